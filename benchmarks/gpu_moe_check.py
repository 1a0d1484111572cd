"""GPU check of the mixture-of-experts path on one CUDA GPU: grouped GEMM, routing replay, SGLang's routes.

    python benchmarks/gpu_moe_check.py                  # exits non-zero if a check fails
    python benchmarks/gpu_moe_check.py --cpu            # part (b) on CPU with gloo (tests this script)

A random tiny Qwen3-MoE (``--layers`` MoE layers, ``--experts`` experts top-``--topk``, head_dim 64
so that every SGLang attention backend takes it) over the character tokenizer, its routers redrawn
at ``--router-std`` (a trained router is decisive; an initialised one sits near a tie on every token,
where any rounding flips the route). Three parts, each skipped with a line saying why when its
dependency is absent:

a. **Grouped GEMM** (Transformer Engine): the Megatron MoE layer with ``moe_grouped_gemm`` (TE's
   ``TEGroupedMLP``, the trainer's GPU path) against the sequential expert MLP (``SequentialMLP``)
   on the same weights: logits and the gradients of the summed target log-probs, in float32 (TF32
   off) and bfloat16, as max |Δ| relative to the sequential side's max |value| (``TOLERANCE``).
   The sequential model is loaded through the converter; whether the converter also loads and
   exports the grouped model's ``linear_fc{1,2}.weight{e}`` (the trainer's default with TE,
   ``moe.grouped_gemm``) is a check of its own, and the grouped model gets the sequential weights by
   name either way.
b. **Routing replay** (megatron-core): the trainer's own routes, captured from its routers in the
   micro-batches the schedule runs, replayed by a ``moe.routing_replay=rollout`` copy of the same
   weights give the same log-probs as fresh routing and ``train/routing_agreement`` 1.0 in an
   update; routes of another choice change the log-probs (the hook is live on this device).
c. **SGLang routes** (SGLang): ``SGLangEngine(record_routes=True)`` (bfloat16) samples
   ``--prompts`` × ``--group-size`` responses; each response's routes have the documented shape
   [prompt + response − 1, MoE layers, k] and, as sets, equal the top-k of a teacher-forced
   transformers forward of the same weights in bfloat16 (``RouteRecorder``) for at least
   ``MIN_SGLANG_AGREEMENT`` of the (token, layer) pairs (the agreement is printed).

Without CUDA (and without ``--cpu``) it says so and exits 0; without megatron-core likewise.
Last line: ``checks=<passed>/<total> skipped=<parts> grouped_rel=<max over dtypes> replay_agreement=<x>
sglang_route_agreement=<x>`` (``na`` for a part that did not run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Grouped vs sequential experts, max |Δ| / max |sequential|: float32 (TF32 off) differs only in the
GEMMs' summation order (~1e-6 expected); bfloat16 rounds every expert output and gradient to 8 bits
of mantissa (eps 7.8e-3), and a few roundings add up over two layers."""
REPLAY_TOLERANCE = 1e-5
"""Replaying the trainer's own routes against fresh routing: the same experts, their gate
probabilities recomputed from the same logits on the replay path (an ulp or two of a log-prob:
4.8e-7 measured with --cpu)."""
MIN_OTHER_GAP = 1e-4
"""Replaying routes the router would not choose must move some log-prob by more than this."""
MIN_SGLANG_AGREEMENT = 0.9
"""SGLang's fused MoE kernels and transformers' bfloat16 forward round differently; with decisive
routers only near-ties may flip ("most tokens")."""
_GROUPED = re.compile(r"\.experts\.linear_fc(\d)\.weight(\d+)$")
CHECKS: list[tuple[str, bool]] = []
SKIPPED: list[str] = []
RESULTS: dict[str, float] = {}


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")


def attempt(part: str, run, *args):
    """``run(*args)``, or a FAIL line naming the error (the other parts still run); None then."""
    try:
        return run(*args)
    except Exception as exc:  # a crash in one part is that part's failure, not the whole check's
        traceback.print_exc()  # the whole story on stderr; gpu_checks.py keeps it in its report
        check(f"({part}) runs", False, f"{type(exc).__name__}: {exc}"[:400])
        return None


def skip(part: str, why: str) -> None:
    # Not the words gpu_checks.py reads as "the whole check skipped": the other parts may still run.
    SKIPPED.append(part)
    print(f"SKIP ({part}) {why}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--router-std", type=float, default=0.5, help="std of the routers' weights")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang mem_fraction_static")
    parser.add_argument("--cpu", action="store_true", help="run what CPU allows (part b, gloo): tests this script")
    return parser.parse_args()


# ------------------------------------------------------------------------------------ the model


