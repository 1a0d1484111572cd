"""Run megatron-core on a machine without CUDA (gloo + CPU tensors), for tests and the CPU demo.

megatron-core assumes a GPU in a handful of places. ``activate()`` patches exactly those, and
nothing when ``torch.cuda.is_available()`` (a CUDA machine must run Megatron unchanged):

- RNG tracker: Megatron's ``CudaRNGStatesTracker`` forks CUDA generator states (TP-aware weight
  init, dropout). On CPU the CPU generator plays the device generator's role, so the tracker class
  is replaced by ``CpuRNGStatesTracker``, which forks ``torch.get_rng_state()`` instead.
- ``torch.cuda`` stubs: ``current_device`` (→ 0, which the device mode maps to CPU),
  ``synchronize`` / ``empty_cache`` (no-ops), ``Stream`` / ``Event`` / ``current_stream`` /
  ``default_stream`` / ``stream`` (inert stand-ins: CPU work is synchronous).
- Device mapping: megatron allocates with hard-coded ``device="cuda"`` / ``.cuda()`` /
  ``device=torch.cuda.current_device()``. A ``TorchFunctionMode`` rewrites those device arguments
  to CPU. Torch function modes are thread-local: the mode covers the thread that called
  ``activate()``, where Megatron's forward, backward, optimizer step and (synchronous)
  checkpointing run; a 'cuda' allocation from another thread is not remapped.
- ``.type()`` strings: clip_grads and the (distributed) optimizer assert
  ``param.type() == "torch.cuda.FloatTensor"``; the same mode reports a CPU tensor's argument-less
  ``.type()`` as its ``torch.cuda.*`` name.
- Backward inside the mode (part of ``device_mode``): ``Tensor.backward`` / ``torch.autograd.backward``
  reach the mode as one torch function, and a mode is switched off while it handles a call, so the
  whole backward pass would run unmapped (the expert-parallel all-to-all allocates its gradient
  with ``device=torch.cuda.current_device()``; Megatron's schedules call ``torch.autograd.backward``
  unless ``deallocate_pipeline_outputs`` is set). The mode runs these two itself, with the mode
  re-entered, through torch's autograd engine entry (``_make_grads``, ``_tensor_or_tensors_to_tuple``,
  ``graph._engine_run_backward``: private, resolved at ``activate()``, which fails naming a missing one).
- MoE all-to-all split sizes (``moe_dispatch``): the all-to-all token dispatcher turns its split
  sizes into numpy arrays with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts
  CUDA tensors only; gloo's ``all_to_all_single`` rejects the CPU tensors left behind. The
  dispatcher's reference to that helper is wrapped to convert CPU tensors too. Applied by
  ``activate_moe()``, which the model provider calls when it builds a MoE model (dense runs do not
  import the dispatcher); a megatron-core without the helper fails it with a ``RuntimeError``.

- Sequence-parallel norms (``sequence_parallel_norm``): Megatron's local spec builds its norms with
  ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel`` (torch_norm.py). It is built
  from a copy of the config with the flag off, and its weights are marked ``sequence_parallel``
  (as ``FusedLayerNorm`` / Transformer Engine mark theirs), so ``finalize_model_grads`` sums their
  gradients over TP: each TP rank normalises its own slice of the sequence. gloo itself runs the
  sequence-parallel all-gather / reduce-scatter (``all_gather_into_tensor``, ``reduce_scatter_tensor``).
- Uneven TP gather / reduce-scatter (``moe_uneven_tp_collectives``): with TP > 1 the all-to-all
  token dispatcher gathers tokens over TP with per-rank split sizes (``torch.distributed.all_gather``
  of unequal parts, ``reduce_scatter`` in backward), which gloo rejects. Megatron's
  ``_gather_along_first_dim`` pads every part to the largest and drops the padding;
  ``_reduce_scatter_along_first_dim`` all-reduces and keeps this rank's rows (the same sums).
  Applied by ``activate_moe()``; a megatron-core without the two helpers fails it naming them.

Not available on CPU (leave them off in the TransformerConfig): gradient_accumulation_fusion,
persist_layer_norm, apply_rope_fusion, bias/activation fusions that need Apex or Transformer Engine.

    from megatron_mugrpo.training import cpu_compat
    counts = cpu_compat.activate()   # {"rng_tracker": 1, "torch_cuda_stubs": 8, "device_mode": 1,
                                     #  "sequence_parallel_norm": 1}
    cpu_compat.activate_moe()        # + {"moe_dispatch": 1, "moe_uneven_tp_collectives": 2}, for MoE models
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_PATCH_COUNTS: dict[str, int] = {}
_DEVICE_MODE: _CpuDeviceMode | None = None
_ORIGINALS: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original value) for every patched attribute, so deactivate() can undo them."""


