"""The search demo's warm-start traces: the searches a good policy makes, the environment's own observation
ids between them, the right answer (or, flawed, the first document's), and a loss on policy tokens only."""

from __future__ import annotations

import re

import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.envs.base import EnvLimits
from megatron_mugrpo.envs.fictional import make_world, world_documents, write_task
from megatron_mugrpo.envs.search import SearchEnvironment, SearchOptions
from megatron_mugrpo.envs.search_demo import IGNORE, LocalIndex, trace, trace_example


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    write_task(out, 3, people=10, cities=3)
    tokenizer = build_char_tokenizer()
    env = SearchEnvironment(
        tokenizer=tokenizer,
        limits=EnvLimits(max_observation_tokens=200),
        options=SearchOptions(topk=2),
        client=LocalIndex(out / "corpus.jsonl"),
    )
    return make_world(3, people=10, cities=3), env, tokenizer


def test_traces_search_the_entity_and_answer_from_its_document(setup):
    world, env, _ = setup
    person = world.people[0]
    one = trace(f"What is the profession of {person.name}?", env, flawed=False)
    assert [text for text, _ in one] == [f"<search>{person.name}</search>", f"<answer>{person.profession}</answer>"]
    assert one[0][1] == env.observation(env.client.retrieve([person.name], 2)[0])  # the env's ids, exactly
    two = trace(f"In which country was {person.name} born?", env, flawed=False)
    assert [text for text, _ in two] == [
        f"<search>{person.name}</search>",
        f"<search>{person.city.name}</search>",
        f"<answer>{person.city.country}</answer>",
    ]
    flawed = trace(f"In which country was {person.name} born?", env, flawed=True)
    assert [text for text, _ in flawed] == [f"<search>{person.name}</search>", f"<answer>{person.city.name}</answer>"]


def test_a_trace_example_puts_labels_on_policy_tokens_only(setup):
    world, env, tokenizer = setup
    question = f"In which city was {world.people[1].name} born?"
    ids, labels = trace_example(question, env, tokenizer, flawed=False)
    (search, observation), (answer, _) = trace(question, env, flawed=False)
    turn = tokenizer(search, add_special_tokens=False)["input_ids"]
    start = labels.index(turn[0])
    assert labels[start : start + len(turn)] == turn
    obs = slice(start + len(turn), start + len(turn) + len(observation))
    assert ids[obs] == list(observation) and set(labels[obs]) == {IGNORE}
    assert tokenizer.decode([t for t in labels if t != IGNORE], skip_special_tokens=True) == search + answer
    assert labels[-1] == ids[-1] == tokenizer.eos_token_id


def test_a_model_directory_gives_back_the_character_tokenizer_it_was_built_with(tmp_path):
    """A built tiny model's directory (config.json says qwen2) reads its tokenizer back as built: with its
    spaces (transformers 5's AutoTokenizer would pick Qwen2Tokenizer, which drops them)."""
    import json as _json

    from megatron_mugrpo.char_tokenizer import load_tokenizer_dir

    built = build_char_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(_json.dumps({"model_type": "qwen2"}))
    loaded = load_tokenizer_dir(tmp_path)
    text = "In which city was Ada Quill born?"
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (built.eos_token_id, 0, "left")


def test_one_syllable_worlds_have_short_names_and_refuse_a_world_too_big_for_them():
    """The demo's world (``syllables=1``): every name one syllable (a city two), surnames still unique."""
    from megatron_mugrpo.envs.fictional import FIRST_NAME_POOL, InputError

    syllable = r"(?:br|dr|kl|tr|st|[bdfgklmnprstvz])(?:ae|io|[aeiou])(?:th|[nrlsm])?"
    world = make_world(0, people=60, cities=12, countries=4, syllables=1)
    assert world == make_world(0, people=60, cities=12, countries=4, syllables=1)
    for person in world.people:
        first, surname = person.name.lower().split(" ")
        assert re.fullmatch(syllable, first) and re.fullmatch(syllable, surname), person.name
    assert all(re.fullmatch(f"(?:{syllable}){{2}}", c.name.lower()) for c in world.cities)
    assert (
        len({p.name for p in world.people}) == 60 and len({p.name.split()[0] for p in world.people}) <= FIRST_NAME_POOL
    )
    with pytest.raises(InputError, match="--syllables 1 gives 931 distinct words, too few for 520 names"):
        make_world(0, people=400, cities=50, countries=8, syllables=1)


