"""The math reward (``reward.kind: math``) and the bounded verifier pool it runs math-verify in.

The reward takes the response's final answer (by default the LAST ``\\boxed{...}``, balanced braces;
``reward.math.answer_format`` picks another convention, see ``rewards/answers.py``) and checks it
against the reference: 1.0 when equal, else 0.0, always with a reason:

    correct     equal to the reference (exactly after normalisation, or equivalent per math-verify)
    no_box      the response has no ``\\boxed`` (no_number, no_answer_marker, no_answer_tag: the
                other formats found no answer)
    unparsable  a ``\\boxed`` without balanced braces, or content math-verify cannot parse
    wrong       parsed and not equal
    timeout     verification took longer than ``timeout_s``; the worker was killed and replaced
    crash       the verifier process died (e.g. out of memory); it was replaced
    error       checking this answer raised (a verifier bug or an input it cannot handle); logged

No answer can stop a stage: every failure while checking one answer becomes that answer's reason.

Most answers never reach math-verify: an exact match of the normalised strings is correct and two
different integers are wrong (the CPU demo verifies hundreds of thousands of short integer answers).
The rest run in a pool of worker processes with a per-answer wall-clock bound. math-verify's own
timeouts use ``signal.alarm`` (main thread only), so they are disabled and the pool kills a worker
that runs past the bound, e.g. on ``\\boxed{9^{9^{9^{9}}}}``, which sympy would try to evaluate forever.

    reward = MathReward(workers=2, timeout_s=5.0, options=MathOptions(answer_format="boxed"))
    results = reward.score(responses, answers)      # [(1.0, "correct"), (0.0, "no_box"), ...]
    reward.close()
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron_mugrpo.rewards.answers import MathOptions, extractor
from megatron_mugrpo.rewards.registry import RewardError
from megatron_mugrpo.rewards.score import Score

log = logging.getLogger(__name__)

REASONS = (
    "correct",
    "no_box",
    "no_number",
    "no_answer_marker",
    "no_answer_tag",
    "unparsable",
    "wrong",
    "timeout",
    "crash",
    "error",
)
"""Every reason a math score can carry; the no_* ones name what the answer format did not find."""
CORRECT_REWARD = 1.0
INCORRECT_REWARD = 0.0
WORKER_START_TIMEOUT_S = 120.0
"""How long a fresh verifier process may take to import math-verify/sympy before the pool gives up."""
_TIMEOUT = "timeout"
_CRASH = "crash"
_ERROR = "error"


# ---------------------------------------------------------------------------------------------------
# Answer extraction and the cheap fast path (pure string functions)
# ---------------------------------------------------------------------------------------------------

_INTEGER = re.compile(r"[+-]?\d+")
_STRIP_TOKENS = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$")


def normalise_answer(answer: str) -> str:
    """Canonical spelling for the exact-match fast path: no spaces, ``$``, sizing or spacing commands."""
    text = answer.strip()
    for token in _STRIP_TOKENS:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = "".join(text.split())
    return text.rstrip(".")


def canonical_integer(text: str) -> str | None:
    """``text`` as a canonical integer spelling ('-12', '0', '7' for '+007'), None if not an integer.

    Compared as strings, not through ``int()``: Python refuses to convert strings of more than 4300
    digits, and a model can box any number of digits.
    """
    match = _INTEGER.fullmatch(text)
    if match is None:
        return None
    digits = text.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if text.startswith("-") and digits != "0" else digits


def fast_verdict(boxed: str, answer: str) -> str | None:
    """'correct' / 'wrong' when the strings decide it without math-verify, else None."""
    pred, gold = normalise_answer(boxed), normalise_answer(answer)
    if pred == gold:
        return "correct"
    pred_int, gold_int = canonical_integer(pred), canonical_integer(gold)
    if pred_int is not None and gold_int is not None:
        return "correct" if pred_int == gold_int else "wrong"
    return None


def verify_with_math_verify(boxed: str, answer: str) -> str:
    """math-verify's verdict on one boxed answer: 'correct', 'wrong' or 'unparsable'.

    Runs without math-verify's signal-based timeouts: call it inside ``VerifierPool``, which bounds
    its time. Sympy can hang or explode on adversarial input.
    """
    from math_verify import parse, verify  # heavy (sympy); imported in the worker processes only

    gold = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    pred = parse("\\boxed{" + boxed + "}", parsing_timeout=None)
    if not pred:
        return "unparsable"
    if gold and verify(gold, pred, timeout_seconds=None):
        return "correct"
    # math-verify returns the raw string as a fallback when it could not build a sympy object.
    return "wrong" if any(not isinstance(p, str) for p in pred) else "unparsable"


# ---------------------------------------------------------------------------------------------------
# Bounded process pool
# ---------------------------------------------------------------------------------------------------


def _worker_main(conn: Connection, fn: Callable[..., Any], warmup: tuple[Any, ...] | None) -> None:
    """Verifier process: warm up (imports), report ready, then answer tasks until told to stop."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if warmup is not None:
        fn(*warmup)
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            # The parent is gone (e.g. SIGKILLed): leave at once. A normal interpreter exit can block
            # joining library threads, leaving an orphan that holds the parent's stdout open.
            os._exit(0)
        if task is None:
            return
        index, args = task
        try:
            result = fn(*args)
        except Exception as exc:  # the verifier's failure on one input must not end the pool
            result = ("error", repr(exc))
        conn.send((index, result))


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    task: int | None = None
    started: float = 0.0


