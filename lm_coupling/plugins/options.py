"""Parsers for ``--metric_args`` values shared by the built-in metrics."""

from __future__ import annotations

from collections.abc import Callable


def parse_bool(text: str) -> bool:
    """Parse ``true/false/1/0/yes/no`` (case-insensitive)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, found {text!r}")


def parse_k(text: str) -> int | float:
    """Parse K: a positive integer, or a fraction of d_model in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected an integer or a fraction in (0, 1), found {text!r}") from None
    if value >= 1 and value.is_integer():
        return int(value)
    if 0 < value < 1:
        return value
    raise ValueError(f"expected an integer >= 1 or a fraction in (0, 1), found {text!r}")


def parse_at_least(low: int) -> Callable[[str], int]:
    """A parser of an integer >= ``low`` (a count, a seed)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer >= {low}, found {text!r}") from None
        if value < low:
            raise ValueError(f"expected an integer >= {low}, found {value}")
        return value

    return parse


def parse_doc_count(text: str) -> int | None:
    """Parse a document count: a non-negative integer, or ``all`` (None)."""
    if text.strip().lower() == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a number of documents or 'all', found {text!r}") from None
    if value < 0:
        raise ValueError(f"expected a non-negative number of documents, found {value}")
    return value


def _optional_number(text: str, convert: type, what: str, valid) -> int | float | None:
    """``none``/``auto`` -> None; else ``convert(text)``, which must satisfy ``valid``."""
    if text.strip().lower() in ("none", "auto"):
        return None
    try:
        value = convert(text)
    except ValueError:
        raise ValueError(f"expected {what} or 'none', found {text!r}") from None
    if not valid(value):
        raise ValueError(f"expected {what}, found {value}")
    return value


def parse_optional_int(text: str) -> int | None:
    """An integer >= 0, or ``none`` (the engine then chooses)."""
    return _optional_number(text, int, "a non-negative integer", lambda v: v >= 0)


def parse_optional_float(text: str) -> float | None:
    """A positive number, or ``none`` (the engine's default)."""
    return _optional_number(text, float, "a positive number", lambda v: v > 0)
