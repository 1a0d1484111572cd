"""How an update's rows become data-parallel shares and micro-batches: pure arithmetic on row lengths.

The trainer (``training.train_step``) receives one update's rows padded to the longest row of the
whole update. Two policies cut them into micro-batches:

* **fixed rows** (``parallel.micro_batch_size``): rank r takes a contiguous equal share of the rows
  and cuts it into micro-batches of ``micro_batch_size`` rows, each as wide as the whole update.
  Empty filler rows make the shares equal.
* **token budget** (``parallel.micro_batch_tokens``): rows are first shared over the data-parallel
  ranks by tokens, not rows (``partition_by_tokens``), then each rank sorts its rows by length and
  fills micro-batches longest first: a micro-batch is as wide as its own longest row and holds at
  most ``micro_batch_tokens`` tokens, padding included (``budget_micro_batches``). With long-tailed
  response lengths most micro-batches are much narrower than the update's longest row.

Neither choice changes the update: every loss returns (loss_sum, normaliser) per row, so any split of
the rows over micro-batches and ranks gives Σ ∇loss_sum / Σ normaliser (``algorithms.losses``).

Worked example, lengths [9, 3, 8, 2, 5, 4] on 2 ranks with a budget of 16 tokens:
  ``partition_by_tokens``: longest first onto the least-loaded rank (ties: lower rank) —
  9→r0, 8→r1, 5→r1 (13), 4→r0 (13), 3→r0 (16), 2→r1 (15): r0 = rows [0, 1, 5], r1 = rows [2, 3, 4].
  ``budget_micro_batches`` on r0 (lengths 9, 4, 3): [9] alone (2 × 9 > 16), then [4, 3] (2 × 4 ≤ 16):
  two micro-batches of 9 and 8 tokens, instead of 3 × 9 = 27 padded to the longest row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: which of the update's rows it holds and its padded shape."""

    rows: tuple[int, ...]
    """Indices into the update's rows, in micro-batch order (may be empty: a filler micro-batch)."""
    length: int
    """Columns: every row is cut or padded to this many (no real target lies beyond it)."""
    size: int
    """Rows including empty filler rows (mask 0): >= len(rows) and >= 1."""
    bins: tuple[tuple[int, ...], ...] = ()
    """Packed sequences: the update's rows each packed row holds, in order (empty: not packed)."""
    packed_width: int = 0
    """Columns of each packed row (packed micro-batches only)."""

    @property
    def tokens(self) -> int:
        """Tokens the micro-batch computes, padding included."""
        return len(self.bins) * self.packed_width if self.bins else self.size * self.length


def row_lengths(response_mask: torch.Tensor) -> list[int]:
    """Columns each row needs: up to and including its last response target.

    ``response_mask`` [B, L]. Position t's logits predict ``targets[t]``; under causal attention they
    depend only on tokens[:t + 1], so the columns after a row's last response target change nothing
    and can be cut. A row without response tokens needs 1 column (it adds 0 to every sum).
    """
    length = response_mask.shape[1]
    columns = torch.arange(1, length + 1, device=response_mask.device)
    last = torch.where(response_mask.bool(), columns, 0).amax(dim=1) if length else torch.zeros(0)
    return [max(int(n), 1) for n in last.tolist()]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def partition_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Rows shared over ``parts`` ranks with about equal tokens: longest first onto the least-loaded
    rank (greedy longest-processing-time: the heaviest rank carries at most 4/3 of the optimum).

    Returns each rank's row indices in ascending order; ties go to the lower rank, so every rank
    computes the same answer.
    """
    if parts < 1:
        raise ValueError(f"cannot partition rows over {parts} ranks")
    loads = [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(parts), key=lambda p: (loads[p], p))
        shares[rank].append(row)
        loads[rank] += lengths[row]
    return [sorted(share) for share in shares]


def budget_micro_batches(rows: list[int], lengths: list[int], budget: int, multiple: int = 1) -> list[MicroBatchPlan]:
    """``rows`` cut into micro-batches of at most ``budget`` tokens, padding included.

    Rows go longest first, so each micro-batch's first row sets its width (rounded up to
    ``multiple``: sequence parallelism splits the columns over TP). A row wider than the budget is
    an error that names the option to raise.
    """
    plans: list[MicroBatchPlan] = []
    current: list[int] = []
    width = 0
    for row in sorted(rows, key=lambda i: (-lengths[i], i)):
        needed = round_up(lengths[row], multiple)
        if needed > budget:
            raise ValueError(
                f"a row of {lengths[row]} tokens (prompt + response) does not fit parallel.micro_batch_tokens="
                f"{budget}; raise it to at least rollout.max_prompt_tokens + rollout.max_new_tokens"
            )
        if current and (len(current) + 1) * width > budget:
            plans.append(MicroBatchPlan(rows=tuple(current), length=width, size=len(current)))
            current = []
        if not current:
            width = needed
        current.append(row)
    if current:
        plans.append(MicroBatchPlan(rows=tuple(current), length=width, size=len(current)))
    return plans


def first_fit_decreasing(rows: list[int], lengths: list[int], width: int) -> list[list[int]]:
    """``rows`` packed into bins of ``width`` columns: longest first, each into the first bin it fits
    (at most 11/9 of the optimal bin count plus one)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda i: (-lengths[i], i)):
        slot = next((b for b, free in enumerate(room) if free >= lengths[row]), None)
        if slot is None:
            bins.append([])
            room.append(width)
            slot = len(bins) - 1
        bins[slot].append(row)
        room[slot] -= lengths[row]
    return bins


