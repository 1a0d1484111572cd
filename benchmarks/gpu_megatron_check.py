"""GPU check of the Megatron training path on NCCL, on one CUDA GPU (no SGLang needed).

    python benchmarks/gpu_megatron_check.py           # exits non-zero if a check fails

One process, TP = PP = 1, torch.distributed on NCCL (``initialize_parallel`` picks NCCL when CUDA is
present) with megatron-core's CUDA paths, none of the CPU compatibility layer. A random float32
Qwen2 is loaded into a Megatron policy through the converter. Checks:

1. the Megatron forward's log-probs (fused and unfused scoring) equal a teacher-forced Hugging Face
   forward of the same weights on the GPU;
2. one μ-GRPO optimizer update on a scripted batch changes the parameters and gives a finite loss;
3. the export back to Hugging Face names reproduces the updated weights (a round trip through
   ``export_hf`` and ``load_state_dict``, compared on the logits).

Without CUDA it says so and exits 0; without megatron-core it names the missing package and exits 0
(a bare GPU machine may have only torch, triton and transformers).
Last line: ``checks=<passed>/<total>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOLERANCE = 1e-3
"""float32 Megatron kernels vs a float32 Hugging Face forward (TF32 off)."""
CHECKS: list[tuple[str, bool]] = []


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--cpu", action="store_true", help="run the same checks on CPU with gloo (tests this script)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device: nothing to check (the CPU tests cover Megatron on gloo)")
        return 0
    if importlib.util.find_spec("megatron") is None:
        print("megatron-core is not installed (pip install 'megatron-core>=0.16.1'): nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from common import prompt_pool, tiny_model_dir
    from gpu_rollout_check import rollout_groups
    from megatron_mugrpo.conversion import export_hf, load_hf_policy
    from transformers import Qwen2ForCausalLM

    from megatron_mugrpo.algorithms.config import AlgoConfig
    from megatron_mugrpo.records import collate
    from megatron_mugrpo.rollout.engine import Generation
    from megatron_mugrpo.rollout.transformers_engine import teacher_forced_logprobs
    from megatron_mugrpo.training.optimizer import OptimConfig
    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.train_step import forward_logprobs, train_step

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        tiny_model_dir(model_dir, hidden=args.hidden, layers=args.layers)
        prompts = prompt_pool(args.prompts)
        groups = initialize_parallel(1, 1, seed=0)
        print(f"backend={torch.distributed.get_backend()}")
        policy = load_hf_policy(model_dir, groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-4))
        hf_config = policy.hf_config

        generator = torch.Generator().manual_seed(0)
        vocab = int(hf_config["vocab_size"])
        responses = [[torch.randint(3, vocab, (12,), generator=generator).tolist() for _ in range(4)] for _ in prompts]
        hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        flat = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
        reference = teacher_forced_logprobs(hf, [p for p, _ in flat], [r for _, r in flat], 1.0)
        generations = [
            [Generation(response_ids=r, logprobs=ref.tolist(), finish_reason="length") for r, ref in zip(rs, refs)]
            for rs, refs in zip(responses, _chunks(reference, 4))
        ]
        batch = collate(rollout_groups(prompts, generations, stage=0), pad_id=0)
        for impl in ("fused", "unfused"):
            ours = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=8, impl=impl)
            errors = torch.cat([(o.cpu() - r.cpu()).abs() for o, r in zip(_rows(ours, batch), reference)])
            check(
                f"Megatron ({impl}) log-probs vs teacher-forced HF forward on {torch.distributed.get_backend()}",
                float(errors.max()) <= TOLERANCE,
                f"mean {float(errors.mean()):.2e} max {float(errors.max()):.2e}",
            )

        before = [p.detach().clone() for chunk in policy.unwrapped() for p in chunk.parameters()]
        metrics = train_step(
            policy,
            batch,
            loss_name="mu_grpo",
            loss_options=AlgoConfig().loss_options(),
            temperature=1.0,
            micro_batch_size=8,
        )
        after = [p for chunk in policy.unwrapped() for p in chunk.parameters()]
        changed = sum(not torch.equal(a, b) for a, b in zip(before, after))
        check(
            "one μ-GRPO update changes the parameters",
            changed > 0 and torch.isfinite(torch.tensor(metrics["train/loss"])).item(),
            f"{changed}/{len(after)} tensors changed, loss {metrics['train/loss']:.4f}",
        )

        exported = {n: t.cpu() for n, t in export_hf(policy.unwrapped(), hf_config, policy.groups)}
        hf.load_state_dict({n: t.to(device) for n, t in exported.items()}, strict=False)
        updated = teacher_forced_logprobs(hf, [p for p, _ in flat], [r for _, r in flat], 1.0)
        ours = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=8, impl="fused")
        errors = torch.cat([(o.cpu() - r.cpu()).abs() for o, r in zip(_rows(ours, batch), updated)])
        check(
            "export_hf round trip of the updated policy",
            float(errors.max()) <= TOLERANCE,
            f"max {float(errors.max()):.2e}",
        )
    torch.distributed.destroy_process_group()
    passed = sum(ok for _, ok in CHECKS)
    print(f"checks={passed}/{len(CHECKS)}")
    return 0 if passed == len(CHECKS) else 1


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _rows(logprobs: torch.Tensor, batch) -> list[torch.Tensor]:
    """Per-response log-prob vectors out of ``forward_logprobs``' [B, T] output, by the batch's response mask."""
    mask = batch.response_mask.bool()
    return [logprobs[i][mask[i].to(logprobs.device)] for i in range(logprobs.shape[0])]


if __name__ == "__main__":
    sys.exit(main())
