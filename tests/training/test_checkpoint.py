"""Checkpoints on one rank: bitwise resume, keep-last-k, the latest pointer, and clear errors.

(Resharding on load — saved at TP=2 / PP=2 / DP=2, loaded at TP=1 — is covered by
test_parallel_equivalence.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.config import AlgoConfig, OptimConfig
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training import checkpoint
from megatron_mugrpo.training.checkpoint import CheckpointError
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.train_step import train_step

from .common import hf_config, make_batch


def _policy(seed: int) -> Policy:
    groups = initialize_parallel(1, 1, seed=seed)
    return build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-3))


def _update(policy: Policy, index: int) -> dict[str, float]:
    # Dropout is off, so the RNG does not change results here; the draw below checks it is restored.
    return train_step(
        policy,
        make_batch(20 + index),
        loss_name="mu_grpo",
        loss_options=AlgoConfig().loss_options(),
        temperature=1.0,
        micro_batch_size=3,
    ) | {"rng_draw": float(torch.rand(()))}


def _params(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.unwrapped()[0].named_parameters()}


def _resume_is_bitwise(rank: int, world_size: int, root: str) -> None:
    torch.use_deterministic_algorithms(True)
    straight = _policy(seed=0)
    straight_metrics = [_update(straight, i) for i in range(4)]
    expected = _params(straight)

    first = _policy(seed=0)
    resumed_metrics = [_update(first, i) for i in range(2)]
    state = TrainerState(stage=0, update_in_stage=2, global_update=2, data_cursor=2 * 2, train_tokens=7.0)
    checkpoint.save_checkpoint(
        root,
        2,
        first.model_chunks,
        hf_config=first.hf_config,
        optimizer=first.optimizer,
        scheduler=first.scheduler,
        trainer_state=state,
        run_config={"seed": 0},
    )
    second = _policy(seed=7)  # different init: everything must come from the checkpoint
    torch.rand(5)  # disturb the RNG: it must be restored too
    info = checkpoint.load_checkpoint(
        checkpoint.latest_checkpoint(root), second.model_chunks, second.optimizer, second.scheduler
    )
    assert info.trainer_state == state and info.loaded_optimizer and info.restored_rng
    assert info.metadata["run_config"] == {"seed": 0} and info.metadata["tp"] == 1
    resumed_metrics += [_update(second, i) for i in range(2, 4)]
    assert resumed_metrics == straight_metrics  # exact float equality, update by update
    for name, value in _params(second).items():
        assert torch.equal(value, expected[name]), f"{name} differs after resume"


def test_resume_after_two_of_four_updates_is_bitwise(tmp_path):
    run_distributed(_resume_is_bitwise, 1, str(tmp_path))


def _keep_last_latest_and_errors(rank: int, world_size: int, root: str) -> None:
    policy = _policy(seed=0)
    root_path = Path(root)
    for step in range(1, 5):
        checkpoint.save_checkpoint(root, step, policy.model_chunks, hf_config=policy.hf_config, keep_last=2)
    names = sorted(p.name for p in root_path.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004"], names
    assert checkpoint.latest_checkpoint(root) == root_path / "step_00000004"

    # A protected step (the best evaluated one) survives pruning past keep_last.
    keep_root = root_path.parent / "keep"
    for step in range(1, 5):
        checkpoint.save_checkpoint(keep_root, step, policy.model_chunks, hf_config=policy.hf_config, keep=[1])
    assert sorted(p.name for p in keep_root.iterdir()) == ["latest", "step_00000001", "step_00000003", "step_00000004"]

    # A half-written save (crash before the rename) is ignored.
    (root_path / "step_00000005.tmp" / "model").mkdir(parents=True)
    assert checkpoint.latest_checkpoint(root) == root_path / "step_00000004"

    # Truncate the newest: loading it names the path and the fix; the older one stays usable.
    (root_path / "step_00000004" / "model" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000004.*truncated.*older checkpoint"):
        checkpoint.load_checkpoint(root_path / "step_00000004", policy.model_chunks)
    assert checkpoint.latest_checkpoint(root) == root_path / "step_00000003"
    checkpoint.load_checkpoint(checkpoint.latest_checkpoint(root), policy.model_chunks)

    (root_path / "step_00000003" / "metadata.json").write_text('{"format": "megatron_mugr')
    with pytest.raises(CheckpointError, match=r"metadata.json is missing or unreadable"):
        checkpoint.load_checkpoint(root_path / "step_00000003", policy.model_chunks)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load_checkpoint(root_path / "step_00000042", policy.model_chunks)
    shutil.rmtree(root_path / "step_00000003")
    shutil.rmtree(root_path / "step_00000004")
    assert checkpoint.latest_checkpoint(root) is None
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.save_checkpoint(root, 9, policy.model_chunks, hf_config=policy.hf_config, keep_last=1)


def test_keep_last_latest_pointer_and_clear_errors(tmp_path):
    run_distributed(_keep_last_latest_and_errors, 1, str(tmp_path / "ckpt"))


def _model_only_checkpoint_starts_fresh_optimizer(rank: int, world_size: int, root: str) -> None:
    source = _policy(seed=0)
    checkpoint.save_checkpoint(root, 0, source.model_chunks, hf_config=source.hf_config)  # like convert hf-to-megatron
    weights = _params(source)
    target = _policy(seed=3)
    info = checkpoint.load_checkpoint(
        checkpoint.latest_checkpoint(root), target.model_chunks, target.optimizer, target.scheduler
    )
    assert not info.loaded_optimizer and not info.metadata["has_optimizer"]
    for name, value in _params(target).items():
        assert torch.equal(value, weights[name]), name
    metrics = _update(target, 0)  # the optimizer steps from the loaded weights, not its own copy
    assert metrics["train/grad_norm"] > 0
    assert all(not torch.equal(v, weights[n]) for n, v in _params(target).items())


def test_model_only_checkpoint_loads_with_a_fresh_optimizer(tmp_path):
    run_distributed(_model_only_checkpoint_starts_fresh_optimizer, 1, str(tmp_path))
