"""Tensor × expert (× expert-tensor) parallelism with sequence parallelism on CPU reproduces one rank.

Megatron insists on sequence parallelism for a MoE model at TP > 1, so TP × EP on CPU needs the
sequence-parallel pieces of ``cpu_compat`` (torch norms marked for the TP all-reduce, the MoE
dispatcher's uneven TP gather / reduce-scatter on gloo). The tiny Qwen3-MoE of test_moe (2 layers,
hidden 32, 4 experts top-2) runs on 4 ranks in the layouts of ``LAYOUTS``: TP=2 × EP=2 (each rank
holds half of 2 experts; DP=2 for the dense parts), with the router losses off, on, and with routing
replay of fixed routes; TP=2 × EP=4 × ETP=1 (one whole expert per rank), router losses off and on;
TP=1 × EP=2 × ETP=2 (attention purely data-parallel, each expert split over 2 ranks); and the tiny
dense Qwen2 at TP=2 × DP=2. The two ETP layouts without router losses take the reference's initial
weights through the trainer's own paths (its one-rank checkpoint; its Hugging Face export, as a warm
start loads it) and save a checkpoint that loads back on one rank bit for bit. Each is compared with a
single-rank run (TP=1, EP=1, no sequence parallelism) of the same initial weights and batch:
logits, log-probs, one update's gradients, loss and grad norm, the weights after that update, and
the Hugging Face tensors ``export_hf`` sends to a rollout engine. The batch is padded to an even
length for both runs (sequence parallelism pads it so; padding tokens are routed too and count in
the router losses).

Measured (2 cores, torch 2.13, megatron-core 0.16.1, float32; one spawn of 4 ranks ~30 s): logits
|Δ| ≤ 1.5e-7, log-probs ≤ 4.8e-7, |Δgrad| ≤ 6e-8 in every layout; |Δw| after one AdamW step at lr
1e-3 ≤ 2.2e-5 (Adam's first step magnifies near-zero gradients), relative |Δgrad_norm| ≤ 1.3e-7.
Bounds: as test_moe (1e-6 on logits and log-probs, 1e-5 on gradients, 1e-6 relative on the
metrics), but 1e-4 on weights (``WEIGHT_ATOL``).

The router losses: megatron-core 0.16 weighs their gradients 1/TP under sequence parallelism with
per-token loss (``mcore_compat.sequence_parallel_router_loss_coefficients``, which multiplies the
coefficients by TP). Without that correction, with the load-balancing (1e-2) and z (1e-3) losses on,
the router's |Δgrad| was 5.6e-3 and the grad norm 1.77964 against one rank's 1.78444; doubling both
coefficients at TP=2 gave |Δgrad| 6e-8. ``moe_losses`` asserts one rank's gradients with both on,
and that the logged ``train/moe_aux_loss``, ``train/moe_z_loss`` and per-layer expert load count
every TP rank's slice of the sequence (``training.moe``: the load is summed over the TP group under
sequence parallelism, the z-loss averaged over it).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from megatron_mugrpo.conversion import export_hf, load_hf_into_model, save_hf_dir

from megatron_mugrpo.records import TrainBatch
from megatron_mugrpo.training import checkpoint
from megatron_mugrpo.training.moe import MoeConfig
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import destroy_parallel, initialize_parallel
from megatron_mugrpo.training.routing_replay import routes_for_schedule, set_micro_batch_routes
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.train_step import forward_logprobs, pad_length

from .common import VOCAB, hf_config, make_batch, max_abs_diff, mu_grpo_step

pytestmark = pytest.mark.multiprocess

LOGIT_ATOL = 1e-6
GRAD_ATOL = 1e-5
WEIGHT_ATOL = 1e-4
"""A tenth of one step at LR: Adam's first step is lr · g / (|g| + ε), so a weight whose gradient is near ε
moves by up to lr on a gradient difference of 1e-8. Measured 3.0e-6 with 2 threads per rank, 1.4e-5 with
1 (make test's workers); a step applied to the wrong shard or not at all is off by ~lr = 1e-3."""
METRIC_RTOL = 1e-6
LR = 1e-3
MICRO_BATCH = 2
EXPERTS = 4
RANKS = 4
MODELS = {
    "moe": hf_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32),
    "moe_losses": hf_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32),
    "moe_replay": hf_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32),
    "dense": hf_config(),
}
"""name: the HF config of a model; each has one single-rank reference run."""
MOE = {
    "moe": MoeConfig(aux_loss_coeff=0.0, z_loss_coeff=0.0),
    "moe_losses": MoeConfig(aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    "moe_replay": MoeConfig(aux_loss_coeff=0.0, z_loss_coeff=0.0, routing_replay="rollout"),
}
"""MoE settings: router losses off in ``moe``, load-balancing and z-loss on in ``moe_losses``; routing
replay of fixed routes (``_routes``, not the model's own choice) in ``moe_replay``."""
LAYOUTS = {
    "moe": ("moe", 2, 2, 2),
    "moe_losses": ("moe_losses", 2, 2, 2),
    "moe_losses_etp1": ("moe_losses", 2, 4, 1),
    "moe_replay": ("moe_replay", 2, 2, 2),
    "dense": ("dense", 2, 1, 2),
    "moe_etp1": ("moe", 2, 4, 1),
    "moe_tp1_etp2": ("moe", 1, 2, 2),
}
"""run name: (model, TP, EP, ETP) on 4 ranks, sequence-parallel when TP > 1. ETP (expert tensor
parallelism) is TP unless set: ``moe_etp1`` keeps every expert whole at TP=2 and spreads the 4
experts over 4 EP ranks; ``moe_tp1_etp2`` splits each expert over 2 ranks while attention is purely
data-parallel (DP=4)."""
CHECKPOINTED = ("moe_etp1", "moe_tp1_etp2")
"""Layouts whose weights after the update are saved with the trainer's checkpoint code and loaded on one rank."""
INIT_FROM = {"moe_etp1": "checkpoint", "moe_tp1_etp2": "hf"}
"""How a layout gets the reference's initial weights: its one-rank checkpoint, resharded by the trainer's
checkpoint code, or its Hugging Face export, loaded by ``load_hf_into_model`` (the warm start's path).
Other layouts shard the weights by hand (``_load``)."""
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _policy(name: str, tp: int, seed: int, *, ep: int = 1, etp: int | None = None) -> Policy:
    """Model ``name`` at TP × EP × ETP, sequence-parallel when tp > 1."""
    groups = initialize_parallel(tp, 1, seed=seed, ep=ep, etp=etp)
    moe = MOE.get(name)
    return build_policy(
        MODELS[name], groups=groups, dtype=torch.float32, optim=OptimConfig(lr=LR), sequence_parallel=tp > 1, moe=moe
    )


def _global_name(name: str, policy: Policy) -> str:
    """The single-rank name: local expert j of EP rank r is global expert r × E/EP + j."""
    groups = policy.groups
    local = EXPERTS // groups.ep
    return _EXPERT.sub(lambda m: f".local_experts.{groups.ep_rank * local + int(m.group(1))}.", name)


def _tp_rank_and_size(name: str, policy: Policy) -> tuple[int, int]:
    """This rank's shard index and shard count: experts are split over the expert-TP group."""
    if ".local_experts." in name:
        from megatron.core import parallel_state

        return parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
    return policy.groups.tp_rank, policy.groups.tp


def _is_swiglu_fc1(name: str) -> bool:
    """SwiGLU fc1 shards hold [gate shard; up shard], not a plain slice of [gate; up]."""
    return name.endswith("linear_fc1.weight")


def _shard(full: torch.Tensor, name: str, param: torch.nn.Parameter, rank: int, size: int) -> torch.Tensor:
    """This rank's part of the single-rank tensor ``full`` for the (possibly TP-split) ``param``."""
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim = param.partition_dim
    if _is_swiglu_fc1(name):
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)])
    rows = param.shape[dim] * size
    if full.shape[dim] < rows:  # the padded vocabulary grows with TP; padding rows are zero
        pad = list(full.shape)
        pad[dim] = rows - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=dim)
    return full.narrow(dim, rank * param.shape[dim], param.shape[dim])


