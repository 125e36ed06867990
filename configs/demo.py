"""The CPU demo: a generated 2-layer Qwen3 learns one-digit addition with GRPO, streaming (max
staleness 1, partial rollout, token-level truncated importance correction).

`bash launch/demo.sh` generates the model, data and warm start into $MOLT_CACHE_DIR and runs
`config()`. Variants below change a few fields of it.
"""

import os
from pathlib import Path

from molt.config import MoltConfig

HERE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE_DIR", Path.home() / ".cache" / "molt"))


def config() -> MoltConfig:
    cfg = MoltConfig(name="demo", seed=0, device="cpu")
    cfg.model.path = str(cache_dir() / "demo" / "model-warm")
    cfg.data.train_path = str(cache_dir() / "demo" / "data" / "train.jsonl")
    cfg.agent.path = str(HERE / "agents" / "addition.py")
    cfg.agent.rollout_timeout_seconds = 60.0
    cfg.layout.num_trainer_ranks = 1
    cfg.layout.num_rollout_ranks = 1
    cfg.rollout.prompts_per_step = 16
    cfg.rollout.n_samples_per_prompt = 16
    cfg.rollout.max_response_tokens = 4
    cfg.rollout.max_length = 64
    cfg.rollout.temperature = 1.0
    # The tiny model's KV cache takes 1 KiB a token: 256 MiB hold ~262k tokens, 16x a step's 256 x 64.
    cfg.rollout.kv_cache_gigabytes = 0.25
    cfg.train.num_steps = 400
    # What took the held-out avg@4 from 0.69 to 0.9+ in 400 steps (docs/demo.md has the runs): a
    # warm start that leaves the policy unsure rather than wrong (sft() below), a learning rate of
    # 1e-3 with warmup and cosine decay, and dropping the groups whose 16 samples all agree (DAPO's
    # dynamic sampling), so the token mean is not diluted by the solved prompts.
    cfg.train.learning_rate = 1e-3
    cfg.train.lr_schedule = "cosine"
    cfg.train.warmup_steps = 10
    cfg.train.min_lr_ratio = 0.1
    cfg.train.max_grad_norm = 1.0
    cfg.train.max_tokens_per_micro_batch = 4096
    cfg.refit.bucket_megabytes = 64
    cfg.refit.check_every_steps = 50
    # Streaming: the next step's rollouts run while the trainer trains (at most one version behind),
    # requests in flight at a refit continue under the new weights, and the trainer corrects for the
    # older behaviour policy token by token (truncated importance weights).
    cfg.algorithm.max_staleness = 1
    cfg.rollout.partial_rollout = True
    cfg.algorithm.importance_level = "token"
    cfg.algorithm.importance_mode = "trunc"
    cfg.algorithm.filter_groups = True
    # Held-out evaluation (docs/evaluation.md): avg@4 and pass@4 over eval.jsonl, each of the 100
    # one-digit sums once (the task's whole space, so the same problems training draws from), at
    # step 0 and every 50 steps, sampled at temperature 0.6 (a sharper read of what the policy
    # knows than training's 1.0, while the 4 samples of a prompt still differ).
    cfg.eval.every_steps = 50
    cfg.eval.data_path = str(cache_dir() / "demo" / "data" / "eval.jsonl")
    cfg.eval.n_samples = 4
    cfg.eval.temperature = 0.6
    return cfg


def two_trainers() -> MoltConfig:
    """2 FSDP2 trainer ranks + 1 rollout rank (3 processes)."""
    cfg = config()
    cfg.layout.num_trainer_ranks = 2
    return cfg


def moe() -> MoltConfig:
    """The demo on the tiny Qwen3-MoE (2 layers of 4 experts, top 2), warm-started the same way (plus
    the routers' load-balancing loss): `MOLT_DEMO_RECIPE=configs/demo.py:moe bash launch/demo.sh`.
    The refit check runs every 50 steps as in the demo, so a refit that missed an expert shows."""
    cfg = config()
    cfg.name = "demo-moe"
    cfg.model.path = str(cache_dir() / "demo" / "model-moe-warm")
    return cfg  # streams like the demo: max_staleness 1, partial rollout, truncated token weights


