"""Quantized rollouts: the engine samples each stage from an FP8 copy of the trainer's policy.

With ``rollout.quantization=fp8`` the weights the trainer exports at the start of a stage are
quantized with NVIDIA Model Optimizer (ModelOpt) before the rollout engine samples from them. The
quantized model *is* the stage's behaviour policy β: the engine stores its log-probs, so the
losses' ratio ρ = π_θ / β stays an exact importance ratio (see ``algorithms.rollout_correction``
for measuring and correcting the gap to the trainer's own policy).

Per stage (``load_behaviour_policy``, called by the weight sync):

1. the full-precision Hugging Face-named tensors from the trainer arrive;
2. a fresh model receives them and ModelOpt inserts fake quantizers (``mtq.quantize``); schemes
   with static activation scales are calibrated on the first ``rollout.modelopt.calibration_prompts``
   prompts of the stage's own prompt set;
3. the engine serves it:

   * transformers engine (CPU and GPU): the fake-quant model itself, with the weight quantizers
     folded into the weights (``mtq.fold_weight``: quantize-dequantize once; activation quantizers
     stay active). The stored log-probs are this model's (a teacher-forced recompute agrees to
     ~1e-6, except on rare tokens where float32 rounding differences between batched decoding and
     the recompute push an activation across an FP8 rounding boundary). This path runs in CI;
   * SGLang (GPU): the model (cast to bfloat16 *before* quantizing: ``dtype=`` at load time does
     not convert norms and embeddings) is exported as a ModelOpt FP8 checkpoint (F8_E4M3 weights,
     ``weight_scale`` / ``input_scale``, ``hf_quant_config.json``; embeddings and ``lm_head`` stay
     unquantized), written to a temporary directory and renamed, and a new SGLang engine loads it
     as ModelOpt FP8 (SGLang cannot reload an FP8 model in place, so each stage shuts the last
     engine down and builds one). Tokenizer files are copied (the export writes none). The
     ``fp8_per_channel`` scheme is refused with SGLang: its checkpoint's ``quant_algo`` is one
     SGLang does not load.

Do not load an exported checkpoint with plain ``transformers``: transformers 5.x ignores
``quant_method: modelopt`` and loads the raw FP8 values without their scales, a garbage model.
Load it through an engine, or with ``dequantized_state_dict`` (w · weight_scale).

ModelOpt is an optional extra (``pip install 'megatron_mugrpo[fp8]'``), imported only when a
scheme is used. Schemes are a small registry (``register_scheme``): ``fp8`` (ModelOpt's
FP8_DEFAULT_CFG), ``fp8_per_channel`` (FP8_PER_CHANNEL_PER_TOKEN_CFG), and ``nvfp4``, which needs
a CUDA GPU (ModelOpt's FP4 kernels have no CPU path).

    scheme = quantization_scheme("fp8")
    quantize_model(model, scheme, calibration=[prompt_ids, ...])
    fold_weights(model)                       # the transformers engine's behaviour policy
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megatron_mugrpo import durable
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.rollout.engine import shutdown_engine

if TYPE_CHECKING:
    import torch

    from megatron_mugrpo.rollout.engine import RolloutEngine
    from megatron_mugrpo.rollout.prompts import PromptRecord

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'megatron_mugrpo[fp8]' (NVIDIA Model Optimizer, nvidia-modelopt)"
NONE = "none"


class QuantizationError(InputError, RuntimeError):
    """A quantization scheme cannot be used as configured; the message says what to change."""


class ModelOptMissingError(QuantizationError, ImportError):
    """NVIDIA Model Optimizer is not installed."""


# --------------------------------------------------------------------------------------- schemes


@dataclass(frozen=True, kw_only=True)
class QuantScheme:
    """One value of ``rollout.quantization``: a ModelOpt quantization config and what it needs."""

    name: str
    modelopt_config: str
    """Attribute of ``modelopt.torch.quantization`` holding the config dict (e.g. FP8_DEFAULT_CFG)."""
    description: str
    needs_cuda: bool = False
    """ModelOpt has no CPU kernels for this format."""
    sglang_loads: bool = True
    """SGLang maps this scheme's exported checkpoint (its ``quant_algo``) to one of its quantization methods."""


_SCHEMES: dict[str, QuantScheme] = {}


def register_scheme(scheme: QuantScheme) -> None:
    """Add a value of ``rollout.quantization``."""
    if scheme.name in _SCHEMES or scheme.name == NONE:
        raise ValueError(f"quantization scheme {scheme.name!r} is already registered")
    _SCHEMES[scheme.name] = scheme


