"""Built-in procedural tasks (math and code), for the CPU demos and the tests.

Nothing can be downloaded at run time, so the demos train a tiny locally built model on problems
generated here. Prompts are kept short on purpose: a character-level model pays one token per character.

* **Math** (``arithmetic``, ``addition``, ...): short two-operand sums/differences such as ``23+58``;
  the prompt is ``23+58=`` and the model is taught (warm start) to answer ``\\boxed{81}`` followed by
  EOS, which the math reward verifies like any real answer.
* **Long chains** (``running_sum``, ``running_sum_long``, ``running_sum_hard``, ``running_sum_tagged``,
  ``running_sum_repeat``):
  add ``terms`` numbers left to right writing every partial sum, ``3+7+2=`` →
  ``3+7=10,10+2=12,\\boxed{12}``. Answers are 150-400 tokens, and one wrong partial sum carries
  through to the boxed answer, so a response has a long suffix after its first mistake (the regime
  the μ-GRPO paper's negative-advantage veto is about). ``terms`` sets the length, ``max_term`` the
  difficulty, ``tagged`` (``a3+b7+c2``) and ``repeat`` (``437+8+8+8``: no term to find) how hard the
  next term is to find (``RunningSumTask``).
* **Code** (``code_expr``): the problem is an expression in two integers, e.g. ``max(a,b)*3-7``; the
  prompt is ``max(a,b)*3-7:`` and the answer is a program that reads ``a b`` from stdin and prints the
  expression's value, in a fence (``code_solution``). The reference answer is a ``CodeProblem`` (as
  JSON) with hidden stdin/stdout tests on multi-digit inputs, which the code reward runs the program on.

    rows = builtin_problems("arithmetic", n=4096, seed=0, split="train")   # [{"problem", "answer"}]

Their model reads them with the character tokenizer (``megatron_mugrpo.char_tokenizer``).

Train and eval splits are disjoint by construction: a problem belongs to the eval split iff a
stable hash of its text falls in the eval bucket, whatever the seed or the number drawn.
"""

from __future__ import annotations

import functools
import random
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from megatron_mugrpo.rewards.code import CodeProblem

SPLITS = ("train", "eval")
EVAL_BUCKETS = 10
"""One problem in EVAL_BUCKETS (by crc32 of its text) is held out for evaluation."""
MAX_DRAWS_PER_PROBLEM = 50
"""Draws allowed per requested problem before duplicates are accepted (small problem spaces)."""

PROMPT_TEMPLATE = "{problem}="
"""Prompt text of a built-in problem: short, since a character-level model pays per character."""


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """Two-operand integer arithmetic; operands are drawn uniformly from [0, max_operand]."""

    max_operand: int
    """Difficulty knob: 9 → one-digit operands, 99 → two digits, ..."""
    operators: str
    """Subset of '+-*'. Differences are ordered so that the answer is never negative."""
    reward_kind: ClassVar[str] = "math"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One (problem, answer) pair, e.g. ('23+58', '81')."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.operators)
        if op == "-" and a < b:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}", str(value)

    def prompt(self, problem: str) -> str:
        return builtin_prompt(problem)


TERM_TAGS = string.ascii_letters
"""The letters a tagged running sum's terms carry, in order (a-z, then A-Z: 52 terms at most)."""
CHAIN_SLIPS = (-10, -1, 1, 10)
"""What a slipped partial sum is off by: a dropped or an extra carry, or a units digit off by one."""
FIRST_MIN = 10
"""Smallest first term of a sum with ``RunningSumTask.first_max``: a multi-digit start."""


