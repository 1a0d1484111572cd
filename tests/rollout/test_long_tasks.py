"""The long-reasoning task family (running sums with every partial sum written out)."""

from __future__ import annotations

import random
import statistics

import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.rewards.registry import build_reward
from megatron_mugrpo.rollout.tasks import (
    BUILTIN_TASKS,
    FIRST_MIN,
    TERM_TAGS,
    RunningSumTask,
    builtin_problems,
    builtin_prompt,
    builtin_reward_kind,
    builtin_solution,
    chain_first_error,
    chain_solution,
    chain_terms,
)
from megatron_mugrpo.warmstart import sft_batch

CHAIN_TASKS = sorted(name for name, spec in BUILTIN_TASKS.items() if isinstance(spec, RunningSumTask))
ANSWER_TOKENS = {"running_sum_repeat_short": (91, 112), "running_sum_repeat_long": (251, 312)}
"""Answer lengths (tokens, EOS included) of the length axis' tasks; the others lie in the family's 150-400."""


@pytest.mark.parametrize(
    ("problem", "kwargs", "expected"),
    [
        ("3+7+2", {}, "3+7=10,10+2=12,\\boxed{12}"),
        ("3+7+2+5", {"slip_step": 0, "slip": -1}, "3+7=9,9+2=11,11+5=16,\\boxed{16}"),
        ("3+7+2+5", {"slip_step": 2, "slip": 10}, "3+7=10,10+2=12,12+5=27,\\boxed{27}"),
        ("1+1", {"slip_step": 0, "slip": -10}, "1+1=0,\\boxed{0}"),
        ("a3+b7+c2", {}, "3+b7=10,10+c2=12,\\boxed{12}"),
        ("a3+b7+c2+d5", {"slip_step": 1, "slip": 1}, "3+b7=10,10+c2=13,13+d5=18,\\boxed{18}"),
        ("437+8+8+8", {}, "437+8=445,445+8=453,453+8=461,\\boxed{461}"),
        ("95+6+6+6", {"slip_step": 0, "slip": -10}, "95+6=91,91+6=97,97+6=103,\\boxed{103}"),
    ],
)
def test_chain_solution_by_hand(problem: str, kwargs: dict, expected: str) -> None:
    assert chain_solution(problem, **kwargs) == expected


@pytest.mark.parametrize("task", CHAIN_TASKS)
def test_answers_lengths_and_difficulty(task: str) -> None:
    spec = BUILTIN_TASKS[task]
    rows = builtin_problems(task, 300, seed=1, split="train")
    tokenizer = build_char_tokenizer()
    lengths = []
    for row in rows:
        tags, values = zip(*chain_terms(row["problem"]))
        assert "".join(tags) == (TERM_TAGS[: spec.terms] if spec.tagged else "")
        assert len(values) == spec.terms and all(1 <= v <= spec.max_term for v in values[1:])
        assert (FIRST_MIN <= values[0] <= spec.first_max) if spec.first_max else (1 <= values[0] <= spec.max_term)
        assert len(set(values[1:])) == 1 or not spec.repeat
        assert sum(values) == int(row["answer"]) and (spec.max_term > 9 or int(row["answer"]) < 1000)
        lengths.append(len(tokenizer(chain_solution(row["problem"]), add_special_tokens=False)["input_ids"]) + 1)
    low, high = ANSWER_TOKENS.get(task, (150, 400))
    assert min(lengths) >= low and max(lengths) <= high, (min(lengths), statistics.median(lengths), max(lengths))
    assert builtin_reward_kind(task) == "math" and builtin_prompt(rows[0]["problem"]).endswith("=")


def test_length_grows_with_terms() -> None:
    rng = random.Random(0)
    short, long = RunningSumTask(terms=8), RunningSumTask(terms=32)
    assert len(chain_solution(short.sample(rng)[0])) < len(chain_solution(long.sample(rng)[0]))
    with pytest.raises(ValueError, match="terms=1"):
        RunningSumTask(terms=1)
    with pytest.raises(ValueError, match="terms=53 is more than the 52 tags"):
        RunningSumTask(terms=53, tagged=True)


def test_chain_terms_reads_tags_and_multi_digit_values() -> None:
    assert chain_terms("a3+b17+Z5") == [("a", 3), ("b", 17), ("Z", 5)]
    assert chain_terms("3+17") == [("", 3), ("", 17)]


