"""Parse the MODELS argument of ``lm-coupling sweep`` into a list of models.

MODELS is one of:

- a comma list of ``name[@revision]`` (Hugging Face names or local paths),
  e.g. ``gpt2,EleutherAI/pythia-160m@step1000``;
- a YAML file: a list whose items are ``name[@revision]`` strings or mappings
  ``{model: NAME, revision: REV}`` (``revision`` may be a list), optionally
  under a top-level ``models:`` key;
- a CSV file with a ``model`` column and an optional ``revision`` column.

Every name and revision may hold brace expressions, expanded like a shell
does: ``step{0,1000,2000}`` (a list) and ``step{0,1000,...,143000}`` (an
arithmetic range from the first two numbers to the last, inclusive). Several
braces give their product.
"""

from __future__ import annotations

import csv
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from lm_coupling.errors import ConfigurationError

_BRACE = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True)
class ModelEntry:
    """One model of a sweep.

    Attributes:
        name: Hugging Face name or local folder (``pretrained=``).
        revision: hub revision (branch, tag, commit), or None for the default.
    """

    name: str
    revision: str | None = None

    @property
    def label(self) -> str:
        """``name@revision`` (or ``name``), as written in MODELS."""
        return f"{self.name}@{self.revision}" if self.revision else self.name

    @property
    def slug(self) -> str:
        """A file-name-safe form of the label."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.label).strip("_")[-150:]


def _arithmetic(items: list[str], text: str) -> list[str]:
    """``a,b,...,z`` -> a, b, ..., z with step b - a (z reached exactly)."""
    if items.count("...") != 1 or items.index("...") != 2 or len(items) != 4:
        raise ConfigurationError(
            f"brace range {{{text}}}: write two first values, '...', and the last one, "
            "e.g. {0,1000,...,143000}"
        )
    try:
        first, second, last = (int(items[i]) for i in (0, 1, 3))
    except ValueError:
        raise ConfigurationError(
            f"brace range {{{text}}}: '...' needs integers around it, e.g. {{0,1000,...,143000}}"
        ) from None
    step = second - first
    if step == 0 or (last - first) % step != 0 or (last - first) // step < 1:
        raise ConfigurationError(
            f"brace range {{{text}}}: {last} is not reached from {first} in steps of {step}"
        )
    return [str(v) for v in range(first, last + (1 if step > 0 else -1), step)]


def _alternatives(text: str) -> list[str]:
    """The words one ``{...}`` stands for."""
    items = [item.strip() for item in text.split(",")]
    if "..." in items:
        return _arithmetic(items, text)
    if any(not item or ".." in item for item in items):
        raise ConfigurationError(
            f"brace list {{{text}}}: an empty item, or a range not written as "
            "{first,second,...,last}, e.g. {0,1000,...,143000}"
        )
    return items


def expand_braces(text: str) -> list[str]:
    """Expand every ``{...}`` of ``text`` (product, left to right; no nesting).

    Raises:
        ConfigurationError: unbalanced or nested braces, or a bad range.
    """
    parts = _BRACE.split(text)  # literal, group, literal, ..., literal
    if any(c in literal for literal in parts[0::2] for c in "{}"):
        raise ConfigurationError(f"unbalanced or nested braces in {text!r}")
    choices = [_alternatives(p) if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def split_top_level(text: str) -> list[str]:
    """Split on commas outside braces (a comma before the next ``}`` is inside them)."""
    return [w.strip() for w in re.split(r",(?![^{}]*\})", text) if w.strip()]


def parse_entry(word: str) -> list[ModelEntry]:
    """``name[@revision]`` with braces -> one entry per expansion.

    The revision is what follows the last ``@`` when it holds no ``/`` (so a
    local path with ``@`` in a folder name stays a path).
    """
    name, sep, revision = word.rpartition("@")
    if not sep or not name or "/" in revision:
        name, revision = word, ""
    return entries_for(name, revision or None)


def entries_for(name: str, revision: str | list | None) -> list[ModelEntry]:
    """Entries for a name and a revision (string, list, or None), braces expanded."""
    names = expand_braces(str(name))
    if revision is None or revision == "":
        return [ModelEntry(n) for n in names]
    items = revision if isinstance(revision, list) else [revision]
    return [ModelEntry(n, r) for n in names for item in items for r in expand_braces(str(item))]


def _yaml_entries(path: Path) -> list[ModelEntry]:
    import yaml

    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict):
        data = data.get("models")
    if not isinstance(data, list):
        raise ConfigurationError(
            f"{path}: expected a list of models (or a 'models:' list), e.g.\n"
            "models:\n  - gpt2\n  - {model: EleutherAI/pythia-160m, revision: 'step{0,1000}'}"
        )
    entries = []
    for item in data:
        if isinstance(item, str):
            entries += parse_entry(item)
        elif isinstance(item, dict) and "model" in item:
            entries += entries_for(item["model"], item.get("revision"))
        else:
            raise ConfigurationError(
                f"{path}: cannot read model item {item!r}: give NAME[@REV] or "
                "{model: NAME, revision: REV}"
            )
    return entries


def _csv_entries(path: Path) -> list[ModelEntry]:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    entries = []
    for number, row in enumerate(rows, start=2):
        name = (row.get("model") or "").strip()
        if not name:
            raise ConfigurationError(f"{path}:{number}: no 'model' value (columns: model,revision)")
        entries += entries_for(name, (row.get("revision") or "").strip() or None)
    return entries


def parse_models(text: str) -> list[ModelEntry]:
    """MODELS (file or comma list) -> entries in order, duplicates removed.

    Raises:
        ConfigurationError: an unreadable file, a bad brace range, or no model.
    """
    path = Path(text)
    if path.suffix.lower() in (".yaml", ".yml", ".csv"):
        if not path.is_file():
            raise ConfigurationError(f"models file {path} does not exist")
        entries = _csv_entries(path) if path.suffix.lower() == ".csv" else _yaml_entries(path)
    else:
        entries = [e for word in split_top_level(text) for e in parse_entry(word)]
    entries = list(dict.fromkeys(entries))
    if not entries:
        raise ConfigurationError(f"no model in {text!r}")
    return entries
