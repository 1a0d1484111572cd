"""The search demo's starting point: a seeded fictional world and a tiny model warm-started on Search-R1's format.

    python -m megatron_mugrpo.envs.search_demo --out runs/search_demo/inputs --seed 0 [--steps 3000]
    → corpus.jsonl, train.jsonl, test.jsonl (envs/fictional.py) and base_model/ (a Hugging Face directory
      with the demo's character tokenizer), then: mugrpo train --config configs/demo_search_cpu.yaml ...

A warm-start trace is what the search environment would produce for a policy that searches well, token
for token: the question's prompt (``rewards.qa.qa_prompt``, as ``data.format: qa`` builds it), policy
turns ``<search>ENTITY</search>``, the observation the environment returns for that query (the same
BM25 index, formatting and token ids, ``SearchEnvironment.observation``), and a final
``<answer>VALUE</answer>``. The loss covers the policy's tokens only, as the RL losses do
(``--context-loss`` adds the prompt and observations; it did not make the model copy sooner).

The demo's world is small on purpose (``DEMO_WORLD``): the traces are of its own training questions, so
the model learns its names, and a held-out question asks another attribute of an entity it has seen.
A model warm-started on other worlds (``--worlds``) must copy names it never saw: after 600 steps it
copied none (held-out exact match 0.0), against 0.06 for 600 steps on the demo's own world.

    1 hop    <search>Ada Quill</search> <information>…</information> <answer>Veloria</answer>
    2 hops   <search>Ada Quill</search> <information>…</information> <search>Veloria</search> <information>…
             </information> <answer>Norland</answer>

The flaw only the reward reveals (``flaw``, 0.8 in the demo): that fraction of the drawn 2-hop traces answers
after the first search from the first retrieved document, which is about the person, not the city the
question asks about (it answers the birth city for "In which country was Ada Quill born?"). A second flaw
(``guess``, 0.7 in the demo): that fraction of the drawn 1-hop traces answers at once, without searching, with
another value of the right kind (``<answer>Norland</answer>`` for a city in Veloria), as a model that answers
from memory does.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_mugrpo.envs.base import EnvLimits
from megatron_mugrpo.envs.fictional import World, make_world, question_rows, world_documents, write_task
from megatron_mugrpo.envs.search import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    SearchEnvironment,
    SearchOptions,
    parse_results,
)
from megatron_mugrpo.envs.server import Bm25Index, CorpusDocument, load_corpus
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.rewards.qa import qa_prompt

_ENTITY = re.compile(
    r"^(?:In which city was (?P<born>.+) born|What is the profession of (?P<prof>.+)|In which country is (?P<city>.+)"
    r"|In which country was (?P<country2>.+) born|Which river flows through the city where (?P<river2>.+) was born)\?$"
)
_BORN = re.compile(r"was born in (\w+)")
_PROFESSION = re.compile(r" is an? (\w+)\.")
_COUNTRY = re.compile(r"is a city in (\w+)\.")
_RIVER = re.compile(r"The river (\w+) flows")
_TWO_HOPS = re.compile(r"^(In which country was|Which river flows)")
ONE_HOP_KINDS = ("born", "prof", "city")
IGNORE = -100
DEMO_WORLD = {"people": 60, "cities": 12, "countries": 4, "syllables": 1}
"""The demo's world: 72 documents, 202 training and 50 held-out questions, one-syllable names ("Fim Bal", born
in "Travaem"), small enough that 1,500 warm-start steps teach its names (longer names and 200 people were
not copied after 800 steps)."""
WARM_SEED = 10_000
"""Warm-start worlds' seeds start here, far from the demo seeds (0, 1, 2, ...) they must not repeat."""
LOG_EVERY = 50
"""Warm-start steps between progress lines on stderr."""
"""Label of a token the warm-start loss skips (prompt, observations, padding)."""


