"""Transformers rollout engine: batched sampling with a KV cache and exact behaviour log-probs.

The CPU default (also usable on one GPU). It runs its own sampling loop over the model's forward
pass instead of ``model.generate``: each step takes the raw logits of the last position in
float32, divides by T, applies log_softmax over the whole vocabulary, samples from it with a
seeded ``torch.Generator`` and stores the sampled token's log-prob. No logits processor touches
the distribution, so the stored log-probs are exactly what the trainer recomputes (measured:
max |error| 4.8e-7 in float32 against a teacher-forced forward, with and without the KV cache).

Prompts of different lengths share a batch through left padding: the attention mask hides the
padding and position ids count only real tokens, so a padded row computes what it would alone.
A row that samples EOS is finished at once (nothing it samples later is read); finished rows leave
the batch (their KV-cache rows are dropped) once they are a quarter of it.

The loop is faster than ``model.generate`` on the same model and batch (issue #28, measured by
``benchmarks/rollout_throughput.py``: ``vs_generate``): the KV cache and the mask are allocated once
for the whole response instead of grown by concatenation every step, a decoding step hands SDPA a
view of the mask instead of having the model rebuild it, finished rows are dropped a few times per
batch instead of at almost every step, and the loop runs in inference mode.

Partial rollouts (``async.partial_rollout``): a rollout worker sets ``engine.interrupt``
(``engine.Interrupt``), whose ``between_steps()`` the loop calls before every forward. When it applied
new weights, the same rows go on under them: their KV cache is rebuilt by one prefill forward over
prompt + the tokens fed so far (``kv="recompute"``: every later token is sampled from exactly the new
policy, as a teacher-forced forward under it computes; tested) or kept (``kv="keep"``: no extra
forward, but the tokens after the switch come from the new weights attending to the old weights' keys
and values, a policy the trainer never computes). Every token records the version that sampled it.

Multi-turn rollouts (``generate_trajectories``, issue #37): token in, token out. A trajectory holds the
ids the policy sampled and the environment's observation ids between its turns (``envs/trajectory.py``),
with a policy mask and behaviour log-probs for policy tokens only. Rows at different turns share a batch;
after an observation a row feeds only its new tokens (a left-padded chunk) into the KV cache it keeps,
so the log-probs equal a teacher-forced forward over prompt + trajectory (tested). Under
``record_routes`` every forward's routes are filed per row (``RouteRecorder.step(rows, fed)``): the
prompt's, each sampled token's and each observation token's, so a trajectory's routes cover every
position the trainer forwards (equal to a teacher-forced forward's; tested). Not yet combined with
partial rollouts.

By default every row waits at a step where some rows' turns ended, for those rows' environment calls (run at
once among themselves). With ``env.overlap`` (``generate_trajectories(overlap=True)``; on by default in async
workers, see ``envs.registry.env_overlap``) a call runs in the background while the other rows go on decoding:
the waiting row keeps its KV-cache row and feeds a masked pad column each step (no position, no route), and
when its answer arrives it feeds [last token, *observation]; the loop blocks only when no row can feed. Only
rows that fed are sampled, so which tokens a seed gives depends on when answers arrive: overlap gives up
determinism across runs, nothing else (tokens, masks, log-probs equal to a teacher-forced forward, limits,
env_error / env_timeout, routes: tested in tests/rollout/test_env_overlap.py).
"""

from __future__ import annotations

import functools
import gc
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_mugrpo.envs.base import EnvLimits, Episode, StepResult
from megatron_mugrpo.envs.trajectory import Trajectory, TrajectoryBuilder, env_step, env_steps, stop_hit
from megatron_mugrpo.errors import MissingInputError, require
from megatron_mugrpo.faults import engine_fault
from megatron_mugrpo.rollout.engine import (
    Generation,
    Interrupt,
    ProgressCallback,
    SamplingParams,
    check_prompt_ids,
    responses_per_prompt,
    validate_generations,
)
from megatron_mugrpo.rollout.routes import RoutedGeneration, RouteRecorder, RouteRecordingError

