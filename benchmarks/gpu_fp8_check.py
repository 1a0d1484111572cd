"""GPU check of FP8 rollouts: a ModelOpt-quantized policy served by SGLang, against the fake-quant model.

    pip install 'megatron_mugrpo[sglang,fp8]'
    python benchmarks/gpu_fp8_check.py                # exits non-zero if a check fails

On one CUDA GPU (FP8 needs compute capability >= 8.9), with a randomly initialised Qwen2 (default
hidden 2048, 8 layers, vocabulary 32,000; no tokenizer: SGLang runs with skip_tokenizer_init):

1. the weights go through the project's SGLang FP8 path (``rollout.quantization.load_behaviour_policy``
   with engine 'sglang': bf16 copy → ModelOpt ``fp8`` → checkpoint written atomically → SGLang);
2. SGLang samples responses; its stored log-probs are compared with a teacher-forced pass of the
   fake-quant model (the same quantization, folded, in transformers) and with the bf16 original.
   Check: SGLang FP8 is closer to the fake-quant model than to the bf16 original (it serves the
   quantized policy, up to kernel differences and SGLang re-quantizing fused q/k/v and gate/up to
   one scale);
3. a second stage: SGLang cannot reload an FP8 model in place, so the first engine is shut down
   and a new one serves the second stage's checkpoint; check: the log-probs follow the new weights;
4. decode throughput of SGLang FP8 vs SGLang bf16 on the same prompts (EOS ignored).

Without CUDA, SGLang or ModelOpt it prints a line and exits 0 (the CPU tests cover the transformers
path, and ``tests/rollout/test_sglang_contract.py`` these calls against SGLang's API snapshots).
Last line: ``checks=<passed>/<total> fp8_vs_bf16_decode=<tokens/s ratio>``.
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

CHECKS: list[tuple[str, bool]] = []


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=64, help="prompts for the log-prob comparison")
    parser.add_argument("--decode-rows", type=int, default=256, help="rows of the throughput measurement")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--mem-fraction", type=float, default=0.35)
    return parser.parse_args()


def build_model_dir(path: Path, args: argparse.Namespace, seed: int = 0) -> None:
    """A random bf16 Qwen2 with a sharpened output layer (so sampled tokens are not uniform noise)."""
    from megatron_mugrpo.training.tiny import tiny_hf_dir

    tiny_hf_dir(
        path,
        seed=seed,
        dtype=torch.bfloat16,
        tokenizer=False,
        adjust=lambda model: model.lm_head.weight.mul_(3.0),
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden) // 256 * 256,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512),
        max_position_embeddings=4096,
        eos_token_id=0,
    )


def hf_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def fake_quant_model(path: Path, tensors, calibration, scheme):
    """The transformers-engine behaviour policy of the same weights: fake quant, folded, on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_mugrpo.rollout.quantization import fold_weights, quantize_model
    from megatron_mugrpo.rollout.transformers_engine import copy_weights

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    copy_weights(model, tensors)
    quantize_model(model, scheme, calibration)
    fold_weights(model)
    return model


@torch.no_grad()
def teacher_forced(model, prompts, responses) -> torch.Tensor:
    from megatron_mugrpo.rollout.transformers_engine import teacher_forced_logprobs

    return torch.cat(teacher_forced_logprobs(model, prompts, responses, 1.0)).double()


def sample(engine, prompts, max_new_tokens: int):
    from megatron_mugrpo.rollout.engine import SamplingParams

    groups = engine.generate(prompts, 1, SamplingParams(max_new_tokens=max_new_tokens, seed=0))
    gens = [g[0] for g in groups]
    return [g.response_ids for g in gens], torch.cat([torch.tensor(g.logprobs, dtype=torch.float64) for g in gens])