@dataclass(kw_only=True)
class WarmStart:
    """The supervised phase of the search demo."""

    steps: int = 3000
    """Measured on the demo's world (seed 0): 600 steps copy few names (held-out exact match 0.06 at T = 1),
    1,500 reach 0.20 (docs/agentic.md). With both flaws, μ-GRPO's held-out gain at seeds 0–2 grows with the
    warm start: +0.105 ± 0.053 after 1,500 steps, +0.212 ± 0.079 after 2,500, +0.370 ± 0.084 after 3,000
    (each seed ≥ +0.30): the sound traces it learns to prefer copy the question's name more often."""
    batch_size: int = 16
    lr: float = 3e-3
    flaw: float = 0.8
    """Fraction of the 2-hop traces that answer from the first document of their first search. Measured at seed 0
    with entity tokens: 0.5 leaves 2-hop questions half solved before RL (held-out exact match 0.36, 1.4 searches
    on 2-hop questions) and little to gain; 0.8 starts them near 1.1 searches (held-out 0.30) and μ-GRPO raises
    both (docs/agentic.md, "The search demo")."""
    guess: float = 0.7
    """Fraction of the 1-hop traces that answer without searching: a confabulated value of the right kind (another
    city, profession or country of the world, fixed per question: ``confabulation``), the flaw of a model that
    answers from memory instead of retrieving. Without it only the 2-hop half of the held-out questions has
    anything for RL to fix: held-out gains +0.135, +0.105, −0.05 at seeds 0–2 with 0 (2-hop flaw only), +0.11,
    +0.155, +0.05 with 0.7, both after 1,500 warm-start steps (docs/agentic.md, "The search demo")."""
    topk: int = 1
    """Documents per search, as ``env.search.topk`` of the demo (the observations must match)."""
    max_observation_tokens: int = 256
    worlds: int = 0
    """0: traces of the demo world's training questions; n > 0: traces of every question of n other worlds of
    the same shape (seeds ``WARM_SEED + 100 * seed + i``, their own indexes), so the base model has never
    seen the demo's names and has to copy them rather than recall a memorised search."""
    entity_tokens: bool = True
    """Give every name of the world (people, cities, countries, rivers) and every profession one token of its own
    (``add_entity_tokens``). A character-level model must learn to copy a name letter by letter, which 1,500
    steps do not teach: it recalls the searches of its training questions and misspells the names of held-out
    ones (seed 0: the first query names the question's entity in 96% of training and 28% of held-out
    trajectories). One token per name makes copying one attention step, as a subword vocabulary that holds
    frequent names does."""
    context_loss: bool = False
    """Also predict the prompt's and the observations' tokens (RL never does): the observations repeat
    names (title, text), copying practice for the heads that copy names into the policy's turns."""

    def __post_init__(self) -> None:
        for flag, ok in (
            (f"--steps {self.steps} must be >= 1", self.steps >= 1),
            (f"--batch-size {self.batch_size} must be >= 1", self.batch_size >= 1),
            (f"--lr {self.lr} must be > 0", self.lr > 0),
            (f"--flaw {self.flaw} must be in [0, 1]", 0.0 <= self.flaw <= 1.0),
            (f"--guess {self.guess} must be in [0, 1]", 0.0 <= self.guess <= 1.0),
            (f"--topk {self.topk} must be >= 1 (env.search.topk of the demo)", self.topk >= 1),
            (f"--worlds {self.worlds} must be >= 0 (0: the demo world's own training questions)", self.worlds >= 0),
        ):
            if not ok:
                raise InputError(flag)


class LocalIndex:
    """``SearchClient``'s ``retrieve`` over an in-process BM25 index (no HTTP: the warm start's searches)."""

    def __init__(self, corpus: Path | list[CorpusDocument]) -> None:
        self.index = Bm25Index(load_corpus(corpus) if isinstance(corpus, Path) else corpus)

    def retrieve(self, queries: Sequence[str], topk: int) -> list[Any]:
        return parse_results({"result": self.index.search(list(queries), topk)}, len(queries))


