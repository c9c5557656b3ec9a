"""Load the offline benchmark variants from local JSONL files (lm-eval ``custom_dataset``).

The offline task YAMLs in this folder name ``load_offline`` as their
``custom_dataset``. lm-eval 0.4.13 calls it with the task's ``metadata`` and
``dataset_kwargs`` as keyword arguments and uses the returned ``DatasetDict``
in place of a hub download; everything else (prompts, few-shot sampling,
metrics) is the stock task's configuration.

Data layout (one folder per benchmark, one file per split)::

    <data_dir>/arc_easy/{train,validation,test}.jsonl
    <data_dir>/arc_challenge/{train,validation,test}.jsonl
    <data_dir>/gsm8k/{train,test}.jsonl
    <data_dir>/hellaswag/{train,validation}.jsonl
    <data_dir>/mmlu/{dev,test}.jsonl          (every row has a "subject")
    <data_dir>/truthfulqa/validation.jsonl
    <data_dir>/winogrande/{train,validation}.jsonl

Rows carry the same fields as the Hugging Face hub data sets that the stock
tasks read (allenai/ai2_arc, openai/gsm8k, Rowan/hellaswag, cais/mmlu,
truthful_qa ``multiple_choice``, allenai/winogrande).

``data_dir``: the ``lmc_data_dir`` metadata, else ``$LM_COUPLING_DATA_DIR``,
else the bundled sample documents (`resolve_data_dir`).

lm-eval imports this file by path (not as part of the ``lm_coupling``
package), so it depends on the standard library and ``datasets`` only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import datasets

DATA_DIR_ENV = "LM_COUPLING_DATA_DIR"
DATA_DIR_METADATA_KEY = "lmc_data_dir"
BUNDLED_DATA_DIR = Path(__file__).resolve().parents[1] / "demo" / "sample_tasks"
log = logging.getLogger("lm_coupling.tasks")
ANNOUNCED_ATTRIBUTE = "lmc_announced"
"""The attribute of the ``lm_coupling.tasks`` logger holding this process's announcements."""


class OfflineDataError(ValueError):
    """A data file of an offline task that cannot serve (empty, missing rows or files).

    A ``ValueError`` as lm-eval expects from a loader; ``lm_coupling.harness.tasks``
    turns it into ``DataUnavailableError`` (an ``LmCouplingError``) by the
    ``lmc_data_error`` mark (this file is imported by path, one class per copy).
    """

    lmc_data_error = True


class OfflineDataMissing(OfflineDataError, FileNotFoundError):
    """No ``<split>.jsonl`` file in the benchmark's folder."""


BENCHMARKS = (
    "arc_easy",
    "arc_challenge",
    "gsm8k",
    "hellaswag",
    "mmlu",
    "truthfulqa",
    "winogrande",
)


def resolve_data_dir(metadata_dir: str | os.PathLike | None = None) -> Path:
    """Return the folder holding the offline benchmark files.

    Args:
        metadata_dir: the ``lmc_data_dir`` metadata value, if any.

    Returns:
        ``metadata_dir`` if given, else ``$LM_COUPLING_DATA_DIR`` if set and
        not empty, else the bundled sample documents. ``~`` is expanded and
        relative paths are taken from the current directory.
    """
    for candidate in (metadata_dir, os.environ.get(DATA_DIR_ENV)):
        if candidate:
            return Path(candidate).expanduser().resolve()
    return BUNDLED_DATA_DIR


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read one JSON object per non-blank line.

    Raises:
        ValueError: a line is not valid JSON (the message names file and line).
    """
    rows = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{number} is not a JSON object ({err.msg}); offline benchmark "
                    "files hold one JSON object per line with the hub data set's fields"
                ) from err
    return rows


def load_offline(
    benchmark: str | None = None,
    subject: str | None = None,
    lmc_data_dir: str | None = None,
    **_ignored: Any,
) -> datasets.DatasetDict:
    """Build the ``DatasetDict`` of one offline benchmark from ``<data_dir>/<benchmark>/``.

    Args:
        benchmark: folder name, one of ``BENCHMARKS`` (from ``dataset_kwargs``).
        subject: MMLU only: keep the rows whose ``subject`` equals it.
        lmc_data_dir: data folder from the task metadata (``--metadata``).
        **_ignored: the rest of the task metadata (``version``,
            ``config_source``, other tasks' keys), unused.

    Returns:
        One ``datasets.Dataset`` per ``<split>.jsonl`` file found.

    Raises:
        ValueError: unknown benchmark, an empty ``<split>.jsonl`` (the message
            names the file), or no rows (for ``subject``).
        FileNotFoundError: the benchmark folder or its files are missing.
    """
    if benchmark not in BENCHMARKS:
        raise ValueError(
            f"offline task config: dataset_kwargs.benchmark must be one of {BENCHMARKS}, "
            f"found {benchmark!r}; fix the task YAML"
        )
    data_dir = resolve_data_dir(lmc_data_dir)
    folder = data_dir / benchmark
    if not (lmc_data_dir or os.environ.get(DATA_DIR_ENV)):
        _announce_bundled(benchmark, folder)
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    if not files:
        raise OfflineDataMissing(
            f"no <split>.jsonl files in {folder}; put the {benchmark} files there, or point "
            f"${DATA_DIR_ENV} (or --metadata '{{\"{DATA_DIR_METADATA_KEY}\": ...}}') at a "
            "folder laid out as described in lm_coupling/tasks/README.md"
        )
    splits = {}
    for path in files:
        rows = read_jsonl(path)
        if not rows:
            raise OfflineDataError(
                f"{path} has no rows: the {path.stem} split of the offline {benchmark} task "
                "needs one JSON object per line with the hub data set's fields; fill the "
                "file or remove it (see lm_coupling/tasks/README.md)"
            )
        if subject is not None:
            rows = [row for row in rows if row.get("subject") == subject]
        if rows:
            splits[path.stem] = datasets.Dataset.from_list(rows)
    if not splits:
        raise OfflineDataError(
            f"{folder} has no rows with subject {subject!r}; the offline MMLU group needs "
            "every subject it lists: convert the full MMLU data, or run the subject tasks "
            "your files cover (lmc_mmlu_offline_<subject>)"
        )
    return datasets.DatasetDict(splits)


def _announce_bundled(benchmark: str, folder: Path) -> None:
    """Say, once per benchmark and process, that the bundled sample documents are used.

    lm-eval imports this file by path, once per copy, each with its own globals:
    the benchmarks announced are kept on the ``lm_coupling.tasks`` logger, one per process.
    """
    announced = vars(log).setdefault(ANNOUNCED_ATTRIBUTE, set())
    if benchmark in announced:
        return
    announced.add(benchmark)
    log.warning(
        "lm-coupling: offline %s task: no data folder given, using the bundled sample "
        "documents in %s (a handful of items, for trying the package out). Set $%s or "
        "--metadata '{\"%s\": ...}' to evaluate your own converted files.",
        benchmark,
        folder,
        DATA_DIR_ENV,
        DATA_DIR_METADATA_KEY,
    )