def is_active() -> bool:
    """True when the compatibility layer has patched this process."""
    return bool(_PATCH_COUNTS)


def activate() -> dict[str, int]:
    """Patch megatron-core / torch.cuda for CPU execution; idempotent.

    Returns the number of patches applied per category (empty dict on a CUDA machine, where
    nothing is touched). Calling it again returns the same counts without patching twice.
    """
    if torch.cuda.is_available():
        return {}
    if not _PATCH_COUNTS:
        _PATCH_COUNTS["rng_tracker"] = _patch_rng_tracker()
        _PATCH_COUNTS["torch_cuda_stubs"] = _patch_torch_cuda()
        _PATCH_COUNTS["device_mode"] = _enter_device_mode()
        _PATCH_COUNTS["sequence_parallel_norm"] = _patch_sequence_parallel_norm()
    return dict(_PATCH_COUNTS)


def activate_moe() -> dict[str, int]:
    """The MoE dispatcher patches on top of ``activate()``; idempotent, nothing unless the layer is active."""
    if is_active() and "moe_dispatch" not in _PATCH_COUNTS:
        _PATCH_COUNTS["moe_dispatch"] = _patch_moe_dispatch()
        _PATCH_COUNTS["moe_uneven_tp_collectives"] = _patch_uneven_tp_collectives()
    return dict(_PATCH_COUNTS)


def deactivate() -> None:
    """Undo every patch (tests use this to leave the pytest process as they found it)."""
    global _DEVICE_MODE
    if _DEVICE_MODE is not None:
        _DEVICE_MODE.__exit__(None, None, None)
        _DEVICE_MODE = None
    while _ORIGINALS:
        owner, name, value = _ORIGINALS.pop()
        setattr(owner, name, value)
    _PATCH_COUNTS.clear()
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _patch(owner: Any, name: str, value: Any) -> None:
    _ORIGINALS.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


# ------------------------------------------------------------------------------------ RNG tracker


def _cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _patch_rng_tracker() -> int:
    """Replace Megatron's CUDA RNG tracker with one that forks the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[valid-type, misc]
        """Megatron's named RNG states (data-parallel, model-parallel, expert) on the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"RNG seed {seed} already exists in the tracker")
            if name in self.states_:
                raise RuntimeError(f"RNG state {name!r} already exists in the tracker")
            self.seeds_.add(seed)
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            # Megatron's fork warns when the CPU state changes inside the context; here the CPU
            # generator *is* the forked device generator, so that change is the intended effect.
            if name not in self.states_:
                raise RuntimeError(f"RNG state {name!r} was not added to the tracker")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    _patch(mrandom, "CudaRNGStatesTracker", CpuRNGStatesTracker)
    _patch(mrandom, "_get_cuda_rng_state", _cpu_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _set_cpu_rng_state)
    # A tracker created before activation would still be the CUDA one: force the next
    # initialize_rng_tracker() to build the CPU tracker.
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    return 1


# ------------------------------------------------------------------------------- torch.cuda stubs