def _attribute(kind: str, text: str) -> str:
    pattern = {"born": _BORN, "prof": _PROFESSION, "city": _COUNTRY, "country": _COUNTRY, "river": _RIVER}[kind]
    found = pattern.search(text)
    return found.group(1) if found else ""


def attribute_values(documents: Sequence[CorpusDocument]) -> dict[str, list[str]]:
    """Every answer a 1-hop question of each kind has in a corpus (``born``: the cities people are born in,
    ``prof``: the professions, ``city``: the countries): what a confabulated answer is drawn from."""
    return {kind: sorted({_attribute(kind, d.text) for d in documents} - {""}) for kind in ONE_HOP_KINDS}


def confabulation(question: str, right: str, values: Sequence[str]) -> str:
    """The wrong answer a flawed 1-hop trace gives without searching: one of ``values`` other than ``right``,
    the same for the same question in every run (crc32 of its text, not Python's salted hash)."""
    wrong = [v for v in values if v != right]
    if not wrong:
        raise InputError(f"the search demo cannot confabulate an answer to {question!r}: its world has one value")
    return wrong[zlib.crc32(question.encode()) % len(wrong)]


def _question(question: str) -> tuple[str, str]:
    match = _ENTITY.match(question.strip())
    if match is None:
        raise InputError(f"the search demo cannot write a trace for {question!r} (not a fictional.py question)")
    return next((k, v) for k, v in match.groupdict().items() if v is not None)


