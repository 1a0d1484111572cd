"""The qa reward (SQuAD exact match, F1), ``data.format: qa`` and the seeded fictional-entity corpus."""

from __future__ import annotations

import json
import pickle

import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.datafiles import PromptDataError
from megatron_mugrpo.envs.fictional import corpus_rows, main, make_world, question_rows, world_documents, write_task
from megatron_mugrpo.envs.server import Bm25Index, load_corpus
from megatron_mugrpo.rewards.qa import (
    QA_INSTRUCTION,
    QaScore,
    normalize_answer,
    qa_rows,
    reference_answers,
    score_answer,
    token_f1,
)
from megatron_mugrpo.rewards.registry import RewardSet, reward_metrics
from megatron_mugrpo.rollout.prompts import DataConfig, format_reward_kind, load_prompts


def test_squad_normalisation():
    assert normalize_answer("  The Eiffel-Tower, in PARIS!  ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("Theatre") == "theatre"  # 'the' only as a word


def test_token_f1_by_hand():
    # prediction "eiffel tower paris" vs reference "eiffel tower": common 2, P = 2/3, R = 1 → F1 = 0.8
    assert token_f1("Eiffel tower, Paris", ["the Eiffel Tower"]) == pytest.approx(0.8)
    assert token_f1("Paris", ["London", "paris"]) == 1.0  # the best reference
    assert token_f1("Rome", ["Paris"]) == 0.0
    assert token_f1("the", ["Paris"]) == 0.0  # nothing left after normalisation


@pytest.mark.parametrize(
    ("response", "end", "expected"),
    [
        ("<search>x</search> <answer> the Eiffel Tower. </answer>", None, (1.0, "correct", 1.0)),
        ("<answer>Paris</answer> then <answer>Rome</answer>", None, (0.0, "wrong_answer", 0.0)),  # the last one
        ("<answer>Eiffel</answer>", None, (0.0, "wrong_answer", pytest.approx(2 / 3))),
        ("Eiffel Tower", None, (0.0, "no_answer", 0.0)),
        ("<answer>Eiffel Tower", None, (0.0, "no_answer", 0.0)),
        ("<answer>Eiffel Tower</answer>", "env_error", (0.0, "env_error", 0.0)),
        ("<answer>Eiffel Tower</answer>", "env_timeout", (0.0, "env_timeout", 0.0)),
        ("<search>x</search>", "max_turns", (0.0, "max_turns", 0.0)),
        ("<answer>Eiffel Tower</answer>", "answered", (1.0, "correct", 1.0)),
    ],
)
def test_reasons(response, end, expected):
    score = score_answer(response, json.dumps(["Eiffel Tower", "La tour Eiffel"]), end)
    assert (score.reward, score.reason, score.f1) == expected


def test_references_are_a_json_list_or_one_string():
    assert reference_answers('["a", "b"]') == ["a", "b"]
    assert reference_answers("Paris") == ["Paris"]
    assert reference_answers("[1, 2]") == ["[1, 2]"]


def test_the_registry_builds_qa_and_logs_f1_beside_the_reward():
    from megatron_mugrpo.rewards.registry import RewardConfig

    rewards = RewardSet(RewardConfig(kind="qa"))
    scores = rewards.score(["<answer>Paris</answer>", "<answer>Paris France</answer>", "no"], ['["Paris"]'] * 3)
    assert [tuple(s) for s in scores] == [(1.0, "correct"), (0.0, "wrong_answer"), (0.0, "no_answer")]
    metrics = reward_metrics(scores)
    assert metrics["rollout/reward_mean"] == pytest.approx(1 / 3)
    assert metrics["rollout/answer_f1"] == pytest.approx((1.0 + 2 / 3 + 0.0) / 3)
    assert metrics["rollout/reason_wrong_answer"] == 1.0
    episodes = rewards.for_kind("qa").score_episodes(
        ["<answer>Paris</answer>"] * 2, ['["Paris"]'] * 2, [None, "env_timeout"]
    )
    assert [s.reason for s in episodes] == ["correct", "env_timeout"]
    assert pickle.loads(pickle.dumps(scores[1])).f1 == scores[1].f1 and isinstance(scores[1], QaScore)
    rewards.close()


def test_qa_rows_name_the_bad_row():
    assert qa_rows([{"question": "Q?", "answers": "A"}], "f.jsonl") == [{"problem": "Q?", "answer": '["A"]'}]
    for bad, field in (({"answers": ["a"]}, "question"), ({"question": "q", "answers": []}, "answers")):
        with pytest.raises(PromptDataError, match=f"f.jsonl row 2: '{field}'"):
            qa_rows([{"question": "ok", "answers": ["x"]}, bad], "f.jsonl")


def test_data_format_qa_loads_prompts_with_the_instruction(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "Who?", "answers": ["Ada", "Ada Quill"]}) + "\n")
    cfg = DataConfig(train_path=str(path), format="qa", use_chat_template=False)
    assert cfg.reward_kind == format_reward_kind("qa") == "qa"
    [record] = load_prompts(cfg, build_char_tokenizer(), max_prompt_tokens=1024)
    assert record.text == f"{QA_INSTRUCTION}\nQuestion: Who?\n"
    assert json.loads(record.answer) == ["Ada", "Ada Quill"]


def test_the_world_is_seeded_and_questions_need_search(tmp_path):
    assert corpus_rows(make_world(3, people=20, cities=5)) == corpus_rows(make_world(3, people=20, cities=5))
    assert corpus_rows(make_world(3, people=20, cities=5)) != corpus_rows(make_world(4, people=20, cities=5))
    world = make_world(0, people=30, cities=6, countries=3)
    corpus = corpus_rows(world)
    questions = question_rows(world)
    assert len(questions) == 6 + 4 * 30 and {q["hops"] for q in questions} == {1, 2}
    docs = {d["title"]: d["text"] for d in corpus}
    for person in world.people:
        # 2 hops: the person's document names the city, not the country; the city's document has the country.
        assert person.city.name in docs[person.name] and person.city.country not in docs[person.name]
        assert person.city.country in docs[person.city.name]
    first_names = [p.name.split()[0] for p in world.people]
    assert len(set(first_names)) < len(first_names)  # shared first names: retrieval can mislead
    index = Bm25Index(world_documents(world))
    hits = index.search([f"{p.name} born" for p in world.people], topk=3)
    assert sum(any(h["title"] == p.name for h in hit) for p, hit in zip(world.people, hits)) == len(world.people)


def test_the_generator_writes_the_three_files(tmp_path, capsys):
    counts = write_task(tmp_path / "a", 1, people=10, cities=4, countries=2, test_fraction=0.25)
    assert counts == {"corpus": 14, "train": 33, "test": 11}
    assert load_corpus(tmp_path / "a" / "corpus.jsonl") == world_documents(
        make_world(1, people=10, cities=4, countries=2)
    )
    assert (
        main(
            [
                "--out",
                str(tmp_path / "b"),
                "--seed",
                "1",
                "--people",
                "10",
                "--cities",
                "4",
                "--countries",
                "2",
                "--test-fraction",
                "0.25",
            ]
        )
        == 0
    )
    for name in ("corpus", "train", "test"):
        assert (tmp_path / "a" / f"{name}.jsonl").read_bytes() == (tmp_path / "b" / f"{name}.jsonl").read_bytes()
    assert main(["--out", str(tmp_path / "c"), "--people", "0"]) == 2
    assert "must each be in" in capsys.readouterr().err
