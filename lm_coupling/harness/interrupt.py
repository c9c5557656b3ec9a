"""Ctrl-C: one line that says how far the run got and how to resume it, exit status 130.

While lm-eval hands the model its requests, `counting_requests` counts the
requests handed over and those answered (every answer passes lm-eval's
``cache_hook.add_partial``, which with ``--use_cache`` also stores it for a
rerun). A `KeyboardInterrupt` raised meanwhile carries the two counts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
ATTRIBUTE = "lmc_requests"  # (answered, handed over), set on the KeyboardInterrupt


@contextlib.contextmanager
def counting_requests(lm: Any, requests: list[Any]) -> Iterator[None]:
    """Count ``requests`` and their answers; tag a `KeyboardInterrupt` with the counts.

    Args:
        lm: the lm-eval model answering (its ``cache_hook`` sees every answer).
        requests: the requests it is about to answer.
    """
    count = vars(lm).setdefault("lmc_request_count", [0, 0])  # answered, handed over
    count[1] += len(requests)
    hook = lm.cache_hook
    stock = hook.add_partial

    def add_partial(attr: str, req: Any, res: Any) -> None:
        count[0] += 1
        stock(attr, req, res)

    hook.add_partial = add_partial
    try:
        yield
    except KeyboardInterrupt as exc:
        setattr(exc, ATTRIBUTE, tuple(count))
        raise
    finally:
        del hook.add_partial  # the class's method again


def interrupted_message(exc: BaseException, use_cache: str | None) -> str:
    """The one line printed for Ctrl-C, after closing the progress bars left open.

    An open ``tqdm`` bar (lm-eval's request bar) redraws itself when the
    interpreter exits: closed here, the line is the last thing printed.
    """
    tqdm_module = sys.modules.get("tqdm")
    # tqdm keeps its open bars in the class attribute ``_instances`` (a WeakSet).
    for bar in list(vars(tqdm_module.tqdm).get("_instances", ())) if tqdm_module else ():
        bar.close()
    counts = getattr(exc, ATTRIBUTE, None)
    where = (
        f"interrupted after {counts[0]} of {counts[1]} requests"
        if counts
        else "interrupted before the model answered any request"
    )
    if use_cache:
        advice = "rerun the same command (with the same --use_cache) to resume"
    else:
        advice = (
            "nothing was kept: rerun the command (add --use_cache PATH so that an interrupted "
            "run resumes where it stopped)"
        )
    return f"lm-coupling: {where}; {advice}"
