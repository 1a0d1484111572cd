"""Token-budget micro-batches, packed sequences and token-balanced data parallelism
(``training.batching``, ``training.packing``) leave the update unchanged.

* The planner's arithmetic on worked examples (no processes).
* The (loss_sum, normaliser) contract in float64, once per registry loss, NAV scope, aggregation,
  rollout correction and a batch holding HDR-replayed groups: the update's loss, gradient and
  metrics over token-budget micro-batches spread over two ranks equal those of the whole batch at
  once, to 1e-6 (they agree to rounding, ~1e-15).
* Packed rows: each token sees only its own sequence; the model's log-probs of packed rows equal
  those of the sequences alone in float64.
* Through Megatron's schedule (float32, tolerances as in ``test_train_step``): token-budget and
  packed micro-batches vs fixed ones on one rank, at DP = 2, at PP = 2 (whose stages then exchange
  activations of different shapes), at TP = 2 with sequence parallelism, and with MoE routing
  replay.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from omegaconf import OmegaConf

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.losses import LossStats, MuGrpoOptions, available_losses, has_update_pass
from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig
from megatron_mugrpo.algorithms.veto import VETO_SCOPES
from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.records import RolloutGroup, RolloutSample, TrainBatch, collate
from megatron_mugrpo.training.batching import (
    MicroBatchPlan,
    budget_micro_batches,
    first_fit_decreasing,
    fixed_micro_batches,
    packed_micro_batches,
    padding_fraction,
    partition_by_tokens,
    row_lengths,
    token_budget_plan,
    token_imbalance,
)
from megatron_mugrpo.training.moe import MoeConfig
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.packing import pack_micro_batch, per_sequence_rotary
from megatron_mugrpo.training.parallel import ParallelConfig, initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.train_step import (
    forward_logprobs,
    policy_loss_fn,
    take,
    train_step,
    with_update_inputs,
)

from .common import VOCAB, hf_config

ATOL = 2e-6
"""float32 agreement for reordered sums (as in test_train_step)."""
EXACT = 1e-6
"""float64: the split only reorders additions."""
OPTIM = OptimConfig(lr=1e-3, eps=1e-4)
"""Adam's first step is lr · g / (|g| + eps): at the default eps 1e-8 a gradient element near 1e-9
turns float32 reordering noise into an lr-sized step; eps 1e-4 keeps the weights' comparison at ATOL."""
BUDGET = 48
"""Tokens per micro-batch in the model tests: several micro-batches of different widths."""

# ------------------------------------------------------------------------------------ planner


def test_worked_example_of_the_module_docstring():
    lengths = [9, 3, 8, 2, 5, 4]
    assert partition_by_tokens(lengths, 2) == [[0, 1, 5], [2, 3, 4]]
    assert budget_micro_batches([0, 1, 5], lengths, budget=16) == [
        MicroBatchPlan(rows=(0,), length=9, size=1),
        MicroBatchPlan(rows=(5, 1), length=4, size=2),
    ]
    plans = token_budget_plan(lengths, dp=2, budget=16)
    # r1 (lengths 8, 2, 5): [8, 5] (2 × 8 = 16) then [2]; both ranks run 2 micro-batches.
    assert plans[1] == [MicroBatchPlan(rows=(2, 4), length=8, size=2), MicroBatchPlan(rows=(3,), length=2, size=1)]
    assert token_imbalance(plans) == pytest.approx(18 / ((17 + 18) / 2))  # r0: 9 + 8, r1: 16 + 2
    assert padding_fraction(plans, lengths) == pytest.approx(1 - 31 / 35)


