"""Math reward: answer extraction, the fast path, math-verify equivalence, and the bounded verifier pool."""

import time
from dataclasses import dataclass

import pytest

from megatron_mugrpo.rewards import registry
from megatron_mugrpo.rewards.answers import MathOptions, last_boxed
from megatron_mugrpo.rewards.math_reward import REASONS, MathReward, VerifierPool, fast_verdict
from megatron_mugrpo.rewards.registry import (
    RewardError,
    RewardSet,
    build_reward,
    reason_counts,
    register_reward,
    reward_metrics,
)
from megatron_mugrpo.rewards.score import Score

TIMEOUT_S = 3.0
PATHOLOGICAL = "so the answer is \\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate this integer forever


@pytest.fixture(scope="module")
def math_reward():
    reward = build_reward("math", workers=2, timeout_s=TIMEOUT_S)
    yield reward
    reward.close()


@pytest.mark.parametrize(
    ("text", "content", "reason"),
    [
        ("The answer is \\boxed{42}.", "42", ""),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", ""),
        ("nested \\boxed{\\{1, 2\\} \\cup {3}}", "\\{1, 2\\} \\cup {3}", ""),
        ("\\fbox{7}", "7", ""),
        ("\\boxed {5}", "5", ""),
        ("no box here: 42", None, "no_box"),
        ("truncated \\boxed{12", None, "unparsable"),
        ("empty \\boxed{}", None, "unparsable"),
        ("\\boxed 5", None, "unparsable"),
        ("\\boxed{1} and a truncated \\boxed{2", None, "unparsable"),
    ],
)
def test_last_boxed(text, content, reason):
    boxed = last_boxed(text)
    assert boxed.content == content
    assert boxed.reason == reason


def test_fast_path_decides_simple_cases_without_math_verify():
    assert fast_verdict("42", "42") == "correct"
    assert fast_verdict(" \\dfrac{1}{2} ", "\\frac{1}{2}") == "correct"
    assert fast_verdict("$-3$", "-3") == "correct"
    assert fast_verdict("+007", "7") == "correct"
    assert fast_verdict("41", "42") == "wrong"
    assert fast_verdict("0.5", "1/2") is None  # needs math-verify
    assert fast_verdict("x+1", "1+x") is None


# (response, reference, reward, reason): correct, equivalent forms, wrong, no box, malformed.
TABLE = [
    ("Thus \\boxed{42}.", "42", 1.0, "correct"),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, "correct"),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, "correct"),
    ("\\boxed{1/2}", "\\frac12", 1.0, "correct"),
    ("\\boxed{x + 1}", "1 + x", 1.0, "correct"),
    ("\\boxed{\\sqrt{4}}", "2", 1.0, "correct"),
    ("\\boxed{10.0}", "10", 1.0, "correct"),
    ("\\boxed{41}", "42", 0.0, "wrong"),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0, "wrong"),
    ("\\boxed{x + 2}", "x + 1", 0.0, "wrong"),
    ("The answer is 42.", "42", 0.0, "no_box"),
    ("\\boxed{42", "42", 0.0, "unparsable"),
    ("\\boxed{\\sqrt{}", "2", 0.0, "unparsable"),
]


def test_reward_table(math_reward):
    results = math_reward.score([r for r, *_ in TABLE], [a for _, a, *_ in TABLE])
    for (response, answer, reward, reason), got in zip(TABLE, results):
        assert got == (reward, reason), f"{response!r} vs {answer!r}"


def test_pathological_answer_times_out_without_stalling_the_pool(math_reward):
    responses = [PATHOLOGICAL, "\\boxed{0.25}", "\\boxed{\\frac{2}{4}}", PATHOLOGICAL, "\\boxed{3}"]
    answers = ["7", "\\frac{1}{4}", "0.5", "7", "3"]
    started = time.monotonic()
    results = math_reward.score(responses, answers)
    elapsed = time.monotonic() - started
    assert results == [
        (0.0, "timeout"),
        (1.0, "correct"),
        (1.0, "correct"),
        (0.0, "timeout"),
        (1.0, "correct"),
    ]
    # Two workers: both hung tasks run side by side (one bound each); the good ones finish regardless.
    assert elapsed < 3 * TIMEOUT_S + 5.0
    # The pool replaced the killed workers and still answers.
    assert math_reward.score(["\\boxed{0.5}"], ["1/2"]) == [(1.0, "correct")]


def test_reason_counts_and_metrics():
    results = [(1.0, "correct"), (0.0, "wrong"), (0.0, "wrong"), (0.0, "timeout")]
    counts = reason_counts(results, REASONS)
    assert set(REASONS) <= set(counts)
    assert counts["wrong"] == 2 and counts["no_box"] == 0
    metrics = reward_metrics(results)
    assert metrics["rollout/reason_wrong"] == 2.0
    assert metrics["rollout/reward_mean"] == 0.25


