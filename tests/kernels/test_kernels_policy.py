"""kernels.logprob_impl: the per-call choice between the fused and unfused log-prob, and its config keys."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.kernels import policy
from megatron_mugrpo.kernels.config import KernelConfig
from megatron_mugrpo.kernels.policy import choose_logprob_path, logits_bytes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MiB = 2**20


def test_logits_bytes_are_float32() -> None:
    assert logits_bytes(1024, 151936) == 1024 * 151936 * 4


@pytest.mark.parametrize("device", (CPU, CUDA), ids=str)
def test_fixed_impls_ignore_shape_and_budget(device: torch.device) -> None:
    for impl in ("fused", "unfused"):
        for budget in (0, 10**12):
            assert choose_logprob_path(impl, n_tokens=8, n_columns=16, device=device, budget_bytes=budget) == impl


def test_auto_materialises_on_cpu_exactly_when_the_logits_fit() -> None:
    size = logits_bytes(256, 1024)  # 1 MiB
    assert choose_logprob_path("auto", n_tokens=256, n_columns=1024, device=CPU, budget_bytes=size) == "unfused"
    assert choose_logprob_path("auto", n_tokens=256, n_columns=1024, device=CPU, budget_bytes=size - 1) == "fused"
    assert choose_logprob_path("auto", n_tokens=257, n_columns=1024, device=CPU, budget_bytes=size) == "fused"


def test_auto_is_fused_on_gpus_whatever_the_budget() -> None:
    assert choose_logprob_path("auto", n_tokens=4, n_columns=8, device=CUDA, budget_bytes=10**12) == "fused"


def test_unknown_impl_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"kernels\.logprob_impl"):
        choose_logprob_path("fast", n_tokens=1, n_columns=1, device=CPU, budget_bytes=0)


def test_auto_logs_once_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    policy._log_choice.cache_clear()
    caplog.set_level(logging.INFO, logger=policy.__name__)
    for _ in range(3):
        choose_logprob_path("auto", n_tokens=512, n_columns=4096, device=CPU, budget_bytes=16 * MiB)
    choose_logprob_path("auto", n_tokens=2048, n_columns=4096, device=CPU, budget_bytes=16 * MiB)
    messages = [r.getMessage() for r in caplog.records if r.name == policy.__name__]
    assert len(messages) == 2, messages
    assert "unfused log-prob for [512 tokens, 4096 columns] on cpu" in messages[0]
    assert "fused log-prob for [2048 tokens, 4096 columns] on cpu" in messages[1] and "exceed" in messages[1]


def test_config_keys_validate() -> None:
    cfg = KernelConfig(logprob_impl="auto", logits_budget_mib=64)
    assert cfg.logits_budget_bytes == 64 * MiB
    assert KernelConfig(logits_budget_mib=0).logits_budget_bytes == 0
    with pytest.raises(ConfigError, match=r"kernels\.logits_budget_mib=-1"):
        KernelConfig(logits_budget_mib=-1)
    with pytest.raises(ConfigError, match=r"kernels\.logprob_impl='fast'"):
        KernelConfig(logprob_impl="fast")
