"""What lm-coupling does with each option of lm-eval 0.4.13's ``run`` command.

`RUN_OPTIONS` (command-line flags) and `MODEL_ARGS` (keys of
``--model_args`` for the ``hf`` model) are one table: for every option, its
outcome with ``--metrics`` and what lm-coupling does with it. The page
``docs/options.md`` is generated from it (`options_page`).

Outcomes:

- ``works``: geometry is measured inside lm-eval's own batches and equals an
  independent measurement of the exact prompt lm-eval scored
  (``tests/harness/test_lm_eval_options.py``).
- ``passed on``: lm-eval's behaviour is unchanged and the geometry does not
  depend on the option (or it depends on hardware the tests do not have).
- ``refused``: `check_run_options` raises `ConfigurationError` before the
  model loads, saying why and what to do instead (some only under a
  condition, e.g. quantized loading without a GPU).
- ``rejected by lm-eval``: lm-eval itself refuses the option or combination;
  lm-coupling does not work around it.

`check_run_options` applies the table to a parsed ``run`` namespace and
returns what the results JSON records under
``config.lm_coupling.lm_eval_options``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_coupling.errors import ConfigurationError, ModelNotFoundError

HF_MODEL_NAMES = ("hf", "hf-auto", "huggingface", "hf-coupling")
"""lm-eval's names of its Hugging Face model (``--model``), which geometry needs."""

WORKS = "works"
PASSED_ON = "passed on"
REFUSED = "refused"
REJECTED = "rejected by lm-eval"
OUTCOMES = (WORKS, PASSED_ON, REFUSED, REJECTED)


@dataclass(frozen=True)
class RunOption:
    """One option of ``lm_eval run`` and what lm-coupling does with it.

    Attributes:
        name: the flag (``--num_fewshot``) or the ``--model_args`` key
            (``peft``).
        outcome: one of `OUTCOMES`.
        what: what lm-coupling does with the option (one sentence or two).
        instead: for a refusal, what to do instead.
        why: for a conditional refusal, its reason (default: ``what``).
        refuse_if: for a conditional refusal, the name of its condition in
            `_CONDITIONS` (``""``: an unconditional refusal, or none).
        record: whether ``config.lm_coupling.lm_eval_options`` records the
            value when the option is set.
        checked_by: the test that shows the outcome (``""``: none).
    """

    name: str
    outcome: str
    what: str
    instead: str = ""
    why: str = ""
    refuse_if: str = ""
    record: bool = True
    checked_by: str = ""

    @property
    def dest(self) -> str:
        """The argparse destination (``--num_fewshot`` -> ``num_fewshot``)."""
        return self.name.lstrip("-")


_TEST = "tests/harness/test_lm_eval_options.py::"

