"""Silence the two messages lm-eval prints on every run that are lm-coupling's to silence.

- lm-eval records the git commit of the working folder (``results["git_hash"]``)
  by running ``git describe --always``; outside a git checkout git prints
  ``fatal: not a git repository ...`` to the terminal, once per run.
  `quiet_lm_eval` runs the same command, with the same fallback, with git's
  error output discarded: the recorded hash is unchanged (None outside a
  checkout). This uses lm-eval beyond its public API, through
  `lm_eval_adapter.git_commit_probe` (for the duration of the run).
- lm-eval warns "Custom kwargs can be passed to `--metadata` ..." once per task
  whose data comes from a ``custom_dataset`` function: lm-coupling's offline
  tasks (``lmc_*``) all do, and read their one option (``lmc_data_dir``) as
  their README says. The warning is dropped for ``lmc_*`` tasks only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator

from lm_coupling.harness.lm_eval_adapter import TASK_LOGGER, commit_from_path, git_commit_probe

_METADATA_HINT = ": Custom kwargs can be passed to `--metadata`"


def quiet_git_commit_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` without git's error output."""
    try:
        found = subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)
        return found.strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return commit_from_path(os.getcwd())


class OwnTaskMetadataFilter(logging.Filter):
    """Drop lm-eval's ``--metadata`` hint for lm-coupling's own (``lmc_*``) tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False only for the hint about an ``lmc_*`` task."""
        message = record.getMessage()
        return not (message.startswith("lmc_") and _METADATA_HINT in message)


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Within the block: no git probe noise, no ``--metadata`` hint for ``lmc_*`` tasks."""
    task_log = logging.getLogger(TASK_LOGGER)
    log_filter = OwnTaskMetadataFilter()
    task_log.addFilter(log_filter)
    try:
        with git_commit_probe(quiet_git_commit_hash):
            yield
    finally:
        task_log.removeFilter(log_filter)
