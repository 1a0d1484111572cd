"""Every shipped YAML loads, every validation error fires with its message, overrides and round trips work."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatron_mugrpo.config import (
    RunConfig,
    _load_yaml_with_inherit,
    config_from_dict,
    field_name,
    load_config,
    save_config,
    user_key,
)
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.training.parallel import ParallelConfig, check_expert_parallel, check_hf_model_parallelism

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
YAMLS = sorted(CONFIGS.rglob("*.yaml"))
NON_PAPER_YAMLS = [p for p in YAMLS if p.parent.name != "paper"]
"""configs/paper/ files are all loaded (and checked in detail) by test_paper_grid_settings."""


def _dims(heads: int, kv_heads: int, layers: int) -> dict[str, int]:
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers}


PAPER_MODELS = {
    # model file stem: the real Hugging Face config.json fields that decide TP / PP.
    "qwen2.5_math_7b": _dims(28, 4, 28),
    "deepseek_r1_distill_qwen_7b": _dims(28, 4, 28),
    "llama3.2_3b_instruct": _dims(24, 8, 28),
    "qwen3_1.7b_base": _dims(16, 8, 28),
    "qwen3_8b_base": _dims(32, 8, 36),
}
PAPER_METHODS = ("mu_grpo", "grpo", "high_staleness_grpo", "m2po")
MOE_PAPER_MODELS = {
    # model file stem: the real config.json fields that decide TP / PP / EP (released Qwen3-MoE spelling).
    "qwen3_30b_a3b": {
        "model_type": "qwen3_moe",
        **_dims(32, 4, 48),
        "hidden_size": 2048,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
}
MOE_PAPER_METHODS = ("mu_grpo", "grpo")
PAPER_TOTAL_UPDATES = 4096


def _raw(path: Path) -> dict:
    """The file's merged YAML (inherit resolved), before the schema and validation."""
    return OmegaConf.to_container(_load_yaml_with_inherit(path, ()))


