"""Every logged metric name, spelled once: its producer writes it and its readers (``report``,
``plan.actual``, ``drift_plots``, the console line of ``metrics``) read it through the same constant.

A producer that renames a metric renames it here, and every reader follows. The names are grouped by
the module that emits them (``PRODUCERS``). ``tests/test_metric_names.py`` checks that each producer
imports the constants of the names it emits, and that no module of the package spells a metric name
(a string under one of ``METRIC_PREFIXES``) outside this file, but for an explained allow-list. This
module sits on the bottom floor (it imports nothing), so any producer, even pure math, can import it.

Some producers return bare statistic names that a caller prefixes: a loss's ``clip_frac_low`` becomes
``train/clip_frac_low`` in the train step, HDR's ``headroom_mean`` becomes ``replay/headroom_mean`` in
``loop/hdr.py``. Their constants are the logged, prefixed names; the producer writes
``stat_name(CLIP_LOW)`` and the caller adds ``TRAIN_PREFIX``.
"""

from __future__ import annotations

ROLLOUT_PREFIX = "rollout/"
TRAIN_PREFIX = "train/"
PERF_PREFIX = "perf/"
"""Timers and throughputs (``metrics.Telemetry`` accepts only names under it)."""
EVAL_PREFIX = "eval/"
"""A benchmark's metric is ``eval/<benchmark>/<stat>``."""
REPLAY_PREFIX = "replay/"
METRIC_PREFIXES = (ROLLOUT_PREFIX, TRAIN_PREFIX, PERF_PREFIX, EVAL_PREFIX, REPLAY_PREFIX)
"""Every metric name starts with one of these (``metrics.check_metric_name``)."""


def stat_name(metric: str) -> str:
    """``metric`` without its prefix: the key a component returns for its caller to prefix
    (``stat_name(CLIP_LOW) == "clip_frac_low"``, which the train step logs as ``train/clip_frac_low``)."""
    return metric.partition("/")[2]


# evaluation.py (evaluation.AVG_KEY); with it, in the same record, loop/actions.py's T_TOTAL
EVAL_AVG = "eval/avg_pass@1"
"""Mean pass@1 over the benchmarks of one evaluation."""
PASS_AT_1_SUFFIX = "/pass@1"
"""A benchmark's pass@1 is ``eval/<benchmark>/pass@1``."""

# loop/actions.py: the run's phase timers (cumulative seconds, resumed time included)
T_ROLLOUT = "perf/t_rollout_s"
T_OPTIMIZE = "perf/t_optimize_s"
T_EVAL = "perf/t_eval_s"
T_TOTAL = "perf/t_total_s"
"""Wall-clock seconds of the run so far (every evaluation record and the last one hold it)."""
STAGE_OVERHEAD_PREFIX = "perf/stage_overhead_"
"""A part of a stage's boundary is ``perf/stage_overhead_<part>_s`` (``loop.actions.overhead_part``)."""

# loop/staged.py
STAGE = "rollout/stage"
"""0-based stage index of a stage's rollout record."""
TRAIN_STAGE = "train/stage"
"""The stage of an optimizer update's record (``drift_plots`` indexes updates within it)."""
UPDATE_S = "perf/update_s"
TRAIN_TOKENS_PER_S = "perf/train_tokens_per_s"
STAGE_OVERHEAD = "perf/stage_overhead_s"
"""A stage's rollout seconds besides sampling."""
STAGE_OVERHEAD_OTHER = "perf/stage_overhead_other_s"
"""STAGE_OVERHEAD less its measured parts."""

# loop/engines.py
WEIGHT_SYNC_S = "perf/weight_sync_s"
WEIGHT_SYNC_GB_PER_S = "perf/weight_sync_gb_per_s"

# loop/hdr.py (HDR's own timers; algorithms/replay.py's statistics get REPLAY_PREFIX there)
REPLAY_SELECT_S = "perf/replay_select_s"
REPLAY_RECHECK_S = "perf/replay_recheck_s"

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

# algorithms/diagnostics.py: the paper's drift diagnostics (train/ added by training/train_step.py)
TRIGGER_COUNT = "train/trigger_count"
TRIGGER_POS_FRAC = "train/trigger_pos_frac"
"""First trigger position κ / T, over the responses with a trigger (NaN when none had one)."""
POST_TRIGGER_SUFFIX_LEN = "train/post_trigger_suffix_len"
"""Tokens after the first trigger, over the responses with a trigger (NaN when none had one)."""
NEG_ADV_LOW_RATIO_FRAC = "train/neg_adv_low_ratio_frac"
KL_BEHAVIOUR_K3 = "train/kl_behaviour_k3"