def build_moe_dir(out_dir: Path, args: argparse.Namespace) -> tuple[dict, list[list[int]]]:
    """The tiny Qwen3-MoE (float32) with the character tokenizer in ``out_dir``; (config.json, prompts)."""
    from common import prompt_pool
    from megatron_mugrpo.conversion.hf_io import load_hf_config

    from megatron_mugrpo.training.tiny import tiny_hf_dir

    def decisive_routers(model: torch.nn.Module) -> None:
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, args.router_std)

    tiny_hf_dir(
        out_dir,
        "qwen3_moe",
        seed=0,
        adjust=decisive_routers,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        moe_intermediate_size=args.hidden // 2,
        max_position_embeddings=512,
    )
    return load_hf_config(out_dir), prompt_pool(args.prompts)


def scripted_batch(prompts: list[list[int]], vocab: int, args: argparse.Namespace):
    """A TrainBatch of ``--group-size`` random responses per prompt (non-zero advantages)."""
    from gpu_rollout_check import rollout_groups

    from megatron_mugrpo.records import collate
    from megatron_mugrpo.rollout.engine import Generation

    generator = torch.Generator().manual_seed(0)
    generations = [
        [
            Generation(
                response_ids=torch.randint(3, vocab, (12,), generator=generator).tolist(),
                logprobs=[0.0] * 12,
                finish_reason="length",
            )
            for _ in range(args.group_size)
        ]
        for _ in prompts
    ]
    return collate(rollout_groups(prompts, generations, stage=0), pad_id=0)


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return model(tokens, positions, None)


# ------------------------------------------------------------------------------------ (a) grouped GEMM


def sequential_name(grouped_name: str) -> str:
    """The ``SequentialMLP`` name of a ``TEGroupedMLP`` parameter (other names are shared by both)::

    decoder.layers.0.mlp.experts.linear_fc1.weight3 -> decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight
    """
    return _GROUPED.sub(r".experts.local_experts.\2.linear_fc\1.weight", grouped_name)


