"""``algo.*``: the policy loss, its aggregation, and one options section per registered loss.

The per-loss sections are not listed here: ``AlgoConfig`` gets one field per entry of the loss
registry (``algorithms.losses``), typed by that loss's options dataclass, so a new loss brings its
``algo.<name>.*`` section with its ``register_loss`` decorator.

    cfg.algo.loss_options()     # {"aggregation": ..., **the chosen loss's section}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_mugrpo.algorithms.losses import AGGREGATIONS, available_losses, loss_spec, needs_old_logprobs
from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig
from megatron_mugrpo.errors import require, with_registry_sections


@dataclass(kw_only=True)
class _AlgoSettings:
    """The policy loss: which registry entry, its aggregation, and one options section per loss.

    Each loss of ``algorithms.losses`` owns its section (``algo.mu_grpo.*``, ``algo.grpo.*``, ...);
    only the chosen loss's section is used. Defaults are μ-GRPO: clip [0, 5] and the veto.
    """

    loss: str = "mu_grpo"
    """Loss registry entry: grpo | mu_grpo | m2po | m2po_clip | opsm | icepop | icepop_current | gspo
    (algorithms.losses)."""
    aggregation: str = "seq_mean_token_mean"
    """seq_mean_token_mean (paper Eq. 2: token mean per response, then mean over responses) or token_mean."""
    adv_eps: float = 1e-6
    """ε in A = (R - mean R) / (std R + ε)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Mismatch metrics and the optional correction of a behaviour policy that differs from the
    trainer's (e.g. an FP8 rollout engine); off by default, for any loss (algorithms.rollout_correction)."""

    def __post_init__(self) -> None:
        require(
            self.loss in available_losses(), f"algo.loss={self.loss!r} is unknown; choose one of {available_losses()}"
        )
        require(
            self.aggregation in AGGREGATIONS,
            f"algo.aggregation={self.aggregation!r} is unknown; choose one of {AGGREGATIONS}",
        )
        require(self.adv_eps > 0, f"algo.adv_eps={self.adv_eps} must be > 0")
        require(
            not (needs_old_logprobs(self.loss) and self.rollout_correction.enabled),
            f"algo.loss={self.loss} already corrects the train/inference mismatch with π_old / β; combined with "
            "algo.rollout_correction its band would see π_old / π_old = 1. Set algo.rollout_correction.tis_cap=0 "
            "and mask_bound=0, or choose another loss",
        )

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the updates read log π_old of the stage's start: a rollout correction, or a loss that
        masks on π_old / β (icepop). The staged loop then scores D_k before the stage's first update."""
        return self.rollout_correction.enabled or needs_old_logprobs(self.loss)

    def loss_options(self) -> dict[str, Any]:
        """Keyword options of the chosen registry loss: its section plus the aggregation."""
        return {"aggregation": self.aggregation} | dataclasses.asdict(getattr(self, self.loss))


AlgoConfig = with_registry_sections(_AlgoSettings, {name: loss_spec(name).options for name in available_losses()})
"""The ``algo`` section: the settings above plus one options section per registered loss."""
