"""``checkpoint.*``: when checkpoints are written and how many are kept (read by the loop and the writer).

Kept apart from the checkpoint I/O modules so that loading a run config imports no Megatron code.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mugrpo.errors import require


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoint cadence, retention and durability."""

    keep_last: int = 2
    """Checkpoints kept on disk (>= 2 so a crash while writing leaves a good one)."""
    every_updates: int = 0
    """Also checkpoint every N updates inside a stage (0: only at stage ends)."""
    every_stages: int = 1
    """Checkpoint at the end of every N-th stage (and always after the last). Standard GRPO's many tiny
    stages want a larger N; a resume redoes at most N stages of updates (stored rollouts are reused)."""
    async_save: bool = True
    """Write checkpoints in background threads while training continues (costs host memory for one
    copy of the rank's model + optimizer state); a checkpoint becomes `latest` once complete."""
    fsync: bool = True
    """fsync every checkpoint file before publishing it (durable on power loss; off the training
    path when async_save is on)."""
    preempt_grace_s: float = 120.0
    """Seconds a trainer signalled with SIGTERM or SIGUSR1 (a scheduler's preemption notice) has to
    finish its update, checkpoint and exit with code 75; past it the process exits without the
    checkpoint, saying so. Keep it below the scheduler's notice (Slurm: ``--signal=USR1@<seconds>``,
    or ``GraceTime`` for SIGTERM) and, under torchrun, below its 30 s wait after forwarding SIGTERM."""

    def __post_init__(self) -> None:
        require(self.keep_last >= 2, f"checkpoint.keep_last={self.keep_last} must be >= 2")
        require(self.every_stages >= 1, f"checkpoint.every_stages={self.every_stages} must be >= 1")
        require(self.every_updates >= 0, f"checkpoint.every_updates={self.every_updates} must be >= 0")
        require(self.preempt_grace_s > 0, f"checkpoint.preempt_grace_s={self.preempt_grace_s} must be > 0 seconds")