def _hf_dir(tmp_path: Path, fields: dict | None = None) -> Path:
    """A directory with a small Hugging Face config.json (the tiny demo shape unless ``fields``)."""
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    values = fields or {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2", **values}))
    return hf


def _path_overrides(path: Path, tmp_path: Path, hf_fields: dict | None = None) -> list[str]:
    """Point the placeholder model.hf_dir / data.train_path of a file at real tmp paths."""
    raw = _raw(path)
    overrides = []
    if raw.get("model", {}).get("hf_dir"):
        overrides.append(f"model.hf_dir={_hf_dir(tmp_path, hf_fields)}")
    if raw.get("data", {}).get("train_path"):
        train = tmp_path / "train.jsonl"
        train.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
        overrides.append(f"data.train_path={train}")
    for index, bench in enumerate(raw.get("eval", {}).get("benchmarks", [])):
        if bench["path"] != "builtin":
            overrides.append(f"eval.benchmarks.{index}.path={train}")
    if raw.get("env", {}).get("search", {}).get("corpus"):  # the search demo's generated corpus
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text(json.dumps({"id": "0", "title": "Paris", "text": "Paris is in France."}) + "\n")
        overrides.append(f"env.search.corpus={corpus}")
    return overrides


def _hf_fields_for(path: Path) -> dict | None:
    stem = path.stem.split("__")[0]
    return PAPER_MODELS.get(stem) or MOE_PAPER_MODELS.get(stem)


@pytest.mark.parametrize("path", NON_PAPER_YAMLS, ids=[str(p.relative_to(CONFIGS)) for p in NON_PAPER_YAMLS])
def test_every_config_loads(path: Path, tmp_path: Path) -> None:
    fields = _hf_fields_for(path)
    cfg = load_config(path, _path_overrides(path, tmp_path, fields))
    assert isinstance(cfg, RunConfig)
    assert cfg.stages.updates_per_stage * cfg.stages.mini_groups == cfg.stages.train_groups
    if cfg.model.hf_dir:
        # The model's real head / layer counts must split under the file's TP / PP.
        check_hf_model_parallelism(cfg.model.hf_dir, cfg.parallel)


def test_only_keyword_sections_are_spelled_apart_from_their_key() -> None:
    """A section named by a Python keyword is the field ``<key>_``; every other field is its own key."""
    names = [f.name for f in dataclasses.fields(RunConfig)]
    assert {name: user_key(name) for name in names if user_key(name) != name} == {"async_": "async"}
    assert [field_name(user_key(name)) for name in names] == names
    assert RunConfig().to_dict().keys() == {user_key(name) for name in names}


def test_errors_name_the_section_as_written_and_leave_file_names_alone(tmp_path: Path) -> None:
    path = tmp_path / "async_run.yaml"
    path.write_text("async:\n  max_lag: soon\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "async.max_lag" in str(caught.value) and "async_run.yaml" in str(caught.value)


def test_grid_covers_every_paper_file() -> None:
    grid = {CONFIGS / "paper" / f"{m}__{method}.yaml" for m in PAPER_MODELS for method in PAPER_METHODS}
    # Table 2's asynchronous runs (tests/asynchronous/test_async_config.py checks them).
    grid |= {CONFIGS / "paper" / f"qwen2.5_math_7b__{method}.yaml" for method in ("async_grpo", "async_mu_grpo")}
    grid |= {CONFIGS / "paper" / f"qwen2.5_coder_7b__{method}.yaml" for method in ("mu_grpo", "grpo")}  # coding
    grid |= {CONFIGS / "paper" / "qwen2.5_7b__search_mu_grpo.yaml"}  # agentic search: tests/envs/
    grid |= {CONFIGS / "paper" / f"{m}__{method}.yaml" for m in MOE_PAPER_MODELS for method in MOE_PAPER_METHODS}
    assert set(YAMLS) - set(NON_PAPER_YAMLS) == grid


@pytest.mark.parametrize(("method", "stages", "mu"), [("mu_grpo", 4, 1024), ("grpo", 1024, 4)])
def test_paper_coding_run_settings(method: str, stages: int, mu: int, tmp_path: Path) -> None:
    """The paper's coding run: Qwen2.5-Coder-7B on code_contests, 8k context, B_mini 16, 4096 updates,
    full-pass code reward in the sandbox, LiveCodeBench pass@4."""
    path = CONFIGS / "paper" / f"qwen2.5_coder_7b__{method}.yaml"
    cfg = load_config(path, _path_overrides(path, tmp_path, _dims(28, 4, 28)))
    check_hf_model_parallelism(cfg.model.hf_dir, cfg.parallel)
    assert (cfg.stages.num_stages, cfg.stages.updates_per_stage, cfg.stages.mini_groups) == (stages, mu, 16)
    assert cfg.stages.total_updates == PAPER_TOTAL_UPDATES
    assert cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens == 8192
    assert (cfg.data.format, cfg.reward.kind, cfg.reward.code.sandbox, cfg.reward.code.partial) == (
        "code_contests",
        "code",
        "bwrap",
        False,
    )
    (bench,) = cfg.eval.benchmarks
    assert (bench.name, bench.format, bench.k, bench.pass_k, cfg.benchmark_reward(bench)) == (
        "livecodebench",
        "livecodebench",
        4,
        4,
        "code",
    )
    assert cfg.algo.loss == ("mu_grpo" if method == "mu_grpo" else "grpo")


def test_placeholder_paths_fail_until_overridden() -> None:
    with pytest.raises(ConfigError, match=r"model\.hf_dir='/path/to/Qwen3-8B-Base' is not a directory"):
        load_config(CONFIGS / "paper" / "qwen3_8b_base__mu_grpo.yaml")


@pytest.mark.parametrize("model", sorted(PAPER_MODELS))
@pytest.mark.parametrize("method", PAPER_METHODS)
def test_paper_grid_settings(model: str, method: str, tmp_path: Path) -> None:
    path = CONFIGS / "paper" / f"{model}__{method}.yaml"
    cfg = load_config(path, _path_overrides(path, tmp_path, PAPER_MODELS[model]))
    check_hf_model_parallelism(cfg.model.hf_dir, cfg.parallel)  # the real model's heads / layers split
    assert cfg.stages.total_updates == PAPER_TOTAL_UPDATES
    assert (cfg.stages.mini_groups, cfg.rollout.group_size, cfg.rollout.temperature) == (32, 8, 1.0)
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (1e-6, 0.01)
    assert (cfg.rollout.engine, cfg.model.dtype) == ("sglang", "bfloat16")
    context = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    assert context == (4096 if model == "qwen2.5_math_7b" else 8192)
    expected = {
        "mu_grpo": (
            "mu_grpo",
            1024,
            {"clip_low": 0.0, "clip_high": 5.0, "veto_scope": "seq", "veto_threshold": 1e-4},
        ),
        "grpo": ("grpo", 4, {"clip_eps": 0.2, "dual_clip_c": 0.0}),
        "high_staleness_grpo": ("grpo", 1024, {"clip_eps": 0.2, "dual_clip_c": 0.0}),
        "m2po": ("m2po", 1024, {"m2_threshold": 0.04}),
    }[method]
    assert cfg.algo.loss == expected[0]
    assert cfg.stages.updates_per_stage == expected[1]
    aggregation = "token_mean" if method == "m2po" else "seq_mean_token_mean"  # as the released M2PO code
    assert cfg.algo.loss_options() == {"aggregation": aggregation, **expected[2]}
    assert cfg.eval.every_updates == 200  # the paper's evaluation interval


@pytest.mark.parametrize("model", sorted(MOE_PAPER_MODELS))
@pytest.mark.parametrize("method", MOE_PAPER_METHODS)
def test_moe_paper_settings(model: str, method: str, tmp_path: Path) -> None:
    """The MoE paper runs: the paper's shared settings and method, expert parallelism over one node's
    8 GPUs dividing the real expert count, and rollout engines that split the model over 2 GPUs."""
    path = CONFIGS / "paper" / f"{model}__{method}.yaml"
    fields = MOE_PAPER_MODELS[model]
    cfg = load_config(path, _path_overrides(path, tmp_path, fields))
    check_hf_model_parallelism(cfg.model.hf_dir, cfg.parallel)  # heads, layers and experts split
    assert cfg.parallel.expert_parallel == 8 and fields["num_experts"] % cfg.parallel.expert_parallel == 0
    assert cfg.parallel.expert_parallel * cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel == 8
    assert (cfg.rollout.engine, cfg.rollout.tensor_parallel, cfg.model.dtype) == ("sglang", 2, "bfloat16")
    assert cfg.stages.total_updates == PAPER_TOTAL_UPDATES
    assert (cfg.stages.mini_groups, cfg.rollout.group_size, cfg.optim.lr) == (32, 8, 1e-6)
    assert cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens == 8192
    assert cfg.algo.loss == method and cfg.stages.updates_per_stage == {"mu_grpo": 1024, "grpo": 4}[method]
    assert cfg.moe.routing_replay == "rollout"  # the engines record routes, every update replays them
    # The file's alternative for long contexts: TP 2 with whole experts still fills the node's 8 ranks.
    wide = dataclasses.replace(cfg.parallel, tensor_parallel=2, sequence_parallel=True, expert_tensor_parallel=1)
    check_hf_model_parallelism(cfg.model.hf_dir, wide)
    check_expert_parallel(8, wide.tensor_parallel, 1, wide.expert_parallel, wide.expert_tensor_parallel)
    with pytest.raises(ConfigError, match=r"expert_parallel=8 × tensor_parallel=2 must divide the 8 ranks"):
        check_expert_parallel(8, 2, 1, 8, None)  # expert TP following TP would need 16 ranks
    # A model whose expert count EP does not divide is refused, naming the key.
    (Path(cfg.model.hf_dir) / "config.json").write_text(json.dumps({**fields, "num_experts": 60}))
    with pytest.raises(ConfigError, match=r"parallel\.expert_parallel=8 does not divide the 60 experts"):
        check_hf_model_parallelism(cfg.model.hf_dir, cfg.parallel)


def test_demo_grpo_matches_demo_updates() -> None:
    mu = load_config(CONFIGS / "demo_cpu.yaml")
    grpo = load_config(CONFIGS / "demo_grpo_cpu.yaml")
    assert grpo.stages.updates_per_stage == 4
    assert grpo.stages.train_groups == 4 * grpo.stages.mini_groups
    assert grpo.stages.mini_groups == mu.stages.mini_groups
    assert grpo.stages.total_updates == mu.stages.total_updates
    assert grpo.algo.loss_options() == {"aggregation": mu.algo.aggregation, "clip_eps": 0.2, "dual_clip_c": 0.0}
    # Everything except the schedule and the loss is the demo's.
    same = ("model", "rollout", "data", "optim", "parallel", "warmstart")
    assert {k: grpo.to_dict()[k] for k in same} == {k: mu.to_dict()[k] for k in same}


def test_mu_is_derived_and_overrides_apply() -> None:
    cfg = load_config(None, ["stages.train_groups=96", "stages.mini_groups=8", "algo.mu_grpo.clip_high=3.5"])
    assert cfg.stages.updates_per_stage == 12
    assert cfg.stages.total_updates == 4 * 12
    assert cfg.algo.mu_grpo.clip_high == 3.5
    assert cfg.algo.loss_options()["clip_high"] == 3.5


def test_loss_options_come_from_the_chosen_loss_section() -> None:
    cfg = load_config(None, ["algo.loss=grpo", "algo.grpo.clip_eps=0.1", "algo.mu_grpo.clip_high=2"])
    assert cfg.algo.loss_options() == {"aggregation": "seq_mean_token_mean", "clip_eps": 0.1, "dual_clip_c": 0.0}
    cfg = load_config(None, ["algo.loss=m2po_clip", "algo.m2po_clip.m2_threshold=0.5", "algo.aggregation=token_mean"])
    assert cfg.algo.loss_options() == {"aggregation": "token_mean", "m2_threshold": 0.5}


def test_algo_has_one_section_per_registered_loss() -> None:
    """Each loss owns its options section: the registry and AlgoConfig's sections agree in name and type."""
    from megatron_mugrpo.algorithms.config import AlgoConfig
    from megatron_mugrpo.algorithms.losses import available_losses, loss_spec

    algo = AlgoConfig()
    for name in available_losses():
        assert type(getattr(algo, name)) is loss_spec(name).options, name


@pytest.mark.parametrize(
    ("old", "new"),
    [("algo.clip_high=5", "algo.mu_grpo.clip_high"), ("rollout.batch_size=8", "rollout.transformers.batch_size")],
)
def test_moved_keys_name_their_new_place(old: str, new: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"is now {new}"):
        load_config(None, [old])
    section, rest = old.split(".", 1)
    key, value = rest.split("=")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"old\.yaml.*is now {new}"):
        load_config(tmp_path / "old.yaml")


def test_override_on_top_of_file_and_inherit_order(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("algo: {mu_grpo: {clip_high: 2.0, veto_scope: suffix}}\nstages: {seed: 3}\n")
    (tmp_path / "child.yaml").write_text("inherit: base.yaml\nalgo: {mu_grpo: {clip_high: 4.0}}\n")
    cfg = load_config(tmp_path / "child.yaml", ["stages.seed=7"])
    assert (cfg.algo.mu_grpo.clip_high, cfg.algo.mu_grpo.veto_scope, cfg.stages.seed) == (4.0, "suffix", 7)


def test_round_trip_through_dict_and_yaml(tmp_path: Path) -> None:
    path = CONFIGS / "paper" / "qwen3_8b_base__mu_grpo.yaml"
    cfg = load_config(path, _path_overrides(path, tmp_path, PAPER_MODELS["qwen3_8b_base"]))
    assert config_from_dict(cfg.to_dict()) == cfg
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stages.train_groups=100", "stages.mini_groups=32"], r"B_train=100\) must be a positive multiple"),
        (
            ["algo.mu_grpo.clip_low=2.0", "algo.mu_grpo.clip_high=1.0"],
            r"algo\.mu_grpo\.clip_low=2\.0 > algo\.mu_grpo\.clip_high=1\.0",
        ),
        (["algo.mu_grpo.veto_threshold=1.5"], r"veto_threshold \(τ_c\)=1\.5 must be in \(0, 1\)"),
        (["algo.mu_grpo.veto_threshold=0"], r"veto_threshold \(τ_c\)=0\.0 must be in \(0, 1\)"),
        (["algo.mu_grpo.veto_threshold=1e-10"], r"veto_threshold=1e-10 is below exp\(-20"),
        (["algo.grpo.clip_eps=1.5"], r"algo\.grpo\.clip_eps=1\.5 must be in \(0, 1\)"),
        (["algo.m2po.m2_threshold=0"], r"m2_threshold \(τ_M2\)=0\.0 must be > 0"),
        (["algo.loss=ppo"], r"algo\.loss='ppo' is unknown"),
        (["algo.mu_grpo.veto_scope=prefix"], r"algo\.mu_grpo\.veto_scope='prefix' is unknown"),
        (["rollout.engine=tgi"], r"rollout\.engine='tgi' is not one of"),
        (["rollout.transformers.batch_size=0"], r"rollout\.transformers\.batch_size=0 must be >= 1"),
        (["rollout.sglang.mem_fraction_static=1.5"], r"mem_fraction_static=1\.5 must be in \(0, 1\)"),
        (["kernels.logprob_impl=magic"], r"kernels\.logprob_impl='magic' is not one of"),
        (["parallel.sequence_parallel=true"], r"sequence_parallel=true needs parallel\.tensor_parallel > 1"),
        (["parallel.tensor_parallel=3"], r"tensor_parallel=3 does not divide the 4 attention heads"),
        (["parallel.tensor_parallel=4"], r"tensor_parallel=4 does not divide the 2 key/value heads"),
        (["parallel.pipeline_parallel=3"], r"pipeline_parallel=3 does not divide the 2 layers"),
        (["rollout.top_p=0.9"], r"rollout\.top_p must be 1\.0 and rollout\.top_k 0"),
        (["rollout.top_k=50"], r"rollout\.top_p must be 1\.0 and rollout\.top_k 0"),
        (["algo.not_a_key=1"], r"algo\.not_a_key"),
        (["stages.num_stages=four"], r"stages\.num_stages"),
        (["model.hf_dir=/nonexistent/model"], r"model\.hf_dir='/nonexistent/model' is not a directory"),
        (["data.train_path=/no/t.jsonl"], r"data\.train_path='/no/t\.jsonl' does not exist"),
        (["stages.num_stages"], r"must look like section\.key=value"),
    ],
)
def test_validation_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_expert_tensor_parallel_is_checked_against_the_model(tmp_path: Path) -> None:
    """parallel.expert_tensor_parallel splits each expert: it must divide moe_intermediate_size, needs a
    MoE model, and is >= 1 or null (null: tensor_parallel, megatron-core's default)."""
    moe = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    (tmp_path / "moe").mkdir()
    (tmp_path / "dense").mkdir()
    hf = _hf_dir(tmp_path / "moe", {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, **moe})
    check_hf_model_parallelism(hf, ParallelConfig(expert_parallel=4, expert_tensor_parallel=2))
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel=5 does not divide moe_intermediate_size=48"):
        check_hf_model_parallelism(hf, ParallelConfig(expert_tensor_parallel=5))
    dense = _hf_dir(tmp_path / "dense", {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel=2 needs a mixture-of-experts model"):
        check_hf_model_parallelism(dense, ParallelConfig(expert_tensor_parallel=2))
    with pytest.raises(ConfigError, match=r"parallel\.expert_tensor_parallel must be >= 1 or null"):
        load_config(None, ["parallel.expert_tensor_parallel=0"])
    assert load_config(None, ["parallel.expert_tensor_parallel=1"]).parallel.expert_tensor_parallel == 1
    assert load_config(None, []).parallel.expert_tensor_parallel is None
    with pytest.raises(ConfigError, match=r"expert_parallel=2 × expert_tensor_parallel=2 must divide the 2 ranks"):
        check_expert_parallel(2, 1, 1, 2, 2)


def test_tp_not_dividing_hf_heads(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path, {"num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28})
    check_hf_model_parallelism(hf, ParallelConfig(tensor_parallel=4))
    with pytest.raises(ConfigError, match="tensor_parallel=8 does not divide the 28 attention heads"):
        check_hf_model_parallelism(hf, ParallelConfig(tensor_parallel=8))
    with pytest.raises(ConfigError, match=r"config\.json is missing"):
        check_hf_model_parallelism(tmp_path, ParallelConfig())


def test_unknown_key_and_wrong_type_in_file(tmp_path: Path) -> None:
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"bad_key\.yaml.*rollout\.temprature"):
        load_config(bad_key)
    bad_type = tmp_path / "bad_type.yaml"
    bad_type.write_text("optim:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"bad_type\.yaml.*optim\.lr"):
        load_config(bad_type)


def test_missing_file_and_inherit_cycle(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")
    (tmp_path / "missing_parent.yaml").write_text("inherit: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere\.yaml' does not exist"):
        load_config(tmp_path / "missing_parent.yaml")
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\n")
    (tmp_path / "b.yaml").write_text("inherit: [a.yaml]\n")
    with pytest.raises(ConfigError, match="inherits itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "self.yaml").write_text("inherit: self.yaml\n")
    with pytest.raises(ConfigError, match="inherits itself"):
        load_config(tmp_path / "self.yaml")
