"""A 1T-parameter MoE (the shape of Kimi K2 as DeepseekV3ForCausalLM: 1.03T parameters, 33B
active) on 24 nodes x 8 GPUs: 128 FSDP2 trainer ranks on nodes 0-15, 8 vLLM engines of tensor
parallel 8 on nodes 16-23 (one rollout rank per node; vLLM's workers take its 8 GPUs).

Bring a bf16 checkpoint of this architecture as $MOLT_CHECKPOINTS/moe-1t and the math data as in
configs/qwen3_30b_a3b_math_tool.py. `--dry-run` reads the architecture from configs/hf/moe-1t.

Why these numbers: Molt's engines are single-node and serve model.dtype unquantized, so one engine
holds 1.03T x 2 bytes / 8 = ~239 GiB per GPU: this needs 288 GB (268 GiB) GPUs (B300 class); on
141 GB H200s --dry-run fails naming layout.gpu_memory_gigabytes. Trainer ranks keep float32 master
weights, gradients and AdamW states (16 bytes/param) sharded 128 ways (~120 GiB) and gather one
17B-parameter MoE block in bf16 at a time (with its float32 gradient on the way to the
reduce-scatter, ~95 GiB); 64 ranks would need ~240 GiB for the state alone. Nodes run different
numbers of processes (8 trainers, or one engine process), which torchrun cannot start: launch it
with launch/slurm_srun.sbatch (--dry-run prints the command and the per-node task counts).
"""

import os
from pathlib import Path

from molt.config import MoltConfig

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path(os.environ.get("MOLT_CHECKPOINTS", "/checkpoints"))
DATA = Path(os.environ.get("MOLT_DATA", "/data"))


def config() -> MoltConfig:
    cfg = MoltConfig(name="moe-1t-math-tool", seed=0, device="cuda")
    cfg.model.path = str(CHECKPOINTS / "moe-1t")
    cfg.model.config_path = str(HERE / "hf" / "moe-1t")
    cfg.model.dtype = "bfloat16"
    cfg.data.train_path = str(DATA / "math" / "train.jsonl")
    cfg.agent.path = str(HERE / "agents" / "math_tool_openai.py")
    cfg.agent.rollout_timeout_seconds = 1800.0
    cfg.agent.max_concurrent_rollouts = 512
    cfg.layout.num_trainer_ranks = 128
    cfg.layout.num_rollout_ranks = 8
    cfg.layout.engine_tensor_parallel_size = 8
    cfg.layout.gpus_per_node = 8
    cfg.layout.gpu_memory_gigabytes = 268
    cfg.rollout.prompts_per_step = 128
    cfg.rollout.n_samples_per_prompt = 16
    cfg.rollout.max_response_tokens = 4096
    cfg.rollout.max_length = 16384
    cfg.rollout.kv_cache_gigabytes = 10  # per GPU, beside ~240 GiB of weights: the (small, MLA) KV cache
    cfg.rollout.enforce_eager = False
    cfg.rollout.num_agent_workers = 8
    cfg.train.num_steps = 300
    cfg.train.learning_rate = 5e-7
    cfg.train.weight_decay = 0.01
    cfg.train.max_grad_norm = 1.0
    cfg.train.max_tokens_per_micro_batch = 16384
    cfg.train.param_dtype = "float32"  # master weights and AdamW state; bf16 forward/backward
    cfg.train.compute_dtype = "bfloat16"
    cfg.train.activation_checkpointing = "full"
    cfg.train.logprob_chunk_tokens = 1024
    cfg.train.lr_schedule = "cosine"
    cfg.train.warmup_steps = 10
    cfg.train.min_lr_ratio = 0.1
    cfg.train.no_weight_decay_on = ("norms", "biases", "embeddings")
    cfg.algorithm.advantage_estimator = "grpo"
    cfg.algorithm.clip_eps_high = 0.28
    cfg.algorithm.filter_groups = True
    cfg.algorithm.max_staleness = 1
    cfg.algorithm.importance_level = "token"
    cfg.algorithm.importance_mode = "trunc"
    cfg.refit.bucket_megabytes = 1024
    cfg.refit.timeout_seconds = 3600.0  # ~2 TB of bf16 weights per refit
    return cfg
