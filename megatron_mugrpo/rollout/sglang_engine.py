"""SGLang rollout engine (GPU): the offline ``sglang.Engine`` serving the frozen behaviour policy.

SGLang is an optional extra (``pip install 'megatron_mugrpo[sglang]'``, it brings its own CUDA
torch and needs a GPU), so it is imported only when this engine is built. Supported versions:
``SUPPORTED_SGLANG`` (the extra's pin). The calls below were checked against SGLang's own source
for both ends of that window: ``tools/sglang_contract.py`` reads a wheel with ``ast`` into a JSON
snapshot, and ``tests/rollout/test_sglang_contract.py`` runs this engine's life cycle against a
stand-in ``sglang`` module built from each checked-in snapshot. That is a test of our calls, not a
GPU run (see the README for which GPU checks have run).

Behaviour log-probs come from ``meta_info["output_token_logprobs"]``, (logprob, token_id, text)
tuples (text is None unless asked for; it is never read here) computed from the temperature-scaled
logits; sampling uses top_p = 1, top_k = -1 (off) and min_p = 0 so that they equal
log_softmax(logits / T), what the trainer scores. The environment variable
``SGLANG_RETURN_ORIGINAL_LOGPROB`` would make them T = 1 log-probs: the engine refuses to start
with it set. Temperatures below ``engine.MIN_TEMPERATURE`` are refused by ``SamplingParams``
(SGLang decodes greedily below 1e-6, with T = 1 log-probs).

Weights are refreshed each stage with ``update_weights_from_tensor`` (tensors streamed from the
trainer, in buckets) or ``update_weights_from_disk`` (an exported HF directory). From SGLang
0.5.21 tensor updates must run inside a weight-update session (``begin_weight_update`` /
``end_weight_update``, where SGLang also post-processes quantized weights); the engine opens one
when SGLang has it. A ModelOpt FP8 model cannot be reloaded in place in any version read (its FP8
layers drop their weight loaders after the first load, and a failed reload kills SGLang's
scheduler and this process tree): an engine built on an FP8 checkpoint refuses reloads, and
``rollout.quantization`` builds a new engine for each stage instead.

``release()`` hands the weights' and KV cache's GPU memory back (``release_memory_occupation``) for
the optimizer phase, and the next weight load resumes it. ``shutdown()`` stops SGLang's processes;
SGLang kills *every* child process of the caller there, so pools of the caller must be closed first
or restarted after (``rewards.VerifierPool`` replaces workers it finds dead).

A server that dies or stops answering mid-stage is replaced by the engine watchdog
(``rollout.watchdog``): ``shutdown()`` (in a thread of its own, bounded), a new engine built with
the same arguments, and the stage's weights pushed again from the host's
copy with ``load_weights`` (or, for an FP8 behaviour policy, the new engine built on the re-exported
checkpoint), without a collective. ``tests/rollout/test_watchdog_sglang.py`` checks that life cycle
against the snapshots.

Seeds: with ``rollout.sglang.deterministic`` SGLang runs its deterministic inference mode and every
response gets its own ``sampling_seed`` (derived from the call's seed, the prompt and the response
index), so a stage's data do not depend on how many engines made it or how requests were batched
(reproducible on one machine and SGLang version, at SGLang's speed cost of that mode). Without it
SGLang ignores per-request seeds, and a stage sampled twice differs (only the transformers engine on
CPU is bitwise reproducible by default).

Multi-turn trajectories (``generate_trajectories``, ``env.enabled``): token in, token out, as the vLLM
engine does it. Each turn is one ``generate(input_ids=prompt + trajectory so far)`` request (ids, never
re-encoded), with ``return_logprob`` and no ``logprob_start_len``, so SGLang returns the output tokens'
log-probs only and its radix cache serves the earlier turns (a finished request's tokens stay cached;
asking for the prompt's log-probs would stop the prefix match there; deterministic mode turns the cache
off for attention backends that cannot run both). Each turn has its own ``sampling_seed``
(deterministic mode) from (call seed, prompt, turn). No stop strings are sent: SGLang
matches them on its own detokenised text, not on the ``decode`` the environment reads, so every sampled
turn is replayed token by token through the transformers engine's rules (stop string, turn cap, EOS,
token budget) and cut where one ends it; what SGLang sampled past the cut is dropped (it changes none of
the kept tokens' log-probs), at the price of decoding it. EOS is the model's ``eos_token_id`` (config.json
and generation_config.json, as SGLang reads it) or the token SGLang's ``finish_reason`` says it stopped at:
0.5.10 checks the length cap before EOS (an EOS sampled as the last allowed token finishes as 'length'),
0.5.23 EOS first, so the finish reason alone does not say whether a turn ended on EOS. Each request fits
SGLang's context length: ``env.max_total_tokens`` must stay below ``max_position_embeddings`` (0.5.10
refuses a request that reaches it). ``tests/rollout/test_sglang_multiturn.py`` checks all of this against
the snapshots' stand-in.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_mugrpo.envs.base import EnvLimits, Episode
from megatron_mugrpo.envs.trajectory import Trajectory, TrajectoryBuilder, env_steps, replay_sampled
from megatron_mugrpo.errors import InputError, MissingInputError, require
from megatron_mugrpo.rollout.engine import (
    Generation,
    ProgressCallback,
    SamplingParams,
    check_prompt_ids,
    derive_seed,
    responses_per_prompt,
    validate_generations,
)
from megatron_mugrpo.rollout.routes import RoutedGeneration, RouteLayout, route_layout

log = logging.getLogger(__name__)

SUPPORTED_SGLANG = ">=0.5.10,<0.5.24"
"""The window of SGLang versions whose source this engine was checked against (setup.py's extra).
0.5.10 is the first with per-request ``sampling_seed`` and routed-expert output; 0.5.21 added the
weight-update session; 0.5.23 is the newest read."""
_WINDOW = ((0, 5, 10), (0, 5, 24))
INSTALL_HINT = (
    f"SGLang is not installed: pip install 'megatron_mugrpo[sglang]' (sglang{SUPPORTED_SGLANG}, needs a CUDA GPU)"
)
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
"""SGLang's switch that returns log-probs of the raw logits (T = 1) instead of log_softmax(logits / T)."""
QUANT_CONFIG_FILE = "hf_quant_config.json"
"""What marks a ModelOpt-quantized checkpoint (rollout.quantization's export writes it)."""
WEIGHT_BUCKET_BYTES = 512 * 1024**2
"""Tensors sent per ``update_weights_from_tensor`` call: bounds the serialised copy in flight."""
REQUEST_CHUNK = 4096
"""Rows submitted per ``generate`` call: SGLang batches them internally; the chunk paces progress."""


@dataclass(kw_only=True)
class SGLangEngineConfig:
    """``rollout.sglang.*``: knobs of the SGLang engine (GPU)."""

    mem_fraction_static: float = 0.7
    """GPU memory fraction SGLang takes for weights + KV cache."""
    enable_memory_saver: bool = True
    """Let ``release()`` hand the GPU memory back for the optimizer phase (needs torch_memory_saver)."""
    deterministic: bool = False
    """SGLang's deterministic inference with one ``sampling_seed`` per response: a stage's data then do
    not depend on the number of engines or on batching (slower decoding). Off: SGLang ignores seeds."""

    def __post_init__(self) -> None:
        require(
            0.0 < self.mem_fraction_static < 1.0,
            f"rollout.sglang.mem_fraction_static={self.mem_fraction_static} must be in (0, 1)",
        )


class SGLangNotInstalledError(ImportError):
    """SGLang could not be imported."""


class SGLangContractError(InputError, RuntimeError):
    """SGLang is set up in a way this engine cannot use correctly; the message says what to change."""


def import_sglang() -> Any:
    """Import SGLang lazily, or raise SGLangNotInstalledError with the install hint."""
    try:
        import sglang
    except ImportError as exc:
        raise SGLangNotInstalledError(f"{INSTALL_HINT} ({exc})") from exc
    return sglang


def check_environment(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """Refuse settings under which SGLang's log-probs are not log_softmax(logits / T)."""
    value = environ.get(ORIGINAL_LOGPROB_ENV, "")
    if value.strip().lower() in ("1", "true"):
        raise SGLangContractError(
            f"{ORIGINAL_LOGPROB_ENV}={value} makes SGLang return log-probs of the untempered logits, so the "
            "stored behaviour log-probs would not be the distribution the trainer scores and every importance "
            f"ratio would be biased: unset {ORIGINAL_LOGPROB_ENV} before starting the run"
        )


def check_version(version: str) -> None:
    """Warn when the installed SGLang lies outside the window this engine was checked against."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if len(numbers) == 3 and not _WINDOW[0] <= numbers < _WINDOW[1]:
        log.warning(
            "SGLang %s is outside the versions this engine was checked against (sglang%s); run "
            "`python tools/sglang_contract.py --check %s` to see what changed",
            version,
            SUPPORTED_SGLANG,
            version,
        )


class SGLangEngine:
    """Rollout engine on SGLang's offline ``Engine`` (one process group per engine, GPU only).

    Args:
        hf_dir: local Hugging Face directory (config.json, weights, tokenizer); a ModelOpt FP8
            checkpoint (with ``hf_quant_config.json``) makes a quantized engine that refuses reloads.
        mem_fraction_static: GPU memory fraction for weights + KV cache (rollout.sglang.mem_fraction_static).
        seed: SGLang's ``random_seed``.
        tp_size: SGLang tensor parallelism (rollout.tensor_parallel: the ranks of this engine's group).
        base_gpu_id: first local GPU of the engine's workers (its host rank's GPU; they use tp_size GPUs).
        dtype: 'auto', 'bfloat16', 'float16' or 'float32'.
        enable_memory_saver: let ``release()`` free GPU memory (needs the ``torch_memory_saver``
            package SGLang uses); when False, release() only flushes the KV cache.
        deterministic: SGLang's ``enable_deterministic_inference`` plus a ``sampling_seed`` per response.
        record_routes: return each response's routed experts (``RoutedGeneration.routes``, for
            ``moe.routing_replay=rollout``): SGLang's ``enable_return_routed_experts`` (see ``routes_from_output``).
        **server_kwargs: further ``sglang.srt.server_args.ServerArgs`` fields.
    """

    name = "sglang"

    def __init__(
        self,
        hf_dir: str | Path,
        *,
        mem_fraction_static: float = 0.7,
        seed: int = 0,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        dtype: str = "auto",
        enable_memory_saver: bool = True,
        deterministic: bool = False,
        record_routes: bool = False,
        **server_kwargs: Any,
    ) -> None:
        check_environment()
        sglang = import_sglang()
        check_version(str(getattr(sglang, "__version__", "")))
        if not torch.cuda.is_available():
            raise RuntimeError("the SGLang engine needs a CUDA GPU; use rollout.engine=transformers on CPU")
        self.vocab_size = _hf_vocab_size(hf_dir)
        self.eos_token_ids = _hf_eos_ids(hf_dir)
        self.context_length = server_kwargs.get("context_length") or _hf_positions(hf_dir)
        self.quantized = (Path(hf_dir) / QUANT_CONFIG_FILE).is_file()
        if deterministic:
            server_kwargs["enable_deterministic_inference"] = True
        self._routes = _hf_route_layout(hf_dir) if record_routes else None
        if record_routes:
            server_kwargs["enable_return_routed_experts"] = True
        self._engine = sglang.Engine(
            model_path=str(hf_dir),
            mem_fraction_static=mem_fraction_static,
            random_seed=seed,
            tp_size=tp_size,
            base_gpu_id=base_gpu_id,
            dtype=dtype,
            enable_memory_saver=enable_memory_saver,
            **server_kwargs,
        )
        self._memory_saver = enable_memory_saver
        self._deterministic = deterministic
        self._gpu = torch.device("cuda", base_gpu_id)
        self._released = False
        self._weights_valid = True

    def load_hf_dir(self, path: str) -> None:
        """Load new weights of the same architecture from a local HF directory, in place."""
        self._refuse_quantized_reload(
            f"update_weights_from_disk({path})", quantized=(Path(path) / QUANT_CONFIG_FILE).is_file()
        )
        self._resume()
        self._weights_valid = False
        _check_ok(self._engine.update_weights_from_disk(str(path)), f"update_weights_from_disk({path})")
        self._weights_valid = True

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors in buckets of about WEIGHT_BUCKET_BYTES inside one weight-update
        session; the KV cache is flushed once, with the last bucket. Until every bucket and the
        session's end succeeded the engine's weights count as invalid (``generate`` refuses).
        Tensors in pinned host memory (a memory publication, staged outside SGLang's GPU fraction) go to
        the GPU one bucket at a time (``_on_gpu``)."""
        self._refuse_quantized_reload("update_weights_from_tensor")
        self._resume()
        self._weights_valid = False
        with self._weight_update_session():
            for bucket, last in _buckets(named_tensors, WEIGHT_BUCKET_BYTES):
                result = self._engine.update_weights_from_tensor(_on_gpu(bucket, self._gpu), flush_cache=last)
                _check_ok(result, f"update_weights_from_tensor({[n for n, _ in bucket][:3]}...)")
        self._weights_valid = True

    @contextmanager
    def _weight_update_session(self) -> Iterator[None]:
        """SGLang >= 0.5.21 refuses tensor updates outside ``begin_weight_update()`` /
        ``end_weight_update()``; older versions have no session. The session is closed even when a
        bucket failed, and both of its answers are checked."""
        begin = getattr(self._engine, "begin_weight_update", None)
        if begin is None:
            yield
            return
        _check_ok(begin(), "begin_weight_update()")
        try:
            yield
        finally:
            ended = self._engine.end_weight_update()
        _check_ok(ended, "end_weight_update()")

    def _refuse_quantized_reload(self, what: str, *, quantized: bool = False) -> None:
        """Raise for any in-place load into, or of, a ModelOpt FP8 model (``quantized``: the new weights are)."""
        if self.quantized or quantized:
            raise SGLangContractError(
                f"{what}: SGLang cannot reload a ModelOpt FP8 model in place (its FP8 layers drop their weight "
                "loaders after the first load, and the failed reload kills SGLang's scheduler and this process "
                "tree). Build a new engine for the new checkpoint (rollout.quantization does so every stage)"
            )

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int],
        params: SamplingParams,
        progress: ProgressCallback | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n`` (or ``n[i]``) responses per prompt; rows are expanded here (one request per
        response) so that SGLang's radix cache shares each prompt's prefix."""
        self._check_weights()
        counts = responses_per_prompt(n, len(prompts))
        check_prompt_ids(prompts, self.vocab_size)
        rows = [(i, k) for i, c in enumerate(counts) for k in range(c)]
        result: list[list[Generation]] = [[] for _ in prompts]
        for start in range(0, len(rows), REQUEST_CHUNK):
            chunk = rows[start : start + REQUEST_CHUNK]
            outputs = self._engine.generate(
                input_ids=[prompts[i] for i, _ in chunk],
                sampling_params=self._sampling(params, chunk),
                return_logprob=True,
                **({"return_routed_experts": True} if self._routes is not None else {}),
            )
            if len(outputs) != len(chunk):
                raise RuntimeError(f"SGLang answered {len(outputs)} outputs for {len(chunk)} requests")
            for (i, _), output in zip(chunk, outputs):
                gen = generation_from_output(output)
                if self._routes is not None:
                    gen = routed_generation(gen, output, prompt_len=len(prompts[i]), layout=self._routes)
                result[i].append(gen)
            if progress is not None:
                progress(len(chunk))
        validate_generations(
            result, counts, vocab_size=self.vocab_size, max_new_tokens=params.max_new_tokens, engine=self.name
        )
        return result

    def _check_weights(self) -> None:
        if not self._weights_valid:
            raise RuntimeError(
                "the SGLang engine holds no valid weights (released, or a weight load failed): "
                "load weights (load_hf_dir / load_weights) first"
            )

    def _sampling(self, params: SamplingParams, rows: list[tuple[int, int]]) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang sampling parameters: one dict for the call, or (deterministic) one per response with its
        own seed from (call seed, prompt, response index)."""
        sampling = {
            "temperature": params.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "max_new_tokens": params.max_new_tokens,
        }
        if not self._deterministic:
            return sampling
        return [sampling | {"sampling_seed": derive_seed(params.seed, i, k)} for i, k in rows]

    # --------------------------------------------------------------- multi-turn

    def generate_trajectories(
        self,
        prompts: list[list[int]],
        episodes: list[Episode],
        params: SamplingParams,
        *,
        limits: EnvLimits,
        decode: Callable[[list[int]], str],
        stop_strings: Sequence[str] = (),
    ) -> list[Trajectory]:
        """One multi-turn trajectory per prompt, with ``episodes[i]`` as prompt i's environment, token in, token
        out (the module docstring): per round, one request per live trajectory over its ids so far, each
        sampled turn replayed through the transformers engine's rules, the environment called on the turns
        that ended (``guarded_step``, those of one round at once)."""
        if len(episodes) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(episodes)} episodes; give one episode per prompt")
        if self._routes is not None:
            raise ValueError("multi-turn rollouts do not record MoE routes yet; set moe.routing_replay=none")
        self._check_weights()
        check_prompt_ids(prompts, self.vocab_size)
        require(
            self.context_length is None or limits.max_total_tokens < self.context_length,
            f"env.max_total_tokens={limits.max_total_tokens} must be below the SGLang model's context length "
            f"{self.context_length} (SGLang refuses a request whose input + max_new_tokens reaches it); lower it",
        )
        rows = [
            TrajectoryBuilder(prompt_length=len(p), episode=e, limits=limits, max_turn_tokens=params.max_new_tokens)
            for p, e in zip(prompts, episodes)
        ]
        eos = set(self.eos_token_ids)
        live = list(range(len(rows)))
        while live:
            turns = self._sample_turns(prompts, rows, live, params)
            ended = [rows[i] for i, turn in zip(live, turns) if replay_turn(rows[i], turn, eos, decode, stop_strings)]
            for row, result in zip(ended, env_steps(ended, decode, self.vocab_size)):
                row.apply(result)
            live = [i for i in live if not rows[i].done]
        return [row.build() for row in rows]

    def _sample_turns(
        self, prompts: list[list[int]], rows: list[TrajectoryBuilder], live: list[int], params: SamplingParams
    ) -> list[tuple[Generation, bool]]:
        """One turn for each live row over its prompt and trajectory so far: at most the turn cap and the
        tokens left in the budget (``guarded_step`` leaves at least one). Returns (turn, SGLang stopped at
        its last token) pairs."""
        sampling = []
        for i in live:
            row = rows[i]
            cap = min(params.max_new_tokens, row.limits.max_total_tokens - row.total_tokens)
            turn = self._sampling(replace(params, max_new_tokens=max(1, cap)), [(i, len(row.turns))])
            sampling.append(turn[0] if isinstance(turn, list) else turn)
        turns = []
        for start in range(0, len(live), REQUEST_CHUNK):
            chunk = live[start : start + REQUEST_CHUNK]
            outputs = self._engine.generate(
                input_ids=[prompts[i] + rows[i].token_ids for i in chunk],
                sampling_params=sampling[start : start + REQUEST_CHUNK],
                return_logprob=True,
            )
            if len(outputs) != len(chunk):
                raise RuntimeError(f"SGLang answered {len(outputs)} outputs for {len(chunk)} requests")
            turns += [turn_from_output(output, self.vocab_size) for output in outputs]
        return turns

    def release(self) -> None:
        """Free the weights' and KV cache's GPU memory; load weights again before generating.
        Without the memory saver only the KV cache is flushed (and the weights stay valid)."""
        if not self._memory_saver:
            _check_ok(self._engine.flush_cache(), "flush_cache()")
        elif not self._released:
            self._engine.release_memory_occupation()
            self._released, self._weights_valid = True, False

    def _resume(self) -> None:
        if self._released:
            self._engine.resume_memory_occupation()
            self._released = False

    def shutdown(self) -> None:
        """Stop SGLang's processes (the engine cannot be used afterwards). SGLang kills every child
        process of this process here: close or restart the caller's own pools (see the module docstring)."""
        self._weights_valid = False
        self._engine.shutdown()


