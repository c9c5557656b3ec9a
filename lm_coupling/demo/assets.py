"""Paths of the trained demo model and its tasks bundled with the package.

The bundled model is the smallest size of the demo family, trained on a
generated corpus; the tasks are its held-out evaluation items, laid out as the
offline task YAMLs read them (``<benchmark>/<split>.jsonl``); ``models/`` holds
four more models trained with the same recipe but their own seeds and sizes.
``assets/PROVENANCE.md`` names the commit whose code trained them.
"""

from __future__ import annotations

from pathlib import Path

from lm_coupling.errors import DataUnavailableError

ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def _existing(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise DataUnavailableError(
            f"the bundled {what} is missing: expected a folder at {path}; reinstall lm-coupling"
        )
    return path


def bundled_model_path() -> Path:
    """Folder of the bundled trained model (loads with ``from_pretrained``, offline).

    Raises:
        DataUnavailableError: the folder is missing from the installation.
    """
    return _existing(ASSETS_DIR / "tiny-gpt2", "demo model")


def bundled_tasks_data_path() -> Path:
    """Folder of the bundled evaluation tasks (``<benchmark>/<split>.jsonl``).

    Point ``LM_COUPLING_DATA_DIR`` at it to run the offline task YAMLs on them.

    Raises:
        DataUnavailableError: the folder is missing from the installation.
    """
    return _existing(ASSETS_DIR / "tasks_data", "demo tasks")


def independent_model_paths() -> list[Path]:
    """The models trained beside the bundled one (``assets/models/<name>``), by name."""
    return sorted(p.parent for p in (ASSETS_DIR / "models").glob("*/config.json"))
