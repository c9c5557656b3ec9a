"""Names of the files a run writes: one rule, used by the writer, the sweep and the report.

lm-eval writes ``results_<date_id>.json`` (and ``samples_<task>_<date_id>.jsonl``);
lm-coupling writes ``geometry_<task>_<date_id>.json`` beside it, ``<task>`` with
every character outside ``[A-Za-z0-9_.-]`` replaced by ``_``.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS_FILE = re.compile(r"^results_(?P<date_id>.+)\.json$")


def output_root(output_path: str | Path) -> Path:
    """The folder a run's ``--output_path`` names: itself, or a ``.json`` file's folder.

    lm-eval writes into ``<root>/<model folder>/`` (or, for a ``.json`` path,
    that file's folder); the leaderboard sits in ``<root>``.
    """
    path = Path(output_path)
    return path.parent if path.suffix == ".json" else path


def geometry_file_name(task: str, date_id: str) -> str:
    """``geometry_<task>_<date_id>.json``."""
    return f"geometry_{re.sub(r'[^A-Za-z0-9_.-]+', '_', task)}_{date_id}.json"


def geometry_file_for(results_file: Path, task: str) -> Path | None:
    """The geometry file of ``task`` beside lm-eval's ``results_<date_id>.json``.

    Returns:
        Its path, or None when ``results_file`` is not named like a results file.
    """
    match = RESULTS_FILE.match(results_file.name)
    if match is None:
        return None
    return results_file.with_name(geometry_file_name(task, match.group("date_id")))
