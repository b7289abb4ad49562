"""megatron-flash: asynchronous RL post-training of LLMs on Megatron-Core.

megatron-core, torch and transformers are bounded by the span the project tests
(megatron_flash/versions.py: CI's lock and `make test-compat`'s newest megatron-core); the rest stay
open for cluster users. CI and the CPU quickstart install the exact set in requirements/cpu-lock.txt
instead (see the Makefile). A version outside a span still runs when installed by hand (--no-deps,
a container's own): the launcher prints one warning line naming it.
"""

import os

from setuptools import find_packages, setup

_versions: dict = {}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_flash", "versions.py")) as f:
    exec(compile(f.read(), "megatron_flash/versions.py", "exec"), _versions)  # stdlib only; nothing installed yet
requirement = _versions["requirement"]

setup(
    name="megatron-flash",
    version="0.1.0",
    description="Asynchronous RL post-training (GRPO-style, off-policy losses) on Megatron-Core",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_flash", "megatron_flash.*"]),
    install_requires=[
        requirement("torch"),
        requirement("megatron-core"),
        requirement("transformers"),
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "omegaconf>=2.3",
        "pyyaml>=6",
        "numpy>=1.24",
        "wandb>=0.19",
        "tensorboard>=2.14",
        "datasets>=3",
        "math-verify>=0.7",
        "tqdm>=4.66",
        "aiohttp>=3.9",  # engine client and proxy
        "fastapi>=0.110",  # local engine server
        "uvicorn>=0.29",
        "psutil>=5.9",  # Megatron's distributed-checkpoint writer needs it (tools/weight_sync/convert.py)
    ],
    extras_require={
        # The set CI pins (Python 3.11: megatron-core 0.16.1 is the newest that supports it).
        "cpu": ["torch==2.13.0", "megatron-core==0.16.1", "transformers==5.23.0", "omegaconf==2.4.0",
                "wandb==0.31.0", "tensorboard==2.21.0", "datasets==5.2.0", "math-verify==0.9.0"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5",  # make test runs two workers
                "matplotlib>=3.7",  # matplotlib: benchmark plots
                "openai>=1.40",  # the agent gateway is tested with the official client
                "peft>=0.17"],  # LoRA exports are checked with PEFT's own loader
        "report": ["matplotlib>=3.7"],  # tools/report.py (pinned in requirements/cpu-lock.txt)
        # GPU clusters: SGLang engines. transformer-engine is optional (Megatron falls back to torch
        # norms/attention without it) and is installed separately against the cluster's CUDA.
        # NVIDIA Apex is built from source; the PyPI package named "apex" is unrelated — never add it.
        "gpu": ["sglang>=0.5.2"],
        "te": ["transformer-engine[pytorch]>=2.0"],
    },
)
