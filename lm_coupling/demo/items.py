"""Benchmark items over the demo world, with the Hugging Face hub data sets' fields.

Each builder turns facts, scripts or arithmetic into rows laid out as the hub
data set that the stock lm-eval task reads (allenai/ai2_arc, openai/gsm8k,
Rowan/hellaswag, cais/mmlu, truthful_qa ``multiple_choice``,
allenai/winogrande). ``choice_requests`` renders a row in its task's zero-shot
prompt format, one (context, continuation) pair per choice, and
``answered_text`` joins the gold pair, as training text. Rows come out in a
seeded order.
"""

from __future__ import annotations

import random
import re
from typing import Any

from lm_coupling.demo.world import SCRIPTS, SUBJECTS, Fact, World

Row = dict[str, Any]
LETTERS = ("A", "B", "C", "D")
ARC_RELATIONS = {
    "arc_easy": ("color", "food", "habitat"),
    "arc_challenge": ("capital", "language", "star"),
}
MMLU_RELATIONS = {"astronomy": ("star", "moons"), "high_school_biology": ("food", "habitat")}
WINOGRANDE_RELATIONS = ("capital", "color", "food", "habitat", "star")
MC_BENCHMARKS = ("arc_easy", "arc_challenge", "hellaswag", "mmlu", "truthfulqa", "winogrande")
_ITEMS = (
    ("apples", "buys"),
    ("marbles", "finds"),
    ("stamps", "gets"),
    ("shells", "picks up"),
    ("cookies", "bakes"),
    ("pencils", "buys"),
)


def _options(value: str, pool: tuple[str, ...], rng: random.Random) -> tuple[list[str], int]:
    """Return ``value`` and three other values of ``pool`` in random order, and its index."""
    wrong = rng.sample([other for other in pool if other != value], 3)
    answer = rng.randrange(4)
    return wrong[:answer] + [value] + wrong[answer:], answer


def arc_rows(world: World, benchmark: str, rng: random.Random) -> list[Row]:
    """ARC rows (``id, question, choices{text,label}, answerKey``) for ``benchmark``."""
    rows = []
    for index, fact in enumerate(world.facts_of(*ARC_RELATIONS[benchmark])):
        texts, answer = _options(fact.value, fact.pool, rng)
        rows.append(
            {
                "id": f"lmc-{benchmark}-{world.seed}-{index}",
                "question": fact.question(),
                "choices": {"text": texts, "label": list(LETTERS)},
                "answerKey": LETTERS[answer],
            }
        )
    return rows


def _arithmetic(rng: random.Random) -> tuple[int, int, str, int]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        return a, b, op, a * b
    a, b = rng.randint(1, 10), rng.randint(1, 10)
    if op == "-":
        a, b = max(a, b) + 1, min(a, b)
        return a, b, op, a - b
    return a, b, op, a + b


def mmlu_rows(world: World, rng: random.Random, n_math: int = 60) -> list[Row]:
    """MMLU rows (``question, subject, choices, answer``): facts and arithmetic."""
    rows = []
    for subject, relations in MMLU_RELATIONS.items():
        for fact in world.facts_of(*relations):
            choices, answer = _options(fact.value, fact.pool, rng)
            rows.append(
                {
                    "question": fact.question(),
                    "subject": subject,
                    "choices": choices,
                    "answer": answer,
                }
            )
    seen = set()
    while len(seen) < n_math:
        a, b, op, result = _arithmetic(rng)
        if (a, b, op) in seen:
            continue
        seen.add((a, b, op))
        pool = [str(v) for v in range(max(0, result - 4), result + 5) if v != result]
        wrong = rng.sample(pool, 3)
        answer = rng.randrange(4)
        rows.append(
            {
                "question": f"What is {a} {op} {b}?",
                "subject": "elementary_mathematics",
                "choices": wrong[:answer] + [str(result)] + wrong[answer:],
                "answer": answer,
            }
        )
    return rows


