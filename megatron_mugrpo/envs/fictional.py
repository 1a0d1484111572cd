"""A seeded world of fictional people and cities: a search corpus and questions only searching can answer.

Every name is made up from syllables, so no model knows an answer beforehand. Each person and each
city is one document; a question names one entity and asks for an attribute (1 hop: one search) or
for an attribute of the city a person was born in (2 hops: the person's document gives the city, the
city's document gives the answer, which the person's document does not hold).

    people   "Ada Quill is a painter. Ada Quill was born in Veloria in 1901."
    cities   "Veloria is a city in Norland. It was founded in 1432. The river Omsa flows through Veloria."

    1 hop    In which city was Ada Quill born?                → Veloria
             What is the profession of Ada Quill?             → painter
             In which country is Veloria?                     → Norland
    2 hops   In which country was Ada Quill born?             → Norland
             Which river flows through the city where Ada Quill was born? → Omsa

First names come from a small pool, so several people share one and a search for a person can rank
another person's document first: a policy that answers from the first document it gets is wrong
some of the time, which only the reward reveals.

    python -m megatron_mugrpo.envs.fictional --out data/search --seed 0
    → data/search/{corpus,train,test}.jsonl    (corpus: {"id","title","text"}; questions: data.format qa)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_mugrpo.envs.server import CorpusDocument
from megatron_mugrpo.errors import InputError

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "tr", "st")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io")
_CODAS = ("", "n", "r", "l", "s", "th", "m")
PROFESSIONS = ("painter", "sailor", "baker", "astronomer", "weaver", "architect", "poet", "smith", "botanist")
MAX_ENTITIES = 20_000
"""Most entities of one kind: far below the 2-syllable names the syllables make (~870,000)."""
NAME_SYLLABLES = 2
"""Syllables of a first name, surname, country and river by default (a city has one more)."""
FIRST_NAME_POOL = 12
"""Distinct first names: far fewer than people, so first names repeat across people (see the docstring)."""


@dataclass(frozen=True, kw_only=True)
class City:
    name: str
    country: str
    founded: int
    river: str


@dataclass(frozen=True, kw_only=True)
class Person:
    name: str
    profession: str
    city: City
    born: int


@dataclass(frozen=True, kw_only=True)
class World:
    cities: list[City]
    people: list[Person]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).title()


def _unique_words(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    words: list[str] = []
    while len(words) < count:
        word = _word(rng, syllables)
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def _distinct_words(syllables: int) -> int:
    return (len(_ONSETS) * len(_VOWELS) * len(_CODAS)) ** syllables


def make_world(
    seed: int,
    *,
    people: int = 200,
    cities: int = 40,
    countries: int = 8,
    syllables: int = NAME_SYLLABLES,
    first_names: bool = True,
) -> World:
    """The world of ``seed``: the same seed gives the same world on every platform.

    ``syllables`` sets the length of every name (a city's has one more): the search demo uses 1, short
    names a character-level model copies in few warm-start steps ("Bo Tral", born in "Velo"). Without
    ``first_names`` a person is named by the surname alone ("Tral")."""
    if min(people, cities, countries) < 1 or max(people, cities, countries) > MAX_ENTITIES:
        raise InputError(f"people={people}, cities={cities}, countries={countries} must each be in 1..{MAX_ENTITIES}")
    names = countries + 2 * cities + FIRST_NAME_POOL + people
    if syllables < 1 or names > _distinct_words(syllables) // 4:  # a quarter: rejection sampling stays quick
        raise InputError(
            f"--syllables {syllables} gives {_distinct_words(syllables) if syllables >= 1 else 0} distinct words, "
            f"too few for {names} names (countries + 2 x cities + {FIRST_NAME_POOL} first names + people): "
            "raise --syllables or make the world smaller"
        )
    rng = random.Random(seed)
    taken: set[str] = set()
    country_names = _unique_words(rng, countries, syllables, taken)
    rivers = _unique_words(rng, cities, syllables, taken)
    city_list = [
        City(name=name, country=rng.choice(country_names), founded=rng.randint(800, 1800), river=river)
        for name, river in zip(_unique_words(rng, cities, syllables + 1, taken), rivers)
    ]
    first_pool = _unique_words(rng, FIRST_NAME_POOL, syllables, taken)  # drawn either way: the same surnames
    surnames = _unique_words(rng, people, syllables, taken)  # full names stay unique
    person_list = [
        Person(
            name=f"{rng.choice(first_pool)} {surname}" if first_names else surname,
            profession=rng.choice(PROFESSIONS),
            city=rng.choice(city_list),
            born=rng.randint(1800, 2000),
        )
        for surname in surnames
    ]
    return World(cities=city_list, people=person_list)


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def corpus_rows(world: World) -> list[dict[str, str]]:
    """One document per city and per person: ``{"id", "title", "text"}``."""
    rows = [
        {
            "id": f"city-{i}",
            "title": c.name,
            "text": f"{c.name} is a city in {c.country}. It was founded in {c.founded}. "
            f"The river {c.river} flows through {c.name}.",
        }
        for i, c in enumerate(world.cities)
    ]
    rows += [
        {
            "id": f"person-{i}",
            "title": p.name,
            "text": f"{p.name} is {_article(p.profession)} {p.profession}. "
            f"{p.name} was born in {p.city.name} in {p.born}.",
        }
        for i, p in enumerate(world.people)
    ]
    return rows


def world_documents(world: World) -> list[CorpusDocument]:
    """The world's corpus as documents, for an in-memory index: ``corpus_rows`` without a file between."""
    return [CorpusDocument(**row) for row in corpus_rows(world)]


def question_rows(world: World) -> list[dict[str, object]]:
    """Every 1-hop and 2-hop question of the world: ``{"id", "question", "answers", "hops"}``."""
    rows: list[dict[str, object]] = []

    def add(question: str, answer: str, hops: int) -> None:
        rows.append({"id": f"q{len(rows)}", "question": question, "answers": [answer], "hops": hops})

    for c in world.cities:
        add(f"In which country is {c.name}?", c.country, 1)
    for p in world.people:
        add(f"In which city was {p.name} born?", p.city.name, 1)
        add(f"What is the profession of {p.name}?", p.profession, 1)
        add(f"In which country was {p.name} born?", p.city.country, 2)
        add(f"Which river flows through the city where {p.name} was born?", p.city.river, 2)
    return rows


def split_questions(
    rows: list[dict[str, object]], *, test_fraction: float, seed: int
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(train, test): a seeded shuffle cut at ``test_fraction``."""
    if not 0.0 < test_fraction < 1.0:
        raise InputError(f"--test-fraction {test_fraction} must be in (0, 1)")
    order = list(rows)
    random.Random(seed + 1).shuffle(order)
    cut = max(1, round(len(order) * test_fraction))
    return order[cut:], order[:cut]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def write_task(
    out: Path,
    seed: int,
    *,
    people: int = 200,
    cities: int = 40,
    countries: int = 8,
    syllables: int = NAME_SYLLABLES,
    first_names: bool = True,
    test_fraction: float = 0.2,
) -> dict[str, int]:
    """Write ``out/{corpus,train,test}.jsonl``; returns their row counts."""
    world = make_world(
        seed, people=people, cities=cities, countries=countries, syllables=syllables, first_names=first_names
    )
    train, test = split_questions(question_rows(world), test_fraction=test_fraction, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus_rows(world)
    write_jsonl(out / "corpus.jsonl", corpus)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    return {"corpus": len(corpus), "train": len(train), "test": len(test)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for corpus.jsonl, train.jsonl, test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--people", type=int, default=200)
    parser.add_argument("--cities", type=int, default=40)
    parser.add_argument("--countries", type=int, default=8)
    parser.add_argument("--syllables", type=int, default=NAME_SYLLABLES, help="syllables per name")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    args = parser.parse_args(argv)
    try:
        counts = write_task(
            args.out,
            args.seed,
            people=args.people,
            cities=args.cities,
            countries=args.countries,
            syllables=args.syllables,
            test_fraction=args.test_fraction,
        )
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(" ".join(f"{name}={n}" for name, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
