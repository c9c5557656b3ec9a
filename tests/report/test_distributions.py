"""A task mean that hides two groups of documents: found from the values, drawn, counted.

`two_groups` on closed cases (two clusters with the mean between them; one
cluster; a spread; too few documents); `add_distributions` on a samples file
in lm-eval's format, for a metric the installed catalogue declares per
document and for one it declares task-level (left out), with a second metric
whose values do not split.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lm_coupling.catalogue import Catalogue
from lm_coupling.report.build import ReportResult
from lm_coupling.report.distributions import add_distributions, two_groups
from lm_coupling.report.loading import RunFile


def test_two_clusters_with_the_mean_between_them():
    values = [0.10] * 8 + [0.97] * 4 + [0.1333]
    groups = two_groups(values)
    assert groups is not None
    assert groups.mean == pytest.approx(sum(values) / len(values))
    assert groups.low == (0.10, 0.1333, 9) and groups.high == (0.97, 0.97, 4)


@pytest.mark.parametrize(
    "values",
    [
        [0.5] * 6,  # one value
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],  # evenly spread: no step covers half the range
        [0.1, 0.97, 0.97],  # too few documents
        [0.1, 0.11, 0.12, 0.13, 0.14, 0.97],  # one far document: an outlier, not a group
    ],
)
def test_no_hidden_split(values):
    assert two_groups(values) is None


def test_nan_values_are_left_out():
    assert two_groups([math.nan, 0.1, 0.1, 0.9, 0.9, math.nan]) is not None


def _run(tmp_path: Path, rows: list[dict]) -> RunFile:
    samples = tmp_path / "samples_lmc_arc_easy_offline_2026-01-01T00-00-00.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunFile(
        path=tmp_path / "results_2026-01-01T00-00-00.json", timestamp=1.0,
        identity=("SmolLM2-135M", "main", ""), shape={}, declared=set(),
        results={"lmc_arc_easy_offline": {}}, samples={"lmc_arc_easy_offline": samples},
        catalogue=Catalogue.installed(),
    )  # fmt: skip


def test_the_report_draws_and_counts_the_hidden_split(tmp_path):
    catalogue = Catalogue.installed()
    per_document = "prompt_entropy_min_layer"
    task_level = next(name for name, entry in catalogue.metrics.items() if entry.task_level)
    assert not catalogue.metrics[per_document].task_level
    rows = []
    for doc_id in range(12):
        split = 0.10 if doc_id % 3 else 0.97
        rows.append({"doc_id": doc_id, per_document: split, "lss": 4.0 + 0.01 * doc_id,
                     task_level: split})  # fmt: skip
    rows.append({"doc_id": 0, per_document: 0.5})  # a second row of a document: ignored
    result = ReportResult(tmp_path, *([None] * 4))
    assert add_distributions([_run(tmp_path, rows)], result, ("png",)) == 1
    (figure,) = result.figures
    assert figure == tmp_path / "figures" / "distributions.png" and figure.stat().st_size > 5000
    (note,) = result.notes
    assert per_document in note and "8 documents at 0.1 and 4 at 0.97" in note
    assert "the mean 0.39 " in note  # (8 * 0.10 + 4 * 0.97) / 12
    assert task_level not in note and "lss" not in note


def test_nothing_added_without_a_split(tmp_path):
    rows = [{"doc_id": i, "prompt_entropy_min_layer": 0.1 * i} for i in range(6)]
    result = ReportResult(tmp_path, *([None] * 4))
    assert add_distributions([_run(tmp_path, rows)], result, ("png",)) == 0
    assert result.figures == [] and result.notes == []
