"""Construct the trainable policy: this rank's GPTModel stage, Megatron DDP, optimizer, schedule hooks.

    groups = initialize_parallel(tp, pp, seed)
    policy = build_policy(hf_config, groups=groups, dtype=torch.float32, optim=cfg.optim,
                          use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    metrics = train_step(policy, batch, ...)

One model chunk per rank (no virtual pipeline stages). The model is wrapped in Megatron's
``DistributedDataParallel`` (contiguous gradient buffers, gradients reduced once per update after
the last micro-batch) and its TransformerConfig gets the hooks Megatron's schedules call:
``no_sync_func``, ``finalize_model_grads_func`` (DP reduction, tied-embedding sync across PP, and the
division by the global loss normaliser) and ``grad_scale_func`` (fp16/bf16 loss scaling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_model_config

from megatron_mugrpo.training.model import build_gpt_model
from megatron_mugrpo.training.moe import MoeConfig
from megatron_mugrpo.training.optimizer import OptimConfig, build_optimizer
from megatron_mugrpo.training.parallel import ParallelGroups


@dataclass
class Policy:
    """Everything one rank needs to run updates on its shard of the policy."""

    model_chunks: list[DistributedDataParallel]
    """This rank's pipeline stage(s), DDP-wrapped (one chunk: no virtual pipeline)."""
    optimizer: MegatronOptimizer | None
    """None for a forward-only policy (evaluation, conversion checks)."""
    scheduler: OptimizerParamScheduler | None
    hf_config: dict[str, Any]
    """The Hugging Face config.json the model was built from (true vocab size lives here)."""
    groups: ParallelGroups
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        """The TRUE (unpadded) vocabulary size; ids >= it are Megatron padding rows."""
        return int(self.hf_config["vocab_size"])

    def unwrapped(self) -> list[MegatronModule]:
        """The bare GPTModel chunks (for state dicts and conversion)."""
        return [chunk.module for chunk in self.model_chunks]

    def weights_loaded(self) -> None:
        """Call after writing weights into the model from outside (e.g. ``conversion.load_hf_into_model``).

        A bf16 / fp16 optimizer keeps fp32 main copies of the parameters; they are re-read here so
        the next step starts from the loaded weights. (``checkpoint.load_checkpoint`` does this itself.)
        """
        if self.optimizer is not None:
            self.optimizer.reload_model_params()


def build_model_chunks(
    hf_config: dict[str, Any],
    groups: ParallelGroups,
    *,
    dtype: torch.dtype,
    use_distributed_optimizer: bool,
    fp8: str = "none",
    sequence_parallel: bool = False,
    moe: MoeConfig | None = None,
) -> list[DistributedDataParallel]:
    """This rank's GPTModel stage on its device, wrapped in Megatron DDP.

    ``calculate_per_token_loss`` is switched on: each micro-batch's loss is the loss *sum* and the
    schedule accumulates the loss normaliser, so the gradient is Σ ∇loss_sum / Σ normaliser over
    micro-batches and DP ranks — independent of the micro-batch count and the DP size.
    """
    model = build_gpt_model(
        hf_config,
        groups,
        dtype=dtype,
        fp8=fp8,
        config_overrides={"calculate_per_token_loss": True, "sequence_parallel": sequence_parallel},
        moe=moe,
    )
    model.to(groups.device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,
    )
    # Gradients are reduced on the model's own groups (groups.mcore), not on megatron's globals.
    wrapped = DistributedDataParallel(
        config=model.config, ddp_config=ddp_config, module=model, pg_collection=groups.mcore
    )
    wrapped.broadcast_params()  # identical replicas across DP even if initialisation differed
    return [wrapped]


def install_schedule_hooks(model_chunks: list[DistributedDataParallel], optimizer: MegatronOptimizer | None) -> None:
    """Give the TransformerConfig the callbacks Megatron's forward-backward schedules call."""
    config = get_model_config(model_chunks[0])
    config.no_sync_func = model_chunks[0].no_sync if len(model_chunks) == 1 else [c.no_sync for c in model_chunks]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None


def build_policy(
    hf_config: dict[str, Any],
    *,
    groups: ParallelGroups,
    dtype: torch.dtype,
    optim: OptimConfig | None,
    use_distributed_optimizer: bool = False,
    fp8: str = "none",
    sequence_parallel: bool = False,
    moe: MoeConfig | None = None,
) -> Policy:
    """Model (+ optimizer and schedule hooks when ``optim`` is given) for this rank.

    Weights are freshly initialised (seeded by ``initialize_parallel``); load real ones with
    ``conversion.load_hf_into_model(policy.unwrapped(), hf_dir, groups)`` or
    ``checkpoint.load_checkpoint(step_dir, policy.model_chunks, ..., groups=groups)``.
    ``moe``: router losses and token dispatch of a mixture-of-experts model (``moe.*``; None: defaults).
    ``sequence_parallel`` runs on CPU too (gloo; ``cpu_compat`` makes the torch norms and the MoE
    dispatcher's uneven TP collectives work), so TP × EP MoE models are testable without a GPU.
    """
    chunks = build_model_chunks(
        hf_config,
        groups,
        dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
        fp8=fp8,
        sequence_parallel=sequence_parallel,
        moe=moe,
    )
    optimizer = scheduler = None
    if optim is not None:
        optimizer, scheduler = build_optimizer(
            chunks, optim, use_distributed_optimizer=use_distributed_optimizer, dtype=dtype
        )
    install_schedule_hooks(chunks, optimizer)
    return Policy(
        model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, hf_config=hf_config, groups=groups, dtype=dtype
    )