def gsm8k_rows(world: World, rng: random.Random, n: int = 400) -> list[Row]:
    """GSM8K rows (``question, answer``), the answer worked and ending ``#### N``."""
    rows, seen = [], set()
    while len(rows) < n:
        a, b, op, result = _arithmetic(rng)
        name = rng.choice(world.people)
        items, verb = rng.choice(_ITEMS)
        key = (a, b, op, name, items)
        if key in seen:
            continue
        seen.add(key)
        if op == "+":
            question = (
                f"{name} has {a} {items}. {name} {verb} {b} more {items}. "
                f"How many {items} does {name} have now?"
            )
        elif op == "-":
            question = (
                f"{name} has {a} {items}. {name} gives away {b} {items}. "
                f"How many {items} does {name} have left?"
            )
        else:
            question = (
                f"{name} has {a} boxes with {b} {items} in each box. "
                f"How many {items} does {name} have?"
            )
        work = f"{name} has {a} {op} {b} = <<{a}{op}{b}={result}>>{result} {items}."
        rows.append({"question": question, "answer": f"{work}\n#### {result}"})
    return rows


def hellaswag_rows(rng: random.Random) -> list[Row]:
    """HellaSwag rows: a script step as context, the next step among three others."""
    rows = []
    for script_index, (label, steps) in enumerate(SCRIPTS):
        others = [step for j, (_, s) in enumerate(SCRIPTS) if j != script_index for step in s]
        for position in range(len(steps) - 1):
            for subject, pronoun in SUBJECTS:
                texts, answer = _options(steps[position + 1], tuple(others), rng)
                ctx_a = f"{subject} {steps[position]}"
                if pronoun == "she":
                    ctx_a = ctx_a.replace(" his ", " her ")
                    texts = [text.replace(" his ", " her ") for text in texts]
                index = len(rows)
                rows.append(
                    {
                        "ind": index,
                        "activity_label": label,
                        "ctx_a": ctx_a,
                        "ctx_b": pronoun,
                        "ctx": f"{ctx_a} {pronoun}",
                        "endings": texts,
                        "source_id": f"lmc~{index}",
                        "split": "val",
                        "split_type": "indomain",
                        "label": str(answer),
                    }
                )
    return rows


def truthfulqa_rows(world: World, rng: random.Random) -> list[Row]:
    """TruthfulQA ``multiple_choice`` rows: true statements first, as in the hub data."""
    rows = []
    for fact in world.facts:
        wrong = rng.sample([value for value in fact.pool if value != fact.value], 3)
        false = [Fact(fact.relation, fact.entity, value, fact.pool).statement() for value in wrong]
        rows.append(
            {
                "question": fact.question(),
                "mc1_targets": {"choices": [fact.statement(), *false], "labels": [1, 0, 0, 0]},
                "mc2_targets": {
                    "choices": [fact.statement(), fact.statement(1), *false[:2]],
                    "labels": [1, 1, 0, 0],
                },
            }
        )
    return rows


def winogrande_rows(world: World, rng: random.Random) -> list[Row]:
    """WinoGrande rows: two entities, one blank, the continuation names a fact."""
    rows = []
    for fact in world.facts_of(*WINOGRANDE_RELATIONS):
        rivals = [
            other.entity
            for other in world.facts_of(fact.relation.name)
            if other.value != fact.value
        ]
        rival = rng.choice(rivals)
        first, second = (fact.entity, rival) if rng.random() < 0.5 else (rival, fact.entity)
        article = "" if fact.relation.kind == "country" else "the "
        subject = fact.relation.subject.format(e="_")
        predicate = fact.relation.predicate.format(v=fact.value)
        sentence = f"We talked about {article}{first} and {article}{second}. {subject} {predicate}"
        rows.append(
            {
                "sentence": sentence,
                "option1": first,
                "option2": second,
                "answer": "1" if first == fact.entity else "2",
            }
        )
    return rows