def packed_micro_batches(rows: list[int], lengths: list[int], budget: int, multiple: int = 1) -> list[MicroBatchPlan]:
    """``rows`` packed several to a row: packed rows as wide as the longest of ``rows`` (rounded up to
    ``multiple``), filled first-fit decreasing, ``budget // width`` packed rows per micro-batch."""
    if not rows:
        return []
    width = round_up(max(lengths[r] for r in rows), multiple)
    if width > budget:
        raise ValueError(
            f"a row of {width} tokens (prompt + response) does not fit parallel.micro_batch_tokens={budget}; "
            "raise it to at least rollout.max_prompt_tokens + rollout.max_new_tokens"
        )
    bins = first_fit_decreasing(rows, lengths, width)
    per_micro_batch = budget // width
    plans = []
    for start in range(0, len(bins), per_micro_batch):
        chosen = tuple(tuple(b) for b in bins[start : start + per_micro_batch])
        members = tuple(r for b in chosen for r in b)
        plans.append(
            MicroBatchPlan(
                rows=members,
                length=round_up(max(lengths[r] for r in members), multiple),
                size=len(members),
                bins=chosen,
                packed_width=width,
            )
        )
    return plans


def fixed_micro_batches(num_rows: int, length: int, dp: int, micro_batch_size: int) -> list[list[MicroBatchPlan]]:
    """Each rank's micro-batches of ``micro_batch_size`` rows, all ``length`` wide: rank r takes the
    r-th contiguous equal share of the rows, filler rows appended at the end so the shares are equal."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 (config: parallel.micro_batch_size)")
    per_rank = round_up(num_rows, dp * micro_batch_size) // dp
    ranks = []
    for rank in range(dp):
        starts = range(rank * per_rank, (rank + 1) * per_rank, micro_batch_size)
        ranks.append(
            [
                MicroBatchPlan(
                    rows=tuple(range(start, min(start + micro_batch_size, num_rows))),
                    length=length,
                    size=micro_batch_size,
                )
                for start in starts
            ]
        )
    return ranks


def token_budget_plan(
    lengths: list[int], dp: int, budget: int, multiple: int = 1, *, pack: bool = False
) -> list[list[MicroBatchPlan]]:
    """Each rank's token-budget micro-batches (packed ones with ``pack``) after sharing the rows by
    tokens. Every rank gets the same number of micro-batches (empty one-row fillers appended):
    expert-parallel all-to-alls and the schedule's collectives need every rank to run as many forward
    passes as the others."""
    if budget < 1:
        raise ValueError(f"parallel.micro_batch_tokens={budget} must be >= 1")
    cut = packed_micro_batches if pack else budget_micro_batches
    ranks = [cut(share, lengths, budget, multiple) for share in partition_by_tokens(lengths, dp)]
    count = max(1, max(len(plans) for plans in ranks))
    filler = MicroBatchPlan(rows=(), length=multiple, size=1)
    return [plans + [filler] * (count - len(plans)) for plans in ranks]


def plan_update(
    lengths: list[int],
    *,
    width: int,
    dp: int,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    multiple: int = 1,
    pack: bool = False,
) -> list[list[MicroBatchPlan]]:
    """Every DP rank's micro-batches for an update whose rows need ``lengths`` columns of ``width``.

    ``micro_batch_tokens`` None: fixed rows of ``micro_batch_size``; else the token budget, with
    several sequences per row when ``pack``. ``multiple``: every micro-batch's width is a multiple of
    it (the TP size under sequence parallelism).
    """
    if micro_batch_tokens is None:
        if pack:
            raise ValueError("parallel.pack_sequences needs parallel.micro_batch_tokens (the packed rows' budget)")
        return fixed_micro_batches(len(lengths), round_up(width, multiple), dp, micro_batch_size)
    return token_budget_plan(lengths, dp, micro_batch_tokens, multiple, pack=pack)


def token_imbalance(ranks: list[list[MicroBatchPlan]]) -> float:
    """The most-loaded rank's computed tokens (padding included) over the mean over ranks (1.0: even)."""
    loads = [sum(plan.tokens for plan in plans) for plans in ranks]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def padding_fraction(ranks: list[list[MicroBatchPlan]], lengths: list[int]) -> float:
    """Share of the computed tokens (all ranks) that are padding: 1 − Σ row lengths / Σ micro-batch tokens."""
    computed = sum(plan.tokens for plans in ranks for plan in plans)
    return 1.0 - sum(lengths) / computed if computed > 0 else 0.0
