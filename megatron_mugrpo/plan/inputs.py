"""What the planner reads from a run: the model's ``config.json`` fields, and stand-ins for the paths a
plan does not need.

A paper config names its checkpoint and data by placeholder paths (``/path/to/Qwen2.5-Math-7B``) that
fail validation until overridden, on purpose. A plan is made before anything is downloaded, so
``planning_overrides`` points a placeholder model directory at a temporary one holding the model's
published ``config.json`` fields (``plan.models.KNOWN_MODELS``, chosen by the directory's name) and a
placeholder data file at an empty stand-in; everything else is validated exactly as ``mugrpo train``
validates it. The tiny CPU model's fields come from ``model.tiny`` as ``warmstart`` builds it.

    with planning_overrides(Path("configs/paper/qwen2.5_math_7b__mu_grpo.yaml"), []) as (overrides, notes):
        cfg = load_config(path, overrides)
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from megatron_mugrpo.char_tokenizer import char_vocab
from megatron_mugrpo.envs.search import is_placeholder_url
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.plan.models import known_model
from megatron_mugrpo.warmstart import TinyModelConfig, tiny_model_hf_config


def tiny_hf_fields(tiny: TinyModelConfig) -> dict[str, Any]:
    """The ``config.json`` of the tiny model ``warmstart.build_tiny_model`` builds from ``model.tiny``."""
    return tiny_model_hf_config(tiny, vocab_size=len(char_vocab()))


def model_name(cfg: Any) -> str:
    """What a plan calls the run's model: its checkpoint directory's name, or the tiny model's arch."""
    if cfg.model.hf_dir:
        return Path(cfg.model.hf_dir).name
    return f"tiny {cfg.model.tiny.arch} (model.tiny)"


def hf_fields(hf_dir: str, tiny: TinyModelConfig) -> dict[str, Any]:
    """The model's ``config.json`` dict: read from ``hf_dir``, or the tiny model's when it is empty."""
    if not hf_dir:
        return tiny_hf_fields(tiny)
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"{path} is missing: model.hf_dir must be a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def _merged_yaml(path: Path, depth: int = 0) -> dict[str, Any]:
    """The file's YAML with its ``inherit:`` files merged first (only to find placeholder paths; the
    config loader does the real merge and reports errors)."""
    if depth > 16 or not path.is_file():
        return {}
    node = yaml.safe_load(path.read_text()) or {}
    parents = node.pop("inherit", None) or []
    merged: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        merged = _deep_merge(merged, _merged_yaml(path.parent / parent, depth + 1))
    return _deep_merge(merged, node)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _declared(raw: dict[str, Any], overrides: list[str], key: str) -> str:
    """A dotted key's value as the command line, else the YAML, sets it ('' when unset)."""
    for item in reversed(overrides):
        name, _, value = item.partition("=")
        if name == key:
            return value
    node: Any = raw
    for part in key.split("."):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return node if isinstance(node, str) else ""


@contextmanager
def planning_overrides(config: Path | None, overrides: list[str]) -> Iterator[tuple[list[str], list[str]]]:
    """``overrides`` plus stand-ins for placeholder paths, and one note per stand-in (for the plan's output).

    The stand-ins live in a temporary directory for the duration of the block.
    """
    raw = _merged_yaml(config) if config is not None else {}
    extra, notes = [], []
    with tempfile.TemporaryDirectory(prefix="mugrpo-plan-") as tmp:
        hf_dir = _declared(raw, overrides, "model.hf_dir")
        if hf_dir and not Path(hf_dir).is_dir():
            fields = known_model(Path(hf_dir).name)
            stand_in = Path(tmp) / Path(hf_dir).name
            stand_in.mkdir()
            (stand_in / "config.json").write_text(json.dumps(fields))
            extra.append(f"model.hf_dir={stand_in}")
            notes.append(
                f"model.hf_dir={hf_dir} is not on this machine: planned with the published config.json "
                f"of {Path(hf_dir).name}"
            )
        data = Path(tmp) / "train.jsonl"
        data.write_text("")
        train = _declared(raw, overrides, "data.train_path")
        if train and not Path(train).is_file():
            extra.append(f"data.train_path={data}")
        for index, bench in enumerate((raw.get("eval") or {}).get("benchmarks") or []):
            path = _declared(raw, overrides, f"eval.benchmarks.{index}.path") or bench.get("path", "")
            if path != "builtin" and not Path(path).is_file():
                extra.append(f"eval.benchmarks.{index}.path={data}")
        url = _declared(raw, overrides, "env.search.url")
        if url and is_placeholder_url(url):  # nothing is called at planning time: any address will do
            extra.append("env.search.url=http://127.0.0.1:8000")
            notes.append(f"env.search.url={url} is a placeholder: planned as if a retrieval server answered there")
        yield [*overrides, *extra], notes
