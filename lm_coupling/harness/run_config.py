"""`RunConfig`: one run's whole configuration, built once and frozen.

`lm_coupling.evaluate` builds it from Python keywords (`from_keywords`), the
command lines from lm-eval's parsed ``run`` arguments (`from_command_line`);
either way lm-eval's own ``EvaluatorConfig`` is built as lm-eval's command
line builds it and checked (`lm_coupling.harness.run_options`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from lm_coupling.errors import ConfigurationError
from lm_coupling.harness import model_identity
from lm_coupling.harness.gguf_checkpoint import check_gguf
from lm_coupling.harness.model_identity import check_model_named
from lm_coupling.harness.run_inputs import check_limit, check_output_path, check_tasks
from lm_coupling.harness.run_options import check_model_path, check_run_options
from lm_coupling.selection import Selection, make_selection

DEFAULT_OUTPUT = "results"
"""The command lines' output folder when ``--output_path`` is not given."""


@dataclass(frozen=True)
class RunConfig:
    """One run's configuration (frozen).

    Attributes:
        evaluator: lm-eval's validated ``EvaluatorConfig``.
        selection: the geometry metrics and their options.
        lm_eval_options: the lm-eval options the run uses, as the results
            record them (`check_run_options`; read-only).
        model: a Hugging Face model already in memory, or None (load
            ``evaluator.model_args``).
        tokenizer: the in-memory model's tokenizer.
        bootstrap_iters: lm-eval's bootstrap resamples for non-mean stderrs.
        task_manager: an lm-eval ``TaskManager`` whose task index to reuse, or None.
        log_samples: keep per-document records (written with an output path,
            returned without one).
        echo: print lm-eval's results table (the command lines do).
        model_record: an in-memory model's recorded ``model_args`` (its name and
            weights fingerprint, `model_identity.recorded_model_args`), else None.
        model_source: a GGUF checkpoint's file and quantisation
            (``config.lm_coupling.model_source``), else None.
    """

    evaluator: Any
    selection: Selection
    lm_eval_options: Mapping[str, Any]
    model: Any = None
    tokenizer: Any = None
    bootstrap_iters: int = 100000
    task_manager: Any = None
    log_samples: bool = False
    echo: bool = False
    model_record: Mapping[str, Any] | None = None
    model_source: Mapping[str, Any] | None = None

    @property
    def model_type(self) -> str:
        """lm-eval's ``--model`` (``"hf"`` when not given)."""
        return self.evaluator.model or "hf"

    @classmethod
    def create(
        cls,
        evaluator: Any,
        selection: Selection,
        *,
        model: Any = None,
        tokenizer: Any = None,
        bootstrap_iters: int = 100000,
        task_manager: Any = None,
        return_samples: bool = False,
        echo: bool = False,
        model_record: Mapping[str, Any] | None = None,
    ) -> RunConfig:
        """Check ``evaluator`` for a geometry run and freeze the whole configuration.

        Raises:
            ConfigurationError: a model type or lm-eval option geometry cannot honour.
            ModelNotFoundError: no model at ``model_args``' path.
        """
        check_tasks(evaluator.tasks)
        check_limit(evaluator.limit)
        check_output_path(evaluator.output_path)
        recorded = check_run_options(evaluator)
        source = None
        if model is None:
            check_model_named(evaluator.model_args)
            model_args = evaluator.model_args or {}
            source = check_gguf(model_args)  # before the path check: a GGUF folder has no config
            if not model_args.get("gguf_file"):
                check_model_path(model_args.get("pretrained"))
        return cls(
            evaluator=evaluator,
            selection=selection,
            lm_eval_options=MappingProxyType(dict(recorded)),
            model=model,
            tokenizer=tokenizer,
            bootstrap_iters=bootstrap_iters,
            task_manager=task_manager,
            log_samples=bool(evaluator.log_samples or return_samples),
            echo=echo,
            model_record=None if model_record is None else MappingProxyType(dict(model_record)),
            model_source=None if source is None else MappingProxyType(source),
        )

    @classmethod
    def from_command_line(
        cls, args: argparse.Namespace, metrics: str, metric_args: str | None
    ) -> RunConfig:
        """From lm-eval's parsed ``run`` arguments and the two geometry flags.

        The command lines write to `DEFAULT_OUTPUT` when no ``--output_path`` is given.
        """
        selection = make_selection(metrics, metric_args)
        options = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
        options["output_path"] = options.get("output_path") or DEFAULT_OUTPUT
        return cls.create(evaluator_config(options), selection, echo=True)

    @classmethod
    def from_keywords(
        cls,
        model: str | Any,
        model_args: str | Mapping[str, Any] | None,
        tasks: str | Sequence[str],
        metrics: str | Sequence[str],
        metric_args: str | Mapping[str, Any] | None,
        *,
        tokenizer: Any = None,
        model_name: str | None = None,
        bootstrap_iters: int = 100000,
        task_manager: Any = None,
        lm_eval_options: Mapping[str, Any],
    ) -> RunConfig:
        """From `lm_coupling.evaluate`'s keywords (``lm_eval_options``: its lm-eval options).

        Raises:
            ConfigurationError: unknown metric or option, a model in memory
                with ``model_args`` or without its tokenizer, or options lm-eval rejects.
        """
        names = metrics if isinstance(metrics, str) else ",".join(metrics)
        if isinstance(metric_args, Mapping):
            metric_args = dict(metric_args)
        selection = make_selection(names, metric_args)  # fails before anything loads
        in_memory = not isinstance(model, str)
        if in_memory and model_args is not None:
            raise ConfigurationError(
                "give either a model in memory or model_args, not both: model_args configure "
                "lm-eval's loading of a model by name"
            )
        if in_memory and tokenizer is None:
            raise ConfigurationError(
                "a model in memory needs its tokenizer: "
                "evaluate(model=model, tokenizer=tokenizer, ...)"
            )
        if not in_memory and model_name is not None:
            raise ConfigurationError(
                "model_name names a model passed in memory (evaluate(model=model, ...)); a model "
                "lm-eval loads is named by model_args={'pretrained': ...}"
            )
        # An in-memory model's name and weights, as the results and the leaderboard file it.
        model_record = model_identity.recorded_model_args(model, model_name) if in_memory else None
        options = _command_line_values(dict(lm_eval_options))
        options.update(
            model="hf" if in_memory else model,
            model_args=dict(model_args) if isinstance(model_args, Mapping) else model_args,
            tasks=tasks if isinstance(tasks, str) else ",".join(tasks),
        )
        # lm-eval ties --log_samples to an output path; in Python the records are returned.
        return_samples = bool(options.get("log_samples")) and not options.get("output_path")
        if return_samples:
            options["log_samples"] = False
        return cls.create(
            evaluator_config(options),
            selection,
            model=model if in_memory else None,
            tokenizer=tokenizer,
            bootstrap_iters=bootstrap_iters,
            task_manager=task_manager,
            return_samples=return_samples,
            model_record=model_record,
        )


