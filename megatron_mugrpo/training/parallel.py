"""Process groups: torch.distributed plus Megatron's TP × PP × DP model-parallel state.

Data parallelism is what the world size leaves: DP = world / (TP × PP). Functions elsewhere take
the groups from the returned ``ParallelGroups`` explicitly instead of reaching for globals.

Expert parallelism (mixture-of-experts models) splits the experts of each MoE layer over EP ranks
taken from the DP × TP ranks of one pipeline stage: attention stays data-parallel, tokens travel to
their experts and back. Each expert's weights are split over ETP ranks (expert tensor parallelism,
``parallel.expert_tensor_parallel``; TP by default, megatron-core's ``expert_tensor_parallel_size``):
ETP = 1 with TP > 1 keeps every expert whole and spreads the experts over more ranks. ETP × EP must
divide world / PP, and each expert is replicated over the world / (PP × ETP × EP) expert-data-parallel
ranks.

    groups = initialize_parallel(tp=2, pp=1, seed=0)   # under torchrun, or inside a spawned rank
    ...
    destroy_parallel()
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_mugrpo.collectives import ObjectGroup
from megatron_mugrpo.errors import ConfigError, require
from megatron_mugrpo.training import cpu_compat

# megatron-core is imported inside the functions that set up process groups, so that loading a run
# config (which holds ParallelConfig) does not import it.

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""Collective timeout; generous because a rank may wait while another saves a checkpoint."""


