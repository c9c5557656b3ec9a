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

HERE = Path(__file__).resolve().parent
TASKS = ["lmc_arc_easy_offline", "lmc_gsm8k_offline"]
# Keys whose values change from run to run (times, paths, environment, versions).
VOLATILE = {
    "date", "start_time", "end_time", "total_evaluation_time_seconds", "git_hash",
    "pretty_env_info", "transformers_version", "lm_eval_version", "upper_git_hash",
    "model_name_sanitized", "model_name", "model_args", "pretrained", "name", "model_path",
    "lm_coupling_version", "version", "plugins", "timings", "tokenizer_pad_token",
    "tokenizer_eos_token", "tokenizer_bos_token", "eot_token_id", "max_length",
    "model_source", "chat_template", "chat_template_sha", "system_instruction_sha",
    "lmc_data_dir", "metadata", "device", "batch_sizes", "seconds",
    # The task definitions (their YAML, revision and hash) are the tasks' own, not ours.
    "configs", "versions", "task_hashes",
}  # fmt: skip


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


def normalise(value: Any) -> Any:
    """Drop the volatile keys, recursively; keep everything else as written."""
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


def written_files(output_path: Path) -> dict[str, Any]:
    """``{"results": ..., "geometry_<task>": ...}`` of one run's folder, normalised."""
    (results,) = output_path.rglob("results_*.json")
    files = {"results": normalise(json.loads(results.read_text(encoding="utf-8")))}
    for path in sorted(output_path.rglob("geometry_*.json")):
        document = json.loads(path.read_text(encoding="utf-8"))
        files[f"geometry_{document['task']}"] = normalise(document)
    return files


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
