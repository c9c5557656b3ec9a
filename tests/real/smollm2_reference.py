"""Independent float64 geometry of one prompt on a real Llama model (SmolLM2-135M).

Written from the definitions in docs/design.md ("Metric definitions"), with
forward hooks and autograd, and no lm-coupling code: the block states come
from hooks on ``model.model.layers``; the block Jacobians from a Llama block
re-implemented here from its weights (RMSNorm, rotary attention with grouped
key/value heads, SwiGLU MLP) at the last position, the prefix's keys and
values held fixed, differentiated with ``torch.func.jacrev``. The
re-implementation is checked against the model's own block output first
(`BlockAtLast.check`), so the Jacobian is the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval 0.4.13 HFLM's rule: trailing spaces move to the continuation; split the whole."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n_context = len(tokenizer.encode(context, add_special_tokens=False))
    return whole[:n_context], whole[n_context:]


@dataclass
class Captured:
    """One forward pass: the states ``[L+1, T, d]`` and each block's rotary (cos, sin)."""

    states: torch.Tensor
    rotary: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor


def capture(model, ids: list[int]) -> Captured:
    """x^0 (block 1's input) and x^l (block l's output, before the final norm), by hooks."""
    layers = model.model.layers
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    rotary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(layers):

        def pre(_m, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            inputs[i] = hidden.detach()[0]
            cos, sin = kwargs["position_embeddings"]
            rotary[i] = (cos.detach()[0], sin.detach()[0])

        def post(_m, _args, output, i=i):
            hidden = output[0] if isinstance(output, tuple) else output
            outputs[i] = hidden.detach()[0]

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].detach()
    finally:
        for handle in handles:
            handle.remove()
    states = torch.stack([inputs[0]] + [outputs[i] for i in range(len(layers))])
    return Captured(states, [rotary[i] for i in range(len(layers))], logits)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Llama applies it (halves rotated): x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class BlockAtLast:
    """Block l's output at the last position as a function of its input there (prefix fixed)."""

    def __init__(self, model, layer: int, captured: Captured):
        config = model.config
        block = model.model.layers[layer]
        attn, mlp = block.self_attn, block.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj):
            if module.bias is not None:
                raise AssertionError("this reference implements bias-free Llama blocks only")
        self.w = {
            "q": attn.q_proj.weight, "k": attn.k_proj.weight, "v": attn.v_proj.weight,
            "o": attn.o_proj.weight, "gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight,
            "down": mlp.down_proj.weight, "norm1": block.input_layernorm.weight,
            "norm2": block.post_attention_layernorm.weight,
        }  # fmt: skip
        self.w = {k: v.detach() for k, v in self.w.items()}
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        x = captured.states[layer]  # the block's input, every position
        self.cos, self.sin = captured.rotary[layer]
        self.x_last = x[-1]
        self.expected = captured.states[layer + 1][-1]
        prefix = _rms(x[:-1], self.w["norm1"], self.eps)
        n = x.shape[0] - 1
        k = (prefix @ self.w["k"].T).view(n, self.kv_heads, self.head_dim)
        v = (prefix @ self.w["v"].T).view(n, self.kv_heads, self.head_dim)
        self.k_prefix = _rotate(k, self.cos[:-1, None], self.sin[:-1, None])
        self.v_prefix = v

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Block output at the last position, ``[d] -> [d]``."""
        w, hd = self.w, self.head_dim
        h = _rms(x, w["norm1"], self.eps)
        q = _rotate((w["q"] @ h).view(self.heads, hd), self.cos[-1], self.sin[-1])
        k = _rotate((w["k"] @ h).view(self.kv_heads, hd), self.cos[-1], self.sin[-1])
        v = (w["v"] @ h).view(self.kv_heads, hd)
        keys = torch.cat([self.k_prefix, k[None]], dim=0)  # [n+1, kv, hd]
        values = torch.cat([self.v_prefix, v[None]], dim=0)
        group = self.heads // self.kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [n+1, heads, hd]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q, keys) / math.sqrt(hd)
        mixed = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), values)
        y = x + w["o"] @ mixed.reshape(-1)
        z = _rms(y, w["norm2"], self.eps)
        return y + w["down"] @ (torch.nn.functional.silu(w["gate"] @ z) * (w["up"] @ z))

    def check(self) -> float:
        """Largest relative difference from the model's own block output (hooked)."""
        got = self(self.x_last)
        return float((got - self.expected).abs().max() / self.expected.abs().max())

    def residual_jacobian(self) -> torch.Tensor:
        """``J^l = d(block_l(X)_n - x^{l-1}_n) / d x^{l-1}_n``, ``[d, d]``."""
        jacobian = torch.func.jacrev(self)(self.x_last)
        return jacobian - torch.eye(jacobian.shape[0], dtype=jacobian.dtype)


