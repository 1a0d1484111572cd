"""Weight publication: after each publication a worker's engine holds exactly the trainer's weights;
pointer, log and pruning; the digest that lets the trainer check what workers loaded."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file

from megatron_mugrpo.asynchronous.files import write_json
from megatron_mugrpo.asynchronous.publish import (
    KEEP_PUBLICATIONS,
    LOAD_ATTEMPTS,
    LOG,
    POINTER,
    Publication,
    Subscription,
    engine_digest,
    latest_publication,
    publication_digests,
    publish_policy,
    published_names,
    weights_digest,
)


def test_digest_ignores_order_and_sees_any_change() -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    assert weights_digest([("a", a), ("b", b)]) == weights_digest([("b", b), ("a", a.clone())])
    changed = a.clone()
    changed[1, 2] += 1e-6
    assert weights_digest([("a", changed), ("b", b)]) != weights_digest([("a", a), ("b", b)])
    assert weights_digest([("a", a.reshape(3, 2)), ("b", b)]) != weights_digest([("a", a), ("b", b)])


def test_worker_weights_equal_each_publication(tmp_path: Path) -> None:
    run_distributed(_publish_and_pick_up, 1, str(tmp_path))


def _publish_and_pick_up(rank: int, world_size: int, tmp: str) -> None:
    from megatron_mugrpo.conversion import export_hf

    from megatron_mugrpo.training.model import tiny_hf_config
    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.setup import build_policy

    groups = initialize_parallel(1, 1, seed=0)
    hf_config = tiny_hf_config("qwen2")
    policy = build_policy(hf_config, groups=groups, dtype=torch.float32, optim=None)
    origin = SimpleNamespace(hf_config=hf_config, hf_dir=Path(tmp) / "no_tokenizer")
    trainer = SimpleNamespace(policy=policy, origin=origin, is_writer=True, groups=groups)
    root = Path(tmp) / "weights"
    root.mkdir()
    worker = _worker("")  # the worker's own load: build the engine once, then reload weights
    load = worker.load

    subscription = Subscription(root)
    assert subscription.refresh(load) >= 0 and subscription.current is None  # nothing published yet
    published = []
    for version in (0, 4, 8):
        if version:  # an optimizer update's worth of change
            with torch.no_grad():
                for param in policy.unwrapped()[0].parameters():
                    param.add_(0.01 * torch.randn_like(param))
        publication = publish_policy(trainer, root, version=version, digest=True)
        published.append(publication)
        assert latest_publication(root) == publication
        subscription.refresh(load)
        assert subscription.current == publication
        expected = dict(export_hf(policy.unwrapped(), hf_config, groups))
        held = worker.engine.weights()
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor), f"{name} differs from publication {version}"
        assert engine_digest(worker.engine, published_names(root / publication.name)) == publication.digest
    assert len({p.digest for p in published}) == 3
    assert subscription.refresh(load) < 1.0 and subscription.current == published[-1]  # no new one: no reload

    for version in range(12, 12 + 4 * KEEP_PUBLICATIONS, 4):
        publish_policy(trainer, root, version=version, digest=False)
    kept = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(kept) == KEEP_PUBLICATIONS and latest_publication(root).name == kept[-1]
    assert publication_digests(root)[published[1].name] == published[1].digest  # the log outlives pruning
    lines = [json.loads(line) for line in (root / LOG).read_text().splitlines()]
    assert [line["version"] for line in lines] == [0, 4, 8, 12, 16, 20, 24]


def test_worker_warms_up_from_the_base_model_then_serves_the_publication(tmp_path: Path) -> None:
    """``Worker.warm_up`` starts the verifier's processes and builds the engine from model.hf_dir
    before any publication; loading the first publication then replaces every weight (a worker never
    samples from the warm-up weights)."""
    from megatron_mugrpo.training.tiny import tiny_hf_dir

    dirs = {
        name: tiny_hf_dir(tmp_path / name, seed=seed, tokenizer=False)
        for name, seed in (("base", 0), ("publication", 1))
    }
    warm = _worker(str(dirs["base"]))
    warm.warm_up()
    assert warm.engine is not None and warm.prompts and warm.tokenizer is not None
    workers = warm.reward_fn.for_kind("math").pool._workers
    assert len(workers) == warm.cfg.reward.workers and all(w.process.is_alive() for w in workers)
    warm.reward_fn.close()
    base_weights = {k: v.clone() for k, v in warm.engine.weights().items()}
    engine = warm.engine
    warm.load(str(dirs["publication"]))
    assert warm.engine is engine  # the built engine is reused, only its weights change
    served, expected = warm.engine.weights(), load_file(str(dirs["publication"] / "model.safetensors"))
    for name, tensor in expected.items():
        assert torch.equal(served[name], tensor), name
    assert any(not torch.equal(served[name], base_weights[name]) for name in expected)
    assert warm.digest == engine_digest(warm.engine, published_names(dirs["publication"]))
    for nothing_to_build_from in ("", str(tmp_path / "missing")):  # demo base built by the trainer; a bad path
        idle = _worker(nothing_to_build_from)
        idle.warm_up()
        idle.reward_fn.close()
        assert idle.engine is None


def _point(root: Path, name: str, version: int) -> Publication:
    """Publish a directory by hand: ``latest`` names it."""
    (root / name).mkdir(parents=True, exist_ok=True)
    write_json(root / POINTER, {"name": name, "version": version, "digest": ""})
    return Publication(name=name, version=version)


def test_a_load_the_engine_refuses_is_retried(tmp_path: Path) -> None:
    """SGLang's ``update_weights_from_disk`` failing raises RuntimeError, not OSError: it is retried too."""
    root = tmp_path / "weights"
    first = _point(root, "v00000004-aaaa", 4)
    calls: list[str] = []

    def flaky(path: str) -> None:
        calls.append(Path(path).name)
        if len(calls) == 1:
            raise RuntimeError("update_weights_from_disk: Failed to load weights (busy)")
        if len(calls) == 2:
            _point(root, "v00000008-bbbb", 8)  # meanwhile a newer one was published: the next try takes it
            raise FileNotFoundError(path)

    subscription = Subscription(root, retry_s=0.0)
    subscription.refresh(flaky)
    assert calls == [first.name, first.name, "v00000008-bbbb"]
    assert subscription.current == Publication(name="v00000008-bbbb", version=8)