def _buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """(bucket, is_last) pairs of about ``limit`` bytes each; one empty bucket when there is no tensor
    (so the cache flush still happens)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    ready: list[tuple[str, torch.Tensor]] | None = None
    for name, tensor in named_tensors:
        if ready is not None:
            yield ready, False
            ready = None
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            ready, bucket, size = bucket, [], 0
    yield (ready if ready is not None else bucket), True


def _on_gpu(bucket: list[tuple[str, torch.Tensor]], gpu: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The bucket with its pinned host tensors copied to ``gpu`` (blocking: SGLang's scheduler reads them by
    CUDA IPC from another process): SGLang receives the tensors of a publication staged on the host the way
    it receives a GPU's, and the GPU holds at most one bucket of them beyond SGLang's fraction."""
    return [(name, tensor.to(gpu) if tensor.is_pinned() else tensor) for name, tensor in bucket]


def generation_from_output(output: dict[str, Any]) -> Generation:
    """Convert one SGLang output dict (``return_logprob=True``) into a Generation."""
    meta = output["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise ValueError("SGLang output has no meta_info['output_token_logprobs']: was return_logprob=True passed?")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length"):
        raise RuntimeError(f"SGLang request finished with {reason!r} (aborted?): {meta.get('error', '')}")
    return Generation(
        response_ids=[int(p[1]) for p in pairs],
        logprobs=[float(p[0]) if p[0] is not None else float("nan") for p in pairs],
        finish_reason=kind,
    )


