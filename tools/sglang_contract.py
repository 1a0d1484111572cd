"""Snapshot of the SGLang API this project calls, read from an SGLang wheel's source without importing it.

SGLang cannot be imported on a machine without a CUDA GPU (its torchvision dependency is a CUDA
build), but its wheel is plain Python source. This tool parses that source with ``ast`` and writes a
JSON snapshot of what ``megatron_mugrpo.rollout.sglang_engine`` relies on:

* ``engine``: the signatures of ``sglang.Engine``'s public methods;
* ``server_args``: the fields of ``ServerArgs`` (every keyword ``Engine(...)`` accepts);
* ``sampling_params`` / ``generate_req_input``: the fields of ``SamplingParams`` and ``GenerateReqInput``;
* ``returns``: what each Engine method our engine checks answers (``RETURN_METHODS``), followed from
  ``Engine.X`` to the tokenizer manager's ``X``: ``tuple[N]`` (a tuple whose first item is the success
  flag), ``object[success,message]`` (an ``...Output`` with those fields), ``none``, or ``unknown``;
* ``session``: the weight-update session's rules, read from the scheduler side: which calls are refused
  outside ``begin_weight_update()`` / ``end_weight_update()``, and SGLang's own refusal message of each
  session call (a second begin, an end without begin, an update outside a session);
* ``flags``: behaviours found in the source, each a text probe of a named file (``PROBES`` below):
  whether weight updates need a begin/end session, whether log-probs are taken after the temperature,
  the environment variable that turns that off, whether per-request seeds need deterministic mode, the
  temperature below which SGLang decodes greedily, whether ``Engine.shutdown`` kills every child of
  its caller, whether a ModelOpt FP8 model can be reloaded in place, and what multi-turn trajectories rely
  on (output-only log-probs by default, the radix cache keeping finished requests and bounded by
  ``logprob_start_len``, ``meta_info['cached_tokens']``, how EOS and the length cap finish a request).

The test suite builds a stand-in ``sglang`` module from the checked-in snapshots of the oldest and
newest supported versions (``tests/rollout/sglang_api/``) and runs the engine's whole life cycle
against it. Usage (downloads need the package index; nothing here runs in ``make test``)::

    python tools/sglang_contract.py --wheel sglang-0.5.23-*.whl          # print a snapshot
    python tools/sglang_contract.py --write 0.5.23                        # download, write the snapshot
    python tools/sglang_contract.py --check 0.5.24                        # diff a version against ours

``--check VERSION`` compares VERSION's snapshot with the newest checked-in one and exits 1 when they
differ: run it before moving the ``sglang`` pin in ``setup.py``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

SNAPSHOT_DIR = Path(__file__).resolve().parent.parent / "tests" / "rollout" / "sglang_api"
SNAPSHOT_FORMAT = 1

ENGINE_FILE = "sglang/srt/entrypoints/engine.py"
SERVER_ARGS_FILE = "sglang/srt/server_args.py"
SAMPLING_PARAMS_FILE = "sglang/srt/sampling/sampling_params.py"
IO_STRUCT_FILE = "sglang/srt/managers/io_struct.py"
MANAGERS_DIR = "sglang/srt/managers/"
RETURN_METHODS = (
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_tensor",
    "update_weights_from_disk",
    "flush_cache",
    "release_memory_occupation",
    "resume_memory_occupation",
)
"""Engine methods whose answers ``sglang_engine`` reads (``_check_ok``) or ignores."""
NAMESPACE_FIELDS_DIR = "sglang/srt/arg_groups/fields/"
"""From 0.5.20 ``ServerArgs`` declares no field itself: it collects them from the classes in these
files that carry ``_NS_PATH`` (``arg_groups/fields/__init__.py::collect_input_fields``)."""


@dataclass(frozen=True)
class Probe:
    """One behaviour flag: does ``pattern`` (a regular expression) occur in one of ``files``?"""

    files: tuple[str, ...]
    """Paths inside the wheel; a directory path ending in '/' covers every .py file under it."""
    pattern: str
    meaning: str


PROBES: dict[str, Probe] = {
    "weight_update_session": Probe(
        ("sglang/srt/managers/",),
        r"must run between\s*\"?\s*\"?begin_weight_update\(\)",
        "update_weights_from_tensor/_distributed are refused outside begin_weight_update()/end_weight_update()",
    ),
    "logprobs_after_temperature": Probe(
        ("sglang/srt/layers/sampler.py",),
        r"logits\.div_\(sampling_info\.temperatures\)",
        "returned log-probs are log_softmax(logits / T)",
    ),
    "original_logprob_env": Probe(
        ("sglang/srt/layers/sampler.py",),
        r"SGLANG_RETURN_ORIGINAL_LOGPROB",
        "the environment variable SGLANG_RETURN_ORIGINAL_LOGPROB makes log-probs ignore the temperature",
    ),
    "seed_needs_deterministic": Probe(
        ("sglang/srt/sampling/sampling_batch_info.py",),
        r"sampling_seed[\s\S]{0,600}if enable_deterministic",
        "a request's sampling_seed is used only with enable_deterministic_inference",
    ),
    "shutdown_kills_children": Probe(
        (ENGINE_FILE,),
        r"kill_process_tree\(os\.getpid\(\), include_parent=False",
        "Engine.shutdown() kills every child process of the calling process",
    ),
    "modelopt_fp8_transposes_weight": Probe(
        ("sglang/srt/layers/quantization/modelopt_quant.py",),
        r"layer\.weight = Parameter\(quantized_weight\.t\(\)",
        "ModelOpt FP8 layers replace their weight by a transposed parameter without a weight loader after "
        "the first load: a ModelOpt FP8 model cannot be reloaded in place",
    ),
    # What multi-turn trajectories rely on (``SGLangEngine.generate_trajectories``): each turn is a request over
    # the whole token prefix, with output log-probs only, so the radix cache can serve the earlier turns.
    "output_logprobs_only_by_default": Probe(
        ("sglang/srt/managers/scheduler.py",),
        r"if recv_req\.return_logprob and recv_req\.token_ids_logprob is None:[\s\S]{0,300}?"
        r"req\.logprob_start_len = len\(req\.origin_input_ids\)",
        "return_logprob without logprob_start_len returns the output tokens' log-probs only (none of the prompt's)",
    ),
    "prefix_match_bounded_by_logprob_start": Probe(
        ("sglang/srt/managers/schedule_batch.py",),
        r"if self\.return_logprob and self\.logprob_start_len >= 0:\s*"
        r"max_prefix_len = min\(max_prefix_len, self\.logprob_start_len\)",
        "the radix-cache prefix match stops at logprob_start_len (and at the input's last token): asking for "
        "the prompt's log-probs would recompute it",
    ),
    "finished_requests_cached": Probe(
        ("sglang/srt/mem_cache/",),
        r"req\.origin_input_ids \+ req\.output_ids",
        "a finished request's input and output tokens go into the radix cache (the next turn's prefix hits them)",
    ),
    "cached_tokens_reported": Probe(
        ("sglang/srt/managers/tokenizer_manager.py",),
        r"\"cached_tokens\": recv_obj\.cached_tokens\[i\]",
        "meta_info['cached_tokens'] counts the prompt tokens served from the radix cache",
    ),
    "eos_finish_names_token": Probe(
        ("sglang/srt/managers/schedule_batch.py",),
        r"class FINISH_MATCHED_TOKEN\b[\s\S]{0,300}?\"type\": \"stop\",[^\n]*\n\s*\"matched\": self\.matched",
        "a request ended by an EOS / stop token finishes as {'type': 'stop', 'matched': <token id>} (a stop "
        "string as {'type': 'stop', 'matched': <str>})",
    ),
    "eos_at_cap_finishes_as_length": Probe(
        ("sglang/srt/managers/schedule_batch.py",),
        r"if len\(self\.output_ids\) >= self\.sampling_params\.max_new_tokens:\s*"
        r"self\.finished_reason = FINISH_LENGTH\([\s\S]{0,400}?new_accepted_tokens = self\.output_ids",
        "the length cap is checked before EOS: an EOS sampled as the last allowed token finishes as 'length' "
        "(later versions check EOS first and say 'stop')",
    ),
    "deterministic_may_disable_radix_cache": Probe(
        ("sglang/srt/server_args.py", "sglang/srt/arg_groups/"),
        r"radix cache is not compatible with \{[a-z_.]+\} attention backend for deterministic inference",
        "deterministic inference turns the radix cache off with attention backends that do not support both "
        "(each multi-turn turn then prefills its whole prefix)",
    ),
    "request_below_context_length": Probe(
        ("sglang/srt/managers/tokenizer_manager.py",),
        r"\(max_new_tokens \+ input_token_num\) >= _max_req_len",
        "a request whose input + max_new_tokens reaches the context length is refused (later versions refuse "
        "only beyond it)",
    ),
    "modelopt_fp8_exact_algo": Probe(
        ("sglang/srt/layers/quantization/modelopt_quant.py",),
        r"quant_method != \"FP8\"",
        "a ModelOpt FP8 checkpoint must declare quant_algo exactly 'FP8' (per-channel schemes are refused)",
    ),
}


# ----------------------------------------------------------------------------------------- reading


def read_sources(wheel: Path) -> dict[str, str]:
    """The wheel's ``sglang/srt`` Python files, path -> text (nothing is imported or executed)."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: archive.read(name).decode("utf-8", errors="replace")
            for name in archive.namelist()
            if name.endswith(".py") and (name.startswith("sglang/srt/") or name == "sglang/version.py")
        }


