"""The CPU demo's starting policy: a tiny Qwen2-architecture model (or a Qwen3-MoE one, ``model.tiny.arch``)
built locally, then warm-started.

Nothing can be downloaded at run time, so the demo builds its own tokenizer (character level) and
a small randomly initialised Qwen2 model, then teaches it the answer format with a short supervised
phase on the built-in task: worked arithmetic steps ("23+58=" → "3+8+0=11,2+5+1=8,\\boxed{81}<eos>"),
or for a code task the program ("a+b:" → "```\\na,b=map(int,input().split())\\nprint(a+b)\\n```<eos>"),
with a deliberate flaw in a fraction of the examples (``warmstart.answer_noise``). The result is an ordinary
Hugging Face directory that the converter, the rollout engine and the trainer read like any real
checkpoint. It is cached: a directory with a ``warmstart.json`` matching the requested settings is
reused as it is (resume, repeated demos).

    hf_dir = base_model_dir(cfg.model, cfg.warmstart, run_dir / "base_model", task=cfg.data.builtin_task, seed=cfg.seed)

The ``model.*`` and ``warmstart.*`` config sections live here, with the code that reads them; the
heavy libraries (transformers' models, megatron-core) are imported only when a model is built.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megatron_mugrpo import durable
from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.errors import require
from megatron_mugrpo.rollout.tasks import (
    builtin_completion,
    builtin_problems,
    builtin_prompt,
    builtin_reward_kind,
    builtin_solution,
    builtin_template,
    code_solution,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WARMSTART_FILE = "warmstart.json"
INIT_STD = 0.02
"""Initialiser std of the tiny model (transformers' default for Qwen2)."""
DTYPES = ("float32", "bfloat16", "float16")
"""model.dtype choices: names of torch dtypes (``ModelConfig.torch_dtype``)."""
TINY_ARCHS = ("qwen2", "qwen3_moe")
"""model.tiny.arch choices: dense Qwen2, or Qwen3-MoE (every layer sparse, no shared expert)."""
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(kw_only=True)
class TinyModelConfig:
    """``model.tiny.*``: shape of the small model built locally for the CPU demo and tests (Qwen2 by default)."""

    arch: str = "qwen2"
    """Architecture: ``qwen2`` (dense) or ``qwen3_moe`` (a mixture of experts in every layer, built from
    ``num_experts`` / ``num_experts_per_tok`` / ``moe_intermediate_size``; ``intermediate_size`` unused)."""
    hidden_size: int = 64
    """Width of the residual stream; a multiple of num_attention_heads."""
    num_layers: int = 2
    """Transformer layers (parallel.pipeline_parallel must divide it)."""
    num_attention_heads: int = 4
    """Query heads (parallel.tensor_parallel must divide it)."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); divides num_attention_heads."""
    intermediate_size: int = 128
    """Width of the gated MLP."""
    max_position_embeddings: int = 256
    """Longest sequence (prompt + response) the model is built for."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output layer."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    num_experts: int = 4
    """qwen3_moe only: experts per layer (parallel.expert_parallel must divide it)."""
    num_experts_per_tok: int = 2
    """qwen3_moe only: experts each token is routed to (top-k, probabilities renormalised over them)."""
    moe_intermediate_size: int = 32
    """qwen3_moe only: width of each expert's gated MLP."""

    def __post_init__(self) -> None:
        require(self.arch in TINY_ARCHS, f"model.tiny.arch={self.arch!r} is not one of {TINY_ARCHS}")
        require(
            1 <= self.num_experts_per_tok <= self.num_experts,
            f"model.tiny.num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
            f"model.tiny.num_experts={self.num_experts}]",
        )
        require(
            self.moe_intermediate_size >= 1,
            f"model.tiny.moe_intermediate_size={self.moe_intermediate_size} must be >= 1",
        )
        require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"model.tiny.num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"model.tiny.num_key_value_heads={self.num_key_value_heads}",
        )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"model.tiny.hidden_size={self.hidden_size} must be divisible by "
            f"model.tiny.num_attention_heads={self.num_attention_heads}",
        )


