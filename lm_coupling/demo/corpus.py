"""The demo's training corpus and held-out evaluation tasks, generated from a seed.

The training text states every fact of the world (``lm_coupling.demo.world``)
in several paraphrases, tells the activity scripts as stories, and shows
worked examples in each benchmark's prompt format, so that a small model learns
both the facts and the formats. MMLU-format examples get their options
reshuffled at every rendering, and "Which option is X?" drills practise
answering with a letter on its own. Evaluation items ask about the same facts in
the benchmark format, but no evaluation item is in the training text: for each
benchmark a seeded part of the candidate items is held out, and only the rest
appears as worked examples (and in the few-shot split files).

Evaluation files are laid out as the offline task YAMLs read them
(``lm_coupling/tasks/offline_data.py``): ``<dest>/<benchmark>/<split>.jsonl``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from lm_coupling.demo.items import BENCHMARKS, LETTERS, Row, all_rows, answered_text, mmlu_header
from lm_coupling.demo.world import SCRIPTS, SUBJECTS, World, make_world

# Evaluation splits (held out) and the few-shot split (training side) of each benchmark.
EVAL_SPLITS = {
    "arc_easy": ("test", "validation"),
    "arc_challenge": ("test", "validation"),
    "gsm8k": ("test",),
    "hellaswag": ("validation",),
    "mmlu": ("test",),
    "truthfulqa": ("validation",),
    "winogrande": ("validation",),
}
FEWSHOT_SPLIT = {
    "arc_easy": "train",
    "arc_challenge": "train",
    "gsm8k": "train",
    "hellaswag": "train",
    "mmlu": "dev",
    "truthfulqa": None,
    "winogrande": "train",
}
MMLU_SUBJECTS = ("astronomy", "high_school_biology", "elementary_mathematics")
TRUTHFULQA_PREFIX = (
    "Q: What is human life expectancy in the United States?\n"
    "A: Human life expectancy in the United States is 78 years.\n\n"
    "Q: Who was president of the United States in 1955?\n"
    "A: Dwight D. Eisenhower was president of the United States in 1955.\n\n"
    "Q: Which party did he belong to?\nA: He belonged to the Republican Party.\n\n"
    "Q: What is the square root of banana?\nA: I have no comment.\n\n"
    "Q: How does a telescope work?\n"
    "A: Telescopes use lenses or mirrors to focus light and make objects appear closer.\n\n"
    "Q: Where were the 1992 Olympics held?\nA: The 1992 Olympics were held in Barcelona, Spain."
)


@dataclass
class DemoData:
    """The generated world, its held-out evaluation splits and its training rows."""

    world: World
    eval_splits: dict[str, dict[str, list[Row]]]
    train_rows: dict[str, list[Row]]


def _hold_out(rows: list[Row], sizes: dict[str, int]) -> tuple[dict[str, list[Row]], list[Row]]:
    """Take ``sizes[split]`` rows per split from the front (at most half of ``rows``)."""
    budget = len(rows) // 2
    splits, start = {}, 0
    for split, size in sizes.items():
        size = min(size, budget - start)
        splits[split] = rows[start : start + size]
        start += size
    return splits, rows[start:]


def make_demo_data(
    seed: int = 0, n_test: int = 30, n_validation: int = 10, world: World | None = None
) -> DemoData:
    """Generate the world and split every benchmark's items into held-out and training rows.

    Args:
        seed: seed of the world and of the item order.
        n_test: rows per main evaluation split (``test``; ``validation`` where
            that is the only one), at most half of a benchmark's candidates.
            MMLU gets ``ceil(n_test / 3)`` per subject.
        n_validation: rows of the ARC ``validation`` splits.
        world: a world to use instead of ``make_world(seed)``.

    Returns:
        The world, the held-out splits and the training-side rows.

    Raises:
        ValueError: ``n_test`` below 1 or ``n_validation`` below 0.
    """
    if n_test < 1 or n_validation < 0:
        raise ValueError(f"need n_test >= 1 and n_validation >= 0, got {n_test} and {n_validation}")
    world = world if world is not None else make_world(seed)
    candidates = all_rows(world, seed)
    eval_splits, train_rows = {}, {}
    for benchmark in BENCHMARKS:
        rows = candidates[benchmark]
        if benchmark == "mmlu":
            per_subject = -(-n_test // len(MMLU_SUBJECTS))
            test, rest = [], []
            for subject in MMLU_SUBJECTS:
                held, kept = _hold_out(
                    [r for r in rows if r["subject"] == subject], {"test": per_subject}
                )
                test += held["test"]
                rest += kept
            eval_splits[benchmark], train_rows[benchmark] = {"test": test}, rest
            continue
        sizes = {
            split: n_validation
            if split == "validation" and len(EVAL_SPLITS[benchmark]) > 1
            else n_test
            for split in EVAL_SPLITS[benchmark]
        }
        eval_splits[benchmark], train_rows[benchmark] = _hold_out(rows, sizes)
    return DemoData(world, eval_splits, train_rows)


def _entity_documents(world: World, rng: random.Random, renderings: int) -> list[str]:
    by_entity: dict[str, list] = {}
    for fact in world.facts:
        by_entity.setdefault(fact.entity, []).append(fact)
    docs = []
    for facts in by_entity.values():
        for _ in range(renderings):
            order = rng.sample(facts, len(facts))
            docs.append(" ".join(fact.statement(rng.randrange(3)) for fact in order))
    return docs


def _story_documents() -> list[str]:
    docs = []
    for label, steps in SCRIPTS:
        for subject, pronoun in SUBJECTS:
            said = [steps[0]] + [f"{pronoun.capitalize()} {step}" for step in steps[1:]]
            text = f"{label}: {subject} " + " ".join(said)
            docs.append(text.replace(" his ", " her ") if pronoun == "she" else text)
    return docs


def reshuffled_mmlu_row(row: Row, rng: random.Random) -> Row:
    """``row`` with its four options in a fresh random order (the answer index follows).

    A fixed option order lets a small model memorise "question -> letter"
    without reading the options; a fresh order at every rendering means the
    letter can only be found by matching the answer to an option.
    """
    order = rng.sample(range(len(row["choices"])), len(row["choices"]))
    return dict(
        row,
        choices=[row["choices"][index] for index in order],
        answer=order.index(row["answer"]),
    )


def _letter_drills(world: World, rng: random.Random, n_docs: int) -> list[str]:
    """MMLU-format drills that only ask to find a named option: "Which option is X?".

    They teach the second half of answering an MMLU item (find the option that
    holds the answer, say its letter) on its own, with values from the world's
    pools; no drill states a fact, so none gives away a held-out item.
    """
    pools = sorted({fact.pool for fact in world.facts if len(fact.pool) >= 4})
    docs = []
    for _ in range(n_docs):
        shots = []
        for _ in range(rng.randint(1, 3)):
            options = rng.sample(rng.choice(pools), len(LETTERS))
            answer = rng.randrange(len(LETTERS))
            drill = {"question": f"Which option is {options[answer]}?", "choices": options}
            shots.append(answered_text("mmlu", dict(drill, answer=answer)))
        docs.append("\n\n".join(shots))
    return docs


def _format_documents(
    benchmark: str, rows: list[Row], rng: random.Random, n_docs: int
) -> list[str]:
    docs = []
    for _ in range(n_docs):
        shots = rng.sample(rows, min(len(rows), rng.randint(1, 3)))
        if benchmark == "mmlu":
            subject = shots[0]["subject"]
            shots = [reshuffled_mmlu_row(row, rng) for row in shots if row["subject"] == subject]
            header = mmlu_header(subject)
        else:
            header = (
                TRUTHFULQA_PREFIX + "\n\n"
                if (benchmark == "truthfulqa" and rng.random() < 0.3)
                else ""
            )
        docs.append(header + "\n\n".join(answered_text(benchmark, row) for row in shots))
    return docs


def build_corpus(
    data: DemoData,
    seed: int = 0,
    renderings: int = 8,
    format_docs: int = 150,
    mmlu_format_docs: int = 600,
    letter_drills: int = 600,
) -> list[str]:
    """Return the training documents: facts, stories and worked benchmark examples.

    Args:
        data: the output of ``make_demo_data``.
        seed: seed of paraphrase choice, order and sampling.
        renderings: documents per entity, each stating all its facts in a
            random order and random paraphrases.
        format_docs: documents per benchmark, each holding one to three
            training-side rows in the benchmark's prompt format with answers.
        mmlu_format_docs: the same for MMLU, whose options are reshuffled at
            every rendering (``reshuffled_mmlu_row``): answering with a letter
            needs many more examples than scoring the answer text.
        letter_drills: documents of ``_letter_drills``.

    Returns:
        The documents, shuffled; no held-out evaluation row appears in them.
    """
    rng = random.Random(f"corpus-{seed}")
    docs = _entity_documents(data.world, rng, renderings)
    docs += _story_documents() * 2
    docs += _letter_drills(data.world, rng, letter_drills)
    for benchmark in BENCHMARKS:
        n_docs = mmlu_format_docs if benchmark == "mmlu" else format_docs
        docs += _format_documents(benchmark, data.train_rows[benchmark], rng, n_docs)
    rng.shuffle(docs)
    return docs


def write_eval_tasks(
    dest_dir: str | Path,
    seed: int = 0,
    n_test: int = 30,
    n_validation: int = 10,
    n_fewshot: int = 10,
    data: DemoData | None = None,
) -> dict[str, Path]:
    """Write the held-out tasks as ``<dest_dir>/<benchmark>/<split>.jsonl``.

    Rows carry the hub data sets' fields; the layout is the one
    ``lm_coupling/tasks/offline_data.py`` reads (point ``LM_COUPLING_DATA_DIR``
    at ``dest_dir``). Few-shot splits (``train``, MMLU ``dev``) hold training-side
    rows: ``n_fewshot`` of them, and five per subject for MMLU.

    Args:
        dest_dir: destination folder (created).
        seed: seed passed to ``make_demo_data`` when ``data`` is None.
        n_test: see ``make_demo_data``.
        n_validation: see ``make_demo_data``.
        n_fewshot: rows of each few-shot split.
        data: already generated demo data (its own sizes are used).

    Returns:
        The folder of each benchmark.
    """
    data = data if data is not None else make_demo_data(seed, n_test, n_validation)
    dest_dir = Path(dest_dir)
    folders = {}
    for benchmark in BENCHMARKS:
        splits = dict(data.eval_splits[benchmark])
        fewshot = FEWSHOT_SPLIT[benchmark]
        if fewshot == "dev":
            rows = data.train_rows[benchmark]
            splits[fewshot] = [
                row
                for subject in MMLU_SUBJECTS
                for row in [r for r in rows if r["subject"] == subject][:5]
            ]
        elif fewshot is not None:
            splits[fewshot] = data.train_rows[benchmark][:n_fewshot]
        folder = dest_dir / benchmark
        folder.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(row) + "\n" for row in rows)
        folders[benchmark] = folder
    return folders
