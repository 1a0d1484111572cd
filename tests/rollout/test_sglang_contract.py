"""The SGLang engine's calls against SGLang's own API, on CPU.

Each test runs against a stand-in ``sglang`` module built from the checked-in snapshot of the oldest
and of the newest supported SGLang version (``tests/rollout/sglang_api/``, written by
``tools/sglang_contract.py`` from the wheels' source). The stand-in binds every call against the real
signatures and enforces the behaviours the source shows (see ``sglang_standin``). It checks our
calls; it does not replace a GPU run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from sglang_standin import build_module, load_snapshot, snapshot_versions

from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.rollout import quantization, sglang_engine
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import SamplingParams, build_engine_from_config, engine_kwargs
from megatron_mugrpo.rollout.quantization import BehaviourQuantizer, load_behaviour_policy, quantization_scheme
from megatron_mugrpo.rollout.sglang_engine import (
    QUANT_CONFIG_FILE,
    SUPPORTED_SGLANG,
    SGLangContractError,
    SGLangEngine,
    SGLangEngineConfig,
)

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = snapshot_versions()
VOCAB, EOS = 32, 1
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def _model_dir(path: Path, *, quantized: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": EOS}))
    if quantized:
        (path / QUANT_CONFIG_FILE).write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    return path


@pytest.fixture(params=VERSIONS)
def sglang(request, monkeypatch):
    """The stand-in ``sglang`` of one snapshot, imported by the engine; CUDA reported available."""
    module = build_module(load_snapshot(request.param))
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(sglang_engine.ORIGINAL_LOGPROB_ENV, raising=False)
    return module


def _tensors(count: int = 5) -> list[tuple[str, torch.Tensor]]:
    return [(f"model.layers.{i}.mlp.weight", torch.full((16, 16), float(i))) for i in range(count)]


def test_snapshots_are_the_window_ends():
    """The checked-in snapshots are the oldest and newest versions of setup.py's sglang extra."""
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", SUPPORTED_SGLANG).groups()
    assert VERSIONS[0] == low
    assert tuple(map(int, VERSIONS[-1].split("."))) < tuple(map(int, high.split(".")))
    assert f'"sglang{SUPPORTED_SGLANG}"' in (ROOT / "setup.py").read_text()
    old, new = load_snapshot(VERSIONS[0]), load_snapshot(VERSIONS[-1])
    assert not old["flags"]["weight_update_session"] and new["flags"]["weight_update_session"]  # both sides of 0.5.21
    for snap in (old, new):
        flags = snap["flags"]
        assert flags["logprobs_after_temperature"] and flags["original_logprob_env"]
        assert flags["seed_needs_deterministic"] and flags["shutdown_kills_children"]
        assert flags["modelopt_fp8_transposes_weight"]
        # what the MoE and async issues build on: routed experts and the distributed weight update
        assert "enable_return_routed_experts" in snap["server_args"]
        assert "return_routed_experts" in snap["generate_req_input"]
        assert {"init_weights_update_group", "update_weights_from_distributed"} <= set(snap["engine"])
        assert "sampling_seed" in snap["sampling_params"]


def test_life_cycle(sglang, tmp_path, monkeypatch):
    """Construct, load weights in several buckets, generate, release, reload, generate, shut down."""
    monkeypatch.setattr(sglang_engine, "WEIGHT_BUCKET_BYTES", 2 * 16 * 16 * 4)  # two tensors per bucket
    cfg = RolloutConfig(engine="sglang", sglang=SGLangEngineConfig(mem_fraction_static=0.5))
    engine = build_engine_from_config(cfg, str(_model_dir(tmp_path / "m")), seed=7)
    assert isinstance(engine, SGLangEngine)
    standin = sglang.recorder.engines[0]
    assert standin.server_args["random_seed"] == 7 and standin.server_args["mem_fraction_static"] == 0.5

    engine.load_weights(_tensors(5))
    groups = engine.generate(PROMPTS, 2, PARAMS)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all(g.logprobs and max(g.logprobs) <= 0 for group in groups for g in group)
    engine.release()
    with pytest.raises(RuntimeError, match="no valid weights"):
        engine.generate(PROMPTS, 1, PARAMS)
    engine.load_weights(_tensors(1))  # the next stage: resumes the memory first
    assert len(engine.generate(PROMPTS, [1, 0, 3], PARAMS)[2]) == 3
    engine.shutdown()

    calls = sglang.recorder.calls
    updates = [args for _, name, args in calls if name == "update_weights_from_tensor"]
    assert [len(a["named_tensors"]) for a in updates] == [2, 2, 1, 1]
    assert [a["flush_cache"] for a in updates] == [False, False, True, True]  # one flush per load, at its end
    names = sglang.recorder.names()
    if load_snapshot(sglang.__version__)["flags"]["weight_update_session"]:
        assert names.count("begin_weight_update") == names.count("end_weight_update") == 2
        first = names.index("begin_weight_update")
        assert names[first : first + 5] == [
            "begin_weight_update",
            *["update_weights_from_tensor"] * 3,
            "end_weight_update",
        ]
    else:
        assert "begin_weight_update" not in names
    assert names.index("resume_memory_occupation") > names.index("release_memory_occupation")
    assert names[-1] == "shutdown"


