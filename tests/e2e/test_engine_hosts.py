"""Every engine host holds the trained policy: TP=2 training with rollout.tensor_parallel=1 runs two
engines, and after a weight sync both hold exactly the tensors ``export_hf`` produces (spawned gloo
ranks through ``open_run``, the same set-up `mugrpo train` uses)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_cpu.yaml"


def _digest(named: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(named):
        digest.update(name.encode())
        digest.update(named[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _sync_on_two_hosts(rank: int, world_size: int, run_dir: str) -> None:
    from megatron_mugrpo.conversion import export_hf

    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.loop.engines import sync_engine
    from megatron_mugrpo.loop.opening import Opening
    from megatron_mugrpo.loop.setup import open_run

    cfg = load_config(
        DEMO,
        ["warmstart.steps=0", "parallel.tensor_parallel=2", "rollout.tensor_parallel=1", "logging.progress_bars=false"],
    )
    run = open_run(cfg, Path(run_dir), Opening.new(None))
    try:
        assert run.placement.is_host and run.placement.num_engines == 2
        with torch.no_grad():  # make the policy differ from the base model the engines were built from
            for param in (p for chunk in run.policy.unwrapped() for p in chunk.parameters()):
                param.add_(0.01 * (1 + torch.arange(param.numel(), dtype=param.dtype).reshape(param.shape) % 7))
        metrics = sync_engine(run)
        assert metrics["perf/weight_sync_s"] > 0 and metrics["perf/weight_sync_gb_per_s"] > 0
        exported = dict(export_hf(run.policy.unwrapped(), run.origin.hf_config, run.groups))
        held = {name: tensor for name, tensor in run.engine.model.state_dict().items() if name in exported}
        assert held.keys() == exported.keys()
        digests = [None] * world_size
        dist.all_gather_object(digests, (_digest(exported), _digest(held)))
        assert digests[0] == digests[1], "the two engines hold different weights"
        assert digests[rank][0] == digests[rank][1], "an engine does not hold the exported policy"
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_engine_holds_the_exported_policy_after_sync(tmp_path: Path):
    run_distributed(_sync_on_two_hosts, 2, str(tmp_path / "run"))
