"""A run's plan: per role and per GPU, the bytes it holds and whether they fit, and how long it takes.

``make_plan`` is arithmetic on the run's config sections, the model's ``config.json`` fields and the
hardware; ``plan.suggest`` proposes changes and ``plan.output`` prints the result.

    plan = make_plan(cfg, hf_fields, Hardware(gpu=gpu_spec("h100"), gpus=8, gpus_per_node=8))

Roles: the **trainer** (every GPU in staged mode; the first world − async.rollout_ranks in async mode)
and the **rollout engine** (staged: colocated on the trainer's GPUs, the trainer's weights, gradients
and optimizer state staying resident while it generates, its activations not; async: the last
async.rollout_ranks GPUs). The engine releases its memory before the optimizer phase
(``rollout.sglang.enable_memory_saver``), so the trainer's peak does not include it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megatron_mugrpo.errors import require
from megatron_mugrpo.plan.gpus import GpuSpec
from megatron_mugrpo.plan.memory import (
    ActivationInputs,
    EngineBytes,
    TrainerLayout,
    activation_bytes,
    engine_bytes,
    logits_bytes,
    route_store_bytes_per_token,
    routing_replay_bytes,
    static_bytes,
)
from megatron_mugrpo.plan.models import ModelShape, RankLayout
from megatron_mugrpo.plan.timing import (
    PUBLISH_BYTES_PER_S,
    SYNC_BYTES_PER_S,
    AsyncBalance,
    async_balance,
    rollout_time,
    update_flops,
    update_s,
)
from megatron_mugrpo.rollout.sglang_engine import WEIGHT_BUCKET_BYTES
from megatron_mugrpo.training.parallel import check_expert_parallel, check_model_parallelism

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ENGINE_WEIGHT_BYTES = {"none": 2.0, "fp8": 1.0, "fp8_per_channel": 1.0, "nvfp4": 0.5625}
"""Bytes per parameter of the rollout engine's weights by rollout.quantization (nvfp4: 4 bits + scales)."""
STAGING_COPIES = 2
"""Async memory publication to a transformers worker: it holds the staged publication and the one arriving
on its own device (publish.Staging). An SGLang worker holds them in pinned host memory instead
(asynchronous.transport.staging_place): on its GPU, only the landing bucket and one bucket being applied."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    gpu: GpuSpec
    gpus: int
    """GPUs of the launch (all nodes)."""
    gpus_per_node: int

    def __post_init__(self) -> None:
        require(self.gpus >= 1 and self.gpus_per_node >= 1, "--gpus and --gpus-per-node must be >= 1")
        require(
            self.gpus <= self.gpus_per_node or self.gpus % self.gpus_per_node == 0,
            f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node {self.gpus_per_node}",
        )


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """What a plan cannot know from the config; each is printed with the plan."""

    mfu: float = 0.35
    """Model FLOPs utilisation of the optimizer phase (--mfu)."""
    response_fill: float = 0.5
    """Mean response length as a fraction of rollout.max_new_tokens (--response-fill)."""
    rollout_tokens_per_s: float | None = None
    """Measured decode rate of one engine (--rollout-tokens-per-s); None: the roofline."""

    def __post_init__(self) -> None:
        require(0 < self.mfu <= 1, f"--mfu {self.mfu} must be in (0, 1]")
        require(0 < self.response_fill <= 1, f"--response-fill {self.response_fill} must be in (0, 1]")
        require(
            self.rollout_tokens_per_s is None or self.rollout_tokens_per_s > 0,
            "--rollout-tokens-per-s must be > 0",
        )


@dataclass(frozen=True, kw_only=True)
class TrainerPlan:
    ranks: int
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    edp: int
    distributed_optimizer: bool
    params_per_rank: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    routing_replay: int
    micro_batch_tokens: int
    in_flight: int
    peak_stage: int
    """The pipeline stage whose rank peaks highest."""
    usable: int

    @property
    def peak(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.routing_replay

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable


@dataclass(frozen=True, kw_only=True)
class EnginePlan:
    engine: str
    gpus: int
    engines: int
    tp: int
    resident: int
    """A colocated trainer's bytes still on the GPU while the engine runs (staged mode)."""
    bytes: EngineBytes
    context: int
    usable: int
    route_store_bytes: int = 0
    """Routes the engines record into a stage's D_k (routing replay; on disk, not on the GPU)."""

    @property
    def peak(self) -> int:
        b = self.bytes
        return self.resident + b.weights + max(b.kv_cache, 0) + b.staging

    @property
    def problem(self) -> str:
        b = self.bytes
        if b.max_sequences < 1:
            return f"its KV cache ({b.kv_cache / GIB:.1f} GiB) holds no {self.context}-token sequence"
        if b.staging > b.outside_pool:
            return (
                f"staging a publication ({b.staging / GIB:.1f} GiB) does not fit outside the engine's pool "
                f"({b.outside_pool / GIB:.1f} GiB)"
            )
        if self.peak > self.usable:
            return f"peak {self.peak / GIB:.1f} GiB exceeds the GPU's {self.usable / GIB:.1f} GiB"
        return ""

    @property
    def fits(self) -> bool:
        return not self.problem


