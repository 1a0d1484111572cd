"""A stand-in ``sglang`` module built from a checked-in API snapshot (``tools/sglang_contract.py``).

SGLang cannot be imported without a CUDA GPU, so the suite checks *our calls* against what its
source says instead: the stand-in's ``Engine``

* accepts exactly the snapshot's ``ServerArgs`` fields (an unknown keyword is a TypeError, as the
  real dataclass raises);
* defines exactly the snapshot's public methods (a method of another version is an AttributeError)
  and binds every call against the real signature;
* keeps the weight-update session by the snapshot's ``session`` rules, read from SGLang's scheduler: the
  calls it lists in ``required_by`` are refused outside ``begin_weight_update()`` /
  ``end_weight_update()``, a second begin and an end without begin are refused, each with SGLang's own
  message (``refusals``);
* answers every call our engine checks in the shape the snapshot's ``returns`` read from SGLang's source
  (``tuple[N]``: success first; ``object[success,message]``; ``none``), so ``_check_ok`` sees what SGLang
  hands back, not what this file assumes;
* fails the way SGLang does on an in-place reload of a ModelOpt FP8 model;
* honours a request's ``sampling_seed`` only in deterministic mode, decodes greedily with T = 1
  log-probs below the snapshot's greedy temperature, and answers with SGLang's output shape:
  ``{"text", "output_ids", "meta_info": {"output_token_logprobs": [(logprob, id, None)], "finish_reason",
  "cached_tokens", ...}}``;
* finishes a request the way the snapshot's scheduler does: at an EOS id of config.json or
  generation_config.json (``{"type": "stop", "matched": id}``) or at ``max_new_tokens`` (``length``), the
  two in the snapshot's order (``eos_at_cap_finishes_as_length``); it has no tokenizer, so a request with
  stop strings is refused rather than answered as if SGLang ignored them;
* refuses a request whose input + ``max_new_tokens`` does not fit the context length (config.json's
  ``max_position_embeddings`` or the ``context_length`` server argument), as the snapshot's version does;
* keeps a radix cache of finished requests (input and output tokens whose keys and values were computed)
  and reports each request's hit in ``meta_info["cached_tokens"]``: at most the input's length - 1, and no
  further than ``logprob_start_len`` when the prompt's log-probs are asked for (the snapshot's flags);
  weight updates and ``flush_cache`` empty it;
* kills every child process of the caller in ``shutdown()`` (when ``kill_children``), as SGLang does.

Its "model" is a random bigram table per weight version (the logits of the next token depend on the
previous one only): enough to exercise shapes, seeds, the temperature and which context a request
carried (``bigram_logprobs`` recomputes a sequence's log-probs teacher-forced), and nothing more. It is
a test of our calls, never an engine in the main path, and it does not replace a GPU run.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import types
from pathlib import Path
from typing import Any

import torch

SNAPSHOT_DIR = Path(__file__).parent / "sglang_api"


def snapshot_versions() -> list[str]:
    """Versions with a checked-in snapshot, oldest first."""
    paths = sorted(SNAPSHOT_DIR.glob("*.json"), key=lambda p: tuple(int(x) for x in p.stem.split(".")))
    return [p.stem for p in paths]


def load_snapshot(version: str) -> dict[str, Any]:
    return json.loads((SNAPSHOT_DIR / f"{version}.json").read_text())


def _signature(params: list[dict[str, Any]]) -> inspect.Signature:
    kinds = {
        "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
        "keyword_only": inspect.Parameter.KEYWORD_ONLY,
        "var_positional": inspect.Parameter.VAR_POSITIONAL,
        "var_keyword": inspect.Parameter.VAR_KEYWORD,
    }
    return inspect.Signature(
        [
            inspect.Parameter(p["name"], kinds[p["kind"]], default=None if p["default"] else inspect.Parameter.empty)
            for p in params
        ]
    )


class Recorder:
    """What the stand-in engines of one module saw: for assertions in tests."""

    def __init__(self) -> None:
        self.engines: list[Any] = []
        self.calls: list[tuple[int, str, dict[str, Any]]] = []
        """(engine index, method, bound arguments without self) in call order."""
        self.answers: list[Any] = []
        """What each call in ``calls`` returned (None while it ran, or when it raised)."""
        self.fail_bucket: int | None = None
        """Index of the tensor update (0-based, over the module's life) that answers failure."""
        self.tensor_updates = 0
        self.fail_flush = False

    def names(self, engine: int | None = None) -> list[str]:
        return [name for index, name, _ in self.calls if engine is None or index == engine]


class _Behaviour:
    """SGLang's behaviour for the methods our engine calls (others raise NotImplementedError)."""

    snapshot: dict[str, Any]
    recorder: Recorder
    kill_children: bool

    def _start(self, **server_args: Any) -> None:
        fields = self.snapshot["server_args"]
        unknown = sorted(set(server_args) - set(fields))
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {unknown}")
        missing = sorted(name for name, has_default in fields.items() if not has_default and name not in server_args)
        if missing:
            raise TypeError(f"ServerArgs.__init__() missing required arguments {missing}")
        config = json.loads((Path(server_args["model_path"]) / "config.json").read_text())
        self.server_args = server_args
        self.vocab_size = int(config["vocab_size"])
        self.eos_ids = _eos_ids(Path(server_args["model_path"]), config)
        self.context_len = server_args.get("context_length") or config.get("max_position_embeddings")
        self.quantized = (Path(server_args["model_path"]) / "hf_quant_config.json").is_file()
        self.index = len(self.recorder.engines)
        self.recorder.engines.append(self)
        self.session_open = False
        self.released = False
        self.dead = False
        self.version = 0
        self.requests = 0
        self.radix: list[tuple[int, ...]] = []
        """Token sequences whose keys and values the cache holds (finished requests)."""

    # ------------------------------------------------------------------------------- weights

    def _answer(self, method: str, ok: bool, message: str) -> Any:
        """``method``'s answer in the shape the snapshot read from SGLang's source."""
        shape = self.snapshot["returns"].get(method, "unknown")
        if shape.startswith("tuple["):  # (success, message[, num_paused_requests])
            return (ok, message, *[0] * (int(shape[len("tuple[") : -1]) - 2))
        if shape == "object[success,message]":
            return types.SimpleNamespace(success=ok, message=message)
        if shape == "none":
            return None
        raise NotImplementedError(f"the snapshot does not say what Engine.{method} answers ({shape})")

    def _refusal(self, method: str) -> str:
        return self.snapshot["session"]["refusals"][method]

    def begin_weight_update(self, selector: str = "all") -> Any:
        if self.session_open:
            return self._answer("begin_weight_update", False, self._refusal("begin_weight_update"))
        self.session_open = True
        return self._answer("begin_weight_update", True, "Success")

    def end_weight_update(self) -> Any:
        if not self.session_open:
            return self._answer("end_weight_update", False, self._refusal("end_weight_update"))
        self.session_open = False
        return self._answer("end_weight_update", True, "Success")

    def update_weights_from_tensor(self, named_tensors: Any, load_format: Any = None, flush_cache: bool = True):
        answer = functools.partial(self._answer, "update_weights_from_tensor")
        if "update_weights_from_tensor" in self.snapshot["session"]["required_by"] and not self.session_open:
            return answer(False, self._refusal("update_weights_from_tensor"))
        if not isinstance(named_tensors, list) or not all(
            isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in named_tensors
        ):
            raise TypeError("named_tensors must be a list of (name, tensor) pairs")
        if self.quantized:
            raise RuntimeError("ModelOpt FP8 weight has no weight_loader: the scheduler died")
        update, self.recorder.tensor_updates = self.recorder.tensor_updates, self.recorder.tensor_updates + 1
        if self.recorder.fail_bucket == update:
            return answer(False, "Failed to update weights: shape mismatch")
        self.version += 1
        if flush_cache:
            self.radix.clear()
        return answer(True, "Success")

    def update_weights_from_disk(self, model_path: str, load_format: Any = None):
        if self.quantized or (Path(model_path) / "hf_quant_config.json").is_file():
            self.dead = True  # the rollback reloads the same path, fails again, and the scheduler dies
            raise RuntimeError("scheduler died during update_weights_from_disk; SGLang kills the process tree")
        self.version += 1
        self.radix.clear()
        return self._answer("update_weights_from_disk", True, "Succeeded to update model weights.")

    def flush_cache(self) -> Any:
        if not self.recorder.fail_flush:
            self.radix.clear()
        return self._answer("flush_cache", not self.recorder.fail_flush, "flush refused: requests pending")

    def release_memory_occupation(self, tags: Any = None) -> Any:
        assert not self.session_open, "release_memory_occupation during a weight-update session"
        self.released = True
        self.radix.clear()
        return self._answer("release_memory_occupation", True, "")

    def resume_memory_occupation(self, tags: Any = None) -> Any:
        self.released = False
        return self._answer("resume_memory_occupation", True, "")

    def shutdown(self) -> None:
        self.dead = True
        if self.kill_children and self.snapshot["flags"]["shutdown_kills_children"]:
            import psutil

            children = psutil.Process(os.getpid()).children(recursive=True)
            for child in children:
                child.kill()
            _wait_until_dead(children)  # like SGLang: polls until gone or a zombie, never reaps

    # ---------------------------------------------------------------------------- generation

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None, **kwargs: Any):
        if self.dead or self.released:
            raise RuntimeError("generate on a released or shut-down engine")
        single = input_ids and isinstance(input_ids[0], int)
        rows = [input_ids] if single else list(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(rows)
        if len(params) != len(rows):
            raise ValueError(f"{len(params)} sampling_params for {len(rows)} requests")
        start = kwargs.get("logprob_start_len")
        self.logprob_start_len = -1 if start is None else start  # this call's; read by _one
        outputs = [self._one(ids, p, bool(kwargs.get("return_logprob"))) for ids, p in zip(rows, params)]
        return outputs[0] if single else outputs

    def _one(self, ids: list[int], params: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
        unknown = sorted(set(params) - set(self.snapshot["sampling_params"]))
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got unexpected keyword arguments {unknown}")
        if params.get("stop") or params.get("stop_regex"):
            raise NotImplementedError("the stand-in has no tokenizer and cannot match stop strings")
        cap = int(params.get("max_new_tokens", 128))
        self._check_length(len(ids), cap)
        cached = self._prefix_hit(ids, return_logprob, self.logprob_start_len)
        temperature, top_k = float(params.get("temperature", 1.0)), int(params.get("top_k", -1))
        if 0 <= temperature < self.snapshot["flags"]["greedy_temperature_below"]:
            temperature, top_k = 1.0, 1
        seed = params.get("sampling_seed")
        deterministic = self.server_args.get("enable_deterministic_inference", False)
        if seed is None or not (deterministic or not self.snapshot["flags"]["seed_needs_deterministic"]):
            seed = (self.server_args.get("random_seed") or 0) * 1_000_003 + self.requests  # batch dependent
        self.requests += 1
        generator = torch.Generator().manual_seed(int(seed))
        table = torch.log_softmax(bigram_logits(self.vocab_size, self.version) / temperature, dim=-1)
        tokens, pairs, reason = [], [], None
        previous = ids[-1]
        while reason is None:
            logprobs = table[previous]
            token = (
                int(logprobs.argmax()) if top_k == 1 else int(torch.multinomial(logprobs.exp(), 1, generator=generator))
            )
            tokens.append(token)
            pairs.append((float(logprobs[token]), token, None))
            reason = self._finish(tokens, cap, ignore_eos=bool(params.get("ignore_eos")))
            previous = token
        if self.snapshot["flags"]["finished_requests_cached"]:
            self.radix.append(tuple(ids) + tuple(tokens[:-1]))  # the last token was sampled, never fed
        meta = {
            "id": f"req{self.requests}",
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
        }
        if self.snapshot["flags"]["cached_tokens_reported"]:
            meta["cached_tokens"] = cached
        if return_logprob:
            meta["output_token_logprobs"] = pairs
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    def _finish(self, tokens: list[int], cap: int, *, ignore_eos: bool) -> dict[str, Any] | None:
        """The finish reason after ``tokens`` (None: go on), in the snapshot's order of the two checks."""
        eos = not ignore_eos and tokens[-1] in self.eos_ids
        length = len(tokens) >= cap
        if length and (self.snapshot["flags"]["eos_at_cap_finishes_as_length"] or not eos):
            return {"type": "length", "length": cap}
        return {"type": "stop", "matched": tokens[-1]} if eos else None

    def _check_length(self, input_len: int, cap: int) -> None:
        """SGLang's tokenizer manager refuses a request that does not fit the context length (at it, or only
        beyond it, by the snapshot's ``request_below_context_length``)."""
        if self.context_len is None:
            return
        total, limit = input_len + cap, int(self.context_len)
        if total > limit or (total == limit and self.snapshot["flags"]["request_below_context_length"]):
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. You "
                f"requested a total of {total} tokens"
            )

    def _prefix_hit(self, ids: list[int], return_logprob: bool, start: int) -> int:
        """Tokens of ``ids`` the radix cache serves: the longest cached prefix, short of the input's last
        token, and (SGLang's rule) short of ``logprob_start_len`` when the prompt's log-probs are asked for."""
        limit = len(ids) - 1
        if return_logprob and start >= 0 and self.snapshot["flags"]["prefix_match_bounded_by_logprob_start"]:
            limit = min(limit, start)
        best = 0
        for cached in self.radix:
            common = 0
            for a, b in zip(cached, ids[:limit]):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return best


def bigram_logits(vocab_size: int, version: int) -> torch.Tensor:
    """[V, V] the stand-in's logits of the next token (column) after a token (row), at a weight version."""
    return torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(version))


