"""What may change when a run continues: the resume policy, in one place.

The stored ``RUN_DIR/config.yaml`` is the run's config. A run continued with ``train --resume`` (or
the phase verbs ``generate`` / ``optimize`` / ``eval`` on an existing run) may change only keys that
are safe mid-run, given as dotted prefixes in ``SAFE_KEYS``:

* ``stages.num_stages``: extends (or ends earlier) the schedule; finished stages stay as they are;
* ``eval.*``, ``logging.*``: read the policy and report on it, never change it;
* ``checkpoint.every_updates``, ``checkpoint.every_stages``, ``checkpoint.keep_last``: when
  checkpoints are written and how many are kept, not what they hold.

Everything else is refused with an error naming the key and why (``UNSAFE_REASONS``): the stored
rollout datasets, the checkpoint's weights and optimizer moments and the data cursor were all made
under the old value, and mixing them silently gives a run that matches neither config. The same
check catches hand edits of ``config.yaml``: it is compared with the config the run last ran with
(``config_history.json``, else the latest checkpoint's ``run_config``).

    cfg, changed = continue_config(run_dir, ["stages.num_stages=3"], load=load_config)   # ResumeError if unsafe
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.rundir import CONFIG_FILE, read_history

SAFE_KEYS = (
    "stages.num_stages",
    "eval.",
    "logging.",
    "checkpoint.every_updates",
    "checkpoint.every_stages",
    "checkpoint.keep_last",
)
"""Dotted keys (exact, or a whole section when ending in '.') that may change on resume."""

UNSAFE_REASONS = (
    ("model.", "it changes the model, so the checkpoint's weights no longer fit it"),
    ("warmstart.", "it changes the base model the run started from"),
    ("parallel.", "the checkpoint's optimizer state and RNG streams belong to the old layout"),
    ("data.", "the prompt order and the stored rollout datasets come from the old data"),
    ("rollout.", "the stored rollout datasets were generated with the old value"),
    ("stages.", "the stored rollout datasets and the minibatch cursor follow the old schedule"),
    ("algo.", "the updates so far optimised the old objective"),
    ("optim.", "the optimizer moments in the checkpoint belong to the old optimizer settings"),
    ("kernels.", "the trainer's numerics would change in the middle of the run"),
)
"""Why a key outside SAFE_KEYS may not change, by prefix (first match wins)."""
DEFAULT_REASON = "the run's checkpoints and stored rollouts were made with the old value"
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
"""Hugging Face config keys that fix the shape of every weight."""


class ResumeError(InputError, ValueError):
    """A change to an existing run that the resume policy refuses; names the key and why."""


def _matches(key: str, prefix: str) -> bool:
    if prefix.endswith("."):
        return key.startswith(prefix) or key == prefix[:-1]
    return key == prefix or key.startswith(prefix + ".")


def is_safe(key: str) -> bool:
    """Whether the dotted ``key`` may change on resume."""
    return any(_matches(key, prefix) for prefix in SAFE_KEYS)


def why_unsafe(key: str) -> str:
    return next((reason for prefix, reason in UNSAFE_REASONS if _matches(key, prefix)), DEFAULT_REASON)


def refuse(keys: Iterable[str], how: str) -> None:
    """Raise ResumeError for the unsafe ones among ``keys`` (``how``: e.g. 'cannot be overridden on resume')."""
    unsafe = [key for key in keys if not is_safe(key)]
    if unsafe:
        reasons = "; ".join(f"{key}: {why_unsafe(key)}" for key in unsafe)
        raise ResumeError(
            f"{', '.join(unsafe)} {how} ({reasons}). Only {_safe_keys_text()} may change on resume; "
            "start a new run (--config C --run-dir NEW_DIR) to change anything else"
        )


def _safe_keys_text() -> str:
    return ", ".join(key + "*" if key.endswith(".") else key for key in SAFE_KEYS)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": [1, {"c": 2}]}}`` → ``{"a.b.0": 1, "a.b.1.c": 2}``."""
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, list):
        items = ((str(index), value) for index, value in enumerate(tree))
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for name, value in items:
        out.update(flatten(value, f"{prefix}.{name}" if prefix else str(name)))
    return out


def changed_keys(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Dotted keys present in both configs whose values differ.

    Keys on one side only are not compared: they come from a config written by an older schema (a
    key renamed since) or are list elements that came or went (eval.benchmarks, a safe section).
    """
    old, new = flatten(before), flatten(after)
    return sorted(key for key in old.keys() & new.keys() if old[key] != new[key])


def reference_config(run_dir: Path) -> dict[str, Any] | None:
    """The config the run last ran with: config_history.json's, else the latest checkpoint's run_config."""
    history = read_history(run_dir)
    if history is not None and history.get("config"):
        return history["config"]
    from megatron_mugrpo.training.checkpoint import latest_checkpoint, read_metadata

    step_dir = latest_checkpoint(run_dir / "checkpoints")
    return read_metadata(step_dir).get("run_config") if step_dir is not None else None


ConfigLoader = Callable[..., Any]
"""``config.load_config(path, overrides=())``: handed in by the entry point (components do not import the
config root); what it returns has ``to_dict()`` and ``stages.num_stages``."""


def override_keys(overrides: Sequence[str]) -> list[str]:
    return [item.split("=", 1)[0].strip() for item in overrides]


def continue_config(run_dir: Path, overrides: Sequence[str], *, load: ConfigLoader) -> tuple[Any, list[str]]:
    """The config an existing run continues with, and what changed: the overrides, then hand edits.

    Refuses (ResumeError) unsafe overrides, unsafe hand edits of config.yaml and a stage count below
    the stages already finished. Reads only; nothing on disk changes.
    """
    path = run_dir / CONFIG_FILE
    refuse(override_keys(overrides), "cannot be overridden on resume")
    stored = load(path)
    reference = reference_config(run_dir)
    edited = changed_keys(reference, stored.to_dict()) if reference is not None else []
    refuse(edited, f"differ in {path} from the config the run has been running with (edited by hand?)")
    cfg = load(path, list(overrides)) if overrides else stored
    check_stage_count(cfg.stages.num_stages, run_dir)
    return cfg, [*overrides, *(f"{key} edited in {CONFIG_FILE}" for key in edited)]


def check_stage_count(num_stages: int, run_dir: Path) -> None:
    """``stages.num_stages`` may not drop below the stages the latest checkpoint has finished."""
    from megatron_mugrpo.training.checkpoint import latest_checkpoint, read_metadata

    step_dir = latest_checkpoint(run_dir / "checkpoints")
    if step_dir is None:
        return
    done = int(read_metadata(step_dir)["trainer_state"].get("stage", 0))
    if num_stages < done:
        raise ResumeError(
            f"stages.num_stages={num_stages}: the run has already finished {done} stages "
            f"({step_dir.name}); give at least {done}"
        )


def check_same_model(hf_config: Mapping[str, Any], checkpoint_hf_config: Mapping[str, Any], where: Path) -> None:
    """ResumeError when the model about to be built has another shape than the checkpoint's."""
    differ = [
        f"{key} {checkpoint_hf_config.get(key)!r} → {hf_config.get(key)!r}"
        for key in ARCHITECTURE_KEYS
        if key in checkpoint_hf_config and checkpoint_hf_config.get(key) != hf_config.get(key)
    ]
    if differ:
        raise ResumeError(
            f"the model differs from the one in {where} ({', '.join(differ)}): point model.hf_dir at the "
            "checkpoint's model, or start a new run"
        )
