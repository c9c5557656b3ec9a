"""A seeded synthetic world: the knowledge base behind the demo corpus and tasks.

No data sets can be downloaded on our machines, so the demo trains its models
on a world generated here: invented countries, animals and planets with a few
attributes each, activity scripts (for HellaSwag-style completions) and
arithmetic. The same seed always gives the same world.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gl",
    "kr",
    "pl",
    "st",
    "tr",
    "sk",
    "th",
    "sh",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ee")
_CODAS = ("", "", "n", "r", "l", "s", "k", "m", "x", "th")

COLORS = ("red", "blue", "green", "yellow", "white", "black", "brown", "orange")
FOODS = ("seeds", "fish", "leaves", "insects", "fruit", "grass", "roots", "worms")
HABITATS = ("forest", "desert", "river", "mountains", "ocean", "swamp", "jungle", "grassland")
SUBJECTS = (("A man", "he"), ("A woman", "she"), ("A boy", "he"), ("A girl", "she"))

# Activity scripts: a label and steps in order (HellaSwag-style completions).
SCRIPTS = (
    (
        "Making tea",
        (
            "fills a kettle with water.",
            "puts the kettle on the stove.",
            "pours the hot water into a cup.",
            "drops a tea bag into the cup.",
            "drinks the tea slowly.",
        ),
    ),
    (
        "Washing a car",
        (
            "parks the car in the driveway.",
            "sprays the car with a hose.",
            "scrubs the car with a soapy sponge.",
            "rinses the soap off the car.",
            "dries the car with a towel.",
        ),
    ),
    (
        "Planting a tree",
        (
            "digs a deep hole in the garden.",
            "places the young tree in the hole.",
            "fills the hole with soil.",
            "presses the soil down with his hands.",
            "waters the tree with a can.",
        ),
    ),
    (
        "Painting a wall",
        (
            "moves the furniture away from the wall.",
            "covers the floor with old sheets.",
            "opens a can of paint.",
            "rolls the paint onto the wall.",
            "lets the paint dry.",
        ),
    ),
    (
        "Baking bread",
        (
            "mixes flour and water in a bowl.",
            "kneads the dough on the table.",
            "lets the dough rise for an hour.",
            "puts the dough in the oven.",
            "takes the golden bread out of the oven.",
        ),
    ),
    (
        "Riding a bike",
        (
            "puts on a helmet.",
            "sits on the bicycle.",
            "pushes the pedals.",
            "rides down the street.",
            "stops at the corner.",
        ),
    ),
    (
        "Brushing teeth",
        (
            "picks up a toothbrush.",
            "squeezes toothpaste onto the brush.",
            "brushes the teeth for two minutes.",
            "spits into the sink.",
            "rinses the mouth with water.",
        ),
    ),
    (
        "Fishing",
        (
            "walks to the edge of the lake.",
            "puts a worm on the hook.",
            "casts the line into the water.",
            "waits for a fish to bite.",
            "reels in a big fish.",
        ),
    ),
    (
        "Building a fire",
        (
            "gathers dry sticks.",
            "stacks the sticks in a pile.",
            "strikes a match.",
            "lights the sticks.",
            "warms the hands by the fire.",
        ),
    ),
    (
        "Cleaning a window",
        (
            "fills a bucket with warm water.",
            "dips a cloth in the bucket.",
            "wipes the window with the cloth.",
            "dries the glass with paper.",
            "looks through the clean window.",
        ),
    ),
    (
        "Mowing the lawn",
        (
            "pushes the mower out of the shed.",
            "starts the engine.",
            "mows the grass in long rows.",
            "empties the grass bag.",
            "puts the mower back in the shed.",
        ),
    ),
    (
        "Reading a book",
        (
            "takes a book from the shelf.",
            "sits down in a chair.",
            "opens the book to the first page.",
            "reads a few chapters.",
            "closes the book and smiles.",
        ),
    ),
)


@dataclass(frozen=True)
class Relation:
    """One attribute of one kind of entity, with its sentence and question forms.

    ``subject`` renders the entity as a sentence subject ("The glimbat",
    "Zorvia"), ``predicate`` the rest of the statement ("lives in the {v}."),
    ``question`` the question whose answer is the value.
    """

    name: str
    kind: str
    subject: str
    predicate: str
    question: str
    paraphrases: tuple[str, ...]


RELATIONS = (
    Relation(
        "capital",
        "country",
        "{e}",
        "has its capital in {v}.",
        "What is the capital of {e}?",
        ("The capital of {e} is {v}.", "{v} is the capital of {e}.", "{e} has its capital in {v}."),
    ),
    Relation(
        "language",
        "country",
        "{e}",
        "speaks {v}.",
        "What language do people in {e} speak?",
        ("People in {e} speak {v}.", "The language of {e} is {v}.", "{e} speaks {v}."),
    ),
    Relation(
        "color",
        "animal",
        "The {e}",
        "is {v}.",
        "What color is the {e}?",
        ("The {e} is {v}.", "A {e} is {v} in color."),
    ),
    Relation(
        "food",
        "animal",
        "The {e}",
        "eats {v}.",
        "What does the {e} eat?",
        ("The {e} eats {v}.", "The food of the {e} is {v}."),
    ),
    Relation(
        "habitat",
        "animal",
        "The {e}",
        "lives in the {v}.",
        "Where does the {e} live?",
        ("The {e} lives in the {v}.", "You can find the {e} in the {v}."),
    ),
    Relation(
        "star",
        "planet",
        "The planet {e}",
        "orbits the star {v}.",
        "Which star does the planet {e} orbit?",
        ("The planet {e} orbits the star {v}.", "The star of the planet {e} is {v}."),
    ),
    Relation(
        "moons",
        "planet",
        "The planet {e}",
        "has {v} moons.",
        "How many moons does the planet {e} have?",
        ("The planet {e} has {v} moons.", "The number of moons of {e} is {v}."),
    ),
)
RELATION_BY_NAME = {relation.name: relation for relation in RELATIONS}


@dataclass(frozen=True)
class Fact:
    """``entity`` has ``value`` for ``relation``; ``pool`` holds all values of the relation."""

    relation: Relation
    entity: str
    value: str
    pool: tuple[str, ...]

    def statement(self, index: int = 0) -> str:
        """Return paraphrase ``index`` of the fact as a sentence."""
        template = self.relation.paraphrases[index % len(self.relation.paraphrases)]
        return template.format(e=self.entity, v=self.value)

    def question(self) -> str:
        """Return the question whose answer is ``value``."""
        return self.relation.question.format(e=self.entity)


@dataclass
class World:
    """The generated knowledge base: facts grouped by entity kind, scripts, seed."""

    seed: int
    facts: list[Fact] = field(default_factory=list)
    entities: dict[str, list[str]] = field(default_factory=dict)
    people: list[str] = field(default_factory=list)

    def facts_of(self, *relations: str) -> list[Fact]:
        """Return the facts of the named relations, in generation order."""
        return [fact for fact in self.facts if fact.relation.name in relations]


def _invent_names(rng: random.Random, count: int, taken: set[str], syllables: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
        name += rng.choice(_CODAS)
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def make_world(
    seed: int = 0, n_countries: int = 32, n_animals: int = 32, n_planets: int = 16
) -> World:
    """Generate the knowledge base of the demo world, deterministically from ``seed``.

    Args:
        seed: seed of the generator; equal seeds give equal worlds.
        n_countries: countries (capital and language each).
        n_animals: animals (color, food and habitat each).
        n_planets: planets (star and number of moons each).

    Returns:
        The world; ``facts`` lists every (entity, relation, value) triple.

    Raises:
        ValueError: a count is below 4 (multiple-choice items need four values).
    """
    for name, count in (
        ("n_countries", n_countries),
        ("n_animals", n_animals),
        ("n_planets", n_planets),
    ):
        if count < 4:
            raise ValueError(f"{name} must be at least 4 (four answer options), got {count}")
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = [n.capitalize() for n in _invent_names(rng, n_countries, taken, 2)]
    cities = [n.capitalize() for n in _invent_names(rng, n_countries, taken, 1)]
    languages = [n.capitalize() + "ish" for n in _invent_names(rng, 8, taken, 1)]
    animals = _invent_names(rng, n_animals, taken, 2)
    planets = [n.capitalize() for n in _invent_names(rng, n_planets, taken, 2)]
    stars = [n.capitalize() for n in _invent_names(rng, 6, taken, 1)]
    people = [n.capitalize() for n in _invent_names(rng, 12, taken, 1)]
    world = World(
        seed=seed,
        entities={"country": countries, "animal": animals, "planet": planets},
        people=people,
    )
    pools = {
        "capital": tuple(cities),
        "language": tuple(languages),
        "color": COLORS,
        "food": FOODS,
        "habitat": HABITATS,
        "star": tuple(stars),
        "moons": tuple(str(k) for k in range(10)),
    }
    for relation in RELATIONS:
        pool = pools[relation.name]
        for index, entity in enumerate(world.entities[relation.kind]):
            value = pool[index] if relation.name == "capital" else rng.choice(pool)
            world.facts.append(Fact(relation, entity, value, pool))
    return world