def test_context_loss_labels_every_token_of_the_trace(setup):
    world, env, tokenizer = setup
    question = f"In which country was {world.people[2].name} born?"
    ids, labels = trace_example(question, env, tokenizer, flawed=False, context_loss=True)
    assert labels == ids
    policy_ids, policy_labels = trace_example(question, env, tokenizer, flawed=False)
    assert policy_ids == ids and IGNORE in policy_labels


def test_a_world_without_first_names_names_each_person_by_the_same_surname():
    with_first = make_world(5, people=20, cities=4, countries=2, syllables=1)
    surnames_only = make_world(5, people=20, cities=4, countries=2, syllables=1, first_names=False)
    assert [p.name for p in surnames_only.people] == [p.name.split(" ")[1] for p in with_first.people]
    assert surnames_only.cities == with_first.cities


def test_a_local_index_serves_documents_held_in_memory_as_it_serves_a_corpus_file(tmp_path):
    world = make_world(6, people=8, cities=3, countries=2, syllables=1, first_names=False)
    write_task(tmp_path, 6, people=8, cities=3, countries=2, syllables=1, first_names=False)
    in_memory = LocalIndex(world_documents(world))
    queries = [p.name for p in world.people]
    assert in_memory.retrieve(queries, 2) == LocalIndex(tmp_path / "corpus.jsonl").retrieve(queries, 2)
    assert [docs[0].title for docs in in_memory.retrieve(queries, 1)] == queries


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--worlds", "-1", "--worlds -1 must be >= 0"),
        ("--flaw", "1.5", "--flaw 1.5 must be in"),
        ("--guess", "-0.1", "--guess -0.1 must be in [0, 1]"),
        ("--steps", "0", ""),
    ],
)
def test_a_bad_warm_start_flag_is_one_error_and_exit_2_before_anything_is_written(
    tmp_path, capsys, flag, value, message
):
    from megatron_mugrpo.envs.search_demo import main

    assert main(["--out", str(tmp_path / "demo"), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} {value} must be") and message in err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("worlds", ["0", "1"])
def test_the_cli_writes_the_world_and_a_warm_started_model_that_loads(tmp_path, worlds):
    """``build_demo`` end to end, on its own world (the demo) and on another world's traces (``--worlds``): the
    three JSONL files and a base model that loads with its tokenizer, which holds every name as one token."""
    import json

    from transformers import AutoModelForCausalLM

    from megatron_mugrpo.char_tokenizer import load_tokenizer_dir
    from megatron_mugrpo.envs.search_demo import main

    out = tmp_path / "demo"
    flags = ["--steps", "2", "--batch-size", "2", "--people", "6", "--cities", "3", "--worlds", worlds]
    assert main(["--out", str(out), "--seed", "1", *flags]) == 0
    rows = {name: (out / f"{name}.jsonl").read_text().splitlines() for name in ("corpus", "train", "test")}
    assert all(rows.values())
    tokenizer = load_tokenizer_dir(out / "base_model")
    title = json.loads(rows["corpus"][0])["title"]
    assert len(tokenizer(title, add_special_tokens=False)["input_ids"]) == 1
    model = AutoModelForCausalLM.from_pretrained(out / "base_model")
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)


def test_a_two_hop_question_has_a_sound_and_a_flawed_trace_and_a_one_hop_question_only_a_sound_one(setup):
    """The warm start draws the flaw per drawn trace (``trace_pair``), so each 2-hop question is sometimes
    answered soundly: its rollouts differ and μ-GRPO gets an advantage."""
    from megatron_mugrpo.envs.search_demo import trace_pair

    world, env, tokenizer = setup
    two_hops = f"Which river flows through the city where {world.people[3].name} was born?"
    sound, flawed = trace_pair(two_hops, env, tokenizer)
    assert sound == trace_example(two_hops, env, tokenizer, flawed=False)
    assert flawed == trace_example(two_hops, env, tokenizer, flawed=True) != sound
    one_hop = f"What is the profession of {world.people[3].name}?"
    assert trace_pair(one_hop, env, tokenizer) == (trace_example(one_hop, env, tokenizer, flawed=False),) * 2


