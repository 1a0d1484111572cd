"""The method's schedule, the ``stages`` section: S stages of μ = B_train / B_mini optimizer updates each.

μ is μ-GRPO's staleness: every update of a stage reuses the data one frozen behaviour policy generated
(standard GRPO is μ = 4; the paper's default is μ = 1024). Both loops and the planner read it; the
staged loop generates B_train groups per stage, the async loop counts a stage as μ updates.

    stages = StagesConfig(num_stages=4, train_groups=32768, mini_groups=32)
    stages.updates_per_stage   # 1024
    stages.total_updates       # 4096
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mugrpo.errors import require


@dataclass(kw_only=True)
class StagesConfig:
    """The staged schedule: μ = train_groups / mini_groups optimizer updates per stage."""

    num_stages: int = 4
    """Generation → optimization stages (the paper's default is 4)."""
    train_groups: int = 32768
    """B_train: prompt groups generated per stage."""
    mini_groups: int = 32
    """B_mini: prompt groups per optimizer update."""
    seed: int = 0
    """Seed of the minibatch permutation and of sampling."""

    def __post_init__(self) -> None:
        require(self.num_stages >= 1, f"stages.num_stages={self.num_stages} must be >= 1")
        require(self.mini_groups >= 1, f"stages.mini_groups={self.mini_groups} must be >= 1")
        require(
            self.train_groups >= self.mini_groups and self.train_groups % self.mini_groups == 0,
            f"stages.train_groups (B_train={self.train_groups}) must be a positive multiple of "
            f"stages.mini_groups (B_mini={self.mini_groups}); μ = B_train / B_mini updates per stage",
        )

    @property
    def updates_per_stage(self) -> int:
        """μ = B_train / B_mini."""
        return self.train_groups // self.mini_groups

    @property
    def total_updates(self) -> int:
        return self.num_stages * self.updates_per_stage