if TYPE_CHECKING:  # transformers is imported when an engine is built, not when the config is loaded
    from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TransformersEngineConfig:
    """``rollout.transformers.*``: knobs of the transformers engine (the CPU default)."""

    batch_size: int = 64
    """Rows (prompt × response) sampled together; bounds memory."""

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, f"rollout.transformers.batch_size={self.batch_size} must be >= 1")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None:
        return "auto"
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {tuple(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


class TransformersEngine:
    """Rollout engine on a Hugging Face ``AutoModelForCausalLM``.

    Args:
        hf_dir: local Hugging Face directory (config.json + weights).
        dtype: parameter dtype; None keeps the checkpoint's ``torch_dtype``.
        device: 'cpu', 'cuda', ...; None picks CUDA when available.
        batch_size: rows (prompt × response) sampled together; bounds memory.
        use_cache: reuse keys/values across steps (False recomputes the whole prefix every step:
            slow, kept to check that the cache does not change the log-probs).
        eos_token_ids: tokens that end a response; None reads the generation config / config.
        attn_implementation: 'sdpa' or 'eager'.
        record_routes: record the experts every token went through (a mixture-of-experts model under
            ``moe.routing_replay: rollout``); generations are then ``RoutedGeneration``s.
    """

    name = "transformers"
    interruptible = True
    """Takes an ``Interrupt`` (``self.interrupt``): partial rollouts."""
    vocab_size: int
    """Rows of the output layer: every id the model can emit (set when a model is loaded)."""

    def __init__(
        self,
        hf_dir: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        batch_size: int = 64,
        use_cache: bool = True,
        eos_token_ids: Sequence[int] | None = None,
        attn_implementation: str = "sdpa",
        record_routes: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _resolve_dtype(dtype)
        self.batch_size = batch_size
        self.use_cache = use_cache
        self.attn_implementation = attn_implementation
        self._eos_override = list(eos_token_ids) if eos_token_ids is not None else None
        self.model: PreTrainedModel | None = None
        self.record_routes = record_routes
        self.recorder: RouteRecorder | None = None
        self.interrupt: Interrupt | None = None
        """Partial rollouts (``async.partial_rollout``): set by a rollout worker, consulted before every
        decode forward; generations then carry per-token ``versions``."""
        self.load_hf_dir(str(hf_dir))

    # ------------------------------------------------------------------ weights

    def load_hf_dir(self, path: str) -> None:
        """Load (or reload) the model from a local Hugging Face directory."""
        if not (Path(path) / "config.json").is_file():
            raise MissingInputError(f"{path} is not a Hugging Face model directory (no config.json)")
        from transformers import AutoModelForCausalLM

        self.release()
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation=self.attn_implementation
        )
        self._set_model(model)
        self.eos_token_ids = self._eos_override if self._eos_override is not None else _eos_ids(model)
        self.pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full Hugging Face-named tensors into the model (rebuilt from its config after
        ``release()``).

        Strict: an unknown name, a shape mismatch or a parameter left without a tensor is an error
        (tied weights count as received when either name arrives). A failed load drops the
        half-updated model, so nothing is ever sampled from a mix of two policies.
        """
        if self.model is None:
            from transformers import AutoModelForCausalLM

            skeleton = AutoModelForCausalLM.from_config(
                self._config, dtype=self._param_dtype, attn_implementation=self.attn_implementation
            )
            self._set_model(skeleton)
        try:
            copy_weights(self._live_model(), named_tensors)
        except Exception:
            self.release()
            raise

    def weights(self) -> dict[str, torch.Tensor]:
        """The live model's Hugging Face-named tensors (tied ones under each name), for checks."""
        return self._live_model().state_dict()

    @property
    def release_frees_memory(self) -> bool:
        """Whether ``release()`` between phases gives the trainer memory it could not otherwise use.

        On an accelerator it does. On the CPU the engine holds a copy of the weights in the host's
        RAM, and releasing it only made the next weight sync rebuild the model from its config (a
        random initialisation and a garbage collection: most of the ~0.3 s stage boundary of the CPU
        demo, issue #28), so the loops keep it and load the next stage's weights in place."""
        return self.device.type != "cpu"

    def release(self) -> None:
        """Drop the model and return its memory (``load_hf_dir`` / ``load_weights`` bring it back)."""
        if self.model is None:
            return
        self.model = None
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _set_model(self, model: PreTrainedModel) -> None:
        self.model = model.to(self.device).eval()
        self._config = model.config
        self._param_dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        if self.recorder is not None:
            self.recorder.close()
        self.recorder = RouteRecorder(self.model) if self.record_routes else None

    def _live_model(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError(
                "the transformers engine was released; call load_hf_dir() or load_weights() before generating"
            )
        return self.model

    # --------------------------------------------------------------- generation

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int],
        params: SamplingParams,
        progress: ProgressCallback | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n`` responses per prompt (``n[i]`` for prompt i); result[i] holds prompt i's.

        Rows (prompt, copy) are sorted by prompt length before micro-batching so that a batch
        carries little padding; results come back in prompt order.
        """
        counts = responses_per_prompt(n, len(prompts))
        check_prompt_ids(prompts, self.vocab_size)
        rows = sorted(((i, j) for i, c in enumerate(counts) for j in range(c)), key=lambda r: -len(prompts[r[0]]))
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        out: list[list[Generation | None]] = [[None] * c for c in counts]
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            gens = self._sample_batch([prompts[i] for i, _ in chunk], params, generator)
            for (i, j), gen in zip(chunk, gens):
                out[i][j] = gen
            if progress is not None:
                progress(len(chunk))
        result: list[list[Generation]] = [[g for g in group if g is not None] for group in out]
        validate_generations(
            result, counts, vocab_size=self.vocab_size, max_new_tokens=params.max_new_tokens, engine=self.name
        )
        return result

    @torch.inference_mode()  # no autograd bookkeeping (version counters, views) on the ~30 ops of each step
    def _sample_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> list[Generation]:
        """Sample one response for each prompt in one left-padded batch of B rows, in the phases of a
        decode loop: allocate the batch, then per step a forward (the prefill at step 0, one token
        per computed row after), sample, retire finished rows, and switch weights when a rollout
        worker applied new ones (partial rollouts).
        """
        model, interrupt = self._live_model(), self.interrupt
        batch = self._start_batch(prompts, params.max_new_tokens, model.config)
        version = interrupt.version() if interrupt is not None else 0
        if self.recorder is not None:
            self.recorder.begin([len(p) for p in prompts])
        if interrupt is not None and interrupt.between_steps():  # before the prefill: nothing to redo
            model, version = self._live_model(), interrupt.version()
        for step in range(batch.steps):
            logits = self._forward(model, batch, step)
            if step == 0:
                engine_fault()  # $MUGRPO_ENGINE_FAULT: the watchdog's tests kill or hang a batch here
            token = self._step(batch, logits, step, params.temperature, generator, version)
            finished = int(batch.done.sum())  # the step's one host sync
            if finished == batch.done.numel():
                break
            batch.feed(token, with_cache=batch.cache is not None)
            # Partial rollouts: new weights between two steps, the same sequences go on under them.
            switched = interrupt is not None and step + 1 < batch.steps and interrupt.between_steps()
            self._retire(batch, finished, force=switched)
            if switched:
                model, version = self._switch_weights(batch, step)
        return self._results(prompts, batch)

    def _start_batch(self, prompts: list[list[int]], steps: int, config: PreTrainedConfig) -> _Batch:
        """Phase 1, allocate: left-pad the prompts and allocate every buffer of the whole response once
        (outputs [B, steps], the mask [B, width + steps], the KV cache), so nothing grows by
        concatenation inside the loop."""
        input_ids, prompt_mask = left_pad(prompts, self.pad_token_id, self.device)
        batch, width = len(prompts), input_ids.shape[1]
        # The whole response's mask at once: generated positions are always real tokens, and step s
        # passes the prefix of width + s columns.
        mask = torch.cat([prompt_mask, torch.ones((batch, steps), dtype=torch.long, device=self.device)], dim=1)
        cache = preallocated_cache(config, width + steps) if self.use_cache else None
        step_pos = position_ids_from_mask(prompt_mask)
        return _Batch(
            input_ids=input_ids,
            steps=steps,
            eos=torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device),
            tokens=torch.full((batch, steps), self.pad_token_id, dtype=torch.long, device=self.device),
            logprobs=torch.zeros((batch, steps), dtype=torch.float32, device=self.device),
            versions=torch.zeros((batch, steps), dtype=torch.long) if self.interrupt is not None else None,
            lengths=torch.full((batch,), steps, dtype=torch.long, device=self.device),
            stopped=torch.zeros(batch, dtype=torch.bool, device=self.device),
            rows=torch.arange(batch, device=self.device),
            done=torch.zeros(batch, dtype=torch.bool, device=self.device),
            mask=mask,
            attend=mask.bool(),  # the same as the SDPA mask of a decoding step (see ``_forward``)
            cache=cache,
            # Decoding steps attend to every real position before them, so their SDPA mask is a view of
            # ``mask`` [A, 1, 1, width + s]: handing it over skips the model's mask construction every
            # step. The prefill keeps the 2D mask (it needs the causal part too).
            decode_mask_4d=cache is not None and self.attn_implementation == "sdpa" and _all_preallocated(cache),
            step_ids=input_ids,
            step_pos=step_pos,
            next_pos=step_pos[:, -1:] + 1,
        )

    def _forward(self, model: PreTrainedModel, batch: _Batch, step: int) -> torch.Tensor:
        """Phase 2, forward: the prefill at step 0 (the whole prompt), one token per computed row after
        (the whole prefix again without a cache). Returns the raw logits [A, V] of the last position."""
        if self.recorder is not None:
            self.recorder.step(batch.rows)  # the rows this forward feeds (done rows stay until compaction)
        width = batch.input_ids.shape[1]
        if batch.cache is None:
            step_mask = batch.mask[:, : batch.step_ids.shape[1]]
        elif step > 0 and batch.decode_mask_4d:
            step_mask = batch.attend[:, None, None, : width + step]
        else:
            step_mask = batch.mask[:, : width + step]
        return model(
            input_ids=batch.step_ids,
            attention_mask=step_mask,
            position_ids=batch.step_pos,
            past_key_values=batch.cache,
            use_cache=batch.cache is not None,
            logits_to_keep=1,
        ).logits[:, -1]

    @staticmethod
    def _step(
        batch: _Batch, logits: torch.Tensor, step: int, temperature: float, generator: torch.Generator, version: int
    ) -> torch.Tensor:
        """Phase 3, sample: one token for each computed row from the raw logits at temperature T, with its
        behaviour log-prob; a row that samples EOS is done (nothing it samples later is read).
        Returns the tokens [A]."""
        token, logprob = sample_with_logprob(logits, temperature, generator)
        rows = batch.rows
        batch.tokens[rows, step], batch.logprobs[rows, step] = token, logprob  # a done row's lie past its length
        if batch.versions is not None:
            batch.versions[rows.cpu(), step] = version
        hit_eos = torch.isin(token, batch.eos) & ~batch.done
        batch.lengths[rows[hit_eos]] = step + 1
        batch.stopped[rows[hit_eos]] = True
        batch.done |= hit_eos
        return token

    @staticmethod
    def _retire(batch: _Batch, finished: int, *, force: bool) -> None:
        """Phase 4, retire: done rows leave the batch (their cache rows are dropped) once they are
        ``_COMPACT_FRACTION`` of the rows computed, so the long tail of unfinished responses does not pay
        for finished ones, and the copy of the cache that dropping costs is paid a few times per batch
        rather than at almost every step. ``force`` (a weight switch) drops any done row: it must not
        be recomputed. ``finished``: the computed rows that are done."""
        if finished >= _COMPACT_FRACTION * batch.done.numel() or (force and finished):
            batch.keep((~batch.done).nonzero().squeeze(1))

    def _switch_weights(self, batch: _Batch, step: int) -> tuple[PreTrainedModel, int]:
        """Phase 5, switch weights (partial rollouts): the rows go on under the weights just applied.
        Under ``kv="recompute"`` their cache, which holds the prompt and tokens[:, :step], is rebuilt."""
        assert self.interrupt is not None
        model, version = self._live_model(), self.interrupt.version()
        if batch.cache is not None and self.interrupt.kv == "recompute":
            rows, capacity = batch.rows, batch.input_ids.shape[1] + batch.steps
            batch.cache = self._recompute_cache(
                model, batch.input_ids[rows], batch.tokens[rows, :step], batch.mask, capacity
            )
        return model, version

    def _results(self, prompts: list[list[int]], batch: _Batch) -> list[Generation]:
        """Cut each row's outputs to its length (with its routes when they were recorded)."""
        gens = _to_generations(batch.tokens, batch.logprobs, batch.lengths, batch.stopped, batch.versions)
        if self.recorder is None:
            return gens
        # A done row may have been fed past its EOS before it left: keep the trainer's input only.
        return [
            RoutedGeneration(**vars(g), routes=self.recorder.routes(b)[: len(prompts[b]) + len(g.response_ids) - 1])
            for b, g in enumerate(gens)
        ]

    def _recompute_cache(
        self, model: PreTrainedModel, prompt_ids: torch.Tensor, fed: torch.Tensor, mask: torch.Tensor, capacity: int
    ) -> DynamicCache:
        """The KV cache of the rows still computed, rebuilt under the weights just applied.

        ``prompt_ids`` [A, width] (left padded) and ``fed`` [A, s] are what the cache held after decode step
        s: the prompt and tokens 0 .. s - 1 (step s + 1 feeds token s); ``mask`` [A, width + steps].
        One prefill forward; its logits are not used. A route recorder is disarmed here (it is armed
        right before each decode forward), so the routes stay those of the forwards that sampled.
        """
        prefix = torch.cat([prompt_ids, fed], dim=1)
        prefix_mask = mask[:, : prefix.shape[1]]
        cache = preallocated_cache(model.config, capacity)
        model(
            input_ids=prefix,
            attention_mask=prefix_mask,
            position_ids=position_ids_from_mask(prefix_mask),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache

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
        overlap: bool = False,
    ) -> list[Trajectory]:
        """One multi-turn trajectory per prompt, with ``episodes[i]`` as prompt i's environment.

        Token in, token out: a trajectory holds the ids the policy sampled and the observation ids the
        environment returned, never re-encoded; ``decode`` only makes the text the environment reads.
        A policy turn ends at a stop string (``stop_strings``, e.g. '</search>'), at
        ``params.max_new_tokens`` tokens, or at EOS (which ends the trajectory). Rows at different turns
        share a batch: after an observation a row feeds its last sampled token and the observation in
        the next forward (a left-padded chunk), so only new tokens are prefilled and the KV cache is kept.
        Environment calls go through ``guarded_step`` (limits, timeout, errors).

        ``overlap`` (``env.overlap``) decides what the other rows do meanwhile. False: the step's calls run at
        once and every row waits for them, so the trajectories depend on the seed only. True: a call runs in
        the background while the other rows go on decoding (``_decode_overlapped``); the trajectories then
        depend on when the answers arrive, everything else holds (module docstring).
        """
        if len(episodes) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(episodes)} episodes; give one episode per prompt")
        if self.interrupt is not None or not self.use_cache:
            raise ValueError("multi-turn rollouts need the KV cache and do not support partial rollouts yet")
        check_prompt_ids(prompts, self.vocab_size)
        positions = getattr(self._config, "max_position_embeddings", None)
        require(
            positions is None or limits.max_total_tokens <= positions,
            f"env.max_total_tokens={limits.max_total_tokens} is more than the rollout model's "
            f"max_position_embeddings={positions}; lower it",
        )
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        rules = _TurnRules(eos=frozenset(self.eos_token_ids), decode=decode, stop_strings=tuple(stop_strings))
        trajectories: list[Trajectory] = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            rows = [
                TrajectoryBuilder(prompt_length=len(p), episode=e, limits=limits, max_turn_tokens=params.max_new_tokens)
                for p, e in zip(prompts[start:end], episodes[start:end])
            ]
            self._rollout_batch(prompts[start:end], rows, params.temperature, generator, rules, overlap=overlap)
            trajectories += [self._built(b, row) for b, row in enumerate(rows)]
        return trajectories

    def _built(self, b: int, row: TrajectoryBuilder) -> Trajectory:
        """Row ``b``'s trajectory, with its routes when they are recorded: [prompt + trajectory - 1, layers, k],
        the trainer's input (a trajectory ends with a sampled token, which no forward fed)."""
        trajectory = row.build()
        if self.recorder is None:
            return trajectory
        routes, expected = self.recorder.routes(b), row.prompt_length + len(trajectory.token_ids) - 1
        if len(routes) != expected:
            raise RouteRecordingError(
                f"trajectory {b} recorded routes for {len(routes)} positions, not {expected} (prompt "
                f"{row.prompt_length} + trajectory {len(trajectory.token_ids)} - 1): the engine fed a row wrongly"
            )
        trajectory.routes = routes
        return trajectory

    @torch.inference_mode()
    def _rollout_batch(
        self,
        prompts: list[list[int]],
        rows: list[TrajectoryBuilder],
        temperature: float,
        generator: torch.Generator,
        rules: _TurnRules,
        *,
        overlap: bool,
    ) -> None:
        """Decode one batch of trajectories to their ends: prefill the prompts, then decode with the environment
        called in step (``_decode_blocking``) or in the background (``_decode_overlapped``)."""
        model = self._live_model()
        batch = _ChunkBatch.prefill(prompts, self.pad_token_id, self.device, model.config)
        if self.recorder is not None:
            self.recorder.begin([len(p) for p in prompts])
        decode_rows = self._decode_overlapped if overlap else self._decode_blocking
        decode_rows(model, batch, rows, temperature, generator, rules)

    def _decode_blocking(
        self,
        model: PreTrainedModel,
        batch: _ChunkBatch,
        rows: list[TrajectoryBuilder],
        temperature: float,
        generator: torch.Generator,
        rules: _TurnRules,
    ) -> None:
        """Per step: sample every row, hand the turns that ended to the environment and wait for all of them,
        retire the rows that ended, and feed the rest their next chunk (the last sampled token, after an
        observation followed by it)."""
        while batch.live:
            logits = batch.forward(model, self.recorder)
            token, logprob = sample_with_logprob(logits, temperature, generator)
            feeds = self._advance_rows([rows[b] for b in batch.live], token.tolist(), logprob.tolist(), rules)
            keep = [a for a, feed in enumerate(feeds) if feed]
            if not keep:
                break
            batch.keep(keep)  # retire ended rows at once: the next chunk is built for live rows only
            batch.feed([feeds[a] for a in keep], self.pad_token_id)

    def _advance_rows(
        self, rows: list[TrajectoryBuilder], tokens: list[int], logprobs: list[float], rules: _TurnRules
    ) -> list[list[int]]:
        """Record each row's sample and run the environment on the turns that ended. Returns each row's ids
        to feed next: its token, after an observation the token and the observation; [] once it ended."""
        ended = [row for row, token, logprob in zip(rows, tokens, logprobs) if rules.add(row, token, logprob)]
        observations = {
            id(row): row.apply(result) for row, result in zip(ended, env_steps(ended, rules.decode, self.vocab_size))
        }
        return [[] if row.done else [token, *observations.get(id(row), [])] for row, token in zip(rows, tokens)]

    def _decode_overlapped(
        self,
        model: PreTrainedModel,
        batch: _ChunkBatch,
        rows: list[TrajectoryBuilder],
        temperature: float,
        generator: torch.Generator,
        rules: _TurnRules,
    ) -> None:
        """``env.overlap``: a turn that ended goes to the environment in the background and the other rows go
        on decoding. A waiting row stays in the KV cache and feeds nothing (an empty chunk: a masked pad
        column, its position not counted); when its answer arrives it feeds [last token, *observation] at the
        next step. Only the rows that fed are sampled: a waiting row's logits (its pad column's) are never
        read. When no row can feed, the loop blocks until an answer lets one go on."""
        with _BackgroundCalls(len(rows), rules.decode, self.vocab_size) as calls:
            while batch.live:
                logits = batch.forward(model, self.recorder)
                fed = [a for a, n in enumerate(batch.fed or [1] * len(batch.live)) if n]
                if len(fed) < len(batch.live):
                    logits = logits[torch.tensor(fed, device=logits.device)]
                token, logprob = sample_with_logprob(logits, temperature, generator)
                feeds: dict[int, list[int]] = {}
                for a, t, lp in zip(fed, token.tolist(), logprob.tolist()):
                    b = batch.live[a]
                    if rules.add(rows[b], t, lp):
                        calls.submit(b, rows[b], t)
                    elif not rows[b].done:
                        feeds[b] = [t]
                feeds |= calls.collect(block=not feeds)
                keep = [a for a, b in enumerate(batch.live) if b in feeds or calls.waiting(b)]
                if not keep:
                    break
                batch.keep(keep)
                batch.feed([feeds.get(b, []) for b in batch.live], self.pad_token_id)

    def teacher_forced_logprobs(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperature: float
    ) -> list[torch.Tensor]:
        """Score given responses with one forward pass each (see ``teacher_forced_logprobs``)."""
        return teacher_forced_logprobs(self._live_model(), prompts, responses, temperature)


@dataclass(kw_only=True, eq=False)
class _Batch:
    """One left-padded batch being decoded: B rows written, A of them still computed.

    Outputs are indexed by the row's place in the batch (B); the computed state by its place among
    the rows still computed (A), which ``rows`` maps back to B."""

    input_ids: torch.Tensor
    """[B, width] the left-padded prompts."""
    steps: int
    """max_new_tokens: columns of the output buffers."""
    eos: torch.Tensor
    """[E] the tokens that end a response."""
    tokens: torch.Tensor
    """[B, steps] sampled ids (a done row's entries past its length are never read)."""
    logprobs: torch.Tensor
    """[B, steps] float32 behaviour log-probs log_softmax(logits / T)[token]."""
    versions: torch.Tensor | None
    """[B, steps] the policy version that sampled each token (partial rollouts), on the CPU."""
    lengths: torch.Tensor
    """[B] response lengths (steps until a row samples EOS)."""
    stopped: torch.Tensor
    """[B] bool: the row ended with EOS."""
    rows: torch.Tensor
    """[A] the computed rows' indices in the batch."""
    done: torch.Tensor
    """[A] bool: the computed row sampled EOS (it leaves at the next compaction)."""
    mask: torch.Tensor
    """[A, width + steps] attention mask of the whole response (0 on left padding)."""
    attend: torch.Tensor
    """[A, width + steps] ``mask`` as bool: the SDPA mask of a decoding step."""
    cache: DynamicCache | None
    """The KV cache (None: every step recomputes the whole prefix)."""
    decode_mask_4d: bool
    """Decoding steps hand SDPA a view of ``attend`` instead of a 2D mask."""
    step_ids: torch.Tensor
    """[A, n] the next forward's input ids."""
    step_pos: torch.Tensor
    """[A, n] their position ids (counting real tokens only)."""
    next_pos: torch.Tensor
    """[A, 1] position of the next input token."""

    def feed(self, token: torch.Tensor, *, with_cache: bool) -> None:
        """The next forward's inputs: the token just sampled (without a cache: the whole sequence)."""
        if with_cache:
            self.step_ids, self.step_pos = token[:, None], self.next_pos
        else:
            self.step_ids = torch.cat([self.step_ids, token[:, None]], dim=1)
            self.step_pos = torch.cat([self.step_pos, self.next_pos], dim=1)
        self.next_pos = self.next_pos + 1

    def keep(self, keep: torch.Tensor) -> None:
        """Keep only the computed rows ``keep`` [A'] (indices among the computed rows)."""
        self.rows, self.done, self.mask, self.attend = (
            self.rows[keep],
            self.done[keep],
            self.mask[keep],
            self.attend[keep],
        )
        self.step_ids, self.step_pos, self.next_pos = self.step_ids[keep], self.step_pos[keep], self.next_pos[keep]
        if self.cache is not None:
            self.cache.batch_select_indices(keep)


@dataclass(frozen=True, kw_only=True)
class _TurnRules:
    """When a sampled token ends a policy turn (multi-turn): EOS ends the trajectory, a stop string or the
    turn's token cap hands the turn to the environment (``TrajectoryBuilder.turn_over``)."""

    eos: frozenset[int]
    decode: Callable[[list[int]], str]
    stop_strings: tuple[str, ...]

    def add(self, row: TrajectoryBuilder, token: int, logprob: float) -> bool:
        """Record ``token`` in ``row``; True when its turn now goes to the environment."""
        row.add_sampled(token, logprob)
        stopped = bool(self.stop_strings) and stop_hit(self.decode(row.turn_ids()), self.stop_strings)
        return row.turn_over(eos=token in self.eos, stopped=stopped)


@dataclass(kw_only=True, eq=False)
class _ChunkBatch:
    """One batch of trajectories being decoded: the rows in the KV cache and the chunk each feeds next.

    Every forward feeds each row its new tokens as one left-padded chunk [A, n]: the prompt at the prefill,
    then the last sampled token, after an observation followed by the observation. An empty chunk (a row
    waiting for its observation, ``env.overlap``) is a masked pad column: the cache stays aligned and the
    row's positions count its real tokens only."""

    live: list[int]
    """[A] the batch rows in the cache, in cache order (rows only leave)."""
    step_ids: torch.Tensor
    """[A, n] the next forward's input ids."""
    step_pos: torch.Tensor
    """[A, n] their position ids (counting real tokens only)."""
    next_pos: torch.Tensor
    """[A] position of each row's next real token."""
    mask: torch.Tensor
    """[A, fed so far] attention mask of every column fed, the next forward's included (0: padding)."""
    cache: DynamicCache
    fed: list[int] | None
    """[A] real tokens each row feeds in the next forward; None: the prefill (each row's whole prompt)."""

    @classmethod
    def prefill(
        cls, prompts: list[list[int]], pad_id: int, device: torch.device, config: PreTrainedConfig
    ) -> _ChunkBatch:
        from transformers import DynamicCache

        step_ids, mask = left_pad(prompts, pad_id, device)
        step_pos = position_ids_from_mask(mask)
        return cls(
            live=list(range(len(prompts))),
            step_ids=step_ids,
            step_pos=step_pos,
            next_pos=step_pos[:, -1] + 1,
            mask=mask,
            cache=DynamicCache(config=config),
            fed=None,
        )

    def forward(self, model: PreTrainedModel, recorder: RouteRecorder | None) -> torch.Tensor:
        """The raw logits [A, V] of each row's last column."""
        if recorder is not None:  # every position a row feeds is routed, observation tokens too; pads are not
            recorder.step(self.live, self.fed)
        return model(
            input_ids=self.step_ids,
            attention_mask=self.mask,
            position_ids=self.step_pos,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices into ``live``), dropping the others' cache rows."""
        if len(keep) == len(self.live):
            return
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]
        self.live = [self.live[a] for a in keep]

    def feed(self, feeds: list[list[int]], pad_id: int) -> None:
        """The next forward's chunk: ``feeds[a]`` for row ``live[a]`` ([] feeds a masked pad column)."""
        self.step_ids, step_mask = left_pad(feeds, pad_id, self.mask.device)
        self.fed = [len(feed) for feed in feeds]
        self.step_pos = self.next_pos[:, None] + position_ids_from_mask(step_mask)
        self.next_pos = self.next_pos + step_mask.sum(dim=1)
        self.mask = torch.cat([self.mask, step_mask], dim=1)


