"""Checkpoints: bitwise resume, keep-last-k, the latest pointer, clear errors, integrity and async saves.

Integrity is tested with real damage: a flipped bit in ``model/__0_0.distcp``, truncated
``.distcp`` and ``rng/*.pt`` files. Resuming falls back to the newest intact checkpoint (or stops
with one CheckpointError), on one rank, on two TP ranks that must agree, and through the real
``mugrpo train --resume`` command line. (Resharding on load — saved at TP=2 / PP=2 / DP=2, loaded
at TP=1 — is covered by test_parallel_equivalence.py.)
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import xxhash
from dist_utils import run_distributed
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.commands import mugrpo_argv
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training import checkpoint, checkpoint_reader, checkpoint_writer, mcore_compat
from megatron_mugrpo.training.checkpoint import CheckpointError, CheckpointSaver
from megatron_mugrpo.training.checkpoint_digests import FileDigest
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.train_step import train_step

from .common import hf_config, make_batch


def _policy(seed: int, tp: int = 1) -> Policy:
    groups = initialize_parallel(tp, 1, seed=seed)
    return build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-3))


def _info(policy: Policy) -> dict:
    """The keyword arguments every save needs."""
    return {"groups": policy.groups, "hf_config": policy.hf_config}


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
        groups=first.groups,
        hf_config=first.hf_config,
        optimizer=first.optimizer,
        scheduler=first.scheduler,
        trainer_state=state,
        run_config={"seed": 0},
    )
    second = _policy(seed=7)  # different init: everything must come from the checkpoint
    torch.rand(5)  # disturb the RNG: it must be restored too
    info = checkpoint.load_checkpoint(
        checkpoint.latest_checkpoint(root),
        second.model_chunks,
        second.optimizer,
        second.scheduler,
        groups=second.groups,
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
        checkpoint.save_checkpoint(root, step, policy.model_chunks, **_info(policy), keep_last=2)
    names = sorted(p.name for p in root_path.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004"], names
    assert checkpoint.latest_checkpoint(root) == root_path / "step_00000004"

    # A protected step (the best evaluated one) survives pruning past keep_last.
    keep_root = root_path.parent / "keep"
    for step in range(1, 5):
        checkpoint.save_checkpoint(keep_root, step, policy.model_chunks, **_info(policy), keep=[1])
    assert sorted(p.name for p in keep_root.iterdir()) == ["latest", "step_00000001", "step_00000003", "step_00000004"]

    # A half-written save (crash before the rename) is ignored.
    (root_path / "step_00000005.tmp" / "model").mkdir(parents=True)
    assert checkpoint.latest_checkpoint(root) == root_path / "step_00000004"

    # Truncate the newest: loading it names the path and the fix; the older one stays usable.
    (root_path / "step_00000004" / "model" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000004.*truncated.*older checkpoint"):
        checkpoint.load_checkpoint(root_path / "step_00000004", policy.model_chunks, groups=policy.groups)
    assert checkpoint.latest_checkpoint(root) == root_path / "step_00000003"
    checkpoint.load_checkpoint(checkpoint.latest_checkpoint(root), policy.model_chunks, groups=policy.groups)

    (root_path / "step_00000003" / "metadata.json").write_text('{"format": "megatron_mugr')
    with pytest.raises(CheckpointError, match=r"metadata.json is missing or unreadable"):
        checkpoint.load_checkpoint(root_path / "step_00000003", policy.model_chunks, groups=policy.groups)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load_checkpoint(root_path / "step_00000042", policy.model_chunks, groups=policy.groups)
    shutil.rmtree(root_path / "step_00000003")
    shutil.rmtree(root_path / "step_00000004")
    assert checkpoint.latest_checkpoint(root) is None
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.save_checkpoint(root, 9, policy.model_chunks, **_info(policy), keep_last=1)


def test_keep_last_latest_pointer_and_clear_errors(tmp_path):
    run_distributed(_keep_last_latest_and_errors, 1, str(tmp_path / "ckpt"))


def _model_only_checkpoint_starts_fresh_optimizer(rank: int, world_size: int, root: str) -> None:
    source = _policy(seed=0)
    checkpoint.save_checkpoint(root, 0, source.model_chunks, **_info(source))  # like convert hf-to-megatron
    weights = _params(source)
    target = _policy(seed=3)
    info = checkpoint.load_checkpoint(
        checkpoint.latest_checkpoint(root),
        target.model_chunks,
        target.optimizer,
        target.scheduler,
        groups=target.groups,
    )
    assert not info.loaded_optimizer and not info.metadata["has_optimizer"]
    for name, value in _params(target).items():
        assert torch.equal(value, weights[name]), name
    metrics = _update(target, 0)  # the optimizer steps from the loaded weights, not its own copy
    assert metrics["train/grad_norm"] > 0
    assert all(not torch.equal(v, weights[n]) for n, v in _params(target).items())


def test_model_only_checkpoint_loads_with_a_fresh_optimizer(tmp_path):
    run_distributed(_model_only_checkpoint_starts_fresh_optimizer, 1, str(tmp_path))


# ------------------------------------------------------------------------------ integrity


def _flip_bit(path: Path, at: float = 0.5) -> None:
    """Flip one bit of ``path`` at relative position ``at`` (a real single-bit corruption)."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _perturb(policy: Policy) -> None:
    with torch.no_grad():
        for param in policy.unwrapped()[0].parameters():
            param.add_(1.0)