def bigram_logprobs(context: list[int], tokens: list[int], *, vocab_size: int, version: int, temperature: float):
    """Teacher-forced log_softmax(logits / T)[token] of each of ``tokens`` after ``context`` + the tokens before it."""
    table = torch.log_softmax(bigram_logits(vocab_size, version) / temperature, dim=-1)
    previous = [context[-1], *tokens[:-1]]
    return [float(table[p, t]) for p, t in zip(previous, tokens)]


def _eos_ids(model_dir: Path, config: dict[str, Any]) -> set[int]:
    """SGLang's EOS ids of a model (``ModelConfig._get_hf_eos_token_id``): config.json's and
    generation_config.json's ``eos_token_id`` (an int or a list), together."""
    sources = [config]
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()))
    ids: set[int] = set()
    for source in sources:
        eos = source.get("eos_token_id")
        if eos is not None:
            ids |= {int(e) for e in (eos if isinstance(eos, list) else [eos])}
    return ids


def _wait_until_dead(processes: list[Any], timeout_s: float = 30.0) -> None:
    import time

    import psutil

    def dead(process: Any) -> bool:
        try:
            return process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + timeout_s
    while not all(dead(p) for p in processes):
        if time.monotonic() > deadline:
            raise RuntimeError("killed children were not gone in time")
        time.sleep(0.01)


