"""FP8 behaviour policy vs the original: per-token log-prob mismatch, KL and generation time.

For every quantization scheme this machine can run (rollout.quantization), the model's weights
are quantized with ModelOpt and folded exactly as the transformers rollout engine does it each
stage (``rollout.quantization.load_behaviour_policy``). The quantized engine samples a batch of
responses; the original model scores them teacher forced; printed per scheme:

* |Δ log-prob| max and mean over the sampled tokens (log β_fp8 − log π, what the first-update
  check sees) and ``kl_k3``, the sampled-token KL(β ‖ π) estimate logged as rollout/mismatch_kl;
* ``kl_exact``: the full-vocabulary KL(β ‖ π) averaged over the same positions (float64);
* the time of one generation batch with the original and with the folded quantized weights
  (best of --repeats, EOS disabled so both generate exactly the same number of tokens);
* ``engine-recompute``: max |stored − teacher-forced| log-prob of the quantized model itself. It is
  ~1e-6 except on rare tokens where a float32 rounding difference between the batched, left-padded
  decode and the one-sequence recompute moves an activation across an FP8 rounding boundary (a
  jump of one FP8 step). The stored values are the engine's actual sampling distribution.

    python benchmarks/fp8_rollout.py                       # warm-started demo model, CPU, ~2 minutes
    python benchmarks/fp8_rollout.py --hf-dir /models/SmolLM2-135M --batch 32

Without --hf-dir the demo's tiny model is built and warm-started locally (nothing is downloaded).
Needs the ``fp8`` extra (NVIDIA Model Optimizer).
Last line: ``mismatch_kl=<fp8> logprob_abs_mean=<fp8> time_ratio=<original / fp8-folded>``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import best_time, prompt_pool
from transformers import AutoTokenizer

from megatron_mugrpo.algorithms.rollout_correction import mismatch_metrics
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.quantization import (
    BehaviourQuantizer,
    QuantizationError,
    available_schemes,
    check_scheme_usable,
    load_behaviour_policy,
    quantization_scheme,
)
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine

HEADLINE_SCHEME = "fp8"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", default="", help="local Hugging Face model (default: build the demo model)")
    parser.add_argument("--warmstart-steps", type=int, default=300, help="warm-start of the built demo model")
    parser.add_argument("--batch", type=int, default=64, help="rows (prompts x 1 response) per generation batch")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--calibration-prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="best of N generation timings (noise)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return parser.parse_args()


def demo_model(target: Path, steps: int) -> Path:
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    config = Path(__file__).resolve().parent.parent / "configs" / "demo_cpu.yaml"
    return prepare_base_model(load_config(config, [f"warmstart.steps={steps}"]), target)


def timed_generate(engine: TransformersEngine, prompts: list[list[int]], params: SamplingParams, repeats: int):
    """(generations of the last run, best wall seconds over ``repeats`` runs)."""
    cuda = engine.device.type == "cuda"
    best, groups = best_time(lambda: engine.generate(prompts, 1, params), repeats, cuda=cuda)
    return [g[0] for g in groups], best


@torch.no_grad()
def score(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
    """float64 log-softmax rows [T, V] of ``model`` at each response position (teacher forced)."""
    device = next(model.parameters()).device
    out = []
    for prompt, response in zip(prompts, responses):
        seq = torch.tensor([prompt + response], device=device)
        out.append(model(input_ids=seq).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1).cpu())
    return out


def compare(quantized, original, prompts, gens) -> dict[str, float]:
    """Mismatch of the quantized engine's samples against the original model (module docstring)."""
    responses = [g.response_ids for g in gens]
    beta, pi = score(quantized, prompts, responses), score(original, prompts, responses)
    b = torch.cat([torch.tensor(g.logprobs, dtype=torch.float64) for g in gens])
    p = torch.cat([rows.gather(1, torch.tensor(r)[:, None]).squeeze(1) for rows, r in zip(pi, responses)])
    stored_vs_recompute = max(
        float(
            (torch.tensor(g.logprobs, dtype=torch.float64) - rows.gather(1, torch.tensor(r)[:, None]).squeeze(1))
            .abs()
            .max()
        )
        for g, rows, r in zip(gens, beta, responses)
    )
    sampled = mismatch_metrics(b[None], p[None], torch.ones(1, b.numel(), dtype=torch.bool))
    kl_exact = torch.cat([(lb.exp() * (lb - lp)).sum(-1) for lb, lp in zip(beta, pi)]).mean()
    return {
        "abs_max": sampled["mismatch_logprob_abs_max"],
        "abs_mean": sampled["mismatch_logprob_abs_mean"],
        "kl_k3": sampled["mismatch_kl"],
        "kl_exact": float(kl_exact),
        "tokens": sampled["mismatch_tokens"],
        "engine_vs_recompute": stored_vs_recompute,
    }


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(args.hf_dir) if args.hf_dir else demo_model(Path(tmp) / "demo", args.warmstart_steps)
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        pool = prompt_pool(max(args.batch, args.calibration_prompts), task="addition", tokenizer=tokenizer)
        prompts, calibration = pool[: args.batch], pool[: args.calibration_prompts]
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)

        def build(path: str) -> TransformersEngine:
            return TransformersEngine(
                path, dtype="float32", device=args.device, batch_size=args.batch, eos_token_ids=[]
            )

        original = build(str(hf_dir))
        tensors = [(n, p.detach().clone()) for n, p in original.model.named_parameters()]
        timed_generate(original, prompts, params, 1)  # warm-up
        _, t_original = timed_generate(original, prompts, params, args.repeats)
        print(
            f"model={hf_dir if args.hf_dir else 'demo (warm-started)'} device={args.device} "
            f"threads={torch.get_num_threads()} batch={args.batch} max_new_tokens={args.max_new_tokens} "
            f"calibration_prompts={len(calibration)}"
        )
        print(f"original: generation batch {t_original:.3f}s (best of {args.repeats})")
        print(
            f"{'scheme':>16} {'|dlogp| max':>12} {'|dlogp| mean':>13} {'kl_k3':>9} {'kl_exact':>9} "
            f"{'tokens':>7} {'t_gen s':>8} {'orig/fp8':>9} {'engine-recompute':>17}"
        )
        results = {}
        for name in available_schemes()[1:]:
            scheme = quantization_scheme(name)
            try:
                check_scheme_usable(scheme)
            except QuantizationError as exc:
                print(f"{name:>16} skipped: {exc}")
                continue
            quantizer = BehaviourQuantizer(scheme=scheme, calibration=calibration, batch_size=32, export_dir=Path(tmp))
            engine = load_behaviour_policy(
                None, tensors, engine_name="transformers", hf_dir=hf_dir, build=build, quantizer=quantizer
            )
            timed_generate(engine, prompts, params, 1)  # warm-up
            gens, seconds = timed_generate(engine, prompts, params, args.repeats)
            row = compare(engine.model, original.model, prompts, gens) | {"seconds": seconds}
            results[name] = row
            print(
                f"{name:>16} {row['abs_max']:>12.4f} {row['abs_mean']:>13.4f} {row['kl_k3']:>9.2e} "
                f"{row['kl_exact']:>9.2e} {int(row['tokens']):>7} {seconds:>8.3f} {t_original / seconds:>9.2f} "
                f"{row['engine_vs_recompute']:>17.2e}"
            )
            engine.release()
    head = results[HEADLINE_SCHEME]
    print(
        f"mismatch_kl={head['kl_k3']:.3g} logprob_abs_mean={head['abs_mean']:.3g} "
        f"time_ratio={t_original / head['seconds']:.2f}"
    )


if __name__ == "__main__":
    main()
