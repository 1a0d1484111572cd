"""Answer formats of the math reward: where a response states its final answer."""

from __future__ import annotations

import pytest

from megatron_mugrpo.rewards.answers import Extracted, extractor


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        ("boxed", "so \\boxed{12} and then \\boxed{\\frac{1}{2}}", Extracted("\\frac{1}{2}")),
        ("boxed", "the sum is 7", Extracted(None, "no_box")),
        ("boxed", "\\boxed{3} then \\boxed{4", Extracted(None, "unparsable")),
        ("last_number", "3 apples and 4 pears make 7.", Extracted("7")),
        ("last_number", "The answer is -3/4.", Extracted("-3/4")),
        ("last_number", "It costs 1,234.50 dollars", Extracted("1234.50")),
        ("last_number", "x2 and v3.1 are names, 5 is not", Extracted("5")),
        ("last_number", "no digits here", Extracted(None, "no_number")),
        ("gsm8k", "He has 3 + 4 = 7 apples.\n#### 7\n", Extracted("7")),
        ("gsm8k", "#### 1,000", Extracted("1000")),
        ("gsm8k", "He has 7 apples.", Extracted(None, "no_answer_marker")),
        ("answer_tag", "<think>2+2</think><answer> 4 </answer>", Extracted("4")),
        ("answer_tag", "<answer>3</answer> wait <ANSWER>5</ANSWER>", Extracted("5")),
        ("answer_tag", "<answer></answer>", Extracted(None, "no_answer_tag")),
    ],
)
def test_extractors(fmt, text, expected):
    assert extractor(fmt)(text) == expected


def test_unknown_format():
    with pytest.raises(ValueError, match="answer_format='xml'"):
        extractor("xml")