class VerifierPool:
    """Processes that apply ``fn`` to tasks with a per-task wall-clock bound.

    A task that runs past ``timeout_s`` gets ``"timeout"`` as its result; its worker is killed and a
    fresh one started, so one pathological input costs one ``timeout_s`` and stalls nothing else.
    A worker that dies gets ``"crash"``. Workers start lazily (spawn context: safe under torch
    distributed / CUDA parents) and stay up until ``close()``.
    """

    def __init__(
        self, fn: Callable[..., Any], *, workers: int, timeout_s: float, warmup: tuple[Any, ...] | None = None
    ):
        if workers < 1 or timeout_s <= 0:
            raise RewardError(f"verifier pool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.fn, self.num_workers, self.timeout_s, self.warmup = fn, workers, timeout_s, warmup
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self.restarts = 0
        self.revived = 0
        """Workers found dead between two ``map`` calls and replaced (see ``_revive``)."""

    def map(self, tasks: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Results in task order; ``"timeout"`` or ``"crash"`` for tasks that did not finish."""
        results: list[Any] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        self._revive()
        self._fill_workers(min(self.num_workers, len(tasks)))
        while pending or any(w.task is not None for w in self._workers):
            self._dispatch(pending, tasks)
            self._collect(results)
            self._expire(results)
        return results

    def start(self) -> None:
        """Start every worker now (each imports and warms up in the background); ``map`` waits for them."""
        self._revive()
        self._fill_workers(self.num_workers)

    def close(self) -> None:
        for worker in self._workers:
            self._stop(worker)
        self._workers.clear()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _revive(self) -> None:
        """Replace workers that died while idle. Something else may kill them between two calls:
        SGLang's ``Engine.shutdown()`` kills every child process of its caller (a new FP8 engine each
        stage does that), and a dead idle worker would fail the next task it is sent."""
        for index, worker in enumerate(self._workers):
            if not worker.process.is_alive():
                self._stop(worker, kill=True)
                self._workers[index] = self._start()
                self.revived += 1

    def _fill_workers(self, wanted: int) -> None:
        while len(self._workers) < wanted:
            self._workers.append(self._start())

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self.fn, self.warmup), daemon=True)
        process.start()
        child.close()
        return _Worker(process=process, conn=parent, started=time.monotonic())

    def _dispatch(self, pending: deque[int], tasks: Sequence[tuple[Any, ...]]) -> None:
        for worker in self._workers:
            if pending and worker.ready and worker.task is None:
                worker.task = pending.popleft()
                worker.started = time.monotonic()
                worker.conn.send((worker.task, tasks[worker.task]))

    def _collect(self, results: list[Any]) -> None:
        waiting = [w for w in self._workers if w.task is not None or not w.ready]
        if not waiting:
            return
        deadline = min(self._deadline(w) for w in waiting)
        by_conn = {id(w.conn): w for w in waiting}
        for conn in wait([w.conn for w in waiting], timeout=max(0.0, deadline - time.monotonic())):
            worker = by_conn[id(conn)]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                if not worker.ready:
                    self.close()
                    raise RewardError(
                        "a verifier process died while starting; run "
                        "`python -c 'import math_verify'` to see the import error"
                    ) from None
                self._replace(worker, results, _CRASH)
                continue
            if message == "ready":
                worker.ready = True
            else:
                index, result = message
                results[index] = result
                worker.task = None

    def _expire(self, results: list[Any]) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if now < self._deadline(worker):
                continue
            if not worker.ready:
                self.close()
                raise RewardError(
                    f"a verifier process did not start within {WORKER_START_TIMEOUT_S:.0f} s; "
                    "check that math-verify imports (python -c 'import math_verify')"
                )
            log.warning("verification of one answer exceeded %.1f s; killing its worker", self.timeout_s)
            self._replace(worker, results, _TIMEOUT)

    def _deadline(self, worker: _Worker) -> float:
        if not worker.ready:
            return worker.started + WORKER_START_TIMEOUT_S
        return worker.started + self.timeout_s if worker.task is not None else float("inf")

    def _replace(self, worker: _Worker, results: list[Any], outcome: str) -> None:
        if worker.task is not None:
            results[worker.task] = outcome
        self._stop(worker, kill=True)
        self._workers[self._workers.index(worker)] = self._start()
        self.restarts += 1

    @staticmethod
    def _stop(worker: _Worker, kill: bool = False) -> None:
        if not kill and worker.process.is_alive():
            try:
                worker.conn.send(None)
                worker.process.join(timeout=1.0)
            except (BrokenPipeError, OSError):
                pass
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()


# ---------------------------------------------------------------------------------------------------
# The math reward
# ---------------------------------------------------------------------------------------------------


class MathReward:
    """1.0 when the response's final answer equals the reference (math-verify equivalence), else 0.0;
    the answer is found per ``reward.math.answer_format`` (``rewards.answers``)."""

    def __init__(self, *, workers: int, timeout_s: float, options: MathOptions | None = None):
        self.extract = extractor((options or MathOptions()).answer_format)
        self.pool = VerifierPool(verify_with_math_verify, workers=workers, timeout_s=timeout_s, warmup=("1", "1"))

    def score(self, responses: list[str], answers: list[str]) -> list[tuple[float, str]]:
        if len(responses) != len(answers):
            raise RewardError(f"score() got {len(responses)} responses but {len(answers)} reference answers")
        reasons: list[str | None] = []
        slow: list[tuple[int, tuple[str, str]]] = []
        errors: list[str] = []
        for response, answer in zip(responses, answers):
            try:
                boxed = self.extract(response)
                verdict = boxed.reason if boxed.content is None else fast_verdict(boxed.content, answer)
            except Exception as exc:  # one answer the checker cannot handle must not stop the stage
                errors.append(repr(exc))
                verdict = _ERROR
            if verdict is None:
                slow.append((len(reasons), (boxed.content, answer)))
            reasons.append(verdict)
        for (index, _), outcome in zip(slow, self.pool.map([args for _, args in slow])):
            if isinstance(outcome, str) and outcome in REASONS:
                reasons[index] = outcome
            else:  # ("error", repr(exc)): the verifier raised on this input
                errors.append(str(outcome[1]) if isinstance(outcome, tuple) else repr(outcome))
                reasons[index] = _ERROR
        if errors:
            log.warning("checking %d answer(s) raised; scored 0, reason 'error' (first: %s)", len(errors), errors[0])
        return [Score(CORRECT_REWARD if r == "correct" else INCORRECT_REWARD, r) for r in reasons]

    def start(self) -> None:
        self.pool.start()

    def close(self) -> None:
        self.pool.close()
