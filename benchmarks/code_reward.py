"""The code reward's cost: the same programs scored through the sandbox and through plain processes.

    .venv/bin/python benchmarks/code_reward.py              # defaults: 24 correct, 24 wrong, 4 timing out
    .venv/bin/python benchmarks/code_reward.py --correct 48 --wrong 48 --workers 2

A fixed set of programs for a two-test stdin/stdout problem (sum of two integers): correct ones,
wrong ones (a wrong answer on the first test stops the rest), and ones that loop until their CPU
limit. Each set is scored twice with the same limits and the same pool size, once through the
bubblewrap sandbox (``reward.code.sandbox=bwrap``: each jail with its memory bound, a cgroup of its
own where one can be made, and the runner's clean-up between tests) and once through plain processes
(``reward.code.sandbox=none``), and the rewards must agree. Last line::

    sandbox_ratio=<sandboxed / plain programs per second> programs_per_s=<sandboxed, with the pool> bound=<kind>

Target on the 2-core machine: sandbox_ratio >= 0.5.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mugrpo.rewards.code import CodeProblem, CodeRewardConfig, CodeRewardPool
from megatron_mugrpo.rewards.sandbox import memory_bound

PROBLEM = CodeProblem(inputs=("1 2\n", "20 22\n"), outputs=("3\n", "42\n"), time_limit_s=0.5)
CORRECT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
LOOPING = "```python\nwhile True:\n    pass\n```"


def measure(sandbox: str, responses: list[str], workers: int) -> tuple[float, list[float]]:
    pool = CodeRewardPool(CodeRewardConfig(sandbox=sandbox, max_cpu_s=0.5), workers=workers)
    try:
        started = time.perf_counter()
        scores = pool.score(responses, [PROBLEM] * len(responses))
        seconds = time.perf_counter() - started
    finally:
        pool.close()
    return len(responses) / seconds, [s.reward for s in scores]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--correct", type=int, default=24)
    parser.add_argument("--wrong", type=int, default=24)
    parser.add_argument("--looping", type=int, default=4)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    programs = [CORRECT] * args.correct + [WRONG] * args.wrong + [LOOPING] * args.looping
    # Each copy made distinct by a comment: the pool runs a repeated program only once per call.
    responses = [f"{text[:-3]}# copy {i}\n```" for i, text in enumerate(programs)]
    plain_rate, plain_rewards = measure("none", responses, args.workers)
    boxed_rate, boxed_rewards = measure("bwrap", responses, args.workers)
    if boxed_rewards != plain_rewards:
        print("error: the sandboxed and plain rewards differ", file=sys.stderr)
        return 1
    print(
        f"programs={len(responses)} workers={args.workers} plain={plain_rate:.2f}/s sandboxed={boxed_rate:.2f}/s "
        f"mean_reward={sum(boxed_rewards) / len(boxed_rewards):.3f}"
    )
    bound = memory_bound().kind.replace(" ", "_")
    print(f"sandbox_ratio={boxed_rate / plain_rate:.3f} programs_per_s={boxed_rate:.2f} bound={bound}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