@dataclass(frozen=True, kw_only=True)
class RunningSumTask:
    """Add ``terms`` integers from [1, max_term] left to right, writing every partial sum.

    The problem is the sum itself, ``3+7+2``; the answer taught (``chain_solution``) is the chain of
    the ``terms − 1`` additions, each starting from the previous partial sum, then the total boxed:
    ``3+7=10,10+2=12,\\boxed{12}``. Only the boxed total is verified (the math reward), and since every
    step starts from the one before, a wrong partial sum anywhere makes the total wrong: the tokens
    after a response's first mistake are a suffix whose fate was sealed by it.

    Length (characters, so tokens, of the answer) grows linearly in ``terms``: with one-digit terms a
    step is about 9 characters, with two-digit terms about 12 (measured: docs/long_reasoning.md).
    Difficulty: ``max_term`` (9: one-digit terms, 99: two-digit ones), ``terms`` (each step is a
    chance to slip), ``tagged`` and ``repeat`` (how hard it is to find the next term).

    ``tagged``: every term carries a letter, ``a3+b7+c2``, and each step writes the tag of the term
    it adds, ``3+b7=10,10+c2=12,\\boxed{12}``. Untagged, the k-th step must find the k-th term of
    the prompt by counting, since one-digit terms repeat and their content cannot tell them apart;
    a two-layer model learns that poorly (the untagged 20-term warm start samples 5% right chains).
    With tags the next term is found by content: the letter after the previous step's, then the
    digits after that letter in the prompt (an induction-head lookup), and what is left to slip on is
    mostly the addition (docs/long_reasoning.md).

    ``repeat``: every term after the first is one step d from [1, ``max_term``], ``437+8+8+8``
    → ``437+8=445,445+8=453,453+8=461,\\boxed{461}``, so any copy of d in the prompt is the right
    term and no step has to find its own. Why: with tags or without, the tiny models' chains failed
    on finding the k-th term, never on the additions (experiments/README.md, F8); without the lookup
    what is left to slip on is the addition, and the warm start's taught slips
    (``warmstart.answer_noise``) set how often. A repeated step leaves a problem space of
    first terms × d, so ``repeat`` needs ``first_max``: with one-digit firsts there would be 81
    problems, 8 of them held out.
    """

    terms: int
    """Length knob: numbers to add (the answer has terms − 1 steps)."""
    max_term: int = 9
    """Difficulty knob: terms are drawn uniformly from [1, max_term]."""
    tagged: bool = False
    """Lookup knob: terms carry the letters of ``TERM_TAGS`` in order, and the steps copy them."""
    repeat: bool = False
    """Lookup knob: every term after the first is the same step d, drawn from [1, max_term]."""
    first_max: int = 0
    """The first term is drawn from [FIRST_MIN, first_max] when > 0 (a multi-digit start: with
    ``repeat``, the problem space is these firsts × max_term steps); 0: from [1, max_term] like the rest."""
    reward_kind: ClassVar[str] = "math"

    def __post_init__(self) -> None:
        if self.terms < 2:
            raise ValueError(f"RunningSumTask.terms={self.terms} must be >= 2 (one addition at least)")
        if self.max_term < 1:
            raise ValueError(f"RunningSumTask.max_term={self.max_term} must be >= 1")
        if self.tagged and self.terms > len(TERM_TAGS):
            raise ValueError(
                f"RunningSumTask.terms={self.terms} is more than the {len(TERM_TAGS)} tags of a tagged sum"
            )
        if self.first_max and self.first_max < FIRST_MIN:
            raise ValueError(
                f"RunningSumTask.first_max={self.first_max} must be 0 (first term like the others) "
                f"or >= {FIRST_MIN} (a multi-digit first term)"
            )
        if self.repeat and not self.first_max:
            raise ValueError(
                "RunningSumTask.repeat=True needs first_max (e.g. 799): with the first term from "
                f"[1, max_term={self.max_term}] there are only {self.max_term**2} problems to split into train and eval"
            )

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One (problem, answer) pair, e.g. ('3+7+2', '12'), tagged ('a3+b7+c2', '12') or repeated
        ('437+8+8+8', '461')."""
        first = rng.randint(FIRST_MIN, self.first_max) if self.first_max else rng.randint(1, self.max_term)
        if self.repeat:
            rest = [rng.randint(1, self.max_term)] * (self.terms - 1)
        else:
            rest = [rng.randint(1, self.max_term) for _ in range(self.terms - 1)]
        values = [first, *rest]
        tags = TERM_TAGS if self.tagged else [""] * self.terms
        return "+".join(f"{tag}{value}" for tag, value in zip(tags, values)), str(sum(values))

    def prompt(self, problem: str) -> str:
        return builtin_prompt(problem)

    def solution(self, problem: str, *, flawed: bool, rng: random.Random) -> str:
        """The chain the warm start teaches; ``flawed``: one step (uniform over the steps) slips by one
        of ``CHAIN_SLIPS`` and every later step continues from the wrong sum (``chain_solution``)."""
        steps = problem.count("+")
        if not flawed:
            return chain_solution(problem)
        return chain_solution(problem, slip_step=rng.randrange(steps), slip=rng.choice(CHAIN_SLIPS))


def chain_terms(problem: str) -> list[tuple[str, int]]:
    """The (tag, value) terms of a running-sum problem: 'a3+b17' → [('a', 3), ('b', 17)]; the tag is
    '' for an untagged problem ('3+17')."""
    terms = []
    for part in problem.split("+"):
        tag = part.rstrip(string.digits)
        terms.append((tag, int(part[len(tag) :])))
    return terms


def chain_solution(problem: str, *, slip_step: int | None = None, slip: int = 0) -> str:
    """The running-sum chain of ``problem`` ('3+7+2' → '3+7=10,10+2=12,\\boxed{12}'; tagged,
    'a3+b7+c2' → '3+b7=10,10+c2=12,\\boxed{12}').

    With ``slip_step`` = k (0-based), the k-th step's written sum is off by ``slip`` (clamped at 0),
    and the following steps add to that wrong sum, so the boxed total is off as well: an early
    mistake carries through to the end.
    """
    terms = chain_terms(problem)
    total, steps = terms[0][1], []
    for k, (tag, value) in enumerate(terms[1:]):
        new = total + value
        if k == slip_step:
            new = max(0, new + slip)
        steps.append(f"{total}+{tag}{value}={new}")
        total = new
    return ",".join(steps) + "," + builtin_completion(str(total))


def chain_first_error(problem: str, response: str) -> int | None:
    """The index of the first wrong step of a response to a running-sum ``problem`` (a step whose
    operands or sum differ from the correct chain's, or that is missing), or None when every step
    and the total are right. Steps are the comma-separated parts before the box."""
    expected = chain_solution(problem).split(",")
    written = response.split(",")
    for k, step in enumerate(expected):
        if k >= len(written) or written[k].strip() != step:
            return k
    return None


CODE_CORES: dict[str, Callable[[Any, Any], Any]] = {
    "a+b": lambda a, b: a + b,
    "a-b": lambda a, b: a - b,
    "b-a": lambda a, b: b - a,
    "a*b": lambda a, b: a * b,
    "max(a,b)": max,
    "min(a,b)": min,
    "a": lambda a, b: a,
    "b": lambda a, b: b,
}
"""The innermost part of a code task's expression, and its value (ints, or the flaw's strings)."""
CODE_PROMPT_TEMPLATE = "{problem}:"
CODE_READ = "a,b=map(int,input().split())"
CODE_READ_FLAWED = "a,b=input().split()"
"""The warm start's deliberate flaw (``warmstart.answer_noise``): the input is not converted to int,
so ``a+b`` concatenates, ``max`` compares as text and ``*``/``-`` repeat or raise. The program looks
right; only running it shows the difference."""


@dataclass(frozen=True, kw_only=True)
class CodeExpressionTask:
    """Write a program that reads two integers ``a b`` and prints an expression of them.

    Expressions are ``CORE``, ``CORE*k``, ``CORE+c``, ``CORE*k-c``, ... with a core of ``CODE_CORES``
    (parenthesised before ``*k`` when it is a sum or difference), k in [2, max_factor] and c in
    [1, max_constant]; bare ``a`` and ``b`` are left out (the flawed program would pass them). Each
    problem has ``tests`` hidden stdin/stdout tests with operands of 1 to ``max_digits`` digits, the
    same for a problem whatever the seed, drawn so that the flawed program fails at least one.

    The default space holds about 1,350 problems (about 135 held out). Constants are one digit
    because copying is what the demo's tiny model finds hard: with c up to 99 the 2-layer, 64-wide
    model copied the expression exactly in 41% of samples after 800 warm-start steps, against 92-96%
    with one-digit constants after 1,000.
    """

    max_factor: int = 9
    max_constant: int = 9
    max_digits: int = 3
    tests: int = 5
    reward_kind: ClassVar[str] = "code"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One (problem, answer) pair: ('max(a,b)*3-7', CodeProblem(...).to_json())."""
        while True:
            core = rng.choice(tuple(CODE_CORES))
            factor = rng.randint(2, self.max_factor) if rng.random() < 0.5 else 0
            constant = rng.randint(1, self.max_constant) * rng.choice((1, -1)) if rng.random() < 0.75 else 0
            if factor or constant or len(core) > 1:
                break
        problem = core
        if factor:
            problem = f"({core})*{factor}" if core in ("a+b", "a-b", "b-a") else f"{core}*{factor}"
        if constant:
            problem += f"{constant:+d}"
        return problem, _tests_json(self, problem)

    def problem_tests(self, problem: str) -> CodeProblem:
        """The hidden tests of ``problem`` (deterministic in its text)."""
        from megatron_mugrpo.rewards.code import CodeProblem

        rng = random.Random(f"code-tests/{problem}")
        while True:
            pairs = [(self._operand(rng), self._operand(rng)) for _ in range(self.tests)]
            outputs = [f"{code_value(problem, a, b)}\n" for a, b in pairs]
            if any(_flawed_output(problem, a, b) != out for (a, b), out in zip(pairs, outputs)):
                return CodeProblem(inputs=tuple(f"{a} {b}\n" for a, b in pairs), outputs=tuple(outputs))

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def prompt(self, problem: str) -> str:
        return CODE_PROMPT_TEMPLATE.format(problem=problem)