def grouped_vs_sequential(hf_dir: Path, hf_config: dict, batch, groups, dtype: torch.dtype) -> float:
    """Part (a) at ``dtype``; returns max |Δ| / max |sequential| over logits and gradients."""
    from megatron_mugrpo.conversion import export_hf, load_hf_into_model

    from megatron_mugrpo.training.model import build_gpt_model

    vocab, name = int(hf_config["vocab_size"]), str(dtype).removeprefix("torch.")
    models = {}
    for grouped in (False, True):
        models[grouped] = build_gpt_model(
            hf_config, groups, dtype=dtype, config_overrides={"moe_grouped_gemm": grouped}
        ).cuda()
    sequential, grouped = models[False], models[True]
    load_hf_into_model(sequential, hf_dir, groups)
    reference = dict(sequential.named_parameters())
    if dtype == torch.float32:  # the converter's own question, asked once
        try:
            load_hf_into_model(grouped, hf_dir, groups)
            same = all(torch.equal(p, reference[sequential_name(n)]) for n, p in grouped.named_parameters())
            check("the converter loads HF experts into grouped GEMM", same, "weights equal the sequential model's")
            exported = dict(export_hf(grouped, hf_config, groups))
            back = dict(export_hf(sequential, hf_config, groups))
            same = exported.keys() == back.keys() and all(torch.equal(t, back[n]) for n, t in exported.items())
            check("the converter exports grouped GEMM's experts", same, "HF tensors equal the sequential model's")
        except Exception as exc:  # reported as this check's failure; the comparison goes on
            check("the converter maps grouped GEMM's experts", False, f"{type(exc).__name__}: {exc}"[:300])
    with torch.no_grad():
        for n, p in grouped.named_parameters():
            p.copy_(reference[sequential_name(n)])
    tokens, targets = batch.tokens.cuda(), batch.targets.cuda()
    out = {}
    for grouped_gemm, model in models.items():
        routes: list[torch.Tensor] = []
        hooks = [
            r.register_forward_hook(lambda _m, _i, o, seen=routes: seen.append(o[1].detach())) for r in _routers(model)
        ]
        model.zero_grad()
        logits = _forward(model, tokens)[..., :vocab]
        logits.float().log_softmax(-1).gather(-1, targets[..., None]).sum().backward()
        for hook in hooks:
            hook.remove()
        grads = {sequential_name(n): p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        out[grouped_gemm] = (logits.detach().float(), grads, torch.stack(routes))
    (seq_logits, seq_grads, seq_routes), (grp_logits, grp_grads, grp_routes) = out[False], out[True]
    same_routes = float((seq_routes == grp_routes).all(-1).float().mean())
    logit_rel = float((grp_logits - seq_logits).abs().max() / seq_logits.abs().max())
    grad_scale = max(float(g.abs().max()) for g in seq_grads.values())
    grad_rel = max(float((grp_grads[n] - g).abs().max()) for n, g in seq_grads.items()) / grad_scale
    missing = sorted(set(seq_grads) ^ set(grp_grads))
    check(
        f"grouped GEMM vs sequential experts ({name}): logits and gradients",
        not missing and max(logit_rel, grad_rel) <= TOLERANCE[dtype],
        f"logits {logit_rel:.2e}, gradients {grad_rel:.2e} of max |value| (tolerance {TOLERANCE[dtype]:.0e}); "
        f"same routes on {same_routes:.4f} of the (layer, token) rows"
        + (f"; unmatched grads {missing[:3]}" if missing else ""),
    )
    del models, sequential, grouped
    return max(logit_rel, grad_rel)


# ------------------------------------------------------------------------------------ (b) routing replay


def own_routes(policy, batch, micro_batch: int, topk: int) -> torch.Tensor:
    """The policy's own routes of ``batch`` [B, L, layers, k] (batch-major, uint8), captured from its
    routers in the micro-batches ``forward_logprobs`` runs, by decreasing probability."""
    bare, parts = policy.unwrapped()[0], []
    device = next(bare.parameters()).device
    bare.eval()
    for start in range(0, batch.num_sequences, micro_batch):
        tokens, seen = batch.tokens[start : start + micro_batch].to(device), []
        hooks = [
            r.register_forward_hook(lambda _m, _i, o, seen=seen: seen.append(o[0].detach())) for r in _routers(bare)
        ]
        with torch.no_grad():
            _forward(bare, tokens)
        for hook in hooks:
            hook.remove()
        rows, length = tokens.shape
        per_layer = [p.topk(topk, dim=-1).indices.reshape(length, rows, topk).transpose(0, 1) for p in seen]
        parts.append(torch.stack(per_layer, dim=2).cpu())
    bare.train()
    return torch.cat(parts).to(torch.uint8)


def routing_replay(hf_config: dict, batch, groups, args: argparse.Namespace) -> float:
    """Part (b); returns the update's train/routing_agreement under the trainer's own routes."""
    from megatron_mugrpo.algorithms.config import AlgoConfig
    from megatron_mugrpo.training.moe import MoeConfig
    from megatron_mugrpo.training.optimizer import OptimConfig
    from megatron_mugrpo.training.setup import build_policy
    from megatron_mugrpo.training.train_step import forward_logprobs, train_step

    optim = OptimConfig(lr=1e-4)
    fresh = build_policy(hf_config, groups=groups, dtype=torch.float32, optim=optim, moe=MoeConfig())
    replay = build_policy(
        hf_config, groups=groups, dtype=torch.float32, optim=optim, moe=MoeConfig(routing_replay="rollout")
    )
    with torch.no_grad():  # both freshly initialised: the replaying copy takes the fresh one's weights
        for a, b in zip(fresh.unwrapped()[0].parameters(), replay.unwrapped()[0].parameters()):
            b.copy_(a)
    replay.weights_loaded()
    own = own_routes(fresh, batch, args.micro_batch, args.topk)
    other = ((own.long() + args.topk) % args.experts).to(torch.uint8)  # distinct ids, not the router's choice
    score = dict(temperature=1.0, micro_batch_size=args.micro_batch)
    mask = batch.response_mask.bool()
    logp_fresh = forward_logprobs(fresh, batch, **score).cpu()[mask]
    logp_own = forward_logprobs(replay, dataclasses.replace(batch, routes=own), **score).cpu()[mask]
    logp_other = forward_logprobs(replay, dataclasses.replace(batch, routes=other), **score).cpu()[mask]
    gap_own = float((logp_own - logp_fresh).abs().max())
    gap_other = float((logp_other - logp_fresh).abs().max())
    check(
        "routing replay of the trainer's own routes gives fresh routing's log-probs",
        gap_own <= REPLAY_TOLERANCE,
        f"max |Δ log p| {gap_own:.2e} (tolerance {REPLAY_TOLERANCE:.0e})",
    )
    check("replaying other routes changes the log-probs", gap_other > MIN_OTHER_GAP, f"max |Δ log p| {gap_other:.2e}")
    step = dict(loss_name="mu_grpo", loss_options=AlgoConfig().loss_options(), **score)
    metrics = train_step(replay, dataclasses.replace(batch, routes=own), **step)
    agreement = float(metrics["train/routing_agreement"])
    check(
        "an update replaying the trainer's own routes: train/routing_agreement",
        agreement == 1.0 and np.isfinite(metrics["train/loss"]),
        f"{agreement:.4f}, loss {metrics['train/loss']:.4f}",
    )
    del fresh, replay
    return agreement


# ------------------------------------------------------------------------------------ (c) SGLang routes


def sglang_routes(hf_dir: Path, hf_config: dict, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Part (c); returns the fraction of (token, layer) top-k sets SGLang and transformers share."""
    from transformers import AutoModelForCausalLM

    from megatron_mugrpo.rollout.engine import SamplingParams
    from megatron_mugrpo.rollout.routes import RouteRecorder, route_layout
    from megatron_mugrpo.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(
        str(hf_dir),
        mem_fraction_static=args.mem_fraction,
        dtype="bfloat16",
        record_routes=True,
        attention_backend="triton",
        disable_cuda_graph=True,
    )
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
        generations = engine.generate(prompts, args.group_size, params)
    finally:
        engine.shutdown()
    layout = route_layout(hf_config)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    recorder = RouteRecorder(model)
    bad_shapes, equal, total = [], 0, 0
    with torch.no_grad():
        for prompt, gens in zip(prompts, generations):
            for gen in gens:
                tokens = prompt + gen.response_ids[:-1]
                want = (len(tokens), len(layout.sparse_layers), layout.topk)
                got = getattr(gen, "routes", None)
                if got is None or tuple(got.shape) != want:
                    bad_shapes.append((None if got is None else tuple(got.shape), want))
                    continue
                recorder.begin([len(tokens)])
                recorder.step([0])
                model(input_ids=torch.tensor([tokens], device="cuda"))
                reference = recorder.routes(0)
                same = (np.sort(got.astype(np.int64), -1) == np.sort(reference.astype(np.int64), -1)).all(-1)
                equal, total = equal + int(same.sum()), total + same.size
    recorder.close()
    agreement = equal / max(total, 1)
    check(
        "SGLang record_routes: shape [prompt + response - 1, MoE layers, k] for every response",
        not bad_shapes and total > 0,
        f"{sum(len(g) for g in generations)} responses" + (f", mismatches {bad_shapes[:3]}" if bad_shapes else ""),
    )
    check(
        "SGLang routes equal transformers' teacher-forced top-k (bfloat16)",
        agreement >= MIN_SGLANG_AGREEMENT,
        f"{agreement:.4f} of {total} (token, layer) sets (at least {MIN_SGLANG_AGREEMENT})",
    )
    return agreement


# ------------------------------------------------------------------------------------ main


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device: nothing to check (the CPU tests cover MoE training and routing replay on gloo)")
        return 0
    if importlib.util.find_spec("megatron") is None:
        print("megatron-core is not installed (pip install 'megatron-core>=0.16.1'): nothing to check")
        return 0
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from megatron_mugrpo.training.model import have_transformer_engine
    from megatron_mugrpo.training.parallel import initialize_parallel

    on_gpu = torch.cuda.is_available() and not args.cpu
    print(f"device={torch.cuda.get_device_name() if on_gpu else 'cpu'} torch={torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "tiny_qwen3_moe"
        hf_config, prompts = build_moe_dir(hf_dir, args)
        batch = scripted_batch(prompts, int(hf_config["vocab_size"]), args)
        groups = initialize_parallel(1, 1, seed=0)
        print(f"backend={torch.distributed.get_backend()} experts={args.experts} top-{args.topk} layers={args.layers}")
        if not on_gpu:
            skip("a", "grouped GEMM: needs CUDA")
        elif not have_transformer_engine():
            skip("a", "grouped GEMM: Transformer Engine does not import (pip install transformer-engine[pytorch])")
        else:
            rel = [attempt("a", grouped_vs_sequential, hf_dir, hf_config, batch, groups, d) for d in TOLERANCE]
            if all(r is not None for r in rel):
                RESULTS["grouped_rel"] = max(rel)
        agreement = attempt("b", routing_replay, hf_config, batch, groups, args)
        if agreement is not None:
            RESULTS["replay_agreement"] = agreement
        if on_gpu:
            torch.cuda.empty_cache()  # the engine below sizes its KV cache from the free memory
        if not on_gpu:
            skip("c", "SGLang routes: SGLang needs CUDA")
        elif importlib.util.find_spec("sglang") is None:
            skip("c", "SGLang routes: SGLang does not import (pip install 'megatron_mugrpo[sglang]')")
        else:
            agreement = attempt("c", sglang_routes, hf_dir, hf_config, prompts, args)
            if agreement is not None:
                RESULTS["sglang_route_agreement"] = agreement
    torch.distributed.destroy_process_group()
    passed = sum(ok for _, ok in CHECKS)
    values = " ".join(
        f"{key}={RESULTS[key]:.3g}" if key in RESULTS else f"{key}=na"
        for key in ("grouped_rel", "replay_agreement", "sglang_route_agreement")
    )
    print(f"checks={passed}/{len(CHECKS)} skipped={','.join(SKIPPED) or 'none'} {values}")
    return 0 if passed == len(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