def _manifest_lists_every_file(rank: int, world_size: int, root: str) -> None:
    policy = _policy(seed=0)
    _update(policy, 0)  # creates the optimizer state
    step_dir = checkpoint.save_checkpoint(
        root, 1, policy.model_chunks, **_info(policy), optimizer=policy.optimizer, scheduler=policy.scheduler
    )
    manifest = json.loads((step_dir / checkpoint.MANIFEST).read_text())
    on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {checkpoint.MANIFEST}
    assert {"model/__0_0.distcp", "optimizer/__0_0.distcp", "rng/rank_00000.pt", "metadata.json"} <= on_disk
    assert manifest["algorithm"] == "xxh3_128"
    for relative, entry in manifest["files"].items():  # the writer threads' digests are the files' digests
        data = (step_dir / relative).read_bytes()
        assert entry == {"checksum": xxhash.xxh3_128(data).hexdigest(), "bytes": len(data)}, relative
    checkpoint.verify_checkpoint(step_dir, groups=policy.groups)
    assert multiprocessing.active_children() == [], "writing must not start processes (threads only)"

    # A directory written when manifests held SHA-256 digests still verifies, and still catches damage.
    legacy = {
        relative: {"sha256": hashlib.sha256((step_dir / relative).read_bytes()).hexdigest(), "bytes": entry["bytes"]}
        for relative, entry in manifest["files"].items()
    }
    legacy_manifest = {"format": manifest["format"], "algorithm": "sha256", "files": legacy}
    (step_dir / checkpoint.MANIFEST).write_text(json.dumps(legacy_manifest))
    checkpoint.verify_checkpoint(step_dir, groups=policy.groups)
    shard = step_dir / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=r"model/__0_0.distcp fails its sha256 check"):
        checkpoint.verify_checkpoint(step_dir, groups=policy.groups)


def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    run_distributed(_manifest_lists_every_file, 1, str(tmp_path))


def _damage_falls_back(rank: int, world_size: int, root: str) -> None:
    policy = _policy(seed=0)
    _update(policy, 0)
    save = lambda step: checkpoint.save_checkpoint(  # noqa: E731
        root, step, policy.model_chunks, **_info(policy), optimizer=policy.optimizer, scheduler=policy.scheduler
    )
    save(1)
    intact = _params(policy)
    _perturb(policy)
    save(2)
    root_path = Path(root)

    # A flipped bit in the newest checkpoint: named, skipped, the older one loaded.
    _flip_bit(root_path / "step_00000002" / "model" / "__0_0.distcp")
    target = _policy(seed=5)
    warnings: list[str] = []
    loaded = checkpoint.load_latest_intact(
        root, target.model_chunks, target.optimizer, target.scheduler, groups=target.groups, warn=warnings.append
    )
    assert loaded is not None and loaded.step_dir == root_path / "step_00000001"
    assert "model/__0_0.distcp fails its xxh3_128 check" in warnings[0] and "falling back" in warnings[0]
    assert all(torch.equal(value, intact[name]) for name, value in _params(target).items())
    with pytest.raises(CheckpointError, match=r"step_00000002 is damaged: model/__0_0.distcp fails its xxh3_128"):
        checkpoint.load_checkpoint(root_path / "step_00000002", target.model_chunks, groups=target.groups)

    # Truncations: a .distcp and an RNG file, each named with its size.
    _truncate(root_path / "step_00000001" / "rng" / "rank_00000.pt")
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt is truncated \(\d+ of \d+ bytes\)"):
        checkpoint.load_checkpoint(root_path / "step_00000001", target.model_chunks, groups=target.groups)
    _truncate(root_path / "step_00000001" / "model" / "__0_1.distcp")
    with pytest.raises(CheckpointError, match=r"model/__0_1.distcp is truncated"):
        checkpoint.verify_checkpoint(root_path / "step_00000001")

    # Nothing intact left: one CheckpointError naming every problem.
    with pytest.raises(
        CheckpointError, match=r"no intact checkpoint under .*__0_0.distcp fails.*rank_00000.pt is trunc"
    ):
        checkpoint.load_latest_intact(root, target.model_chunks, groups=target.groups, warn=warnings.append)


