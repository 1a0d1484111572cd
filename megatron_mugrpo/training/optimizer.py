"""Megatron's optimizer for the policy: AdamW with the paper's settings, optionally distributed.

AdamW β = (0.9, 0.999), weight decay 0.01 (not on biases and norm weights: Megatron's standard
``wd_mult = 0`` for 1-D parameters), constant learning rate (default 1e-6), global gradient-norm
clipping. With ``use_distributed_optimizer`` the fp32 main parameters and Adam moments are sharded
across data-parallel ranks (Megatron's DistributedOptimizer; needs the DDP wrapper's contiguous
buffers, see ``setup.wrap_ddp``).

    optimizer, scheduler = build_optimizer(model_chunks, cfg.optim, use_distributed_optimizer=False,
                                           dtype=torch.float32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_mugrpo.errors import require

if TYPE_CHECKING:  # megatron-core is imported when an optimizer is built, not when a config is loaded
    import torch
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import MegatronModule

CONSTANT_SCHEDULE_STEPS = 1
"""Warm-up / decay lengths handed to Megatron's scheduler; irrelevant with the 'constant' styles but
they must be positive for its sanity checks."""


@dataclass(kw_only=True)
class OptimConfig:
    """``optim.*``: AdamW as in the paper: β = (0.9, 0.999), weight decay 0.01, constant LR 1e-6."""

    lr: float = 1e-6
    """Learning rate, constant over the run (no warm-up, no decay)."""
    weight_decay: float = 0.01
    """Decoupled weight decay; not applied to biases and norm weights (Megatron's wd_mult = 0)."""
    beta1: float = 0.9
    """Adam β1 (first-moment decay)."""
    beta2: float = 0.999
    """Adam β2 (second-moment decay)."""
    eps: float = 1e-8
    """Adam ε added to the second-moment square root."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        require(self.clip_grad >= 0, f"optim.clip_grad={self.clip_grad} must be >= 0 (0 disables)")


def megatron_optimizer_config(
    optim: OptimConfig, *, use_distributed_optimizer: bool, dtype: torch.dtype
) -> OptimizerConfig:
    """Translate our OptimConfig into Megatron's OptimizerConfig."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",  # Megatron's "adam" is decoupled-weight-decay Adam, i.e. AdamW
        lr=optim.lr,
        min_lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.beta1,
        adam_beta2=optim.beta2,
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )


def build_optimizer(
    model_chunks: list[MegatronModule],
    optim: OptimConfig,
    *,
    use_distributed_optimizer: bool,
    dtype: torch.dtype,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Megatron optimizer over the DDP-wrapped ``model_chunks`` and a constant LR / WD schedule.

    The scheduler is what writes each parameter group's lr and (wd_mult-scaled) weight decay; it is
    stepped once per update by the train step and saved in checkpoints.
    """
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = megatron_optimizer_config(optim, use_distributed_optimizer=use_distributed_optimizer, dtype=dtype)
    optimizer = get_megatron_optimizer(config, model_chunks)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr,
        lr_warmup_steps=0,
        lr_decay_steps=CONSTANT_SCHEDULE_STEPS,
        lr_decay_style="constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=CONSTANT_SCHEDULE_STEPS,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def current_lr(optimizer: MegatronOptimizer) -> float:
    """Learning rate of the first parameter group (all groups share it: constant schedule)."""
    return float(optimizer.param_groups[0]["lr"])
