"""Benchmark the trainer side, one figure per function (selected with --figures).

One run prints one JSON line per figure, then the command that produced them:
- loss_head_peak_memory_bytes (--figures loss_head): peak memory of the loss head, forward and
  backward of log-probs plus entropy (their sum is the loss), from final hidden states through the
  LM head: `compute_chunked_logprobs`, against the full-logits computation (hidden @ W.T, upcast,
  / temperature, gather - logsumexp, entropy from softmax) on the same float32 inputs (target
  ratio <= 0.2). Also reports each variant's median seconds (the chunked path recomputes logits).
- trainer_tokens_per_second: real tokens/s through `Learner.train_step` (GRPO, token-level
  truncated importance weights, 1 mini-batch, 1 epoch, packing, float32, no activation
  checkpointing) against a bare FSDP2 loop over the same packed micro-batches and the same weights
  (target ratio >= 0.9). The bare loop is what a hand-written trainer does: the plain Hugging Face
  model (`from_pretrained`, `fully_shard` per decoder layer and the root), full logits, float32
  log_softmax + gather, a policy-gradient loss over the action tokens, backward, grad-norm clipping
  at 1.0 (Molt clips too, at train.max_grad_norm) and AdamW. It uses full logits, not Molt's
  chunked head, because that is the plain loop a user would write; the chunked head's one extra
  LM-head matmul in backward (it recomputes each chunk's logits) is part of what is measured.
  Generated random Qwen3 (--model-hidden etc., cached in $MOLT_CACHE_DIR/bench), one gloo rank in
  this process; --warmup-steps then --train-steps steps of each, alternating, medians.
- packing_padding_share: on the demo's lengths, the share of computed positions that are padding
  (1 - real tokens / positions) of the micro-batches with packing on (value) and off (baseline)
  at the demo's train.max_tokens_per_micro_batch.
- packing_tokens_per_second: real tokens/s through `Learner.train_step` with the demo's config on
  the demo's model size (the "tiny" preset of tools/make_tiny_model.py) with packing on (value)
  and off (baseline), alternating, medians. The demo's lengths: a step of
  rollout.prompts_per_step x n_samples_per_prompt experiences, each a real demo prompt
  (tools/make_demo_data.py) through the tiny tokenizer's chat template (12 tokens) plus a response
  of 1..rollout.max_response_tokens tokens, uniformly (the response length of a stated, not
  sampled, policy). --packing-lengths long_tail draws responses log-normal instead (median 24
  tokens, sigma 1, at most 400), a mix where a few long answers set the padded rows' length.
- gpu_scale (only when named in --figures; needs CUDA, refuses otherwise): a random ~1.1B-parameter
  Qwen3 (hidden 2048, 16 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, vocab
  151936, tied; saved as safetensors to a temp dir and loaded through Molt's sharded loader) on
  one NCCL rank, FSDP2 with float32 master weights, bfloat16 compute, every block checkpointed,
  chunked log-probs (1024-token chunks); --gpu-sequences x --gpu-sequence-tokens (4 x 4096 =
  16K tokens) as one packed micro-batch through `Actor.train_window`, attention as Molt chooses
  it (flash_attention_2 where flash-attn is installed; sdpa, a dense block-diagonal mask over the
  whole packed row, otherwise; --gpu-attention overrides). Three lines:
  gpu_peak_memory_bytes (torch.cuda.max_memory_allocated over the measured windows, against the
  16 bytes/parameter of fp32 weights, gradients and AdamW state), gpu_tokens_per_second, and
  gpu_mfu = model FLOPs/s / 989e12 (H200 dense bf16 peak, --gpu-peak-flops), model FLOPs per
  token = 6 x matmul parameters (all but the input embedding table; the tied table counts once,
  as the LM head) + 12 x layers x heads x head_dim x sequence length for attention (PaLM's
  appendix B count over each sequence's own length, not halved for causality); activation
  recompute and the chunked head's recompute are not counted. --gpu-preset small is a ~85M model
  for smaller GPUs and tests (tests/test_bench_trainer_gpu.py); --gpu-device cpu --gpu-preset tiny
  runs the same code on CPU (tools/gpu_check.py --cpu-smoke; no memory figure, nothing measured).
  Not yet run on a GPU.

The loss head has no allocator statistics on CPU, so each variant runs in a fresh child process
(this file with --measure VARIANT): it allocates the inputs, takes its resident set size as the
baseline, resets the kernel's high-water mark, runs forward + backward and reports VmHWM -
baseline. Variants alternate, --repeats times each, and the medians are reported.

    python tools/bench/trainer.py [--figures loss_head,trainer_tokens_per_second,packing_padding_share,
                                   packing_tokens_per_second] [--threads 1] [--packing-lengths demo|long_tail]
        loss head:  [--tokens 8192] [--vocab 32768] [--hidden 1024] [--chunk-tokens 1024] [--repeats 3]
        trainer:    [--model-hidden 384] [--model-layers 4] [--model-vocab 4096]
                    [--model-intermediate 1152] [--experiences 24] [--micro-batch-tokens 1024]
                    [--warmup-steps 3] [--train-steps 10]
    python tools/bench/trainer.py --figures gpu_scale [--gpu-preset 1b|small] [--gpu-sequences 4]
                                  [--gpu-sequence-tokens 4096] [--gpu-warmup-steps 2] [--gpu-steps 5]
                                  [--gpu-attention auto|sdpa|flash_attention_2] [--gpu-device cuda|cpu]
    python tools/bench/trainer.py --smoke   # CI's tiny setting of the default figures, seconds
"""

