"""Keep megatron-core from importing torch.compile's machinery at start-up on CPU.

megatron-core 0.16's ``megatron.core.jit`` sets ``jit_fuser = torch.compile`` (torch >= 2.2), and about a
dozen of its modules decorate functions with it as they are imported (``fusions.fused_bias_geglu`` and
others). The first such call imports ``torch._dynamo``: 3.5 s of every process's start-up on this
project's 2-core machine (``import torch, megatron.core`` took 10.0 s, 6.4 s without it), paid by every
trainer rank, rollout worker and spawned test rank. None of those functions runs in the models we
build: the fusions are off (``training.model``), and we use no attention output gate, expert bias or
L2 norm. On CPU, compiling them would also need a C++ compiler.

So where CUDA is absent, ``megatron.core.jit`` is finished as it is first imported by calling its own
``disable_jit_fuser()``, which makes ``jit_fuser`` megatron-core's no-op decorator before any module
binds it. With CUDA, megatron-core is left exactly as it is. ``install()`` is called by the package's
``__init__``, so it is in place before any of our modules imports megatron-core; a process that
imported megatron-core first keeps torch.compile.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

JIT_MODULE = "megatron.core.jit"


class _NoJitOnCpu(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the normal path finder does and disables its fuser after it runs."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            import torch  # megatron.core.jit has just imported it

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` once (nothing to do if megatron-core is already imported)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _NoJitOnCpu) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _NoJitOnCpu())
