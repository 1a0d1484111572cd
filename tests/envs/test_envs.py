"""The environment protocol's guard, the ``env`` section and the Search-R1 environment (no model, no server)."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.envs.base import (
    EnvError,
    EnvLimits,
    Problem,
    StepResult,
    Turn,
    call_with_timeout,
    guarded_step,
)
from megatron_mugrpo.envs.registry import EnvConfig, available_envs, build_env
from megatron_mugrpo.envs.search import (
    INFO_HEAD,
    INFO_TAIL,
    Document,
    SearchEnvironment,
    SearchOptions,
    format_documents,
    parse_results,
)
from megatron_mugrpo.errors import ConfigError

TURN = Turn(token_ids=(5, 6), text="x")


class Scripted:
    """An episode that answers each call with the next item (a StepResult, an exception or a callable)."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def step(self, turn):
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer() if callable(answer) else answer


def step(episode, limits=None, turn_index=0, total_tokens=10):
    return guarded_step(episode, TURN, limits or EnvLimits(), turn_index=turn_index, total_tokens=total_tokens)


def test_a_continuing_step_passes_its_observation_through():
    result = step(Scripted(StepResult(observation_ids=(1, 2, 3), done=False, info={"tool_calls": 1})))
    assert (result.observation_ids, result.done, result.reason, result.info) == (
        (1, 2, 3),
        False,
        "continue",
        {"tool_calls": 1},
    )


def test_an_environment_that_raises_ends_the_trajectory_with_env_error():
    result = step(Scripted(RuntimeError("index corrupted")))
    assert (result.done, result.reason, result.observation_ids) == (True, "env_error", ())
    assert result.info["error"] == "RuntimeError: index corrupted"


@pytest.mark.parametrize(
    "garbage",
    [
        "not a result",
        StepResult(observation_ids=(1, -4), done=False),
        StepResult(observation_ids=(1, 2.5), done=False),
        StepResult(observation_ids=(), done=False),
        StepResult(done=True),  # done with reason 'continue'
        StepResult(done=True, reason=""),
        StepResult(observation_ids=(1,), done=False, info="not a dict"),
    ],
)
def test_garbage_ends_the_trajectory_with_env_error(garbage):
    result = step(Scripted(garbage))
    assert (result.done, result.reason) == (True, "env_error"), result.info


def test_a_hanging_environment_ends_with_env_timeout_and_the_caller_goes_on():
    release = threading.Event()
    limits = EnvLimits(timeout_s=0.2)
    result = step(Scripted(lambda: release.wait(60) and StepResult(done=True, reason="answered")), limits)
    release.set()
    assert (result.done, result.reason) == (True, "env_timeout")
    assert "env.timeout_s=0.2" in result.info["error"]


def test_the_last_allowed_turn_ends_with_max_turns_unless_the_environment_ended_it():
    limits = EnvLimits(max_turns=2)
    going_on = StepResult(observation_ids=(1,), done=False)
    assert step(Scripted(going_on), limits, turn_index=0).done is False
    assert step(Scripted(going_on), limits, turn_index=1).reason == "max_turns"
    assert step(Scripted(StepResult(done=True, reason="answered")), limits, turn_index=1).reason == "answered"


def test_observations_are_cut_to_the_limit_and_the_token_budget_ends_the_trajectory():
    limits = EnvLimits(max_observation_tokens=3, max_total_tokens=20)
    long = StepResult(observation_ids=(1, 2, 3, 4, 5), done=False)
    cut = step(Scripted(long), limits, total_tokens=16)  # 16 + 3 + 1 room for the policy = 20
    assert cut.observation_ids == (1, 2, 3) and cut.info["observation_truncated"] == 1
    assert step(Scripted(long), limits, total_tokens=17).reason == "max_total_tokens"


