"""The run the loops operate on (``loop.run``) and how each verb opens it (``loop.opening``): the
configuration type the loops read matches the composed one, and every verb's opening rule."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from megatron_mugrpo.config import RunConfig
from megatron_mugrpo.loop.opening import Opening
from megatron_mugrpo.loop.run import Run, RunSections
from megatron_mugrpo.metrics import TENSORBOARD_DIR
from megatron_mugrpo.state import TrainerState


def test_the_sections_the_loops_read_are_the_composed_ones():
    """``RunSections`` (what the loops type ``run.cfg`` as) lists every field of ``RunConfig`` with the same
    type, so the loops read the real sections without importing the composition root."""
    composed = typing.get_type_hints(RunConfig)
    read = typing.get_type_hints(RunSections)
    assert read == {field.name: composed[field.name] for field in dataclasses.fields(RunConfig)}
    assert callable(RunConfig().to_dict)


def test_the_run_keeps_the_names_every_loop_reads_and_groups_the_rest():
    top = {field.name for field in dataclasses.fields(Run)}
    assert {"cfg", "run_dir", "groups", "policy", "state", "engine"} <= top
    assert {"origin", "inputs", "trainer", "telemetry"} <= top
    assert len(top) <= 12, f"{sorted(top)}: put a new component in one of the groups, not at the top of Run"
    assert isinstance(Run.placement, property)


# Each verb's rule, as the table of ``Opening``'s docstring states it: (opening, starts from the newest
# checkpoint, records kept of 7 when resumed from a checkpoint, the same without one, metrics source).
VERBS = {
    "train": (Opening.new("train: created"), False, None, None, None),
    "train --resume": (Opening.resumed("train --resume"), True, 7, 0, None),
    "generate": (Opening.phase("generate", None), True, None, None, None),
    "optimize": (Opening.phase("optimize", None), True, 7, 0, None),
    "eval": (Opening.evaluation(None, None), True, None, None, "eval"),
}


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_opens_by_its_own_rule(verb: str):
    opening, latest, kept_resumed, kept_fresh, standalone = VERBS[verb]
    state = TrainerState(metrics_records=7)
    assert opening.latest is latest and opening.checkpoint is None and opening.standalone == standalone
    assert opening.keep_records(state, Path("step_00000008")) == kept_resumed
    assert opening.keep_records(state, None) == kept_fresh


def test_a_new_run_records_its_creation_and_a_phase_verb_only_a_change():
    assert Opening.new("train: created from c.yaml").record == "train: created from c.yaml"
    assert Opening.phase("optimize", None).record is None


def test_only_the_phase_verbs_open_as_a_phase():
    with pytest.raises(ValueError, match="'train' is not one of \\('generate', 'optimize'\\)"):
        Opening.phase("train", None)


def test_an_evaluation_writes_its_own_metrics_source_and_tensorboard_run():
    step = Path("run/checkpoints/step_00000008")
    opening = Opening.evaluation(step, "eval: k=4")
    assert opening.metrics_source(step) == ("mugrpo eval of step_00000008", f"{TENSORBOARD_DIR}/eval_step_00000008")
    assert opening.metrics_source(None) == ("mugrpo eval of base_model", f"{TENSORBOARD_DIR}/eval_base_model")
    assert Opening.resumed(None).metrics_source(step) == (None, TENSORBOARD_DIR)


def test_the_weights_come_from_the_given_step_else_the_newest_else_the_base_model(tmp_path: Path):
    root = tmp_path / "checkpoints"
    given = tmp_path / "elsewhere" / "step_00000004"
    assert Opening.evaluation(given, None).start_from(root) == given
    assert Opening.resumed(None).start_from(root) is None  # no checkpoint yet: the Hugging Face model
    assert Opening.new(None).start_from(root) is None