def multi_turn() -> MoltConfig:
    """The two-turn retry Env."""
    cfg = config()
    cfg.name = "demo-multi-turn"
    cfg.agent.path = str(HERE / "agents" / "addition_retry.py")
    cfg.agent.max_turns = 2
    cfg.rollout.max_length = 96
    return cfg


def tool_agent() -> MoltConfig:
    """A ChatAgent that may call a calculator tool through the OpenAI SDK (one or two turns)."""
    cfg = config()
    cfg.name = "demo-tool-openai"
    cfg.model.path = str(cache_dir() / "demo" / "model-tool-warm")
    cfg.agent.path = str(HERE / "agents" / "addition_tool_openai.py")
    cfg.rollout.prompts_per_step = 8
    cfg.rollout.n_samples_per_prompt = 8
    cfg.rollout.max_response_tokens = 24
    cfg.rollout.max_length = 512
    cfg.train.learning_rate = 3e-4
    cfg.train.num_steps = 300
    return cfg  # streams like the demo: max_staleness 1, partial rollout, truncated token weights


def tool_agent_anthropic() -> MoltConfig:
    """The same agent loop through the Anthropic SDK."""
    cfg = tool_agent()
    cfg.name = "demo-tool-anthropic"
    cfg.agent.path = str(HERE / "agents" / "addition_tool_anthropic.py")
    return cfg


def sft() -> MoltConfig:
    """The demo's supervised warm start, `python -m molt.sft --config configs/demo.py:sft` (launch/
    prepare_demo.sh runs it): 100 steps of 64 prompt -> sum rows (the label as the answer) on the
    generated model, written where config() reads its model. A from-scratch policy on a 320-token
    vocabulary almost never emits a bare number, so RL would have no signal to climb; this teaches
    the answer format and some arithmetic (held-out avg@4 ~0.4 at temperature 0.6), with clipped
    gradients and a cosine decay: the earlier 160 unclipped steps at a constant 1e-2 left some sums
    confidently wrong, which sampling then almost never corrects, and RL stalled near 0.78."""
    cfg = config()
    cfg.name = "demo-sft"
    cfg.model.path = str(cache_dir() / "demo" / "model")
    cfg.sft.data_path = cfg.data.train_path
    cfg.sft.output_dir = str(cache_dir() / "demo" / "model-warm")
    cfg.sft.num_steps = 100
    cfg.sft.batch_size = 64
    cfg.train.learning_rate = 5e-3
    cfg.train.lr_schedule = "cosine"
    cfg.train.warmup_steps = 0
    cfg.train.min_lr_ratio = 0.0
    cfg.train.weight_decay = 0.01
    cfg.train.max_grad_norm = 1.0
    return cfg


def _former_warm_start(cfg: MoltConfig) -> MoltConfig:
    """The settings the MoE and tool demos' figures were measured with: 160 unclipped steps at a
    constant 1e-2."""
    cfg.sft.num_steps = 160
    cfg.train.learning_rate = 1e-2
    cfg.train.lr_schedule = "constant"
    cfg.train.max_grad_norm = 0.0
    return cfg


def sft_moe() -> MoltConfig:
    """The warm start of the tiny Qwen3-MoE for moe(), with its routers' load-balancing loss (the
    model config's router_aux_loss_coef): without it the routers collapse within these steps (one
    expert of layer 1 never chosen) and the answer loss ends twice as high."""
    cfg = _former_warm_start(sft())
    cfg.name = "demo-sft-moe"
    cfg.model.path = str(cache_dir() / "demo" / "model-moe")
    cfg.sft.output_dir = str(cache_dir() / "demo" / "model-moe-warm")
    return cfg


def sft_tool() -> MoltConfig:
    """The tool demo's warm start (launch/demo_tool.sh), from sft()'s model: 200 steps on the demo
    rows with the calculator tool in the prompt, half of them calling it and answering with its
    result (tools/make_tool_chats.py writes them), at a lower learning rate."""
    cfg = _former_warm_start(sft())
    cfg.name = "demo-sft-tool"
    cfg.model.path = str(cache_dir() / "demo" / "model-warm")
    cfg.sft.data_path = str(cache_dir() / "demo" / "data" / "tool_chats.jsonl")
    cfg.sft.output_dir = str(cache_dir() / "demo" / "model-tool-warm")
    cfg.sft.num_steps = 200
    cfg.train.learning_rate = 3e-3
    return cfg


