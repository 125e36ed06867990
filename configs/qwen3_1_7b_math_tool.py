"""Qwen3-1.7B (dense) learns the math tool agent with GRPO on the GPUs people have (docs/gpu.md,
"One GPU, one node, two nodes"):

- `one_gpu()`: one GPU, colocated (layout.colocate): trainer rank 0 and the engine share GPU 0; the
  engine takes rollout.engine_memory_fraction of it and sleeps while the trainer steps
  (rollout.sleep_while_training), refit goes through host memory (gloo).
- `config()` / `one_node()`: one node of 8 GPUs, colocated: 8 FSDP2 trainer ranks and 8 engines
  over the same 8 GPUs.

Bring the checkpoint and the data as for configs/qwen3_30b_a3b_math_tool.py: model.path is
$MOLT_CHECKPOINTS/Qwen3-1.7B, data.train_path is $MOLT_DATA/math/train.jsonl. `--dry-run` needs
neither: it reads the architecture from configs/hf/qwen3-1.7b (model.config_path).

Memory, 80 GiB class GPU: a trainer rank holds float32 master weights, gradients and AdamW states
(16 B/param: 27.5 GiB for 1.72B on one GPU, 3.4 GiB per rank over 8) plus bf16 activations of one
checkpointed micro-batch; the engine serves bf16 weights (3.4 GiB) plus KV cache (112 KiB a token:
28 layers x 8 KV heads x 128 x K,V x bf16) in its share.
"""

import os
from pathlib import Path

from molt.config import MoltConfig

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path(os.environ.get("MOLT_CHECKPOINTS", "/checkpoints"))
DATA = Path(os.environ.get("MOLT_DATA", "/data"))


def one_gpu() -> MoltConfig:
    cfg = MoltConfig(name="qwen3-1.7b-math-tool-1gpu", seed=0, device="cuda")
    cfg.model.path = str(CHECKPOINTS / "Qwen3-1.7B")
    cfg.model.config_path = str(HERE / "hf" / "qwen3-1.7b")
    cfg.model.dtype = "bfloat16"
    cfg.data.train_path = str(DATA / "math" / "train.jsonl")
    cfg.agent.path = str(HERE / "agents" / "math_tool_openai.py")
    cfg.agent.rollout_timeout_seconds = 600.0
    cfg.agent.max_concurrent_rollouts = 128
    cfg.layout.num_trainer_ranks = 1
    cfg.layout.num_rollout_ranks = 1
    cfg.layout.colocate = True  # trainer rank 0 and the engine on GPU 0
    cfg.layout.gpus_per_node = 1
    cfg.layout.gpu_memory_gigabytes = 79  # an 80 GB H100/A100 reports 79.6 GiB
    # The engine's share of the GPU (weights 3.4 GiB + KV cache + CUDA graphs); the trainer rank has the
    # rest while the engine is awake, and all of it while the engine sleeps during the step.
    cfg.rollout.engine_memory_fraction = 0.35
    cfg.rollout.sleep_while_training = True
    cfg.rollout.prompts_per_step = 32
    cfg.rollout.n_samples_per_prompt = 8
    cfg.rollout.max_response_tokens = 2048
    cfg.rollout.max_length = 8192
    cfg.rollout.num_agent_workers = 2
    cfg.train.num_steps = 300
    cfg.train.learning_rate = 1e-6
    cfg.train.weight_decay = 0.01
    cfg.train.max_grad_norm = 1.0
    cfg.train.max_tokens_per_micro_batch = 16384
    cfg.train.param_dtype = "float32"
    cfg.train.compute_dtype = "bfloat16"
    cfg.train.activation_checkpointing = "full"
    cfg.train.logprob_chunk_tokens = 1024
    cfg.train.lr_schedule = "cosine"
    cfg.train.warmup_steps = 10
    cfg.train.min_lr_ratio = 0.1
    cfg.train.no_weight_decay_on = ("norms", "biases", "embeddings")
    cfg.algorithm.advantage_estimator = "grpo"
    cfg.algorithm.clip_eps_high = 0.28
    # Synchronous: the engine sleeps while the trainer steps (rollout.sleep_while_training needs it).
    cfg.algorithm.max_staleness = 0
    cfg.refit.bucket_megabytes = 512
    cfg.refit.timeout_seconds = 300.0  # ~3.4 GB of bf16 weights through host memory
    return cfg


def one_node() -> MoltConfig:
    cfg = one_gpu()
    cfg.name = "qwen3-1.7b-math-tool-1node"
    cfg.layout.num_trainer_ranks = 8
    cfg.layout.num_rollout_ranks = 8  # one engine beside each trainer rank
    cfg.layout.gpus_per_node = 8
    cfg.rollout.prompts_per_step = 128
    cfg.agent.max_concurrent_rollouts = 256
    return cfg


def config() -> MoltConfig:
    return one_node()