def _sleep_then_echo(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def test_verifier_pool_kills_only_the_slow_task():
    with VerifierPool(_sleep_then_echo, workers=2, timeout_s=1.0) as pool:
        results = pool.map([(0.0, 1), (30.0, 2), (0.0, 3), (0.0, 4)])
        assert results == [1, "timeout", 3, 4]
        assert pool.restarts == 1


def test_started_pool_warms_up_before_the_first_task():
    """``start`` spawns the workers without waiting; by the first ``map`` they may already be ready."""
    with VerifierPool(_sleep_then_echo, workers=2, timeout_s=5.0) as pool:
        pool.start()
        assert len(pool._workers) == 2 and all(w.process.is_alive() for w in pool._workers)
        assert pool.map([(0.0, 1), (0.0, 2)]) == [1, 2]
        assert pool.restarts == 0 and len(pool._workers) == 2


def test_registry(monkeypatch):
    class Constant:
        def __init__(self, *, workers, timeout_s, options):
            self.options = options

        def score(self, responses, answers):
            return [Score(1.0, "correct") for _ in responses]

        def start(self):
            pass

        def close(self):
            pass

    @dataclass
    class ConstantOptions:
        level: int = 3

    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    monkeypatch.setattr(registry, "_OPTIONS", dict(registry._OPTIONS))
    register_reward("test_constant", Constant, ConstantOptions)
    reward = build_reward("test_constant", workers=1, timeout_s=1.0)
    assert reward.score(["a"], ["b"]) == [(1.0, "correct")] and reward.options == ConstantOptions()
    with pytest.raises(RewardError, match="already registered"):
        register_reward("test_constant", Constant, ConstantOptions)
    with pytest.raises(RewardError, match="unknown reward 'nope'"):
        build_reward("nope", workers=1, timeout_s=1.0)


def test_reward_section_has_one_options_section_per_registered_reward():
    section = registry.RewardConfig()
    assert section.kind == "math" and section.math.answer_format == "boxed" and section.code.sandbox == "bwrap"
    with pytest.raises(Exception, match=r"reward.kind='poetry' is not one of \('code', 'math', 'qa'\)"):
        registry.RewardConfig(kind="poetry")
    with pytest.raises(Exception, match=r"reward\.math\.answer_format='latex'"):
        MathOptions(answer_format="latex")
    assert registry.reward_record(section) == {"kind": "math", "options": {"answer_format": "boxed"}}


def test_reward_set_builds_each_kind_once_and_scores_with_the_training_kind():
    rewards = RewardSet(registry.RewardConfig(workers=1), kinds=["math", "math"])
    try:
        assert rewards.score(["\\boxed{2}"], ["2"]) == [(1.0, "correct")]
        assert isinstance(rewards.for_kind("math"), MathReward)
        with pytest.raises(RewardError, match="'code' was not built"):
            rewards.for_kind("code")
    finally:
        rewards.close()


def test_score_is_a_pair_that_keeps_its_pass_fraction_through_pickle():
    import pickle

    score = Score(0.0, "wrong_answer", passed=1, total=2, seconds=0.25)
    reward, reason = score
    assert (reward, reason) == (0.0, "wrong_answer") and score == (0.0, "wrong_answer")
    again = pickle.loads(pickle.dumps(score))
    assert again == score and (again.pass_fraction, again.seconds) == (0.5, 0.25)
    assert Score(1.0, "correct").pass_fraction is None
    metrics = reward_metrics([score, Score(1.0, "correct", passed=3, total=3)])
    assert metrics["rollout/test_pass_rate"] == 0.75 and metrics["rollout/reward_mean"] == 0.5


def test_score_rejects_mismatched_lengths(math_reward):
    with pytest.raises(RewardError, match="2 responses but 1"):
        math_reward.score(["a", "b"], ["c"])


# ----------------------------------------------------------------------------- no answer stops a stage

HUGE = "\\boxed{" + "1" * 5000 + "}"
"""An integer past Python's int-string limit (4300 digits): int() raises ValueError on it."""


def test_huge_integers_are_compared_as_digit_strings(math_reward):
    assert fast_verdict("1" * 5000, "81") == "wrong"
    assert fast_verdict("+000" + "1" * 5000, "1" * 5000) == "correct"
    assert fast_verdict("-0", "0") == "correct"
    assert math_reward.score([HUGE, HUGE, "\\boxed{81}"], ["81", "1" * 5000, "81"]) == [
        (0.0, "wrong"),
        (1.0, "correct"),
        (1.0, "correct"),
    ]


def test_a_failing_check_is_reason_error_for_that_answer_only(math_reward, monkeypatch):
    """An exception while checking one answer (main process or verifier worker) scores it 0 with
    reason 'error'; the other answers of the batch are scored as usual."""
    from megatron_mugrpo.rewards import math_reward as rewards

    real = rewards.fast_verdict

    def flaky(boxed: str, answer: str) -> str | None:
        if boxed == "13":
            raise ValueError("checker bug")
        return real(boxed, answer)

    monkeypatch.setattr(rewards, "fast_verdict", flaky)
    got = math_reward.score(["\\boxed{12}", "\\boxed{13}", "\\boxed{0.5}"], ["12", "13", "1/2"])
    assert got == [(1.0, "correct"), (0.0, "error"), (1.0, "correct")]
    assert "error" in REASONS and reward_metrics(got)["rollout/reason_error"] == 1.0


def _raise_on_x(boxed: str, answer: str) -> str:
    if "x" in boxed:
        raise RecursionError("sympy blew its stack")
    return "correct"


def test_an_exception_inside_the_verifier_is_reason_error():
    reward = build_reward("math", workers=1, timeout_s=TIMEOUT_S)
    reward.pool.close()
    reward.pool = VerifierPool(_raise_on_x, workers=1, timeout_s=TIMEOUT_S)
    try:
        got = reward.score(["\\boxed{x^2}", "\\boxed{0.5}"], ["y", "1/2"])
    finally:
        reward.close()
    assert got == [(0.0, "error"), (1.0, "correct")]


def _fuzz_cases(count: int, seed: int) -> list[tuple[str, str]]:
    """Random and adversarial (response, reference) pairs: huge numbers, unbalanced and deep braces,
    LaTeX soup, control characters, unicode, very long strings; a few reach math-verify."""
    import random

    rng = random.Random(seed)
    alphabet = "0123456789+-*/^_{}()[]\\$., xyz=<>!|&%#~'\"\n\t\x00\u00b5\u2212\u221a\ud7ff"
    pieces = ["\\boxed{", "\\fbox{", "}", "{", "\\frac", "\\sqrt", "\\left(", "\\right)", "^{", "\\dfrac{1}{", "9"]
    fixed = [
        HUGE,
        "\\boxed{-" + "9" * 10000 + "}",
        "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",
        "\\boxed{" + "}" * 100,
        "\\boxed{1e99999999}",
        "\\boxed{" + "1/" * 2000 + "1}",
        "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
        "\\boxed{\\infty}",
        "\\boxed{nan}",
        "\\boxed{" + "x" * 100000 + "}",
        "\\boxed{\x00}",
        "\\boxed{\\}",
        "\\boxed{}" * 1000,
        "",
    ]
    cases = [(text, rng.choice(["81", "1/2", "x", "", "1" * 5000])) for text in fixed]
    while len(cases) < count:
        kind = rng.random()
        if kind < 0.5:  # random characters, usually no box
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        elif kind < 0.99:  # box fragments that rarely balance: exercises extraction and the fast path
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        else:  # a balanced box with random content: goes to math-verify (kept rare: it is the slow path)
            text = "\\boxed{" + "".join(rng.choice("0123456789+-*/^x.") for _ in range(rng.randint(1, 12))) + "}"
        cases.append((text, rng.choice(["81", "-3", "\\frac{1}{2}", "x+1", "1" * 5000, ""])))
    return cases


FUZZ_TIMEOUT_S = 1.0
"""Per-answer bound for the fuzz test: a few adversarial answers hit it, so it sets the test's runtime."""


@pytest.mark.timeout(600)
def test_fuzz_thousand_strings_never_raise():
    """1,000 random and adversarial answers: every one gets a (reward, known reason), none raises.
    Bounded time comes from the verifier pool's per-answer timeout (pytest-timeout backs it up)."""
    cases = _fuzz_cases(1000, seed=1234)
    reward = build_reward("math", workers=2, timeout_s=FUZZ_TIMEOUT_S)
    try:
        results = reward.score([text for text, _ in cases], [answer for _, answer in cases])
    finally:
        reward.close()
    assert len(results) == len(cases)
    for (text, _), (reward, reason) in zip(cases, results):
        assert reason in REASONS, (text[:80], reason)
        assert reward in (0.0, 1.0)


def test_math_reward_reads_the_configured_answer_format():
    reward = MathReward(workers=1, timeout_s=5.0, options=MathOptions(answer_format="gsm8k"))
    try:
        assert reward.score(["so 3 + 4 = 7\n#### 7", "it is 7", "#### 8"], ["7", "7", "7"]) == [
            (1.0, "correct"),
            (0.0, "no_answer_marker"),
            (0.0, "wrong"),
        ]
    finally:
        reward.close()
