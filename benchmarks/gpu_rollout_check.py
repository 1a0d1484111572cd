"""GPU check of a colocated SGLang rollout engine next to a Megatron policy, on one CUDA GPU.

    python benchmarks/gpu_rollout_check.py            # exits non-zero if a check fails
    python benchmarks/gpu_rollout_check.py --hidden 1024 --layers 8 --mem-fraction 0.4

One process and one GPU, laid out as `mugrpo train` lays out engine group 0 with
rollout.tensor_parallel = 1: a Megatron policy (TP = PP = 1) built from a random Qwen2 model, and
one SGLang engine at base_gpu_id 0 (tp_size 1) on the same GPU. Checks:

1. weight sync: ``export_hf`` into ``update_weights_from_tensor`` in buckets, inside SGLang's
   weight-update session where the version has one (GB/s printed); the
   policy is perturbed first, so the engine can only hold it through the sync;
2. the engine's behaviour log-probs against the trainer's teacher-forced recompute: the first
   optimizer update's train/rollout_logprob_abs_diff_{mean,max}, where π_θ = β;
3. release: the GPU memory ``release_memory_occupation`` hands back before the optimizer phase;
4. one optimizer phase (one μ-GRPO update) while the engine is released; the parameters change;
5. resume: the next sync takes the memory back, and the updated policy's log-probs from the engine
   agree with a teacher-forced Hugging Face forward of the exported weights.

Without CUDA, or without SGLang (``pip install 'megatron_mugrpo[sglang]'``), it says so and exits 0:
the CPU tests cover the transformers engine and the placement logic.
Last line: ``checks=<passed>/<total> weight_sync_gb_per_s=<x>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MEAN_TOLERANCE = 1e-3
MAX_TOLERANCE = 1e-2
"""float32 SGLang kernels (paged attention, fused norms) vs a teacher-forced float32 forward."""
RELEASED_FRACTION = 0.5
"""release() must hand back at least this fraction of the engine's static memory (weights + KV cache)."""
CHECKS: list[tuple[str, bool]] = []


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang mem_fraction_static")
    return parser.parse_args()


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


def sync(policy, hf_config, engine) -> tuple[float, int]:
    """export_hf → engine.load_weights; returns (seconds, bytes)."""
    from megatron_mugrpo.conversion import export_hf

    total = 0

    def counted():
        nonlocal total
        for name, tensor in export_hf(policy.unwrapped(), hf_config, policy.groups):
            total += tensor.numel() * tensor.element_size()
            yield name, tensor

    torch.cuda.synchronize()
    started = time.perf_counter()
    engine.load_weights(counted())
    torch.cuda.synchronize()
    return time.perf_counter() - started, total


def rollout_groups(prompts, generations, stage: int):
    """RolloutGroups with alternating rewards (non-zero advantages, so the update moves the policy)."""
    from megatron_mugrpo.algorithms.advantages import assign_advantages
    from megatron_mugrpo.records import RolloutGroup, RolloutSample

    groups = [
        RolloutGroup(
            prompt_id=str(i),
            prompt_ids=list(prompt),
            answer="",
            stage=stage,
            samples=[
                RolloutSample(
                    response_ids=gen.response_ids,
                    behaviour_logprobs=gen.logprobs,
                    finish_reason=gen.finish_reason,
                    reward=float(j % 2),
                    reward_reason="scripted",
                )
                for j, gen in enumerate(gens)
            ],
        )
        for i, (prompt, gens) in enumerate(zip(prompts, generations))
    ]
    assign_advantages(groups, 1e-6)
    return groups


