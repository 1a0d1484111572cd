"""The unfused vocab-parallel log-prob: values and gradients against log_softmax on the true vocabulary."""

from __future__ import annotations

import torch

from megatron_mugrpo.training.logprobs import logprobs_from_logits

TRUE_VOCAB = 10
PADDED_VOCAB = 16


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits[..., :TRUE_VOCAB] / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_matches_log_softmax_over_the_true_vocabulary():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, PADDED_VOCAB, generator=gen, dtype=torch.float64) * 3
    logits[..., TRUE_VOCAB:] = 50.0  # huge padding logits must not leak into the normaliser
    targets = torch.randint(0, TRUE_VOCAB, (2, 5), generator=gen)
    ours = logprobs_from_logits(logits.float(), targets, temperature=0.7, vocab_size=TRUE_VOCAB, tp_group=None)
    assert ours.dtype == torch.float32 and ours.shape == (2, 5)
    torch.testing.assert_close(ours.double(), _reference(logits, targets, 0.7), atol=1e-5, rtol=0)


def test_gradient_matches_autograd_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, PADDED_VOCAB, generator=gen).requires_grad_()  # float32, as the model emits
    targets = torch.randint(0, TRUE_VOCAB, (3, 4), generator=gen)
    weights = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    ours = logprobs_from_logits(logits, targets, temperature=1.3, vocab_size=TRUE_VOCAB, tp_group=None)
    (ours.double() * weights).sum().backward()
    ours = logits.grad.double()
    reference = logits.detach().double().requires_grad_()
    (_reference(reference, targets, 1.3) * weights).sum().backward()
    # The statistics are float32 (as on bf16 GPUs): float32 accuracy against the float64 reference.
    torch.testing.assert_close(ours, reference.grad, atol=1e-6, rtol=0)
    assert torch.all(ours[..., TRUE_VOCAB:] == 0), "padding rows get no gradient"