# fmt: off
RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption(
        "--model", WORKS,
        "`hf`, `hf-auto` and `huggingface` are replaced by lm-coupling's `hf-coupling` (lm-eval's "
        "`hf` model with capture); `config.model` keeps the name typed. Any other model type is "
        "refused.",
        why="geometry needs the hidden states of a Hugging Face causal LM in this process.",
        instead="run the model with `--model hf` (a vLLM, API or GGUF server model cannot be "
        "hooked)",
        refuse_if="not_hf_model", record=False, checked_by=_TEST + "test_hf_auto_and_dtype",
    ),
    RunOption(
        "--model_args", WORKS,
        "Passed to the `hf` model; its keys are in the `--model_args` table below.",
        record=False, checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--tasks", WORKS,
        "Every leaf task gets geometry, one geometry file per leaf task (a group of groups such "
        "as `lmc_openllm_v1_offline`, and each MMLU subject).",
        record=False, checked_by=_TEST + "test_group_of_groups_one_file_per_subtask",
    ),
    RunOption(
        "--config", WORKS,
        "The YAML's options are checked like the same flags on the command line (command line "
        "first).",
        checked_by=_TEST + "test_options_from_a_config_file_are_checked",
    ),
    RunOption(
        "--apply_chat_template", WORKS,
        "Geometry of the templated prompt lm-eval scores (the tokenizer's chat template, or the "
        "named one).",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--fewshot_as_multiturn", WORKS,
        "Geometry of the multi-turn prompt lm-eval builds. lm-eval rejects it without "
        "`--apply_chat_template`.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--system_instruction", WORKS,
        "Geometry of the prompt with the instruction, as lm-eval scores it.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--limit", WORKS,
        "Geometry of the documents lm-eval evaluates; a fraction (`0.4`) as well as a count. "
        "lm-eval rejects it together with `--samples`.",
        checked_by=_TEST + "test_hf_auto_and_dtype",
    ),
    RunOption(
        "--samples", WORKS,
        "Geometry of exactly the listed documents; a sampled metric's sample (`coupling_docs`) is "
        "drawn from them (seeded, `docs/metrics.md`).",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--use_cache", WORKS,
        "A geometry cache beside lm-eval's response cache: documents lm-eval answers from its "
        "cache are read from it (`capture.cached`).",
        checked_by="tests/harness/test_harness_cache.py",
    ),
    RunOption(
        "--cache_requests", WORKS,
        "lm-eval's cached requests are planned like fresh ones.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--num_fewshot", WORKS,
        "Geometry of the few-shot prompt lm-eval scores.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--batch_size", WORKS,
        "An integer, `auto` or `auto:N`: geometry is captured in whatever batches lm-eval forms "
        "(lm-eval's batch-size probe is not measured).",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--max_batch_size", WORKS,
        "Caps lm-eval's `auto` batch size, as without --metrics.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--device", WORKS,
        "The model's device; geometry is computed there, in float32.",
        record=False, checked_by="tests/harness/test_harness_runs.py",
    ),
    RunOption(
        "--gen_kwargs", WORKS,
        "Generation tasks: geometry of the prompt at the prefill (its truncation follows "
        "`max_gen_toks`); the generated tokens are not part of it.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--output_path", WORKS,
        "A folder, or a `.json` file name: geometry files go beside lm-eval's results file. "
        "Default `results`. `lm-coupling report` and the leaderboard refresh read "
        "`results_*.json` files, so a run saved under another file name is not in them (the "
        "refresh warns).",
        record=False, checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--log_samples", WORKS,
        "Each document's geometry values are in its samples JSONL row.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--predict_only", REFUSED,
        "lm-eval replaces every metric by `bypass` and never scores a document, so geometry would "
        "be measured and then dropped.",
        instead="drop --predict_only; --log_samples keeps the predictions beside the scores and "
        "the geometry",
        refuse_if="set",
        checked_by=_TEST + "test_refused_option_stops_lm_eval_before_the_model_loads",
    ),
    RunOption(
        "--check_integrity", PASSED_ON,
        "Runs the tasks' own test suites; no effect on geometry.",
    ),
    RunOption(
        "--include_path", WORKS,
        "Merged with lm-coupling's task folder (both are searched).",
        checked_by="tests/sweep/test_sweep_options.py",
    ),
    RunOption(
        "--verbosity", PASSED_ON,
        "lm-eval's log level (deprecated by lm-eval).",
        record=False,
    ),
    RunOption(
        "--write_out", WORKS,
        "lm-eval prints the first prompts; geometry unchanged.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--show_config", WORKS,
        "lm-eval prints the results, `config.lm_coupling` included.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--wandb_args", WORKS,
        "Geometry values are logged to the W&B run like `acc` (offline mode included).",
        checked_by=_TEST + "test_geometry_is_logged_to_wandb_offline",
    ),
    RunOption(
        "--wandb_config_args", PASSED_ON,
        "Passed to W&B's run config.",
    ),
    RunOption(
        "--trackio_args", PASSED_ON,
        "Geometry values are in the results lm-eval hands Trackio (not tested: Trackio is not a "
        "test dependency).",
    ),
    RunOption(
        "--hf_hub_log_args", PASSED_ON,
        "lm-eval pushes its results (geometry means included) and samples; the geometry files "
        "(profiles, matrices) are not pushed.",
    ),
    RunOption(
        "--seed", WORKS,
        "lm-eval's seeds (few-shot sampling included); geometry follows the prompts they give. "
        "The sampled metrics' samples do not depend on it.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "--trust_remote_code", WORKS,
        "Passed to the model; a remote-code model is supported where its blocks can be located "
        "(`lm-coupling` overrides otherwise).",
        checked_by=_TEST + "test_hf_auto_and_dtype",
    ),
    RunOption(
        "--confirm_run_unsafe_code", PASSED_ON,
        "Needed by code-execution tasks.",
    ),
    RunOption(
        "--metadata", WORKS,
        "Passed to the tasks (lm-coupling's offline tasks read `lmc_data_dir`).",
        checked_by=_TEST + "test_hf_auto_and_dtype",
    ),
    RunOption(
        "--bootstrap_iters", REJECTED,
        "Not a flag of lm-eval 0.4.13's `run` command (argparse refuses it); "
        "`lm_eval.simple_evaluate(bootstrap_iters=0)` takes it from Python.",
        record=False, checked_by=_TEST + "test_lm_eval_rejections",
    ),
)