def build_module(snapshot: dict[str, Any], *, kill_children: bool = False) -> types.ModuleType:
    """A module standing in for ``sglang`` at the snapshot's version; ``module.recorder`` saw every call.

    ``kill_children``: ``Engine.shutdown()`` kills every child process of this process, as SGLang's
    does. Off by default inside the pytest process, whose other children belong to other tests.
    """
    recorder = Recorder()
    namespace: dict[str, Any] = {"snapshot": snapshot, "recorder": recorder, "kill_children": kill_children}

    def init(self: Any, **kwargs: Any) -> None:
        _signature(snapshot["engine"]["__init__"]).bind(self, **kwargs)
        self._start(**kwargs)

    namespace["__init__"] = init
    for name, params in snapshot["engine"].items():
        if name != "__init__":
            namespace[name] = _bound(name, _signature(params), getattr(_Behaviour, name, None))
    engine = type("Engine", (_Behaviour,), namespace)
    for name in ("begin_weight_update", "end_weight_update"):  # absent in this version: like the real class
        if name not in snapshot["engine"]:
            setattr(engine, name, _missing(name))
    module = types.ModuleType("sglang")
    module.__version__ = snapshot["version"]
    module.Engine = engine
    module.recorder = recorder
    return module


def _bound(name: str, signature: inspect.Signature, behaviour: Any) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)  # TypeError on a call the real signature refuses
        if self.dead and name != "shutdown":
            raise RuntimeError(f"{name} on an engine that was shut down")
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        call = len(self.recorder.calls)
        self.recorder.calls.append((self.index, name, arguments))
        self.recorder.answers.append(None)
        if behaviour is None:
            raise NotImplementedError(f"the stand-in does not model Engine.{name}")
        answer = self.recorder.answers[call] = behaviour(self, *args, **kwargs)
        return answer

    method.__name__ = name
    return method


class _Missing:
    """A descriptor that makes ``getattr(engine, name)`` raise AttributeError, like a method the version lacks."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance: Any, owner: Any) -> Any:
        raise AttributeError(f"'Engine' object has no attribute '{self.name}'")


def _missing(name: str) -> _Missing:
    return _Missing(name)