class _BackgroundCalls:
    """Environment calls running in the background while the batch decodes (``env.overlap``).

    One thread per row at most, so a call never queues behind another; each is bounded by ``env.timeout_s``
    (``guarded_step``). A row is left alone by the decode loop while its call runs: the call reads its turn,
    and only the loop applies the answer. Leaving the block drops calls not yet started; those running end
    by their timeout at the latest, and their answers are dropped."""

    def __init__(self, rows: int, decode: Callable[[list[int]], str], vocab_size: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(rows, 1), thread_name_prefix="env-step")
        self.decode, self.vocab_size = decode, vocab_size
        self.pending: dict[Future[StepResult], tuple[int, TrajectoryBuilder, int]] = {}
        self.rows: set[int] = set()

    def __enter__(self) -> _BackgroundCalls:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, b: int, row: TrajectoryBuilder, token: int) -> None:
        """Hand row ``b``'s turn, whose last token ``token`` was sampled but not fed yet, to the environment."""
        self.pending[self.pool.submit(env_step, row, self.decode, self.vocab_size)] = (b, row, token)
        self.rows.add(b)

    def waiting(self, b: int) -> bool:
        return b in self.rows

    def collect(self, *, block: bool) -> dict[int, list[int]]:
        """Apply the answers that arrived. Returns, for each row that goes on, its next chunk [token,
        *observation]. ``block``: wait until some row goes on, or no call is left."""
        out: dict[int, list[int]] = {}
        while self.pending:
            arrived, _ = wait(self.pending, timeout=None if block else 0, return_when=FIRST_COMPLETED)
            for future in sorted(arrived, key=lambda f: self.pending[f][0]):  # row order: no set order leaks in
                b, row, token = self.pending.pop(future)
                self.rows.discard(b)
                observation = row.apply(future.result())
                if not row.done:
                    out[b] = [token, *observation]
            if out or not block:
                break
        return out