def turn_from_output(output: dict[str, Any], vocab_size: int) -> tuple[Generation, bool]:
    """One multi-turn request's output: (the sampled turn, whether SGLang stopped at its last token).

    The request sends no stop strings, so a 'stop' finish must name the token id it matched, the last one
    sampled (``{'type': 'stop', 'matched': id}``); anything else (a string, SGLang's 'NaN happened') is an
    SGLangContractError, and so is a token id outside the model's vocabulary."""
    gen = generation_from_output(output)
    bad = [t for t in gen.response_ids if not 0 <= t < vocab_size]
    if bad:
        raise SGLangContractError(f"SGLang sampled token id {bad[0]} outside the model's vocabulary ({vocab_size} ids)")
    if gen.finish_reason != "stop":
        return gen, False
    matched = output["meta_info"]["finish_reason"].get("matched")
    if isinstance(matched, bool) or not isinstance(matched, int) or not gen.response_ids:
        raise SGLangContractError(
            f"SGLang stopped a turn at {matched!r}, not at a token id: this engine sends no stop strings, so a "
            "turn may end only at EOS or its max_new_tokens"
        )
    if matched != gen.response_ids[-1]:
        raise SGLangContractError(f"SGLang stopped at token {matched} but its last token is {gen.response_ids[-1]}")
    return gen, True