register_scheme(
    QuantScheme(
        name="fp8",
        modelopt_config="FP8_DEFAULT_CFG",
        description="E4M3 weights and activations, one scale per tensor; activation scales calibrated on prompts",
    )
)
register_scheme(
    QuantScheme(
        name="fp8_per_channel",
        modelopt_config="FP8_PER_CHANNEL_PER_TOKEN_CFG",
        description="E4M3 weights with one scale per output channel; activations scaled per token at run time",
        # Exported as quant_algo FP8_PER_CHANNEL_PER_TOKEN, which SGLang's ModelOpt loader refuses at start
        # (from 0.5.20 it accepts exactly "FP8"; read in srt/layers/quantization/modelopt_quant.py).
        sglang_loads=False,
    )
)
register_scheme(
    QuantScheme(
        name="nvfp4",
        modelopt_config="NVFP4_DEFAULT_CFG",
        description="E2M1 weights and activations in blocks of 16 with E4M3 block scales (Blackwell GPUs)",
        needs_cuda=True,
    )
)


def available_schemes() -> tuple[str, ...]:
    """Values accepted by ``rollout.quantization``."""
    return (NONE, *_SCHEMES)


def quantization_scheme(name: str) -> QuantScheme | None:
    """The registered scheme ``name``; None for 'none'."""
    if name == NONE:
        return None
    if name not in _SCHEMES:
        raise QuantizationError(f"rollout.quantization={name!r} is unknown; choose one of {available_schemes()}")
    return _SCHEMES[name]


@dataclass(kw_only=True)
class ModelOptConfig:
    """``rollout.modelopt.*``: how the behaviour policy is quantized when rollout.quantization != none."""

    calibration_prompts: int = 256
    """Prompts of the stage's own prompt set run through the model to calibrate static activation
    scales (the ``fp8`` scheme); weight scales come from the weights themselves."""
    calibration_batch_size: int = 32
    """Prompts per calibration forward pass (prompts of equal length only: no padding enters a scale)."""

    def __post_init__(self) -> None:
        for name in ("calibration_prompts", "calibration_batch_size"):
            if getattr(self, name) < 1:
                raise QuantizationError(f"rollout.modelopt.{name}={getattr(self, name)} must be >= 1")


# ------------------------------------------------------------------------------------ ModelOpt


def import_modelopt() -> Any:
    """``modelopt.torch.quantization`` (imported on first use), or ModelOptMissingError with the hint."""
    try:
        with warnings.catch_warnings():
            # ModelOpt warns at import about transformers versions it has not been tested with;
            # the paths used here are covered by this project's tests.
            warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
            import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise ModelOptMissingError(
            f"rollout.quantization needs NVIDIA Model Optimizer: {INSTALL_HINT} ({exc})"
        ) from exc
    return mtq


def scheme_engine_problem(name: str, engine: str) -> str:
    """Why ``rollout.engine`` cannot serve the ``rollout.quantization`` value ``name`` ('' when it can);
    a config check, importing nothing."""
    scheme = quantization_scheme(name)
    if scheme is None or engine != "sglang" or scheme.sglang_loads:
        return ""
    accepted = [s.name for s in _SCHEMES.values() if s.sglang_loads]
    return (
        f"rollout.quantization={name!r} cannot be served by rollout.engine=sglang: SGLang refuses the "
        f"checkpoint this scheme exports at start. Use one of {accepted} with SGLang, or the transformers engine"
    )


def check_scheme_usable(scheme: QuantScheme) -> None:
    """Raise QuantizationError when this machine cannot run ``scheme`` (no ModelOpt, or no GPU)."""
    import torch

    if scheme.needs_cuda and not torch.cuda.is_available():
        raise QuantizationError(
            f"rollout.quantization={scheme.name!r} needs a CUDA GPU (ModelOpt has no CPU kernels for it); "
            f"on CPU use one of {[s for s in available_schemes() if s == NONE or not _SCHEMES[s].needs_cuda]}"
        )
    import_modelopt()


def calibration_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[list[int]]]:
    """Group prompts into batches of equal length (in first-seen order), at most ``batch_size`` each.

    Equal lengths need no padding: a padded position (whose attention row may be fully masked)
    would feed activations into the calibrated amax that the engine never sees.
    """
    by_length: dict[int, list[list[int]]] = {}
    for prompt in prompts:
        by_length.setdefault(len(prompt), []).append(list(prompt))
    return [rows[i : i + batch_size] for rows in by_length.values() for i in range(0, len(rows), batch_size)]