@dataclass(kw_only=True)
class ParallelConfig:
    """``parallel.*``: Megatron model parallelism; data parallelism is what the world size leaves."""

    tensor_parallel: int = 1
    """TP degree; must divide the attention heads and KV heads."""
    pipeline_parallel: int = 1
    """PP degree; must divide the number of layers."""
    micro_batch_size: int = 4
    """Sequences per micro-batch; micro-batches accumulate into one optimizer update."""
    micro_batch_tokens: int | None = None
    """Token budget per micro-batch of an update, padding included; replaces micro_batch_size there.
    Rows are shared over data-parallel ranks by tokens, sorted by length, and each micro-batch is
    padded only to its own longest row (``training.batching``): with long-tailed response lengths it
    computes far fewer padding tokens, and the update is the same. At least the longest row
    (rollout.max_prompt_tokens + rollout.max_new_tokens); micro_batch_size × that keeps today's peak
    memory. null: fixed micro_batch_size rows, each padded to the update's longest row."""
    pack_sequences: bool = False
    """Several responses per row under micro_batch_tokens (``training.packing``): packed rows as wide
    as the longest row, per-sequence position ids, attention confined to each sequence by a
    block-diagonal mask through Megatron's local attention. Exact, but each packed row computes its
    full width² attention scores; RoPE models only."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside attention/MLP split along the sequence over
    the TP group (less activation memory). Needs tensor_parallel > 1; megatron-core requires it for a
    mixture-of-experts model at tensor_parallel > 1. On CPU it runs through ``cpu_compat``'s shims."""
    expert_parallel: int = 1
    """EP degree of a mixture-of-experts model: ranks (within one pipeline stage) that split each MoE
    layer's experts; must divide the number of experts. 1 for dense models."""
    expert_tensor_parallel: int | None = None
    """ETP degree of a mixture-of-experts model: ranks that split each expert's weights (must divide
    moe_intermediate_size). None: tensor_parallel, as megatron-core defaults. 1 at tensor_parallel > 1
    keeps experts whole (no TP collectives inside an expert). ETP × EP must divide the ranks of one
    pipeline stage."""

    timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before it fails; the error then names what this
    rank was doing (weight sync, store plan, an update, a checkpoint) and what each other rank last said
    it was doing. A lost rank is reported at once, whatever this is."""

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, f"parallel.timeout_s={self.timeout_s} must be > 0 seconds")
        for name in ("tensor_parallel", "pipeline_parallel", "micro_batch_size", "expert_parallel"):
            require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        require(
            self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
            f"parallel.micro_batch_tokens must be >= 1 or null (fixed micro_batch_size rows), got "
            f"{self.micro_batch_tokens}",
        )
        require(
            not self.pack_sequences or self.micro_batch_tokens is not None,
            "parallel.pack_sequences=true needs parallel.micro_batch_tokens (the budget of a micro-batch of "
            "packed rows); set it, or set pack_sequences to false",
        )
        require(
            self.expert_tensor_parallel is None or self.expert_tensor_parallel >= 1,
            "parallel.expert_tensor_parallel must be >= 1 or null (= tensor_parallel), "
            f"got {self.expert_tensor_parallel}",
        )
        require(
            not self.sequence_parallel or self.tensor_parallel > 1,
            "parallel.sequence_parallel=true needs parallel.tensor_parallel > 1 (it splits the sequence over "
            "the tensor-parallel group); set it to false",
        )


def check_model_parallelism(num_heads: int, num_kv_heads: int, num_layers: int, parallel: ParallelConfig) -> None:
    """Raise ConfigError when TP/PP cannot split a model with these dimensions."""
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    require(num_heads % tp == 0, f"parallel.tensor_parallel={tp} does not divide the {num_heads} attention heads")
    require(
        num_kv_heads % tp == 0,
        f"parallel.tensor_parallel={tp} does not divide the {num_kv_heads} key/value heads (query groups)",
    )
    require(num_layers % pp == 0, f"parallel.pipeline_parallel={pp} does not divide the {num_layers} layers")


def check_hf_model_parallelism(hf_dir: str | Path, parallel: ParallelConfig) -> None:
    """Validate TP/PP against a Hugging Face config.json."""
    path = Path(hf_dir) / "config.json"
    require(path.is_file(), f"{path} is missing: model.hf_dir must be a Hugging Face checkpoint directory")
    hf = json.loads(path.read_text())
    heads = hf["num_attention_heads"]
    check_model_parallelism(heads, hf.get("num_key_value_heads", heads), hf["num_hidden_layers"], parallel)
    ep, experts = parallel.expert_parallel, hf.get("num_experts") or hf.get("num_local_experts") or 0
    require(ep == 1 or experts > 0, f"parallel.expert_parallel={ep} needs a mixture-of-experts model ({path})")
    require(
        ep == 1 or experts % ep == 0, f"parallel.expert_parallel={ep} does not divide the {experts} experts ({path})"
    )
    etp, width = parallel.expert_tensor_parallel, hf.get("moe_intermediate_size")
    require(
        etp is None or etp == 1 or experts > 0,
        f"parallel.expert_tensor_parallel={etp} needs a mixture-of-experts model ({path}); remove it",
    )
    require(
        etp is None or not experts or int(width) % etp == 0,
        f"parallel.expert_tensor_parallel={etp} does not divide moe_intermediate_size={width} ({path})",
    )


@dataclass(frozen=True)
class ParallelGroups(ObjectGroup):
    """This rank's place in the TP × PP × DP grid and the process groups it communicates on.

    Its object collectives (``ObjectGroup``'s ``barrier``, ``broadcast``, ``all_gather``, ``any_rank``)
    run on ``world_group``, every trainer rank; in one process they are no-ops.
    ``ParallelGroups.local()`` is that one process without torch.distributed.
    """

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup
    """TP × PP ranks holding one model replica (the grad-norm reduction group)."""
    device: torch.device
    """Where this rank's model lives: cuda:<local rank> or cpu."""
    world_group: Any = field(default=None, compare=False)
    """Every trainer rank (torch.distributed's default group: async mode's rollout workers are not in
    it); None only in one process, where the object collectives are no-ops."""
    ep: int = 1
    """Expert-parallel size (1 for dense models)."""
    ep_rank: int = 0
    ep_group: Any = field(default=None, compare=False)
    """Ranks exchanging tokens for one MoE layer's experts (None in one process)."""
    etp: int = 1
    """Expert-tensor-parallel size: ranks splitting each expert's weights (TP unless set otherwise)."""
    etp_rank: int = 0
    etp_group: Any = field(default=None, compare=False)
    """Ranks holding the shards of the same experts (None in one process)."""
    mcore: Any = field(default=None, compare=False, repr=False)
    """The same groups as megatron-core's ``ProcessGroupCollection`` (plus the ones megatron derives from
    them: embedding, context-parallel, expert-data-parallel, ...), handed to ``GPTModel`` so the model
    never reads megatron's global groups. None in one process."""

    @classmethod
    def local(cls, device: torch.device | None = None) -> ParallelGroups:
        """One process, TP = PP = DP = 1, no process groups: every collective is a no-op."""
        return cls(
            world_size=1, rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
            tp_group=None, pp_group=None, dp_group=None, model_parallel_group=None,
            device=device or torch.device("cpu"),
        )  # fmt: skip

    @property
    def collective_group(self) -> Any:
        return self.world_group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def _init_process_group(world_size: int | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Start torch.distributed from the environment (torchrun's variables), single process if absent.

    ``world_size`` below the launch's WORLD_SIZE makes ranks [0, world_size) a process group of their
    own (async mode's trainers; the launch's remaining ranks never join it). Rank 0 is in it and hosts
    the rendezvous store as usual.
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ.get("RANK", "0"))
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's tracked (TP-aware) RNG states.

    Same seed on every rank; Megatron offsets the model-parallel state by the TP rank.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def initialize_parallel(
    tp: int,
    pp: int,
    seed: int,
    *,
    ep: int = 1,
    etp: int | None = None,
    world_size: int | None = None,
    timeout_s: float | None = None,
) -> ParallelGroups:
    """Initialise torch.distributed (NCCL with CUDA, gloo without) and Megatron's TP/PP/DP/EP/ETP state.

    Activates the CPU compatibility layer when CUDA is absent. Re-initialising with the same sizes
    is allowed (the existing groups are reused); different sizes need ``destroy_parallel()`` first.
    ``world_size``: the ranks that train, when fewer than the launch's (async mode's rollout workers
    are the launch's last ranks and stay outside). ``ep``: expert-parallel size (MoE models only);
    ``etp``: expert-tensor-parallel size (None: ``tp``). ``timeout_s``: how long a collective may wait
    (None: 30 minutes).
    """
    from megatron.core import parallel_state

    cpu_compat.activate()
    _init_process_group(world_size, DEFAULT_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise ConfigError(
            f"world size {world} is not a multiple of tensor_parallel × pipeline_parallel = {tp} × {pp}; "
            "change parallel.tensor_parallel / parallel.pipeline_parallel or the number of processes"
        )
    etp = tp if etp is None else etp
    check_expert_parallel(world, tp, pp, ep, etp)
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
        if current != (tp, pp, ep, etp):
            raise RuntimeError(
                f"Megatron parallel state is already initialised with (tp, pp, ep, etp) = {current}, not "
                f"{(tp, pp, ep, etp)}; call destroy_parallel() first"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    seed_everything(seed)
    return current_groups()


def check_expert_parallel(world: int, tp: int, pp: int, ep: int, etp: int | None = None) -> None:
    """ConfigError unless EP × ETP (expert tensor parallel, TP when None) divides the ranks of one pipeline stage."""
    etp = tp if etp is None else etp
    if ep < 1 or etp < 1 or (world // pp) % (ep * etp) != 0:
        name = "tensor_parallel" if etp == tp else "expert_tensor_parallel"
        raise ConfigError(
            f"expert_parallel={ep} × {name}={etp} must divide the {world // pp} ranks of a pipeline "
            f"stage (world size {world} / pipeline_parallel {pp}); change parallel.expert_parallel"
            + ("" if etp == tp else " or parallel.expert_tensor_parallel")
        )


def current_groups() -> ParallelGroups:
    """The ParallelGroups of an already initialised Megatron parallel state.

    The one place that reads megatron's global groups: everything after takes them from the returned
    object (``groups.tp_group`` ..., ``groups.mcore`` for megatron-core modules)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: call initialize_parallel() first")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mcore = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelGroups(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_group=mcore.tp,
        pp_group=mcore.pp,
        dp_group=mcore.dp,
        model_parallel_group=mcore.mp,
        device=device,
        # The default group is the trainers only (see _init_process_group's world_size).
        world_group=dist.group.WORLD,
        ep=parallel_state.get_expert_model_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_group=mcore.ep,
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        etp_group=mcore.expt_tp,
        mcore=mcore,
    )


def destroy_parallel(*, destroy_process_group: bool = False) -> None:
    """Tear down Megatron's parallel state (and optionally torch.distributed itself).

    Keeping the process group lets one process re-initialise at another TP/PP (e.g. a test that
    saves at TP=2 and loads at TP=1 with the same ranks).
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