# training/train_step.py
LOSS = "train/loss"
"""The update's loss: its weighted sum over its normaliser."""
NORMALISER = "train/normaliser"
RESPONSE_TOKENS = "train/response_tokens"
"""Response tokens of an update: the weight of its fractions in a run's rate."""
LOGPROB_GAP_MEAN = "train/rollout_logprob_abs_diff_mean"
LOGPROB_GAP_MAX = "train/rollout_logprob_abs_diff_max"
"""Largest |trainer − behaviour| log-prob of an update (``logging.logprob_gap_tolerance`` checks it)."""
GRAD_NORM = "train/grad_norm"
LR = "train/lr"
UPDATE_SUCCESSFUL = "train/update_successful"
DP_TOKEN_IMBALANCE = "perf/dp_token_imbalance"
PADDING_FRAC = "perf/padding_frac"

# algorithms/replay.py (replay/ added by loop/hdr.py)
REPLAY_HEADROOM = "replay/headroom_mean"
REPLAY_HEADROOM_REJECTED = "replay/headroom_mean_rejected"
REPLAY_DRIFT = "replay/drift_mean"
REPLAY_AGE = "replay/age_mean"

# rollout/manifest.py (store_metrics) and rewards/registry.py (reward_metrics), under a caller's prefix
REWARD = "rollout/reward_mean"

# rollout/generate.py
ROLLOUT_SAMPLING_S = "perf/rollout_sampling_s"
STAGE_OVERHEAD_REWARD = "perf/stage_overhead_reward_s"
STAGE_OVERHEAD_STORE_WRITE = "perf/stage_overhead_store_write_s"
ROLLOUT_TOKENS = "perf/rollout_tokens"
ROLLOUT_TIME_S = "perf/rollout_time_s"
ROLLOUT_TOKENS_PER_S = "perf/rollout_tokens_per_s"
ROLLOUT_SHARDS_RESUMED = "perf/rollout_shards_resumed"
ROLLOUT_SHARDS_WRITTEN = "perf/rollout_shards_written"
ROLLOUT_ENGINES = "perf/rollout_engines"
ROLLOUT_SHARDS_MAX_PER_ENGINE = "perf/rollout_shards_max_per_engine"

# rollout/watchdog.py
ENGINE_RESTARTS = "perf/rollout_engine_restarts"

# algorithms/rollout_correction.py (rollout/ added by training/stage_reference.py)
MISMATCH_KL = "rollout/mismatch_kl"
MISMATCH_LOGPROB_ABS_MEAN = "rollout/mismatch_logprob_abs_mean"
MISMATCH_LOGPROB_ABS_MAX = "rollout/mismatch_logprob_abs_max"
MISMATCH_TOKENS = "rollout/mismatch_tokens"

# loop/asynchronous.py (async mode's update records)
LAG_MEAN = "rollout/lag_mean"
LAG_MAX = "rollout/lag_max"
TOKEN_LAG_MEAN = "rollout/token_lag_mean"
TOKEN_LAG_MAX = "rollout/token_lag_max"
DROPPED_GROUPS = "rollout/dropped_groups"
DROPPED_GROUPS_TOTAL = "rollout/dropped_groups_total"
PAUSED_BATCHES = "rollout/paused_batches"
PAUSED_BATCHES_TOTAL = "rollout/paused_batches_total"
QUEUE_POSITION = "rollout/queue_position"
QUEUE_BACKLOG = "rollout/queue_backlog"
SAMPLE_WAIT_S = "perf/sample_wait_s"
WEIGHT_SYNC_MIB = "perf/weight_sync_mib"
TRAINER_IDLE_RATIO = "perf/trainer_idle_ratio"
"""Time waiting for and assembling samples / the update's time."""
ROLLOUT_IDLE_RATIO = "perf/rollout_idle_ratio"

# training/moe.py (and training/routing_replay.py for the agreement's stage summaries)
MOE_LOAD_MIN = "train/moe_load_min"
MOE_LOAD_MAX = "train/moe_load_max"
ROUTING_AGREEMENT = "train/routing_agreement"
ROUTING_AGREEMENT_FIRST = "train/routing_agreement_first"
ROUTING_AGREEMENT_STAGE_MEAN = "train/routing_agreement_stage_mean"
MOE_AUX_LOSS = "train/moe_aux_loss"
MOE_Z_LOSS = "train/moe_z_loss"
MOE_LAYER_LOAD_PATTERN = r"^train/moe_load_(min|max)_layer_(\d+)$"
"""Per-layer bounds, ``moe_layer_load_key``'s names."""


MOE_LOAD_BOUNDS = {"min": MOE_LOAD_MIN, "max": MOE_LOAD_MAX}


def moe_layer_load_key(bound: str, layer: int) -> str:
    """``train/moe_load_{min,max}_layer_NN``: the load bound of one MoE layer (0-based global index)."""
    return f"{MOE_LOAD_BOUNDS[bound]}_layer_{layer:02d}"


