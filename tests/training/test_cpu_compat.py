"""The CPU compatibility layer: what it patches, that it can be undone, and that CUDA turns it off."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_mugrpo.training import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive with CUDA")


@pytest.fixture
def active():
    counts = cpu_compat.activate()
    yield counts
    cpu_compat.deactivate()


def test_activate_counts_patches_and_is_idempotent(active):
    assert active == {"rng_tracker": 1, "torch_cuda_stubs": 8, "device_mode": 1, "sequence_parallel_norm": 1}
    assert cpu_compat.activate() == active
    assert cpu_compat.is_active()


def test_cuda_device_arguments_map_to_cpu(active):
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.empty_like(torch.ones(3), device="cuda:0").device.type == "cpu"
    t = torch.arange(3.0)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(torch.device("cuda", 0), torch.float64).dtype == torch.float64


def test_type_strings_report_cuda_names(active):
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    # .type(dtype) keeps converting as usual.
    assert torch.ones(1).type(torch.float64).dtype == torch.float64


def test_torch_cuda_stubs_are_inert(active):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    stream = torch.cuda.Stream(device=torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pass
    assert torch.cuda.Event().query()


def test_rng_tracker_forks_the_cpu_generator(active):
    from megatron.core import tensor_parallel

    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outer_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer_before), "fork must restore the outer CPU state"
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second), "the forked stream must advance between forks"
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), first), "same seed, same stream"


def test_deactivate_restores_torch():
    original = torch.cuda.current_device
    cpu_compat.activate()
    cpu_compat.deactivate()
    assert torch.cuda.current_device is original
    assert torch.ones(1).type() == "torch.FloatTensor"
    assert not cpu_compat.is_active()


def test_inactive_when_cuda_is_available():
    """In a fresh interpreter that reports CUDA, activate() patches nothing."""
    script = textwrap.dedent(
        """
        import torch
        torch.cuda.is_available = lambda: True
        original = torch.cuda.current_device
        from megatron.core.tensor_parallel import random as mrandom
        tracker_cls = mrandom.CudaRNGStatesTracker
        from megatron_mugrpo.training import cpu_compat
        assert cpu_compat.activate() == {}, "must not patch on a CUDA machine"
        assert torch.cuda.current_device is original
        assert mrandom.CudaRNGStatesTracker is tracker_cls
        assert not cpu_compat.is_active()
        assert torch.ones(1).type() == "torch.FloatTensor"
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