@dataclass(frozen=True, kw_only=True)
class TimePlan:
    stages: int
    updates_per_stage: int
    rollout_s: float
    """Per stage (staged mode); per stage's worth of groups on the rollout GPUs (async mode)."""
    rollout_tokens: float
    tokens_per_s_per_engine: float
    concurrency: int
    update_s: float
    update_tflop: float
    optimize_s: float
    """Per stage."""
    boundary_s: float
    """Per stage: the weight sync (staged) or the publications of a stage's updates (async)."""
    total_s: float
    balance: AsyncBalance | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: str
    params: int
    active_params: int
    mode: str
    hardware: Hardware
    assumptions: Assumptions
    trainer: TrainerPlan
    engine: EnginePlan
    time: TimePlan | None
    """None when the device has no FLOPs / bandwidth entry (a CPU, an unknown GPU): memory only."""
    notes: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        out = []
        if not self.trainer.fits:
            t = self.trainer
            out.append(f"trainer: peak {t.peak / GIB:.1f} GiB exceeds the GPU's {t.usable / GIB:.1f} GiB")
        if not self.engine.fits:
            out.append(f"rollout engine: {self.engine.problem}")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems


def trainer_ranks(cfg: Any, gpus: int) -> int:
    """GPUs that train: all of them in staged mode, all but async.rollout_ranks in async mode."""
    if cfg.mode != "async":
        return gpus
    trainers = gpus - cfg.async_.rollout_ranks
    require(
        trainers >= 1,
        f"async.rollout_ranks={cfg.async_.rollout_ranks} leaves no trainer among --gpus {gpus}; "
        "lower async.rollout_ranks or plan more GPUs",
    )
    return trainers


