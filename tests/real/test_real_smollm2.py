"""SmolLM2-135M as the yardstick: accuracy untouched, every value equal to an independent one.

- The benchmark's accuracy with ``--metrics`` (every per-document metric and
  coupling) is lm-eval's own, document by document, on real ARC-Easy and
  WinoGrande items.
- Every per-document trajectory, lens and Layer by Layer value, and coupling
  and the alignment ratio on the two sampled documents (one per task), equal a
  float64 computation written in `smollm2_reference` from docs/design.md
  (hooks and autograd) within 1e-4 relative.
- The GGUF route and the float folder converted from it give the same values.
"""

from __future__ import annotations

import math

import pytest
import torch
from smollm2_reference import (
    BlockAtLast,
    capture,
    coupling,
    encode_pair,
    layer_by_layer,
    lens,
    trajectory,
)
from smollm2_runs import PER_DOCUMENT, REFERENCED, TASKS, evaluate_values

RTOL = 1e-4
ATOL = 1e-6  # values that are 0 or near it (fixation depth 0, coupling near 0)


def _by_doc(samples: list[dict]) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for row in samples:
        rows.setdefault(row["doc_id"], row)
    return rows


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= ATOL + RTOL * abs(want)


@pytest.mark.parametrize("task", TASKS)
def test_accuracy_is_lm_evals_own(geometry_run, plain_run, task):
    """acc (and acc_norm) per document and per task equal the plain lm_eval run's."""
    with_metrics = _by_doc(geometry_run["samples"][task])
    plain = _by_doc(plain_run["samples"][task])
    assert sorted(with_metrics) == sorted(plain) and len(plain) >= 5
    for key in ("acc", "acc_norm"):
        if key not in plain[0]:
            continue
        assert [with_metrics[d][key] for d in sorted(plain)] == [
            plain[d][key] for d in sorted(plain)
        ]
        assert (
            geometry_run["results"][task][f"{key},none"]
            == plain_run["results"][task][f"{key},none"]
        )
    assert all(math.isfinite(with_metrics[d]["lss"]) for d in with_metrics)  # geometry was measured


def _prompt(tokenizer, row: dict) -> tuple[list[int], int]:
    """The measured prompt (context tokens) and the gold continuation's first token.

    The gold choice's request (WinoGrande, whose options differ in the context: the
    gold option's, docs/design.md "Conventions").
    """
    doc = row["doc"]
    gold = int(doc["answer"]) - 1 if "option1" in doc else int(row["target"])
    context, continuation = encode_pair(tokenizer, *row["arguments"][gold])
    return context, continuation[0]


@pytest.fixture(scope="module")
def references(geometry_run, reference_model) -> dict[tuple[str, int], dict]:
    """The independent float64 values of every document (coupling where sampled)."""
    model, tokenizer = reference_model
    values = {}
    for task, doc_id, row in _documents(geometry_run):
        ids, target = _prompt(tokenizer, row)
        captured = capture(model, ids)
        states = captured.states
        ref = {**trajectory(states), **layer_by_layer(states)}
        lens_values = lens(model, states, target)
        # the lens at x^L is the model's own output (the read-out is the model's function)
        torch.testing.assert_close(
            lens_values.pop("lens_logits_last"), captured.logits[-1], rtol=1e-9, atol=1e-9
        )
        ref.update(lens_values)
        if math.isfinite(row.get("coupling", math.nan)):
            blocks = [BlockAtLast(model, layer, captured) for layer in range(len(states) - 1)]
            # the model's own blocks (its RMSNorm computes in float32, even in a float64 model)
            assert max(block.check() for block in blocks) < 1e-6
            ref.update(coupling([block.residual_jacobian() for block in blocks]))
        values[(task, doc_id)] = ref
    return values


def _documents(run: dict):
    for task in TASKS:
        for doc_id, row in _by_doc(run["samples"][task]).items():
            yield task, doc_id, row


def test_every_value_equals_the_independent_float64_one(geometry_run, references):
    """Trajectory, lens and Layer by Layer on every document; coupling on the sampled two."""
    rows = {(task, doc_id): row for task, doc_id, row in _documents(geometry_run)}
    worst: dict[str, float] = {}
    failures = []
    for key, ref in references.items():
        for metric in REFERENCED:
            if metric not in ref:
                continue
            got, want = float(rows[key][metric]), ref[metric]
            worst[metric] = max(worst.get(metric, 0.0), abs(got - want) / max(abs(want), 1e-12))
            if not _close(got, want):
                failures.append(f"{key} {metric}: run {got!r}, float64 {want!r}")
    assert not failures, "\n".join(failures)
    sampled = [key for key, ref in references.items() if "coupling" in ref]
    assert len(sampled) >= 2, f"coupling was measured on {sampled}"
    assert set(worst) == set(REFERENCED)
    print("worst relative difference per metric:", worst)


def test_gguf_route_and_float_folder_agree(geometry_run, float_folder, real_items):
    """The float folder saved from the dequantized GGUF gives the GGUF route's values.

    Every per-document metric and the accuracy; coupling (a minute per document on
    a CI core) is left to the independent check above.
    """
    per_document = ",".join(PER_DOCUMENT)
    converted = evaluate_values({"pretrained": str(float_folder)}, real_items[0], per_document)
    for task in TASKS:
        gguf, folder = _by_doc(geometry_run["samples"][task]), _by_doc(converted["samples"][task])
        assert sorted(gguf) == sorted(folder)
        for doc_id, row in gguf.items():
            for metric in ("acc", *PER_DOCUMENT):
                a, b = row.get(metric, math.nan), folder[doc_id].get(metric, math.nan)
                if isinstance(a, float) and math.isnan(a):
                    assert math.isnan(b), (task, doc_id, metric)
                    continue
                assert _close(float(b), float(a)), (task, doc_id, metric, a, b)
