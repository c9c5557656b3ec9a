"""Build hook: ship the start-up ``.pth`` file into site-packages.

All metadata lives in setup.cfg. setuptools cannot place a file at the root
of site-packages declaratively, so ``build_py`` copies
``lm_coupling_startup.pth`` into the build's library root (pytest-cov ships
its ``.pth`` the same way).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "lm_coupling_startup.pth"


class BuildPyWithStartupHook(build_py):
    """Copy the start-up hook next to the package."""

    def run(self):
        """Build the package, then copy the ``.pth`` file beside it."""
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode=True):
        """List the ``.pth`` file among the build's outputs."""
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
