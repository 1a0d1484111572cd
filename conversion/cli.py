"""``mugrpo convert``: Hugging Face <-> Megatron checkpoints with TP/PP/EP resharding, and a numeric check.

    mugrpo convert hf-to-megatron --hf-dir D --out O --tp 2 --pp 2
    mugrpo convert megatron-to-hf --ckpt O --out D2
    mugrpo convert verify --hf-dir D --ckpt O --tp 2 --pp 2

--ep N (mixture-of-experts models) spawns TP × PP × N ranks, each holding E / N experts of every MoE
layer, so a large MoE converts with 1/N of its expert memory per rank; N must divide num_experts.
With --tp T > 1 a MoE model runs sequence-parallel (megatron-core requires it), so verify's
--seq-len must be a multiple of T.

Also runnable as ``python -m megatron_mugrpo.conversion.cli convert ...``. Bad input prints one ``error:`` line and
exits with status 2; a failed ``verify`` exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2


def _add_parallel_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size {what} (default 1)")
    parser.add_argument("--pp", type=int, default=1, help=f"pipeline-parallel size {what} (default 1)")
    parser.add_argument(
        "--ep", type=int, default=1, help=f"expert-parallel size {what} (MoE only: divides the experts; default 1)"
    )


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``convert`` verb (sub-verbs hf-to-megatron, megatron-to-hf, verify) to ``subparsers``."""
    convert = subparsers.add_parser(
        "convert",
        help="convert checkpoints between Hugging Face and Megatron",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = convert.add_subparsers(dest="convert_verb", required=True)

    to_mg = verbs.add_parser(
        "hf-to-megatron", help="HF directory -> Megatron dist checkpoint (root with step_00000000)"
    )
    to_mg.add_argument("--hf-dir", required=True, help="local Hugging Face directory (config.json + safetensors)")
    to_mg.add_argument("--out", required=True, help="new checkpoint root (must not exist or be empty)")
    _add_parallel_args(to_mg, "to convert at; the result loads at any TP/PP/EP")
    to_mg.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype (default: the checkpoint's torch_dtype, else float32)",
    )

    to_hf = verbs.add_parser("megatron-to-hf", help="Megatron checkpoint -> HF directory (safetensors + config)")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint root (follows 'latest') or step directory")
    to_hf.add_argument("--out", required=True, help="new HF directory (must not exist or be empty)")
    _add_parallel_args(to_hf, "to load the checkpoint at")
    to_hf.add_argument(
        "--tokenizer-dir",
        default=None,
        help="copy tokenizer files from here (default: the tokenizer/ saved by hf-to-megatron, or the base model "
        "of the run the checkpoint belongs to)",
    )

    check = verbs.add_parser("verify", help="compare Megatron and transformers logits on random tokens")
    check.add_argument("--hf-dir", required=True, help="the Hugging Face directory (reference model)")
    check.add_argument("--ckpt", required=True, help="checkpoint root or step directory to check")
    _add_parallel_args(check, "to run the Megatron model at")
    check.add_argument("--batch", type=int, default=2, help="random sequences (default 2)")
    check.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    check.add_argument("--atol", type=float, default=None, help="max |logit difference| accepted (default 1e-3)")
    check.add_argument("--kl-tol", type=float, default=None, help="mean KL accepted (default 1e-5)")
    return convert


def run_convert(args: argparse.Namespace) -> int:
    """Run a parsed ``convert`` command; returns the process exit status."""
    from megatron_mugrpo.errors import InputError

    try:
        check_arguments(args)
        return _dispatch(args)
    except InputError as err:  # conversion, checkpoint or config input: one line; anything else is a bug
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def check_arguments(args: argparse.Namespace) -> None:
    """Numeric arguments in range, before anything is read, spawned or written."""
    from megatron_mugrpo.conversion.errors import ConversionError

    at_least_one = ("tp", "pp", "ep", "batch", "seq_len")
    for name in at_least_one:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConversionError(f"--{name.replace('_', '-')} {value}: must be a positive integer")
    for name in ("atol", "kl_tol"):
        value = getattr(args, name, None)
        if value is not None and not value >= 0:
            raise ConversionError(f"--{name.replace('_', '-')} {value}: must be >= 0")
    tokenizer_dir = getattr(args, "tokenizer_dir", None)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ConversionError(f"--tokenizer-dir {tokenizer_dir} is not a directory")


def _dispatch(args: argparse.Namespace) -> int:
    import megatron_mugrpo.conversion.convert as convert
    import megatron_mugrpo.conversion.verify as verify
    from megatron_mugrpo.conversion.hf_io import TOKENIZER_FILES

    if args.convert_verb == "hf-to-megatron":
        step_dir = convert.hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype)
        print(f"wrote {step_dir} (converted at tp={args.tp} pp={args.pp} ep={args.ep})")
        return EXIT_OK
    if args.convert_verb == "megatron-to-hf":
        out = convert.megatron_to_hf(
            args.ckpt, args.out, tp=args.tp, pp=args.pp, ep=args.ep, tokenizer_dir=args.tokenizer_dir
        )
        print(f"wrote {out}")
        if not any((out / name).is_file() for name in TOKENIZER_FILES):
            print(
                f"note: {out} has no tokenizer files: none were found next to the checkpoint or in the model the "
                "run started from. Copy them from that model (its Hugging Face directory) or rerun with "
                "--tokenizer-dir DIR",
                file=sys.stderr,
            )
        return EXIT_OK
    result = verify.verify(
        args.hf_dir,
        args.ckpt,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        batch=args.batch,
        seq_len=args.seq_len,
        seed=args.seed,
        atol=verify.DEFAULT_ATOL if args.atol is None else args.atol,
        kl_tol=verify.DEFAULT_KL_TOL if args.kl_tol is None else args.kl_tol,
    )
    sizes = f"tp={args.tp} pp={args.pp} ep={args.ep}"
    print(f"verify {sizes}: {result.line()} (atol={result.atol:g} kl_tol={result.kl_tol:g})")
    return EXIT_OK if result.ok else EXIT_VERIFY_FAILED


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_mugrpo.conversion.cli convert ...``: the same verbs as ``mugrpo convert``."""
    parser = argparse.ArgumentParser(prog="python -m megatron_mugrpo.conversion.cli")
    add_convert_parser(parser.add_subparsers(dest="verb", required=True))
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
