"""The router-loss coefficient correction for sequence parallelism (``mcore_compat``), field by field.

That it gives one rank's gradients is measured end to end in ``test_moe_tp_ep.py`` (``moe_losses``);
here: when it applies, by how much, and that other megatron-core versions are left alone.
"""

from __future__ import annotations

import logging

import pytest

from megatron_mugrpo.training import mcore_compat
from megatron_mugrpo.training.mcore_compat import sequence_parallel_router_loss_coefficients as corrected

SP_TP4 = {
    "tensor_model_parallel_size": 4,
    "sequence_parallel": True,
    "calculate_per_token_loss": True,
    "moe_aux_loss_coeff": 1e-3,
    "moe_z_loss_coeff": 1e-4,
}


def test_both_coefficients_are_multiplied_by_tp_under_sequence_parallelism():
    assert corrected(SP_TP4) == pytest.approx({"moe_aux_loss_coeff": 4e-3, "moe_z_loss_coeff": 4e-4})


@pytest.mark.parametrize(
    "change",
    [
        {"tensor_model_parallel_size": 1},
        {"sequence_parallel": False},
        {"calculate_per_token_loss": False},  # megatron-core's mean-loss path weighs the slices right
        {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None},  # both losses off
    ],
)
def test_nothing_changes_outside_that_case(change):
    assert corrected({**SP_TP4, **change}) == {}


def test_only_the_losses_that_are_on_are_scaled():
    assert corrected({**SP_TP4, "moe_z_loss_coeff": None}) == pytest.approx({"moe_aux_loss_coeff": 4e-3})


def test_other_megatron_core_versions_are_left_alone_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(mcore_compat, "mcore_version", lambda: (0, 17))
    with caplog.at_level(logging.WARNING, logger=mcore_compat.__name__):
        assert corrected(SP_TP4) == {}
    assert "router-loss gradients under sequence parallelism" in caplog.text
