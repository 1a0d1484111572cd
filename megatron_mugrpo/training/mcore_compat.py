"""Every private name of megatron-core and torch that the checkpoint I/O uses, in one place, checked.

The checkpoint writer and reader (``checkpoint_writer``, ``checkpoint_reader``) are subclasses of
megatron-core's public ``torch_dist`` strategies and of torch's public ``FileSystemReader``; they
assign nothing into either library. A few private helpers are still needed, because megatron-core
keeps the translation between its sharded state dicts and ``torch.distributed.checkpoint`` in
module-private functions that its strategies call directly. They are reached only through this
module:

=========================================================  ==============================================
private name                                               why
=========================================================  ==============================================
``strategies.torch._replace_state_dict_keys_with_sharded_keys``  flatten a sharded state dict by key (save, load)
``strategies.torch._replace_sharded_keys_with_state_dict_keys``  undo it on the loaded state dict (load)
``strategies.torch._unwrap_pyt_sharded_tensor``             torch ShardedTensor → megatron tensor (load)
``strategies.torch._restore_dict_types``                    lists / dicts as the caller's template (load)
``torch.distributed.checkpoint.filesystem._StorageInfo``    where an item lies in a file (the writer's
                                                            results; what ``FileSystemReader`` reads)
=========================================================  ==============================================

One patch, and only on torch < 2.13 (``ZIP_CRC_PROCESS_WIDE``): ``torch.utils.serialization.config
.save.compute_crc32`` is set to False while writer threads run, and restored by the last writer out.
torch.save computes a CRC-32 per record that torch.load never checks (the manifest's checksum
covers the bytes). From torch 2.13 on the switch is per thread and only the writer threads change
it (``thread_without_zip_crc``); the process is left alone.

One more patch, for mixture-of-experts models without Transformer Engine (``define_moe_te_names``):
megatron-core 0.16 binds ``te_general_gemm`` and eight ``fused_*`` kernels in ``moe_utils`` only
inside ``try: import transformer_engine``, then tests them with ``is not None``; without TE the names
are undefined and the router's first forward raises ``NameError`` (CPU and GPU alike). They are
defined as None, the value megatron-core itself checks for; nothing is touched when TE is there.

One correction, not a patch (``sequence_parallel_router_loss_coefficients``): with per-token loss,
megatron-core 0.16 weighs the router losses' gradients 1/TP under sequence parallelism, so the
model's config gets both router-loss coefficients multiplied by TP there (megatron-core 0.16 only).

Version gates: each hook names the megatron-core versions it was read from
(``TESTED_MCORE``, the range ``setup.py`` allows) and the parameters it must take. ``check()``
resolves every hook against the installed libraries and raises ``CompatError`` naming the missing
or changed one; the strategies call it before their first save / load, so a megatron-core that
moved a helper fails loudly instead of falling back to a slower path. A megatron-core outside the
tested range is accepted when every hook resolves, with one logged warning.

    from megatron_mugrpo.training import mcore_compat
    mcore_compat.check()   # {"_replace_state_dict_keys_with_sharded_keys": <function ...>, ...}
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

TESTED_MCORE = ((0, 16), (0, 20))
"""megatron-core versions [from, to) whose sources the hooks below were read from (setup.py's range)."""
ZIP_CRC_PROCESS_WIDE = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
"""torch < 2.13 keeps torch.save's CRC switch process-wide; from 2.13 on it lives in a ContextVar
(per thread)."""

_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


class CompatError(RuntimeError):
    """The installed megatron-core / torch lacks a hook the checkpoint I/O needs; the message names it."""


@dataclass(frozen=True)
class Hook:
    """One private name: where it lives, the parameters it must take, and why it is used."""

    module: str
    name: str
    params: tuple[str, ...]
    """Leading parameter names of the function (or dataclass fields), checked with ``inspect``."""
    why: str


HOOKS = (
    Hook(
        _MCORE_TORCH,
        "_replace_state_dict_keys_with_sharded_keys",
        ("sharded_state_dict", "keep_only_main_replica"),
        "flatten a sharded state dict by key before planning",
    ),
    Hook(
        _MCORE_TORCH,
        "_replace_sharded_keys_with_state_dict_keys",
        ("state_dict", "flat_mapping", "rename_mapping"),
        "put the loaded tensors back under the caller's keys",
    ),
    Hook(_MCORE_TORCH, "_unwrap_pyt_sharded_tensor", ("sh_ten",), "torch ShardedTensor to megatron tensor"),
    Hook(_MCORE_TORCH, "_restore_dict_types", ("x", "keys_template"), "lists and dicts as in the template"),
    Hook(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        ("relative_path", "offset", "length"),
        "file, offset and length of a written item, as FileSystemReader reads them",
    ),
)


def mcore_version() -> tuple[int, int]:
    import megatron.core

    parts = str(getattr(megatron.core, "__version__", "0.0")).split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _parameters(value: Any) -> list[str]:
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is not None:
        return list(fields)
    return list(inspect.signature(value).parameters)


def _resolve(hook: Hook) -> Any:
    version = ".".join(map(str, mcore_version()))
    fix = (
        f"megatron_mugrpo's checkpoint I/O supports megatron-core {TESTED_MCORE[0][0]}.{TESTED_MCORE[0][1]}"
        f"-{TESTED_MCORE[1][0]}.{TESTED_MCORE[1][1] - 1} (installed: {version}); install a version in that "
        "range or update megatron_mugrpo/training/mcore_compat.py"
    )
    try:
        value = getattr(importlib.import_module(hook.module), hook.name)
    except (ImportError, AttributeError) as exc:
        raise CompatError(f"{hook.module}.{hook.name} is missing ({exc}); {fix}") from exc
    got = _parameters(value)
    if tuple(got[: len(hook.params)]) != hook.params:
        raise CompatError(
            f"{hook.module}.{hook.name} takes ({', '.join(got)}), expected ({', '.join(hook.params)}, ...); {fix}"
        )
    return value


@functools.lru_cache(maxsize=1)
def check() -> dict[str, Any]:
    """Resolve every hook (once); CompatError naming the first missing or changed one."""
    resolved = {hook.name: _resolve(hook) for hook in HOOKS}
    low, high = TESTED_MCORE
    if not low <= mcore_version() < high:
        logger.warning(
            "megatron-core %s is outside the tested range [%s, %s) of the checkpoint I/O; every hook resolved",
            mcore_version(),
            low,
            high,
        )
    return resolved


def _hook(name: str) -> Callable[..., Any]:
    return check()[name]


# ----------------------------------------------------------------------- megatron-core helpers


def replace_state_dict_keys_with_sharded_keys(sharded_state_dict: Any, keep_only_main_replica: bool) -> tuple:
    """(flat {key: [sharded items]}, flat mapping, rename mapping) of a sharded state dict."""
    return _hook("_replace_state_dict_keys_with_sharded_keys")(sharded_state_dict, keep_only_main_replica)


def replace_sharded_keys_with_state_dict_keys(state_dict: Any, flat_mapping: Any, rename_mapping: Any) -> Any:
    return _hook("_replace_sharded_keys_with_state_dict_keys")(state_dict, flat_mapping, rename_mapping)


def unwrap_pyt_sharded_tensor(value: Any) -> Any:
    return _hook("_unwrap_pyt_sharded_tensor")(value)


def restore_dict_types(loaded: Any, template: Any) -> None:
    _hook("_restore_dict_types")(loaded, template)


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """torch's record of where a written item lies (``WriteResult.storage_data``)."""
    return _hook("_StorageInfo")(relative_path=relative_path, offset=offset, length=length)


# ------------------------------------------------------------------------------ zip CRC switch


def _serialization_config() -> Any:
    """torch.save's config (``compute_crc32``), or None for a torch without the switch."""
    try:
        from torch.utils.serialization import config  # not imported by ``import torch``
    except ImportError:
        return None
    return config if hasattr(getattr(config, "save", None), "compute_crc32") else None


_NO_CRC_USERS = 0
_NO_CRC_SAVED: list[bool] = []
_NO_CRC_LOCK = threading.Lock()


@contextlib.contextmanager
def writers_without_zip_crc() -> Iterator[None]:
    """Around a pool of writer threads: on torch < 2.13 the (process-wide) CRC switch is off inside.

    Concurrent pools count themselves in; the last one out restores the previous value. On torch
    >= 2.13 nothing happens here (see ``thread_without_zip_crc``).
    """
    global _NO_CRC_USERS
    save_config = getattr(_serialization_config(), "save", None)
    if save_config is None or not ZIP_CRC_PROCESS_WIDE:
        yield
        return
    with _NO_CRC_LOCK:
        if _NO_CRC_USERS == 0:
            _NO_CRC_SAVED[:] = [save_config.compute_crc32]
            save_config.compute_crc32 = False
        _NO_CRC_USERS += 1
    try:
        yield
    finally:
        with _NO_CRC_LOCK:
            _NO_CRC_USERS -= 1
            if _NO_CRC_USERS == 0:
                save_config.compute_crc32 = _NO_CRC_SAVED.pop()


def thread_without_zip_crc() -> contextlib.AbstractContextManager:
    """In the calling writer thread, skip torch.save's CRC-32 (torch >= 2.13, where the switch is per thread).

    Without it the CRC pass over every byte cost ~30% of a writer thread's time here.
    """
    config = _serialization_config()
    if config is None or ZIP_CRC_PROCESS_WIDE:
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})


