"""The geometry work's progress line, beside lm-eval's own progress bar.

`geometry_progress` draws one more ``tqdm`` line under lm-eval's bar
(``position=1``): sampled documents measured out of those planned, with tqdm's
rate and time estimate::

    Running loglikelihood requests:  40%|████      | 96/240 [00:31<00:47, 3.05it/s]
    lm-coupling coupling,alignment_ratio:  32%|███▏      | 8/25 [00:24<00:51, 3.0s/doc]
"""

from __future__ import annotations

import os
from typing import Any


def sampled_in_requests(session: Any, requests: list[Any]) -> int:
    """Sampled documents still to measure whose measured request reaches the model now.

    A resumed run (``--use_cache``) measures the documents whose measured
    request the cache answered after lm-eval's request loop, so they are not
    counted and the bar ends at its total.
    """
    sampled = set(session.runner.sampled_metrics) if session.runner else set()
    if not sampled:
        return 0
    prompts = {r.args[0] for r in requests if r.request_type == "generate_until"}
    pairs = {tuple(r.args[:2]) for r in requests if r.request_type == "loglikelihood"}
    count = 0
    for key, plans in session.plans.plans_by_key.items():
        done = session.measurements.measured.get(key)
        if not any(plan.sampled for plan in plans) or (
            done is not None and sampled <= set(done.values)
        ):
            continue
        generation = any(plan.kind == "generate_until" for plan in plans)
        count += (key[0] in prompts) if generation else (tuple(key) in pairs)
    return count


def geometry_progress(label: str, total: int, disable: bool = False) -> Any:
    """A second ``tqdm`` line for the sampled (Jacobian) documents of a run.

    Args:
        label: what is measured (the sampled metrics' names).
        total: the documents to measure (no line when 0).
        disable: draw nothing (also on data-parallel ranks other than 0).
    """
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=f"lm-coupling {label}",
        unit="doc",
        position=1,
        leave=False,
        dynamic_ncols=True,
        disable=disable or total <= 0 or int(os.environ.get("RANK", "0")) != 0,
    )
