"""``kernels.*``: how the trainer computes log-probs and whether its transformer layers run in FP8."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mugrpo.errors import require
from megatron_mugrpo.kernels.fp8 import FP8_RECIPES

LOGPROB_IMPLS = ("fused", "unfused")
"""'fused': chunked vocab-parallel log-prob from hidden states; 'unfused': from materialised logits."""


@dataclass(kw_only=True)
class KernelConfig:
    """Log-prob computation and low precision of the trainer."""

    logprob_impl: str = "fused"
    """'fused' (chunked vocab-parallel log-prob, default) or 'unfused' (materialised logits)."""
    fp8: str = "none"
    """FP8 recipe for the transformer layers: none | delayed | current | mxfp8 (needs Transformer Engine
    and an FP8-capable GPU)."""

    def __post_init__(self) -> None:
        require(
            self.logprob_impl in LOGPROB_IMPLS,
            f"kernels.logprob_impl={self.logprob_impl!r} is not one of {LOGPROB_IMPLS}",
        )
        require(self.fp8 in FP8_RECIPES, f"kernels.fp8={self.fp8!r} is not one of {FP8_RECIPES}")