def decode_tokens_per_s(engine, prompts, tokens: int) -> float:
    """Generated tokens per second for one batch (EOS ignored, so every row makes ``tokens``)."""
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": tokens, "ignore_eos": True}
    engine._engine.generate(input_ids=prompts[:8], sampling_params=params)  # warm-up
    start = time.perf_counter()
    outputs = engine._engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    return sum(o["meta_info"]["completion_tokens"] for o in outputs) / seconds


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU tests cover the transformers FP8 path)")
        return 0
    for module, extra in (("sglang", "sglang"), ("modelopt", "fp8")):
        if importlib.util.find_spec(module) is None:
            print(f"{module} is not installed (pip install 'megatron_mugrpo[{extra}]'): nothing to check")
            return 0
    args = parse_args()
    from megatron_mugrpo.rollout.quantization import BehaviourQuantizer, load_behaviour_policy, quantization_scheme
    from megatron_mugrpo.rollout.sglang_engine import SGLangEngine

    print(f"device={torch.cuda.get_device_name()} capability={torch.cuda.get_device_capability()}", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, args.vocab, (int(n),), generator=gen).tolist() for n in torch.randint(8, 64, (512,))]
    calibration = prompts[:128]
    scheme = quantization_scheme("fp8")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_model_dir(root / "bf16", args, seed=0)
        build_model_dir(root / "bf16_next", args, seed=1)
        quantizer = BehaviourQuantizer(scheme=scheme, calibration=calibration, batch_size=32, export_dir=root / "fp8")

        def build(path: str) -> SGLangEngine:
            return SGLangEngine(
                path, mem_fraction_static=args.mem_fraction, skip_tokenizer_init=True, enable_memory_saver=False
            )

        tensors = hf_tensors(root / "bf16")
        engine = load_behaviour_policy(
            None, tensors, engine_name="sglang", hf_dir=root / "bf16", build=build, quantizer=quantizer
        )
        check("quantized checkpoint written", (root / "fp8" / "hf_quant_config.json").is_file(), str(root / "fp8"))
        responses, served = sample(engine, prompts[: args.prompts], 64)
        fake = fake_quant_model(root / "bf16", tensors, calibration, scheme)
        vs_fake = (served - teacher_forced(fake, prompts[: args.prompts], responses)).abs()
        del fake
        from transformers import AutoModelForCausalLM

        original = AutoModelForCausalLM.from_pretrained(str(root / "bf16"), dtype=torch.bfloat16).cuda().eval()
        vs_bf16 = (served - teacher_forced(original, prompts[: args.prompts], responses)).abs()
        del original
        print(
            f"SGLang FP8 vs fake-quant: |dlogp| mean {vs_fake.mean():.4f} max {vs_fake.max():.4f}; "
            f"vs bf16 original: mean {vs_bf16.mean():.4f} max {vs_bf16.max():.4f} ({vs_fake.numel()} tokens)"
        )
        check(
            "SGLang FP8 serves the quantized policy",
            bool(vs_fake.mean() < vs_bf16.mean()),
            f"mean |dlogp| to fake-quant {vs_fake.mean():.4f} < to bf16 {vs_bf16.mean():.4f}",
        )

        next_tensors = hf_tensors(root / "bf16_next")
        engine = load_behaviour_policy(
            engine, next_tensors, engine_name="sglang", hf_dir=root / "bf16", build=build, quantizer=quantizer
        )
        responses, served = sample(engine, prompts[: args.prompts], 32)
        fake = fake_quant_model(root / "bf16", next_tensors, calibration, scheme)
        reloaded = (served - teacher_forced(fake, prompts[: args.prompts], responses)).abs().mean()
        del fake
        check(
            "next stage: a new engine on the new checkpoint serves the new policy",
            bool(reloaded <= 2 * vs_fake.mean() + 1e-3),
            f"mean |dlogp| to the new fake-quant {reloaded:.4f}",
        )
        results["fp8"] = decode_tokens_per_s(engine, prompts[: args.decode_rows], args.decode_tokens)
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()

        bf16 = build(str(root / "bf16"))
        responses, served = sample(bf16, prompts[: args.prompts], 64)
        original = AutoModelForCausalLM.from_pretrained(str(root / "bf16"), dtype=torch.bfloat16).cuda().eval()
        baseline = (served - teacher_forced(original, prompts[: args.prompts], responses)).abs()
        del original
        noise = f"|dlogp| mean {baseline.mean():.4f} max {baseline.max():.4f}"
        print(f"SGLang bf16 vs transformers bf16 (kernel noise): {noise}")
        results["bf16"] = decode_tokens_per_s(bf16, prompts[: args.decode_rows], args.decode_tokens)
        bf16.shutdown()
    ratio = results["fp8"] / results["bf16"]
    print(
        f"decode tokens/s ({args.decode_rows} rows x {args.decode_tokens} tokens): "
        f"fp8 {results['fp8']:.0f}, bf16 {results['bf16']:.0f}"
    )
    passed = sum(ok for _, ok in CHECKS)
    print(f"checks={passed}/{len(CHECKS)} fp8_vs_bf16_decode={ratio:.2f}")
    return 0 if passed == len(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