def test_damaged_checkpoints_fall_back_or_fail_clearly(tmp_path):
    run_distributed(_damage_falls_back, 1, str(tmp_path))


def _without_manifest(step_dir: Path) -> None:
    """Make ``step_dir`` look like a checkpoint written before manifests existed."""
    meta = json.loads((step_dir / "metadata.json").read_text())
    meta.pop("manifest")
    (step_dir / "metadata.json").write_text(json.dumps(meta))
    (step_dir / checkpoint.MANIFEST).unlink()


def _unverified_damage_is_a_checkpoint_error(rank: int, world_size: int, root: str) -> None:
    """Without a manifest, verification fails naming the directory and the fix; trusted, damage surfaces
    while loading: still a CheckpointError, never a raw traceback."""
    policy = _policy(seed=0)
    step_dir = checkpoint.save_checkpoint(root, 1, policy.model_chunks, **_info(policy))
    _without_manifest(step_dir)
    unverifiable = rf"{re.escape(str(step_dir))} has no checksum manifest .*trust_unverified=True"
    with pytest.raises(CheckpointError, match=unverifiable):
        checkpoint.verify_checkpoint(step_dir)
    with pytest.raises(CheckpointError, match=unverifiable):
        checkpoint.load_checkpoint(step_dir, policy.model_chunks, groups=policy.groups)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint under .*has no checksum manifest"):
        checkpoint.load_latest_intact(root, policy.model_chunks, groups=policy.groups, warn=lambda _: None)
    checkpoint.verify_checkpoint(step_dir, trust_unverified=True)  # passes, with a warning
    trusted = {"groups": policy.groups, "trust_unverified": True}
    loaded = checkpoint.load_latest_intact(root, policy.model_chunks, **trusted)
    assert loaded is not None and loaded.step_dir == step_dir
    _truncate(step_dir / "rng" / "rank_00000.pt")
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt is unreadable"):
        checkpoint.load_checkpoint(step_dir, policy.model_chunks, **trusted)
    _truncate(step_dir / "model" / "__0_0.distcp")
    # torch's CheckpointException derives from BaseException, not Exception: it must still be caught.
    with pytest.raises(CheckpointError, match=r"failed to load .*model \(CheckpointException"):
        checkpoint.load_checkpoint(step_dir, policy.model_chunks, load_rng=False, **trusted)


def test_unverified_damage_is_a_checkpoint_error(tmp_path):
    run_distributed(_unverified_damage_is_a_checkpoint_error, 1, str(tmp_path))


def _two_ranks_agree_on_damage(rank: int, world_size: int, root: str) -> None:
    """TP = 2: rank 1's file is damaged; both ranks fall back to the same older checkpoint."""
    policy = _policy(seed=0, tp=2)
    save = lambda step: checkpoint.save_checkpoint(root, step, policy.model_chunks, **_info(policy))  # noqa: E731
    save(1)
    intact = _params(policy)
    _perturb(policy)
    save(2)
    if rank == 0:
        _flip_bit(Path(root) / "step_00000002" / "model" / "__1_0.distcp")
    torch.distributed.barrier()
    target = _policy(seed=5, tp=2)
    loaded = checkpoint.load_latest_intact(root, target.model_chunks, groups=target.groups)
    assert loaded is not None and loaded.step_dir.name == "step_00000001"
    assert all(torch.equal(value, intact[name]) for name, value in _params(target).items())


@pytest.mark.multiprocess
def test_two_ranks_agree_on_a_damaged_file(tmp_path):
    run_distributed(_two_ranks_agree_on_damage, 2, str(tmp_path))


# ------------------------------------------------------------------------------ async saves


def _async_save_publishes_when_complete(rank: int, world_size: int, root: str) -> None:
    policy = _policy(seed=0)
    _update(policy, 0)
    saver = CheckpointSaver(root, groups=policy.groups, async_save=True)
    kwargs = {"hf_config": policy.hf_config, "optimizer": policy.optimizer, "scheduler": policy.scheduler}
    first = saver.save(1, policy.model_chunks, **kwargs)
    saver.wait()
    assert checkpoint.latest_checkpoint(root) == first
    saved = _params(policy)
    second = saver.save(2, policy.model_chunks, **kwargs, trainer_state=TrainerState(global_update=2))
    _perturb(policy)  # training goes on while the threads write: the snapshot must not see this
    # Written in the background, published by the next poll() / wait(): until then `latest` is the old one.
    assert saver.pending == [second] and not second.exists()
    assert checkpoint.latest_checkpoint(root) == first
    assert multiprocessing.active_children() == [], "async writers are threads, not processes"
    assert saver.wait() == [second] and saver.pending == []
    assert checkpoint.latest_checkpoint(root) == second
    target = _policy(seed=3)
    info = checkpoint.load_checkpoint(second, target.model_chunks, target.optimizer, groups=target.groups)
    assert info.trainer_state.global_update == 2
    assert all(torch.equal(value, saved[name]) for name, value in _params(target).items())


