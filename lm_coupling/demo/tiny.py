"""Build tiny Hugging Face causal LMs and a locally trained tokenizer, offline.

No weights or data sets can be downloaded on our machines, so tests and the
embedded demo build models from transformers config classes with explicit small
sizes, and a byte-level BPE tokenizer trained here with ``tokenizers``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import transformers

SAMPLE_TEXT = (
    "Question: Which property of a mineral can be determined just by looking at it?\n"
    "Answer: luster\n"
    "The sun is a star. Water boils at one hundred degrees. Plants need light to grow.\n"
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May? 72\n"
    "A man is sitting on a roof. He starts pulling up roofing on a roof.\n"
    "The trophy doesn't fit into the brown suitcase because the suitcase is too small.\n"
)

# Keys are `model_type`; values map our generic size names to each config's own.
_SIZE_KEYS = {
    "gpt2": {
        "d_model": "n_embd",
        "n_layers": "n_layer",
        "n_heads": "n_head",
        "max_len": "n_positions",
        "d_ff": "n_inner",
    },
    "gpt_neox": {
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "max_len": "max_position_embeddings",
        "d_ff": "intermediate_size",
    },
    "opt": {
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "max_len": "max_position_embeddings",
        "d_ff": "ffn_dim",
    },
    "falcon": {
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "max_len": "max_position_embeddings",
    },
}
_LLAMA_LIKE = {
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "max_len": "max_position_embeddings",
    "d_ff": "intermediate_size",
}
ARCHITECTURES = ("gpt2", "llama", "gpt_neox", "mistral", "qwen2", "gemma", "phi", "opt", "falcon")


def train_tokenizer(
    texts: Iterable[str] | None = None, vocab_size: int = 512
) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (default: a built-in sample).

    Byte-level BPE encodes any string, so prompts outside the training text
    still tokenize. The tokenizer has an ``<|endoftext|>`` token used as BOS,
    EOS and padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts) if texts is not None else [SAMPLE_TEXT] * 4, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def tiny_config(
    model_type: str,
    vocab_size: int,
    *,
    d_model: int = 32,
    n_layers: int = 3,
    n_heads: int = 4,
    d_ff: int | None = None,
    max_len: int = 512,
    **overrides,
) -> transformers.PretrainedConfig:
    """Return a small config of ``model_type`` with the given sizes.

    Raises:
        ValueError: ``model_type`` is not one of ``ARCHITECTURES``.
    """
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {model_type!r}; choose from {ARCHITECTURES}")
    keys = _SIZE_KEYS.get(model_type, _LLAMA_LIKE)
    sizes = {
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "max_len": max_len,
        "d_ff": d_ff if d_ff is not None else 4 * d_model,
    }
    kwargs = {keys[k]: v for k, v in sizes.items() if k in keys}
    kwargs["vocab_size"] = vocab_size
    if model_type in ("llama", "mistral", "qwen2", "gemma"):
        kwargs["num_key_value_heads"] = n_heads
        kwargs["head_dim"] = d_model // n_heads
    if model_type == "gemma":
        kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    if model_type == "falcon":
        kwargs.update(new_decoder_architecture=False, multi_query=False, alibi=False)
    if model_type == "opt":
        kwargs["word_embed_proj_dim"] = d_model
    kwargs.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    return config


def build_tiny_model(
    model_type: str,
    vocab_size: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_std: float | None = None,
    **sizes,
) -> transformers.PreTrainedModel:
    """Build a randomly initialised tiny causal LM (seeded, eval mode).

    Args:
        model_type: one of ``ARCHITECTURES``.
        vocab_size: the tokenizer's vocabulary size.
        seed: torch seed for the initialisation.
        dtype: parameter dtype.
        init_std: override of ``initializer_range`` (larger values give
            less trivial geometry in tiny models).
        **sizes: ``d_model``, ``n_layers``, ``n_heads``, ``d_ff``, ``max_len``.
    """
    overrides = {} if init_std is None else {"initializer_range": init_std}
    config = tiny_config(model_type, vocab_size, **sizes, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(dtype).eval()


def save_tiny_model(
    path: str | Path,
    model_type: str = "gpt2",
    tokenizer: transformers.PreTrainedTokenizerFast | None = None,
    **kwargs,
) -> Path:
    """Build a tiny model and save it with its tokenizer to ``path``.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``lm_eval --model hf --model_args pretrained=path``.
    """
    path = Path(path)
    tokenizer = tokenizer if tokenizer is not None else train_tokenizer()
    model = build_tiny_model(model_type, len(tokenizer), **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
