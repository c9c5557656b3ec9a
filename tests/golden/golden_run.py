"""The golden run: one fixed evaluation whose results and geometry files are kept.

``python tests/golden/golden_run.py`` rewrites ``tests/golden/*.json`` (only when a
change of numbers or format is intended, and said so in the commit). The test
(`test_golden_files.py`) reruns the same evaluation and compares.

Fixed inputs: the bundled trained model, and the task items frozen beside this
file (``data/``, lm-coupling's own sample items), so that a change of the
bundled samples does not move the golden numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (when run as a script)

from fixtures.outputs import written_files  # noqa: E402

HERE = Path(__file__).resolve().parent
TASKS = ["lmc_arc_easy_offline", "lmc_gsm8k_offline"]


def golden_arguments(output_path: Path) -> dict[str, Any]:
    """The keyword arguments of `lm_coupling.evaluate` for the golden run."""
    from lm_coupling.demo.assets import bundled_model_path

    return {
        "model_args": {"pretrained": str(bundled_model_path()), "dtype": "float32"},
        "tasks": TASKS,
        "metrics": "all",
        "metric_args": {"coupling_docs": 2},
        "batch_size": 2,
        "device": "cpu",
        "limit": 3,
        "output_path": str(output_path),
        "num_fewshot": 1,
        "log_samples": True,
        "metadata": {"lmc_data_dir": str(HERE / "data")},
    }


def main() -> int:
    """Run the golden evaluation into a temporary folder and rewrite the golden files."""
    import tempfile

    import lm_coupling

    with tempfile.TemporaryDirectory() as tmp:
        lm_coupling.evaluate(**golden_arguments(Path(tmp)))
        for name, content in written_files(Path(tmp)).items():
            path = HERE / f"{name}.json"
            path.write_text(json.dumps(content, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