# ------------------------------------------------------------------- MoE without Transformer Engine

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MOE_TE_NAMES = (
    "te_general_gemm",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
)
"""Names ``moe_utils`` binds only when Transformer Engine imports, and tests against None."""


def define_moe_te_names() -> list[str]:
    """Define the missing ``MOE_TE_NAMES`` in ``moe_utils`` as None (see the module docstring).

    Returns the names defined now (empty with TE, or when already done). CompatError when
    ``moe_utils`` lacks its ``HAVE_TE`` switch, i.e. is not the module these names were read from.
    """
    module = importlib.import_module(_MOE_UTILS)
    if not hasattr(module, "HAVE_TE"):
        raise CompatError(
            f"{_MOE_UTILS}.HAVE_TE is missing (megatron-core {'.'.join(map(str, mcore_version()))}): the "
            "Transformer-Engine-less MoE shim was read from 0.16; update megatron_mugrpo/training/mcore_compat.py"
        )
    if module.HAVE_TE:
        return []
    missing = [name for name in MOE_TE_NAMES if not hasattr(module, name)]
    for name in missing:
        setattr(module, name, None)
    return missing


ROUTER_LOSS_TP_SCALED = ((0, 16), (0, 17))
"""megatron-core versions whose router losses are read to weigh 1/TP under sequence parallelism with
per-token loss (``sequence_parallel_router_loss_coefficients``)."""


