"""Built-in procedural math task and a character-level tokenizer, for the CPU demo and the tests.

Nothing can be downloaded at run time, so the demo trains a tiny locally built model on problems
generated here. Problems are short two-operand sums/differences such as ``23+58``; the prompt is
``23+58=`` and the model is taught (warm start) to answer ``\\boxed{81}`` followed by EOS, which the
math reward verifies like any real answer. Prompts are kept short on purpose: a character-level
model pays one token per character.

    rows = builtin_problems("arithmetic", n=4096, seed=0, split="train")   # [{"problem", "answer"}]
    tokenizer = build_char_tokenizer("runs/demo/tokenizer")                 # AutoTokenizer-loadable

Train and eval splits are disjoint by construction: a problem belongs to the eval split iff a
stable hash of its text falls in the eval bucket, whatever the seed or the number drawn.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

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

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One (problem, answer) pair, e.g. ('23+58', '81')."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.operators)
        if op == "-" and a < b:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}", str(value)


BUILTIN_TASKS: dict[str, ArithmeticTask] = {
    "arithmetic_easy": ArithmeticTask(max_operand=9, operators="+-"),
    "addition": ArithmeticTask(max_operand=99, operators="+"),
    "arithmetic": ArithmeticTask(max_operand=99, operators="+-"),
    "arithmetic_hard": ArithmeticTask(max_operand=999, operators="+-*"),
}


def is_eval_problem(problem: str) -> bool:
    """Stable split membership: the same problem text is always in the same split."""
    return zlib.crc32(problem.encode()) % EVAL_BUCKETS == 0


def builtin_problems(task: str, n: int, seed: int, split: str) -> list[dict[str, str]]:
    """Generate ``n`` problems of a built-in task as ``{"problem": ..., "answer": ...}`` rows.

    Deterministic in (task, n, seed, split). Problems are distinct while the split's problem space
    allows it; tiny spaces (e.g. 'arithmetic_easy' with large n) repeat problems.
    """
    if task not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {task!r} (data.builtin_task); choose one of {tuple(BUILTIN_TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if n < 1:
        raise ValueError(f"n={n} problems must be >= 1")
    spec, want_eval = BUILTIN_TASKS[task], split == "eval"
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
    if task not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {task!r} (data.builtin_task); choose one of {tuple(BUILTIN_TASKS)}")
    return builtin_prompt


def builtin_reward_kind(task: str) -> str:
    """The reward kind (``reward.kind``) that scores a built-in task: 'math' for the arithmetic tasks."""
    if task not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {task!r} (data.builtin_task); choose one of {tuple(BUILTIN_TASKS)}")
    return "math"


def builtin_completion(answer: str) -> str:
    """The answer text the demo model is taught to produce (EOS follows), e.g. '\\boxed{81}'."""
    return f"\\boxed{{{answer}}}"


# --------------------------------------------------------------------------------------------------
# Character-level tokenizer
# --------------------------------------------------------------------------------------------------

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = string.digits + "+-*/=()[]{}\\^_.,:;!?'\"<>|$%&#~ \n" + string.ascii_letters
"""Everything the tasks, the answer format and short English instructions need."""


def char_vocab() -> dict[str, int]:
    """Token → id: the special tokens first (pad = 0, bos = 1, eos = 2, unk = 3), then characters."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}


def build_char_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer (vocabulary < 128) built locally with `tokenizers`.

    Encoding prepends <bos>; decoding concatenates characters. Unknown characters map to <unk>.
    When ``out_dir`` is given the tokenizer is saved there (``AutoTokenizer.from_pretrained`` loads it).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Oniguruma's (?m) lets '.' match newlines too: every character is its own pre-token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