MODEL_ARGS: tuple[RunOption, ...] = (
    RunOption(
        "pretrained", WORKS,
        "The model (hub name or local folder).",
        record=False, checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "peft", WORKS,
        "The adapter (e.g. LoRA) is applied by lm-eval; geometry is that of the adapted model, "
        "equal to the merged model's.",
        checked_by=_TEST + "test_adapter_chat_template_and_samples",
    ),
    RunOption(
        "delta", WORKS,
        "Geometry of the base plus delta weights lm-eval builds.",
        checked_by=_TEST + "test_delta_float16",
    ),
    RunOption(
        "dtype", WORKS,
        "The model runs in that dtype; geometry is computed from its states in float32 (bfloat16 "
        "and float16 agree with a same-dtype measurement of the prompt alone within the tolerance "
        "in docs/options.md).",
        checked_by=_TEST + "test_hf_auto_and_dtype",
    ),
    RunOption(
        "revision", WORKS,
        "Recorded as the model's revision in the geometry file.",
        checked_by=_TEST + "test_hf_auto_and_dtype",
    ),
    RunOption(
        "trust_remote_code", WORKS,
        "As `--trust_remote_code`.",
        checked_by=_TEST + "test_hf_auto_and_dtype",
    ),
    RunOption(
        "backend", REFUSED,
        "`backend=seq2seq` (encoder-decoder): the geometry is defined for decoder-only causal "
        "LMs.",
        instead="use a decoder-only model with the default backend",
        refuse_if="seq2seq_backend", checked_by=_TEST + "test_refusals_before_the_model_loads",
    ),
    RunOption(
        "load_in_4bit", REFUSED,
        "bitsandbytes quantization: refused on a machine without CUDA (bitsandbytes loads on "
        "GPUs); on a GPU geometry is measured from the dequantized states.",
        instead="run on a CUDA machine, or drop the quantization on CPU",
        refuse_if="quantized_without_gpu", checked_by=_TEST + "test_quantized_loading_on_gpu",
    ),
    RunOption(
        "quantization_config", REFUSED,
        "A quantized checkpoint (GPTQ, AWQ: `quantization_config` in its config.json, or this "
        "key): refused on a machine without CUDA, whose kernels these formats need.",
        instead="run on a CUDA machine, or evaluate the unquantized checkpoint",
        refuse_if="quantized_checkpoint_without_gpu",
        checked_by=_TEST + "test_refusals_before_the_model_loads",
    ),
    RunOption(
        "load_in_8bit", REFUSED,
        "As `load_in_4bit`.",
        instead="run on a CUDA machine, or drop the quantization on CPU",
        refuse_if="quantized_without_gpu",
        checked_by=_TEST + "test_refusals_before_the_model_loads",
    ),
    RunOption(
        "autogptq", REFUSED,
        "GPTQ kernels need a GPU: refused without CUDA.",
        instead="run on a CUDA machine",
        refuse_if="quantized_without_gpu",
        checked_by=_TEST + "test_refusals_before_the_model_loads",
    ),
    RunOption(
        "gptqmodel", REFUSED,
        "GPTQ (and AWQ through GPTQModel) needs a GPU: refused without CUDA.",
        instead="run on a CUDA machine",
        refuse_if="quantized_without_gpu",
        checked_by=_TEST + "test_refusals_before_the_model_loads",
    ),
    RunOption(
        "peft+delta", REJECTED,
        "lm-eval refuses an adapter and delta weights together (after loading the model); "
        "lm-coupling refuses the pair before.",
        instead="apply one of them",
        refuse_if="peft_and_delta", checked_by=_TEST + "test_refusals_before_the_model_loads",
    ),
    RunOption(
        "tp_plan", REFUSED,
        "Tensor parallelism splits each block's weights across processes; geometry capture is not "
        "verified there.",
        instead="use parallelize=True (whole blocks per GPU) or data parallelism (accelerate "
        "launch)",
        refuse_if="set", checked_by=_TEST + "test_refusals_before_the_model_loads",
    ),
    RunOption(
        "parallelize", PASSED_ON,
        "Blocks on several GPUs: hooks and the Jacobian engine work on each block's own device "
        "(needs several GPUs; not in these tests).",
    ),
    RunOption(
        "gguf_file", WORKS,
        "transformers dequantizes a GGUF file into a float torch model, whose geometry is "
        "measured; the file is checked before the model loads (the gguf package, "
        "`lm-coupling[gguf]`; a GGUF file; every tensor type dequantizable) and the results file "
        "the model under the file and its quantisation (`dtype` `gguf:Q4_1`).",
        checked_by="tests/real/test_real_smollm2.py",
    ),
    RunOption(
        "max_length", WORKS,
        "lm-eval's truncation; geometry follows it.",
        checked_by="tests/harness/test_harness_runs.py",
    ),
)
# fmt: on

