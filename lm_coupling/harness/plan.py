"""Which request of each document carries its geometry, and the gold token.

A document's geometry is measured once, at the last token of one context:
the context of its gold request for multiple choice (for WinoGrande, whose
choices differ in the context, that is the gold option's context), the
prompt for generation. The lens target is the first token of the gold
continuation (multiple choice) or of the gold answer (generation).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

GeometryKey = tuple[str, str]
"""(context string, gold continuation string): identifies one measurement."""


def doc_fingerprint(doc: Any) -> str:
    """Stable hash of a document's content (lm-eval re-creates doc dicts)."""
    text = json.dumps(doc, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class DocumentPlan:
    """Where one document's geometry comes from.

    Attributes:
        task_name: lm-eval task name.
        doc_id: the document's index in the task.
        key: (context, gold continuation) of the measured request.
        kind: ``"loglikelihood"`` or ``"generate_until"``.
        sampled: inside the coupling sample (gets Jacobian metrics).
        max_gen_toks: generation only: the request's token budget (lm-eval
            truncates the prompt to ``max_length - max_gen_toks``); None
            means the model's default.
    """

    task_name: str
    doc_id: int
    key: GeometryKey
    kind: str
    sampled: bool
    max_gen_toks: int | None = None


def _gold_index(task, doc, n_choices: int) -> int:
    """Index of the gold choice, as lm-eval's multiple-choice scoring reads it."""
    try:
        # Tasks whose choices are contexts (WinoGrande): lm-eval's gold is doc_to_text.
        multiple_input = getattr(task, "multiple_input", 0)
        gold = task.doc_to_text(doc) if multiple_input else task.doc_to_target(doc)
    except Exception:  # a task without a target still gets its geometry
        return 0
    if isinstance(gold, list):
        gold = gold[0] if gold else 0
    if isinstance(gold, str):
        try:
            choices = task.doc_to_choice(doc)
            gold = choices.index(gold) if gold in choices else int(gold)
        except (ValueError, TypeError, AttributeError):
            return 0
    return int(gold) if 0 <= int(gold) < n_choices else 0


def _generation_target(task, doc) -> str:
    try:
        target = task.doc_to_target(doc)
    except Exception:
        return ""
    if isinstance(target, list):
        target = target[0] if target else ""
    delimiter = getattr(task.config, "target_delimiter", " ")
    return f"{delimiter}{target}" if str(target) else ""


_MAX_GEN_TOKS_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def _max_gen_toks(instance) -> int | None:
    """The request's generation budget, read like lm-eval's ``normalize_gen_kwargs``."""
    gen_kwargs = instance.args[1] if len(instance.args) > 1 else None
    if not isinstance(gen_kwargs, dict):
        return None
    for name in _MAX_GEN_TOKS_ALIASES:
        if gen_kwargs.get(name) is not None:
            return int(gen_kwargs[name])
    return None


def plan_task(task, coupling_docs: int | None) -> list[DocumentPlan]:
    """Plan the geometry of every document this rank evaluates in ``task``.

    Args:
        task: an lm-eval Task after ``build_all_requests``.
        coupling_docs: the first N documents (by doc_id) get Jacobian metrics;
            None means all.
    """
    by_doc: dict[int, list] = defaultdict(list)
    for instance in task.instances:
        by_doc[instance.doc_id].append(instance)
    plans = []
    for doc_id, instances in sorted(by_doc.items()):
        instances.sort(key=lambda inst: inst.idx)
        first = instances[0]
        sampled = coupling_docs is None or doc_id < coupling_docs
        if first.request_type == "generate_until":
            key = (first.args[0], _generation_target(task, first.doc))
            plans.append(
                DocumentPlan(
                    task.config.task, doc_id, key, "generate_until", sampled, _max_gen_toks(first)
                )
            )
        elif first.request_type == "loglikelihood":
            gold = instances[_gold_index(task, first.doc, len(instances))]
            key = (gold.args[0], gold.args[1])
            plans.append(DocumentPlan(task.config.task, doc_id, key, "loglikelihood", sampled))
    return plans
