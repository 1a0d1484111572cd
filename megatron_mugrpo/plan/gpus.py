"""The accelerators a plan can be made for: memory, dense peak FLOPs and HBM bandwidth, with sources.

Numbers are the vendors' datasheet values for the SXM (socket) parts unless the name says otherwise:
dense (no 2:4 sparsity) tensor-core peaks, bf16 and FP8, and HBM bandwidth. Memory is the datasheet
capacity in GB (10^9 bytes); what a process can allocate is a little less (the CUDA context takes
about 0.5–1 GiB), which ``CUDA_CONTEXT_BYTES`` accounts for.

    gpu = gpu_spec("h100")
    gpu.memory_bytes, gpu.bf16_flops, gpu.hbm_bytes_per_s
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mugrpo.errors import InputError

CUDA_CONTEXT_BYTES = 1 * 2**30
"""What the CUDA context, NCCL communicators and the allocator's fragmentation take on every GPU before
any tensor is allocated (measured on H100 with torch 2.x: 0.5–1 GiB); subtracted from the usable memory."""


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator model."""

    name: str
    memory_gb: float
    """Datasheet memory capacity, GB (10^9 bytes)."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float
    """Dense FP8 tensor-core peak, TFLOP/s (0: no FP8 tensor cores)."""
    hbm_tb_per_s: float
    """Memory bandwidth, TB/s."""
    source: str
    """Where the numbers come from."""
    context_bytes: int = CUDA_CONTEXT_BYTES
    """Taken before any tensor (0 for a CPU: the host's memory has no device context)."""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    @property
    def usable_bytes(self) -> int:
        """What tensors can take: the capacity less the CUDA context (``context_bytes``)."""
        return self.memory_bytes - self.context_bytes

    @property
    def has_roofline(self) -> bool:
        """Whether the time can be planned: FLOPs and bandwidth are known (not for a CPU or an unknown GPU)."""
        return self.bf16_tflops > 0 and self.hbm_tb_per_s > 0

    @property
    def bf16_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def fp8_flops(self) -> float:
        return self.fp8_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tb_per_s * 1e12


_HOPPER = "https://resources.nvidia.com/en-us-gpu-resources/h100-datasheet-24306 (H100 SXM5 column)"
GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(name="h100", memory_gb=80, bf16_tflops=989, fp8_tflops=1979, hbm_tb_per_s=3.35, source=_HOPPER),
        GpuSpec(
            name="h100-pcie",
            memory_gb=80,
            bf16_tflops=756,
            fp8_tflops=1513,
            hbm_tb_per_s=2.0,
            source="NVIDIA H100 datasheet, H100 PCIe column",
        ),
        GpuSpec(
            name="h200",
            memory_gb=141,
            bf16_tflops=989,
            fp8_tflops=1979,
            hbm_tb_per_s=4.8,
            source="https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM column)",
        ),
        GpuSpec(
            name="a100",
            memory_gb=80,
            bf16_tflops=312,
            fp8_tflops=0,
            hbm_tb_per_s=2.039,
            source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM column)",
        ),
        GpuSpec(
            name="a100-40gb",
            memory_gb=40,
            bf16_tflops=312,
            fp8_tflops=0,
            hbm_tb_per_s=1.555,
            source="NVIDIA A100 datasheet, A100 40GB SXM column",
        ),
        GpuSpec(
            name="b200",
            memory_gb=180,
            bf16_tflops=2250,
            fp8_tflops=4500,
            hbm_tb_per_s=7.7,
            source="https://www.nvidia.com/en-us/data-center/dgx-b200/ (DGX B200 totals / 8: 1,440 GB, "
            "72 PFLOPS FP8 sparse, 64 TB/s)",
        ),
        GpuSpec(
            name="l40s",
            memory_gb=48,
            bf16_tflops=362,
            fp8_tflops=733,
            hbm_tb_per_s=0.864,
            source="https://www.nvidia.com/en-us/data-center/l40s/ (dense = half the sparse figures)",
        ),
        GpuSpec(
            name="mi300x",
            memory_gb=192,
            bf16_tflops=1307,
            fp8_tflops=2615,
            hbm_tb_per_s=5.3,
            source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
        ),
    )
}
"""Known accelerators by ``--gpu`` name."""


def gpu_spec(name: str, memory_gib: float | None = None) -> GpuSpec:
    """The spec of ``--gpu NAME``; ``memory_gib`` (``--gpu-memory-gib``) replaces its memory capacity."""
    spec = GPUS.get(name.lower())
    if spec is None:
        raise InputError(
            f"--gpu {name!r} is not a known GPU; choose one of {sorted(GPUS)} (megatron_mugrpo/plan/gpus.py)"
        )
    if memory_gib is None:
        return spec
    if memory_gib <= 0:
        raise InputError(f"--gpu-memory-gib {memory_gib} must be > 0")
    return GpuSpec(
        name=spec.name,
        memory_gb=memory_gib * 2**30 / 1e9,
        bf16_tflops=spec.bf16_tflops,
        fp8_tflops=spec.fp8_tflops,
        hbm_tb_per_s=spec.hbm_tb_per_s,
        source=spec.source + f"; memory set to {memory_gib} GiB by --gpu-memory-gib",
    )