OPTIONS_BY_NAME: dict[str, RunOption] = {o.dest: o for o in RUN_OPTIONS}
MODEL_ARGS_BY_NAME: dict[str, RunOption] = {o.name: o for o in MODEL_ARGS}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _set(option: RunOption, options: Mapping[str, Any], model_args: Mapping[str, Any]) -> bool:
    """Whether the option is given (a flag, or a ``--model_args`` key)."""
    if option.name.startswith("--"):
        return option.dest in options
    return _is_set(model_args.get(option.name))


def _without_gpu(options: Mapping[str, Any]) -> bool:
    return str(options.get("device") or "").startswith("cpu") or not _cuda_available()


def _checkpoint_quantization(model_args: Mapping[str, Any]) -> Any:
    """``quantization_config`` of a local checkpoint's config.json (GPTQ, AWQ), if any."""
    from pathlib import Path

    config = Path(str(model_args.get("pretrained", ""))) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError):
        return None


Condition = Callable[[RunOption, Mapping[str, Any], Mapping[str, Any]], bool]
_CONDITIONS: dict[str, Condition] = {
    "set": _set,
    "not_hf_model": lambda option, options, model_args: (
        _set(option, options, model_args) and options["model"] not in HF_MODEL_NAMES
    ),
    "seq2seq_backend": lambda option, options, model_args: model_args.get("backend") == "seq2seq",
    "quantized_without_gpu": lambda option, options, model_args: (
        _set(option, options, model_args) and _without_gpu(options)
    ),
    "quantized_checkpoint_without_gpu": lambda option, options, model_args: (
        bool(model_args.get("quantization_config") or _checkpoint_quantization(model_args))
        and _without_gpu(options)
    ),
    "peft_and_delta": lambda option, options, model_args: bool(
        model_args.get("peft") and model_args.get("delta")
    ),
}


def _is_set(value: Any) -> bool:
    """lm-eval's rule for a command-line value that overrides the defaults."""
    return bool(value) or value == 0 and value is not False


def _option_values(args: Any) -> dict[str, Any]:
    """The options of a parsed ``run`` namespace or of an ``EvaluatorConfig``, by name."""
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if dataclasses.is_dataclass(args):
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return dict(args)


def effective_options(args: Any) -> dict[str, Any]:
    """The options the run will use: the ``--config`` YAML, then the command line.

    The same precedence as lm-eval's ``EvaluatorConfig.from_cli`` (set values
    only; ``model_args`` parsed into a dict).

    Args:
        args: lm-eval's parsed ``run`` namespace, or its ``EvaluatorConfig``
            (read as it is).
    """
    options: dict[str, Any] = {}
    values = _option_values(args)
    config_path = values.get("config")
    if config_path:
        from lm_eval.config.evaluate_config import EvaluatorConfig

        try:
            options.update(EvaluatorConfig.load_yaml_config(config_path))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"--config {config_path}: cannot read it ({exc}); give a YAML file of "
                "lm_eval run options"
            ) from exc
    skip = {"command", "func", "metrics", "metric_args"}
    options.update({k: v for k, v in values.items() if k not in skip and _is_set(v)})
    options["model_args"] = _model_args_dict(options.get("model_args"))
    return options