@functools.lru_cache(maxsize=1 << 16)
def _tests_json(task: CodeExpressionTask, problem: str) -> str:
    """``problem_tests`` as JSON, cached: a small problem space is drawn from many times over."""
    return task.problem_tests(problem).to_json()


def code_value(problem: str, a: Any, b: Any) -> Any:
    """The value of a code task's expression at ``a``, ``b`` (ints; strings give the flaw's behaviour,
    raising TypeError where Python would)."""
    rest = problem
    core = next(c for c in sorted(CODE_CORES, key=len, reverse=True) if rest.lstrip("(").startswith(c))
    value = CODE_CORES[core](a, b)
    rest = rest.lstrip("(")[len(core) :].lstrip(")")
    if rest.startswith("*"):
        digits = len(rest) - len(rest[1:].lstrip("0123456789"))
        value, rest = value * int(rest[1:digits]), rest[digits:]
    if rest:
        value = value + int(rest)  # '+c' or '-c'
    return value


def _flawed_output(problem: str, a: int, b: int) -> str | None:
    """What the flawed program (operands left as strings) prints, or None where it raises."""
    try:
        return f"{code_value(problem, str(a), str(b))}\n"
    except TypeError:
        return None


def code_solution(problem: str, *, flawed: bool = False) -> str:
    """The fenced program the warm start teaches for a code task's problem (EOS follows).

    'max(a,b)*3-7' → '```\\na,b=map(int,input().split())\\nprint(max(a,b)*3-7)\\n```'; ``flawed``
    reads the operands without converting them (``CODE_READ_FLAWED``). The fence is unlabelled, which
    the code reward accepts (``extract_program``), and saves a character-level model six tokens.
    """
    read = CODE_READ_FLAWED if flawed else CODE_READ
    return f"```\n{read}\nprint({problem})\n```"


