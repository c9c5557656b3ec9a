r"""Quick task accuracy of a causal LM without lm-eval, scored as lm-eval scores it.

Multiple-choice accuracy sums the log-likelihood of each answer continuation
given the zero-shot prompt and takes the argmax, as lm-eval's ``acc``. Prompts
follow the offline task YAMLs (``lm_coupling/tasks``): ARC ``"Question:
{q}\\nAnswer:"`` with continuation ``" {choice}"``, MMLU with the subject
description and letters, HellaSwag's preprocessed query, TruthfulQA MC1 after
its six-shot QA prefix, WinoGrande partial scoring. Tokenization follows
lm-eval's ``_encode_pair``: trailing context spaces move to the continuation,
and the continuation tokens are those of the joint encoding after the context.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers

from lm_coupling.demo.corpus import EVAL_SPLITS, TRUTHFULQA_PREFIX
from lm_coupling.demo.items import (
    Row,
    choice_requests,
    mmlu_header,
    question_prompt,
)


def mc_requests(benchmark: str, row: Row) -> tuple[list[tuple[str, str]], int]:
    """Return the (context, continuation) pair of each choice and the gold index.

    `choice_requests` with the task's zero-shot prefix: the MMLU subject
    description, the TruthfulQA six-shot QA prefix.

    Raises:
        ValueError: ``benchmark`` is not multiple choice.
    """
    pairs, gold = choice_requests(benchmark, row)
    if benchmark == "mmlu":
        prefix = mmlu_header(row["subject"])
    elif benchmark == "truthfulqa":
        prefix = TRUTHFULQA_PREFIX + "\n\n"
    else:
        return pairs, gold
    return [(prefix + context, continuation) for context, continuation in pairs], gold


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    head = tokenizer(context, add_special_tokens=False)["input_ids"]
    return head, whole[len(head) :]


@torch.no_grad()
def loglikelihoods(
    model: transformers.PreTrainedModel, tokenizer, pairs: list[tuple[str, str]]
) -> list[float]:
    """Sum of continuation token log-probabilities for each (context, continuation).

    Computed in float32 (float64 for float64 models) on the model's device, one
    padded batch per call.
    """
    encoded = [_encode_pair(tokenizer, c, x) for c, x in pairs]
    seqs = [head + tail for head, tail in encoded]
    width = max(len(s) for s in seqs) - 1
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq) - 1] = torch.tensor(seq[:-1])
        mask[i, : len(seq) - 1] = 1
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    logprobs = torch.log_softmax(
        logits.to(torch.promote_types(logits.dtype, torch.float32)), -1
    ).cpu()
    scores = []
    for i, (head, tail) in enumerate(encoded):
        positions = torch.arange(len(head) - 1, len(head) - 1 + len(tail))
        scores.append(float(logprobs[i, positions, torch.tensor(tail)].sum()))
    return scores


def mc_accuracy(
    model: transformers.PreTrainedModel, tokenizer, benchmark: str, rows: list[Row]
) -> float:
    """Zero-shot ``acc`` of ``model`` on ``rows`` (argmax of summed log-likelihoods)."""
    if not rows:
        raise ValueError(f"no {benchmark} rows to score; check the tasks folder")
    hits = 0
    for row in rows:
        pairs, gold = mc_requests(benchmark, row)
        scores = loglikelihoods(model, tokenizer, pairs)
        hits += int(max(range(len(scores)), key=scores.__getitem__) == gold)
    return hits / len(rows)


@torch.no_grad()
def gsm8k_exact_match(
    model: transformers.PreTrainedModel, tokenizer, rows: list[Row], max_new_tokens: int = 32
) -> float:
    """Zero-shot greedy strict-match accuracy: the ``#### N`` number of the generation."""
    device = next(model.parameters()).device
    hits = 0
    for row in rows:
        ids = tokenizer(
            question_prompt(row["question"]), return_tensors="pt", add_special_tokens=False
        )["input_ids"].to(device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :]).split("Question:")[0]
        found = re.search(r"#### (\-?[0-9\.\,]+)", text)
        hits += int(bool(found) and found.group(1) == row["answer"].split("#### ")[-1])
    return hits / len(rows)


def read_split(tasks_dir: str | Path, benchmark: str, split: str | None = None) -> list[Row]:
    """Read ``<tasks_dir>/<benchmark>/<split>.jsonl`` (default: its first evaluation split)."""
    path = Path(tasks_dir) / benchmark / f"{split or EVAL_SPLITS[benchmark][0]}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; write the tasks with write_eval_tasks()")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