def test_budget_counts_padding_and_rounds_to_the_sequence_parallel_multiple():
    lengths = [5, 5, 5, 3]
    # width 6 under multiple 2: 6 + 6 + 6 = 18 > 16 so two rows, then [5, 3] at width 6.
    assert budget_micro_batches([0, 1, 2, 3], lengths, budget=16, multiple=2) == [
        MicroBatchPlan(rows=(0, 1), length=6, size=2),
        MicroBatchPlan(rows=(2, 3), length=6, size=2),
    ]
    with pytest.raises(ValueError, match=r"parallel\.micro_batch_tokens=4"):
        budget_micro_batches([0], [5], budget=4)


def test_ranks_get_as_many_micro_batches_with_empty_fillers():
    plans = token_budget_plan([10, 10, 10], dp=2, budget=10)  # r0: rows 0 and 2, r1: row 1 and a filler
    assert [len(p) for p in plans] == [2, 2]
    assert MicroBatchPlan(rows=(), length=1, size=1) in plans[0] + plans[1]


def test_fixed_rows_are_todays_contiguous_shares():
    plans = fixed_micro_batches(5, length=7, dp=2, micro_batch_size=2)
    assert [[p.rows for p in rank] for rank in plans] == [[(0, 1), (2, 3)], [(4,), ()]]
    assert {p.tokens for rank in plans for p in rank} == {14}


def test_greedy_partition_balances_tokens_not_rows():
    lengths = [100, 1, 1, 1, 1, 96]
    shares = partition_by_tokens(lengths, 2)
    assert [sum(lengths[i] for i in share) for share in shares] == [100, 100]
    assert sorted(len(s) for s in shares) == [1, 5]


def test_row_lengths_end_at_the_last_response_target():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]], dtype=torch.float32)
    assert row_lengths(mask) == [3, 1, 5]


def test_config_keys_are_checked():
    with pytest.raises(ConfigError, match=r"parallel\.micro_batch_tokens"):
        ParallelConfig(micro_batch_tokens=0)
    with pytest.raises(ConfigError, match=r"parallel\.pack_sequences=true needs parallel\.micro_batch_tokens"):
        ParallelConfig(pack_sequences=True)


# ---------------------------------------------------------------- the loss contract, float64


