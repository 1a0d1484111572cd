"""megatron-core imported after our package on CPU: its ``jit_fuser`` is its own no-op decorator and
torch.compile's machinery (``torch._dynamo``) is never imported; imported first, it is left alone.

Each case runs in a fresh interpreter, since the point is what an import does to a new process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

PROBE = """
import json, sys
{first}
import megatron.core, megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
print(json.dumps({{"fuser": jit.jit_fuser.__name__, "dynamo": "torch._dynamo" in sys.modules,
                  "swiglu_plain": not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")}}))
"""


def _probe(first: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine megatron-core keeps torch.compile")
def test_on_cpu_megatron_core_imports_without_torch_compile():
    assert _probe("import megatron_mugrpo") == {"fuser": "noop_decorator", "dynamo": False, "swiglu_plain": True}
    # megatron-core imported before our package: nothing is changed behind its back.
    first = _probe("import megatron.core.jit\nimport megatron_mugrpo")
    assert first["fuser"] == "compile" and first["dynamo"] and not first["swiglu_plain"]
