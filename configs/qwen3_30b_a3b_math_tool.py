"""Qwen3-30B-A3B (MoE, 3.3B active) learns a math tool agent with GRPO on 2 nodes x 8 GPUs: 8
FSDP2 trainer ranks on node 0, 8 single-GPU vLLM engines on node 1.

Bring the checkpoint and the data: model.path is $MOLT_CHECKPOINTS/Qwen3-30B-A3B (a Hugging Face
directory), data.train_path is $MOLT_DATA/math/train.jsonl (rows {"prompt": ..., "label": "<number>"},
e.g. GSM8K or DAPO-Math-17k converted); or --set either. `--dry-run` needs neither: it reads the
architecture from configs/hf/qwen3-30b-a3b (model.config_path).

GPUs: 80 GiB class (layout.gpu_memory_gigabytes). Trainer ranks keep float32 master weights,
gradients and AdamW states (16 B/param: 1/8 of them is ~57 GiB per rank) and compute in bf16 with
every decoder block checkpointed; the engines serve bf16 (~57 GiB for the whole model) plus KV cache.
"""

import os
from pathlib import Path

from molt.config import MoltConfig

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path(os.environ.get("MOLT_CHECKPOINTS", "/checkpoints"))
DATA = Path(os.environ.get("MOLT_DATA", "/data"))


def config() -> MoltConfig:
    cfg = MoltConfig(name="qwen3-30b-a3b-math-tool", seed=0, device="cuda")
    cfg.model.path = str(CHECKPOINTS / "Qwen3-30B-A3B")
    cfg.model.config_path = str(HERE / "hf" / "qwen3-30b-a3b")
    cfg.model.dtype = "bfloat16"
    cfg.data.train_path = str(DATA / "math" / "train.jsonl")
    cfg.agent.path = str(HERE / "agents" / "math_tool_openai.py")
    cfg.agent.rollout_timeout_seconds = 600.0
    cfg.agent.max_concurrent_rollouts = 256
    cfg.layout.num_trainer_ranks = 8
    cfg.layout.num_rollout_ranks = 8
    cfg.layout.engine_tensor_parallel_size = 1
    cfg.layout.gpus_per_node = 8
    cfg.layout.gpu_memory_gigabytes = 79  # an 80 GB H100/A100 reports 79.6 GiB
    cfg.rollout.prompts_per_step = 64
    cfg.rollout.n_samples_per_prompt = 8
    cfg.rollout.max_response_tokens = 2048
    cfg.rollout.max_length = 8192  # prompt + every turn and tool result of one segment
    # 96 KiB a token (48 layers x 4 KV heads x 128 x K,V x bf16): ~87k tokens. With the 56.9 GiB of
    # weights that leaves ~14 GiB of the 79 for activations and CUDA graphs.
    cfg.rollout.kv_cache_gigabytes = 8
    cfg.rollout.enforce_eager = False  # CUDA graphs: faster decode
    cfg.rollout.num_agent_workers = 4
    cfg.train.num_steps = 500
    cfg.train.learning_rate = 1e-6
    cfg.train.weight_decay = 0.01
    cfg.train.max_grad_norm = 1.0
    cfg.train.max_tokens_per_micro_batch = 16384
    # Precision and memory (docs/training.md): float32 master weights and AdamW state, bf16
    # forward/backward, every block's activations recomputed in backward, log-probs in chunks.
    cfg.train.param_dtype = "float32"
    cfg.train.compute_dtype = "bfloat16"
    cfg.train.activation_checkpointing = "full"
    cfg.train.logprob_chunk_tokens = 1024
    cfg.train.lr_schedule = "cosine"
    cfg.train.warmup_steps = 10
    cfg.train.min_lr_ratio = 0.1
    cfg.train.no_weight_decay_on = ("norms", "biases", "embeddings")
    cfg.train.mini_batches_per_step = 2  # two PPO mini-batches per rollout batch (decoupled PPO)
    cfg.algorithm.advantage_estimator = "grpo"
    cfg.algorithm.clip_eps_high = 0.28  # DAPO's clip-higher
    cfg.algorithm.filter_groups = True  # DAPO dynamic sampling: drop all-right and all-wrong groups
    # Streaming, one version behind; token-level truncated importance weights correct the
    # engine/trainer mismatch (larger for an MoE: the engine may route a token differently).
    cfg.algorithm.max_staleness = 1
    cfg.algorithm.importance_level = "token"
    cfg.algorithm.importance_mode = "trunc"
    cfg.refit.bucket_megabytes = 512
    cfg.refit.timeout_seconds = 900.0  # ~61 GB of bf16 weights per refit
    return cfg