def _model_args_dict(model_args: Any) -> dict[str, Any]:
    if not model_args:
        return {}
    if isinstance(model_args, Mapping):
        return dict(model_args)
    from lm_eval.utils import simple_parse_args_string

    return dict(simple_parse_args_string(str(model_args)))


def _refusal(option: RunOption, shown: str) -> ConfigurationError:
    return ConfigurationError(
        f"{shown} cannot be combined with --metrics: {option.why or option.what} "
        f"Instead: {option.instead}."
    )


def check_run_options(args: Any) -> dict[str, Any]:
    """Refuse the options geometry cannot honour; return those to record.

    Call it after the geometry flags are parsed and before any model loads.

    Args:
        args: lm-eval's parsed ``run`` namespace or its ``EvaluatorConfig``
            (``--config`` YAML read too).

    Returns:
        The options used, JSON-safe, for ``config.lm_coupling.lm_eval_options``:
        each set flag with ``record`` in `RUN_OPTIONS` under its name, and each
        recorded ``--model_args`` key (``peft``, ``dtype``, ...) at top level.

    Raises:
        ConfigurationError: a refused option (the message says why and what to
            do instead).
    """
    options = effective_options(args)
    model_args = options["model_args"]
    for option in (*RUN_OPTIONS, *MODEL_ARGS):
        if option.refuse_if and _CONDITIONS[option.refuse_if](option, options, model_args):
            keys = option.name.split("+")
            value = options.get(option.dest)
            shown = (
                option.name + ("" if value is True else f" {value}")
                if option.name.startswith("--")
                else "--model_args " + " and ".join(f"{k}={model_args.get(k)}" for k in keys)
            )
            raise _refusal(option, shown)
    _warn_unlisted(options)
    return _recorded(options, model_args)


def _warn_unlisted(options: Mapping[str, Any]) -> None:
    """Options the table does not know (a newer lm-eval) are passed on, with a warning."""
    known = set(OPTIONS_BY_NAME) | {"config", "tasks", "model_args"}
    unknown = sorted(set(options) - known)
    if unknown:
        warnings.warn(
            f"lm-coupling: lm_eval run option(s) {', '.join(unknown)} are not in lm-coupling's "
            "table of lm-eval 0.4.13 options; they are passed on unchecked",
            UserWarning,
            stacklevel=3,
        )


def _recorded(options: Mapping[str, Any], model_args: Mapping[str, Any]) -> dict[str, Any]:
    if "samples" in options:
        options = {**options, "samples": _samples_mapping(options["samples"])}
    recorded = {
        option.dest: _jsonable(options[option.dest])
        for option in RUN_OPTIONS
        if option.record and option.dest in options
    }
    recorded.update(
        {
            option.name: _jsonable(model_args[option.name])
            for option in MODEL_ARGS
            if option.record and option.name in model_args
        }
    )
    return recorded


def _samples_mapping(samples: Any) -> Any:
    """``--samples`` as the mapping lm-eval uses (JSON text or a JSON file's path)."""
    if not isinstance(samples, str):
        return samples
    from pathlib import Path

    try:
        return json.loads(samples)
    except ValueError:
        path = Path(samples)
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else samples


_SECRET_KEYS = ("token", "api_key", "password", "secret")


def _jsonable(value: Any) -> Any:
    """A JSON-safe copy; values of secret-looking keys (``token=``) are redacted."""
    if isinstance(value, Mapping):
        return {
            str(k): "<redacted>" if any(w in str(k).lower() for w in _SECRET_KEYS) else _jsonable(v)
            for k, v in value.items()
        }
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value