BuiltinTask = ArithmeticTask | RunningSumTask | CodeExpressionTask

BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arithmetic_easy": ArithmeticTask(max_operand=9, operators="+-"),
    "addition": ArithmeticTask(max_operand=99, operators="+"),
    "arithmetic": ArithmeticTask(max_operand=99, operators="+-"),
    "arithmetic_hard": ArithmeticTask(max_operand=999, operators="+-*"),
    "running_sum": RunningSumTask(terms=20, max_term=9),
    "running_sum_long": RunningSumTask(terms=40, max_term=9),
    "running_sum_hard": RunningSumTask(terms=16, max_term=99),
    "running_sum_tagged": RunningSumTask(terms=20, max_term=9, tagged=True),
    "running_sum_repeat": RunningSumTask(terms=21, max_term=9, repeat=True, first_max=799),
    "running_sum_repeat_short": RunningSumTask(terms=11, max_term=9, repeat=True, first_max=799),
    "running_sum_repeat_long": RunningSumTask(terms=31, max_term=9, repeat=True, first_max=729),
    "code_expr": CodeExpressionTask(),
}
"""Built-in tasks (``data.builtin_task``). The running sums' answers with the character tokenizer, EOS
included (min / median / max over 2,000 train problems): running_sum 154 / 162 / 176 tokens,
running_sum_long 338 / 362 / 376, running_sum_hard 161 / 174 / 182, running_sum_tagged 173 / 181 / 199
(prompt ≤ 61 tokens), running_sum_repeat 171 / 212 / 212 (prompt ≤ 45 tokens; its first terms stop at 799
so that no partial sum reaches four digits) (docs/long_reasoning.md). ``running_sum_repeat_short`` and
``_long`` are the same chain with 11 and 31 terms, F8's answer-length axis: 91 / 112 / 112 tokens
(prompt ≤ 25) and 251 / 312 / 312 (prompt ≤ 65; first terms stop at 729, again below four digits)."""