def test_async_save_snapshots_and_publishes_only_when_complete(tmp_path):
    run_distributed(_async_save_publishes_when_complete, 1, str(tmp_path))


def _failed_write_is_reported(rank: int, world_size: int, root: str) -> None:
    policy = _policy(seed=0)
    checkpoint.save_checkpoint(root, 1, policy.model_chunks, **_info(policy))
    original = checkpoint_writer._write_bucket

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    checkpoint_writer._write_bucket = disk_full
    try:
        with pytest.raises(CheckpointError, match=r"writing checkpoint .*step_00000002.tmp failed .*No space left"):
            checkpoint.save_checkpoint(root, 2, policy.model_chunks, **_info(policy))
    finally:
        checkpoint_writer._write_bucket = original
    assert checkpoint.latest_checkpoint(root) == Path(root) / "step_00000001"


def test_a_failed_write_is_reported_and_not_published(tmp_path):
    run_distributed(_failed_write_is_reported, 1, str(tmp_path))


# --------------------------------------------------------------------------- command line

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = [
    "warmstart.steps=5",
    "stages.num_stages=1",
    "stages.train_groups=4",
    "stages.mini_groups=2",
    "parallel.micro_batch_size=8",
    "rollout.shard_groups=4",
    "rollout.max_new_tokens=8",
    "eval.benchmarks.0.limit=4",
    "eval.benchmarks.0.k=1",
    "checkpoint.every_updates=1",
    "logging.progress_bars=false",
    "logging.tensorboard=false",
]
"""A 2-update run of the CPU demo: checkpoints step_00000001 (after update 1) and step_00000002."""


def _mugrpo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MUGRPO_CRASH_AT", None)
    return subprocess.run(mugrpo_argv(*args), cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_resume_cli_skips_a_bit_flipped_checkpoint_and_stops_when_none_is_intact(tmp_path):
    run = tmp_path / "run"
    first = _mugrpo("train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(run), *TINY_RUN)
    assert first.returncode == 0, first.stderr[-4000:]
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"

    _flip_bit(ckpts / "step_00000002" / "model" / "__0_0.distcp")
    resumed = _mugrpo("train", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "step_00000002 is damaged: model/__0_0.distcp fails its xxh3_128 check" in resumed.stderr
    assert "falling back to an older checkpoint" in resumed.stderr and "resumed from" in resumed.stderr
    checkpoint.verify_checkpoint(ckpts / "step_00000002")  # update 2 was redone and saved intact

    for step in ("step_00000001", "step_00000002"):
        _flip_bit(ckpts / step / "model" / "__0_0.distcp", at=0.9)
    failed = _mugrpo("train", "--resume", str(run))
    assert failed.returncode == 2, failed.stderr[-4000:]
    assert "Traceback" not in failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no intact checkpoint under" in errors[0], failed.stderr[-4000:]


def test_writer_threads_skip_the_zip_crc_and_leave_the_callers_setting_alone(tmp_path):
    """torch.save's CRC-32 is off in the writer threads (torch >= 2.13 keeps that switch per thread),
    the records still load, also through the direct read path; the caller's own torch.save keeps its CRC."""
    tensors = [torch.arange(1000, dtype=torch.float32), torch.ones(3, 5)]
    items = [WriteItem(index=MetadataIndex(f"t{i}"), type=WriteItemType.TENSOR) for i in range(len(tensors))]
    path = tmp_path / "bucket.distcp"
    with ThreadPoolExecutor(1) as pool:
        results, digest = pool.submit(
            checkpoint_writer._write_bucket, (str(path), path.name, ([], list(zip(items, tensors)))), fsync=True
        ).result()
    data = path.read_bytes()
    assert digest == FileDigest(path.name, xxhash.xxh3_128(data).hexdigest(), len(data))
    for result, tensor in zip(results, tensors):
        record = data[result.storage_data.offset : result.storage_data.offset + result.storage_data.length]
        assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), tensor)
        if not mcore_compat.ZIP_CRC_PROCESS_WIDE:
            with zipfile.ZipFile(io.BytesIO(record)) as archive:
                assert all(info.CRC == 0 for info in archive.infolist())
        # The loader's fast path finds the raw bytes of such a record (and reads them into place).
        with open(path, "rb", buffering=0) as stream:
            start = result.storage_data.offset
            position = checkpoint_reader._record_data_span(stream, start, result.storage_data.length, tensor)
            assert position is not None
            stream.seek(position)
            assert stream.read(tensor.numel() * 4) == tensor.numpy().tobytes()
    assert torch.serialization.get_crc32_options()  # untouched in this thread