PRODUCERS: dict[str, tuple[str, ...]] = {
    "megatron_mugrpo/evaluation.py": (EVAL_AVG, EVAL_PREFIX, PASS_AT_1_SUFFIX),
    "megatron_mugrpo/loop/actions.py": (T_ROLLOUT, T_OPTIMIZE, T_EVAL, T_TOTAL, STAGE_OVERHEAD_PREFIX),
    "megatron_mugrpo/loop/staged.py": (
        STAGE,
        TRAIN_STAGE,
        UPDATE_S,
        TRAIN_TOKENS_PER_S,
        STAGE_OVERHEAD,
        STAGE_OVERHEAD_OTHER,
    ),
    "megatron_mugrpo/loop/engines.py": (WEIGHT_SYNC_S, WEIGHT_SYNC_GB_PER_S),
    "megatron_mugrpo/loop/hdr.py": (REPLAY_SELECT_S, REPLAY_RECHECK_S),
    "megatron_mugrpo/algorithms/loss_core.py": (CLIP_LOW, CLIP_HIGH, RATIO_NEG, RATIO_POS),
    "megatron_mugrpo/algorithms/loss_grpo.py": (VETO_FRAC, MASKED_FRAC),
    "megatron_mugrpo/algorithms/loss_m2po.py": (MASKED_FRAC,),
    "megatron_mugrpo/algorithms/loss_opsm.py": (MASKED_FRAC,),
    "megatron_mugrpo/algorithms/loss_icepop.py": (MASKED_FRAC,),
    "megatron_mugrpo/algorithms/diagnostics.py": (
        TRIGGER_COUNT,
        TRIGGER_POS_FRAC,
        POST_TRIGGER_SUFFIX_LEN,
        NEG_ADV_LOW_RATIO_FRAC,
        KL_BEHAVIOUR_K3,
    ),
    "megatron_mugrpo/training/train_step.py": (
        LOSS,
        NORMALISER,
        RESPONSE_TOKENS,
        LOGPROB_GAP_MEAN,
        LOGPROB_GAP_MAX,
        GRAD_NORM,
        LR,
        UPDATE_SUCCESSFUL,
        DP_TOKEN_IMBALANCE,
        PADDING_FRAC,
    ),
    "megatron_mugrpo/algorithms/replay.py": (
        REPLAY_HEADROOM,
        REPLAY_HEADROOM_REJECTED,
        REPLAY_DRIFT,
        REPLAY_AGE,
    ),
    "megatron_mugrpo/rollout/manifest.py": (REWARD,),
    "megatron_mugrpo/rewards/registry.py": (REWARD,),
    "megatron_mugrpo/rollout/generate.py": (
        ROLLOUT_SAMPLING_S,
        STAGE_OVERHEAD_REWARD,
        STAGE_OVERHEAD_STORE_WRITE,
        ROLLOUT_TOKENS,
        ROLLOUT_TIME_S,
        ROLLOUT_TOKENS_PER_S,
        ROLLOUT_SHARDS_RESUMED,
        ROLLOUT_SHARDS_WRITTEN,
        ROLLOUT_ENGINES,
        ROLLOUT_SHARDS_MAX_PER_ENGINE,
    ),
    "megatron_mugrpo/rollout/watchdog.py": (ENGINE_RESTARTS,),
    "megatron_mugrpo/algorithms/rollout_correction.py": (
        MISMATCH_KL,
        MISMATCH_LOGPROB_ABS_MEAN,
        MISMATCH_LOGPROB_ABS_MAX,
        MISMATCH_TOKENS,
    ),
    "megatron_mugrpo/loop/asynchronous.py": (
        T_ROLLOUT,
        T_OPTIMIZE,
        STAGE,
        WEIGHT_SYNC_S,
        WEIGHT_SYNC_MIB,
        LAG_MEAN,
        LAG_MAX,
        TOKEN_LAG_MEAN,
        TOKEN_LAG_MAX,
        DROPPED_GROUPS,
        DROPPED_GROUPS_TOTAL,
        PAUSED_BATCHES,
        PAUSED_BATCHES_TOTAL,
        QUEUE_POSITION,
        QUEUE_BACKLOG,
        SAMPLE_WAIT_S,
        TRAINER_IDLE_RATIO,
        ROLLOUT_IDLE_RATIO,
    ),
    "megatron_mugrpo/training/moe.py": (MOE_LOAD_MIN, MOE_LOAD_MAX, ROUTING_AGREEMENT, MOE_AUX_LOSS, MOE_Z_LOSS),
    "megatron_mugrpo/training/routing_replay.py": (ROUTING_AGREEMENT_FIRST, ROUTING_AGREEMENT_STAGE_MEAN),
}
"""Producing module (path from the repository root) → the names above it emits, through their constants
(a bare name as ``stat_name(CONSTANT)`` under the prefix its caller adds). The prefixes themselves
(``METRIC_PREFIXES``) belong to no one producer."""