def _long_tailed_groups(seed: int, groups: int = 4, group_size: int = 4, stage: int = 0) -> list[RolloutGroup]:
    """Prompt groups whose response lengths span 1..40 tokens, with π_old and varied advantages."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
        samples = []
        for _ in range(group_size):
            length = min(40, max(1, int(rng.lognormvariate(2.0, 0.9))))
            behaviour = [-4.6 + rng.uniform(-1.0, 1.0) for _ in range(length)]
            samples.append(
                RolloutSample(
                    response_ids=[rng.randrange(3, VOCAB) for _ in range(length)],
                    behaviour_logprobs=behaviour,
                    old_logprobs=[b + rng.uniform(-0.6, 0.6) for b in behaviour],
                    finish_reason="stop",
                    advantage=rng.uniform(-1.5, 1.5),
                )
            )
        out.append(RolloutGroup(prompt_id=f"{seed}-{g}", prompt_ids=prompt, answer="", samples=samples, stage=stage))
    return out


def _options(loss: str, scope: str = "seq", **algo: Any) -> dict[str, Any]:
    """The loss's options; NAV at a threshold that triggers on this data (the paper's 1e-4 would not)."""
    return AlgoConfig(loss=loss, mu_grpo=MuGrpoOptions(veto_threshold=0.5, veto_scope=scope), **algo).loss_options()


CORRECTION = RolloutCorrectionConfig(tis_cap=2.0, mask_bound=1.5)
CORRECTION_REJECT_SEQ = RolloutCorrectionConfig(tis_cap=2.0, mask_bound=1.5, mask_mode="reject", level="sequence")

CONTRACT_CASES: dict[str, tuple[str, dict[str, Any], RolloutCorrectionConfig | None, bool]] = {
    **{f"loss-{name}": (name, _options(name), None, False) for name in available_losses()},
    **{f"nav-{scope}": ("mu_grpo", _options("mu_grpo", scope), None, False) for scope in VETO_SCOPES},
    "token_mean": ("mu_grpo", _options("mu_grpo", aggregation="token_mean"), None, False),
    "correction-token": ("mu_grpo", _options("mu_grpo"), CORRECTION, False),
    "correction-m2po-reject-seq": ("m2po", _options("m2po"), CORRECTION_REJECT_SEQ, False),
    "hdr-replayed-groups": ("mu_grpo", _options("mu_grpo"), None, True),
}


def _contract_batch(replayed: bool) -> TrainBatch:
    fresh = _long_tailed_groups(1)
    if replayed:  # HDR: replayed groups (an earlier stage's, their generation-time log-probs) come first
        old = _long_tailed_groups(2, groups=2, stage=0)
        for group in old:
            for sample in group.samples:
                sample.behaviour_logprobs = [b - 0.8 for b in sample.behaviour_logprobs]
        fresh = old + _long_tailed_groups(1, stage=1)
    batch = collate(fresh, pad_id=0)
    return batch.map_rows(lambda t: t.double() if t.is_floating_point() else t)


@pytest.mark.parametrize("case", CONTRACT_CASES, ids=str)
def test_token_budget_split_is_exact_in_float64(case):
    """Σ loss_sum / Σ normaliser, its gradient w.r.t. the log-probs and every loss metric, over
    token-budget micro-batches on 2 DP ranks, equal the whole batch's, for the loss ``case`` names."""
    name, options, correction, replayed = CONTRACT_CASES[case]
    caps = correction.loss_options() if correction is not None else {}
    batch = _contract_batch(replayed)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(batch.behaviour_logprobs.shape, generator=gen, dtype=torch.float64)
    logprobs = (batch.behaviour_logprobs + 0.7 * noise * batch.response_mask).requires_grad_()
    if has_update_pass(name):
        batch = with_update_inputs(batch, logprobs.detach(), name, options, caps)
    loss_fn = policy_loss_fn(name, options, caps)

    whole_sum, whole_norm, whole = loss_fn(batch, logprobs)
    (whole_grad,) = torch.autograd.grad(whole_sum / whole_norm, logprobs)

    plans = token_budget_plan(row_lengths(batch.response_mask), dp=2, budget=BUDGET)
    flat = [plan for rank in plans for plan in rank]
    assert len({p.length for p in flat}) > 2, "the split exercises micro-batches of different widths"
    carrying = dataclasses.replace(batch, behaviour_logprobs=logprobs)  # take() carries the graph
    parts = [loss_fn(take(batch, p), take(carrying, p).behaviour_logprobs) for p in flat]
    split_sum, split_norm = sum(p[0] for p in parts), sum(p[1] for p in parts)
    (split_grad,) = torch.autograd.grad(split_sum / split_norm, logprobs)

    assert int(split_norm) == int(whole_norm)
    assert float(split_sum / split_norm) == pytest.approx(float(whole_sum / whole_norm), abs=EXACT)
    torch.testing.assert_close(split_grad, whole_grad, atol=EXACT, rtol=0)
    expected = LossStats.merge([whole["stats"]]).finish()
    merged = LossStats.merge([p[2]["stats"] for p in parts]).finish()
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert merged[key] == pytest.approx(value, abs=EXACT, nan_ok=True), key


