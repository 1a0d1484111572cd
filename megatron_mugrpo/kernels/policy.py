"""Which log-prob path a micro-batch takes: fused (vocabulary blocks) or unfused (materialised logits).

    path = choose_logprob_path("auto", n_tokens=4096, n_columns=75968, device=torch.device("cpu"),
                               budget_bytes=128 * 2**20)            # -> "fused" | "unfused"

``kernels.logprob_impl`` names the policy (see :class:`megatron_mugrpo.kernels.config.KernelConfig`):

* ``fused``: always the fused path; it keeps the leading blocks' logits up to the budget for the
  backward and recomputes the others.
* ``unfused``: always materialised logits (Megatron's own output layer).
* ``auto``: per call. On CPU, the unfused path when the micro-batch's float32 logits
  ``[tokens, V/tp]`` fit in the budget (it then costs three matmuls and no recompute); otherwise,
  and always on GPUs, whose memory is the scarce resource, the fused path.

The choice is logged once per distinct (policy, shape, device, budget), not on every call.
"""

from __future__ import annotations

import functools
import logging

import torch

from megatron_mugrpo.kernels.config import LOGPROB_IMPLS

logger = logging.getLogger(__name__)

LOGPROB_PATHS = ("fused", "unfused")
FLOAT32_BYTES = 4


def logits_bytes(n_tokens: int, n_columns: int) -> int:
    """Bytes of float32 logits [n_tokens, n_columns]."""
    return FLOAT32_BYTES * n_tokens * n_columns


def choose_logprob_path(impl: str, *, n_tokens: int, n_columns: int, device: torch.device, budget_bytes: int) -> str:
    """The path ("fused" | "unfused") that ``impl`` ("fused" | "unfused" | "auto") takes for one call.

    Args:
        impl: the policy, ``kernels.logprob_impl``.
        n_tokens: tokens in the call (micro-batch × sequence length).
        n_columns: this rank's vocabulary rows V/tp, padding included.
        device: where the logits would live.
        budget_bytes: ``kernels.logits_budget_mib`` in bytes.
    """
    if impl in LOGPROB_PATHS:
        return impl
    if impl != "auto":
        raise ValueError(f"logprob impl={impl!r} is not one of {LOGPROB_IMPLS} (config: kernels.logprob_impl)")
    size = logits_bytes(n_tokens, n_columns)
    path = "unfused" if device.type == "cpu" and size <= budget_bytes else "fused"
    _log_choice(path, n_tokens, n_columns, device.type, size, budget_bytes)
    return path


@functools.cache
def _log_choice(path: str, n_tokens: int, n_columns: int, device: str, size: int, budget: int) -> None:
    """Log an auto choice; the cache makes it once per distinct shape, device and budget."""
    relation = "fit in" if size <= budget else "exceed"
    logger.info(
        "kernels.logprob_impl=auto: %s log-prob for [%d tokens, %d columns] on %s (float32 logits %.1f MiB %s "
        "the %.1f MiB budget)",
        path,
        n_tokens,
        n_columns,
        device,
        size / 2**20,
        relation,
        budget / 2**20,
    )
