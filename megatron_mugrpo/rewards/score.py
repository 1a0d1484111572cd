"""What every reward returns per response: ``Score``, a (reward, reason) pair with optional test counts.

Its own module, below the registry: the rewards the registry builds import it while the registry
assembles the ``reward`` section from their option classes.
"""

from __future__ import annotations

from typing import Any


class Score(tuple):
    """``(reward, reason)``: unpacks and compares like that pair. Rewards that run tests also set
    ``passed`` / ``total`` (tests) and ``seconds`` (time spent on this response); None elsewhere."""

    def __new__(
        cls,
        reward: float,
        reason: str,
        passed: int | None = None,
        total: int | None = None,
        seconds: float | None = None,
    ) -> Score:
        score = super().__new__(cls, (reward, reason))
        score.passed, score.total, score.seconds = passed, total, seconds
        return score

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickles with its test counts
        return (self[0], self[1], self.passed, self.total, self.seconds)

    @property
    def reward(self) -> float:
        return self[0]

    @property
    def reason(self) -> str:
        return self[1]

    @property
    def pass_fraction(self) -> float | None:
        """Fraction of the tests passed (None for rewards without tests)."""
        return None if self.passed is None or not self.total else self.passed / self.total