class _InertStream:
    """Stand-in for torch.cuda.Stream / Event: CPU kernels run synchronously, so waits are no-ops."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_stream(self, *_args: Any) -> None:
        pass

    def wait_event(self, *_args: Any) -> None:
        pass

    def record_event(self, *_args: Any) -> _InertStream:
        return _InertStream()

    def record(self, *_args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, _other: Any) -> float:
        return 0.0


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _current_device() -> int:
    return 0


def _stream_context(_stream: Any = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _patch_torch_cuda() -> int:
    stubs: dict[str, Any] = {
        "current_device": _current_device,
        "synchronize": _noop,
        "empty_cache": _noop,
        "Stream": _InertStream,
        "Event": _InertStream,
        "current_stream": lambda *_a, **_k: _InertStream(),
        "default_stream": lambda *_a, **_k: _InertStream(),
        "stream": _stream_context,
    }
    for name, stub in stubs.items():
        _patch(torch.cuda, name, stub)
    return len(stubs)


# ---------------------------------------------------------------------------------- device mode


def _is_accelerator(device: Any) -> bool:
    """An int (Megatron passes torch.cuda.current_device()), 'cuda', 'cuda:N' or a cuda device."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
}


def _backward_entry() -> dict[str, Any]:
    """torch's private autograd entry points that ``_run_backward`` calls; RuntimeError naming a missing one."""
    import torch.autograd.graph as graph

    owners = {"_make_grads": torch.autograd, "_tensor_or_tensors_to_tuple": torch.autograd}
    owners["_engine_run_backward"] = graph
    missing = [name for name, owner in owners.items() if not hasattr(owner, name)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} lacks torch.autograd {missing}: the CPU compatibility layer cannot run "
            "backward passes inside its device mode; update megatron_mugrpo/training/cpu_compat.py"
        )
    return {name: getattr(owner, name) for name, owner in owners.items()}


