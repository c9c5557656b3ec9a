"""`evaluate`: an lm-eval benchmark with geometry, from Python.

The keywords are lm-eval's own run options plus the geometry selection; they
become the run's `RunConfig` (`RunConfig.from_keywords`), validated and run
as the command lines' (`lm_coupling.harness.run.run_evaluation`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_coupling.harness.run import RunRecord


def evaluate(
    model: str | Any = "hf",
    model_args: str | Mapping[str, Any] | None = None,
    tasks: str | Sequence[str] = "lmc_demo",
    metrics: str | Sequence[str] = "all",
    metric_args: str | Mapping[str, Any] | None = None,
    *,
    tokenizer: Any = None,
    model_name: str | None = None,
    output_path: str | None = None,
    batch_size: int | str = 1,
    max_batch_size: int | None = None,
    device: str | None = None,
    limit: int | float | None = None,
    samples: str | Mapping[str, Sequence[int]] | None = None,
    num_fewshot: int | None = None,
    include_path: str | Sequence[str] | None = None,
    log_samples: bool = False,
    use_cache: str | None = None,
    gen_kwargs: str | Mapping[str, Any] | None = None,
    apply_chat_template: bool | str = False,
    fewshot_as_multiturn: bool | None = None,
    system_instruction: str | None = None,
    seed: int | Sequence[int | None] | None = None,
    predict_only: bool = False,
    write_out: bool = False,
    metadata: Mapping[str, Any] | None = None,
    wandb_args: str | Mapping[str, Any] | None = None,
    bootstrap_iters: int = 100000,
    task_manager: Any = None,
    **lm_eval_options: Any,
) -> dict[str, Any] | None:
    """Run an lm-eval benchmark and measure its geometry from the same forward passes.

    Example::

        import lm_coupling

        results = lm_coupling.evaluate(
            model_args={"pretrained": "EleutherAI/pythia-160m", "dtype": "bfloat16"},
            tasks=["arc_easy"],
            metrics="all",
            metric_args={"coupling_docs": 25},
            batch_size="auto",
            device="cuda",
        )
        results["results"]["arc_easy"]["coupling,none"]
        results["geometry"]["arc_easy"]["matrices"]["coupling"]["mean"]  # L x L

        # or a model already in memory:
        results = lm_coupling.evaluate(model=hf_model, tokenizer=hf_tokenizer, tasks="arc_easy")

    Args:
        model: lm-eval's model type (``"hf"``, ``"hf-auto"``), or a Hugging Face
            ``PreTrainedModel`` already in memory (then give ``tokenizer``).
        model_args: ``"pretrained=...,dtype=..."`` or a dict (with a model type).
        tasks: lm-eval task, group or tag names, or YAML files (comma string or
            list); lm-coupling's own tasks are on the include path.
        metrics: geometry metrics (comma string, list, or ``"all"``).
        metric_args: their options (``"k=10,coupling_docs=25"`` or a dict).
        tokenizer: the tokenizer of an in-memory model.
        model_name: the name an in-memory model is filed under (recorded as
            lm-eval records ``pretrained``; it names the output folder and the
            leaderboard row). Default: the ``name_or_path`` it was loaded from;
            a model built from a config has none and must be named.
        output_path: folder (or ``.json`` file name) for lm-eval's results and
            the geometry files; without it nothing is written.
        batch_size: an integer, ``"auto"`` or ``"auto:N"``.
        max_batch_size: the ceiling of ``"auto"``.
        device: torch device (lm-eval's default when None).
        limit: documents per task (an int) or a fraction (a float < 1).
        samples: document ids per task (a dict, JSON text or a JSON file).
        num_fewshot: few-shot examples (the task's default when None).
        include_path: folders of your own task YAMLs (beside lm-coupling's).
        log_samples: keep per-document records (returned under ``"samples"``;
            written as lm-eval's samples files too when ``output_path`` is given).
        use_cache: lm-eval's response cache path (geometry is cached beside it).
        gen_kwargs: generation arguments for generation tasks.
        apply_chat_template: apply the tokenizer's chat template (or a named one).
        fewshot_as_multiturn: few-shot examples as chat turns.
        system_instruction: a system prompt.
        seed: one seed, or lm-eval's four (random, numpy, torch, few-shot).
        predict_only: lm-eval's predictions only (geometry is still measured).
        write_out: print the first prompts of each task.
        metadata: task metadata (``{"lmc_data_dir": ...}`` for offline tasks).
        wandb_args: Weights & Biases ``init`` arguments (geometry is logged
            like any metric).
        bootstrap_iters: bootstrap resamples for lm-eval's non-mean stderrs.
        task_manager: an lm-eval ``TaskManager`` to reuse across evaluations
            (skips lm-eval's task indexing, ~15 s); it must include
            ``lm_coupling.harness.run.TASKS_DIR`` for lm-coupling's tasks.
        **lm_eval_options: any other ``lm_eval run`` option by its name
            (``check_integrity``, ``cache_requests``, ``hf_hub_log_args``, ...).

    Returns:
        lm-eval's results dictionary, as written to the results file, plus
        ``"geometry"`` (per task, the geometry file's content) and, with
        ``log_samples``, ``"samples"``. Per task its geometry values sit beside
        accuracy; ``config.lm_coupling`` records the options, capture counts
        and model shape. None on data-parallel ranks other than 0.

    Raises:
        ConfigurationError: unknown metric, option or task, or options lm-eval
            rejects (before anything loads).
        ModelNotFoundError: no model at the path given.
        UnsupportedModelError: the model's blocks, final norm or unembedding
            cannot be located, or it cannot give the selected metrics.
        DataUnavailableError: a task's data cannot be read.
        ConcurrentRunError: another evaluation is running in this process.
    """
    keywords = dict(locals())  # every argument, as given
    keywords.update(keywords.pop("lm_eval_options"))
    record = evaluate_record(**keywords)
    if record.results is None:
        return None
    return {**record.results, "geometry": record.geometry}


def evaluate_record(*args: Any, **keywords: Any) -> RunRecord:
    """`evaluate`, returning the whole `RunRecord` (results, geometry, files, session).

    Takes exactly `evaluate`'s arguments (bound to its signature, defaults included).

    Raises:
        TypeError: an argument `evaluate` does not take.
    """
    from lm_coupling.harness.run import run_evaluation
    from lm_coupling.harness.run_config import RunConfig

    bound = inspect.signature(evaluate).bind(*args, **keywords)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.update(arguments.pop("lm_eval_options"))
    # RunConfig.from_keywords takes its own arguments by name; the others are lm-eval's options.
    own = set(inspect.signature(RunConfig.from_keywords).parameters) - {"lm_eval_options"}
    named = {name: arguments.pop(name) for name in own}
    return run_evaluation(RunConfig.from_keywords(**named, lm_eval_options=arguments))
