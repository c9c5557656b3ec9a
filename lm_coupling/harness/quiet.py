"""Silence the messages lm-eval prints on every run that are lm-coupling's to silence.

- lm-eval records the git commit of the working folder (``results["git_hash"]``)
  by running ``git describe --always``; outside a git checkout git prints
  ``fatal: not a git repository ...``. The same command runs here with git's
  error output discarded (`lm_eval_adapter.git_commit_probe`): the recorded
  hash is unchanged.
- lm-eval warns "Custom kwargs can be passed to `--metadata` ..." once per task
  whose data comes from a ``custom_dataset`` function, as every offline
  ``lmc_*`` task's does: dropped for ``lmc_*`` tasks only.
- lm-eval warns that metrics were not scored on the same number of documents;
  sampled geometry metrics are by design (the geometry file records
  ``n_measured``): dropped only when the benchmark's own metrics all have one
  count and no geometry metric has more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
from collections.abc import Iterable, Iterator

from lm_coupling.harness.lm_eval_adapter import TASK_LOGGER, commit_from_path, git_commit_probe

_METADATA_HINT = ": Custom kwargs can be passed to `--metadata`"
_COUNTS = re.compile(r"Metrics were not scored on the same number of documents \((.*?)\)\.")


def quiet_git_commit_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` without git's error output."""
    try:
        found = subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)
        return found.strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return commit_from_path(os.getcwd())


class QuietFilter(logging.Filter):
    """Drop lm-eval's ``--metadata`` hint for ``lmc_*`` tasks and the geometry count warning.

    Args:
        geometry_metrics: the run's geometry metrics (the count warning's exception).
    """

    def __init__(self, geometry_metrics: Iterable[str] = ()):
        super().__init__()
        self.geometry_metrics = frozenset(geometry_metrics)

    def filter(self, record: logging.LogRecord) -> bool:
        """False only for the two messages above."""
        message = record.getMessage()
        if message.startswith("lmc_") and _METADATA_HINT in message:
            return False
        match = _COUNTS.search(message)
        if match is None:
            return True
        own, geometry = set(), set()
        for item in match.group(1).split(", "):
            key, _, count = item.rpartition("=")
            if not count.isdigit():
                return True
            metric = key.split(",", 1)[0]
            (geometry if metric in self.geometry_metrics else own).add(int(count))
        return not (len(own) == 1 and all(n <= min(own) for n in geometry))


@contextlib.contextmanager
def quiet_lm_eval(geometry_metrics: Iterable[str] = ()) -> Iterator[None]:
    """Within the block: no git probe noise, and `QuietFilter` on lm-eval's two loggers."""
    log_filter = QuietFilter(geometry_metrics)
    loggers = [logging.getLogger(TASK_LOGGER), logging.getLogger("lm_eval.evaluator_utils")]
    for logger in loggers:
        logger.addFilter(log_filter)
    try:
        with git_commit_probe(quiet_git_commit_hash):
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(log_filter)
