"""A task no one here wrote: reasoning-gym's `basic_arithmetic` (two one-digit terms, + and -,
negatives and parentheses, e.g. "Calculate -( 7 - -6 )." -> "-13"), graded by the package's own
`score_answer`, on the CPU demo's tiny generated Qwen3 with GRPO.

`bash launch/reasoning_gym.sh` generates the model and the data (offline, with the package's
generator) into $MOLT_CACHE_DIR/reasoning_gym, warm-starts the model with `sft()`, then runs
`config()`.
"""

import os
from pathlib import Path

from molt.config import MoltConfig

HERE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE_DIR", Path.home() / ".cache" / "molt")) / "reasoning_gym"


def config() -> MoltConfig:
    cfg = MoltConfig(name="reasoning-gym-basic-arithmetic", seed=0, device="cpu")
    cfg.model.path = str(cache_dir() / "model-warm")
    cfg.data.train_path = str(cache_dir() / "data" / "train.jsonl")
    cfg.agent.path = str(HERE / "agents" / "reasoning_gym_task.py")
    cfg.agent.rollout_timeout_seconds = 60.0
    cfg.layout.num_trainer_ranks = 1
    cfg.layout.num_rollout_ranks = 1
    cfg.rollout.prompts_per_step = 16
    cfg.rollout.n_samples_per_prompt = 16
    cfg.rollout.max_response_tokens = 6  # the longest answer, "-18", is 3 tokens; then the end token
    cfg.rollout.max_length = 64  # the longest prompt is 54 tokens in the tiny model's vocabulary
    cfg.rollout.temperature = 1.0
    cfg.rollout.kv_cache_gigabytes = 0.25  # 1 KiB a token: ~262k tokens, 16x a step's 256 x 64
    # Short: in a 300-step run of the four-operator variant the policy stopped exploring after ~120
    # steps (whole groups with one reward, so zero gradient) and neither reward nor eval moved again.
    cfg.train.num_steps = 150
    cfg.train.learning_rate = 5e-4
    cfg.train.max_grad_norm = 1.0
    cfg.train.max_tokens_per_micro_batch = 4096
    cfg.refit.bucket_megabytes = 64
    cfg.refit.check_every_steps = 50
    # The held-out split (no question of it is in train.jsonl): 4 samples of each of its 256 prompts
    # at the start and every 25 steps, logged as eval/avg@4 (mean score) and eval/pass@k (exact).
    cfg.eval.data_path = str(cache_dir() / "data" / "eval.jsonl")
    cfg.eval.every_steps = 25
    cfg.eval.n_samples = 4
    # Streams like the demo: at most one version behind, partial rollout, truncated token weights.
    cfg.algorithm.max_staleness = 1
    cfg.rollout.partial_rollout = True
    cfg.algorithm.importance_level = "token"
    cfg.algorithm.importance_mode = "trunc"
    return cfg


def sft() -> MoltConfig:
    """The supervised warm start, `python -m molt.sft --config configs/reasoning_gym.py:sft`: 160
    steps of 64 training rows (question -> the package's answer) on the generated model, written
    where config() reads its model; as the demo's, it teaches the bare-answer format and a little
    arithmetic, and RL does the rest."""
    cfg = config()
    cfg.name = "reasoning-gym-sft"
    cfg.model.path = str(cache_dir() / "model")
    cfg.sft.data_path = cfg.data.train_path
    cfg.sft.output_dir = str(cache_dir() / "model-warm")
    cfg.sft.num_steps = 160
    cfg.sft.batch_size = 64
    cfg.train.learning_rate = 1e-2
    cfg.train.weight_decay = 0.01
    cfg.train.max_grad_norm = 0.0
    return cfg
