"""What a small or one-rank update no longer pays, with the same result bit for bit.

* RoPE's cos / sin once per table (``training.rope_cache``): megatron-core's unfused path's values and
  gradients, computed once per table, the original restored, a changed signature refused.
* The one-rank gradient finalisation (``train_step._one_rank_finalize``): the same weights after an
  update as megatron-core's ``finalize_model_grads`` with its collectives, and only at one rank."""

from __future__ import annotations

import importlib

import pytest
import torch
from dist_utils import run_distributed
from torch.overrides import TorchFunctionMode

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.training import train_step as ts
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.rope_cache import APPLY, ROPE_MODULE, RopeCompatError, shared_cos_sin
from megatron_mugrpo.training.setup import build_policy

from .common import hf_config, make_batch

rope = importlib.import_module(ROPE_MODULE)


class _CountCos(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.cos
        return func(*args, **(kwargs or {}))


def _apply_and_grad(t: torch.Tensor, freqs: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.clone().requires_grad_(True)
    out = getattr(rope, APPLY)(t, freqs, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), t.grad


@pytest.mark.parametrize(
    "interleaved, rot_dim, mscale",
    [(False, 8, 1.0), (True, 8, 1.0), (False, 4, 0.7)],  # rot_dim 4 < head dim 8: a slice passes through
    ids=["half-split", "interleaved", "partial-rotary-mscale"],
)
def test_values_and_gradients_equal_megatrons_bit_for_bit(interleaved: bool, rot_dim: int, mscale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(5, 2, 3, 8, generator=gen)  # [s, b, heads, head dim]
    freqs = torch.randn(5, 1, 1, rot_dim, generator=gen)
    kwargs = {"rotary_interleaved": interleaved, "mscale": mscale}
    expected = _apply_and_grad(t, freqs, **kwargs)
    with shared_cos_sin():
        first, again = _apply_and_grad(t, freqs, **kwargs), _apply_and_grad(t, freqs, **kwargs)  # second: cached
    for got in (first, again):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_cos_once_per_table_and_original_restored() -> None:
    original = getattr(rope, APPLY)
    t, freqs, other = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 8)
    with shared_cos_sin(), _CountCos() as counter:
        for _ in range(3):  # queries and keys of several layers share one table
            getattr(rope, APPLY)(t, freqs)
        getattr(rope, APPLY)(t, other)
        assert counter.calls == 2
        freqs.mul_(2.0)  # changed in place: a new table, recomputed
        getattr(rope, APPLY)(t, freqs)
        assert counter.calls == 3
    assert getattr(rope, APPLY) is original


def test_a_changed_signature_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rope, APPLY, lambda t, freqs, config: t)
    with pytest.raises(RopeCompatError, match=r"expected \('t', 'freqs', 'rotary_interleaved'"), shared_cos_sin():
        pass


def _model_output_and_grads_unchanged(rank: int, world_size: int) -> None:
    groups = initialize_parallel(1, 1, seed=0)
    chunk = build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=None).model_chunks[0]
    tokens = make_batch(0).tokens
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        chunk.zero_grad_buffer()  # DDP accumulates every parameter's gradient into its main_grad
        logits = chunk(tokens, positions, None)
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), [p.main_grad.clone() for p in chunk.module.parameters()]

    before = run()
    with shared_cos_sin():
        after = run()
    assert torch.equal(before[0], after[0])
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))


def test_whole_model_output_and_gradients_unchanged() -> None:
    run_distributed(_model_output_and_grads_unchanged, 1)


def _weights_after_one_update(fast_path: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], int]:
    """(the weights after one 3-micro-batch update from seed 0's initialisation, fast finalisations run)."""
    calls = []
    fast = ts._finalize_one_rank
    monkeypatch.setattr(ts, "_finalize_one_rank", lambda *a, **k: calls.append(1) or fast(*a, **k))
    monkeypatch.setattr(ts, "one_rank", lambda groups: fast_path)
    policy = build_policy(
        hf_config(), groups=initialize_parallel(1, 1, seed=0), dtype=torch.float32, optim=OptimConfig(lr=1e-2)
    )
    before = [p.detach().clone() for p in policy.unwrapped()[0].parameters()]
    options = AlgoConfig().loss_options()
    batch = make_batch(1, groups=3)
    ts.train_step(policy, batch, loss_name="mu_grpo", loss_options=options, temperature=1.0, micro_batch_size=5)
    after = [p.detach().clone() for p in policy.unwrapped()[0].parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the update moved them
    return after, len(calls)


def _one_rank_finalize_equals_megatrons(rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_mugrpo.training.parallel import destroy_parallel

    reference, none = _weights_after_one_update(False, monkeypatch)
    destroy_parallel()
    fast, once = _weights_after_one_update(True, monkeypatch)
    assert none == 0 and once == 1  # three micro-batches, one finalisation
    assert all(torch.equal(a, b) for a, b in zip(reference, fast, strict=True))


def test_one_rank_finalize_gives_megatrons_update(monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_one_rank_finalize_equals_megatrons, 1, monkeypatch)


def test_one_rank_is_every_group_of_one() -> None:
    from types import SimpleNamespace

    base = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1}
    assert ts.one_rank(SimpleNamespace(**base))
    for name in base:
        assert not ts.one_rank(SimpleNamespace(**{**base, name: 2}))