def replay_turn(
    row: TrajectoryBuilder,
    turn: tuple[Generation, bool],
    eos: set[int],
    decode: Callable[[list[int]], str],
    stop_strings: Sequence[str],
) -> bool:
    """Feed a sampled turn to ``row`` (``envs.trajectory.replay_sampled``; EOS: a token of ``eos``, or the
    one SGLang stopped at); True when the turn goes to the environment."""
    gen, stopped_last = turn
    to_env = replay_sampled(
        row, gen.response_ids, gen.logprobs, eos=eos, decode=decode, stop_strings=stop_strings, eos_at_last=stopped_last
    )
    if to_env is None:
        raise SGLangContractError(
            f"SGLang ended a turn after {len(gen.response_ids)} tokens ({gen.finish_reason}), before its "
            "max_new_tokens or EOS"
        )
    return to_env


def _check_ok(result: Any, what: str) -> None:
    """Raise when an SGLang call reports failure, or answers in a shape this engine does not know.

    SGLang's answers, as read from its source for both ends of SUPPORTED_SGLANG (the snapshots'
    ``returns``): (success, message[, num_paused_requests]) tuples (weight updates, the weight-update
    session) and objects with a bool ``success`` and a ``message`` (``flush_cache``'s FlushCacheReqOutput);
    a dict of the same or a bare bool is taken too. Anything else (None, an empty tuple, a success that is
    not a bool) is an SGLangContractError: an answer not understood is never taken for success.
    """
    if isinstance(result, bool):
        ok, message = result, ""
    elif isinstance(result, dict) and "success" in result:
        ok, message = result["success"], result.get("message", "")
    elif isinstance(result, (tuple, list)) and result:
        ok, message = result[0], result[1] if len(result) > 1 else ""
    elif hasattr(result, "success") and not isinstance(result, (dict, tuple, list)):
        ok, message = result.success, getattr(result, "message", "")
    else:
        ok, message = None, ""
    if not isinstance(ok, bool):
        raise SGLangContractError(
            f"SGLang {what} answered {_shown(result)}, which is neither a (success, message) tuple nor an object "
            "with a bool 'success': this engine cannot tell whether it worked. The installed SGLang answers "
            f"differently from the versions this engine was checked against (sglang{SUPPORTED_SGLANG}); run "
            "`python tools/sglang_contract.py --check VERSION` to see what changed"
        )
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:120]}{'...' if len(text) > 120 else ''}"


