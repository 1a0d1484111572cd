"""Where a math response states its final answer: one extractor per ``reward.math.answer_format``.

Each extractor returns ``Extracted(content, reason)``: the answer text to compare (through the
math reward's fast path and math-verify), or None with the reason it has none, counted per stage
like every reward reason (``rollout/reward_reason/<reason>``).

* ``boxed`` (default): the last ``\\boxed{...}`` / ``\\fbox{...}``, braces balanced (``no_box``,
  ``unparsable`` when the last box never closes);
* ``last_number``: the last number in the text: an integer, a decimal or a fraction such as
  ``-3/4``, thousands separators allowed (``no_number``);
* ``gsm8k``: what follows the last ``####`` on its line, GSM8K's convention (``no_answer_marker``);
* ``answer_tag``: the content of the last ``<answer>...</answer>`` (``no_answer_tag``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from megatron_mugrpo.errors import ConfigError

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?(?![\w])")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Extracted:
    content: str | None
    """The stated answer; None when the response has none in this format."""
    reason: str = ""
    """Why ``content`` is None."""


def last_boxed(text: str) -> Extracted:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

    A last box whose braces never close (a truncated response) is 'unparsable', even when an earlier
    box is complete: the model's final answer is the last one it started.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return Extracted(None, "no_box")
    brace = text.find("{", start)
    between = text[start:brace] if brace >= 0 else ""
    if brace < 0 or not re.fullmatch(r"\\(boxed|fbox)\s*", between):
        return Extracted(None, "unparsable")
    depth = 0
    for pos in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            content = text[brace + 1 : pos].strip()
            return Extracted(content, "") if content else Extracted(None, "unparsable")
    return Extracted(None, "unparsable")


def last_number(text: str) -> Extracted:
    """The last number in ``text`` (thousands separators dropped, a fraction kept as a/b)."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return Extracted(None, "no_number")
    return Extracted(re.sub(r"\s+", "", numbers[-1]).replace(",", ""))


def gsm8k_answer(text: str) -> Extracted:
    """What follows the last ``####`` on its line."""
    marker = text.rfind("####")
    if marker < 0:
        return Extracted(None, "no_answer_marker")
    content = text[marker + 4 :].split("\n", 1)[0].strip().replace(",", "")
    return Extracted(content) if content else Extracted(None, "no_answer_marker")


def answer_tag(text: str) -> Extracted:
    """The content of the last ``<answer>...</answer>``."""
    tags = _ANSWER_TAG.findall(text)
    if not tags or not tags[-1].strip():
        return Extracted(None, "no_answer_tag")
    return Extracted(tags[-1].strip())


ANSWER_FORMATS: dict[str, Callable[[str], Extracted]] = {
    "boxed": last_boxed,
    "last_number": last_number,
    "gsm8k": gsm8k_answer,
    "answer_tag": answer_tag,
}
"""``reward.math.answer_format`` -> extractor."""


def extractor(answer_format: str) -> Callable[[str], Extracted]:
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError(f"reward.math.answer_format={answer_format!r} is not one of {tuple(ANSWER_FORMATS)}")
    return ANSWER_FORMATS[answer_format]


@dataclass(kw_only=True)
class MathOptions:
    """``reward.math.*``: how the math reward finds a response's final answer."""

    answer_format: str = "boxed"
    """'boxed' (the last \\boxed{}), 'last_number', 'gsm8k' (after the last ####) or 'answer_tag'
    (inside the last <answer>...</answer>)."""

    def __post_init__(self) -> None:
        extractor(self.answer_format)