def test_the_session_is_enforced_where_sglang_enforces_it(sglang, tmp_path):
    """Without the session, the newest SGLang refuses the first bucket: what the engine's fix is for."""
    standin = sglang.Engine(model_path=str(_model_dir(tmp_path / "m")))
    ok, message = standin.update_weights_from_tensor(_tensors(1))[:2]
    if load_snapshot(sglang.__version__)["flags"]["weight_update_session"]:
        assert not ok and "begin_weight_update" in message
    else:
        assert ok


def test_a_failed_bucket_closes_the_session_and_invalidates_the_weights(sglang, tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_engine, "WEIGHT_BUCKET_BYTES", 16 * 16 * 4)
    engine = SGLangEngine(_model_dir(tmp_path / "m"))
    sglang.recorder.fail_bucket = 1
    with pytest.raises(RuntimeError, match="shape mismatch"):
        engine.load_weights(_tensors(3))
    assert not sglang.recorder.engines[0].session_open
    with pytest.raises(RuntimeError, match="no valid weights"):
        engine.generate(PROMPTS, 1, PARAMS)
    engine.load_weights(_tensors(3))  # a retry works, in a new session
    assert engine.generate(PROMPTS, 1, PARAMS)


def test_fp8_policy_is_a_new_engine_every_stage(sglang, tmp_path, monkeypatch):
    """Two stages with rollout.quantization=fp8: the second stage shuts the first engine down and
    builds a new one on its own checkpoint; nothing is ever reloaded in place."""
    exported: list[Path] = []

    def fake_export(named_tensors, quantizer, *, hf_dir):  # the GPU-only ModelOpt export
        list(named_tensors)
        path = _model_dir(tmp_path / f"fp8_stage{len(exported)}", quantized=True)
        exported.append(path)
        return path

    monkeypatch.setattr(quantization, "export_behaviour_checkpoint", fake_export)
    quantizer = BehaviourQuantizer(
        scheme=quantization_scheme("fp8"), calibration=[[3, 4]], batch_size=1, export_dir=tmp_path / "fp8"
    )
    base = _model_dir(tmp_path / "base")
    engine = None
    for _stage in range(2):
        engine = load_behaviour_policy(
            engine, _tensors(2), engine_name="sglang", hf_dir=base, build=SGLangEngine, quantizer=quantizer
        )
        assert engine.generate(PROMPTS, 2, PARAMS)
        engine.release()
    engines = sglang.recorder.engines
    assert [e.server_args["model_path"] for e in engines] == [str(p) for p in exported]
    assert engines[0].dead and not engines[1].dead
    assert sglang.recorder.names(0)[-1] == "shutdown"
    assert "update_weights_from_disk" not in sglang.recorder.names()
    assert "update_weights_from_tensor" not in sglang.recorder.names()
    for reload in (lambda: engine.load_hf_dir(str(exported[0])), lambda: engine.load_weights(_tensors(1))):
        with pytest.raises(SGLangContractError, match="cannot reload a ModelOpt FP8 model in place"):
            reload()


