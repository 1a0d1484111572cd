"""TP=2 (two gloo ranks) equals TP=1 for both entry points, including a shard that is all padding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from kernel_cases import make_case, make_targets

from megatron_mugrpo.kernels import fused_linear_logprobs, vocab_parallel_logprobs
from megatron_mugrpo.training.parallel import initialize_parallel

N, H, PADDED, TEMPERATURE = 24, 16, 1024, 0.8
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _fused(h, w, targets, vocab_start, vocab_size, group, reduce_hidden_grad=True):
    """Forward + backward of Σ g·logprob + Σ g'·entropy; returns (logprob, entropy, d hidden, d weight)."""
    _, _, g_lp, g_ent = make_case(N, H, PADDED, torch.float32)
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    lp, ent = fused_linear_logprobs(
        h,
        w,
        targets,
        temperature=TEMPERATURE,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        tp_group=group,
        with_entropy=True,
        chunk_size=100,
        impl="torch",
        reduce_hidden_grad=reduce_hidden_grad,
    )
    ((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _materialised(logits, targets, vocab_start, vocab_size, group):
    _, _, g_lp, g_ent = make_case(N, H, PADDED, torch.float32)
    logits = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(
        logits,
        targets,
        temperature=TEMPERATURE,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        tp_group=group,
        with_entropy=True,
        chunk_size=100,
        impl="torch",
    )
    ((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum()).backward()
    return lp.detach(), ent.detach(), logits.grad


def _tp2_equals_tp1(rank: int, world_size: int) -> None:
    groups = initialize_parallel(tp=world_size, pp=1, seed=0)  # as every rank body does (tests/dist_utils.py)
    # 1000: the last shard ends in padding rows; 500: the last shard is nothing but padding.
    for vocab_size in (1000, 500):
        _compare(groups.tp_rank, groups.tp, vocab_size, groups.tp_group)


def _compare(rank: int, world_size: int, vocab_size: int, group: dist.ProcessGroup) -> None:
    h, w, _, _ = make_case(N, H, PADDED, torch.float32)
    targets = make_targets(N, vocab_size)
    shard = PADDED // world_size
    start, stop = rank * shard, (rank + 1) * shard

    lp1, ent1, dh1, dw1 = _fused(h, w, targets, 0, vocab_size, None)
    lp2, ent2, dh2, dw2 = _fused(h, w[start:stop], targets, start, vocab_size, group)
    for a, b in ((lp2, lp1), (ent2, ent1), (dh2, dh1), (dw2, dw1[start:stop])):
        torch.testing.assert_close(a, b, **TOL)

    # Without the built-in reduction each rank holds its shard's partial d hidden; they sum to TP=1's.
    _, _, partial, _ = _fused(h, w[start:stop], targets, start, vocab_size, group, reduce_hidden_grad=False)
    dist.all_reduce(partial, group=group)
    torch.testing.assert_close(partial, dh1, **TOL)

    logits = h @ w.T
    lp1, ent1, dl1 = _materialised(logits, targets, 0, vocab_size, None)
    lp2, ent2, dl2 = _materialised(logits[:, start:stop].contiguous(), targets, start, vocab_size, group)
    for a, b in ((lp2, lp1), (ent2, ent1), (dl2, dl1[:, start:stop])):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.multiprocess
def test_tp2_equals_tp1() -> None:
    run_distributed(_tp2_equals_tp1, 2)
