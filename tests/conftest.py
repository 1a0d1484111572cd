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
