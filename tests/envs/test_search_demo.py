"""The search demo's warm-start traces: the searches a good policy makes, the environment's own observation
ids between them, the right answer (or, flawed, the first document's), and a loss on policy tokens only."""

from __future__ import annotations

import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.envs.base import EnvLimits
from megatron_mugrpo.envs.fictional import make_world, write_task
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
