"""The sweep's record of each model: done, skipped or failed, with its error.

Each model's record is its own file, ``<out>/sweep_status/<slug>.json``, so
that shards writing to one shared folder never write the same file; after
every model the job rewrites ``<out>/sweep_status.csv``, one row per record
found (atomically, through a temporary file and a rename).
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from lm_coupling.sweep.spec import ModelEntry

STATUS_DIR = "sweep_status"
STATUS_CSV = "sweep_status.csv"
FIELDS = ("model", "revision", "status", "tasks", "seconds", "error", "log", "finished")


@dataclass
class ModelStatus:
    """What happened to one model.

    Attributes:
        model: name or path.
        revision: revision, "" for the default.
        status: ``done`` (ran, results and geometry complete) or ``failed``
            (a rerun tries it again).
        tasks: the tasks run (``;``-separated).
        seconds: wall time of the model's lm-eval process.
        error: the error's last line, for a failed model.
        log: the model's log file (lm-eval's output), relative to the folder.
        finished: local time the record was written.
    """

    model: str
    revision: str
    status: str
    tasks: str = ""
    seconds: float = 0.0
    error: str = ""
    log: str = ""
    finished: str = ""


def record(out_dir: Path, entry: ModelEntry, status: ModelStatus) -> None:
    """Write one model's record, then rewrite ``sweep_status.csv`` from every record."""
    status.finished = time.strftime("%Y-%m-%dT%H:%M:%S")
    folder = out_dir / STATUS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / f"{entry.slug}.json", json.dumps(asdict(status), indent=2) + "\n")
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(asdict(found) for found in read_records(out_dir))
    _atomic_write(out_dir / STATUS_CSV, text.getvalue())


def read_records(out_dir: Path) -> list[ModelStatus]:
    """Every model record in the folder (an unreadable one is left out, with a warning)."""
    records = []
    for path in sorted((out_dir / STATUS_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            records.append(ModelStatus(**{k: data[k] for k in FIELDS if k in data}))
        except (OSError, ValueError, TypeError) as exc:
            warnings.warn(
                f"lm-coupling sweep: the model record {path} cannot be read ({exc!r}); it is "
                "left out of sweep_status.csv (delete it, and the model is planned again)",
                UserWarning,
                stacklevel=2,
            )
    return records


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
