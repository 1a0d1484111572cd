"""Compatibility: run set-up moved to ``megatron_mugrpo.loop.setup``.

Only ``stage_prompts`` is re-exported here, for tests/test_evaluation.py (owned elsewhere); import it
from ``megatron_mugrpo.rollout.prompts`` and delete this module.
"""

from megatron_mugrpo.rollout.prompts import stage_prompts

__all__ = ["stage_prompts"]
