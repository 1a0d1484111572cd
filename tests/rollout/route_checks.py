"""Shared checks of recorded routes (tests/rollout/test_routes*.py): a teacher-forced forward's routes,
and every generation's routes against them."""

from __future__ import annotations

import numpy as np
import torch

from megatron_mugrpo.rollout.routes import RoutedGeneration, RouteRecorder


@torch.no_grad()
def teacher_forced_routes(model: torch.nn.Module, recorder: RouteRecorder, tokens: list[int]) -> np.ndarray:
    """The routes of one forward over ``tokens`` (a scoring pass armed as a one-row prefill)."""
    recorder.begin([len(tokens)])
    recorder.step([0])
    model(input_ids=torch.tensor([tokens]))
    return recorder.routes(0)


def assert_routes_are_teacher_forced(model: torch.nn.Module, prompts, groups, *, moe_layers: int, topk: int) -> None:
    """Every generation is a RoutedGeneration whose routes, [prompt + response - 1, layers, k], equal a
    teacher-forced forward's over prompt + response minus its last token."""
    checker = RouteRecorder(model)
    try:
        for prompt, group in zip(prompts, groups):
            for gen in group:
                assert isinstance(gen, RoutedGeneration)
                assert gen.routes.shape == (len(prompt) + len(gen.response_ids) - 1, moe_layers, topk)
                expected = teacher_forced_routes(model, checker, prompt + gen.response_ids[:-1])
                np.testing.assert_array_equal(gen.routes, expected)
    finally:
        checker.close()