# -- the metrics, from docs/design.md ------------------------------------------------------------


def trajectory(states: torch.Tensor) -> dict[str, float]:
    """lss, expodistance, equidistance: per token t = 1..n, then the mean over tokens."""
    values: dict[str, list[float]] = {"lss": [], "expodistance": [], "equidistance": []}
    for t in range(1, states.shape[1]):
        x = states[:, t]  # [L+1, d]
        steps = x[1:] - x[:-1]
        lengths = steps.norm(dim=-1)
        nonzero = lengths > 0
        units = steps[nonzero] / lengths[nonzero, None]
        values["lss"].append(float(nonzero.sum() / units.sum(0).norm()))
        norms = x.norm(dim=-1)
        growth = torch.log(norms[1:] / norms[:-1])
        values["expodistance"].append(float(growth.var(unbiased=False) / growth.mean() ** 2))
        values["equidistance"].append(float(lengths.std(unbiased=False) / lengths.mean()))
    return {k: sum(v) / len(v) for k, v in values.items()}


def lens(model, states: torch.Tensor, target: int) -> dict[str, float]:
    """Logit lens at the last position: entropy / ln V, 1 - P(target), fixation depth."""
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(states[:, -1]))  # [L+1, V]
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1) / math.log(logits.shape[-1])
    tv = 1 - p[:, target]
    top = logits.argmax(-1)
    n_layers = states.shape[0] - 1
    depth = n_layers
    while depth > 0 and top[depth - 1] == top[n_layers]:
        depth -= 1
    return {
        "logit_lens_entropy": float(entropy.mean()),
        "tv_to_target": float(tv.mean()),
        "fixation_depth": depth / n_layers,
        "lens_logits_last": logits[-1],
    }


def layer_by_layer(states: torch.Tensor) -> dict[str, float]:
    """Prompt entropy, curvature, effective rank of the tokens 1..n, per state; mean and argmin."""
    entropy, curve, rank = [], [], []
    for z in states[:, 1:]:  # [n, d] at state l
        lam = torch.linalg.eigvalsh(z @ z.T).clamp(min=0)
        lam = torch.where(lam > lam.shape[0] * 2.2e-16 * lam.max(), lam, torch.zeros_like(lam))
        p = lam / lam.sum()
        entropy.append(float(-(p[p > 0] * p[p > 0].log()).sum()))
        v = z[1:] - z[:-1]
        a, b = v[:-1], v[1:]
        keep = (a.norm(dim=-1) > 0) & (b.norm(dim=-1) > 0)
        a, b = a[keep], b[keep]
        # the angle from atan2(|a x b|, a.b): as exact near 0 and pi as anywhere
        cross = torch.sqrt(
            (a.norm(dim=-1) * b.norm(dim=-1)) ** 2 - (a * b).sum(-1) ** 2
        ).nan_to_num()
        curve.append(float(torch.atan2(cross, (a * b).sum(-1)).mean()))
        sigma = torch.linalg.svdvals(z)
        q = sigma / sigma.sum()
        rank.append(float(torch.exp(-(q[q > 0] * q[q > 0].log()).sum())))
    n_layers = states.shape[0] - 1

    def argmin_depth(profile: list[float]) -> float:
        return min(range(len(profile)), key=profile.__getitem__) / n_layers

    return {
        "prompt_entropy": sum(entropy) / len(entropy),
        "prompt_entropy_min_layer": argmin_depth(entropy),
        "curvature": sum(curve) / len(curve),
        "curvature_min_layer": argmin_depth(curve),
        "effective_rank": sum(rank) / len(rank),
    }


def coupling(jacobians: list[torch.Tensor], k: int = 10, alignment_k: int = 30) -> dict[str, float]:
    """Coupling (ICLR 2025 eq. 9, l1, ordered pairs l != l') and the alignment ratio (K = 30)."""
    svds = [torch.linalg.svd(j) for j in jacobians]
    n = len(jacobians)
    scores, ratios = [], []
    for i in range(n):
        for m in range(n):
            if i == m:
                continue
            u, _, vh = svds[m]
            s = svds[i][1]
            a = u[:, :k].T @ jacobians[i] @ vh[:k].T
            scores.append(1 - float((a - torch.diag(s[:k])).norm() / s[:k].abs().sum()))
            b = (u[:, :alignment_k].T @ jacobians[i] @ vh[:alignment_k].T).abs()
            diag = torch.diagonal(b)
            off = (b.sum() - diag.sum()) / (alignment_k * alignment_k - alignment_k)
            ratios.append(float(off / diag.mean()))
    return {"coupling": sum(scores) / len(scores), "alignment_ratio": sum(ratios) / len(ratios)}
