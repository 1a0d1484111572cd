"""Names of the metrics that more than their producer reads (``report``, ``plan.actual``, the console line
of ``metrics``).

A consumer imports a name from here instead of spelling it, so a producer that renames a metric
renames it here and every reader follows. The names are grouped by the module that emits them
(``PRODUCERS``); ``tests/test_metric_names.py`` checks that each producer still emits each of its
names, and that ``report.py`` spells no metric name of its own. This module sits on the bottom floor
(it imports nothing), so any producer can import its names too.

Some producers return bare statistic names that a caller prefixes (the losses' ``clip_frac_low``
becomes ``train/clip_frac_low`` in the train step; HDR's ``headroom_mean`` becomes
``replay/headroom_mean``): their constants are the logged, prefixed names, and ``PRODUCERS`` says
where the bare name is written.
"""

from __future__ import annotations

# evaluation.py (evaluation.AVG_KEY); with it, in the same record, loop/actions.py's T_TOTAL
EVAL_AVG = "eval/avg_pass@1"
"""Mean pass@1 over the benchmarks of one evaluation."""
EVAL_PREFIX, PASS_AT_1_SUFFIX = "eval/", "/pass@1"
"""A benchmark's pass@1 is ``eval/<benchmark>/pass@1``."""

# loop/actions.py: the run's phase timers (cumulative seconds, resumed time included)
T_ROLLOUT = "perf/t_rollout_s"
T_OPTIMIZE = "perf/t_optimize_s"
T_EVAL = "perf/t_eval_s"
T_TOTAL = "perf/t_total_s"
"""Wall-clock seconds of the run so far (every evaluation record and the last one hold it)."""

# algorithms/loss_core.py and the losses (train/ added by training/train_step.py)
CLIP_LOW = "train/clip_frac_low"
CLIP_HIGH = "train/clip_frac_high"
RATIO_NEG = "train/ratio_mean_neg_adv"
"""E[ρ | A<0] over response tokens."""
RATIO_POS = "train/ratio_mean_pos_adv"
VETO_FRAC = "train/nav_vetoed_frac"
"""algorithms/loss_grpo.py: NAV-vetoed / response tokens."""
MASKED_FRAC = "train/masked_frac"
"""Response tokens any loss's mask removed (NAV, M2PO, OPSM, IcePop)."""
# training/train_step.py
LOSS = "train/loss"
"""The update's loss: its weighted sum over its normaliser."""
RESPONSE_TOKENS = "train/response_tokens"
"""Response tokens of an update: the weight of its fractions in a run's rate."""

# algorithms/replay.py (replay/ added by loop/hdr.py)
REPLAY_HEADROOM = "replay/headroom_mean"
REPLAY_HEADROOM_REJECTED = "replay/headroom_mean_rejected"
REPLAY_DRIFT = "replay/drift_mean"
REPLAY_AGE = "replay/age_mean"

# rollout/manifest.py (store_metrics, prefix rollout/) and loop/staged.py / loop/asynchronous.py
REWARD = "rollout/reward_mean"
STAGE = "rollout/stage"
"""0-based stage index of a stage's rollout record."""

# loop/asynchronous.py (async mode's update records)
LAG_MEAN = "rollout/lag_mean"
LAG_MAX = "rollout/lag_max"
TOKEN_LAG_MEAN = "rollout/token_lag_mean"
TOKEN_LAG_MAX = "rollout/token_lag_max"
DROPPED_GROUPS_TOTAL = "rollout/dropped_groups_total"
TRAINER_IDLE_RATIO = "perf/trainer_idle_ratio"
"""Time waiting for and assembling samples / the update's time."""
ROLLOUT_IDLE_RATIO = "perf/rollout_idle_ratio"

# training/moe.py (and training/routing_replay.py for the agreement)
MOE_LOAD_MIN = "train/moe_load_min"
MOE_LOAD_MAX = "train/moe_load_max"
ROUTING_AGREEMENT = "train/routing_agreement"
MOE_AUX_LOSS = "train/moe_aux_loss"
MOE_LAYER_LOAD_PATTERN = r"^train/moe_load_(min|max)_layer_(\d+)$"
"""Per-layer bounds, training.moe.load_layer_key's names."""

PRODUCERS: dict[str, tuple[str, ...]] = {
    "megatron_mugrpo/evaluation.py": (EVAL_AVG, EVAL_PREFIX, PASS_AT_1_SUFFIX),
    "megatron_mugrpo/loop/actions.py": (T_ROLLOUT, T_OPTIMIZE, T_EVAL, T_TOTAL),
    "megatron_mugrpo/algorithms/loss_core.py": (CLIP_LOW, CLIP_HIGH, RATIO_NEG, RATIO_POS),
    "megatron_mugrpo/algorithms/loss_grpo.py": (VETO_FRAC, MASKED_FRAC),
    "megatron_mugrpo/training/train_step.py": (LOSS, RESPONSE_TOKENS),
    "megatron_mugrpo/algorithms/replay.py": (
        REPLAY_HEADROOM,
        REPLAY_HEADROOM_REJECTED,
        REPLAY_DRIFT,
        REPLAY_AGE,
    ),
    "megatron_mugrpo/rollout/manifest.py": (REWARD,),
    "megatron_mugrpo/loop/staged.py": (STAGE,),
    "megatron_mugrpo/loop/asynchronous.py": (
        LAG_MEAN,
        LAG_MAX,
        TOKEN_LAG_MEAN,
        TOKEN_LAG_MAX,
        DROPPED_GROUPS_TOTAL,
        TRAINER_IDLE_RATIO,
        ROLLOUT_IDLE_RATIO,
    ),
    "megatron_mugrpo/training/moe.py": (MOE_LOAD_MIN, MOE_LOAD_MAX, ROUTING_AGREEMENT, MOE_AUX_LOSS),
}
"""Producing module (path from the repository root) → the names above it emits, in full or as the bare
name after the prefix (``train/``, ``replay/``, ``rollout/``) that its caller adds."""