def is_eval_problem(problem: str) -> bool:
    """Stable split membership: the same problem text is always in the same split."""
    return zlib.crc32(problem.encode()) % EVAL_BUCKETS == 0


def builtin_problems(task: str, n: int, seed: int, split: str) -> list[dict[str, str]]:
    """Generate ``n`` problems of a built-in task as ``{"problem": ..., "answer": ...}`` rows.

    Deterministic in (task, n, seed, split). Problems are distinct while the split's problem space
    allows it; tiny spaces (e.g. 'arithmetic_easy' with large n) repeat problems.
    """
    spec = _task(task)
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if n < 1:
        raise ValueError(f"n={n} problems must be >= 1")
    want_eval = split == "eval"
    rng = random.Random(f"{task}/{split}/{seed}")  # str seeds are hashed with SHA-512: stable across runs
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    draws = 0
    while len(rows) < n:
        draws += 1
        problem, answer = spec.sample(rng)
        if is_eval_problem(problem) != want_eval:
            continue
        if problem in seen and draws < MAX_DRAWS_PER_PROBLEM * n:
            continue
        seen.add(problem)
        rows.append({"problem": problem, "answer": answer})
    return rows


def builtin_prompt(problem: str) -> str:
    """The prompt text of a built-in problem, e.g. '23+58='."""
    return PROMPT_TEMPLATE.format(problem=problem)


def builtin_template(task: str) -> Callable[[str], str]:
    """The prompt template of a built-in task's problems (text → the prompt the model sees)."""
    return _task(task).prompt


def builtin_reward_kind(task: str) -> str:
    """The reward kind (``reward.kind``) that scores a built-in task: 'math' for the arithmetic tasks,
    'code' for the code tasks."""
    return _task(task).reward_kind


def builtin_solution(task: str, problem: str, *, noise: float, rng: random.Random) -> str | None:
    """The completion the warm start teaches for a task that defines its own: the running sums' chain,
    flawed (one slipped step) with probability ``noise``. None for a task whose worked solution the
    warm start writes itself (two-operand arithmetic, code); ``rng`` is then left untouched, so those
    tasks' warm starts draw exactly what they drew before."""
    spec = _task(task)
    if not isinstance(spec, RunningSumTask):
        return None
    return spec.solution(problem, flawed=rng.random() < noise, rng=rng)


def _task(task: str) -> BuiltinTask:
    if task not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {task!r} (data.builtin_task); choose one of {tuple(BUILTIN_TASKS)}")
    return BUILTIN_TASKS[task]


def builtin_completion(answer: str) -> str:
    """The answer text the demo model is taught to produce (EOS follows), e.g. '\\boxed{81}'."""
    return f"\\boxed{{{answer}}}"