def _class(tree: ast.Module, name: str, where: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"error: class {name} not found in {where}: the SGLang layout changed; update this tool")


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[dict[str, object]]:
    """A function's parameters (self included) as [{name, kind, default}] in order."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    params: list[dict[str, object]] = [
        {"name": a.arg, "kind": "positional_or_keyword", "default": i >= first_default}
        for i, a in enumerate(positional)
    ]
    if args.vararg is not None:
        params.append({"name": args.vararg.arg, "kind": "var_positional", "default": False})
    params += [
        {"name": a.arg, "kind": "keyword_only", "default": d is not None}
        for a, d in zip(args.kwonlyargs, args.kw_defaults)
    ]
    if args.kwarg is not None:
        params.append({"name": args.kwarg.arg, "kind": "var_keyword", "default": False})
    return params


def engine_methods(source: str) -> dict[str, list[dict[str, object]]]:
    """Public methods of ``class Engine`` (and ``__init__``), name -> parameters."""
    engine = _class(ast.parse(source), "Engine", ENGINE_FILE)
    return {
        node.name: _parameters(node)
        for node in engine.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (not node.name.startswith("_") or node.name == "__init__")
    }


def class_fields(source: str, name: str, where: str) -> dict[str, bool]:
    """Fields of a dataclass-like class, name -> has a default: its ``__init__`` parameters when it
    defines one, else its annotated class attributes."""
    cls = _class(ast.parse(source), name, where)
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return {p["name"]: bool(p["default"]) for p in _parameters(node)[1:] if p["kind"] != "var_keyword"}
    return {
        node.target.id: node.value is not None
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def server_args_fields(sources: dict[str, str]) -> dict[str, bool]:
    """``ServerArgs``'s fields: its own annotated attributes, or (0.5.20+) those of every namespace
    class (one with ``_NS_PATH``) under ``NAMESPACE_FIELDS_DIR``."""
    fields = class_fields(sources[SERVER_ARGS_FILE], "ServerArgs", SERVER_ARGS_FILE)
    if fields:
        return fields
    for path in sorted(p for p in sources if p.startswith(NAMESPACE_FIELDS_DIR)):
        for node in ast.parse(sources[path]).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "_NS_PATH" for t in item.targets)
                for item in node.body
            ):
                fields |= class_fields(sources[path], node.name, path)
    if not fields:
        raise SystemExit(f"error: no ServerArgs field found in {SERVER_ARGS_FILE} or {NAMESPACE_FIELDS_DIR}")
    return fields


def _assigns(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)


def module_constant(source: str, name: str) -> object:
    """The literal value assigned to a module-level ``name`` (None when absent)."""
    for node in ast.parse(source).body:
        if _assigns(node, name):
            return ast.literal_eval(node.value)  # type: ignore[attr-defined]
    return None


def probe(sources: dict[str, str], check: Probe) -> bool:
    texts = [
        text
        for path, text in sources.items()
        if any(path == f or (f.endswith("/") and path.startswith(f)) for f in check.files)
    ]
    return any(re.search(check.pattern, text) for text in texts)


def _functions(sources: dict[str, str], prefix: str) -> dict[str, list[tuple[str, ast.AST]]]:
    """Every function and method under ``prefix``, name -> [(path, node)] (parse errors skipped)."""
    found: dict[str, list[tuple[str, ast.AST]]] = {}
    for path in sorted(p for p in sources if p.startswith(prefix)):
        try:
            tree = ast.parse(sources[path])
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append((path, node))
    return found


def _manager_call(method: ast.AST) -> str | None:
    """The ``self.tokenizer_manager.X`` an Engine method hands its request to."""
    for node in ast.walk(method):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "tokenizer_manager"
        ):
            return node.attr
    return None


def _answer_shape(function: ast.AST, output_fields: dict[str, set[str]]) -> str:
    """What ``function`` returns: tuple literals win over the annotation (0.5.x's update_weights_from_disk
    is annotated Tuple[bool, str] and returns three items)."""
    values = [node.value for node in ast.walk(function) if isinstance(node, ast.Return) and node.value is not None]
    arities = sorted({len(v.elts) for v in values if isinstance(v, ast.Tuple)})
    if arities:
        return f"tuple[{arities[-1]}]"
    returns = getattr(function, "returns", None)
    annotation = ast.unparse(returns) if returns is not None else ""
    match = re.fullmatch(r"(?:typing\.)?[Tt]uple\[(.*)\]", annotation)
    if match:
        return f"tuple[{len(match.group(1).split(','))}]"
    if annotation in output_fields and {"success", "message"} <= output_fields[annotation]:
        return "object[success,message]"
    if annotation == "None" or (not values and returns is None):
        return "none"
    return "unknown"


def answer_shapes(sources: dict[str, str]) -> dict[str, str]:
    """``RETURN_METHODS`` that Engine defines -> the shape of their answer (see the module docstring)."""
    engine_class = _class(ast.parse(sources[ENGINE_FILE]), "Engine", ENGINE_FILE)
    engine = {
        node.name: node for node in engine_class.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    managers = {
        name: [(path, node) for path, node in nodes if "tokenizer" in path.rsplit("/", 1)[-1]]
        for name, nodes in _functions(sources, MANAGERS_DIR).items()
    }
    output_fields = _output_fields(sources.get(IO_STRUCT_FILE, ""))
    shapes = {}
    for name in RETURN_METHODS:
        if name not in engine:
            continue
        target = _manager_call(engine[name])
        candidates = managers.get(target or "", [])
        shapes[name] = _answer_shape(candidates[0][1], output_fields) if candidates else "unknown"
    return shapes


def _output_fields(source: str) -> dict[str, set[str]]:
    """io_struct's classes -> their annotated fields."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    return {
        node.name: {i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def session_rules(sources: dict[str, str]) -> dict[str, object]:
    """The weight-update session as the scheduler enforces it: ``required_by`` (calls refused outside a
    session) and ``refusals`` (call -> SGLang's message when it refuses it for the session's state)."""
    refusals: dict[str, str] = {}
    for name, nodes in _functions(sources, MANAGERS_DIR).items():
        for path, node in nodes:
            if "tokenizer" in path.rsplit("/", 1)[-1] or "_session" not in ast.unparse(node):
                continue
            for branch in ast.walk(node):
                if isinstance(branch, ast.If) and "_session" in ast.unparse(branch.test):
                    message = _returned_message(branch.body)
                    if message is not None:
                        refusals.setdefault(name, message)
                        break
    required = sorted(n for n, m in refusals.items() if re.search(r"must run between\s*begin_weight_update\(\)", m))
    return {"required_by": required, "refusals": dict(sorted(refusals.items()))}


def _returned_message(body: list[ast.stmt]) -> str | None:
    """The ``message=`` string of the first ``return X(success=False, message=...)`` in ``body``."""
    for statement in body:
        if isinstance(statement, ast.Return) and isinstance(statement.value, ast.Call):
            for keyword in statement.value.keywords:
                if keyword.arg == "message" and isinstance(keyword.value, ast.Constant):
                    return str(keyword.value.value)
    return None


def snapshot(wheel: Path) -> dict[str, object]:
    """The JSON-ready snapshot of one wheel."""
    sources = read_sources(wheel)
    for required in (ENGINE_FILE, SERVER_ARGS_FILE, SAMPLING_PARAMS_FILE, IO_STRUCT_FILE):
        if required not in sources:
            raise SystemExit(f"error: {wheel} has no {required}: is it an SGLang wheel?")
    version = module_constant(sources.get("sglang/version.py", ""), "__version__") or _version_from_name(wheel)
    flags: dict[str, object] = {name: probe(sources, check) for name, check in PROBES.items()}
    flags["greedy_temperature_below"] = module_constant(sources[SAMPLING_PARAMS_FILE], "_SAMPLING_EPS")
    return {
        "format": SNAPSHOT_FORMAT,
        "version": version,
        "engine": engine_methods(sources[ENGINE_FILE]),
        "server_args": server_args_fields(sources),
        "sampling_params": class_fields(sources[SAMPLING_PARAMS_FILE], "SamplingParams", SAMPLING_PARAMS_FILE),
        "generate_req_input": class_fields(sources[IO_STRUCT_FILE], "GenerateReqInput", IO_STRUCT_FILE),
        "returns": answer_shapes(sources),
        "session": session_rules(sources),
        "flags": flags,
        "flag_meanings": {name: check.meaning for name, check in PROBES.items()},
    }


def _version_from_name(wheel: Path) -> str:
    match = re.match(r"sglang-([^-]+)-", wheel.name)
    return match.group(1) if match else "unknown"


# ------------------------------------------------------------------------------------------- diff


def diff(old: dict[str, object], new: dict[str, object]) -> list[str]:
    """Human-readable differences between two snapshots (empty: same contract)."""
    lines: list[str] = []
    for section in ("engine", "server_args", "sampling_params", "generate_req_input", "returns", "session", "flags"):
        a, b = old.get(section, {}), new.get(section, {})
        assert isinstance(a, dict) and isinstance(b, dict)
        for key in sorted(set(a) | set(b)):
            if key not in b:
                lines.append(f"{section}.{key}: removed")
            elif key not in a:
                lines.append(f"{section}.{key}: added")
            elif a[key] != b[key] and section == "engine":
                lines.append(f"engine.{key}: {_signature_change(a[key], b[key])}")
            elif a[key] != b[key]:
                lines.append(f"{section}.{key}: {json.dumps(a[key])} -> {json.dumps(b[key])}")
    return lines


def _signature_change(old: list[dict[str, object]], new: list[dict[str, object]]) -> str:
    """'+name' for parameters added, '-name' for removed, '~name' for a changed kind or default."""
    before, after = {p["name"]: p for p in old}, {p["name"]: p for p in new}
    changes = [f"+{n}" for n in after if n not in before] + [f"-{n}" for n in before if n not in after]
    changes += [f"~{n}" for n in after if n in before and after[n] != before[n]]
    return " ".join(changes) or "parameter order changed"


def download(version: str, into: Path) -> Path:
    """``pip download sglang==VERSION --no-deps`` into ``into``; returns the wheel."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "--quiet", "-d", str(into)],
        check=True,
    )
    wheels = sorted(into.glob("sglang-*.whl"))
    if not wheels:
        raise SystemExit(f"error: pip downloaded no wheel of sglang=={version}")
    return wheels[0]


def checked_in() -> list[Path]:
    return sorted(SNAPSHOT_DIR.glob("*.json"), key=lambda p: tuple(int(x) for x in re.findall(r"\d+", p.stem)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--wheel", type=Path, help="print the snapshot of a local SGLang wheel")
    group.add_argument("--write", metavar="VERSION", help="download VERSION and write its snapshot here")
    group.add_argument("--check", metavar="VERSION", help="download VERSION and diff it against the newest snapshot")
    args = parser.parse_args(argv)
    if args.wheel is not None:
        print(json.dumps(snapshot(args.wheel), indent=1, sort_keys=True))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        data = snapshot(download(args.write or args.check, Path(tmp)))
    if args.write:
        SNAPSHOT_DIR.mkdir(parents=True, exist_ok=True)
        target = SNAPSHOT_DIR / f"{args.write}.json"
        target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {target}")
        return 0
    known = checked_in()
    if not known:
        raise SystemExit(f"error: no snapshot in {SNAPSHOT_DIR}")
    changes = diff(json.loads(known[-1].read_text()), data)
    for line in changes:
        print(line)
    print(f"sglang {args.check} vs {known[-1].stem}: {len(changes)} difference(s)")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main())
