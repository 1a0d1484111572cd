"""Session-wide test setup.

Without CUDA the Triton kernels are tested under Triton's interpreter, which must be switched on
before ``triton`` is first imported: triton decorates its own ``tl`` library functions at import
time, and megatron-core imports triton, so any test module importing Megatron first would leave
them compiled-mode and break the interpreted kernels. Setting it here, before any test module is
collected, makes the order of test files irrelevant. The CPU code paths never call Triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers (``make test`` runs two) split the cores: each worker's torch, and the
# processes its tests start, get cores / workers threads, since oversubscribed OpenMP threads spin.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