def _run_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward`` without its torch-function dispatch (which would reach the mode again)."""
    entry = _backward_entry()
    tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
    inputs_tuple = () if inputs is None else (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
    grads = entry["_tensor_or_tensors_to_tuple"](grad_tensors, len(tensors))
    grads = entry["_make_grads"](tensors, grads, is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    entry["_engine_run_backward"](
        tensors, grads, retain, create_graph, inputs_tuple, allow_unreachable=True, accumulate_grad=True
    )


def _backward_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """(tensors, grad_tensors, retain_graph, create_graph, inputs) of a Tensor.backward / autograd.backward call."""
    import inspect

    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    if func is torch.Tensor.backward:
        return named["self"], named["gradient"], named["retain_graph"], named["create_graph"], named["inputs"]
    grads = named["grad_tensors"] if named.get("grad_tensors") is not None else named.get("grad_variables")
    return named["tensors"], grads, named["retain_graph"], named["create_graph"], named["inputs"]


_BACKWARD_FUNCS = (torch.Tensor.backward, torch.autograd.backward)
"""Torch functions that run a whole backward pass: the mode must stay on inside them."""


class _CpuDeviceMode(TorchFunctionMode):
    """Maps CUDA device arguments to CPU and reports ``.type()`` with CUDA names."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _BACKWARD_FUNCS:
            with self:  # re-entered: backward functions (e.g. the EP all-to-all's) allocate on 'cuda'
                return _run_backward(*_backward_call(func, args, kwargs))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            return name if name is not None else func(*args)
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_accelerator(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_accelerator(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _enter_device_mode() -> int:
    global _DEVICE_MODE
    _backward_entry()  # fail here, not in the first backward, when torch moved its autograd entry
    _DEVICE_MODE = _CpuDeviceMode()
    # Entered for the life of the process: Megatron allocates on 'cuda' at arbitrary points
    # (optimizer construction, schedules, checkpoint exchange), not inside one call we could wrap.
    _DEVICE_MODE.__enter__()
    return 1


# ------------------------------------------------------------------------------ MoE dispatch


_MOE_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def _to_cpu_or_numpy(move: Any) -> Any:
    """``maybe_move_tensor_to_cpu`` that also turns CPU tensors into numpy when ``as_numpy`` is set."""

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _patch_moe_dispatch() -> int:
    """Split sizes of the all-to-all dispatcher as numpy on CPU (see the module docstring)."""
    import importlib

    dispatcher = importlib.import_module(_MOE_DISPATCHER)
    move = getattr(dispatcher, "maybe_move_tensor_to_cpu", None)
    if move is None:
        raise RuntimeError(
            f"{_MOE_DISPATCHER}.maybe_move_tensor_to_cpu is missing: the CPU compatibility layer cannot give "
            "gloo the all-to-all split sizes; update megatron_mugrpo/training/cpu_compat.py for this megatron-core"
        )
    _patch(dispatcher, "maybe_move_tensor_to_cpu", _to_cpu_or_numpy(move))
    return 1


# ---------------------------------------------------------------------- sequence-parallel norm


def _sequence_parallel_norm(original_new: Any) -> Any:
    """``WrappedTorchNorm.__new__`` that builds the torch norm under sequence parallelism too.

    Megatron refuses (torch_norm.py: ``assert not config.sequence_parallel``) because a plain torch
    norm does not mark its weight for the TP all-reduce that Megatron's own norms request: under
    sequence parallelism each TP rank normalises its slice of the sequence, so its weight gradient is
    a partial sum. Marking the weight ``sequence_parallel`` (as ``FusedLayerNorm`` and Transformer
    Engine do) makes ``finalize_model_grads`` sum it over the TP group.
    """

    def build_norm(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, *args, **kwargs)
        plain = copy.copy(config)  # no __post_init__: MoE with TP > 1 insists on sequence parallelism
        plain.sequence_parallel = False
        norm = original_new(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return build_norm


def _patch_sequence_parallel_norm() -> int:
    """Let the local spec's torch norms run with sequence parallelism (see the module docstring)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _patch(WrappedTorchNorm, "__new__", staticmethod(_sequence_parallel_norm(WrappedTorchNorm.__new__)))
    return 1


# --------------------------------------------------------------- uneven TP gather / reduce-scatter


_MAPPINGS = "megatron.core.tensor_parallel.mappings"


def _gather_uneven(original: Any) -> Any:
    """``_gather_along_first_dim`` whose uneven case pads every part to the largest and drops the padding."""

    def _gather_along_first_dim(
        input_: torch.Tensor, group: Any, output_split_sizes: list[int] | None = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        import torch.distributed as dist

        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, output_split_sizes)])

    return _gather_along_first_dim


def _reduce_scatter_uneven(original: Any) -> Any:
    """``_reduce_scatter_along_first_dim`` whose uneven case all-reduces and keeps this rank's rows."""

    def _reduce_scatter_along_first_dim(
        input_: torch.Tensor, group: Any, input_split_sizes: list[int] | None = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        import torch.distributed as dist

        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.split(input_split_sizes)[group.rank()].contiguous()

    return _reduce_scatter_along_first_dim


def _patch_uneven_tp_collectives() -> int:
    """Uneven first-dimension gather / reduce-scatter over TP in gloo terms (see the module docstring)."""
    import importlib

    mappings = importlib.import_module(_MAPPINGS)
    shims = {"_gather_along_first_dim": _gather_uneven, "_reduce_scatter_along_first_dim": _reduce_scatter_uneven}
    missing = [name for name in shims if not hasattr(mappings, name)]
    if missing:
        raise RuntimeError(
            f"{_MAPPINGS} lacks {missing}: the CPU compatibility layer cannot run the MoE token dispatch over "
            "TP > 1 on gloo; update megatron_mugrpo/training/cpu_compat.py for this megatron-core"
        )
    for name, shim in shims.items():
        _patch(mappings, name, shim(getattr(mappings, name)))
    return len(shims)