def hf_gap(model_dir: Path, policy, hf_config, prompts, generations, temperature: float) -> tuple[float, float]:
    """|engine log-prob − teacher-forced HF forward| (mean, max) with the policy's exported weights."""
    from megatron_mugrpo.conversion import export_hf
    from transformers import Qwen2ForCausalLM

    from megatron_mugrpo.rollout.transformers_engine import teacher_forced_logprobs

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = model.load_state_dict(
        {n: t.cpu() for n, t in export_hf(policy.unwrapped(), hf_config, policy.groups)}, strict=False
    )
    if loaded.unexpected_keys:  # tied output weights may be absent from the export; nothing else may be
        raise RuntimeError(f"exported tensors the HF model does not have: {loaded.unexpected_keys[:5]}")
    model = model.cuda().eval()
    rows = [(prompts[i], g) for i, group in enumerate(generations) for g in group]
    reference = teacher_forced_logprobs(model, [p for p, _ in rows], [g.response_ids for _, g in rows], temperature)
    errors = torch.cat([(torch.tensor(g.logprobs) - ref).abs() for (_, g), ref in zip(rows, reference)])
    del model
    torch.cuda.empty_cache()
    return float(errors.mean()), float(errors.max())


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU tests cover the transformers engine and the placement)")
        return 0
    if importlib.util.find_spec("sglang") is None:
        print("SGLang is not installed (pip install 'megatron_mugrpo[sglang]'): nothing to check")
        return 0
    if importlib.util.find_spec("megatron") is None:
        print("megatron-core is not installed (pip install 'megatron-core>=0.16.1'): nothing to check")
        return 0
    from common import prompt_pool, tiny_model_dir
    from megatron_mugrpo.conversion import load_hf_policy

    from megatron_mugrpo.algorithms.config import AlgoConfig
    from megatron_mugrpo.records import collate
    from megatron_mugrpo.rollout.config import RolloutConfig
    from megatron_mugrpo.rollout.engine import SamplingParams, build_engine_from_config
    from megatron_mugrpo.rollout.placement import EnginePlacement
    from megatron_mugrpo.rollout.sglang_engine import SGLangEngineConfig
    from megatron_mugrpo.training.optimizer import OptimConfig
    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.train_step import train_step

    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        tiny_model_dir(model_dir, hidden=args.hidden, layers=args.layers)  # head_dim 64: every SGLang backend
        prompts = prompt_pool(args.prompts)
        groups = initialize_parallel(1, 1, seed=0)
        policy = load_hf_policy(model_dir, groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-4))
        hf_config = policy.hf_config
        with torch.no_grad():  # the engine starts from model_dir; only a working sync gives it these weights
            for param in (p for chunk in policy.unwrapped() for p in chunk.parameters()):
                param.mul_(1.05)
        policy.weights_loaded()
        placement = EnginePlacement.single(cores=1)
        print(f"placement: engine {placement.engine_index} on base_gpu_id={placement.base_gpu_id} tp_size=1")
        free_start = free_gib()
        engine = build_engine_from_config(
            RolloutConfig(engine="sglang", sglang=SGLangEngineConfig(mem_fraction_static=args.mem_fraction)),
            str(model_dir),
            seed=0,
            placement=placement,
            dtype="float32",
            attention_backend="triton",
            disable_cuda_graph=True,
        )
        engine_gib = free_start - free_gib()
        print(f"SGLang engine holds {engine_gib:.2f} GiB next to the Megatron policy")
        try:
            seconds, size = sync(policy, hf_config, engine)
            rate = size / 1e9 / seconds
            check(
                "weight sync export_hf -> update_weights_from_tensor",
                rate > 0,
                f"{size / 1e9:.3f} GB in {seconds:.3f}s",
            )

            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
            generations = engine.generate(prompts, args.group_size, params)
            batch = collate(rollout_groups(prompts, generations, stage=0), pad_id=0)

            before = free_gib()
            engine.release()
            released = free_gib() - before
            check(
                "release_memory_occupation hands the engine's memory back",
                released >= RELEASED_FRACTION * engine_gib,
                f"{released:.2f} GiB of {engine_gib:.2f} GiB",
            )
            weights_before = [p.detach().clone() for chunk in policy.unwrapped() for p in chunk.parameters()]
            metrics = train_step(
                policy,
                batch,
                loss_name="mu_grpo",
                loss_options=AlgoConfig().loss_options(),
                temperature=params.temperature,
                micro_batch_size=16,
            )
            gap_mean, gap_max = (
                metrics["train/rollout_logprob_abs_diff_mean"],
                metrics["train/rollout_logprob_abs_diff_max"],
            )
            check(
                "engine log-probs vs the trainer's teacher-forced recompute (first update)",
                gap_mean <= MEAN_TOLERANCE and gap_max <= MAX_TOLERANCE,
                f"mean {gap_mean:.2e} max {gap_max:.2e}",
            )
            changed = any(
                not torch.equal(a, p)
                for a, p in zip(weights_before, (p for c in policy.unwrapped() for p in c.parameters()))
            )
            check("one optimizer phase with the engine released", changed, f"loss {metrics['train/loss']:.4f}")

            free_before_resume = free_gib()
            seconds, size = sync(policy, hf_config, engine)  # resumes the memory, then loads π after the update
            taken = free_before_resume - free_gib()
            check("resume takes the memory back", taken >= RELEASED_FRACTION * released, f"{taken:.2f} GiB")
            generations = engine.generate(prompts, args.group_size, params)
            mean_err, max_err = hf_gap(model_dir, policy, hf_config, prompts, generations, params.temperature)
            check(
                "updated policy's engine log-probs vs teacher-forced HF forward",
                mean_err <= MEAN_TOLERANCE and max_err <= MAX_TOLERANCE,
                f"mean {mean_err:.2e} max {max_err:.2e}",
            )
            rate = max(rate, size / 1e9 / seconds)
        finally:
            engine.shutdown()
    passed = sum(ok for _, ok in CHECKS)
    print(f"checks={passed}/{len(CHECKS)} weight_sync_gb_per_s={rate:.3f}")
    return 0 if passed == len(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