def test_call_with_timeout_returns_and_reraises():
    assert call_with_timeout(lambda a, b: a + b, (2, 3), 5.0) == 5
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["x"], (), 5.0)
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        call_with_timeout(time.sleep, (30,), 0.05)
    assert time.perf_counter() - start < 25  # abandoned, not joined


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"max_turns": 0}, "env.max_turns"),
        ({"max_observation_tokens": 0}, "env.max_observation_tokens"),
        ({"max_total_tokens": 1}, "env.max_total_tokens"),
        ({"timeout_s": 0}, "env.timeout_s"),
        ({"kind": "browser"}, "env.kind"),
        ({"max_error_frac": 1.5}, "env.max_error_frac"),
    ],
)
def test_the_env_section_names_the_bad_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        EnvConfig(**overrides)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"url": "localhost:8000"}, "env.search.url"),
        ({"topk": 0}, "env.search.topk"),
        ({"latency_s": -1}, "env.search.latency_s"),
        ({"retries": -1}, "env.search.retries"),
    ],
)
def test_the_search_section_names_the_bad_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        SearchOptions(**overrides)


def test_the_registry_builds_the_configured_environment():
    assert "search" in available_envs()
    cfg = EnvConfig()
    assert isinstance(cfg.search, SearchOptions) and cfg.max_turns == 4
    with pytest.raises(EnvError, match=r"env\.search\.url is empty"):
        build_env(cfg, build_char_tokenizer())
    cfg = EnvConfig(search=SearchOptions(url="http://127.0.0.1:9"))
    env = build_env(cfg, build_char_tokenizer())
    assert isinstance(env, SearchEnvironment) and env.stop_strings == ("</search>", "</answer>")


class FakeClient:
    def __init__(self, documents):
        self.documents, self.queries = documents, []

    def retrieve(self, queries, topk):
        self.queries.append((list(queries), topk))
        return [self.documents[:topk] for _ in queries]


DOCS = [Document(id=str(i), title=f"T{i}", text=f"text {i}", score=1.0 / (i + 1)) for i in range(5)]


def search_env(limits=None, **options):
    client = FakeClient(DOCS)
    env = SearchEnvironment(
        tokenizer=build_char_tokenizer(), limits=limits or EnvLimits(), options=SearchOptions(**options), client=client
    )
    return env, client


def test_a_search_turn_gets_the_information_block_as_token_ids():
    env, client = search_env(topk=2)
    episode = env.start(Problem(prompt="q", answer="a"))
    result = episode.step(Turn(token_ids=(1,), text="think <search>old query</search> <search> who is T0 </search>"))
    assert client.queries == [(["who is T0"], 2)]  # the last search, stripped
    assert result.done is False and result.info == {"tool_calls": 1}
    text = env.tokenizer.decode(list(result.observation_ids))
    assert text == INFO_HEAD + "Doc 1(Title: T0) text 0\nDoc 2(Title: T1) text 1\n" + INFO_TAIL


def test_answer_and_no_action_end_the_episode():
    env, client = search_env()
    episode = env.start(Problem(prompt="q", answer="a"))
    assert episode.step(Turn(token_ids=(1,), text="<answer>Paris</answer>")).reason == "answered"
    assert episode.step(Turn(token_ids=(1,), text="I do not know")).reason == "no_action"
    assert client.queries == []


def test_an_observation_over_budget_keeps_both_tags():
    limits = EnvLimits(max_observation_tokens=len(INFO_HEAD) + len(INFO_TAIL) + 7)  # one char per token
    env, _ = search_env(limits)
    observation = env.observation(DOCS)
    assert len(observation) == limits.max_observation_tokens
    assert env.tokenizer.decode(list(observation)) == INFO_HEAD + "Doc 1(T" + INFO_TAIL
    with pytest.raises(EnvError, match=r"env\.max_observation_tokens"):
        search_env(EnvLimits(max_observation_tokens=len(INFO_HEAD) + len(INFO_TAIL)))


def test_the_latency_is_added_to_every_search():
    env, _ = search_env(latency_s=0.05)
    start = time.perf_counter()
    env.start(Problem(prompt="q", answer="a")).step(Turn(token_ids=(1,), text="<search>x</search>"))
    assert time.perf_counter() - start >= 0.05


def test_malformed_server_answers_are_env_errors():
    assert parse_results({"result": [[{"id": 1, "title": "t", "text": "x", "score": "0.5"}]]}, 1) == [
        [Document(id="1", title="t", text="x", score=0.5)]
    ]
    for payload in ({"result": []}, {"hits": []}, [1], {"result": [[{"id": 1}]]}):
        with pytest.raises(EnvError):
            parse_results(payload, 1)
    assert format_documents([]) == ""