def _command_line_values(options: dict[str, Any]) -> dict[str, Any]:
    """Python values as lm-eval's command line parses the same options."""
    converted = dict(options)
    if isinstance(converted.get("include_path"), (list, tuple)):
        converted["include_path"] = ",".join(map(str, converted["include_path"]))
    if "batch_size" in converted:
        converted["batch_size"] = str(converted["batch_size"])
    if converted.get("limit") is not None:
        converted["limit"] = float(converted["limit"])
    for name in ("samples", "gen_kwargs", "wandb_args"):
        if isinstance(converted.get(name), Mapping):
            converted[name] = dict(converted[name])
    if isinstance(converted.get("seed"), int):
        converted["seed"] = [converted["seed"]] * 4
    if "metadata" in converted:
        converted["metadata"] = dict(converted["metadata"]) if converted["metadata"] else None
    return converted


def evaluator_config(options: Mapping[str, Any]) -> Any:
    """lm-eval's validated run configuration from ``lm_eval run``-style options.

    Raises:
        ConfigurationError: lm-eval rejected the combination (its message kept).
    """
    from lm_eval.config.evaluate_config import EvaluatorConfig

    try:
        return EvaluatorConfig.from_cli(argparse.Namespace(**options))
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise ConfigurationError(f"lm-eval rejected the run options: {exc}") from exc
