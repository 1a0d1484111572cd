"""Check a converted checkpoint numerically: Megatron (any TP × PP; EP > 1 at TP = 1) and transformers
logits on the same random tokens, reported as the max absolute logit difference and the mean KL divergence.

Both models run in float32, whatever the checkpoint dtype, so the comparison measures the
conversion and not bf16 rounding. Only the true vocabulary is compared: Megatron's padded rows
do not exist in HF.

    result = verify("/models/Qwen3-1.7B-Base", "/ckpt/qwen3", tp=2, pp=2)
    print(result.line())    # max_abs_logit_diff=3.1e-06 kl=2.0e-12 ok=True
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron_mugrpo.conversion.convert import check_convertible
from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.hf_io import load_hf_config
from megatron_mugrpo.conversion.launch import run_on_ranks
from megatron_mugrpo.conversion.live import as_chunks
from megatron_mugrpo.conversion.megatron_io import build_model_chunks, load_model, read_metadata, resolve_step_dir
from torch import Tensor

from megatron_mugrpo.training.moe import is_moe
from megatron_mugrpo.training.parallel import ParallelGroups

DEFAULT_ATOL = 1e-3
"""Max |logit difference| accepted by ``mugrpo convert verify`` (float32; tiny models reach ~1e-6,
7B models ~1e-4 from summation order across 28 layers)."""
DEFAULT_KL_TOL = 1e-5
"""Mean KL(HF || Megatron) per position accepted by ``mugrpo convert verify``."""


@dataclass(frozen=True)
class VerifyResult:
    """Agreement of the two models on one batch of random tokens."""

    max_abs_logit_diff: float
    kl: float
    """Mean over positions of KL(p_hf || p_megatron) over the true vocabulary (nats)."""
    atol: float
    kl_tol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_logit_diff <= self.atol and self.kl <= self.kl_tol

    def line(self) -> str:
        return f"max_abs_logit_diff={self.max_abs_logit_diff:.3e} kl={self.kl:.3e} ok={self.ok}"


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> Tensor:
    """[batch, seq_len] int64 token ids drawn uniformly from the true vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=generator)


def _pp_neighbour(groups: ParallelGroups, offset: int) -> int:
    return dist.get_global_rank(groups.pp_group, groups.pp_rank + offset)


@torch.no_grad()
def pipeline_forward_logits(
    model_chunks: Any, tokens: Tensor, vocab_size: int, groups: ParallelGroups
) -> Tensor | None:
    """Forward-only pass through this rank's pipeline stage; full logits on the last stage.

    tokens: [B, S] on every rank. Hidden states [S, B, H] go stage to stage by point-to-point send /
    recv on the PP group ([S / TP, B, H], each TP rank's slice, under sequence parallelism). Returns
    [B, S, vocab_size] float32 logits (TP shards gathered, padding dropped) on last-stage ranks, None
    elsewhere.
    """
    (model,) = as_chunks(model_chunks)
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    batch, seq_len = tokens.shape
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, seq_len)
    if not groups.is_first_stage:
        local_len = seq_len // groups.tp if model.config.sequence_parallel else seq_len
        hidden = torch.empty(local_len, batch, model.config.hidden_size, dtype=model.config.params_dtype, device=device)
        dist.recv(hidden, src=_pp_neighbour(groups, -1))
        model.set_input_tensor(hidden)
    output = model(tokens, positions, attention_mask=None)
    if not groups.is_last_stage:
        dist.send(output.contiguous(), dst=_pp_neighbour(groups, +1))
        return None
    logits = _gather_vocab_shards(output, groups)  # [B, S, V_pad]
    return logits[..., :vocab_size].float()


def _gather_vocab_shards(output: Tensor, groups: ParallelGroups) -> Tensor:
    """[B, S, V_pad / tp] logits of every TP rank concatenated along the vocabulary (in rank order)."""
    if groups.tp == 1:
        return output
    shards = [torch.empty_like(output) for _ in range(groups.tp)]
    dist.all_gather(shards, output.contiguous(), group=groups.tp_group)
    return torch.cat(shards, dim=-1)


def hf_logits(hf_dir: str | Path, tokens: Tensor) -> Tensor:
    """[B, S, V] float32 logits of the transformers model in ``hf_dir`` (loaded in float32 on CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def compare_logits(reference: Tensor, candidate: Tensor, *, atol: float, kl_tol: float) -> VerifyResult:
    """Max |reference − candidate| and mean KL(softmax(reference) || softmax(candidate)); both [B, S, V]."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference.shape)} vs {tuple(candidate.shape)}")
    ref_logp = F.log_softmax(reference.double(), dim=-1)
    cand_logp = F.log_softmax(candidate.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1).mean()
    diff = (reference.double() - candidate.double()).abs().max()
    return VerifyResult(float(diff), max(float(kl), 0.0), atol, kl_tol)


def megatron_logits_on_rank(groups: ParallelGroups, step_dir: str, tokens: Tensor, out_file: str) -> None:
    """Rank body: load the step directory in float32, forward ``tokens``; rank 0 of the last stage saves logits."""
    hf_config = read_metadata(step_dir)["hf_config"]
    chunks = build_model_chunks(hf_config, torch.float32, groups)
    load_model(step_dir, chunks, groups)
    logits = pipeline_forward_logits(chunks, tokens, hf_config["vocab_size"], groups)
    if logits is not None and groups.tp_rank == 0 and groups.dp_rank == 0:
        torch.save(logits.cpu(), out_file)


def verify(
    hf_dir: str | Path,
    ckpt: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    batch: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    atol: float = DEFAULT_ATOL,
    kl_tol: float = DEFAULT_KL_TOL,
) -> VerifyResult:
    """Compare the Megatron checkpoint ``ckpt`` (run at TP × PP × EP) with the HF model in ``hf_dir``.

    Spawns its own TP × PP × EP ranks, so it must be called from a plain (non-distributed) process.
    Every rank forwards the same tokens; with EP > 1 they travel to the EP rank holding their experts.
    """
    if dist.is_initialized():
        raise ConversionError("verify spawns its own ranks: run it from a plain process, not under torchrun")
    hf_config = load_hf_config(hf_dir)
    step_dir = resolve_step_dir(ckpt)
    check_convertible(read_metadata(step_dir)["hf_config"], tp, pp, ep)
    if is_moe(hf_config) and tp > 1 and seq_len % tp:
        raise ConversionError(
            f"--seq-len {seq_len}: a mixture-of-experts model at --tp {tp} runs sequence-parallel, which splits "
            f"the sequence over the {tp} TP ranks; use a multiple of {tp}"
        )
    tokens = random_tokens(hf_config["vocab_size"], batch, seq_len, seed)
    reference = hf_logits(hf_dir, tokens)
    with tempfile.TemporaryDirectory(prefix="mugrpo-verify-") as tmp:
        out_file = str(Path(tmp) / "logits.pt")
        run_on_ranks(megatron_logits_on_rank, tp=tp, pp=pp, ep=ep, args=(str(step_dir), tokens, out_file))
        candidate = torch.load(out_file)
    return compare_logits(reference, candidate, atol=atol, kl_tol=kl_tol)