def _join(name: str, shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """The single-rank tensor from its TP shards in rank order (the inverse of ``_shard``)."""
    if dim is None:
        return shards[0]
    if _is_swiglu_fc1(name):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def _full(policy: Policy, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` (keyed like the local parameters) as single-rank tensors, gathered over every rank."""
    params = dict(policy.unwrapped()[0].named_parameters())
    mine = {}
    for name, value in values.items():
        rank, size = _tp_rank_and_size(name, policy)
        split = getattr(params[name], "tensor_model_parallel", False) and size > 1
        mine[_global_name(name, policy)] = (rank, params[name].partition_dim if split else None, value.detach().clone())
    shards: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for part in policy.groups.all_gather(mine):
        for name, (rank, dim, value) in part.items():
            shards.setdefault(name, {})[rank] = value
            dims[name] = dim
    return {name: _join(name, [by_rank[r] for r in sorted(by_rank)], dims[name]) for name, by_rank in shards.items()}


def _load(policy: Policy, init: dict[str, torch.Tensor]) -> None:
    """Write the single-rank weights ``init`` into this rank's shards."""
    with torch.no_grad():
        for name, param in policy.unwrapped()[0].named_parameters():
            rank, size = _tp_rank_and_size(name, policy)
            param.copy_(_shard(init[_global_name(name, policy)], name, param, rank, size))
    policy.weights_loaded()


def _routes(batch: TrainBatch, layers: int) -> torch.Tensor:
    """Fixed routes [B, L, layers, top-2] for every token: a seeded random pair of distinct experts."""
    generator = torch.Generator().manual_seed(7)
    scores = torch.rand((*batch.tokens.shape, layers, EXPERTS), generator=generator)
    return scores.argsort(dim=-1)[..., :2].to(torch.uint8)


def _logits(policy: Policy, batch: TrainBatch) -> torch.Tensor:
    """Full-vocabulary logits [B, S, V] (the batch's length is a multiple of TP for sequence parallelism)."""
    groups = policy.groups
    tokens, length = batch.tokens, batch.tokens.shape[1]
    assert length % groups.tp == 0
    bare = policy.unwrapped()[0]
    bare.eval()
    with torch.no_grad(), routes_for_schedule([bare]):
        set_micro_batch_routes(bare, batch.routes, batch.response_mask)
        local = bare(tokens, torch.arange(length).expand_as(tokens), None).contiguous()
    bare.train()
    if groups.tp > 1:  # vocabulary-parallel output: gather the shards of the last dimension
        parts = [torch.empty_like(local) for _ in range(groups.tp)]
        dist.all_gather(parts, local, group=groups.tp_group)
        local = torch.cat(parts, dim=-1)
    return local[:, :length, :VOCAB].clone()


def _run(policy: Policy, name: str) -> dict[str, Any]:
    """Logits and log-probs of the loaded weights, then one update: its metrics, gradients, new weights."""
    batch = pad_length(make_batch(10, groups=2, group_size=4), 2)  # the same tokens with and without SP
    if name in MOE and MOE[name].routing_replay == "rollout":
        batch = dataclasses.replace(batch, routes=_routes(batch, MODELS[name]["num_hidden_layers"]))
    logits = _logits(policy, batch)
    logprobs = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=MICRO_BATCH)
    metrics = mu_grpo_step(policy, batch, MICRO_BATCH)
    model = policy.unwrapped()[0]
    grads = _full(policy, {n: p.main_grad for n, p in model.named_parameters()})
    params = _full(policy, dict(model.named_parameters()))
    exported = {key: t.clone() for key, t in export_hf(policy.unwrapped(), policy.hf_config, policy.groups)}
    return {
        "logits": logits, "logprobs": logprobs, "metrics": metrics, "grads": grads, "params": params,
        "exported": exported,
    }  # fmt: skip


def _reference(rank: int, world_size: int, root: str) -> None:
    """One rank, no sequence parallelism: the initial weights and the run every layout must reproduce."""
    for name in MODELS:
        policy = _policy(name, 1, seed=0, ep=1)
        torch.save(_full(policy, dict(policy.unwrapped()[0].named_parameters())), Path(root) / f"{name}_init.pt")
        if any(LAYOUTS[run][0] == name for run in INIT_FROM):
            ckpt = Path(root) / f"{name}_init_ckpt"
            checkpoint.save_checkpoint(ckpt, 1, policy.model_chunks, groups=policy.groups, hf_config=policy.hf_config)
            save_hf_dir(
                export_hf(policy.unwrapped(), policy.hf_config, policy.groups),
                ckpt.with_suffix(".hf"),
                policy.hf_config,
            )
        torch.save(_run(policy, name), Path(root) / f"{name}_tp1.pt")
        destroy_parallel()


def _parallel(rank: int, world_size: int, root: str) -> None:
    torch.use_deterministic_algorithms(True)
    for run, (name, tp, ep, etp) in LAYOUTS.items():
        policy = _policy(name, tp, seed=1234, ep=ep, etp=etp)  # another seed: the weights must come from the reference
        init = Path(root) / f"{name}_init_ckpt"
        if INIT_FROM.get(run) == "checkpoint":
            checkpoint.load_checkpoint(
                checkpoint.latest_checkpoint(init), policy.model_chunks, groups=policy.groups, load_rng=False
            )
        elif INIT_FROM.get(run) == "hf":
            load_hf_into_model(policy.unwrapped(), init.with_suffix(".hf"), policy.groups)
            policy.weights_loaded()
        else:
            _load(policy, torch.load(Path(root) / f"{name}_init.pt"))
        result = _run(policy, name)
        groups = policy.groups
        if rank == 0:
            torch.save(result | {"layout": (groups.tp, groups.ep, groups.etp, groups.dp)}, Path(root) / run)
        if run in CHECKPOINTED:
            hf = policy.hf_config
            checkpoint.save_checkpoint(Path(root) / f"{run}_ckpt", 1, policy.model_chunks, groups=groups, hf_config=hf)
        destroy_parallel()


def _load_on_one_rank(rank: int, world_size: int, root: str) -> None:
    """Each checkpoint of ``CHECKPOINTED`` loaded at TP = EP = ETP = 1: its weights and metadata."""
    for run in CHECKPOINTED:
        policy = _policy(LAYOUTS[run][0], 1, seed=99)
        step_dir = checkpoint.latest_checkpoint(Path(root) / f"{run}_ckpt")
        loaded = checkpoint.load_checkpoint(step_dir, policy.model_chunks, groups=policy.groups, load_rng=False)
        params = _full(policy, dict(policy.unwrapped()[0].named_parameters()))
        torch.save({"params": params, "metadata": loaded.metadata}, Path(root) / f"{run}_at_one_rank")
        destroy_parallel()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("moe_tp_ep")
    run_distributed(_reference, 1, str(root))
    run_distributed(_parallel, RANKS, str(root))
    run_distributed(_load_on_one_rank, 1, str(root))
    loaded = {f"{run}_at_one_rank": torch.load(root / f"{run}_at_one_rank", weights_only=False) for run in CHECKPOINTED}
    return loaded | {
        run: {
            "ref": torch.load(root / f"{name}_tp1.pt"),
            "ours": torch.load(root / run),
            "init": torch.load(root / f"{name}_init.pt"),
        }
        for run, (name, *_) in LAYOUTS.items()
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logits_and_logprobs_match_one_rank(runs, name):
    ours, ref = runs[name]["ours"], runs[name]["ref"]
    _, tp, ep, etp = LAYOUTS[name]
    assert ours["layout"] == (tp, ep, etp, RANKS // tp)  # (tp, ep, etp, dp) on 4 ranks
    torch.testing.assert_close(ours["logits"], ref["logits"], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(ours["logprobs"], ref["logprobs"], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradients_and_optimizer_step_match_one_rank(runs, name):
    ours, ref = runs[name]["ours"], runs[name]["ref"]
    if name.startswith("moe"):
        expert_grads = [n for n in ref["grads"] if ".local_experts." in n]
        assert len(expert_grads) == 2 * EXPERTS * 2  # 2 layers × 4 experts × (fc1, fc2), all gathered
        assert min(float(ref["grads"][n].abs().max()) for n in expert_grads) > 1e-4  # every expert learns
    grad_diff = max_abs_diff(ours["grads"], ref["grads"])
    assert grad_diff < GRAD_ATOL, f"max |Δgrad| {name} TP=2 vs one rank = {grad_diff:.3g}"
    weight_diff = max_abs_diff(_real_vocabulary(ours["params"]), _real_vocabulary(ref["params"]))
    assert weight_diff < WEIGHT_ATOL, f"max |Δw| {name} after one step = {weight_diff:.3g}"


def _real_vocabulary(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` without the vocabulary-padding rows of the embedding and output layer: a Hugging Face
    load zeroes them (HF has no such rows), where the reference keeps its random initialisation."""
    return {name: t[:VOCAB] if name.startswith(("embedding.", "output_layer.")) else t for name, t in params.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_update_metrics_match_one_rank(runs, name):
    ours, ref = runs[name]["ours"]["metrics"], runs[name]["ref"]["metrics"]
    for key in ("train/loss", "train/grad_norm", "train/ratio_mean"):
        assert ours[key] == pytest.approx(ref[key], rel=METRIC_RTOL), key


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_engine_sync_export_equals_one_rank_s(runs, name):
    """export_hf gathers every expert over TP and EP: the Hugging Face tensors the engine would load."""
    ours, ref = runs[name]["ours"]["exported"], runs[name]["ref"]["exported"]
    assert ours.keys() == ref.keys() and any(".mlp.experts.3." in key for key in ours) == name.startswith("moe")
    assert max_abs_diff(ours, ref) < WEIGHT_ATOL


@pytest.mark.parametrize("name", [run for run, (model, *_) in LAYOUTS.items() if model in MOE])
def test_expert_load_and_router_loss_metrics_count_every_slice_of_the_sequence(runs, name):
    """Under sequence parallelism each TP rank routes its own slice: the logged load sums the slices,
    the logged router losses combine the slices' partial losses, so all equal one rank's."""
    ours, ref = runs[name]["ours"]["metrics"], runs[name]["ref"]["metrics"]
    loads = sorted(key for key in ref if key.startswith("train/moe_load_"))
    assert loads and sorted(key for key in ours if key.startswith("train/moe_load_")) == loads
    for key in loads:
        assert ours[key] == pytest.approx(ref[key], abs=1e-12), key
    if LAYOUTS[name][0] == "moe_losses":
        for key in ("train/moe_aux_loss", "train/moe_z_loss"):
            assert ours[key] == pytest.approx(ref[key], rel=METRIC_RTOL), key


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_a_checkpoint_saved_with_expert_tensor_parallelism_loads_on_one_rank_bit_for_bit(runs, name):
    _, tp, ep, etp = LAYOUTS[name]
    saved, loaded = runs[name]["ours"]["params"], runs[f"{name}_at_one_rank"]["params"]
    assert max_abs_diff(loaded, saved) == 0  # bit for bit (TP=2's vocabulary padding rows left out)
    metadata = runs[f"{name}_at_one_rank"]["metadata"]
    assert (metadata["tp"], metadata["ep"], metadata["etp"]) == (tp, ep, etp)


def test_replayed_routes_are_not_the_models_own(runs):
    """``moe_replay`` starts from ``moe``'s weights; replaying its fixed routes changes the log-probs, so
    the TP=2 × EP=2 match above is a match of replayed routing, sliced per TP rank under sequence parallelism."""
    assert max_abs_diff(runs["moe_replay"]["init"], runs["moe"]["init"]) == 0
    replayed, fresh = runs["moe_replay"]["ref"]["logprobs"], runs["moe"]["ref"]["logprobs"]
    assert float((replayed - fresh).abs().max()) > 1e-3
