"""An independent scorer of (context, continuation) log-likelihoods, as lm-eval tokenizes.

Tokenization follows lm-eval's ``_encode_pair``: trailing context spaces move to
the continuation, and the continuation's tokens are those of the joint encoding
after the context's.
"""

from __future__ import annotations

import torch


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    head = tokenizer(context, add_special_tokens=False)["input_ids"]
    return head, whole[len(head) :]


@torch.no_grad()
def loglikelihoods(model, tokenizer, pairs: list[tuple[str, str]]) -> list[float]:
    """Sum of the continuation's token log-probabilities, one unpadded forward per pair."""
    scores = []
    for context, continuation in pairs:
        head, tail = _encode_pair(tokenizer, context, continuation)
        ids = torch.tensor([head + tail])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        positions = torch.arange(len(head) - 1, len(head) + len(tail) - 1)
        scores.append(float(logprobs[positions, torch.tensor(tail)].sum()))
    return scores