def check_layout(cfg: Any, shape: ModelShape, hardware: Hardware) -> RankLayout:
    """The trainer's layout; ConfigError (as at launch) when the model or the GPUs cannot be split so."""
    par = cfg.parallel
    world = trainer_ranks(cfg, hardware.gpus)
    tp, pp, ep = par.tensor_parallel, par.pipeline_parallel, par.expert_parallel
    require(
        world % (tp * pp) == 0,
        f"{world} trainer GPUs are not a multiple of parallel.tensor_parallel × parallel.pipeline_parallel = "
        f"{tp} × {pp}; change them or --gpus",
    )
    check_model_parallelism(shape.heads, shape.kv_heads, shape.layers, par)
    require(
        shape.is_moe or shape.ffn % tp == 0,
        f"parallel.tensor_parallel={tp} does not divide the MLP width {shape.ffn}",
    )
    etp = tp if par.expert_tensor_parallel is None else par.expert_tensor_parallel
    if shape.is_moe:
        require(shape.experts % ep == 0, f"parallel.expert_parallel={ep} does not divide the {shape.experts} experts")
        require(
            shape.expert_ffn % etp == 0,
            f"expert tensor parallel size {etp} does not divide moe_intermediate_size={shape.expert_ffn}",
        )
        check_expert_parallel(world, tp, pp, ep, etp)
    else:
        require(ep == 1, f"parallel.expert_parallel={ep} needs a mixture-of-experts model; set it to 1")
        etp = tp
    rtp = cfg.rollout.tensor_parallel
    engine_gpus = hardware.gpus if cfg.mode != "async" else cfg.async_.rollout_ranks
    require(
        engine_gpus % rtp == 0 and min(hardware.gpus_per_node, hardware.gpus) % rtp == 0,
        f"rollout.tensor_parallel={rtp} must divide the {engine_gpus} rollout GPUs and the "
        f"{min(hardware.gpus_per_node, hardware.gpus)} GPUs per node (an engine lies inside one node)",
    )
    return RankLayout(tp=tp, pp=pp, ep=ep, etp=etp)


def make_plan(
    cfg: Any, hf: dict[str, Any], hardware: Hardware, assumptions: Assumptions | None = None, *, model: str = ""
) -> Plan:
    """The plan of run config ``cfg`` (a ``RunConfig``: its model, parallel, rollout, stages, kernels, moe,
    mode and async sections) for the model of ``hf`` (config.json fields) on ``hardware``."""
    assumptions = assumptions or Assumptions()
    shape = ModelShape.from_hf(hf)
    layout = check_layout(cfg, shape, hardware)
    trainer = _trainer_plan(cfg, shape, layout, hardware)
    engine = _engine_plan(cfg, shape, hardware, trainer)
    roofline = hardware.gpu.has_roofline
    time = _time_plan(cfg, shape, hardware, assumptions, trainer, engine) if roofline else None
    return Plan(
        model=model or str(hf.get("_name_or_path") or hf.get("model_type")),
        params=shape.total_params(),
        active_params=shape.active_params(),
        mode=cfg.mode,
        hardware=hardware,
        assumptions=assumptions,
        trainer=trainer,
        engine=engine,
        time=time,
        notes=[] if roofline else [f"{hardware.gpu.name}: no FLOPs or bandwidth figures, so no time is planned"],
    )


def _rows_per_update(cfg: Any) -> int:
    return cfg.stages.mini_groups * cfg.rollout.group_size


def trainer_layout(cfg: Any, layout: RankLayout, hardware: Hardware) -> TrainerLayout:
    """The trainer's data-parallel sizes around the model-parallel ``layout`` (``check_layout``'s)."""
    world = trainer_ranks(cfg, hardware.gpus)
    dp, edp = world // (layout.tp * layout.pp), world // (layout.pp * layout.etp * layout.ep)
    return TrainerLayout(model=layout, dp=dp, edp=edp, distributed_optimizer=cfg.parallel.use_distributed_optimizer)


def _trainer_plan(cfg: Any, shape: ModelShape, layout: RankLayout, hardware: Hardware) -> TrainerPlan:
    """The trainer's memory per rank at its fullest pipeline stage (the one whose peak is highest)."""
    tlayout = trainer_layout(cfg, layout, hardware)
    seq, tokens, micro_batches = _micro_batching(cfg, tlayout.dp)
    plans = [
        _stage_plan(cfg, shape, layout, hardware, stage=stage, seq=seq, tokens=tokens, micro_batches=micro_batches)
        for stage in range(layout.pp)
    ]
    return max(plans, key=lambda plan: plan.peak)  # the first of equal peaks, as a strict > scan keeps