def test_a_load_that_keeps_failing_stops_with_the_last_error(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    _point(root, "v00000004-aaaa", 4)
    attempts: list[int] = []

    def broken(path: str) -> None:
        attempts.append(1)
        raise RuntimeError(f"update_weights_from_disk({path}) failed: attempt {len(attempts)}")

    subscription = Subscription(root, retry_s=0.0)
    with pytest.raises(RuntimeError) as failure:
        subscription.refresh(broken)
    assert len(attempts) == LOAD_ATTEMPTS and subscription.current is None
    message = str(failure.value)
    assert f"in {LOAD_ATTEMPTS} attempts; the last, of v00000004-aaaa, failed with RuntimeError" in message
    assert message.endswith(f"attempt {LOAD_ATTEMPTS}")

    def bug(path: str) -> None:  # anything else is not a load failure: no retry
        raise KeyError("model.layers.0")

    with pytest.raises(KeyError):
        subscription.refresh(bug)


def test_each_worker_seeds_its_engine_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_mugrpo.asynchronous import worker as worker_module

    seeds = [worker_module.engine_seed(0, w) for w in range(8)]
    assert len(set(seeds)) == 8 and seeds == [worker_module.engine_seed(0, w) for w in range(8)]  # stable
    assert worker_module.engine_seed(1, 0) not in seeds and all(0 <= s < 2**31 for s in seeds)

    built: dict[int, int] = {}

    def build(rollout, path, *, seed, **overrides):
        return SimpleNamespace(seed=seed)

    monkeypatch.setattr(worker_module, "build_engine_from_config", build)
    for index in (0, 1):
        worker = _worker("", index=index, world=3)
        built[index] = worker._build_engine("unused").seed
    assert built == {0: seeds[0], 1: seeds[1]}


def _worker(hf_dir: str, *, index: int = 0, world: int = 2):
    """A rollout worker with the async demo's engine settings and only what loading weights needs."""
    from megatron_mugrpo.asynchronous.roles import split_roles
    from megatron_mugrpo.asynchronous.worker import Worker
    from megatron_mugrpo.config import load_config

    demo = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo_async_cpu.yaml")
    cfg = SimpleNamespace(
        model=SimpleNamespace(hf_dir=hf_dir),
        rollout=demo.rollout,
        reward=demo.reward,
        data=demo.data,
        seed=0,
        async_=SimpleNamespace(verify_weights=True),
    )
    role = split_roles(rank=1 + index, world_size=world, mode="async", rollout_ranks=world - 1, model_parallel=1)
    return Worker(cfg=cfg, role=role, paths=None, trainer=None, subscription=None)
