"""``kernels.*``: how the trainer computes log-probs and whether its transformer layers run in FP8."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mugrpo.errors import require
from megatron_mugrpo.kernels.fp8 import FP8_RECIPES

LOGPROB_IMPLS = ("fused", "unfused", "auto")
"""'fused': chunked vocab-parallel log-prob from hidden states; 'unfused': from materialised logits;
'auto': chosen per micro-batch (``kernels.policy``)."""
DEFAULT_LOGITS_BUDGET_MIB = 128
"""Keeps a [1024 tokens, 151,936] float32 step's log-prob working memory under 1/8 of the materialised
path's (which holds about three such logits buffers) while sparing about a fifth of its recomputation."""


@dataclass(kw_only=True)
class KernelConfig:
    """Log-prob computation and low precision of the trainer."""

    logprob_impl: str = "fused"
    """'fused' (chunked vocab-parallel log-prob, default), 'unfused' (materialised logits), or 'auto': per
    micro-batch, unfused on CPU when its float32 logits [tokens, V/tp] fit in logits_budget_mib, else fused
    (the choice is logged once per shape)."""
    logits_budget_mib: float = DEFAULT_LOGITS_BUDGET_MIB
    """Logits memory (MiB per micro-batch and TP rank) the log-prob may hold to save time. The fused path
    keeps the leading vocabulary blocks' logits up to this size for the backward instead of recomputing
    them (each kept block spares one of four block matmuls; 0: least memory); 'auto' compares it with the
    whole float32 logits."""
    fp8: str = "none"
    """FP8 recipe for the transformer layers: none | delayed | current | mxfp8 (needs Transformer Engine
    and an FP8-capable GPU)."""

    def __post_init__(self) -> None:
        require(
            self.logprob_impl in LOGPROB_IMPLS,
            f"kernels.logprob_impl={self.logprob_impl!r} is not one of {LOGPROB_IMPLS}",
        )
        require(
            self.logits_budget_mib >= 0,
            f"kernels.logits_budget_mib={self.logits_budget_mib} must be >= 0 (0: keep no logits, recompute all)",
        )
        require(self.fp8 in FP8_RECIPES, f"kernels.fp8={self.fp8!r} is not one of {FP8_RECIPES}")

    @property
    def logits_budget_bytes(self) -> int:
        return int(self.logits_budget_mib * 2**20)