import argparse
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # run from anywhere without installing molt

from bench_fixtures import load_test_fixtures, parse_with_smoke  # noqa: E402
from molt.trainer.logprobs import compute_chunked_logprobs  # noqa: E402

# The training figures import transformers and the rest of molt inside their functions: the loss
# head's child processes re-run this file and should start without them.

KIB = 1024
MAX_THREADS = 2  # the bench machine's CPUs are shared with other workers
# Molt's packed layout where attention takes a block-diagonal mask (sdpa on CPU): rows as wide as
# the micro-batch's longest experience (molt.trainer.policy.packing_layout).
CPU_PACKED_LAYOUT = "rows"
LONG_TAIL_MAX_TOKENS = 400
PAD_TOKEN_ID = 0
CPU = torch.device("cpu")
H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA's H200 SXM dense BF16 tensor-core peak (no sparsity)
FP32_TRAINING_BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + AdamW exp_avg and exp_avg_sq
# --smoke (CI, tests/test_bench_smoke.py): every default figure in seconds, on a 1-layer model.
SMOKE_DEFAULTS = dict(tokens=256, vocab=512, hidden=32, chunk_tokens=64, repeats=1, model_hidden=64,
                      model_head_dim=32, model_layers=1, model_intermediate=128, model_vocab=512, experiences=4,
                      warmup_steps=1, train_steps=1)


# -- loss head ----------------------------------------------------------------------------------