def test_the_contract_cases_exercise_what_they_check():
    """NAV vetoes, the correction masks and M2PO masks something on the contract's data."""
    batch = _contract_batch(False)
    noise = torch.randn(batch.behaviour_logprobs.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logprobs = batch.behaviour_logprobs + 0.7 * noise * batch.response_mask
    for case, key in (("nav-seq", "nav_vetoed_tokens"), ("loss-m2po", "m2_masked_tokens")):
        name, options, _, _ = CONTRACT_CASES[case]
        mb = with_update_inputs(batch, logprobs, name, options, {}) if has_update_pass(name) else batch
        stats = policy_loss_fn(name, options, {})(mb, logprobs)[2]["stats"]
        assert LossStats.merge([stats]).finish()[key] > 0, case


def test_take_carries_each_rows_routes():
    """Routing replay: a micro-batch's routes are its own rows' routes, cut with the row."""
    batch = collate(_long_tailed_groups(3), pad_id=0)
    routes = torch.randint(0, 4, (*batch.tokens.shape, 2, 2), dtype=torch.uint8)
    batch = dataclasses.replace(batch, routes=routes)
    for rank in token_budget_plan(row_lengths(batch.response_mask), dp=2, budget=BUDGET):
        for plan in rank:
            mb = take(batch, plan)
            for i, row in enumerate(plan.rows):
                assert torch.equal(mb.routes[i], routes[row, : plan.length])
                assert torch.equal(mb.tokens[i], batch.tokens[row, : plan.length])


# ------------------------------------------------------------------------------------ packing


def test_first_fit_decreasing_and_packed_micro_batches():
    lengths = [9, 3, 8, 2, 5, 4]
    # width 9, longest first into the first bin with room: 9 | 8 | 5 + 4 | 3 + 2 (8's bin has 1 left).
    assert first_fit_decreasing(list(range(6)), lengths, 9) == [[0], [2], [4, 5], [1, 3]]
    plans = packed_micro_batches(list(range(6)), lengths, budget=18)  # 2 packed rows of 9 per micro-batch
    assert [p.bins for p in plans] == [((0,), (2,)), ((4, 5), (1, 3))]
    assert [(p.rows, p.length, p.packed_width, p.tokens) for p in plans] == [
        ((0, 2), 9, 9, 18),
        ((4, 5, 1, 3), 5, 9, 18),
    ]


def test_packed_rows_keep_each_sequence_to_itself():
    batch = _model_batch()
    lengths = row_lengths(batch.response_mask)
    plan = next(p for p in packed_micro_batches(list(range(12)), lengths, BUDGET) if len(p.bins[0]) > 1)
    mb = take(batch, plan)
    packed = pack_micro_batch(mb, plan, lengths)
    # unpack() of the packed tokens / positions gives each row's own tokens / positions back
    torch.testing.assert_close(packed.unpack(packed.tokens), torch.where(packed.valid, mb.tokens, 0))
    columns = torch.arange(mb.tokens.shape[1]).expand_as(mb.tokens)
    torch.testing.assert_close(packed.unpack(packed.positions), torch.where(packed.valid, columns, 0))
    # token (r, j) sees token (r, k) iff same sequence and k <= j
    seg = torch.full(packed.tokens.shape, -1)
    seg.view(-1)[packed.index[packed.valid]] = torch.arange(len(plan.rows)).repeat_interleave(packed.valid.sum(1))
    r, j, k = 0, packed.tokens.shape[1] - 1, 0
    for r in range(packed.tokens.shape[0]):
        for j in range(packed.tokens.shape[1]):
            for k in range(packed.tokens.shape[1]):
                sees = bool(seg[r, j] >= 0 and seg[r, j] == seg[r, k] and k <= j)
                assert bool(packed.attention_mask[r, 0, j, k]) is not sees


def _packed_logprobs_in_float64(rank: int, world_size: int) -> None:
    """The model's log-probs of packed rows equal those of the sequences alone, in float64 (the
    kernels take float32 at most, so this scores the logits directly)."""
    groups = initialize_parallel(1, 1, seed=0)
    model = build_policy(hf_config(), groups=groups, dtype=torch.float64, optim=OPTIM).unwrapped()[0].eval()
    batch = _model_batch()
    lengths = row_lengths(batch.response_mask)
    vocab = hf_config()["vocab_size"]

    def scores(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logits[..., :vocab].log_softmax(-1).gather(-1, targets[..., None])[..., 0]

    worst, packed_rows = 0.0, 0
    with torch.no_grad():
        for plan in token_budget_plan(lengths, dp=1, budget=BUDGET, pack=True)[0]:
            mb = take(batch, plan)
            packed = pack_micro_batch(mb, plan, lengths)
            with per_sequence_rotary(model, packed.positions):
                together = packed.unpack(
                    scores(model(packed.tokens, packed.positions, packed.attention_mask), packed.targets)
                )
            positions = torch.arange(mb.tokens.shape[1]).expand_as(mb.tokens)
            alone = scores(model(mb.tokens, positions, None), torch.where(mb.response_mask.bool(), mb.targets, 0))
            mask = mb.response_mask.bool()
            worst = max(worst, float((together - alone)[mask].abs().max()))
            packed_rows += sum(len(b) > 1 for b in plan.bins)
            # without the block-diagonal mask a packed sequence attends to its neighbours
            if any(len(b) > 1 for b in plan.bins):
                leaky = packed.unpack(scores(model(packed.tokens, packed.positions, None), packed.targets))
                assert float((leaky - alone)[mask].abs().max()) > 1e-3
    assert packed_rows > 0
    assert worst < EXACT, worst


# ------------------------------------------------------------------ through Megatron's schedule


def _policy(seed: int = 0, **kwargs: Any) -> Policy:
    groups = initialize_parallel(kwargs.pop("tp", 1), kwargs.pop("pp", 1), seed=seed)
    return build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=OPTIM, **kwargs)


def _params(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.unwrapped()[0].named_parameters()}


def _assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=ATOL, rtol=0, msg=f"parameter {name} differs")


