"""RoPE's cos / sin once per embedding table in a schedule, not once per attention call.

megatron-core's unfused rotary path, ``rope_utils._apply_rotary_pos_emb_bshd`` (taken whenever
``apply_rope_fusion`` is off: always on CPU, on GPU without Transformer Engine), recomputes
``cos(freqs) * mscale`` and ``sin(freqs) * mscale`` and concatenates an empty pass-through slice for
the queries and the keys of every layer of every micro-batch: six small ops per call, 2 × layers
calls per forward, on a table that is the same for all of them (``GPTModel`` computes it once per
forward and hands it to every layer; its rotary module even caches it across forwards). At the
demo's update shape those calls were about 6% of a CPU update (``benchmarks/train_step.py``).

``shared_cos_sin()`` replaces that one function for the duration of a schedule with one that
computes cos / sin once per table and skips the empty concatenation. The values are those of the
original bit for bit (the same ops on the same inputs; ``cat`` with an empty slice only copied).
The private name is checked against the parameters it was read from (megatron-core 0.16.1), and a
megatron-core that renamed or changed it fails loudly rather than falling back to the slow path.

    with shared_cos_sin():
        schedule(...)
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

ROPE_MODULE = "megatron.core.models.common.embeddings.rope_utils"
APPLY = "_apply_rotary_pos_emb_bshd"
"""The private function replaced: megatron-core's unfused RoPE for [s, b, h, d] (and THD's per-sequence calls)."""
APPLY_PARAMS = ("t", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale")
"""Its parameters in megatron-core 0.16.1; any other signature is refused."""
MAX_TABLES = 64
"""Tables kept at once: a model hands all layers one table per forward; per-sequence slices (THD) would
otherwise pile up for the whole schedule."""
ROTATE_HALF = "_rotate_half"
"""The private helper the replacement reuses, so interleaved and half-split layouts stay megatron's."""


class RopeCompatError(RuntimeError):
    """The installed megatron-core's unfused RoPE is not the one ``shared_cos_sin`` was written for."""


def _checked(module: object) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """(the original apply function, megatron's rotate-half), or RopeCompatError naming what changed."""
    fix = f"update megatron_mugrpo/training/rope_cache.py for it (written against megatron-core 0.16.1's {APPLY})"
    apply, rotate = getattr(module, APPLY, None), getattr(module, ROTATE_HALF, None)
    if apply is None or rotate is None:
        raise RopeCompatError(f"{ROPE_MODULE} has no {APPLY} or {ROTATE_HALF}; {fix}")
    params = tuple(inspect.signature(apply).parameters)
    if params[: len(APPLY_PARAMS)] != APPLY_PARAMS:
        raise RopeCompatError(f"{ROPE_MODULE}.{APPLY} takes {params}, expected {APPLY_PARAMS}; {fix}")
    return apply, rotate


@contextmanager
def shared_cos_sin() -> Iterator[None]:
    """Within the block, megatron-core's unfused RoPE computes cos / sin once per embedding table.

    Tables are recognised by identity and version (an in-place change is a new table); the cache
    lives only as long as the block, so nothing is kept between schedules. Multi-latent attention and
    a table that requires grad take the original path."""
    module = importlib.import_module(ROPE_MODULE)
    original, rotate_half = _checked(module)
    tables: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}

    def apply(
        t: Tensor,
        freqs: Tensor,
        rotary_interleaved: bool = False,
        multi_latent_attention: bool = False,
        mscale: float = 1.0,
    ) -> Tensor:
        if multi_latent_attention or freqs.requires_grad:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        key = (id(freqs), freqs._version, float(mscale), t.dtype)
        entry = tables.get(key)
        if entry is None or entry[0] is not freqs:  # the first holder of this id may have been freed
            cos = (torch.cos(freqs) * mscale).to(t.dtype)
            sin = (torch.sin(freqs) * mscale).to(t.dtype)
            if len(tables) >= MAX_TABLES:
                tables.clear()
            entry = tables[key] = (freqs, cos, sin)
        _, cos, sin = entry
        rot_dim = freqs.shape[-1]
        if t.shape[-1] == rot_dim:  # the usual case: nothing passes through unrotated
            return t * cos + rotate_half(t, rotary_interleaved) * sin
        head, tail = t[..., :rot_dim], t[..., rot_dim:]
        return torch.cat((head * cos + rotate_half(head, rotary_interleaved) * sin, tail), dim=-1)

    setattr(module, APPLY, apply)
    try:
        yield
    finally:
        setattr(module, APPLY, original)
