"""The tests' tiny-model builders (``tests/fixtures/tiny.py``), for the bench scripts.

The bench scripts import this module by name (``bench/`` is on ``sys.path``
when one runs), so the builders live in one place, beside the tests that use
them most, and not in the installed package.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.tiny import (  # noqa: E402
    ARCHITECTURES,
    SAMPLE_TEXT,
    build_tiny_model,
    save_tiny_model,
    tiny_config,
    train_tokenizer,
)

__all__ = [
    "ARCHITECTURES",
    "SAMPLE_TEXT",
    "build_tiny_model",
    "save_tiny_model",
    "tiny_config",
    "train_tokenizer",
]