def _model_batch() -> TrainBatch:
    return collate(_long_tailed_groups(4, groups=3, group_size=4), pad_id=0)


VARIANTS = {
    "fixed": {"micro_batch_tokens": None},
    "budget": {"micro_batch_tokens": BUDGET},
    "packed": {"micro_batch_tokens": BUDGET, "pack_sequences": True},
}
"""Today's 4-row micro-batches, token-budget ones, and packed rows under the same budget."""


def _budget_vs_fixed(policy_kwargs: dict[str, Any], batch: TrainBatch, losses: tuple[str, ...]) -> dict[str, Any]:
    """Every variant from the same weights gives fixed micro-batches' log-probs, metrics and weights."""
    results: dict[str, Any] = {}
    for name in losses:
        runs = {}
        for variant, options in VARIANTS.items():
            policy = _policy(seed=0, **policy_kwargs)
            score = dict(temperature=1.0, micro_batch_size=4, **options)
            logprobs = forward_logprobs(policy, batch, **score)
            metrics = train_step(policy, batch, loss_name=name, loss_options=_options(name), **score)
            runs[variant] = (logprobs, metrics, _params(policy))
        lf, mf, pf = runs["fixed"]
        for variant in ("budget", "packed"):
            lb, mb, pb = runs[variant]
            torch.testing.assert_close(lb, lf, atol=ATOL, rtol=0, msg=variant)
            for key, value in mf.items():
                if not key.startswith("perf/"):
                    assert mb[key] == pytest.approx(value, abs=ATOL, rel=ATOL, nan_ok=True), (name, variant, key)
            _assert_params_close(pb, pf)
        results[name] = {variant: metrics for variant, (_, metrics, _) in runs.items()}
    return results


def _single_rank(rank: int, world_size: int) -> None:
    metrics = _budget_vs_fixed({}, _model_batch(), ("m2po",))["m2po"]  # μ-GRPO: the multi-rank tests
    padding = {variant: m["perf/padding_frac"] for variant, m in metrics.items()}
    assert padding["packed"] < padding["budget"] < padding["fixed"], padding
    assert metrics["budget"]["perf/dp_token_imbalance"] == 1.0


