"""Routes of a mixture-of-experts rollout: the experts each token went through, for routing replay.

Under ``moe.routing_replay: rollout`` the trainer replays, for every input token and MoE layer, the
top-k experts the behaviour policy β used when it generated the response (``training.moe``). This
module records them on the engine side and keeps them compact:

- ``RouteRecorder`` hooks the router (``mlp.gate``) of every sparse block of a Hugging Face
  Qwen3-MoE model and captures its top-k expert ids during the engine's own decode loop;
- ``RoutedGeneration`` is a ``Generation`` that carries them, ``routes`` [T, moe_layers, k] with
  T = len(prompt) + len(response) − 1: prompt plus response minus its last token, exactly the
  tokens the trainer feeds (the last sampled token is never fed back, so no layer routed it);
- ids are stored as ``route_dtype(E)``: uint8 up to 256 experts, int16 beyond, so a token costs
  ``route_bytes_per_token`` = moe_layers × k × 1 or 2 bytes (Qwen3-30B-A3B: 48 × 8 × 1 = 384 B;
  the tiny demo MoE: 2 × 2 × 1 = 4 B).

How an engine drives the recorder (one batch of B rows, left padded, rows leave at EOS):

    recorder = RouteRecorder(model)                  # once per loaded model; hooks stay until close()
    recorder.begin([len(p) for p in prompts])         # before the prefill forward of a batch
    for step in range(max_new_tokens):
        recorder.step(active)                         # rows of ``prompts`` in the forward that follows
        logits = model(...)                           # prefill at step 0, one token per live row after
        ...                                           # sample; rows that hit EOS leave ``active``
    routes = recorder.routes(b)                       # [len(prompt_b) + len(response_b) - 1, layers, k]

The first ``step`` after ``begin`` arms the prefill: row b's routes are the last ``prompt_lengths[b]``
positions of its (left-padded) sequence. Every later ``step`` arms one decode forward in which each
live row feeds one new token, taken as the last position of its row (so an engine that re-feeds the
whole sequence without a KV cache records the same). A forward without a ``step`` before it (e.g. a
scoring pass) is not recorded.

Multi-turn trajectories (``TransformersEngine.generate_trajectories``) feed chunks instead: after an
observation a row feeds its last sampled token and the observation's tokens, other rows one token, in one
left-padded forward. ``step(live, fed=[n_a, ...])`` arms such a forward: row ``live[a]`` feeds its last
``n_a`` positions, and its routes grow by exactly those (observation tokens included: the trainer forwards
them too, and their routes shape the keys and values later tokens attend to). A batch records either
chunk steps or one-token decode steps after its prefill, never both (the two are filed differently).

The routes file of a shard (the rollout store's ``routes_00000.arrow``, the async queue's
``.routes.arrow``) is written and read here too: ``shard_routes`` checks a shard's routes before anything
is written, ``write_routes`` writes them durably and returns the record entry (``RoutesInfo``),
``group_routes`` reads one group back as read-only views of the mapped file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from megatron_mugrpo import durable
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rollout.engine import Generation
from megatron_mugrpo.rollout.shards import StoreError, write_table
from megatron_mugrpo.training.moe import moe_layer_pattern, num_experts

ROUTE_RECORDING_ENGINES = ("sglang", "transformers")
"""Rollout engines that record routes: SGLang (``SGLangEngine(record_routes=True)``) and the
transformers engine (``RouteRecorder`` in its decode loop)."""
MAX_UINT8_EXPERTS = 256
"""Expert ids 0..255 fit one byte; larger models (E <= 32768) take two."""
MAX_INT16_EXPERTS = 32768


class RouteRecordingError(InputError, RuntimeError):
    """The engine drove the recorder against its contract (rows out of range, a forward of another shape)."""


def route_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type that holds expert ids 0..num_experts-1 (uint8 up to 256 experts, else int16)."""
    if not 1 <= num_experts <= MAX_INT16_EXPERTS:
        raise RouteRecordingError(f"num_experts={num_experts}: routes store 1..{MAX_INT16_EXPERTS} experts")
    return np.dtype(np.uint8) if num_experts <= MAX_UINT8_EXPERTS else np.dtype(np.int16)