def test_unquantized_engine_refuses_a_quantized_directory(sglang, tmp_path):
    engine = SGLangEngine(_model_dir(tmp_path / "m"))
    with pytest.raises(SGLangContractError, match="in place"):
        engine.load_hf_dir(str(_model_dir(tmp_path / "q", quantized=True)))
    engine.load_hf_dir(str(_model_dir(tmp_path / "plain")))
    assert "update_weights_from_disk" in sglang.recorder.names()


def test_deterministic_mode_gives_every_response_its_own_seed(sglang, tmp_path, monkeypatch):
    """rollout.sglang.deterministic: SGLang's deterministic mode, one sampling_seed per response; the
    data then do not depend on how requests were batched. Without it no seed is sent (SGLang ignores it)."""
    engine = SGLangEngine(_model_dir(tmp_path / "m"), deterministic=True)
    assert sglang.recorder.engines[0].server_args["enable_deterministic_inference"] is True
    whole = engine.generate(PROMPTS, 3, PARAMS)
    monkeypatch.setattr(sglang_engine, "REQUEST_CHUNK", 2)
    chunked = engine.generate(PROMPTS, 3, PARAMS)
    assert whole == chunked
    seeds = [
        p["sampling_seed"] for _, name, a in sglang.recorder.calls if name == "generate" for p in a["sampling_params"]
    ]
    assert len(set(seeds[:9])) == 9  # 3 prompts x 3 responses, each its own seed

    plain = SGLangEngine(_model_dir(tmp_path / "p"))
    plain.generate(PROMPTS, 2, PARAMS)
    last = [a for _, name, a in sglang.recorder.calls if name == "generate"][-1]
    assert isinstance(last["sampling_params"], dict) and "sampling_seed" not in last["sampling_params"]
    assert "enable_deterministic_inference" not in sglang.recorder.engines[1].server_args