def _routing_replay(rank: int, world_size: int) -> None:
    """MoE with the rollout's routes replayed: the routes follow their rows into sorted, cut micro-batches
    and their tokens into packed rows (routes that did not would route other tokens' experts and change
    the log-probs)."""
    config = hf_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    batch = _model_batch()
    gen = torch.Generator().manual_seed(1)
    routes = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(batch.tokens.numel() * 2)])
    batch = dataclasses.replace(batch, routes=routes.reshape(*batch.tokens.shape, 2, 2).to(torch.uint8))
    runs = []
    for options in VARIANTS.values():
        groups = initialize_parallel(1, 1, seed=0)
        policy = build_policy(
            config,
            groups=groups,
            dtype=torch.float32,
            optim=OPTIM,
            moe=MoeConfig(routing_replay="rollout"),
        )
        score = dict(temperature=1.0, micro_batch_size=4, **options)
        logprobs = forward_logprobs(policy, batch, **score)
        metrics = train_step(policy, batch, loss_name="mu_grpo", loss_options=_options("mu_grpo"), **score)
        runs.append((logprobs, metrics["train/loss"], _params(policy)))
    for other in runs[1:]:  # token budget, packed
        torch.testing.assert_close(other[0], runs[0][0], atol=ATOL, rtol=0)
        assert other[1] == pytest.approx(runs[0][1], abs=ATOL)
        _assert_params_close(other[2], runs[0][2])


def _data_parallel(rank: int, world_size: int) -> None:
    """DP = 2: a by-tokens share per rank gives the update of today's contiguous row shares."""
    batch = _model_batch()
    metrics = _budget_vs_fixed({}, batch, ("mu_grpo",))["mu_grpo"]
    fixed, budget = metrics["fixed"], metrics["budget"]
    plans = token_budget_plan(row_lengths(batch.response_mask), dp=2, budget=BUDGET)
    assert budget["perf/dp_token_imbalance"] == pytest.approx(token_imbalance(plans))
    assert 1.0 <= budget["perf/dp_token_imbalance"] < 1.25
    assert budget["perf/padding_frac"] < fixed["perf/padding_frac"]


def _pipeline_parallel(rank: int, world_size: int) -> None:
    """PP = 2: the stages exchange activations of a different shape per micro-batch."""
    _budget_vs_fixed({"pp": 2}, _model_batch(), ("mu_grpo",))


def _tensor_and_sequence_parallel(rank: int, world_size: int) -> None:
    """TP = 2 with sequence parallelism: micro-batch and packed widths are multiples of TP."""
    _budget_vs_fixed({"tp": 2, "sequence_parallel": True}, _model_batch(), ("mu_grpo",))


@pytest.mark.parametrize(
    "body", [_single_rank, _routing_replay, _packed_logprobs_in_float64], ids=lambda fn: fn.__name__.strip("_")
)
def test_one_rank_token_budget_equals_fixed_micro_batches(body):
    run_distributed(body, 1)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "body",
    [_data_parallel, _pipeline_parallel, _tensor_and_sequence_parallel],
    ids=lambda fn: fn.__name__.strip("_"),
)
def test_two_ranks_token_budget_equals_fixed_micro_batches(body):
    run_distributed(body, 2)


# --------------------------------------------------------------------------------------- config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted((CONFIGS / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_paper_models_use_token_budget_micro_batches_at_todays_peak_memory(path):
    cfg = OmegaConf.load(path)
    longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    assert cfg.parallel.micro_batch_tokens == cfg.parallel.micro_batch_size * longest


def test_a_budget_below_the_longest_row_is_a_config_error():
    with pytest.raises(ConfigError, match=r"parallel\.micro_batch_tokens=10 is below the longest row .* at least 64"):
        load_config(CONFIGS / "demo_cpu.yaml", ["parallel.micro_batch_tokens=10"])
    assert load_config(CONFIGS / "demo_cpu.yaml", ["parallel.micro_batch_tokens=64"]).parallel.micro_batch_tokens == 64