def quantize_model(
    model: torch.nn.Module,
    scheme: QuantScheme,
    calibration: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
) -> torch.nn.Module:
    """Insert ``scheme``'s fake quantizers into ``model`` (in place) and calibrate them.

    Args:
        model: a Hugging Face causal LM, on the device it will run on.
        calibration: prompt token ids; every scheme gets them (max calibration reads weights
            anyway, static activation scales need the prompts).
    """
    import torch

    check_scheme_usable(scheme)
    mtq = import_modelopt()
    if not calibration:
        raise QuantizationError("quantization needs at least one calibration prompt (rollout.modelopt)")
    device = next(model.parameters()).device
    batches = calibration_batches(calibration, batch_size)

    def forward_loop(quantized: torch.nn.Module) -> None:
        with torch.no_grad():
            for rows in batches:
                quantized(input_ids=torch.tensor(rows, dtype=torch.long, device=device), use_cache=False)

    model.eval()
    with _quiet():
        mtq.quantize(model, getattr(mtq, scheme.modelopt_config), forward_loop)
    return model


def fold_weights(model: torch.nn.Module) -> None:
    """Replace each quantized weight by its quantize-dequantize value once and disable its quantizer,
    so that decoding does not re-quantize the weights at every step (same outputs, original speed)."""
    mtq = import_modelopt()
    with _quiet():
        mtq.fold_weight(model)


@contextlib.contextmanager
def _quiet() -> Iterable[None]:
    """ModelOpt prints progress ("Inserted 56 quantizers") to stdout; send it to the debug log instead."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    if buffer.getvalue().strip():
        logger.debug("modelopt: %s", buffer.getvalue().strip())


# ------------------------------------------------------------------------------ checkpoint files


def export_checkpoint(model: torch.nn.Module, target: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """Write ``model`` (quantized, not folded) as a ModelOpt Hugging Face checkpoint at ``target``.

    The directory is written under a temporary name and renamed into place, replacing an older one,
    so an engine never reads a half-written checkpoint. The export consumes the model (ModelOpt
    replaces its weights by the FP8 values): export a copy you no longer need.

    The FP8 codes equal the fake quant's for a float32 model. For a bf16 model they may land one
    E4M3 step away from the (float32) fake quant where the division by the scale runs in bf16 (a
    bf16 division would move 3.4% of a small Qwen2's codes); ModelOpt 0.47 on CPU divides in float32
    (its float32 scale promotes the weight) and moves none. Either way the checkpoint, not the
    fake-quant model, is what SGLang serves, and its own log-probs are the ones stored.
    """
    import_modelopt()
    from modelopt.torch.export import export_hf_checkpoint

    target = Path(target)
    if not getattr(model.config, "architectures", None):  # built from a config: the export and SGLang need it
        model.config.architectures = [type(model).__name__]
    with durable.atomic_dir(target, replace_existing=True) as scratch:
        with _quiet():
            export_hf_checkpoint(model, export_dir=str(scratch))
        if tokenizer_dir is not None:
            # ModelOpt's export writes no tokenizer: copy what the converter also copies beside weights
            from megatron_mugrpo.conversion.hf_io import TOKENIZER_FILES

            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, scratch / name)
    return target


def dequantized_state_dict(export_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read an exported ModelOpt FP8 checkpoint back as float32 tensors: w_fp8 · weight_scale.

    ``weight_scale`` is a scalar (per tensor) or one value per output row (per channel); scales and
    ``input_scale`` tensors are dropped from the result. Other tensors are returned as float32.
    """
    from safetensors.torch import load_file

    files = sorted(Path(export_dir).glob("*.safetensors"))
    if not files:
        raise QuantizationError(f"{export_dir} holds no .safetensors files: is it an exported checkpoint?")
    raw: dict[str, torch.Tensor] = {}
    for path in files:
        raw.update(load_file(str(path)))
    out = {}
    for name, tensor in raw.items():
        if name.endswith(("_scale", "_scale_2")):
            continue
        value = tensor.float()
        scale = raw.get(name.removesuffix("weight") + "weight_scale") if name.endswith("weight") else None
        if scale is not None:
            scale = scale.float()
            value = value * (scale.view(-1, *([1] * (value.dim() - 1))) if scale.numel() > 1 else scale)
        out[name] = value
    return out


# --------------------------------------------------------------------------- the stage's policy

EngineBuilder = Callable[[str], "RolloutEngine"]
"""Builds the configured engine on a Hugging Face directory."""


@dataclass(kw_only=True)
class BehaviourQuantizer:
    """What the weight sync needs to turn the trainer's tensors into the stage's quantized β."""

    scheme: QuantScheme
    calibration: list[list[int]]
    """Prompt token ids of the stage (the first ``rollout.modelopt.calibration_prompts``)."""
    batch_size: int
    export_dir: Path
    """Where the SGLang path writes the stage's checkpoint (replaced every stage)."""


class QuantizationSettings(Protocol):
    """What the stage's quantizer reads of the ``rollout`` section (``rollout.config.RolloutConfig``)."""

    quantization: str
    """A value of ``available_schemes()``."""
    modelopt: ModelOptConfig


def behaviour_quantizer(
    rollout: QuantizationSettings, prompts: Sequence[PromptRecord], export_dir: Path
) -> BehaviourQuantizer | None:
    """The stage's quantizer from the rollout config (None with rollout.quantization=none), calibrated
    on the first ``rollout.modelopt.calibration_prompts`` of the stage's ``prompts``."""
    scheme = quantization_scheme(rollout.quantization)
    if scheme is None:
        return None
    options = rollout.modelopt
    calibration = [list(p.prompt_ids) for p in prompts[: options.calibration_prompts]]
    return BehaviourQuantizer(
        scheme=scheme, calibration=calibration, batch_size=options.calibration_batch_size, export_dir=export_dir
    )


def load_behaviour_policy(
    engine: RolloutEngine | None,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    engine_name: str,
    hf_dir: str | Path,
    build: EngineBuilder,
    quantizer: BehaviourQuantizer | None,
) -> RolloutEngine:
    """Give ``engine`` (built on first use) the stage's behaviour policy; returns the engine.

    Without a quantizer the trainer's tensors are loaded as they are. With one, they become the
    quantized policy of ``quantizer.scheme``: in memory for the transformers engine, through an
    exported checkpoint for engines that load checkpoints (``engine_name``, e.g. 'sglang').
    """
    if quantizer is None or engine_name == "transformers":
        engine = engine if engine is not None else build(str(hf_dir))
        if quantizer is None:
            engine.load_weights(named_tensors)
        else:
            _load_fake_quant(engine, named_tensors, quantizer)
        return engine
    return _load_exported(engine, named_tensors, quantizer, hf_dir=hf_dir, build=build)


def _load_fake_quant(
    engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], quantizer: BehaviourQuantizer
) -> None:
    """Transformers engine: the fake-quant model with folded weights, built fresh for the stage."""
    check_scheme_usable(quantizer.scheme)
    engine.release()  # a fresh, unquantized model: the last stage's quantizers must not carry over
    engine.load_weights(named_tensors)
    quantize_model(engine.model, quantizer.scheme, quantizer.calibration, batch_size=quantizer.batch_size)
    fold_weights(engine.model)


