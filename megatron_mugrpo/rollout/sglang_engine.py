"""SGLang rollout engine (GPU): the offline ``sglang.Engine`` serving the frozen behaviour policy.

SGLang is an optional extra (``pip install 'megatron_mugrpo[sglang]'``, it brings its own CUDA
torch and needs a GPU), so it is imported only when this engine is built.

Behaviour log-probs come from ``meta_info["output_token_logprobs"]``, (logprob, token_id, text)
tuples computed from the temperature-scaled logits; sampling uses top_p = 1, top_k = -1 (off) and
min_p = 0 so that they equal log_softmax(logits / T), what the trainer scores
(tests/rollout/test_sglang_gpu.py checks them against a teacher-forced recompute).

Weights are refreshed each stage with ``update_weights_from_disk`` (an exported HF directory) or
``update_weights_from_tensor`` (tensors streamed from the trainer); ``release()`` hands the weights'
and KV cache's GPU memory back (``release_memory_occupation``) for the optimizer phase, and the next
weight load resumes it. Sampling is seeded once per engine (``random_seed``); unlike the
transformers engine on CPU it is not bitwise reproducible across runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_mugrpo.errors import MissingInputError, require
from megatron_mugrpo.rollout.engine import (
    Generation,
    ProgressCallback,
    SamplingParams,
    check_prompt_ids,
    responses_per_prompt,
    validate_generations,
)

INSTALL_HINT = "SGLang is not installed: pip install 'megatron_mugrpo[sglang]' (needs a CUDA GPU)"
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

    def __post_init__(self) -> None:
        require(
            0.0 < self.mem_fraction_static < 1.0,
            f"rollout.sglang.mem_fraction_static={self.mem_fraction_static} must be in (0, 1)",
        )


class SGLangNotInstalledError(ImportError):
    """SGLang could not be imported."""


def import_sglang() -> Any:
    """Import SGLang lazily, or raise SGLangNotInstalledError with the install hint."""
    try:
        import sglang
    except ImportError as exc:
        raise SGLangNotInstalledError(f"{INSTALL_HINT} ({exc})") from exc
    return sglang


class SGLangEngine:
    """Rollout engine on SGLang's offline ``Engine`` (one process group per engine, GPU only).

    Args:
        hf_dir: local Hugging Face directory (config.json, weights, tokenizer).
        mem_fraction_static: GPU memory fraction for weights + KV cache (rollout.sglang.mem_fraction_static).
        seed: SGLang's ``random_seed``.
        tp_size: SGLang tensor parallelism.
        dtype: 'auto', 'bfloat16', 'float16' or 'float32'.
        enable_memory_saver: let ``release()`` free GPU memory (needs the ``torch_memory_saver``
            package SGLang uses); when False, release() only flushes the KV cache.
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
        dtype: str = "auto",
        enable_memory_saver: bool = True,
        **server_kwargs: Any,
    ) -> None:
        sglang = import_sglang()
        if not torch.cuda.is_available():
            raise RuntimeError("the SGLang engine needs a CUDA GPU; use rollout.engine=transformers on CPU")
        self.vocab_size = _hf_vocab_size(hf_dir)
        self._engine = sglang.Engine(
            model_path=str(hf_dir),
            mem_fraction_static=mem_fraction_static,
            random_seed=seed,
            tp_size=tp_size,
            dtype=dtype,
            enable_memory_saver=enable_memory_saver,
            **server_kwargs,
        )
        self._memory_saver = enable_memory_saver
        self._released = False
        self._weights_valid = True

    def load_hf_dir(self, path: str) -> None:
        """Load new weights of the same architecture from a local HF directory, in place."""
        self._resume()
        _check_ok(self._engine.update_weights_from_disk(str(path)), f"update_weights_from_disk({path})")
        self._weights_valid = True

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors in buckets of about WEIGHT_BUCKET_BYTES; the KV cache is
        flushed once, after the last bucket."""
        self._resume()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= WEIGHT_BUCKET_BYTES:
                self._send(bucket, flush_cache=False)
                bucket, size = [], 0
        self._send(bucket, flush_cache=True)
        self._weights_valid = True

    def _send(self, bucket: list[tuple[str, torch.Tensor]], *, flush_cache: bool) -> None:
        result = self._engine.update_weights_from_tensor(bucket, flush_cache=flush_cache)
        _check_ok(result, f"update_weights_from_tensor({[n for n, _ in bucket][:3]}...)")

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int],
        params: SamplingParams,
        progress: ProgressCallback | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n`` (or ``n[i]``) responses per prompt; rows are expanded here (one request per
        response) so that SGLang's radix cache shares each prompt's prefix."""
        if not self._weights_valid:
            raise RuntimeError("the SGLang engine was released: load weights (load_hf_dir / load_weights) first")
        counts = responses_per_prompt(n, len(prompts))
        check_prompt_ids(prompts, self.vocab_size)
        rows = [i for i, c in enumerate(counts) for _ in range(c)]
        sampling = {
            "temperature": params.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "max_new_tokens": params.max_new_tokens,
        }
        result: list[list[Generation]] = [[] for _ in prompts]
        for start in range(0, len(rows), REQUEST_CHUNK):
            chunk = rows[start : start + REQUEST_CHUNK]
            outputs = self._engine.generate(
                input_ids=[prompts[i] for i in chunk], sampling_params=sampling, return_logprob=True
            )
            for i, output in zip(chunk, outputs):
                result[i].append(generation_from_output(output))
            if progress is not None:
                progress(len(chunk))
        validate_generations(
            result, counts, vocab_size=self.vocab_size, max_new_tokens=params.max_new_tokens, engine=self.name
        )
        return result

    def release(self) -> None:
        """Free the weights' and KV cache's GPU memory; load weights again before generating.
        Without the memory saver only the KV cache is flushed (and the weights stay valid)."""
        if not self._memory_saver:
            self._engine.flush_cache()
        elif not self._released:
            self._engine.release_memory_occupation()
            self._released, self._weights_valid = True, False

    def _resume(self) -> None:
        if self._released:
            self._engine.resume_memory_occupation()
            self._released = False

    def shutdown(self) -> None:
        """Stop SGLang's processes (the engine cannot be used afterwards)."""
        self._engine.shutdown()


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


def _check_ok(result: Any, what: str) -> None:
    """SGLang weight calls answer (success, message[, ...]) tuples or dicts; raise on failure."""
    if isinstance(result, dict):
        ok, message = result.get("success", True), result.get("message", "")
    elif isinstance(result, (tuple, list)) and result:
        ok, message = result[0], result[1] if len(result) > 1 else ""
    else:
        return
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _hf_vocab_size(hf_dir: str | Path) -> int:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise MissingInputError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    config = json.loads(path.read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise ValueError(f"{path} has no vocab_size")
    return int(vocab)