def test_entity_tokens_make_each_name_one_token_kept_by_the_model_directory_and_never_split_from_a_longer_word(
    tmp_path,
):
    """``add_entity_tokens``: a person's full name, a city, a country, a river and a profession are one token each
    (copying one is one attention step); a word that only starts with a name stays characters; the model
    directory reads the same ids back (qwen2 config, as a built model's) and decoding gives the text back."""
    import json as _json

    from megatron_mugrpo.char_tokenizer import load_tokenizer_dir
    from megatron_mugrpo.envs.search_demo import add_entity_tokens, entity_names

    world = make_world(0, people=6, cities=2, countries=2, syllables=1)
    names = entity_names(world)
    person, city = world.people[0], world.people[0].city
    assert {person.name, person.profession, city.name, city.country, city.river} <= set(names)
    tokenizer = build_char_tokenizer()
    assert add_entity_tokens(tokenizer, names) == len(names)
    tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(_json.dumps({"model_type": "qwen2"}))
    loaded = load_tokenizer_dir(tmp_path)
    text = f"<search>{person.name}</search> {city.name} is a city in {city.country}. {city.river}x"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [loaded.decode([i]) for i in ids]
    assert {person.name, city.name, city.country} <= set(pieces)
    assert city.river not in pieces and pieces[-1] == "x"  # "Stesx" is not the river "Stes" and an "x"
    assert loaded.decode(ids) == text


def test_a_flawed_one_hop_trace_answers_a_confabulated_value_of_its_kind_without_searching(setup):
    """``guess``: the flawed 1-hop trace is one turn, ``<answer>`` with another value of the question's kind (a city
    for a birthplace, a profession, a country for a city), the same one every time; the sound trace still searches.
    A 2-hop question keeps its own flaw."""
    from megatron_mugrpo.envs.search_demo import attribute_values, confabulation, trace_pair

    world, env, tokenizer = setup
    values = attribute_values(world_documents(world))
    assert values["born"] == sorted({p.city.name for p in world.people})
    assert values["prof"] == sorted({p.profession for p in world.people})
    assert values["city"] == sorted({c.country for c in world.cities})
    person = world.people[2]
    for question, right, kind in (
        (f"In which city was {person.name} born?", person.city.name, "born"),
        (f"What is the profession of {person.name}?", person.profession, "prof"),
        (f"In which country is {person.city.name}?", person.city.country, "city"),
    ):
        flawed = trace(question, env, flawed=True, values=values)
        assert len(flawed) == 1 and flawed[0][1] == ()
        guess = re.fullmatch(r"<answer>(\w+)</answer>", flawed[0][0]).group(1)
        assert guess != right and guess in values[kind]
        assert guess == confabulation(question, right, values[kind])  # fixed per question
        assert trace(question, env, flawed=False, values=values)[0][0] == f"<search>{_entity(question)}</search>"
        sound, bad = trace_pair(question, env, tokenizer, values=values)
        assert bad == trace_example(question, env, tokenizer, flawed=True, values=values) != sound
    two_hops = f"In which country was {person.name} born?"
    assert trace(two_hops, env, flawed=True, values=values) == trace(two_hops, env, flawed=True)


def _entity(question: str) -> str:
    return re.search(r"(?:was|of|is) (\w+(?: \w+)?)(?: born)?\?$", question).group(1)


def test_the_warm_start_draws_each_question_s_flaw_at_its_own_rate_and_trains(setup):
    """``flaw`` is the 2-hop rate, ``guess`` the 1-hop one (``_flaw_rate``); a warm start with both on runs its
    steps on the world's traces (confabulations drawn from the corpus) and moves the parameters."""
    import torch

    from megatron_mugrpo.envs.search_demo import TraceWorld, WarmStart, _flaw_rate, attribute_values, warm_start
    from megatron_mugrpo.warmstart import TinyModelConfig, build_tiny_model

    world, env, tokenizer = setup
    ws = WarmStart(steps=3, batch_size=4, flaw=0.25, guess=0.75)
    person = world.people[0]
    assert _flaw_rate(f"In which country was {person.name} born?", ws) == 0.25
    assert _flaw_rate(f"What is the profession of {person.name}?", ws) == 0.75
    tiny = TinyModelConfig(
        hidden_size=16,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=512,
    )
    model = build_tiny_model(tiny, tokenizer, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    traced = TraceWorld(env=env, values=attribute_values(world_documents(world)))
    questions = [(f"What is the profession of {p.name}?", traced) for p in world.people[:3]]
    losses = warm_start(model, tokenizer, [*questions, (f"In which city was {person.name} born?", traced)], ws, seed=0)
    assert len(losses) == 3 and all(loss == loss and loss > 0 for loss in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
