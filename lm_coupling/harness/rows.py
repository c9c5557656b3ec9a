"""Row-to-document matching: which rows of lm-eval's forward batch measure which documents.

lm-eval reorders the requests, groups one-token answers after one context
into one row, truncates on the left and pads on the right; `RowIndex` indexes
the wanted requests by the exact model input lm-eval will build
(`lm_eval_adapter.loglikelihood_input`), so that each row of a forward batch
finds its documents by its tokens, whatever lm-eval did to the order.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lm_coupling.harness.lm_eval_adapter import loglikelihood_input
from lm_coupling.harness.plan import GeometryKey

if TYPE_CHECKING:
    import torch

    from lm_coupling.harness.measurements import MeasurementStore
    from lm_coupling.plugins.specs import MetricSpec
    from lm_coupling.states import DocumentGeometry

__all__ = ["RowIndex", "RowPlan", "rows_per_target", "share_untargeted"]


@dataclass(frozen=True)
class RowPlan:
    """One batch row to measure: its key, target position, gold token, context."""

    key: GeometryKey
    last_index: int
    target_token: int
    context_tokens: tuple[int, ...]


class RowIndex:
    """The wanted log-likelihood requests of one scoring call, by model input length and tokens.

    Args:
        rows: ``{len(input): {input tokens: [RowPlan]}}``.
    """

    def __init__(self, rows: dict[int, dict[tuple[int, ...], list[RowPlan]]]):
        self.rows = rows
        self.lengths = sorted(rows)

    def __bool__(self) -> bool:
        return bool(self.rows)

    @classmethod
    def of_requests(cls, lm: Any, requests: list[Any], store: MeasurementStore) -> RowIndex:
        """Index the wanted requests by the exact model input lm-eval will build.

        Requests with the same input (duplicate prompts: the same context, or
        one-token answers after it, which lm-eval runs as one row) keep every
        distinct key: all of them are measured from that one row.
        """
        rows: dict[int, dict[tuple[int, ...], list[RowPlan]]] = defaultdict(dict)
        for cache_key, context_enc, continuation_enc in requests:
            if cache_key is None:  # loglikelihood_rolling windows: no geometry
                continue
            key = (cache_key[0], cache_key[1])
            if key[0] is None or not store.wanted(key):
                continue
            inp, last = loglikelihood_input(lm, context_enc, continuation_enc)
            if last < 0:
                continue
            inp = tuple(inp)
            plan = RowPlan(key, last, continuation_enc[0], inp[: last + 1])
            plans = rows[len(inp)].setdefault(inp, [])
            if all(other.key != key for other in plans):
                plans.append(plan)
        return cls(rows)

    def match(self, inps: torch.Tensor) -> list[tuple[int, list[RowPlan]]]:
        """Find each right-padded row's plans (pads are zeros, as lm-eval pads)."""
        matches = []
        lengths = self.lengths
        for b, row in enumerate(inps.tolist()):
            shortest = len(row)  # the row without its trailing pads (at least 1 token)
            while shortest > 1 and row[shortest - 1] == 0:
                shortest -= 1
            candidates = lengths[bisect_left(lengths, shortest) : bisect_right(lengths, len(row))]
            for length in candidates:
                plans = self.rows[length].get(tuple(row[:length]))
                if plans is not None:
                    matches.append((b, plans))
                    break
        return matches


def rows_per_target(
    matched: list[tuple[int, list[RowPlan]]], batch: int
) -> tuple[list[tuple[int, list[RowPlan]]], list[int]]:
    """One captured row per (batch row, lens target); extra rows are copies of their row.

    A key with another target than its row's first (one-token answers after
    the same context) gets a copy of the row appended to the forward pass.

    Returns:
        ``[(row, plans)]`` and the batch rows copied (the extra rows, in order).
    """
    rows: list[tuple[int, list[RowPlan]]] = []
    copies: list[int] = []
    for b, plans in matched:
        by_target: dict[int, list[RowPlan]] = {}
        for plan in plans:
            by_target.setdefault(plan.target_token, []).append(plan)
        for i, group in enumerate(by_target.values()):
            if i:
                copies.append(b)
            rows.append((b if i == 0 else batch + len(copies) - 1, group))
    return rows, copies


def share_untargeted(
    documents: list[DocumentGeometry],
    at: Mapping[int, int],
    copies: Mapping[int, int],
    specs: Mapping[str, MetricSpec],
) -> None:
    """A copy row takes its original row's values of every metric that reads no target.

    Only the metrics that read the lens target are a copy's own; every other
    value and profile is the original's, to the bit.

    Args:
        documents: the measured rows' geometry, in capture order.
        at: batch row -> its position in ``documents``.
        copies: copy row -> the row it copies.
        specs: the selected metrics' specs.
    """
    targeted = {name for name, spec in specs.items() if spec.reads_target}
    own_profiles = {p for name in targeted for p in specs[name].profiles}
    for row, original in copies.items():
        if row not in at or original not in at:
            continue
        copy, source = documents[at[row]], documents[at[original]]
        copy.values.update({k: v for k, v in source.values.items() if k not in targeted})
        copy.profiles.update({k: v for k, v in source.profiles.items() if k not in own_profiles})
