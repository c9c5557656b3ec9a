"""The interpreter start-up hook behind ``lm_eval ... --metrics ...``.

lm-eval 0.4.13 has no ``--metrics`` flag and discovers no plugins, so the
package installs ``lm_coupling_startup.pth``, whose one line imports this
module and calls `maybe_install` only when the program is ``lm_eval`` (or
``python -m lm_eval``) with a ``--metrics``/``--metric_args`` argument
(`is_lm_eval_with_metrics` is the same decision written out). `maybe_install`
then waits, with an import hook, for lm-eval's ``run`` command module to load
and adds the flags to it. ``LM_COUPLING_NO_STARTUP_HOOK=1`` switches it off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

DISABLE_ENV = "LM_COUPLING_NO_STARTUP_HOOK"
TARGET_MODULE = "lm_eval._cli.run"
FLAGS = ("--metrics", "--metric_args")


def is_lm_eval_with_metrics(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this interpreter runs lm-eval's command line with ``--metrics`` (or its options)."""
    if os.environ.get(DISABLE_ENV):
        return False
    if not any(arg.split("=", 1)[0] in FLAGS for arg in argv):
        return False
    program = os.path.basename(argv[0]) if argv else ""
    if program in ("lm_eval", "lm-eval", "lm_eval.exe", "lm-eval.exe"):
        return True
    for i, arg in enumerate(orig_argv[:-1]):
        if arg == "-m" and orig_argv[i + 1] in ("lm_eval", "lm_eval.__main__"):
            return True
    return False


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patch ``lm_eval._cli.run`` right after it is first imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        stock_exec = spec.loader.exec_module

        def exec_module(module):
            stock_exec(module)
            from lm_coupling.harness.cli import patch_run_command

            patch_run_command()

        spec.loader.exec_module = exec_module
        return spec


def maybe_install() -> None:
    """Install the import hook when this process is ``lm_eval ... --metrics``."""
    if not is_lm_eval_with_metrics(sys.argv, getattr(sys, "orig_argv", sys.argv)):
        return
    if any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        return
    if TARGET_MODULE in sys.modules:
        from lm_coupling.harness.cli import patch_run_command

        patch_run_command()
        return
    sys.meta_path.insert(0, _PatchAfterImport())