def test_original_logprob_variable_is_refused(sglang, tmp_path, monkeypatch):
    monkeypatch.setenv(sglang_engine.ORIGINAL_LOGPROB_ENV, "1")
    with pytest.raises(SGLangContractError, match="unset SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangEngine(_model_dir(tmp_path / "m"))
    assert not sglang.recorder.engines  # refused before SGLang starts


def test_flush_cache_result_is_checked(sglang, tmp_path):
    engine = SGLangEngine(_model_dir(tmp_path / "m"), enable_memory_saver=False)
    engine.release()  # without the memory saver: only the KV cache is flushed
    sglang.recorder.fail_flush = True
    with pytest.raises(RuntimeError, match="flush_cache"):
        engine.release()


def test_unknown_server_argument_is_refused_like_sglang(sglang, tmp_path):
    with pytest.raises(TypeError, match="not_a_server_arg"):
        SGLangEngine(_model_dir(tmp_path / "m"), not_a_server_arg=1)


def test_near_greedy_temperatures_are_refused():
    with pytest.raises(ValueError, match="near-greedy"):
        SamplingParams(max_new_tokens=4, temperature=1e-7)
    with pytest.raises(Exception, match="near-greedy"):
        RolloutConfig(temperature=1e-3)


def test_fp8_per_channel_is_refused_with_sglang():
    with pytest.raises(ConfigError, match=r"cannot be served by rollout\.engine=sglang.*\['fp8'"):
        load_config(None, ["rollout.engine=sglang", "rollout.quantization=fp8_per_channel"])
    RolloutConfig(quantization="fp8_per_channel")  # the transformers engine serves it


def test_verify_weights_is_refused_with_sglang():
    with pytest.raises(ConfigError, match=r"async\.verify_weights=true cannot be checked with rollout\.engine=sglang"):
        load_config(None, ["mode=async", "async.verify_weights=true", "rollout.engine=sglang"])


def test_engine_kwargs_carry_the_deterministic_switch():
    cfg = RolloutConfig(engine="sglang", sglang=SGLangEngineConfig(deterministic=True))
    assert engine_kwargs(cfg, seed=1)["deterministic"] is True


SHUTDOWN_ORDER = """
import json, sys
sys.path[:0] = [{root!r}, {here!r}]
import torch
torch.cuda.is_available = lambda: True
from sglang_standin import build_module, load_snapshot
sys.modules["sglang"] = build_module(load_snapshot({version!r}), kill_children=True)
from megatron_mugrpo.rewards.registry import build_reward
from megatron_mugrpo.rollout.sglang_engine import SGLangEngine

reward = build_reward("math", workers=1, timeout_s=30)
reward.start()
before = reward.score(["\\\\boxed{{\\\\frac{{2}}{{4}}}}"], ["1/2"])  # math-verify, not the integer fast path
engine = SGLangEngine({model!r})
engine.shutdown()  # kills every child process of this one, the verifier included
alive = [w.process.is_alive() for w in reward.pool._workers]
after = reward.score(["\\\\boxed{{\\\\frac{{3}}{{6}}}}", "\\\\boxed{{\\\\frac{{1}}{{3}}}}"], ["1/2", "1/4"])
print(json.dumps({{"before": before, "after": after, "alive": alive, "revived": reward.pool.revived}}))
reward.close()
"""


@pytest.mark.parametrize("version", [VERSIONS[-1]])
def test_reward_pool_survives_the_engine_shutdown(version, tmp_path):
    """SGLang's shutdown kills every child of its caller; the verifier pool replaces its dead workers
    at its next use instead of failing. Run in its own process: the kill is real."""
    script = SHUTDOWN_ORDER.format(
        root=str(ROOT), here=str(Path(__file__).parent), version=version, model=str(_model_dir(tmp_path / "m"))
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"][0][0] == 1.0
    assert result["alive"] == [False]  # SGLang's shutdown really killed the verifier
    assert [r[0] for r in result["after"]] == [1.0, 0.0]
    assert result["revived"] == 1


# ------------------------------------------------------------------------------ the snapshot tool


def _fake_wheel(path: Path, *, session: bool) -> Path:
    session_text = (
        'message="update_weights_from_tensor must run between "\n"begin_weight_update() and x"' if session else ""
    )
    files = {
        "sglang/version.py": '__version__ = "9.9.9"\n',
        "sglang/srt/entrypoints/engine.py": textwrap.dedent(
            """
            import os
            class Engine:
                def __init__(self, **kwargs): pass
                def generate(self, prompt=None, input_ids=None, *, cache_salt=None): pass
                def _private(self): pass
                def shutdown(self):
                    kill_process_tree(os.getpid(), include_parent=False)
            """
        ),
        "sglang/srt/server_args.py": "class ServerArgs:\n    model_path: str\n    tp_size: int = 1\n",
        "sglang/srt/sampling/sampling_params.py": textwrap.dedent(
            """
            _SAMPLING_EPS = 1e-6
            class SamplingParams:
                def __init__(self, max_new_tokens=128, temperature=1.0, sampling_seed=None, **kw): pass
            """
        ),
        "sglang/srt/managers/io_struct.py": "class GenerateReqInput:\n    input_ids: list = None\n",
        "sglang/srt/managers/weights.py": session_text,
        "sglang/srt/layers/sampler.py": "logits.div_(sampling_info.temperatures)\n",
    }
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def test_snapshot_tool_reads_a_wheel_without_importing_it(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sglang_contract
    finally:
        sys.path.remove(str(ROOT / "tools"))
    snap = sglang_contract.snapshot(_fake_wheel(tmp_path / "sglang-9.9.9-py3-none-any.whl", session=True))
    assert snap["version"] == "9.9.9"
    assert set(snap["engine"]) == {"__init__", "generate", "shutdown"}
    assert [p["name"] for p in snap["engine"]["generate"]] == ["self", "prompt", "input_ids", "cache_salt"]
    assert snap["engine"]["generate"][-1] == {"name": "cache_salt", "kind": "keyword_only", "default": True}
    assert snap["server_args"] == {"model_path": False, "tp_size": True}
    assert snap["sampling_params"] == {"max_new_tokens": True, "temperature": True, "sampling_seed": True}
    assert snap["generate_req_input"] == {"input_ids": True}
    flags = snap["flags"]
    assert flags["weight_update_session"] and flags["logprobs_after_temperature"] and flags["shutdown_kills_children"]
    assert not flags["original_logprob_env"] and flags["greedy_temperature_below"] == 1e-6
    older = sglang_contract.snapshot(_fake_wheel(tmp_path / "sglang-9.9.8-py3-none-any.whl", session=False))
    assert "flags.weight_update_session: true -> false" in sglang_contract.diff(snap, older)
    assert sglang_contract.diff(snap, snap) == []