def trace(
    question: str, env: SearchEnvironment, *, flawed: bool, values: dict[str, list[str]] | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """[(policy text, observation ids after it)] of one warm-start trajectory (the last has no observation).

    ``flawed``: a 2-hop trace answers from its first document; a 1-hop trace, when ``values``
    (``attribute_values``) are given, answers at once with a ``confabulation`` and never searches."""
    kind, entity = _question(question)
    turns: list[tuple[str, tuple[int, ...]]] = []

    def search(query: str) -> str:
        documents = env.client.retrieve([query], env.options.topk)[0]
        turns.append((f"{SEARCH_OPEN}{query}{SEARCH_CLOSE}", env.observation(documents)))
        own = [d for d in documents if d.title == query]
        return (own[0] if own and not flawed else documents[0]).text

    text = search(entity)
    if flawed and values is not None and kind in ONE_HOP_KINDS:
        guess = confabulation(question, _attribute(kind, text), values[kind])
        return [(f"{ANSWER_OPEN}{guess}{ANSWER_CLOSE}", ())]
    if kind in ("country2", "river2"):
        city = _attribute("born", text)
        if not flawed:
            text = search(city)
        answer = city if flawed else _attribute("country" if kind == "country2" else "river", text)
    else:
        answer = _attribute(kind, text)
    turns.append((f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}", ()))
    return turns


def entity_names(world: World) -> list[str]:
    """The words ``entity_tokens`` makes single tokens: full names of people, cities, countries, rivers, professions."""
    names = {p.name for p in world.people} | {p.profession for p in world.people}
    names |= {c.name for c in world.cities} | {c.country for c in world.cities} | {c.river for c in world.cities}
    return sorted(names)


def add_entity_tokens(tokenizer: Any, names: Sequence[str]) -> int:
    """Add ``names`` to ``tokenizer`` as whole-word tokens (never matched inside a longer word: the river "Ki" is
    not a piece of "Kios"); returns how many were new. Decoding gives the names' text back, so the environment
    and the reward read the same strings as with the character tokenizer."""
    from tokenizers import AddedToken

    return tokenizer.add_tokens([AddedToken(name, single_word=True, normalized=False) for name in names])


def trace_example(
    question: str,
    env: SearchEnvironment,
    tokenizer: Any,
    *,
    flawed: bool,
    context_loss: bool = False,
    values: dict[str, list[str]] | None = None,
) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one trace: labels on the policy's tokens and the closing EOS only, or on every
    token but the first with ``context_loss``."""
    ids = list(tokenizer(qa_prompt(question))["input_ids"])
    labels = list(ids) if context_loss else [IGNORE] * len(ids)
    for text, observation in trace(question, env, flawed=flawed, values=values):
        turn = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += turn + list(observation)
        labels += turn + (list(observation) if context_loss else [IGNORE] * len(observation))
    return [*ids, tokenizer.eos_token_id], [*labels, tokenizer.eos_token_id]


def trace_pair(
    question: str,
    env: SearchEnvironment,
    tokenizer: Any,
    *,
    context_loss: bool = False,
    values: dict[str, list[str]] | None = None,
) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """(sound, flawed) examples of one question; for a 1-hop question without ``values`` the same example twice
    (no flaw).

    The warm start draws the flawed one (with probability ``flaw`` for a 2-hop question, ``guess`` for a 1-hop
    one) each time it draws the question, never once per question: a question whose trace were always flawed
    would be memorised as such, its G rollouts would all fail alike and give μ-GRPO no advantage to learn from
    (measured: a warm start with per-question flaws left the training reward flat at 0.78 over 4 stages)."""
    sound = trace_example(question, env, tokenizer, flawed=False, context_loss=context_loss)
    if not _TWO_HOPS.match(question) and values is None:
        return sound, sound
    return sound, trace_example(question, env, tokenizer, flawed=True, context_loss=context_loss, values=values)


@dataclass(frozen=True)
class TraceWorld:
    """A world the warm start traces: the environment its traces search, and the values its confabulated 1-hop
    answers are drawn from (``attribute_values`` of the same corpus)."""

    env: SearchEnvironment
    values: dict[str, list[str]]


def trace_world(documents: list[CorpusDocument], tokenizer: Any, limits: EnvLimits, topk: int) -> TraceWorld:
    """The ``TraceWorld`` of a corpus: an in-process index over ``documents`` and their attribute values."""
    env = SearchEnvironment(
        tokenizer=tokenizer, limits=limits, options=SearchOptions(topk=topk), client=LocalIndex(documents)
    )
    return TraceWorld(env=env, values=attribute_values(documents))


def warm_start(
    model: torch.nn.Module,
    tokenizer: Any,
    questions: Sequence[tuple[str, TraceWorld]],
    ws: WarmStart,
    seed: int,
) -> list[float]:
    """``ws.steps`` AdamW steps on traces of ``questions`` (each with the world it is asked in; seeded order and
    flaws, a flaw drawn per drawn trace: ``trace_pair``); the loss per step."""
    rng = random.Random(seed)
    examples = [
        (
            *trace_pair(
                q, world.env, tokenizer, context_loss=ws.context_loss, values=world.values if ws.guess else None
            ),
            _flaw_rate(q, ws),
        )
        for q, world in questions
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / ws.steps)
    model.train()
    losses = []
    for _ in range(ws.steps):
        drawn = [examples[rng.randrange(len(examples))] for _ in range(ws.batch_size)]
        batch = _pad([(sound, flawed)[rng.random() < rate] for sound, flawed, rate in drawn], tokenizer.pad_token_id)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if len(losses) % LOG_EVERY == 0:  # minutes per hundred steps on a shared CPU: say where it is
            print(f"warm start step {len(losses)}/{ws.steps} loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
    model.eval()
    return losses


def _flaw_rate(question: str, ws: WarmStart) -> float:
    return ws.flaw if _TWO_HOPS.match(question) else ws.guess


def _pad(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), length), pad_id)
    labels = torch.full((len(examples), length), IGNORE)
    mask = torch.zeros(len(examples), length, dtype=torch.long)
    for row, (seq, lab) in enumerate(examples):
        ids[row, : len(seq)], labels[row, : len(lab)], mask[row, : len(seq)] = (
            torch.tensor(seq),
            torch.tensor(lab),
            1,
        )
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def build_demo(
    out: Path,
    *,
    seed: int,
    ws: WarmStart,
    tiny: Any,
    people: int = 200,
    cities: int = 40,
    countries: int = 8,
    syllables: int = 2,
    first_names: bool = True,
) -> dict:
    """Write the world (``out/{corpus,train,test}.jsonl``) and the warm-started ``out/base_model``."""
    from megatron_mugrpo.char_tokenizer import build_char_tokenizer
    from megatron_mugrpo.warmstart import build_tiny_model

    shape = {"people": people, "cities": cities, "countries": countries, "syllables": syllables}
    shape |= {"first_names": first_names}
    counts = write_task(out, seed, **shape)
    tokenizer = build_char_tokenizer()
    worlds = [make_world(WARM_SEED + 100 * seed + i, **shape) for i in range(ws.worlds)]
    if ws.entity_tokens:
        for world in [make_world(seed, **shape), *worlds]:
            add_entity_tokens(tokenizer, entity_names(world))
    tokenizer.save_pretrained(str(out / "base_model"))
    limits = EnvLimits(max_observation_tokens=ws.max_observation_tokens, max_total_tokens=tiny.max_position_embeddings)
    if ws.worlds == 0:
        traced = trace_world(load_corpus(out / "corpus.jsonl"), tokenizer, limits, ws.topk)
        rows = (out / "train.jsonl").read_text().splitlines()
        questions = [(json.loads(line)["question"], traced) for line in rows]
    else:
        questions = []
        for world in worlds:
            traced = trace_world(world_documents(world), tokenizer, limits, ws.topk)
            questions += [(str(row["question"]), traced) for row in question_rows(world)]
    model = build_tiny_model(tiny, tokenizer, seed=seed)
    losses = warm_start(model, tokenizer, questions, ws, seed)
    model.save_pretrained(str(out / "base_model"), safe_serialization=True)
    return counts | {"final_loss": losses[-1] if losses else float("nan")}


def main(argv: list[str] | None = None) -> int:
    from megatron_mugrpo.warmstart import TinyModelConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WarmStart.steps)
    parser.add_argument("--batch-size", type=int, default=WarmStart.batch_size)
    parser.add_argument("--flaw", type=float, default=WarmStart.flaw)
    parser.add_argument("--guess", type=float, default=WarmStart.guess)
    parser.add_argument("--people", type=int, default=DEMO_WORLD["people"])
    parser.add_argument("--cities", type=int, default=DEMO_WORLD["cities"])
    parser.add_argument("--countries", type=int, default=DEMO_WORLD["countries"])
    parser.add_argument("--syllables", type=int, default=DEMO_WORLD["syllables"])
    parser.add_argument("--topk", type=int, default=WarmStart.topk)
    parser.add_argument("--lr", type=float, default=WarmStart.lr)
    parser.add_argument("--worlds", type=int, default=WarmStart.worlds)
    parser.add_argument("--first-names", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--entity-tokens", action=argparse.BooleanOptionalAction, default=WarmStart.entity_tokens)
    parser.add_argument("--context-loss", action=argparse.BooleanOptionalAction, default=WarmStart.context_loss)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    tiny = TinyModelConfig(
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=768,
    )
    try:
        result = build_demo(
            args.out,
            seed=args.seed,
            ws=WarmStart(  # inside the try: a bad flag is an InputError
                steps=args.steps,
                batch_size=args.batch_size,
                flaw=args.flaw,
                guess=args.guess,
                topk=args.topk,
                lr=args.lr,
                context_loss=args.context_loss,
                entity_tokens=args.entity_tokens,
                worlds=args.worlds,
            ),
            tiny=tiny,
            people=args.people,
            cities=args.cities,
            countries=args.countries,
            syllables=args.syllables,
            first_names=args.first_names,
        )
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
