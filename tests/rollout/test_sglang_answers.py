"""What SGLang answers, derived from its source rather than written by hand: the snapshot tool reads the
weight-update session's rules and each checked call's answer shape from a wheel; the stand-in answers
in those shapes and keeps those rules; ``_check_ok`` refuses an answer it does not know instead of
taking it for success."""

from __future__ import annotations

import sys
import textwrap
import types
import zipfile
from pathlib import Path

import pytest
from sglang_standin import build_module, load_snapshot, snapshot_versions

from megatron_mugrpo.rollout.sglang_engine import SGLangContractError, _check_ok

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> types.ModuleType:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sglang_contract
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return sglang_contract


ENGINE = """
class Engine:
    def __init__(self, **kwargs): pass
    def begin_weight_update(self, selector="all"):
        return self.loop.run_until_complete(self.tokenizer_manager.begin_weight_update(obj, None))
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_tensor(obj, None))
    def update_weights_from_disk(self, model_path, load_format=None):
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_disk(obj, None))
    def flush_cache(self):
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())
    def release_memory_occupation(self, tags=None):
        self.loop.run_until_complete(self.tokenizer_manager.release_memory_occupation(obj, None))
"""
TOKENIZER_MIXIN = """
class TokenizerControlMixin:
    async def begin_weight_update(self, obj, request) -> Tuple[bool, str]:
        return await self._session_call(obj)
    async def update_weights_from_tensor(self, obj, request) -> Tuple[bool, str]:
        return success, message
    async def update_weights_from_disk(self, obj, request) -> Tuple[bool, str]:
        return success, message, num_paused_requests
    async def flush_cache(self) -> FlushCacheReqOutput:
        return result
    async def release_memory_occupation(self, obj, request):
        await self.communicator(obj)
"""
SCHEDULER = """
class SchedulerWeightUpdater:
    def begin_weight_update(self, recv_req):
        if self._session is not None:
            return BeginWeightUpdateReqOutput(success=False, message="already open; "
                                              "call end first")
        self._session = object()
    def update_weights_from_tensor(self, recv_req):
        if self._session is None:
            return UpdateWeightsFromTensorReqOutput(success=False, message="update_weights_from_tensor must run "
                                                    "between begin_weight_update() and end_weight_update()")
        return UpdateWeightsFromTensorReqOutput(success=True, message="Success")
"""


def _wheel(path: Path) -> Path:
    files = {
        "sglang/version.py": '__version__ = "9.9.9"\n',
        "sglang/srt/entrypoints/engine.py": ENGINE,
        "sglang/srt/server_args.py": "class ServerArgs:\n    model_path: str\n",
        "sglang/srt/sampling/sampling_params.py": "class SamplingParams:\n    def __init__(self, n=1): pass\n",
        "sglang/srt/managers/io_struct.py": (
            "class GenerateReqInput:\n    input_ids: list = None\n"
            "class FlushCacheReqOutput(BaseReq):\n    success: bool\n    message: str = ''\n"
        ),
        "sglang/srt/managers/tokenizer_control_mixin.py": TOKENIZER_MIXIN,
        "sglang/srt/managers/scheduler_components/weight_updater.py": SCHEDULER,
    }
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, textwrap.dedent(text))
    return path


def test_the_tool_reads_answer_shapes_and_session_rules_from_the_source(tmp_path):
    tool = _tool()
    snap = tool.snapshot(_wheel(tmp_path / "sglang-9.9.9-py3-none-any.whl"))
    assert snap["returns"] == {
        "begin_weight_update": "tuple[2]",  # from the annotation: the body returns another call's answer
        "update_weights_from_tensor": "tuple[2]",
        "update_weights_from_disk": "tuple[3]",  # the literal wins over the annotation, as in SGLang
        "flush_cache": "object[success,message]",
        "release_memory_occupation": "none",
    }
    assert snap["session"] == {
        "required_by": ["update_weights_from_tensor"],
        "refusals": {
            "begin_weight_update": "already open; call end first",
            "update_weights_from_tensor": (
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            ),
        },
    }
    other = {**snap, "session": {"required_by": [], "refusals": {}}}
    assert 'session.required_by: [] -> ["update_weights_from_tensor"]' in tool.diff(other, snap)


def test_the_snapshots_hold_both_sides_of_the_session():
    old, new = (load_snapshot(v) for v in (snapshot_versions()[0], snapshot_versions()[-1]))
    assert old["session"] == {"required_by": [], "refusals": {}}  # 0.5.10: no session
    assert new["session"]["required_by"] == ["update_weights_from_distributed", "update_weights_from_tensor"]
    assert set(new["session"]["refusals"]) >= {"begin_weight_update", "end_weight_update"}
    for snap in (old, new):
        assert snap["returns"]["update_weights_from_disk"] == "tuple[3]"
        assert snap["returns"]["update_weights_from_tensor"] == "tuple[2]"
        assert snap["returns"]["flush_cache"] == "object[success,message]"
        assert "unknown" not in snap["returns"].values()
    assert new["returns"]["begin_weight_update"] == new["returns"]["end_weight_update"] == "tuple[2]"


@pytest.mark.parametrize("version", snapshot_versions())
def test_the_standin_answers_as_its_snapshot_says(version, tmp_path):
    snap = load_snapshot(version)
    (tmp_path / "config.json").write_text('{"vocab_size": 8, "eos_token_id": 1}')
    engine = build_module(snap).Engine(model_path=str(tmp_path))
    assert len(engine.update_weights_from_disk(str(tmp_path))) == 3
    assert engine.flush_cache().success is True
    assert engine.release_memory_occupation() is None
    if not snap["session"]["required_by"]:
        assert engine.update_weights_from_tensor([]) == (True, "Success")
        return
    refused = engine.update_weights_from_tensor([])
    assert refused == (False, snap["session"]["refusals"]["update_weights_from_tensor"])
    assert engine.begin_weight_update() == (True, "Success")
    assert engine.begin_weight_update() == (False, snap["session"]["refusals"]["begin_weight_update"])
    assert engine.update_weights_from_tensor([]) == (True, "Success")
    assert engine.end_weight_update() == (True, "Success")
    assert engine.end_weight_update() == (False, snap["session"]["refusals"]["end_weight_update"])


@pytest.mark.parametrize(
    "answer",
    [None, (), "Success", object(), {"message": "done"}, ("Success", True), types.SimpleNamespace(success=None)],
    ids=["none", "empty-tuple", "string", "object", "dict-without-success", "success-not-first", "success-none"],
)
def test_check_ok_refuses_an_answer_it_does_not_know(answer):
    with pytest.raises(
        SGLangContractError, match=r"SGLang update_weights_from_tensor answered .*tools/sglang_contract"
    ):
        _check_ok(answer, "update_weights_from_tensor")


def test_check_ok_reads_the_answers_sglang_gives():
    _check_ok((True, "Success"), "update_weights_from_tensor")
    _check_ok((True, "Succeeded to update model weights.", 0), "update_weights_from_disk")
    _check_ok(types.SimpleNamespace(success=True, message=""), "flush_cache")
    _check_ok({"success": True}, "x")
    _check_ok(True, "x")
    with pytest.raises(RuntimeError, match="flush refused"):
        _check_ok(types.SimpleNamespace(success=False, message="flush refused"), "flush_cache")
    with pytest.raises(RuntimeError, match="already open"):
        _check_ok((False, "already open"), "begin_weight_update()")
