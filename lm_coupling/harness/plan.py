"""Which request of each document carries its geometry, and the gold token.

A document is identified one way: ``(task name, doc_id)``, as lm-eval's
`Instance` carries them. Its geometry is measured once, at the last token of
one context: the context of its gold request for multiple choice (for
WinoGrande, whose choices differ in the context, that is the gold option's
context), the prompt for generation. The lens target is the first token of
the gold continuation (multiple choice) or of the gold answer (generation).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

GeometryKey = tuple[str, str]
"""(context string, gold continuation string): identifies one measurement."""

DocumentId = tuple[str, int]
"""(task name, doc_id): identifies one document of a run."""


class PlanError(ValueError):
    """A document's measured request cannot be chosen (its gold is unreadable)."""


@dataclass(frozen=True, slots=True)
class DocumentPlan:
    """Where one document's geometry comes from (one per evaluated document, slotted).

    Attributes:
        task_name: lm-eval task name.
        doc_id: the document's index in the task (lm-eval's ``doc_id``).
        key: (context, gold continuation) of the measured request.
        kind: ``"loglikelihood"`` or ``"generate_until"``.
        sampled_metrics: the sampled (Jacobian) metrics whose document sample
            holds this document.
        max_gen_toks: generation only: the request's token budget (lm-eval
            truncates the prompt to ``max_length - max_gen_toks``); None
            means the model's default.
        problem: why the document cannot be measured (its geometry is then
            NaN, with one warning); None when it can.
        target_problem: why the lens has no target token (``tv_to_target``
            is then NaN, and the warning says this); None when it has one.
    """

    task_name: str
    doc_id: int
    key: GeometryKey
    kind: str
    sampled_metrics: frozenset[str] = frozenset()
    max_gen_toks: int | None = None
    problem: str | None = None
    target_problem: str | None = None

    @property
    def sampled(self) -> bool:
        """Whether any sampled metric is computed on this document."""
        return bool(self.sampled_metrics)


def gold_index(task: Any, doc: dict, n_choices: int) -> int:
    """Index of the gold choice, as lm-eval's multiple-choice scoring reads it.

    Raises:
        PlanError: the task gives no readable gold index in ``[0, n_choices)``.
    """
    try:
        # Tasks whose choices are contexts (WinoGrande): lm-eval's gold is doc_to_text.
        multiple_input = getattr(task, "multiple_input", 0)
        gold = task.doc_to_text(doc) if multiple_input else task.doc_to_target(doc)
        if isinstance(gold, list):
            gold = gold[0]
        if isinstance(gold, str):
            choices = task.doc_to_choice(doc)
            gold = choices.index(gold) if gold in choices else int(gold)
        index = int(gold)
    except Exception as exc:  # any task code: report it, never guess
        raise PlanError(f"its gold answer could not be read ({exc!r})") from None
    if not 0 <= index < n_choices:
        raise PlanError(f"its gold index {index} is outside the {n_choices} choices")
    return index


def _generation_target(task: Any, doc: dict) -> tuple[str, str | None]:
    """The gold continuation of a generation document, and why it is missing (if it is)."""
    try:
        target = task.doc_to_target(doc)
    except Exception as exc:  # any task code: the lens target is then absent, and said why
        return "", f"the task's doc_to_target failed ({exc!r}), so the lens has no target"
    if isinstance(target, list):
        target = target[0] if target else ""
    if not str(target):
        return "", "the task's gold answer is empty, so the lens has no target"
    delimiter = getattr(task.config, "target_delimiter", " ")
    return f"{delimiter}{target}", None


_MAX_GEN_TOKS_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def _max_gen_toks(instance: Any) -> int | None:
    """The request's generation budget, read like lm-eval's ``normalize_gen_kwargs``."""
    gen_kwargs = instance.args[1] if len(instance.args) > 1 else None
    if not isinstance(gen_kwargs, dict):
        return None
    for name in _MAX_GEN_TOKS_ALIASES:
        if gen_kwargs.get(name) is not None:
            return int(gen_kwargs[name])
    return None


def plan_document(
    task: Any,
    task_name: str,
    doc_id: int,
    instances: Iterable[Any],
    sampled: frozenset[str] = frozenset(),
) -> DocumentPlan | None:
    """Plan one document from its lm-eval `Instance`s.

    Args:
        task: the lm-eval Task (gold index, target, delimiter).
        task_name: its name.
        doc_id: the document's ``doc_id``.
        instances: the document's requests (any order; repeats allowed).
        sampled: the sampled metrics whose document sample holds this
            document (`lm_coupling.harness.sample`).

    Returns:
        The plan, or None for a ``loglikelihood_rolling`` document (no
        geometry is measured for rolling log-likelihood).
    """
    by_idx = {inst.idx: inst for inst in instances}
    ordered = [by_idx[i] for i in sorted(by_idx)]
    first = ordered[0]
    if first.request_type == "generate_until":
        target, target_problem = _generation_target(task, first.doc)
        return DocumentPlan(
            task_name,
            doc_id,
            (first.args[0], target),
            "generate_until",
            sampled,
            _max_gen_toks(first),
            target_problem=target_problem,
        )
    if first.request_type == "loglikelihood_rolling":
        return None
    try:
        gold = ordered[gold_index(task, first.doc, len(ordered))]
    except PlanError as exc:
        key = (first.args[0], "")
        return DocumentPlan(task_name, doc_id, key, "loglikelihood", problem=str(exc))
    return DocumentPlan(task_name, doc_id, (gold.args[0], gold.args[1]), "loglikelihood", sampled)