@dataclass(kw_only=True)
class ModelConfig:
    """``model.*``: which policy to train."""

    hf_dir: str = ""
    """Local Hugging Face directory (config.json + safetensors + tokenizer). Empty: build the tiny
    model described by ``tiny`` (the CPU demo)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the locally built model when ``hf_dir`` is empty."""
    dtype: str = "float32"
    """Parameter / compute dtype of the trainer: float32 (CPU), bfloat16 (GPU)."""

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"model.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.hf_dir:
            require(
                Path(self.hf_dir).is_dir(),
                f"model.hf_dir={self.hf_dir!r} is not a directory; point it at a local Hugging Face "
                "checkpoint (nothing is downloaded at run time) or leave it empty for the tiny model",
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as the torch dtype the trainer builds its model in."""
        return getattr(torch, self.dtype)


@dataclass(kw_only=True)
class WarmStartConfig:
    """``warmstart.*``: short supervised phase for the locally built demo model (cached in the run directory)."""

    steps: int = 0
    """SFT steps on the built-in task before RL (0: none)."""
    lr: float = 3e-3
    """AdamW learning rate of the supervised phase (decayed linearly to 0)."""
    batch_size: int = 32
    """Examples per supervised step."""
    answer_noise: float = 0.0
    """Fraction of warm-start examples with a deliberate flaw: for a math task the final boxed answer
    has one digit miscopied (the worked steps stay right); for a running-sum task one partial sum slips
    and the rest of the chain carries the error to the box; for a code task the program leaves its input
    as text (``a,b=input().split()``, wrong or failing once run). The demos use it to start RL from a
    policy with a systematic flaw that only the reward (verifier, tests) reveals."""

    def __post_init__(self) -> None:
        require(self.steps >= 0, f"warmstart.steps={self.steps} must be >= 0")
        require(0.0 <= self.answer_noise < 1.0, f"warmstart.answer_noise={self.answer_noise} must be in [0, 1)")


def base_model_dir(model: ModelConfig, warmstart: WarmStartConfig, out_dir: Path, *, task: str, seed: int) -> Path:
    """The Hugging Face directory the run starts from: ``model.hf_dir``, or the tiny model built (and
    warm-started on the built-in ``task``) in ``out_dir``, reused when its settings match."""
    if model.hf_dir:
        return Path(model.hf_dir)
    spec = base_model_spec(model.tiny, warmstart, task=task, seed=seed)
    marker = out_dir / WARMSTART_FILE
    if marker.is_file() and json.loads(marker.read_text()).get("spec") == spec:
        return out_dir
    # Built aside and swapped in whole (replacing a model of other settings), the marker inside: a
    # half-built directory is never reused. fsync: the marker vouches for every file beside it.
    with durable.atomic_dir(out_dir, replace_existing=True, fsync=True) as tmp:
        tokenizer = build_char_tokenizer(tmp)
        policy = build_tiny_model(model.tiny, tokenizer, seed=seed)
        losses = supervised_warmstart(policy, tokenizer, warmstart, task=task, seed=seed)
        policy.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / WARMSTART_FILE).write_text(json.dumps({"spec": spec, "final_loss": losses[-1] if losses else None}))
    return out_dir


def base_model_spec(tiny: TinyModelConfig, warmstart: WarmStartConfig, *, task: str, seed: int) -> dict[str, Any]:
    """Everything the built base model depends on: runs with equal specs can share one base model."""
    shape = dict(tiny.__dict__)
    if tiny.arch == "qwen2":  # the dense model's spec as before the MoE option: its cached base models stay valid
        for key in ("arch", *_MOE_FIELDS):
            shape.pop(key)
    return {"tiny": shape, "warmstart": dict(warmstart.__dict__), "seed": seed, "task": task}


class _DataSection(Protocol):
    builtin_task: str


class RunSections(Protocol):
    """The sections of a run config the two adapters below read (``config.RunConfig`` has them)."""

    model: ModelConfig
    warmstart: WarmStartConfig
    data: _DataSection
    seed: int


def prepare_base_model(cfg: RunSections, out_dir: Path) -> Path:
    """``base_model_dir`` with the sections taken from a whole run config: kept for callers that have
    not moved to ``base_model_dir`` yet."""
    return base_model_dir(cfg.model, cfg.warmstart, out_dir, task=cfg.data.builtin_task, seed=cfg.seed)


def warmstart_spec(cfg: RunSections) -> dict[str, Any]:
    """``base_model_spec`` from a whole run config: kept for callers that have not moved to it yet."""
    return base_model_spec(cfg.model.tiny, cfg.warmstart, task=cfg.data.builtin_task, seed=cfg.seed)


def tiny_model_hf_config(tiny: TinyModelConfig, *, vocab_size: int, **extra: Any) -> dict[str, Any]:
    """The ``config.json`` dict of the tiny model of ``model.tiny`` over a vocabulary of ``vocab_size``:
    the one the demo builds (``build_tiny_model``) and the one a run's plan sizes (``plan.inputs``).
    ``extra`` adds keys that do not change the shape (token ids, initialisation, dtype)."""
    from megatron_mugrpo.training.model import tiny_hf_config

    moe = (
        {
            "num_experts": tiny.num_experts,
            "num_experts_per_tok": tiny.num_experts_per_tok,
            "moe_intermediate_size": tiny.moe_intermediate_size,
            "head_dim": tiny.hidden_size // tiny.num_attention_heads,
        }
        if tiny.arch == "qwen3_moe"
        else {}
    )
    return tiny_hf_config(
        tiny.arch,
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
        rope_theta=tiny.rope_theta,
        **moe,
        **extra,
    )


def build_tiny_model(tiny: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, *, seed: int) -> torch.nn.Module:
    """A randomly initialised Qwen2ForCausalLM (or Qwen3MoeForCausalLM, ``tiny.arch``) of the configured
    shape, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = tiny_model_hf_config(
        tiny,
        vocab_size=len(tokenizer),
        initializer_range=INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    config = AutoConfig.for_model(**hf)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def worked_solution(problem: str, answer: str) -> str:
    """The step-by-step answer the warm start teaches, digit by digit from the right.

    '23+58' → '3+8+0=11,2+5+1=8,\\boxed{81}' (digit + digit + carry = sum);
    '52-38' → '12-8-0=4,5-3-1=1,\\boxed{14}' (a borrowed ten is written into the digit).
    Each step is a one-digit table lookup, which a tiny model learns quickly and which generalises
    to unseen problems; only the final ``\\boxed{}`` is verified.
    """
    op = "+" if "+" in problem else "-"
    a, b = (operand[::-1] for operand in problem.split(op))
    steps, carry = [], 0
    for i in range(max(len(a), len(b))):
        x, y = int(a[i]) if i < len(a) else 0, int(b[i]) if i < len(b) else 0
        if op == "+":
            steps.append(f"{x}+{y}+{carry}={x + y + carry}")
            carry = (x + y + carry) // 10
        else:
            borrow = int(x - y - carry < 0)
            steps.append(f"{x + 10 * borrow}-{y}-{carry}={x + 10 * borrow - y - carry}")
            carry = borrow
    return ",".join(steps) + "," + builtin_completion(answer)


def miscopy(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit replaced by a different digit (the warm start's deliberate flaw)."""
    pos = rng.randrange(len(answer))
    wrong = rng.choice([d for d in "0123456789" if d != answer[pos]])
    return answer[:pos] + wrong + answer[pos + 1 :]


def sft_batch(
    rows: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    noise: float = 0.0,
    rng: random.Random | None = None,
    task: str | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion + EOS with labels only on the completion (−100 elsewhere).

    Rows of a math task (``task`` None or a math task) get worked steps; with ``noise`` > 0 that
    fraction of completions box a miscopied answer after correct steps. Rows of a code task get the
    program (``code_solution``); with ``noise`` > 0 that fraction of programs has the flaw.
    """
    rng = rng or random.Random(0)
    code_prompt = builtin_template(task) if task is not None and builtin_reward_kind(task) == "code" else None
    seqs, labels = [], []
    for row in rows:
        chain = builtin_solution(task, row["problem"], noise=noise, rng=rng) if task is not None else None
        if code_prompt is not None:
            prompt = tokenizer(code_prompt(row["problem"]))["input_ids"]
            solution = code_solution(row["problem"], flawed=rng.random() < noise)
        elif chain is not None:  # a long-chain task writes its own chain (a slipped step is its flaw)
            prompt, solution = tokenizer(builtin_prompt(row["problem"]))["input_ids"], chain
        else:
            prompt = tokenizer(builtin_prompt(row["problem"]))["input_ids"]
            boxed = miscopy(row["answer"], rng) if rng.random() < noise else row["answer"]
            solution = (
                worked_solution(row["problem"], row["answer"]).rsplit(",", 1)[0] + "," + builtin_completion(boxed)
            )
        completion = tokenizer(solution, add_special_tokens=False)["input_ids"]
        completion = [*completion, tokenizer.eos_token_id]
        seqs.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    length = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([s + [pad] * (length - len(s)) for s in seqs])
    label_ids = torch.tensor([lab + [-100] * (length - len(lab)) for lab in labels])
    return {"input_ids": input_ids, "labels": label_ids, "attention_mask": (label_ids != -100) | (input_ids != pad)}


def supervised_warmstart(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    ws: WarmStartConfig,
    *,
    task: str,
    seed: int,
) -> list[float]:
    """A short supervised phase on built-in train problems; returns the loss per step."""
    if ws.steps == 0:
        return []
    rows = builtin_problems(task, n=ws.steps * ws.batch_size, seed=seed + 1, split="train")
    random.Random(seed).shuffle(rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / ws.steps)
    model.train()
    losses = []
    noise_rng = random.Random(seed + 2)
    for step in range(ws.steps):
        chunk = rows[step * ws.batch_size : (step + 1) * ws.batch_size]
        batch = sft_batch(chunk, tokenizer, noise=ws.answer_noise, rng=noise_rng, task=task)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def describe(hf_dir: Path) -> dict[str, Any]:
    """The warm-start record of a built base model (empty for a user-supplied checkpoint)."""
    marker = Path(hf_dir) / WARMSTART_FILE
    return json.loads(marker.read_text()) if marker.is_file() else {}