def _load_exported(
    engine: RolloutEngine | None,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    quantizer: BehaviourQuantizer,
    *,
    hf_dir: str | Path,
    build: EngineBuilder,
) -> RolloutEngine:
    """Engines that load checkpoints (SGLang): a new engine on each stage's exported checkpoint.

    SGLang builds its FP8 layers from the checkpoint's ``hf_quant_config.json`` when it starts and
    cannot reload them in place (see ``rollout.sglang_engine``), so the last stage's engine is shut
    down first (which also hands its GPU memory back before the quantized copy is made) and a new
    one is built on the new checkpoint. SGLang's shutdown kills the caller's child processes; the
    reward pool replaces its workers at its next use.
    """
    if engine is not None:
        shutdown_engine(engine)
    path = export_behaviour_checkpoint(named_tensors, quantizer, hf_dir=hf_dir)
    return build(str(path))


def export_behaviour_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]], quantizer: BehaviourQuantizer, *, hf_dir: str | Path
) -> Path:
    """Quantize a bf16 copy of the trainer's tensors on the GPU and export it to ``quantizer.export_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_mugrpo.rollout.transformers_engine import copy_weights

    check_scheme_usable(quantizer.scheme)
    if not torch.cuda.is_available():
        raise QuantizationError(
            "exporting a quantized checkpoint for SGLang needs a CUDA GPU; on CPU use the transformers engine"
        )
    with torch.device("cuda"):  # built on the GPU: no full-size float32 copy in host memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(hf_dir)), dtype=torch.bfloat16)
    model = model.to(torch.bfloat16)  # cast *before* quantizing: dtype= leaves some modules in float32
    copy_weights(model, named_tensors)
    quantize_model(model, quantizer.scheme, quantizer.calibration, batch_size=quantizer.batch_size)
    path = export_checkpoint(model, quantizer.export_dir, tokenizer_dir=hf_dir)
    del model
    torch.cuda.empty_cache()
    return path
