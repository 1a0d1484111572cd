"""The `mugrpo` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mugrpo", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    train = sub.add_parser("train", help="run the staged μ-GRPO loop")
    train.add_argument("--config", required=True)
    train.add_argument("--run-dir", required=True)
    train.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from megatron_mugrpo.config import load_config

    load_config(args.config, args.overrides)
    print("mugrpo train: the staged trainer is not yet available (config validated).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
