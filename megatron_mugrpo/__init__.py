"""megatron_mugrpo: μ-GRPO on Megatron-core.

μ-GRPO runs GRPO as a few large stages: freeze the policy, bulk-generate a static rollout dataset
with stored behaviour log-probs, then make μ = B_train / B_mini optimizer updates on it with relaxed
ratio clipping ([0, 5]) and the negative-advantage veto. See README.md.
"""

__version__ = "0.1.0"

from megatron_mugrpo.training import mcore_jit as _mcore_jit

_mcore_jit.install()  # before any of our modules imports megatron-core: no torch.compile at import on CPU