def question_prompt(question: str) -> str:
    r"""The ARC and GSM8K prompt ``"Question: {q}\nAnswer:"``."""
    return f"Question: {question}\nAnswer:"


def mmlu_header(subject: str) -> str:
    """The MMLU task description that opens a prompt about ``subject``."""
    return (
        "The following are multiple choice questions (with answers) about "
        f"{subject.replace('_', ' ')}.\n\n"
    )


def hellaswag_clean(text: str) -> str:
    """lm-eval's ``hellaswag.utils.preprocess``."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def choice_requests(benchmark: str, row: Row) -> tuple[list[tuple[str, str]], int]:
    """Return the (context, continuation) pair of each choice and the gold index.

    The row's own zero-shot prompt in its lm-eval format, without what the
    task puts before every row (the MMLU description, the TruthfulQA prefix).

    Raises:
        ValueError: ``benchmark`` is not multiple choice.
    """
    if benchmark in ARC_RELATIONS:
        context = question_prompt(row["question"])
        texts = row["choices"]["text"]
        return [(context, f" {t}") for t in texts], row["choices"]["label"].index(row["answerKey"])
    if benchmark == "mmlu":
        options = "".join(
            f"\n{letter}. {text}" for letter, text in zip(LETTERS, row["choices"], strict=True)
        )
        context = f"{row['question'].strip()}{options}\nAnswer:"
        return [(context, f" {letter}") for letter in LETTERS], int(row["answer"])
    if benchmark == "hellaswag":
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        context = hellaswag_clean(row["activity_label"] + ": " + ctx)
        return [(context, " " + hellaswag_clean(e)) for e in row["endings"]], int(row["label"])
    if benchmark == "truthfulqa":
        context = f"Q: {row['question']}\nA:"
        return [(context, f" {c}") for c in row["mc1_targets"]["choices"]], 0
    if benchmark == "winogrande":
        index = row["sentence"].index("_")
        target = " " + row["sentence"][index + 1 :].strip()
        pairs = [
            (row["sentence"][:index] + option, target)
            for option in (row["option1"], row["option2"])
        ]
        return pairs, {"1": 0, "2": 1}[row["answer"]]
    raise ValueError(f"{benchmark!r} is not a multiple-choice benchmark; use {MC_BENCHMARKS}")


def answered_text(benchmark: str, row: Row) -> str:
    """Render ``row`` in its lm-eval prompt format followed by the right answer.

    Args:
        benchmark: one of ``arc_easy, arc_challenge, gsm8k, hellaswag, mmlu,
            truthfulqa, winogrande``.
        row: a row of that benchmark.

    Raises:
        ValueError: unknown benchmark.
    """
    if benchmark == "gsm8k":
        return f"{question_prompt(row['question'])} {row['answer']}"
    if benchmark not in MC_BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; expected one of {BENCHMARKS}")
    pairs, gold = choice_requests(benchmark, row)
    return "".join(pairs[gold])


def all_rows(world: World, seed: int) -> dict[str, list[Row]]:
    """Every candidate row of every benchmark, each list in a seeded random order."""
    rng = random.Random(f"items-{seed}")
    rows = {
        "arc_easy": arc_rows(world, "arc_easy", rng),
        "arc_challenge": arc_rows(world, "arc_challenge", rng),
        "gsm8k": gsm8k_rows(world, rng),
        "hellaswag": hellaswag_rows(rng),
        "mmlu": mmlu_rows(world, rng),
        "truthfulqa": truthfulqa_rows(world, rng),
        "winogrande": winogrande_rows(world, rng),
    }
    for values in rows.values():
        rng.shuffle(values)
    return rows


BENCHMARKS = ("arc_easy", "arc_challenge", "gsm8k", "hellaswag", "mmlu", "truthfulqa", "winogrande")