def copy_weights(model: PreTrainedModel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into ``model``'s parameters; every parameter must receive one.

    Names are those of a released checkpoint. Where the model stores a mixture-of-experts layer's
    experts fused (transformers 5: ``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, and
    ``mlp.experts.down_proj`` [E, H, I]), each expert's ``experts.{e}.{gate,up,down}_proj.weight`` goes
    into its slice, as transformers' own loader puts it; a fused parameter counts as received once
    every slice has arrived.
    """
    targets = model.state_dict(keep_vars=True)
    received: dict[int, set[int]] = {}
    with torch.no_grad():
        for name, tensor in named_tensors:
            resolved = _copy_target(targets, name)
            if resolved is None:
                kind = type(model).__name__
                raise KeyError(f"load_weights: {name!r} is not a parameter of the rollout model ({kind})")
            param, target, piece = resolved
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model expects "
                    f"{tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            received.setdefault(param.data_ptr(), set()).add(piece)
    missing = []
    for name, param in model.named_parameters():
        pieces = received.get(param.data_ptr(), set())
        if _WHOLE not in pieces and len(pieces) < _slices(name, param):
            missing.append(name)
    if missing:
        raise ValueError(f"load_weights: no tensor for {len(missing)} parameters, e.g. {missing[:5]}")


_WHOLE = -1
_EXPERT_WEIGHT = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
"""One expert's projection as a released MoE checkpoint names it (Qwen2-MoE, Qwen3-MoE, Mixtral-style)."""


def _copy_target(targets: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(parameter, the tensor or slice ``name`` is copied into, piece), or None when ``name`` has no home.

    ``piece`` is ``_WHOLE`` for a whole parameter, else the slice's index in a fused expert parameter:
    ``2 * expert + (0 gate, 1 up)`` in ``gate_up_proj``, ``expert`` in ``down_proj``."""
    if name in targets:
        return targets[name], targets[name], _WHOLE
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    expert, proj = int(match["index"]), match["proj"]
    fused = targets.get(f"{match['experts']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if fused is None or fused.dim() != 3 or expert >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused, fused[expert], expert
    half = fused.shape[1] // 2
    if proj == "gate_proj":
        return fused, fused[expert, :half], 2 * expert
    return fused, fused[expert, half:], 2 * expert + 1


def _slices(name: str, param: torch.Tensor) -> int:
    """Pieces that make up ``param`` when it arrives in slices (fused experts), else 1."""
    if name.endswith(".experts.gate_up_proj"):
        return 2 * param.shape[0]
    if name.endswith(".experts.down_proj"):
        return param.shape[0]
    return 1


def _eos_ids(model: PreTrainedModel) -> list[int]:
    """EOS ids from the generation config, falling back to the model config (int or list)."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    logger.warning("the model defines no eos_token_id: every response will run to max_new_tokens")
    return []


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts. Returns input ids [B, P] int64 and attention mask [B, P] int64 (1 = token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[b, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions [B, P] counting only real tokens (padding gets 0; the mask hides it anyway)."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


_COMPACT_FRACTION = 0.25
"""Done rows leave the batch once they are this fraction of the rows computed. Dropping them copies
the whole KV cache; keeping them costs their share of each step's forward. At every EOS (the old
rule) the copy ran at most steps of a 256-row batch; a quarter bounds the wasted rows to 25% and
compacts a handful of times per batch."""


@functools.cache
def _preallocated_layer_class() -> type:
    """``DynamicLayer`` with its KV cache in buffers of the response's final length [A, H, capacity, D].

    ``DynamicLayer`` concatenates every step, copying the whole cache each time; this layer writes the
    step's keys/values into place and hands out views of the filled prefix. Defined on first use so
    that transformers is imported only when an engine runs."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity, self.filled = capacity, 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            (batch, heads, _, dim), value_dim = key_states.shape, value_states.shape[-1]
            self.key_buffer = key_states.new_empty((batch, heads, self.capacity, dim))
            self.value_buffer = value_states.new_empty((batch, value_states.shape[1], self.capacity, value_dim))
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.filled + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"the preallocated KV cache holds {self.capacity} positions, not {end}")
            self.key_buffer[:, :, self.filled : end] = key_states
            self.value_buffer[:, :, self.filled : end] = value_states
            self.filled = end
            self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
                self.keys, self.values = self.key_buffer[:, :, : self.filled], self.value_buffer[:, :, : self.filled]

    return PreallocatedLayer


def _all_preallocated(cache: DynamicCache) -> bool:
    return all(type(layer) is _preallocated_layer_class() for layer in cache.layers)


def preallocated_cache(config: PreTrainedConfig, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose plain full-attention layers write into buffers of ``capacity`` positions;
    other layer kinds (sliding windows, linear attention) keep their own class."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layer_class = _preallocated_layer_class()
    cache.layers = [layer_class(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def sample_with_logprob(
    logits: torch.Tensor, temperature: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from softmax(logits / T) over the full vocabulary.

    Args:
        logits: [B, V] raw logits of the next position.
    Returns:
        token [B] int64 and its log-prob [B] float32: log_softmax(logits / T)[token].
    """
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature  # x / 1.0 == x exactly
    logp = torch.log_softmax(scaled, dim=-1)
    token = torch.multinomial(logp.exp(), num_samples=1, generator=generator).squeeze(1)
    return token, logp.gather(1, token[:, None]).squeeze(1)


def _to_generations(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    lengths: torch.Tensor,
    stopped: torch.Tensor,
    versions: torch.Tensor | None = None,
) -> list[Generation]:
    """Cut [B, S] sampled tokens / log-probs (and per-token versions, when recorded) to each row's length ([B])."""
    tokens, logprobs, lengths, stopped = tokens.cpu(), logprobs.cpu(), lengths.tolist(), stopped.tolist()
    return [
        Generation(
            response_ids=tokens[b, : lengths[b]].tolist(),
            logprobs=logprobs[b, : lengths[b]].tolist(),
            finish_reason="stop" if stopped[b] else "length",
            versions=versions[b, : lengths[b]].tolist() if versions is not None else None,
        )
        for b in range(tokens.shape[0])
    ]


@torch.no_grad()
def teacher_forced_logprobs(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperature: float,
) -> list[torch.Tensor]:
    """log_softmax(logits / T) of each response token given the prompt and the previous tokens.

    One unpadded forward pass per sequence (the reference the engine is tested against).
    Returns one float32 tensor [T_i] per response, on the CPU.
    """
    device = next(model.parameters()).device
    scores = []
    for prompt, response in zip(prompts, responses):
        seq = torch.tensor([list(prompt) + list(response)], dtype=torch.long, device=device)
        logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        scores.append(logp.gather(1, seq[0, len(prompt) :, None]).squeeze(1).cpu())
    return scores