def full_loss_head(hidden: Tensor, weight: Tensor, targets: Tensor, args) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy through whole [tokens, vocab] logits, as autograd would keep them."""
    logits = (hidden @ weight.T).float() / args.temperature  # [tokens, vocab]
    logsumexp = logits.logsumexp(-1)  # [tokens]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logsumexp
    entropy = logsumexp - (logits.softmax(-1) * logits).sum(-1)
    return logprobs, entropy


def chunked_loss_head(hidden: Tensor, weight: Tensor, targets: Tensor, args) -> tuple[Tensor, Tensor]:
    return compute_chunked_logprobs(hidden, weight, targets, temperature=args.temperature,
                                    chunk_tokens=args.chunk_tokens, with_entropy=True)


LOSS_HEADS: dict[str, Callable] = {"chunked": chunked_loss_head, "full": full_loss_head}


def build_loss_head_inputs(num_tokens: int, vocab: int, hidden_size: int) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator).mul_(hidden_size ** -0.5).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (num_tokens,), generator=generator)


def run_loss_head(variant: str, inputs: tuple[Tensor, Tensor, Tensor], args) -> float:
    """Seconds of one forward + backward of sum(log-probs) + sum(entropy)."""
    start = time.perf_counter()
    logprobs, entropy = LOSS_HEADS[variant](*inputs, args)
    (logprobs.sum() + entropy.sum()).backward()
    return time.perf_counter() - start


def read_status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS: resident now, VmHWM: its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line; this benchmark needs Linux")


def measure_loss_head(args) -> None:
    """Child process: peak resident bytes above the inputs during one forward + backward."""
    torch.set_num_threads(min(MAX_THREADS, torch.get_num_threads()))
    # Warm-up on small inputs first, so library and thread-pool start-up is in the baseline.
    run_loss_head(args.measure, build_loss_head_inputs(16, 64, 16), args)
    inputs = build_loss_head_inputs(args.tokens, args.vocab, args.hidden)
    baseline_kib = read_status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    seconds = run_loss_head(args.measure, inputs, args)
    peak_kib = read_status_kib("VmHWM")
    print(json.dumps({"peak_bytes": (peak_kib - baseline_kib) * KIB, "seconds": seconds}), flush=True)


def measure_in_child(variant: str, args) -> dict:
    command = [sys.executable, __file__, "--measure", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden),
               "--chunk-tokens", str(args.chunk_tokens), "--temperature", str(args.temperature)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"--measure {variant} exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def loss_head_figure(args) -> list[dict]:
    runs: dict[str, list[dict]] = {"chunked": [], "full": []}
    for _ in range(args.repeats):  # alternate, so load from other processes hits both alike
        for variant in runs:
            runs[variant].append(measure_in_child(variant, args))
    peak = {variant: int(statistics.median(run["peak_bytes"] for run in results)) for variant, results in runs.items()}
    seconds = {variant: statistics.median(run["seconds"] for run in results) for variant, results in runs.items()}
    return [{"figure": "loss_head_peak_memory_bytes", "value": peak["chunked"], "baseline": peak["full"],
             "ratio": round(peak["chunked"] / peak["full"], 3), "target": "<= 0.2",
             "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "chunk_tokens": args.chunk_tokens,
             "dtype": "float32", "repeats": args.repeats,
             "seconds_median": round(seconds["chunked"], 3), "baseline_seconds_median": round(seconds["full"], 3),
             "path": "compute_chunked_logprobs forward + backward of sum(logprobs) + sum(entropy), "
                     "peak RSS above the inputs in a fresh process"}]


# -- shared by the training figures: one rank, a generated model, experiences, timing ----------


def init_single_rank() -> dist.ProcessGroup:
    """This process as the only rank of the default group (an in-process store; NCCL beside gloo
    when CUDA is there, so the GPU figure and the CPU ones can share it)."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def write_random_qwen3(out_dir: Path, sizes: dict, *, dtype: torch.dtype = torch.float32,
                       device: torch.device = CPU, seed: int = 0) -> None:
    """A randomly initialised, tied-embedding Qwen3 as a Hugging Face directory (safetensors)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**sizes, tie_word_embeddings=True, initializer_range=0.02, dtype="float32",
                         bos_token_id=PAD_TOKEN_ID, eos_token_id=PAD_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    torch.manual_seed(seed)
    with torch.device(device):  # the 1B model initialises in seconds on a GPU, minutes on CPU
        model = Qwen3ForCausalLM(config)
    model.to(dtype).save_pretrained(out_dir)


def build_bench_model(args) -> tuple[Path, dict]:
    """The trainer figure's model, generated once into $MOLT_CACHE_DIR/bench (keyed by its sizes)."""
    heads = args.model_hidden // args.model_head_dim
    sizes = dict(vocab_size=args.model_vocab, hidden_size=args.model_hidden, intermediate_size=args.model_intermediate,
                 num_hidden_layers=args.model_layers, num_attention_heads=heads,
                 num_key_value_heads=max(1, heads // 2), head_dim=args.model_head_dim, max_position_embeddings=4096)
    fixtures = load_test_fixtures()
    name = "qwen3-" + "-".join(f"{key}{value}" for key, value in sorted(sizes.items())) + "-seed0"
    path = fixtures.build_cached(fixtures.cache_root() / "bench" / name,
                                 lambda out_dir: write_random_qwen3(out_dir, sizes))
    return path, sizes


def make_experiences(lengths: list[tuple[list[int], int]], *, vocab: int, group_size: int, seed: int) -> list:
    """One experience per (prompt token ids, response length): random response tokens, behaviour
    log-probs near a uniform policy's, rewards 0 or 1, groups of `group_size` consecutive rollouts."""
    from molt.trace.experience import Experience

    rng = random.Random(seed)
    experiences = []
    for rollout_id, (prompt, num_response) in enumerate(lengths):
        action_mask = [0] * len(prompt) + [1] * num_response
        reward = float(rng.random() < 0.5)
        experiences.append(Experience(
            token_ids=prompt + [rng.randrange(1, vocab) for _ in range(num_response)], action_mask=action_mask,
            behavior_logprobs=[-math.log(vocab) + rng.gauss(0, 0.3) if action else 0.0 for action in action_mask],
            policy_versions=[0 if action else -1 for action in action_mask], reward=reward, score=reward,
            group_id=rollout_id // group_size, rollout_id=rollout_id))
    return experiences


def random_prompts(count: int, low: int, high: int, *, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def build_batch_info(experiences: list):
    """What every rank knows of the step's batch; with one rank, it owns every experience."""
    from molt.trainer.learner import BatchInfo

    return BatchInfo(rollout_ids=[e.rollout_id for e in experiences], group_ids=[e.group_id for e in experiences],
                     rewards=[e.reward for e in experiences], own=list(range(len(experiences))))


def build_step_windows(experiences: list, *, max_tokens_per_micro_batch: int, layout: str) -> list[list]:
    """One optimizer window (1 mini-batch) of micro-batches, as molt.trainer.loop builds it on one rank."""
    from molt.trainer.batch import build_windows, count_window_micro_batches

    counts = count_window_micro_batches(experiences, num_windows=1, layout=layout,
                                        max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    return build_windows(experiences, num_windows=1, micro_batch_counts=counts, pad_token_id=PAD_TOKEN_ID,
                         max_tokens_per_micro_batch=max_tokens_per_micro_batch, layout=layout)


def build_learner(cfg, group: dist.ProcessGroup):
    """The actor and learner of `cfg` on CPU, built the way molt.trainer.loop.Trainer builds them."""
    from molt.distributed.parallelize import TrainerMesh
    from molt.trainer.learner import Learner
    from molt.trainer.policy import build_policy

    mesh = TrainerMesh.from_group(group, "cpu")
    policy = build_policy(cfg, mesh=mesh, device=CPU, num_steps=cfg.train.num_steps,
                          temperature=cfg.rollout.temperature, routing_replay=cfg.algorithm.routing_replay)
    if cfg.train.packing and policy.micro_batch_layout == "padded":
        raise RuntimeError("the model does not keep packed sequences apart here; packing figures are meaningless")
    return Learner(cfg, policy.actor, mesh=mesh, device=CPU)


def time_alternating(runs: dict[str, Callable[[], object]], *, warmup: int, measured: int) -> dict[str, list[float]]:
    """Seconds of each run's measured calls, the runs taking turns so machine load hits all alike."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(warmup + measured):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if index >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def count_tokens(windows: list[list]) -> tuple[int, int]:
    """(real tokens, positions the model computes) over the windows' micro-batches."""
    micro_batches = [micro_batch for window in windows for micro_batch in window]
    return (sum(m.num_real_tokens for m in micro_batches), sum(m.num_model_tokens for m in micro_batches))


# -- trainer tokens/s against a bare FSDP2 loop ----------------------------------------------------


def build_bare_model(model_path: Path, group: dist.ProcessGroup, learning_rate: float):
    """The plain Hugging Face model under FSDP2 (one unit per decoder layer and the root), with AdamW."""
    from molt.distributed.parallelize import TrainerMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    # FSDP2 takes a DeviceMesh: the TrainerMesh's FSDP mesh, the one Molt's own learner shards over.
    mesh = TrainerMesh.from_group(group, "cpu").fsdp_mesh
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=learning_rate)


def build_bare_batches(windows: list[list], info) -> list[dict[str, Tensor]]:
    """The packed micro-batches as plain tensors: input_ids and position_ids [packed rows, width], each
    position's target (the next packed token) and its loss weight (that token's GRPO advantage over
    the window's action tokens; 0 where the next token is no action or starts another sequence)."""
    from molt.trainer.batch import compute_group_advantages

    advantages = compute_group_advantages(info.rollout_ids, info.group_ids, info.rewards, estimator="grpo")
    micro_batches = [micro_batch for window in windows for micro_batch in window]
    num_actions = sum(m.num_action_tokens for m in micro_batches)
    batches = []
    for micro_batch in micro_batches:
        inputs = micro_batch.model_inputs()
        row_advantages = torch.tensor([advantages[row] if row >= 0 else 0.0 for row in micro_batch.rows])
        index = micro_batch.packed_index
        real = index >= 0  # -1: a pad at a packed row's end
        token_weights = torch.zeros(index.numel())
        token_weights[real] = (row_advantages[:, None] * micro_batch.action_mask).reshape(-1)[index[real]]
        token_weights = token_weights.view(inputs["input_ids"].shape)  # [packed rows, width]
        weights = torch.cat([token_weights[:, 1:], token_weights.new_zeros(len(token_weights), 1)], dim=1) / num_actions
        batches.append({"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"],
                        "targets": torch.roll(inputs["input_ids"], -1, dims=-1), "weights": weights})
    return batches


def run_bare_step(model, optimizer: torch.optim.Optimizer, batches: list[dict[str, Tensor]], temperature: float,
                  max_grad_norm: float) -> None:
    """Forward with full logits, log_softmax + gather, policy-gradient loss, backward; clip; AdamW."""
    model.train()
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
        logprobs = logprobs.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)  # [packed rows, width]
        (-(logprobs * batch["weights"]).sum()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trainer_config(model_path: Path, args):
    """GRPO with token-level truncated importance weights, 1 mini-batch, 1 epoch, packing, float32."""
    from molt.config import MoltConfig

    cfg = MoltConfig()
    cfg.model.path = str(model_path)
    cfg.model.dtype = "float32"
    cfg.algorithm.advantage_estimator = "grpo"
    cfg.algorithm.importance_level, cfg.algorithm.importance_mode = "token", "trunc"
    cfg.train.packing = True
    cfg.train.max_tokens_per_micro_batch = args.micro_batch_tokens
    cfg.train.learning_rate = 1e-6  # small, so 26 steps on one batch stay finite (a skipped step is faster)
    return cfg


def trainer_tokens_figure(args) -> list[dict]:
    group = init_single_rank()
    model_path, sizes = build_bench_model(args)
    cfg = trainer_config(model_path, args)
    learner = build_learner(cfg, group)
    bare_model, bare_optimizer = build_bare_model(model_path, group, cfg.train.learning_rate)
    prompts = random_prompts(args.experiences, 16, 64, vocab=args.model_vocab, seed=1)
    response_rng = random.Random(2)
    lengths = [(prompt, response_rng.randint(32, 192)) for prompt in prompts]
    experiences = make_experiences(lengths, vocab=args.model_vocab, group_size=8, seed=3)
    info = build_batch_info(experiences)
    windows = build_step_windows(experiences, max_tokens_per_micro_batch=args.micro_batch_tokens,
                                 layout=CPU_PACKED_LAYOUT)
    bare_batches = build_bare_batches(windows, info)
    real_tokens, model_tokens = count_tokens(windows)
    seconds = time_alternating(
        {"molt": lambda: learner.train_step(windows, info),
         "bare": lambda: run_bare_step(bare_model, bare_optimizer, bare_batches, cfg.rollout.temperature,
                                       cfg.train.max_grad_norm)},
        warmup=args.warmup_steps, measured=args.train_steps)
    molt, bare = (statistics.median(seconds[name]) for name in ("molt", "bare"))
    num_params = sum(p.numel() for p in learner.actor.model.parameters())
    return [{"figure": "trainer_tokens_per_second", "value": round(real_tokens / molt, 1),
             "baseline": round(real_tokens / bare, 1), "ratio": round(bare / molt, 3), "target": ">= 0.9",
             "tokens_per_step": real_tokens, "positions_per_step": model_tokens,
             "micro_batches": len(windows[0]), "max_tokens_per_micro_batch": args.micro_batch_tokens,
             "experiences": len(experiences), "model": sizes, "params": num_params, "dtype": "float32",
             "attn_implementation": learner.actor.model.config._attn_implementation,
             "step_seconds_median": round(molt, 3), "baseline_step_seconds_median": round(bare, 3),
             "warmup_steps": args.warmup_steps, "measured_steps": args.train_steps, "threads": torch.get_num_threads(),
             "path": "Learner.train_step (GRPO, token/trunc importance, packing, chunked log-probs)",
             "baseline_path": "plain HF model under FSDP2: full logits, log_softmax + gather, backward, "
                              "clip_grad_norm_, AdamW"}]


# -- packing on the demo's lengths -----------------------------------------------------------------


def demo_config(model_path: Path):
    """configs/demo.py's config() on `model_path` (the generated tiny model: the demo's size)."""
    from molt.config import load_config

    return load_config(str(REPO_ROOT / "configs" / "demo.py"), [f"model.path={model_path}"])


def demo_experiences(cfg, model_path: Path, *, seed: int = 0, long_tail: bool = False) -> list:
    """One demo step: real prompts through the tiny tokenizer's chat template, each group of
    n_samples_per_prompt rollouts with responses of 1..max_response_tokens tokens (uniform)."""
    from transformers import AutoTokenizer

    fixtures = load_test_fixtures()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = [json.loads(line) for line in (fixtures.build_cached_demo_data() / "train.jsonl").read_text().splitlines()]
    rollout = cfg.rollout
    rng = random.Random(seed)
    lengths = []
    for row in rows[:rollout.prompts_per_step]:
        prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)["input_ids"]
        lengths += [(prompt, response_length(rng, rollout.max_response_tokens, long_tail))
                    for _ in range(rollout.n_samples_per_prompt)]
    return make_experiences(lengths, vocab=len(tokenizer), group_size=rollout.n_samples_per_prompt, seed=seed)


def response_length(rng: random.Random, max_response_tokens: int, long_tail: bool) -> int:
    """The demo's 1..max_response_tokens uniform, or a long tail: log-normal with median 24 tokens,
    capped at LONG_TAIL_MAX_TOKENS (an agent whose few long answers set each padded row's length)."""
    if not long_tail:
        return rng.randint(1, max_response_tokens)
    return min(LONG_TAIL_MAX_TOKENS, 1 + int(rng.lognormvariate(math.log(24), 1.0)))


def build_demo_step(args) -> tuple:
    """(demo config, tiny model path, experiences, {packing: windows}) for the packing figures."""
    model_path = load_test_fixtures().build_cached_tiny_model(preset="tiny")
    cfg = demo_config(model_path)
    experiences = demo_experiences(cfg, model_path, long_tail=args.packing_lengths == "long_tail")
    budget = cfg.train.max_tokens_per_micro_batch
    windows = {packing: build_step_windows(experiences, max_tokens_per_micro_batch=budget,
                                           layout=CPU_PACKED_LAYOUT if packing else "padded")
               for packing in (True, False)}
    return cfg, model_path, experiences, windows


def describe_demo_step(cfg, experiences: list, args) -> dict:
    lengths = [e.num_tokens for e in experiences]
    responses = ("1..max_response_tokens response tokens, uniform" if args.packing_lengths == "demo" else
                 f"log-normal response tokens (median 24, sigma 1, at most {LONG_TAIL_MAX_TOKENS})")
    return {"experiences": len(experiences), "tokens_min": min(lengths), "tokens_max": max(lengths),
            "tokens_mean": round(statistics.fmean(lengths), 2),
            "max_tokens_per_micro_batch": cfg.train.max_tokens_per_micro_batch,
            "lengths": f"{args.packing_lengths}: 12-token chat-templated demo prompt + {responses}"}


def packing_padding_figure(args) -> list[dict]:
    cfg, _, experiences, windows = build_demo_step(args)
    shares = {}
    for packing, step_windows in windows.items():
        real_tokens, model_tokens = count_tokens(step_windows)
        shares[packing] = 1.0 - real_tokens / model_tokens
    return [{"figure": "packing_padding_share", "value": round(shares[True], 4), "baseline": round(shares[False], 4),
             "ratio": round(shares[True] / shares[False], 3) if shares[False] else None, "target": None,
             "micro_batches": len(windows[True][0]), "baseline_micro_batches": len(windows[False][0]),
             **describe_demo_step(cfg, experiences, args),
             "path": f"build_windows layout={CPU_PACKED_LAYOUT}", "baseline_path": "build_windows layout=padded"}]


def packing_tokens_figure(args) -> list[dict]:
    group = init_single_rank()
    cfg, _, experiences, windows = build_demo_step(args)
    learner = build_learner(cfg, group)  # one learner: packing is a property of the micro-batches
    info = build_batch_info(experiences)
    real_tokens, model_tokens = count_tokens(windows[True])
    seconds = time_alternating({packing: (lambda w=step_windows: learner.train_step(w, info))
                                for packing, step_windows in windows.items()},
                               warmup=args.warmup_steps, measured=args.train_steps)
    packed, padded = statistics.median(seconds[True]), statistics.median(seconds[False])
    return [{"figure": "packing_tokens_per_second", "value": round(real_tokens / packed, 1),
             "baseline": round(real_tokens / padded, 1), "ratio": round(padded / packed, 3), "target": None,
             "step_seconds_median": round(packed, 4), "baseline_step_seconds_median": round(padded, 4),
             "positions_per_step": model_tokens, "baseline_positions_per_step": count_tokens(windows[False])[1],
             **describe_demo_step(cfg, experiences, args),
             "attn_implementation": learner.actor.model.config._attn_implementation,
             "warmup_steps": args.warmup_steps, "measured_steps": args.train_steps, "threads": torch.get_num_threads(),
             "path": "Learner.train_step, demo config, packed micro-batches",
             "baseline_path": "the same learner on padded micro-batches of the same experiences"}]


# -- one GPU: a ~1B model at 16K tokens -----------------------------------------------------------

GPU_PRESETS: dict[str, dict] = {
    # Qwen3-1.7B's widths with 16 of its 28 layers: ~1.1B parameters (0.31B of them the tied table).
    "1b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    # ~85M parameters, for smaller GPUs and tests/test_bench_trainer_gpu.py.
    "small": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128),
    # ~70k parameters: the figure's code path on CPU in seconds (tools/gpu_check.py --cpu-smoke).
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}


def build_gpu_actor(sizes: dict, args, group: dist.ProcessGroup, device: torch.device):
    """A random Qwen3 saved to a temp dir (bf16 safetensors), loaded by Molt's sharded loader as
    float32 master weights with bfloat16 compute, every block checkpointed, chunked log-probs."""
    from molt.distributed.parallelize import TrainerMesh

    from molt.trainer.actor import Actor
    from molt.trainer.sharded_model import build_actor_model
    from molt.trainer.optimizer import OptimizerSettings
    from molt.distributed.parallelize import ShardingPlan

    plan = ShardingPlan(param_dtype=torch.float32, compute_dtype=torch.bfloat16, checkpoint_every=1)
    mesh = TrainerMesh.from_group(group, device.type)
    with tempfile.TemporaryDirectory(prefix="molt-gpu-scale-") as directory:
        write_random_qwen3(Path(directory), sizes, dtype=torch.bfloat16, device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model = build_actor_model(directory, mesh=mesh, device=device, plan=plan,
                                  logprob_chunk_tokens=args.gpu_chunk_tokens)
    if args.gpu_attention != "auto":  # else Molt's choice (molt.trainer.sharded_model.choose_attention)
        model.set_attn_implementation(args.gpu_attention)
    return Actor(model, group=group, device=device, optimizer=OptimizerSettings(lr=1e-6), max_grad_norm=1.0)


def count_matmul_parameters(model) -> int:
    """Parameters in matmuls: all but the input embedding table (a lookup); a tied table counts
    once, as the LM head."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size
    return total if model.get_output_embeddings().weight is embedding else total - embedding.numel()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CPU ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_scale_figure(args) -> list[dict]:
    """The one-GPU figure; with --gpu-device cpu (the tiny preset, for CI) the same code on CPU,
    where there are no allocator statistics (peak memory is reported as None)."""
    from molt.trainer.actor import PolicyLoss
    from molt.trainer.policy import packing_layout
    from molt.trainer.batch import build_micro_batches

    device = torch.device("cuda", 0) if args.gpu_device == "cuda" else CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_single_rank()
    sizes = dict(GPU_PRESETS[args.gpu_preset], max_position_embeddings=max(4096, args.gpu_sequence_tokens))
    actor = build_gpu_actor(sizes, args, group, device)
    num_tokens = args.gpu_sequences * args.gpu_sequence_tokens
    prompt_tokens = args.gpu_sequence_tokens // 8
    prompts = random_prompts(args.gpu_sequences, prompt_tokens, prompt_tokens, vocab=sizes["vocab_size"], seed=1)
    experiences = make_experiences([(prompt, args.gpu_sequence_tokens - prompt_tokens) for prompt in prompts],
                                   vocab=sizes["vocab_size"], group_size=args.gpu_sequences, seed=2)
    advantages = [float(index % 2) - 0.5 for index in range(len(experiences))]
    micro_batches = [m.to(device) for m in build_micro_batches(
        experiences, advantages, max_tokens_per_micro_batch=num_tokens, pad_token_id=PAD_TOKEN_ID,
        layout=packing_layout(actor.model))]
    loss = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, importance=("token", "trunc", 0.5, 2.0))
    for _ in range(args.gpu_warmup_steps):  # the first step also allocates AdamW's state
        actor.train_window(micro_batches, loss)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, stepped = [], []
    for _ in range(args.gpu_steps):
        start = time.perf_counter()
        result = actor.train_window(micro_batches, loss)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        stepped.append(result.stepped)
    step_seconds = statistics.median(seconds)
    tokens_per_second = num_tokens / step_seconds
    num_params = sum(p.numel() for p in actor.model.parameters())
    linear_flops = 6 * count_matmul_parameters(actor.model)
    attention_flops = 12 * sizes["num_hidden_layers"] * sizes["num_attention_heads"] * sizes["head_dim"] * \
        args.gpu_sequence_tokens
    model_flops = (linear_flops + attention_flops) * tokens_per_second
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    static_bytes = FP32_TRAINING_BYTES_PER_PARAMETER * num_params
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke: no GPU figures)"
    common = {"gpu": gpu_name, "preset": args.gpu_preset, "params": num_params,
              "model": sizes, "tokens_per_step": num_tokens, "sequences": args.gpu_sequences,
              "sequence_tokens": args.gpu_sequence_tokens, "micro_batches": len(micro_batches),
              "param_dtype": "float32", "compute_dtype": "bfloat16", "checkpoint_every": 1,
              "logprob_chunk_tokens": args.gpu_chunk_tokens,
              "attn_implementation": actor.model.config._attn_implementation,
              "warmup_steps": args.gpu_warmup_steps, "measured_steps": args.gpu_steps, "all_stepped": all(stepped),
              "path": "Actor.train_window, one packed micro-batch, FSDP2 on 1 "
                      + ("NCCL" if device.type == "cuda" else "gloo") + " rank"}
    return [
        {"figure": "gpu_peak_memory_bytes", "value": peak_bytes, "baseline": static_bytes,
         "ratio": None if peak_bytes is None else round(peak_bytes / static_bytes, 3), "target": None,
         "baseline_path": "16 bytes/parameter: fp32 weights, gradients, AdamW exp_avg and exp_avg_sq", **common},
        {"figure": "gpu_tokens_per_second", "value": round(tokens_per_second, 1), "baseline": None, "ratio": None,
         "target": None, "step_seconds_median": round(step_seconds, 6),
         "step_seconds": [round(s, 6) for s in seconds], **common},
        {"figure": "gpu_mfu", "value": round(model_flops / args.gpu_peak_flops, 6), "baseline": args.gpu_peak_flops,
         "ratio": round(model_flops / args.gpu_peak_flops, 6), "target": None,
         "mfu_without_attention": round(linear_flops * tokens_per_second / args.gpu_peak_flops, 6),
         "flops_per_token": linear_flops + attention_flops, "attention_flops_per_token": attention_flops,
         "flops_count": "6 x matmul params (all but the input embedding table; the tied table once, as the LM head) "
                        "+ 12 x layers x heads x head_dim x sequence length (PaLM appendix B, each sequence's "
                        "own length, not halved for causality); no recompute counted",
         "peak_flops": "H200 dense BF16 989e12 unless --gpu-peak-flops", **common},
    ]


FIGURES: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "loss_head": loss_head_figure,
    "trainer_tokens_per_second": trainer_tokens_figure,
    "packing_padding_share": packing_padding_figure,
    "packing_tokens_per_second": packing_tokens_figure,
    "gpu_scale": gpu_scale_figure,
}
DEFAULT_FIGURES = [name for name in FIGURES if name != "gpu_scale"]  # gpu_scale needs CUDA and minutes


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", default=",".join(DEFAULT_FIGURES),
                        help=f"comma-separated figures to run, from {', '.join(FIGURES)} (default: all but gpu_scale)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training figures")
    parser.add_argument("--tokens", type=int, default=8192, help="loss head: tokens in the batch")
    parser.add_argument("--vocab", type=int, default=32768, help="loss head: vocabulary size")
    parser.add_argument("--hidden", type=int, default=1024, help="loss head: hidden size")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="loss head: tokens per chunk")
    parser.add_argument("--temperature", type=float, default=1.0, help="loss head: sampling temperature")
    parser.add_argument("--repeats", type=int, default=3, help="loss head: fresh-process measurements per variant")
    parser.add_argument("--model-hidden", type=int, default=384, help="trainer: hidden size of the generated Qwen3")
    parser.add_argument("--model-head-dim", type=int, default=64, help="trainer: attention head size")
    parser.add_argument("--model-layers", type=int, default=4, help="trainer: decoder layers")
    parser.add_argument("--model-intermediate", type=int, default=1152, help="trainer: MLP intermediate size")
    parser.add_argument("--model-vocab", type=int, default=4096, help="trainer: vocabulary size")
    parser.add_argument("--experiences", type=int, default=24, help="trainer: experiences per step")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="trainer: max_tokens_per_micro_batch")
    parser.add_argument("--packing-lengths", choices=("demo", "long_tail"), default="demo",
                        help="packing: the demo's response lengths, or a long-tailed distribution")
    parser.add_argument("--warmup-steps", type=int, default=3, help="trainer, packing: unmeasured steps of each")
    parser.add_argument("--train-steps", type=int, default=10, help="trainer, packing: measured steps of each")
    parser.add_argument("--gpu-preset", choices=sorted(GPU_PRESETS), default="1b", help="gpu_scale: model size")
    parser.add_argument("--gpu-sequences", type=int, default=4, help="gpu_scale: sequences packed in the micro-batch")
    parser.add_argument("--gpu-sequence-tokens", type=int, default=4096, help="gpu_scale: tokens per sequence")
    parser.add_argument("--gpu-chunk-tokens", type=int, default=1024, help="gpu_scale: train.logprob_chunk_tokens")
    parser.add_argument("--gpu-attention", default="auto",
                        help="gpu_scale: Hugging Face attention implementation; auto = Molt's choice "
                             "(flash_attention_2 where flash-attn is installed: each packed sequence on its own; "
                             "else sdpa, which masks the whole packed row densely)")
    parser.add_argument("--gpu-warmup-steps", type=int, default=2, help="gpu_scale: unmeasured windows")
    parser.add_argument("--gpu-steps", type=int, default=5, help="gpu_scale: measured windows")
    parser.add_argument("--gpu-peak-flops", type=float, default=H200_BF16_DENSE_FLOPS,
                        help="gpu_scale: the accelerator's dense bf16 peak FLOP/s for the MFU")
    parser.add_argument("--gpu-device", choices=("cuda", "cpu"), default="cuda",
                        help="gpu_scale: cpu runs the figure's code on CPU (with --gpu-preset tiny: CI's smoke "
                             "of tools/gpu_check.py); its figures mean nothing there")
    parser.add_argument("--measure", choices=sorted(LOSS_HEADS), help=argparse.SUPPRESS)  # the child
    args = parse_with_smoke(parser, SMOKE_DEFAULTS)
    figures = args.figures.split(",")
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figures {unknown}; choose from {sorted(FIGURES)}")
    if "gpu_scale" in figures and args.gpu_device == "cuda" and not torch.cuda.is_available():
        parser.error("gpu_scale needs a CUDA device and torch.cuda.is_available() is False here; run it on a "
                     "GPU machine, or leave it out of --figures")
    return args


def main() -> None:
    args = parse_args()
    if args.measure:
        measure_loss_head(args)
        return
    torch.set_num_threads(args.threads)
    for figure in args.figures.split(","):
        for record in FIGURES[figure](args):
            emit(record)
    emit({"command": "python " + shlex.join(sys.argv)})
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