def _hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise MissingInputError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def _hf_eos_ids(hf_dir: str | Path) -> list[int]:
    """The model's EOS ids as SGLang reads them (``ModelConfig._get_hf_eos_token_id``): config.json's and
    generation_config.json's ``eos_token_id`` (an int or a list), together."""
    sources = [_hf_config(hf_dir)]
    generation = Path(hf_dir) / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()))
    ids: set[int] = set()
    for source in sources:
        eos = source.get("eos_token_id", source.get("text_config", {}).get("eos_token_id"))
        if eos is not None:
            ids |= {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return sorted(ids)


def _hf_positions(hf_dir: str | Path) -> int | None:
    config = _hf_config(hf_dir)
    positions = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    return int(positions) if positions else None


def _hf_vocab_size(hf_dir: str | Path) -> int:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise MissingInputError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    config = json.loads(path.read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise ValueError(f"{path} has no vocab_size")
    return int(vocab)


# ------------------------------------------------------------------------------ routed experts
# Routing replay (moe.routing_replay=rollout) reads the experts SGLang routed each token to. Read in
# SGLang 0.5.10 and 0.5.23 (both ends of SUPPORTED_SGLANG): the server argument
# ``enable_return_routed_experts`` installs a capturer, the request flag
# ``Engine.generate(..., return_routed_experts=True)`` asks for it, and each output's
# ``meta_info["routed_experts"]`` is ``base64(int32 array.tobytes())`` of shape
# [prompt + output tokens - 1, num_hidden_layers, num_experts_per_tok], C order
# (0.5.10: layers/moe/routed_experts_capturer.py ``get_routed_experts`` and tokenizer_manager.py;
# 0.5.23: state_capturer/routed_experts.py, ``extract_routed_experts_from_meta_info``, and
# detokenizer_manager.py ``_b64_encode_per_request``). Tokens start at the prompt's first
# (``routed_experts_start_len`` = 0, its default) and stop before the last generated one: the
# trainer's input. The layer axis holds every decoder layer; dense layers' rows are not routes and are
# dropped here. Untested on a GPU in this repository: the parsing is tested on outputs shaped as that
# source writes them (tests/rollout/test_sglang_routes.py).


def _hf_route_layout(hf_dir: str | Path) -> RouteLayout:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise MissingInputError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    config = json.loads(path.read_text())
    return route_layout(config.get("text_config", config))


def routes_from_output(
    output: dict[str, Any], *, prompt_len: int, response_len: int, layout: RouteLayout
) -> np.ndarray:
    """One SGLang output's routed experts as [prompt_len + response_len - 1, sparse layers, k] (``layout.dtype``).

    Raises SGLangContractError when the output has none (the engine was started without
    ``enable_return_routed_experts``), or when their size, token count or ids do not fit the model.
    """
    raw = output.get("meta_info", {}).get("routed_experts")
    if raw is None:
        raise SGLangContractError(
            "SGLang output has no meta_info['routed_experts']: start the engine with enable_return_routed_experts "
            "and pass return_routed_experts=True (SGLangEngine(record_routes=True) does both)"
        )
    if isinstance(raw, str):
        flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    else:  # a tensor or list, as a skip_tokenizer_init path may hand back
        flat = np.asarray(raw.cpu() if isinstance(raw, torch.Tensor) else raw, dtype=np.int32).reshape(-1)
    per_token = layout.num_layers * layout.topk
    tokens = prompt_len + response_len - 1
    if flat.size != tokens * per_token:
        raise SGLangContractError(
            f"SGLang returned {flat.size} routed-expert ids; expected {tokens} tokens (prompt {prompt_len} + response "
            f"{response_len} - 1) x {layout.num_layers} layers x top-{layout.topk} = {tokens * per_token}"
        )
    routes = flat.reshape(tokens, layout.num_layers, layout.topk)[:, list(layout.sparse_layers)]
    if routes.size and (routes.min() < 0 or routes.max() >= layout.num_experts):
        raise SGLangContractError(
            f"SGLang returned expert ids in [{routes.min()}, {routes.max()}] outside [0, {layout.num_experts})"
        )
    return routes.astype(layout.dtype)


def routed_generation(
    gen: Generation, output: dict[str, Any], *, prompt_len: int, layout: RouteLayout
) -> RoutedGeneration:
    """``gen`` with the routes of its SGLang ``output`` (``routes_from_output``)."""
    routes = routes_from_output(output, prompt_len=prompt_len, response_len=len(gen.response_ids), layout=layout)
    return RoutedGeneration(
        response_ids=gen.response_ids, logprobs=gen.logprobs, finish_reason=gen.finish_reason, routes=routes
    )