def vision() -> MoltConfig:
    """Images (docs/images.md): the tiny Idefics3 (tools/make_tiny_model.py --preset vlm) reads a
    one-digit sum drawn as a 128x64 PNG (tools/make_vision_data.py) and writes it out with its
    result, "a+b=s", through the OpenAI SDK (configs/agents/vision_sum_openai.py: reward 1 for the
    exact equation), warm-started by sft_vision() then sft_vision_unsure();
    `MOLT_DEMO_RECIPE=configs/demo.py:vision bash launch/demo.sh`. Streams like the demo."""
    cfg = config()
    cfg.name = "demo-vision"
    data = cache_dir() / "demo" / "data-vision"
    cfg.model.path = str(cache_dir() / "demo" / "model-vlm-warm")
    cfg.data.train_path = str(data / "train.jsonl")
    cfg.eval.data_path = str(data / "eval.jsonl")
    cfg.agent.path = str(HERE / "agents" / "vision_sum_openai.py")
    cfg.rollout.max_response_tokens = 8  # "a+b=s" and the end of turn
    cfg.rollout.max_length = 128  # the 61-token prompt (12 image tokens) and the reply
    # 8 samples a prompt and at most 8 backfill prompts a step: rollouts through the SDK are most of
    # a step here (~100 a second on 2 cores), and once most groups are solved, backfilling up to the
    # demo's 32 prompts made steps 1.5x longer; this fits 250 steps in ~9 minutes.
    cfg.rollout.n_samples_per_prompt = 8
    cfg.algorithm.max_backfill_prompts = 8
    cfg.train.num_steps = 250
    return cfg


# The warm start's finding (docs/images.md; measured on the tiny VLM before its vision LayerNorms
# started at one): at one rate for the whole model, whether the randomly initialised vision tower
# started telling the digits apart within the warm start depended on the seed; at 3x the text
# tower's rate for the vision tower and connector, both seeds tried did.
VISION_LR_MULTIPLIERS = {"model.vision_model.": 3.0, "model.connector.": 3.0}


def sft_vision() -> MoltConfig:
    """vision()'s warm start, first part, `python -m molt.sft --config configs/demo.py:sft_vision`:
    1200 steps of 64 image rows with the reply "a+b=s" (the digit tokens train the vision tower
    directly), at 3e-3 with a cosine decay, the vision tower and connector at 3x; ~6 min on one core.
    The loss sits on a plateau (~1.1: digits at chance) until the vision tower starts telling them
    apart, after 150 to 550+ steps depending on the schedule and the prompt text, so the run is long
    enough to get past it and learn the sums (docs/images.md). Its model reads the digits and knows
    most sums: too sure for RL to show much."""
    cfg = sft()
    cfg.name = "demo-sft-vision"
    data = cache_dir() / "demo" / "data-vision"
    cfg.model.path = str(cache_dir() / "demo" / "model-vlm")
    cfg.sft.data_path = str(data / "sft.jsonl")
    cfg.sft.output_dir = str(cache_dir() / "demo" / "model-vlm-read")
    cfg.sft.num_steps = 1200
    cfg.train.learning_rate = 3e-3
    cfg.train.lr_multipliers = dict(VISION_LR_MULTIPLIERS)
    return cfg


def sft_vision_unsure() -> MoltConfig:
    """The warm start's second part, from sft_vision()'s model: 400 steps at 1e-3 on the same rows
    whose result is right in 40% of them and 1 or 2 off in the rest (sft_unsure.jsonl). The policy
    keeps reading the digits but is unsure of each sum, as the text demo's short warm start leaves it;
    RL then finds which of its candidates the reward pays."""
    cfg = sft_vision()
    cfg.name = "demo-sft-vision-unsure"
    cfg.model.path = str(cache_dir() / "demo" / "model-vlm-read")
    cfg.sft.data_path = str(cache_dir() / "demo" / "data-vision" / "sft_unsure.jsonl")
    cfg.sft.output_dir = str(cache_dir() / "demo" / "model-vlm-warm")
    cfg.sft.num_steps = 400
    cfg.train.learning_rate = 1e-3
    return cfg