def route_bytes_per_token(moe_layers: int, topk: int, num_experts: int) -> int:
    """Bytes one token's routes take in storage: moe_layers × k × the id size."""
    return moe_layers * topk * route_dtype(num_experts).itemsize


@dataclass(frozen=True)
class RouteLayout:
    """Which layers route and how, read from a model's ``config.json`` (what an engine's raw output needs)."""

    num_layers: int
    """All decoder layers (an engine that reports per layer may report dense ones too)."""
    sparse_layers: tuple[int, ...]
    """Indices of the mixture-of-experts layers, in order: the routes' layer axis."""
    topk: int
    num_experts: int

    @property
    def dtype(self) -> np.dtype:
        return route_dtype(self.num_experts)


def route_layout(hf_config: dict[str, Any]) -> RouteLayout:
    """The ``RouteLayout`` of a Hugging Face config dict; RouteRecordingError for a dense model."""
    experts = num_experts(hf_config)
    if not experts:
        raise RouteRecordingError(
            f"model_type={hf_config.get('model_type')!r} has no experts; only mixture-of-experts models route"
        )
    pattern = moe_layer_pattern(hf_config)
    return RouteLayout(
        num_layers=len(pattern),
        sparse_layers=tuple(i for i, sparse in enumerate(pattern) if sparse),
        topk=int(hf_config["num_experts_per_tok"]),
        num_experts=experts,
    )


def routing_replay_problem(replay: str, *, engine: str, tiny_arch: str | None) -> str:
    """Why ``moe.routing_replay`` cannot work with this run, naming the keys; '' when it can.

    ``tiny_arch``: ``model.tiny.arch`` of a run that builds its own tiny model, None for a model from
    ``model.hf_dir`` (a dense one is refused when the trainer builds it, ``training.moe.check_routing_replay``).
    """
    if replay == "none":
        return ""
    if tiny_arch is not None and tiny_arch != "qwen3_moe":
        return (
            f"moe.routing_replay={replay!r} replays a mixture-of-experts model's routes, but model.tiny.arch="
            f"{tiny_arch!r} is dense; set model.tiny.arch=qwen3_moe or moe.routing_replay=none"
        )
    if engine not in ROUTE_RECORDING_ENGINES:
        return (
            f"moe.routing_replay={replay!r} needs the experts the rollout engine routed each token to, and "
            f"rollout.engine={engine!r} does not record them; use one of {ROUTE_RECORDING_ENGINES} or "
            "moe.routing_replay=none"
        )
    return ""


@dataclass
class RoutedGeneration(Generation):
    """A response with the experts that routed it (the store keeps ``routes`` next to the log-probs)."""

    routes: np.ndarray
    """[len(prompt) + len(response) - 1, moe_layers, k] expert ids (``route_dtype``), in token order,
    each token's k experts by decreasing router probability."""


def _sparse_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of the model's sparse blocks, in layer order (a block with ``experts`` and ``gate``)."""
    return [module.gate for module in model.modules() if hasattr(module, "experts") and hasattr(module, "gate")]