def sequence_parallel_router_loss_coefficients(fields: dict[str, Any]) -> dict[str, float]:
    """Router-loss coefficients (``TransformerConfig`` fields) under which a TP > 1 sequence-parallel
    MoE model's router gradients equal one rank's; ``{}`` when nothing needs to change.

    With ``calculate_per_token_loss`` (our trainer's setting) megatron-core 0.16 scales each router
    loss by the number of tokens *this rank* routes, so that the schedule's division by the total
    loss tokens leaves the loss's own scale (router.py: ``attach_and_log_load_balancing_loss`` and
    ``apply_z_loss``; the z-loss coefficient is divided by the TP size first). Under sequence
    parallelism each TP rank routes 1 / TP of the sequence and the router's gradient is summed over
    TP, so both losses' gradients come out TP times too small (measured at TP=2: exactly 1/2, with
    the load-balancing and the z-loss alike; ``tests/training/test_moe_tp_ep.py``). Multiplying the
    coefficients by TP restores one rank's gradients; the logged losses are divided by the
    coefficient and do not change. Other megatron-core versions are left alone, with a warning.
    """
    tp = int(fields.get("tensor_model_parallel_size", 1))
    losses = {key: fields[key] for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff") if fields.get(key)}
    if tp == 1 or not losses or not (fields.get("sequence_parallel") and fields.get("calculate_per_token_loss")):
        return {}
    low, high = ROUTER_LOSS_TP_SCALED
    if not low <= mcore_version() < high:
        _warn_router_losses_unchecked(mcore_version())
        return {}
    return {key: float(value) * tp for key, value in losses.items()}


@functools.cache
def _warn_router_losses_unchecked(version: tuple[int, int]) -> None:
    """Warn once per process and version: every model build passes here."""
    logger.warning(
        "megatron-core %s: router-loss gradients under sequence parallelism were checked against one rank "
        "only on %s; the router-loss coefficients are used as given",
        version,
        ROUTER_LOSS_TP_SCALED[0],
    )
