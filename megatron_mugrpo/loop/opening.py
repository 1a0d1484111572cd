"""How a verb opens a run (``Opening``): one constructor per verb, each owning its rule.

Kept light (the checkpoint and conversion code is imported when weights load), so the command line
builds an opening before it knows whether this process is a trainer rank or an async rollout worker,
which never imports Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_mugrpo.metrics import TENSORBOARD_DIR
from megatron_mugrpo.state import TrainerState

if TYPE_CHECKING:
    from megatron_mugrpo.training.setup import Policy

PHASE_VERBS = ("generate", "optimize")


@dataclass(frozen=True, kw_only=True)
class Opening:
    """How a verb opens a run: the weights it starts from, the metrics records it keeps, the config
    history entry it writes. One constructor per verb, each stating its rule, so ``open_run`` takes no
    flag that names its caller::

        verb            constructor                          weights                     metrics.jsonl
        train (new)     Opening.new(record)                  the Hugging Face model      appended to
        train --resume  Opening.resumed(record)              newest intact checkpoint    records after it redone
        generate        Opening.phase("generate", record)    newest intact checkpoint    appended to
        optimize        Opening.phase("optimize", record)    newest intact checkpoint    records after it redone
        eval            Opening.evaluation(step, record)     ``step``, else the newest   its own, never dropped

    Without a checkpoint, "newest intact checkpoint" is the Hugging Face model (and "redone" drops
    every record: all of it is redone).
    """

    latest: bool
    """Start from the newest intact checkpoint when there is one (damaged ones are skipped with a warning)."""
    checkpoint: Path | None = None
    """Start from this step directory instead."""
    record: str | None = None
    """The config history entry written once set-up succeeded (None: the stored config is unchanged)."""
    redo: bool = False
    """The verb redoes the work logged after its checkpoint, whose metrics records are dropped first."""
    standalone: str | None = None
    """A command whose records are its own (``eval``): a later resume never drops them, and they go to
    their own TensorBoard run (an older step written later would hide newer points)."""

    @classmethod
    def new(cls, record: str | None) -> Opening:
        return cls(latest=False, record=record)

    @classmethod
    def resumed(cls, record: str | None) -> Opening:
        return cls(latest=True, record=record, redo=True)

    @classmethod
    def phase(cls, verb: str, record: str | None) -> Opening:
        """``generate`` adds a stage's data; ``optimize`` redoes the updates logged after the checkpoint."""
        if verb not in PHASE_VERBS:
            raise ValueError(f"phase verb {verb!r} is not one of {PHASE_VERBS}")
        return cls(latest=True, record=record, redo=verb == "optimize")

    @classmethod
    def evaluation(cls, checkpoint: Path | None, record: str | None) -> Opening:
        return cls(latest=True, checkpoint=checkpoint, record=record, standalone="eval")

    def start_from(self, checkpoint_root: Path) -> Path | None:
        """The step directory the weights will come from, as far as can be told before loading (the
        loader skips a damaged newest one): what the model is checked against before it is built."""
        from megatron_mugrpo.training.checkpoint import latest_checkpoint

        return self.checkpoint or (latest_checkpoint(checkpoint_root) if self.latest else None)

    def load_weights(self, policy: Policy, hf_dir: Path, checkpoint_root: Path) -> tuple[TrainerState, Path | None]:
        """Load the given checkpoint, or the newest intact one, else the base Hugging Face weights;
        returns the trainer state and the step directory loaded (None: the HF weights)."""
        from megatron_mugrpo.training.checkpoint import load_checkpoint, load_latest_intact

        if self.checkpoint is not None:
            loaded = load_checkpoint(
                self.checkpoint, policy.model_chunks, policy.optimizer, policy.scheduler, groups=policy.groups
            )
            return loaded.trainer_state, self.checkpoint
        if self.latest:
            args = (policy.model_chunks, policy.optimizer, policy.scheduler)
            intact = load_latest_intact(checkpoint_root, *args, groups=policy.groups)
            if intact is not None:
                return intact.trainer_state, intact.step_dir
        from megatron_mugrpo.conversion import load_hf_into_model

        load_hf_into_model(policy.unwrapped(), hf_dir, policy.groups)
        policy.weights_loaded()  # optimizers holding fp32 main copies re-read the loaded weights
        return TrainerState(), None

    def keep_records(self, state: TrainerState, resumed_from: Path | None) -> int | None:
        """How many metrics records to keep (None: all): those logged up to the checkpoint when redoing."""
        if not self.redo:
            return None
        return state.metrics_records if resumed_from is not None else 0

    def metrics_source(self, resumed_from: Path | None) -> tuple[str | None, str]:
        """(the source every record is marked with, None for the run's own; the TensorBoard directory)."""
        if self.standalone is None:
            return None, TENSORBOARD_DIR
        evaluated = resumed_from.name if resumed_from is not None else "base_model"
        return f"mugrpo {self.standalone} of {evaluated}", f"{TENSORBOARD_DIR}/{self.standalone}_{evaluated}"