class RouteRecorder:
    """Captures every sparse block's top-k experts during an engine's decode loop (see the module docstring).

    Args:
        model: a Hugging Face mixture-of-experts causal LM (Qwen3-MoE: ``model.layers[i].mlp.gate``).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.num_experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
        self.topk = int(config.num_experts_per_tok)
        self.dtype = route_dtype(self.num_experts)
        self._torch_dtype = torch.uint8 if self.dtype == np.uint8 else torch.int16
        gates = _sparse_gates(model)
        if not gates:
            raise RouteRecordingError(f"{type(model).__name__} has no mixture-of-experts block (mlp.gate) to record")
        self.moe_layers = len(gates)
        self._hooks = [gate.register_forward_hook(self._capture(i)) for i, gate in enumerate(gates)]
        self._prompt_lengths: list[int] = []
        self._prefill: list[np.ndarray] = []
        self._chunks: list[list[np.ndarray]] = []
        """Per row, the routes of each chunk forward it fed (multi-turn), on the host."""
        self._fed: list[int] | None = None
        """New tokens per armed row of a chunk forward (None: the prefill or a one-token decode step)."""
        self._decode: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per decode forward: (live rows [A], routes [A, layers, k]) still on the model's device."""
        self._armed: torch.Tensor | None = None
        self._pending: list[torch.Tensor | None] = []
        self._dense: np.ndarray | None = None

    @property
    def bytes_per_token(self) -> int:
        return route_bytes_per_token(self.moe_layers, self.topk, self.num_experts)

    def begin(self, prompt_lengths: Sequence[int]) -> None:
        """Start a batch of ``len(prompt_lengths)`` rows; the next ``step`` arms its prefill forward."""
        self._prompt_lengths = [int(n) for n in prompt_lengths]
        if any(n < 1 for n in self._prompt_lengths):
            raise RouteRecordingError(f"prompt lengths {self._prompt_lengths[:8]} must be >= 1")
        self._prefill, self._decode, self._dense, self._armed = [], [], None, None
        self._chunks = [[] for _ in self._prompt_lengths]

    def step(self, live_rows: torch.Tensor | Sequence[int], fed: Sequence[int] | None = None) -> None:
        """Arm the next forward: ``live_rows`` [A] are the batch rows (indices into ``begin``'s prompts) it feeds;
        ``fed`` [A] (a chunk forward after the prefill, multi-turn): the new tokens each row feeds, the last
        positions of its left-padded row (0: none, the row waits; nothing is filed for it). None: the prefill,
        then one token per row."""
        rows = torch.as_tensor(live_rows, dtype=torch.long).reshape(-1)
        self._check_fed(rows, fed)
        batch = len(self._prompt_lengths)
        if (
            rows.numel() == 0
            or int(rows.min()) < 0
            or int(rows.max()) >= batch
            or rows.unique().numel() != rows.numel()
        ):
            raise RouteRecordingError(f"step(live_rows) needs distinct rows in [0, {batch}), got {rows.tolist()[:8]}")
        if not self._prefill and rows.numel() != batch:
            raise RouteRecordingError(
                f"the prefill forward must feed all {batch} rows of the batch, got {rows.numel()}"
            )
        self._armed, self._fed = rows, None if fed is None else [int(n) for n in fed]
        self._pending = [None] * self.moe_layers

    def _check_fed(self, rows: torch.Tensor, fed: Sequence[int] | None) -> None:
        """RouteRecordingError unless ``fed`` fits the forward ``step`` arms (see ``step``)."""
        if fed is None:
            if any(self._chunks):
                raise RouteRecordingError(
                    "a batch that fed chunks (step(rows, fed)) cannot take one-token decode steps"
                )
            return
        if not self._prefill:
            raise RouteRecordingError("the prefill forward takes no fed counts: it feeds each row's whole prompt")
        if self._decode:
            raise RouteRecordingError("a batch that took one-token decode steps cannot feed chunks (step(rows, fed))")
        # 0: a row waiting for its observation (env.overlap) feeds a masked pad column, which is no position
        if len(fed) != rows.numel() or any(int(n) < 0 for n in fed) or max(fed, default=0) < 1:
            raise RouteRecordingError(
                f"step(rows, fed) needs one count >= 1 per row that feeds (0 for a row that waits), and a row "
                f"that feeds; got {list(fed)[:8]} for {rows.numel()} rows"
            )

    def _capture(self, layer: int) -> Any:
        def hook(_gate: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if self._armed is None:
                return
            self._pending[layer] = self._top_k(output).to(self._torch_dtype)
            if layer == self.moe_layers - 1:
                self._commit()

        return hook

    def _top_k(self, output: Any) -> torch.Tensor:
        """[N, k] expert ids from a router's output: transformers 5 returns (logits, weights, indices);
        a plain linear gate (transformers 4) returns logits, whose top-k is taken as the block does."""
        if isinstance(output, tuple):
            return output[2].detach()
        return torch.softmax(output.detach().float(), dim=-1).topk(self.topk, dim=-1).indices

    def _commit(self) -> None:
        """File the armed forward's routes: [A, S, layers, k] → each row's new tokens (the last positions)."""
        rows, self._armed = self._armed, None
        if any(p is None for p in self._pending):
            raise RouteRecordingError("a forward skipped a MoE layer's router: routes would miss layers")
        live = rows.numel()
        per_layer = []
        for routes in self._pending:
            if routes.shape[0] % live:
                raise RouteRecordingError(
                    f"a forward routed {routes.shape[0]} token rows, not a multiple of {live} rows"
                )
            per_layer.append(routes.reshape(live, -1, self.topk))
        stacked = torch.stack(per_layer, dim=2)  # [A, S, layers, k], batch-major as HF flattens
        if not self._prefill:
            host = stacked.cpu().numpy()
            self._prefill = [host[b, host.shape[1] - n :] for b, n in enumerate(self._prompt_lengths)]
            if any(len(p) != n for p, n in zip(self._prefill, self._prompt_lengths)):
                raise RouteRecordingError(f"the prefill held {host.shape[1]} positions, shorter than a prompt")
        elif self._fed is not None:
            self._file_chunks(rows, stacked)
        else:
            self._decode.append((rows.to(stacked.device), stacked[:, -1]))
        self._dense = None

    def routes(self, row: int) -> np.ndarray:
        """Row ``row``'s routes so far: [prompt + fed response tokens, moe_layers, k] (``route_dtype``)."""
        if not 0 <= row < len(self._prefill):
            raise RouteRecordingError(
                f"no routes for row {row}: the batch's prefill recorded {len(self._prefill)} rows"
            )
        if self._dense is None:
            self._dense, self._decoded = self._decode_table()
        return np.concatenate([self._prefill[row], *self._chunks[row], self._dense[row, : self._decoded[row]]])

    def _file_chunks(self, rows: torch.Tensor, stacked: torch.Tensor) -> None:
        """File a chunk forward's routes [A, S, layers, k]: row ``rows[a]`` fed its last ``fed[a]`` positions."""
        fed, self._fed = self._fed, None
        host, width = stacked.cpu().numpy(), stacked.shape[1]
        if max(fed) > width:
            raise RouteRecordingError(f"a chunk forward held {width} positions, fewer than a row fed ({max(fed)})")
        for a, (row, n) in enumerate(zip(rows.tolist(), fed)):
            self._chunks[row].append(host[a, width - n :])

    def _decode_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Decode routes as [B, steps, layers, k] plus fed tokens per row (rows only ever leave, so a
        row's decode routes are the first ``fed[row]`` steps)."""
        batch = len(self._prompt_lengths)
        table = np.zeros((batch, len(self._decode), self.moe_layers, self.topk), dtype=self.dtype)
        fed = np.zeros(batch, dtype=np.int64)
        for step, (rows, routes) in enumerate(self._decode):
            index = rows.cpu().numpy()
            if (fed[index] != step).any():
                raise RouteRecordingError(f"decode step {step} fed a row that had left the batch: rows must only leave")
            table[index, step] = routes.cpu().numpy()
            fed[index] += 1
        return table, fed

    def close(self) -> None:
        """Remove the hooks (the model routes as before)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


# ---------------------------------------------------------------------------------------------------
# The routes file of a shard (the rollout store's and the async queue's)
# ---------------------------------------------------------------------------------------------------
#
# One Arrow column, one row per group, [response][token] of fixed-size lists of moe_layers × k expert
# ids in the engine's dtype. In memory that is one array of the shard's token rows concatenated plus
# offsets per response and per group, so a row is read back as [tokens, moe_layers, k] views of the
# mapped file, without a copy. Each response holds len(prompt) + len(response) - 1 rows (the trainer's
# input); ``shard_routes`` refuses anything else before anything is written.

ROUTE_DTYPES = ("uint8", "int16")
"""Expert id types a routes file holds (``route_dtype``)."""


@dataclass(kw_only=True)
class RoutesInfo:
    """A shard's routes file, as the shard's record (and the sealed manifest) lists it."""

    file: str
    checksum: durable.Checksum
    dtype: str
    """Expert id type, one of ``ROUTE_DTYPES``."""
    moe_layers: int
    topk: int
    tokens: int
    """Token rows over the whole shard (sum over responses of prompt + response - 1)."""

    @property
    def bytes_per_token(self) -> int:
        return self.moe_layers * self.topk * np.dtype(self.dtype).itemsize

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> RoutesInfo:
        checksum, rest = durable.Checksum.split_record(values)
        return cls(**rest, checksum=checksum)


def shard_routes(groups: Sequence[RolloutGroup], where: str) -> list[list[np.ndarray]] | None:
    """Every response's routes ([group][response] arrays), None when no response carries any.

    StoreError, before anything is written, when only some responses carry routes, or one's are not
    [len(prompt) + len(response) - 1, moe_layers, k] of the shard's one shape and dtype with k
    distinct experts per token."""
    samples = [(g, j, s) for g in groups for j, s in enumerate(g.samples)]
    missing = [f"prompt {g.prompt_id!r} response {j}" for g, j, s in samples if s.routes is None]
    if len(missing) == len(samples):
        return None
    if missing:
        raise StoreError(
            f"{where}: {', '.join(missing[:3])} ({len(missing)} of {len(samples)} responses) carry no routes while "
            "the others do; the engine must record routes for every response (moe.routing_replay=rollout)"
        )
    first = samples[0][2].routes
    for g, j, sample in samples:
        problem = _routes_problem(sample.routes, len(g.prompt_ids), len(sample.response_ids), first)
        if problem:
            raise StoreError(
                f"{where}: prompt {g.prompt_id!r} response {j} has routes of shape {sample.routes.shape} with "
                f"{problem}; the engine's route recording is broken, nothing was written"
            )
    return [[s.routes for s in g.samples] for g in groups]


def _routes_problem(routes: np.ndarray, prompt_len: int, response_len: int, first: np.ndarray) -> str:
    """What is wrong with one response's routes ('' when nothing); ``first``: the shard's first response's."""
    rows = prompt_len + response_len - 1
    if routes.dtype.name not in ROUTE_DTYPES:
        return f"dtype {routes.dtype.name}, not one of {ROUTE_DTYPES} (rollout.routes.route_dtype)"
    if routes.dtype != first.dtype or routes.shape[1:] != first.shape[1:]:
        return f"[{routes.dtype.name}] {routes.shape[1:]} per token, the shard's first response {first.shape[1:]}"
    if routes.shape[0] != rows:
        return f"{routes.shape[0]} rows, not {rows} (prompt {prompt_len} + response {response_len} - 1)"
    if routes.shape[2] > 1 and (np.diff(np.sort(routes, axis=-1), axis=-1) == 0).any():
        return "an expert repeated within one token's top-k"
    return ""


def routes_schema(dtype: str, width: int) -> pa.Schema:
    """One row per group: [response][token] of ``width`` = moe_layers × k expert ids."""
    return pa.schema([("routes", pa.list_(pa.list_(pa.list_(pa.from_numpy_dtype(np.dtype(dtype)), width))))])


def write_routes(path: Path, per_group: list[list[np.ndarray]]) -> RoutesInfo:
    """Write a shard's routes (``shard_routes``) as ``path``, durably; returns its record entry."""
    responses = [r for group in per_group for r in group]
    dtype, (layers, topk) = responses[0].dtype, responses[0].shape[1:]
    flat = np.concatenate([r.reshape(-1) for r in responses])
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(flat), layers * topk)
    token_offsets = np.cumsum([0] + [len(r) for r in responses], dtype=np.int32)
    per_response = pa.ListArray.from_arrays(pa.array(token_offsets), tokens)
    response_offsets = np.cumsum([0] + [len(group) for group in per_group], dtype=np.int32)
    schema = routes_schema(dtype.name, layers * topk)
    column = pa.ListArray.from_arrays(pa.array(response_offsets), per_response).cast(schema.field("routes").type)
    checksum = write_table(path, pa.Table.from_arrays([column], schema=schema))
    return RoutesInfo(
        file=path.name,
        checksum=checksum,
        dtype=dtype.name,
        moe_layers=int(layers),
        topk=int(topk),
        tokens=int(token_offsets[-1]),
    )


def group_routes(table: pa.Table, row: int, info: RoutesInfo) -> list[np.ndarray]:
    """Group ``row``'s routes from a mapped routes file: per response [tokens, moe_layers, k], read-only
    views of the mapped pages (no copy)."""
    per_response = table.column(0).slice(row, 1).combine_chunks().flatten()
    return [
        per_response[j].values.flatten().to_numpy(zero_copy_only=True).reshape(-1, info.moe_layers, info.topk)
        for j in range(len(per_response))
    ]