def _micro_batching(cfg: Any, dp: int) -> tuple[int, int, int]:
    """(sequence length, tokens per micro-batch, micro-batches per rank and update): a token budget
    (parallel.micro_batch_tokens) replaces micro_batch_size rows of the longest sequence."""
    par = cfg.parallel
    seq = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    budget = getattr(par, "micro_batch_tokens", None)
    tokens = budget or par.micro_batch_size * seq
    rows_per_rank = math.ceil(_rows_per_update(cfg) / dp)
    if budget:
        return seq, tokens, max(1, math.ceil(rows_per_rank * seq / tokens))
    return seq, tokens, math.ceil(rows_per_rank / par.micro_batch_size)


def _stage_plan(
    cfg: Any,
    shape: ModelShape,
    layout: RankLayout,
    hardware: Hardware,
    *,
    stage: int,
    seq: int,
    tokens: int,
    micro_batches: int,
) -> TrainerPlan:
    """The trainer's memory per rank on pipeline stage ``stage`` (its most loaded DP rank)."""
    par, tlayout = cfg.parallel, trainer_layout(cfg, layout, hardware)
    dp, edp, dtype = tlayout.dp, tlayout.edp, DTYPE_BYTES[cfg.model.dtype]
    static = max(
        (
            static_bytes(shape, tlayout, dtype_bytes=dtype, pp_rank=stage, dp_rank=r, edp_rank=min(r, edp - 1))
            for r in {0, dp - 1}
        ),
        key=lambda s: s.total,
    )
    in_flight = min(layout.pp - stage, micro_batches)  # 1F1B: stage s holds up to PP − s micro-batches
    acts = ActivationInputs(
        tokens=tokens,
        seq_len=seq,
        dtype_bytes=dtype,
        sequence_parallel=par.sequence_parallel,
        fused_kernels=True,  # planned for the GPU layer spec (Transformer Engine)
        in_flight=in_flight,
    )
    logits = 0
    if stage == layout.pp - 1:
        fused = cfg.kernels.logprob_impl != "unfused"
        logits = logits_bytes(shape, layout.tp, tokens, fused=fused, budget_bytes=cfg.kernels.logits_budget_bytes)
    routes = routing_replay_bytes(shape, layout.pp, tokens, in_flight) if cfg.moe.routing_replay != "none" else 0
    return TrainerPlan(
        ranks=trainer_ranks(cfg, hardware.gpus),
        tp=layout.tp,
        pp=layout.pp,
        dp=dp,
        ep=layout.ep,
        etp=layout.etp,
        edp=edp,
        distributed_optimizer=par.use_distributed_optimizer,
        params_per_rank=static.params,
        weights=static.weights,
        grads=static.grads,
        optimizer=static.optimizer,
        activations=activation_bytes(shape, layout, acts, pp_rank=stage),
        logits=logits,
        routing_replay=routes,
        micro_batch_tokens=tokens,
        in_flight=in_flight,
        peak_stage=stage,
        usable=hardware.gpu.usable_bytes,
    )


def _engine_plan(cfg: Any, shape: ModelShape, hardware: Hardware, trainer: TrainerPlan) -> EnginePlan:
    gpu, ro = hardware.gpu, cfg.rollout
    is_async = cfg.mode == "async"
    context = ro.max_prompt_tokens + ro.max_new_tokens
    tp = ro.tensor_parallel
    gpus = cfg.async_.rollout_ranks if is_async else hardware.gpus
    resident = 0 if is_async else trainer.weights + trainer.grads + trainer.optimizer
    weight_bytes = ENGINE_WEIGHT_BYTES.get(ro.quantization, 2.0)
    staging = 0
    if is_async and cfg.async_.publish == "memory" and ro.engine == "sglang":
        staging = int(cfg.async_.bucket_mib * 2**20) + WEIGHT_BUCKET_BYTES
    elif is_async and cfg.async_.publish == "memory":
        staging = STAGING_COPIES * shape.total_params() * DTYPE_BYTES[cfg.model.dtype]
    if ro.engine == "sglang":
        fraction = ro.sglang.mem_fraction_static
    else:
        # transformers engine: no static pool; its KV cache is batch_size sequences at full length, so the
        # "fraction" is what those take, and the check is that they fit beside everything else.
        need = (
            resident
            + shape.total_params() * weight_bytes / tp
            + ro.transformers.batch_size * shape.kv_bytes_per_token() * context / tp
        )
        fraction = min(1.0, (need + (gpu.memory_bytes - gpu.usable_bytes)) / gpu.memory_bytes)
    eb = engine_bytes(
        shape,
        engine_tp=tp,
        gpu_bytes=gpu.memory_bytes,
        usable_bytes=gpu.usable_bytes,
        mem_fraction=fraction,
        weight_bytes_per_param=weight_bytes,
        resident=resident,
        context=context,
        staging=staging,
    )
    return EnginePlan(
        engine=ro.engine,
        gpus=gpus,
        engines=gpus // tp,
        tp=tp,
        resident=resident,
        bytes=eb,
        context=context,
        usable=gpu.usable_bytes,
        route_store_bytes=_route_store_bytes(cfg, shape),
    )


