"""capture/, model/ and jacobian/ know no metric: no import of metrics/ or the built-ins."""

from __future__ import annotations

import ast
from pathlib import Path

import lm_coupling.capture

CAPTURE = Path(lm_coupling.capture.__file__).parent
ROOMS = (CAPTURE, CAPTURE.parent / "model", CAPTURE.parent / "jacobian")  # the rooms of capture
FORBIDDEN = ("lm_coupling.metrics", "lm_coupling.plugins.builtin")


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` in the file names, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package lm_coupling.capture
                parent = ["lm_coupling", "capture"][: 2 - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def test_capture_imports_no_metric_code():
    files = sorted(path for room in ROOMS for path in room.rglob("*.py"))
    assert len(files) > 5, "capture/, model/ and jacobian/ were not found"
    offending = [
        f"{path.relative_to(CAPTURE.parent)}:{line}: {module}"
        for path in files
        for line, module in _imports(path)
        if module.startswith(FORBIDDEN)
    ]
    assert offending == [], "capture/ imports metric code:\n" + "\n".join(offending)


def test_the_check_sees_an_import_of_metric_code(tmp_path):
    # The check itself can fail: each kind of import of metric code is found.
    source = (
        "import lm_coupling.metrics.lens\n"
        "from lm_coupling.metrics.trajectory import TrajectoryAccumulator\n"
        "from lm_coupling.plugins import builtin\n"
        "from ..metrics import coupling\n"
        "def f():\n    from lm_coupling.plugins.builtin.lens import LensReducer\n"
    )
    path = tmp_path / "bad.py"
    path.write_text(source, encoding="utf-8")
    hits = {line for line, module in _imports(path) if module.startswith(FORBIDDEN)}
    assert hits == {1, 2, 3, 4, 6}
