"""Process groups: Megatron's TP × PP × DP grid on gloo ranks, and the run_distributed helper."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.training.model import build_gpt_model, transformer_config_from_hf
from megatron_mugrpo.training.parallel import ParallelGroups, destroy_parallel, initialize_parallel

from .common import hf_config


def _check_grid(rank: int, world_size: int, tp: int, pp: int) -> None:
    groups = initialize_parallel(tp, pp, seed=3)
    assert (groups.world_size, groups.rank) == (world_size, rank)
    assert (groups.tp, groups.pp, groups.dp) == (tp, pp, world_size // (tp * pp))
    assert dist.get_world_size(groups.tp_group) == tp
    assert dist.get_world_size(groups.pp_group) == pp
    assert dist.get_world_size(groups.dp_group) == groups.dp
    assert groups.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    # megatron-core modules get the same groups as one collection (GPTModel's pg_collection).
    mcore = groups.mcore
    assert (mcore.tp, mcore.pp, mcore.dp, mcore.mp) == (
        groups.tp_group,
        groups.pp_group,
        groups.dp_group,
        groups.model_parallel_group,
    )
    # An all-reduce over the TP group sums exactly the TP ranks.
    value = torch.tensor([float(groups.tp_rank)])
    dist.all_reduce(value, group=groups.tp_group)
    assert value.item() == sum(range(tp))
    # Re-initialising with the same sizes reuses the state; other sizes need destroy_parallel().
    assert initialize_parallel(tp, pp, seed=3).tp_rank == groups.tp_rank
    if tp * pp > 1:
        with pytest.raises(RuntimeError, match="destroy_parallel"):
            initialize_parallel(1, 1, seed=3)
    destroy_parallel()
    again = initialize_parallel(1, 1, seed=3)
    assert again.dp == world_size


def _check_object_collectives(groups: ParallelGroups | HostGroup) -> None:
    """Object collectives (the trainers' or the hosts' group): every rank sees the same values, in rank order."""
    groups.barrier()
    assert groups.broadcast({"from": groups.rank}) == {"from": 0}
    assert groups.broadcast(f"rank {groups.rank}", src=groups.world_size - 1) == f"rank {groups.world_size - 1}"
    assert groups.all_gather((groups.rank, "x")) == [(r, "x") for r in range(groups.world_size)]
    gathered = groups.gather(groups.rank)
    assert gathered == (list(range(groups.world_size)) if groups.rank == 0 else None)
    assert groups.any_rank(groups.rank == groups.world_size - 1)
    assert not groups.any_rank(False)


def _check_both_two_rank_grids(rank: int, world_size: int) -> None:
    """TP=2 then, after destroy_parallel(), PP=2 on the same ranks (one spawn for both)."""
    _check_grid(rank, world_size, 2, 1)
    groups = initialize_parallel(1, 1, seed=3)
    assert dist.get_world_size(groups.world_group) == world_size
    _check_object_collectives(groups)
    # The engine hosts' group has the same collectives (one implementation, collectives.ObjectGroup).
    _check_object_collectives(HostGroup.create(EnginePlacement.from_env(tensor_parallel=1, world_size=world_size)))
    destroy_parallel()
    destroy_parallel()
    _check_grid(rank, world_size, 1, 2)


def _check_bad_sizes(rank: int, world_size: int) -> None:
    with pytest.raises(ConfigError, match="not a multiple"):
        initialize_parallel(2, 1, seed=0)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    initialize_parallel(1, 1, seed=0)
    if rank == 1:
        raise AssertionError("deliberate failure on rank one")


def test_single_process_grid_without_spawning():
    run_distributed(_check_grid, 1, 1, 1)
    run_distributed(_check_bad_sizes, 1)
    assert not dist.is_initialized(), "run_distributed(world_size=1) must tear down the process group"


def test_object_collectives_are_no_ops_in_one_process():
    local = ParallelGroups.local()
    assert not local.distributed and not dist.is_initialized()
    payload = {"a": [1, 2]}
    local.barrier()
    assert local.broadcast(payload) is payload
    assert local.all_gather(payload) == [payload]
    assert local.gather(payload) == [payload]
    assert local.any_rank(True) and not local.any_rank(False)
    run_distributed(lambda rank, world_size: _check_object_collectives(initialize_parallel(1, 1, seed=0)), 1)


@pytest.mark.multiprocess
def test_two_rank_grids():
    run_distributed(_check_both_two_rank_grids, 2)


@pytest.mark.multiprocess
def test_rank_failure_is_reraised_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed.*deliberate failure on rank one"):
        run_distributed(_fail_on_rank_one, 2)


def test_a_model_needs_process_groups_not_megatrons_globals():
    with pytest.raises(ValueError, match="initialize_parallel"):
        build_gpt_model(hf_config(), ParallelGroups.local(), dtype=torch.float32)


def test_transformer_config_takes_its_parallel_sizes_from_the_caller():
    """No parallel state is initialised here: the sizes can only come from the arguments."""
    config = transformer_config_from_hf(hf_config(), dtype=torch.float32, tensor_parallel=2, pipeline_parallel=2)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    assert transformer_config_from_hf(hf_config(), dtype=torch.float32).tensor_model_parallel_size == 1
