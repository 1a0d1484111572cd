"""Engine placement: which ranks host an engine, the host's local GPU, CPU threads per host, and the
errors for layouts that cannot work."""

from __future__ import annotations

import pytest
import torch

from megatron_mugrpo.rollout.placement import EnginePlacement, PlacementError, engine_threads


def placements(world: int, per_node: int, tp: int, cores: int = 16) -> list[EnginePlacement]:
    return [
        EnginePlacement(
            rank=rank,
            world_size=world,
            local_rank=rank % per_node,
            local_world_size=per_node,
            tensor_parallel=tp,
            cores=cores,
        )
        for rank in range(world)
    ]


def test_one_engine_per_rank_by_default():
    ranks = placements(world=8, per_node=8, tp=1)
    assert all(p.is_host for p in ranks)
    assert [p.base_gpu_id for p in ranks] == list(range(8))
    assert ranks[0].num_engines == 8 and list(ranks[0].host_ranks) == list(range(8))
    assert {p.cpu_threads for p in ranks} == {2}  # 16 cores shared by 8 hosts


def test_engine_groups_across_two_nodes():
    # 2 nodes × 4 GPUs, engines of TP 2: groups {0,1} {2,3} | {4,5} {6,7}
    ranks = placements(world=8, per_node=4, tp=2, cores=32)
    assert [p.is_host for p in ranks] == [True, False] * 4
    assert [p.host_rank for p in ranks] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert [p.engine_index for p in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    # Every rank knows its host's local GPU: SGLang's base_gpu_id (tp_size 2 uses it and the next).
    assert [p.base_gpu_id for p in ranks] == [0, 0, 2, 2, 0, 0, 2, 2]
    assert ranks[0].num_engines == 4 and list(ranks[0].host_ranks) == [0, 2, 4, 6]
    assert ranks[0].hosts_on_node == 2 and ranks[0].cpu_threads == 16


def test_cpu_threads_never_below_one_and_overridable():
    assert placements(world=4, per_node=4, tp=1, cores=2)[0].cpu_threads == 1
    fixed = EnginePlacement(
        rank=0, world_size=2, local_rank=0, local_world_size=2, tensor_parallel=1, cores=2, cpu_threads_override=3
    )
    assert fixed.cpu_threads == 3


@pytest.mark.parametrize(
    ("world", "per_node", "tp", "message"),
    [
        (6, 6, 4, r"rollout.tensor_parallel=4 does not divide the world size 6.*engine group"),
        (8, 2, 4, r"does not divide the 2 ranks per node: an engine group must lie inside one node"),
        (4, 4, 0, r"rollout.tensor_parallel=0 must be >= 1"),
    ],
)
def test_impossible_layouts_are_explained(world, per_node, tp, message):
    with pytest.raises(PlacementError, match=message):
        placements(world=world, per_node=per_node, tp=tp)


def test_from_env_reads_torchrun_variables(monkeypatch):
    for key, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    placement = EnginePlacement.from_env(tensor_parallel=2, cores=8)
    assert (placement.rank, placement.local_rank, placement.host_rank, placement.is_host) == (5, 1, 4, False)
    assert placement.base_gpu_id == 0 and placement.cpu_threads == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # without it: one node
    assert EnginePlacement.from_env(tensor_parallel=2, cores=8).local_world_size == 8


def test_engine_threads_restores_the_trainers_setting():
    before = torch.get_num_threads()
    with engine_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_engines_keep_to_the_thread_budget_the_process_was_given(monkeypatch):
    """A sweep's one-thread jobs (OMP_NUM_THREADS=1) must not each start an engine on every core."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert EnginePlacement.from_env(tensor_parallel=1).cpu_threads == 16
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EnginePlacement.from_env(tensor_parallel=1).cpu_threads == 1
    # 4 processes on the node with 2 threads each: 8 of the 16 cores, 2 per engine host
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert EnginePlacement.from_env(tensor_parallel=1).cores == 8
    assert EnginePlacement.from_env(tensor_parallel=1).cpu_threads == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # more than the mask: the mask wins
    assert EnginePlacement.from_env(tensor_parallel=1).cores == 16
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")  # ignored, as OpenMP ignores it
    assert EnginePlacement.from_env(tensor_parallel=1).cores == 16