def _route_store_bytes(cfg: Any, shape: ModelShape) -> int:
    """Routes recorded per stage: every sampled token's top-k experts of every sparse layer."""
    if cfg.moe.routing_replay == "none":
        return 0
    ro, st = cfg.rollout, cfg.stages
    tokens = st.train_groups * ro.group_size * (ro.max_prompt_tokens + ro.max_new_tokens)
    return tokens * route_store_bytes_per_token(shape)


def _time_plan(
    cfg: Any, shape: ModelShape, hardware: Hardware, assumptions: Assumptions, trainer: TrainerPlan, engine: EnginePlan
) -> TimePlan:
    ro, st = cfg.rollout, cfg.stages
    response = ro.max_new_tokens * assumptions.response_fill
    weight_bytes = ENGINE_WEIGHT_BYTES.get(ro.quantization, 2.0)
    rollout = rollout_time(
        shape,
        hardware.gpu,
        sequences=st.train_groups * ro.group_size,
        engines=engine.engines,
        tp=engine.tp,
        max_concurrent=max(1, engine.bytes.max_sequences),
        prompt=ro.max_prompt_tokens,
        response=response,
        weight_bytes=weight_bytes,
        measured_tokens_per_s=assumptions.rollout_tokens_per_s,
    )
    fp8 = cfg.kernels.fp8 != "none"
    flops = update_flops(shape, sequences=_rows_per_update(cfg), seq_tokens=ro.max_prompt_tokens + response)
    one = update_s(flops, hardware.gpu, gpus=trainer.ranks, mfu=assumptions.mfu, fp8=fp8)
    model_bytes = shape.total_params() * 2
    mu = st.updates_per_stage
    common = {
        "stages": st.num_stages,
        "updates_per_stage": mu,
        "rollout_s": rollout.seconds,
        "rollout_tokens": rollout.tokens,
        "tokens_per_s_per_engine": rollout.tokens_per_s_per_engine,
        "concurrency": rollout.concurrency,
        "update_s": one,
        "update_tflop": flops / 1e12,
        "optimize_s": mu * one,
    }
    if cfg.mode != "async":
        boundary = model_bytes / SYNC_BYTES_PER_S
        total = st.num_stages * (rollout.seconds + mu * one + boundary)
        return TimePlan(**common, boundary_s=boundary, total_s=total)
    a = cfg.async_
    publish = model_bytes / PUBLISH_BYTES_PER_S
    balance = async_balance(
        produce_groups_per_s=st.train_groups / rollout.seconds,
        update_s=one,
        mini_groups=st.mini_groups,
        sync_every=a.sync_every,
        publish_s=publish,
        queue_groups=a.queue_groups,
        batch_groups=a.batch_groups,
        workers=a.rollout_ranks,
        max_lag=a.max_lag,
    )
    total = st.num_stages * mu * one / max(1e-9, 1.0 - balance.idle_fraction)
    return TimePlan(**common, boundary_s=publish * mu / a.sync_every, total_s=total, balance=balance)