def options_page() -> str:
    """``docs/options.md``: the table as Markdown (a test keeps the page up to date)."""
    lines = [
        "# lm-eval options with --metrics",
        "",
        "<!-- Generated from lm_coupling/harness/run_options.py by",
        "     tests/harness/test_lm_eval_options.py (LMC_WRITE_DOCS=1 rewrites it). -->",
        "",
        "What lm-coupling does with each option of lm-eval 0.4.13's `run` command when",
        "`--metrics` is given. *works*: the run exits 0, every document's geometry is",
        "captured inside lm-eval's own batches (`alone == 0` in the geometry file's",
        "`capture`) and equals an independent measurement of the exact prompt lm-eval",
        "scored; *passed on*: lm-eval's behaviour is unchanged and the geometry does not",
        "depend on it; *refused*: the run stops before the model loads, saying why and",
        "what to do instead; *rejected by lm-eval*: lm-eval itself refuses it. The",
        "options used are recorded in the results JSON under",
        "`config.lm_coupling.lm_eval_options`.",
        "",
        "`lm-coupling sweep` passes every option below on to each model's run (a user's",
        "`--include_path` too) and checks them once, before the first model runs; the",
        "options it sets per model (`--model`, `pretrained=` in `--model_args`, and the",
        "short flags `-M`, `-a`, `-o`, `-t`) are refused there with the reason.",
        "",
        "Tolerance of reduced precision (tiny test models, CPU): with `dtype=bfloat16`",
        "or `dtype=float16`, values match a same-dtype measurement of the prompt alone",
        f"to a relative {DTYPE_RTOL:g} (absolute {DTYPE_ATOL:g}): batching and padding",
        "change the rounding of half-precision states. Measured on the tests' tiny models",
        "(CPU, torch 2.13): at most 1.2e-6 relative in bfloat16 (batch 4) and 7.4e-5 in",
        "float16 (batch 2, `logit_lens_entropy`). Float32 runs agree to 1e-4 absolute.",
        "",
    ]
    for title, table in (("`lm_eval run` flags", RUN_OPTIONS), ("`--model_args` keys", MODEL_ARGS)):
        lines += [f"## {title}", "", "| option | outcome | what lm-coupling does | checked by |"]
        lines += ["|---|---|---|---|"]
        for option in table:
            what = option.what + (f" Instead: {option.instead}." if option.instead else "")
            checked = f"`{option.checked_by}`" if option.checked_by else "-"
            lines.append(f"| `{option.name}` | {option.outcome} | {what} | {checked} |")
        lines.append("")
    return "\n".join(lines)


# Tolerance of half-precision geometry against a same-dtype measurement alone.
DTYPE_RTOL = 1e-3
DTYPE_ATOL = 1e-4


def check_model_type(model_type: str) -> None:
    """Geometry needs lm-eval's Hugging Face model.

    Raises:
        ConfigurationError: any other ``--model``.
    """
    if model_type not in HF_MODEL_NAMES:
        raise ConfigurationError(
            f"--metrics needs a Hugging Face model: --model {model_type!r} is not supported. "
            f"Use one of: {', '.join(n for n in HF_MODEL_NAMES if n != 'hf-coupling')}"
        )


def check_model_path(pretrained: Any) -> None:
    """Fail at once on a model that cannot be found, before lm-eval indexes its tasks.

    A name that looks like a path (absolute, ``./``, ``../``, ``~``, or an
    existing parent folder) must exist. A hub id (``org/name``) is checked
    against the local cache only when the hub is offline (``HF_HUB_OFFLINE``).

    Raises:
        ModelNotFoundError: "no model at PATH", with what to do.
    """
    if not isinstance(pretrained, str) or not pretrained:
        return
    path = Path(pretrained).expanduser()
    looks_like_path = (
        path.is_absolute()
        or pretrained.startswith((".", "~"))
        or pretrained.count("/") > 1
        or (len(path.parts) > 1 and path.parent.is_dir())
    )
    if looks_like_path:
        if not path.exists():
            raise ModelNotFoundError(
                f"no model at {pretrained} (the folder does not exist); give the folder "
                "that holds config.json, or a Hugging Face hub id such as EleutherAI/pythia-160m"
            )
        if path.is_dir() and not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"no model at {pretrained}: the folder has no config.json; give the folder "
                "save_pretrained wrote"
            )
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(pretrained, "config.json"), str):
            raise ModelNotFoundError(
                f"no model at {pretrained}: it is not a local folder, and the hub is offline "
                "(HF_HUB_OFFLINE=1) with no cached copy; download it first or give a local folder"
            )