def test_an_early_slip_carries_to_the_box_and_the_reward_sees_it() -> None:
    rows = builtin_problems("running_sum", 40, seed=0, split="eval")
    rng = random.Random(3)
    spec = BUILTIN_TASKS["running_sum"]
    flawed = [spec.solution(r["problem"], flawed=True, rng=rng) for r in rows]
    right = [chain_solution(r["problem"]) for r in rows]
    reward = build_reward("math", workers=1, timeout_s=5.0)
    try:
        scores = reward.score(right + flawed, [r["answer"] for r in rows] * 2)
    finally:
        reward.close()
    assert [s for s, _ in scores] == [1.0] * len(rows) + [0.0] * len(rows)
    for row, text in zip(rows, flawed):
        k = chain_first_error(row["problem"], text)
        assert k is not None and k < spec.terms - 1  # the slip is a step, and every later sum inherits it
        assert all(
            step != good for step, good in zip(text.split(",")[k:], chain_solution(row["problem"]).split(",")[k:])
        )
    assert all(chain_first_error(r["problem"], t) is None for r, t in zip(rows, right))


@pytest.mark.parametrize(("task", "noise"), [("running_sum", 0.5), ("running_sum_repeat", 0.7)])
def test_warm_start_teaches_the_chain_with_slips_at_the_noise_rate(task: str, noise: float) -> None:
    """About ``noise`` of the taught chains slip once; every chain starts from the first term and has one
    comma-ended step per addition before the box."""
    tokenizer = build_char_tokenizer()
    rows = builtin_problems(task, 400, seed=0, split="train")
    batch = sft_batch(rows, tokenizer, noise=noise, rng=random.Random(1), task=task)
    texts = [tokenizer.decode([t for t in lab.tolist() if t >= 0], skip_special_tokens=True) for lab in batch["labels"]]
    slipped = sum(chain_first_error(r["problem"], t) is not None for r, t in zip(rows, texts))
    assert noise - 0.1 < slipped / len(rows) < noise + 0.1
    assert all(t.startswith(r["problem"].split("+")[0] + "+") for r, t in zip(rows, texts))
    assert all(t.count(",") == r["problem"].count("+") and t.endswith("}") for r, t in zip(rows, texts))


def test_other_tasks_leave_the_warm_start_rng_alone() -> None:
    rng = random.Random(7)
    state = rng.getstate()
    assert builtin_solution("addition", "23+58", noise=0.5, rng=rng) is None
    assert builtin_solution("code_expr", "a+b", noise=0.5, rng=rng) is None
    assert rng.getstate() == state


def test_repeated_step_draws_one_step_and_a_multi_digit_first_term() -> None:
    spec = RunningSumTask(terms=5, max_term=9, repeat=True, first_max=799)
    draws = [spec.sample(random.Random(11)) for _ in range(2)]
    assert draws[0] == draws[1]  # deterministic in the rng
    rng = random.Random(0)
    for _ in range(200):
        problem, answer = spec.sample(rng)
        first, *rest = (value for _, value in chain_terms(problem))
        assert FIRST_MIN <= first <= 799 and len(rest) == 4 and len(set(rest)) == 1 and 1 <= rest[0] <= 9
        assert int(answer) == first + 4 * rest[0]
    # the knobs left at their defaults draw exactly what they drew before (cached base models stay valid)
    old_rng = random.Random(5)
    values = [old_rng.randint(1, 9) for _ in range(3)]
    assert RunningSumTask(terms=3).sample(random.Random(5)) == ("+".join(map(str, values)), str(sum(values)))


def test_repeat_needs_a_problem_space_big_enough_to_hold_out() -> None:
    with pytest.raises(ValueError, match="repeat=True needs first_max"):
        RunningSumTask(terms=21, repeat=True)
    with pytest.raises(ValueError, match="first_max=5 must be 0"):
        RunningSumTask(terms=21, repeat=True, first_max=5)
    # running_sum_repeat: 790 firsts x 9 steps; the eval bucket holds 256 distinct problems and the
    # train split thousands, disjoint
    eval_rows = builtin_problems("running_sum_repeat", 256, seed=0, split="eval")
    train_rows = builtin_problems("running_sum_repeat", 4096, seed=0, split="train")
    eval_set, train_set = {r["problem"] for r in eval_rows}, {r["problem"] for r in train_rows}
    assert len(eval_set) == 256 and len(train_set) == 4096 and not eval_set & train_set
