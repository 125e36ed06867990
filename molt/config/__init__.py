"""Run configuration: dataclass sections, Python recipes, `--set` overrides, start-up validation.

A recipe is a function in `configs/<name>.py` returning a fresh `MoltConfig`. The command line
names it with `--config PATH[:FUNCTION]` (default function `config`) and changes fields with
repeatable `--set section.field=value`, type-checked against the dataclasses.

`python -m molt.config --config configs/demo.py [--set ...]` prints the resolved config.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from molt.config.engine_args import engine_args_errors


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and the fix."""


class ConfigSection:
    """Base of every config dataclass: assigning a name that is not a field fails, so a recipe typo
    (`cfg.train.lerning_rate = 1e-4`) is refused instead of kept as an attribute nothing reads."""

    def __setattr__(self, name: str, value) -> None:
        if name not in self.__dataclass_fields__:
            raise ConfigError(_unknown_field_message(type(self), name))
        object.__setattr__(self, name, value)


@dataclass(kw_only=True)
class ModelConfig(ConfigSection):
    path: str = ""
    """Hugging Face model directory used by the trainer and the engines."""
    dtype: str = "float32"
    """Parameter dtype on trainer and engines: float32 | bfloat16 | float16."""
    config_path: str = ""
    """--dry-run only: a Hugging Face config.json (or its directory) describing model.path's
    architecture, read when model.path has no config.json on this machine ('' = none); no weights."""


@dataclass(kw_only=True)
class LayoutConfig(ConfigSection):
    num_trainer_ranks: int = 1
    """Ranks 0..T-1 train (FSDP2 data-parallel); the rest host one vLLM engine each."""
    num_rollout_ranks: int = 1
    """Ranks T..T+R-1; T + R must equal the torchrun world size."""
    engine_tensor_parallel_size: int = 1
    """Devices per engine: vLLM's tensor-parallel workers, each its own refit rank. On CPU the engine's
    workers take one core each (VLLM_CPU_OMP_THREADS_BIND, set by Molt when unset)."""
    trainer_data_parallel_replicate: int = 1
    """HSDP: replicas of the sharded trainer model (each holds a full FSDP2 copy sharded over
    num_trainer_ranks / (replicate x tensor x context parallel) ranks; gradients are all-reduced
    across replicas). 1 = plain FSDP2."""
    trainer_tensor_parallel_size: int = 1
    """Tensor parallelism inside each trainer data-parallel rank (Megatron-style column/row-wise
    attention and MLP, sequence-parallel norms); the ranks of one tensor-parallel group train on the
    same micro-batches. Must divide num_trainer_ranks and the model's attention and KV heads."""
    trainer_context_parallel_size: int = 1
    """Context parallelism (GPU only): each sequence split over this many ranks for attention."""
    trainer_expert_parallel_size: int = 1
    """MoE: each MoE layer's experts split over this many trainer ranks, taken from the dp_shard ranks
    (tokens reach their experts by all-to-all); must divide dp_shard and the model's num_experts,
    with trainer_tensor_parallel_size=1. 1 = every rank holds FSDP2 shards of all experts."""
    gpus_per_node: int = 8
    """GPUs per node: --dry-run places the ranks in order on nodes of this size (a trainer rank on
    one GPU, a rollout rank on its engine's engine_tensor_parallel_size GPUs, all on one node)."""
    gpu_memory_gigabytes: float = 0.0
    """Memory of one GPU in GiB, for --dry-run's check that each trainer rank's shards and each
    engine's weights fit (0 = skip the check)."""
    colocate: bool = False
    """Trainer ranks and engines share GPUs (one node): engine i takes the GPUs of trainer ranks
    i x engine_tensor_parallel_size onwards, so num_rollout_ranks x engine_tensor_parallel_size must
    equal num_trainer_ranks. On a GPU the engine takes rollout.engine_memory_fraction of it and refit
    goes over gloo (NCCL refuses two ranks on one GPU). False: every engine has GPUs of its own."""


@dataclass(kw_only=True)
class DataConfig(ConfigSection):
    train_path: str = ""
    """Chat-format prompts, .jsonl or .parquet."""
    shuffle: bool = True
    """Shuffle the prompt stream each epoch (seeded by `seed`)."""


@dataclass(kw_only=True)
class AgentConfig(ConfigSection):
    path: str = ""
    """Python file defining `AgentRunner` (a StepEnvRunner or ChatAgentRunner subclass)."""
    max_turns: int = 1
    """Most Env steps per rollout; the rollout is truncated after it."""
    rollout_timeout_seconds: float = 300.0
    """Wall-clock limit of one rollout; past it the rollout fails with reason 'timeout'."""
    on_failed_rollout: str = "drop_group"
    """What a failed rollout does to its group: drop_group (drop the whole group) | refill (re-run it)."""
    max_refills_per_group: int = 2
    """refill only: replacement rollouts one group may get; a group needing more is dropped."""
    max_failed_steps: int = 3
    """Consecutive steps in which every rollout failed before the job stops, naming the most common
    failure and an example, instead of training on nothing (0 = never stop)."""
    max_concurrent_rollouts: int = 256
    """Rollouts one rollout rank runs at a time, over all its agent workers (the rank holds the rest
    back and hands each to the worker with the fewest in flight)."""
    endpoint_host: str = "127.0.0.1"
    """Interface the ChatAgent session endpoint binds to (loopback: agents run on the same node)."""
    image_root: str = ""
    """ChatAgents: a directory whose image files requests may name by path (an image_url part whose
    url is a path or file:// URL under it); "" = local paths are refused, images come as data URIs."""
    on_context_exhausted: str = "train_truncated"
    """ChatAgents: a request whose conversation no longer fits rollout.max_length gets the API's
    context-length error; then train_truncated keeps the segments captured so far, marked truncated,
    with the agent's reward (context_exhausted_reward if the agent raised) | fail (the rollout fails)."""
    context_exhausted_reward: float = 0.0
    """train_truncated only: the reward of a rollout whose agent raised after its context was exhausted."""
    share_tls_context: bool = True
    """ChatAgents: SDK clients built per rollout share one default TLS context instead of loading the
    CA bundle each time (~30-50 ms of CPU per client; see molt/agents/tls.py)."""


# Each engine worker's KV cache when neither rollout.kv_cache_gigabytes nor engine_memory_fraction is set,
# on CPU: vLLM's CPU backend sizes by bytes, and a share of a NUMA node's memory varies from machine to machine.
DEFAULT_KV_CACHE_GIGABYTES = 1.0
# The share of its own GPU an engine fills when neither is set (vLLM 0.32's CacheConfig default is 0.92;
# 0.9 leaves the refit's NCCL buffers room).
DEFAULT_GPU_ENGINE_MEMORY_FRACTION = 0.9
# Engine start limit when rollout.engine_start_timeout_seconds is 0 (auto): a fixed part for the
# process, compilation and CUDA graph capture, plus a read time per GiB of checkpoint for each engine
# reading it at once from one node's storage (~0.8 GiB/s a node: 8 engines x 57 GiB of Qwen3-30B-A3B
# take ~570 s).
ENGINE_START_BASE_SECONDS = 300.0
ENGINE_START_SECONDS_PER_GIGABYTE = 1.25


@dataclass(kw_only=True)
class RolloutConfig(ConfigSection):
    prompts_per_step: int = 8
    """Prompts per optimizer step; each becomes a group of n_samples_per_prompt rollouts."""
    n_samples_per_prompt: int = 8
    """Rollouts per prompt (the group size of group advantage estimators)."""
    max_response_tokens: int = 64
    """max_tokens of each generation."""
    max_length: int = 1024
    """Longest token sequence of one segment (prompt + context + responses)."""
    temperature: float = 1.0
    """Sampling temperature, and a ChatAgent request's default; the trainer recomputes each token's
    log-prob at the temperature it was sampled at (a request may set its own)."""
    top_p: float = 1.0
    """Nucleus sampling mass; must be 1.0: the trainer recomputes log-probs over the full vocabulary."""
    tool_call_parser: str = "hermes"
    """ChatAgents: how tool calls are read from replies: hermes (the <tool_call> blocks of Qwen and
    Hermes templates, parsed as they stream) or a vLLM tool parser's name (llama3_json, mistral,
    deepseek_v3, pythonic, ...; applied to the whole reply) for templates of other families."""
    kv_cache_gigabytes: float = 0.0
    """KV cache of each engine worker in GiB (vLLM kv_cache_memory_bytes; a tensor-parallel engine has
    one worker per device), on CPU and GPU alike; the weights and activations come on top. 0 = unset:
    engine_memory_fraction sizes the engine, or, if that is unset too, 1 GiB on CPU
    (DEFAULT_KV_CACHE_GIGABYTES) and 0.9 of the GPU on GPUs (engine_memory). Not with layout.colocate
    on GPUs."""
    engine_memory_fraction: float = 0.0
    """vLLM gpu_memory_utilization: the share of a GPU an engine worker fills (weights, activations,
    KV cache), or on CPU of the NUMA node's memory (less the engine process's own); 0 = unset. Set
    this or kv_cache_gigabytes, not both; required with layout.colocate on GPUs (the trainer rank
    on the same GPU has the rest)."""
    engine_args: dict[str, object] = field(default_factory=dict)
    """More vLLM engine arguments (AsyncEngineArgs names: enable_prefix_caching, max_num_seqs,
    speculative_config, quantization, compilation_config, ...), passed through as given. Names Molt
    sets from its own fields are refused, naming the field."""
    engine_threads: int = 0
    """CPU only: OpenMP threads of each engine (0 = vLLM's default)."""
    engine_start_timeout_seconds: float = 0.0
    """Longest wait for the engines to come up; 0 = auto: 300 s + 1.25 s per GiB of model.path's
    weight files for each engine of a node reading them at once (engine_start_limit_seconds)."""
    enforce_eager: bool | None = None
    """Skip CUDA graph capture / compilation (faster start, slower decode); None = auto: eager on CPU,
    CUDA graphs on GPUs (resolve_enforce_eager)."""
    sleep_while_training: bool = False
    """GPU only, with layout.colocate and algorithm.max_staleness=0: each engine sleeps (vLLM sleep
    mode level 1: weights to host memory, KV cache freed) while the trainer steps, and wakes before
    the refit or its next request, so the trainer rank on its GPU gets the engine's memory."""
    partial_rollout: bool = False
    """At a refit, keep the requests in flight and continue them from their generated prefixes under
    the new weights (each token keeps the version and log-prob it was sampled with; needs
    algorithm.importance_level). False: they finish under the old weights first, and a multi-turn
    rollout whose next turn runs under a new version starts a new segment there."""
    num_agent_workers: int = 1
    """Agent worker processes per rollout rank: each imports the agent file and runs many rollouts
    with asyncio; user agent code runs only there, never in the rank with the engine."""
    group_affinity: bool = True
    """Run a group's rollouts on one engine (its prompt prefilled once, then prefix-cached) while load
    allows (molt.controller.engine_router.EngineRouter); False: each rollout goes to the least-loaded engine."""
    capture_routes: bool | None = None
    """MoE: the engines record each token's top-k expert ids at every MoE layer (the trace's
    routed_experts, molt.rollout.route_capture); None = on for MoE models, off for dense ones (True on a
    dense model is refused)."""

    def engine_memory(self, *, on_gpu: bool, colocate: bool = False) -> dict[str, float | int]:
        """The vLLM argument that sizes each engine worker: {'kv_cache_memory_bytes': n} or
        {'gpu_memory_utilization': share}. On CPU the byte budget is the default; on GPU a share of the
        GPU (0.9 of its own), and colocated only the share the recipe gives (validate_config asks for it)."""
        if self.kv_cache_gigabytes > 0:
            return {"kv_cache_memory_bytes": int(self.kv_cache_gigabytes * 2**30)}
        if self.engine_memory_fraction > 0:
            return {"gpu_memory_utilization": self.engine_memory_fraction}
        if on_gpu and not colocate:
            return {"gpu_memory_utilization": DEFAULT_GPU_ENGINE_MEMORY_FRACTION}
        if on_gpu:
            raise ConfigError("layout.colocate=True on GPUs needs rollout.engine_memory_fraction (the engine's share "
                              "of the GPU it shares with a trainer rank), e.g. 0.4")
        return {"kv_cache_memory_bytes": int(DEFAULT_KV_CACHE_GIGABYTES * 2**30)}


@dataclass(kw_only=True)
class TrainConfig(ConfigSection):
    num_steps: int = 100
    """Optimizer steps to run."""
    learning_rate: float = 1e-5
    """AdamW peak learning rate (lr_schedule shapes it over the steps)."""
    lr_schedule: str = "constant"
    """constant | linear | cosine: the learning rate after warmup, set per training step, decaying from
    learning_rate toward min_lr_ratio x learning_rate over train.num_steps (docs/training.md)."""
    warmup_steps: int = 0
    """Training steps of linear warmup: step s <= warmup_steps uses learning_rate x s / warmup_steps."""
    min_lr_ratio: float = 0.0
    """linear, cosine: where the decay ends, as a share of learning_rate (reached just after the last step)."""
    lr_multipliers: dict[str, float] = field(default_factory=dict)
    """Parameter-name prefix -> factor on learning_rate, for modules that need their own rate (e.g.
    {"model.vision_model.": 3.0} for a vision tower trained from scratch); the longest matching prefix
    wins; the schedule scales every rate alike; {} = one rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    no_weight_decay_on: tuple[str, ...] = ()
    """Parameters exempt from weight decay: any of norms, biases, embeddings (e.g. (norms, biases))."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    max_tokens_per_micro_batch: int = 8192
    """Tokens per forward/backward on one trainer rank: packed tokens with packing, else rows x longest row."""
    param_dtype: str = "float32"
    """Stored (master) dtype of trained weights, their gradients and AdamW state: float32 | bfloat16 |
    float64. The engines serve model.dtype; refit casts to it."""
    compute_dtype: str = ""
    """Forward/backward dtype through FSDP2 mixed precision (gradients reduced in float32): float32 |
    bfloat16 | float16 | float64; '' = model.dtype, what the engines compute in."""
    activation_checkpointing: str = "none"
    """none | full (every decoder block) | every_n:<k> (blocks 0, k, 2k, ...): keep only the block's
    input and recompute its activations in backward."""
    cpu_offload: bool = False
    """GPU only: parameters, gradients and AdamW state live in host memory between uses (FSDP2
    CPUOffloadPolicy), a GPU memory control; refused on CPU runs."""
    logprob_chunk_tokens: int = 1024
    """Positions per chunk of the LM head when computing log-probs and entropy: no [tokens, vocab]
    tensor beyond chunk x vocab is alive (peak about 3 x chunk x vocab x 4 bytes)."""
    packing: bool = True
    """Pack a micro-batch's experiences into one row without padding (per-sequence positions,
    attention kept within each sequence); False pads each experience to the longest row."""
    mini_batches_per_step: int = 1
    """Optimizer steps per rollout batch: the batch is split into this many windows (PPO mini-batches)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch's windows; mini_batches_per_step x ppo_epochs optimizer steps a step."""
    freeze_router: bool = False
    """MoE: the routers (each block's mlp.gate) are not trained, so RL updates cannot shift which
    experts a token uses, the most sensitive part of an MoE model; experts and the rest train."""
    max_consecutive_nonfinite_steps: int = 3
    """A step with a NaN/inf loss or gradient norm takes no optimizer step and pushes no weights;
    this many in a row stop the job."""


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "group_mean", "rloo")
TOKEN_ESTIMATORS = ("reinforce_pp", "gae")


@dataclass(kw_only=True)
class AlgorithmConfig(ConfigSection):
    advantage_estimator: str = "grpo"
    """grpo | dr_grpo | group_mean | rloo (per rollout, within its prompt group) | reinforce_pp |
    gae (per token; gae trains a critic). Formulas in docs/objectives.md."""
    gamma: float = 1.0
    """reinforce_pp, gae: discount per action token (observation tokens between turns cost none)."""
    gae_lambda: float = 0.95
    """gae: the GAE lambda (1 = Monte-Carlo returns minus values)."""
    whiten_advantages: bool = True
    """gae: whiten the advantages over the batch's action tokens (reinforce_pp always whitens)."""
    policy_loss: str = "ppo"
    """ppo (clipped token ratios) | gspo (clipped sequence ratio, Zheng et al. 2025) | cispo (REINFORCE
    with a clipped stop-gradient token weight, MiniMax-M1); formulas in docs/objectives.md."""
    clip_eps_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_eps_high: float = 0.2
    """PPO ratio clip above 1 (raise for DAPO's clip-higher)."""
    dual_clip: float = 0.0
    """Dual clip: cap the loss of a negative-advantage token at -c * A; c > 1, 0 = off."""
    loss_aggregation: str = "token_mean"
    """How the window's token terms (policy, entropy, KL in the loss) make one loss: token_mean (over the
    window's action tokens) | seq_mean_token_mean (each sequence's token mean, averaged over the window's
    sequences; GSPO's) | constant (token sums / (sequences x loss_constant_tokens), Dr. GRPO)."""
    loss_constant_tokens: int = 0
    """constant aggregation: tokens per sequence in the divisor; 0 = rollout.max_response_tokens."""
    trust_region_kl: float = 0.0
    """Sequence trust region (Li et al. 2025): weight 0 for every token of an experience whose mean
    per-token KL(behaviour || trainer) exceeds this (the paper: 1e-3); 0 = off."""
    trust_region_weight_cap: float = 2.0
    """Trust region: cap (>= 1) on a kept token's weight, exp(trainer - behaviour log-prob) or the
    importance correction's weight."""
    importance_level: str = "off"
    """Correct the trainer/engine mismatch with importance weights exp(trainer - behaviour log-prob):
    off | token | seq | geo (token+trunc = TIS, token+mask = IcePop, geo+mask = seq-mask-tis)."""
    importance_mode: str = "trunc"
    """mask (weight 0 outside importance_band) | clip (clamp into the band) | trunc (cap at its top);
    seq and geo take only mask."""
    importance_band: tuple[float, float] = (0.5, 2.0)
    """[low, high] for the importance ratio (trunc uses only high)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = off; > 0 computes the entropy over the vocabulary each micro-batch)."""
    kl_coef: float = 0.0
    """Weight of the KL to a frozen reference copy of the initial policy; 0 = no reference model."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 (Schulman's estimators of KL(policy || reference), per action token)."""
    kl_placement: str = "loss"
    """loss (a term of the loss) | reward (subtracted from the reward before the advantages)."""
    kl_target: float = 0.0
    """> 0: adapt kl_coef each step toward this mean per-token KL (Ziegler et al. 2019)."""
    kl_horizon: float = 10000.0
    """Adaptive KL: its horizon in rollouts (a step moves the coefficient by at most
    0.2 x rollouts / horizon of itself)."""
    critic_learning_rate: float = 1e-5
    """gae: the critic's AdamW learning rate (it shares the actor's other optimizer settings)."""
    value_clip: float = 0.2
    """gae: clip the value prediction to old value +- this in the value loss; 0 = unclipped."""
    max_staleness: int = 0
    """Policy versions between a rollout's dispatch and the step that trains on it: a rollout
    dispatched at version v is trained by a step that updates version v..v+k (then k+1 steps of
    prompts may be in flight while the trainer trains); 0 = synchronous."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop complete groups whose scores carry no signal (see filter_band) and
    run fresh prompts as new groups until the step has rollout.prompts_per_step groups."""
    filter_band: tuple[float, float] = (0.0, 1.0)
    """(low, high): a group is dropped when every rollout's score is <= low (all_low) or every one is
    >= high (all_high); for 0/1 rewards, all wrong or all right. Each rollout counts once."""
    max_backfill_prompts: int = 32
    """Most extra prompts one step dispatches to replace lost groups (32 = 4 x the default
    prompts_per_step); past it the step trains on fewer groups and warns. 0 = filter, never backfill."""
    overlong_filter: bool = False
    """DAPO overlong filtering: a truncated rollout (a response cut at rollout.max_response_tokens or
    max_length, the context exhausted, agent.max_turns spent) adds no token to the loss; its reward
    still counts in its group's baseline."""
    overlong_buffer_tokens: int = 0
    """DAPO soft overlong punishment, L_cache: a rollout whose longest response passes
    rollout.max_response_tokens - this many tokens loses reward linearly, up to
    overlong_penalty_factor at max_response_tokens. 0 = off."""
    overlong_penalty_factor: float = 1.0
    """The most reward the soft overlong punishment takes (at rollout.max_response_tokens and beyond)."""
    kl_clamp: float = 10.0
    """Cap on each token's k3 KL estimate (loss and reward placement); a capped token adds the cap and
    no gradient. 0 = uncapped; k1 and k2 are never capped."""
    routing_replay: bool = False
    """MoE: the trainer's forward routes each token to the experts the engine recorded for it (R3,
    rollout.capture_routes), live routing where none was recorded; the router keeps its gradient."""
    router_aux_loss_coef: float | None = None
    """MoE: weight of the model's own load-balancing loss (per token, as its Hugging Face class
    computes it); None = the model config's router_aux_loss_coef, 0 = off."""


@dataclass(kw_only=True)
class SFTConfig(ConfigSection):
    """`python -m molt.sft` (docs/sft.md): supervised fine-tuning of model.path on chat rows with the
    train section's optimizer, precision and micro-batching; RL runs ignore it."""

    data_path: str = ""
    """Chat rows, .jsonl or .parquet: `messages` whose assistant turns are trained (optional `tools`);
    a row whose messages end before an answer trains on its `label` as the assistant's reply."""
    output_dir: str = ""
    """The trained Hugging Face model directory, usable as an RL run's model.path
    ('' = <output_dir>/model)."""
    num_steps: int = 0
    """Optimizer steps (0 = epochs x the rows / batch_size, rounded up)."""
    epochs: int = 1
    """When num_steps is 0: how many rows' worth of batches to train on, in passes over the file
    (each step draws batch_size distinct rows from a seeded stream, so a row may recur earlier)."""
    batch_size: int = 64
    """Rows per optimizer step over all data-parallel ranks (at most the file's rows); the loss is
    the mean over their assistant tokens."""


@dataclass(kw_only=True)
class RefitConfig(ConfigSection):
    bucket_megabytes: float = 64.0
    """Size of one broadcast bucket; control messages per refit are O(buckets)."""
    timeout_seconds: float = 120.0
    """One limit over a whole refit (gather, broadcast, engine reload)."""
    check_every_steps: int = 0
    """Compare engine and trainer log-probs on a fixed probe every N refits (0 = never)."""
    max_attempts: int = 2
    """Attempts per refit: after a failed one (an engine reported an error or did not confirm within
    timeout_seconds) the refit group is rebuilt and the refit retried; 1 = the first failure stops the job."""
    backend: str = "auto"
    """How weights reach the engines: 'gloo' (host memory over TCP; what CPU runs use), 'nccl'
    (vLLM's NCCL weight-transfer engine, GPU to GPU), 'auto' = nccl when the trainer runs on CUDA."""
    receiver_cls: str = "molt.rollout.worker_extension.WorkerExtension"
    """The class vLLM mixes into its workers to receive and load weights and record MoE routes (a
    subclass of molt.rollout.worker_extension.WorkerExtension may change how weights are loaded); a
    dotted path importable in the engine's worker processes."""


@dataclass(kw_only=True)
class CheckpointConfig(ConfigSection):
    dir: str = ""
    """Where checkpoints go, one step_<N> directory each ('' = <output_dir>/checkpoints)."""
    interval_steps: int = 0
    """Write a checkpoint every N steps (0 = never)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are removed after a newer one is complete."""
    resume: str = ""
    """'' = start fresh | 'auto' = the newest complete checkpoint in dir, if any | a step_<N> directory."""
    overwrite: bool = False
    """A fresh start may write into a checkpoint.dir holding another run's checkpoints: they are deleted first."""


@dataclass(kw_only=True)
class PayloadConfig(ConfigSection):
    budget_megabytes: float = 1024.0
    """Shared memory one rollout rank's payload store may hold (experiences' token-axis tensors
    until their trainer rank has them); past it, payloads spill to files in spill_dir."""
    spill_dir: str = ""
    """Directory for spilled payloads, private to the user ('' = molt-payloads-<uid> in the system temp dir)."""
    node_id: str = ""
    """This machine's id in payload references ('' = its host name): equal ids read each other's
    payloads from shared memory, different ones fetch them over ZeroMQ."""
    fetch_timeout_seconds: float = 120.0
    """How long a trainer rank waits for a payload from another node's store."""
    inline_bytes: int = 32768
    """Experiences whose token-axis payload is at most this many bytes (13 a token, 17 with per-token
    temperatures) travel whole in their light record, past the store: below ~32 KiB that costs less
    than half a store round trip, while the controller decodes and forwards their tokens (a record
    of at most ~1.75x this as msgpack). 0 = every experience goes through the store."""


@dataclass(kw_only=True)
class EvalConfig(ConfigSection):
    every_steps: int = 0
    """Evaluate the policy after every N training steps, on the rollout engines (0 = off); the eval
    of step s runs before step s + 1 (or at the end) and is logged as its own metrics row of step s."""
    at_start: bool = True
    """Also evaluate the initial policy (step 0), so the eval curve starts from the base model."""
    data_path: str = ""
    """Eval prompts, .jsonl or .parquet ('' = holdout_rows of data.train_path)."""
    holdout_rows: int = 0
    """With data_path '': hold out this many rows of data.train_path (chosen by seed) as the eval
    set; training never sees them."""
    max_prompts: int = 0
    """Evaluate only the first N eval prompts (0 = all)."""
    n_samples: int = 4
    """k: samples per eval prompt; logged as eval/avg@k (mean reward) and eval/pass@k."""
    temperature: float = 0.6
    """Sampling temperature of eval rollouts (independent of rollout.temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass of eval rollouts (nothing is trained on them, so any value in (0, 1] works)."""
    max_response_tokens: int = 0
    """max_tokens of each eval generation (0 = rollout.max_response_tokens)."""
    success_threshold: float = 1.0
    """A sample whose reward is at least this counts as solved for pass@k."""


@dataclass(kw_only=True)
class MetricsConfig(ConfigSection):
    output_dir: str = ""
    """Run directory for metrics.jsonl, config.json and W&B files ('' = runs/<name>)."""
    wandb_mode: str = "disabled"
    """W&B: disabled | offline | online."""
    wandb_project: str = "molt"
    """W&B project name."""


@dataclass(kw_only=True)
class MoltConfig(ConfigSection):
    name: str = "run"
    """Run name, used for the output directory and W&B."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    device: str = "auto"
    """auto | cpu | cuda: where trainers compute and which collective backend they use."""
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    payloads: PayloadConfig = field(default_factory=PayloadConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def world_size(self) -> int:
        return self.layout.num_trainer_ranks + self.layout.num_rollout_ranks

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.output_dir, "checkpoints")

    @property
    def output_dir(self) -> str:
        return self.metrics.output_dir or os.path.join("runs", self.name)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading and overrides


def load_config(spec: str, overrides: list[str] = ()) -> MoltConfig:
    """Build the config named by `PATH[:FUNCTION]` and apply `a.b=value` overrides."""
    path, _, function_name = spec.partition(":")
    function_name = function_name or "config"
    if not Path(path).is_file():
        raise ConfigError(f"--config {spec!r}: no file {path!r}; pass a recipe such as configs/demo.py")
    module_spec = importlib.util.spec_from_file_location(f"molt_recipe_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    function = getattr(module, function_name, None)
    if not callable(function):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ConfigError(f"--config {spec!r}: {path} has no function {function_name!r}; it has {names}")
    try:
        cfg = function()
    except ConfigError as error:
        raise ConfigError(f"--config {spec!r}: {error}") from error
    if not isinstance(cfg, MoltConfig):
        raise ConfigError(f"--config {spec!r}: {function_name}() returned {type(cfg).__name__}, not MoltConfig")
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def apply_override(cfg: MoltConfig, item: str) -> None:
    """Set one `a.b=value` on `cfg`, converting the value to the field's declared type."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.learning_rate=1e-5")
    target = cfg
    parts = key.strip().split(".")
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(target)}
        if part not in fields:
            prefix = ".".join(parts[:depth])
            valid = [f"{prefix}.{n}" if prefix else n for n in fields]
            close = _closest(key, _all_keys(cfg)) or valid[0]
            raise ConfigError(f"--set {item!r}: unknown key {key!r}; did you mean {close!r}?")
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(target, part)):
                raise ConfigError(f"--set {item!r}: {key!r} is a section; set one of its fields")
            hint = typing.get_type_hints(type(target))[part]
            setattr(target, part, _convert(raw.strip(), hint, key))
        else:
            target = getattr(target, part)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:depth + 1])!r} is not a section")


def _closest(name: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, candidates, n=1)
    return matches[0] if matches else None


def _section_prefix(cls: type) -> str:
    """'train.' for TrainConfig, '' for the root MoltConfig."""
    for f in dataclasses.fields(MoltConfig):
        if f.default_factory is cls:
            return f"{f.name}."
    return ""


def _unknown_field_message(cls: type, name: str) -> str:
    prefix, fields = _section_prefix(cls), list(cls.__dataclass_fields__)
    close = _closest(name, fields)
    fix = f"did you mean {prefix + close!r}?" if close else f"its fields are {', '.join(fields)}"
    return f"{prefix}{name}: {cls.__name__} has no field {name!r}; {fix}"


def _all_keys(cfg, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += _all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _convert(raw: str, hint, key: str):
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        if hint in (int, float, str):
            return hint(raw)
        if origin in (tuple, list):
            args = typing.get_args(hint)
            item_type = args[0] if args else str
            try:
                values = json.loads(raw if raw.startswith("[") else f"[{raw}]")
            except json.JSONDecodeError:
                if item_type is not str:
                    raise
                values = [v.strip() for v in raw.strip("[]").split(",") if v.strip()]  # norms,biases
            return origin(item_type(v) for v in values)
        if origin in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            if len(members) == 1:  # X | None: none/null, or an X (rollout.capture_routes=False)
                return None if raw.lower() in ("none", "null") else _convert(raw, members[0], key)
            return json.loads(raw)
        if origin is dict:  # a JSON object: rollout.engine_args='{"max_num_seqs": 64}'
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
    except (ValueError, json.JSONDecodeError) as error:
        raise ConfigError(f"--set {key}={raw!r}: expected {_type_name(hint)}") from error
    raise ConfigError(f"--set {key}: fields of type {_type_name(hint)} cannot be set from the command line")


def check_trainer_mesh(layout: LayoutConfig, check) -> None:
    """The trainer mesh dp_replicate x dp_shard x cp x tp must tile layout.num_trainer_ranks."""
    sizes = {"trainer_data_parallel_replicate": layout.trainer_data_parallel_replicate,
             "trainer_context_parallel_size": layout.trainer_context_parallel_size,
             "trainer_tensor_parallel_size": layout.trainer_tensor_parallel_size}
    for name, size in sizes.items():
        check(size >= 1, f"layout.{name}={size}: need at least 1")
    product = math.prod(max(size, 1) for size in sizes.values())
    check(layout.num_trainer_ranks % product == 0,
          f"layout.num_trainer_ranks={layout.num_trainer_ranks} is not a multiple of trainer_data_parallel_replicate "
          f"x trainer_context_parallel_size x trainer_tensor_parallel_size = "
          f"{' x '.join(str(size) for size in sizes.values())} = {product}: the trainer mesh is dp_replicate x "
          f"dp_shard x cp x tp")
    check_expert_parallel(layout, layout.num_trainer_ranks // max(product, 1), check)


def check_expert_parallel(layout: LayoutConfig, dp_shard: int, check) -> None:
    """ep borrows from the dp_shard ranks (dp_shard = dp_shard_mod_ep x ep); the model's side
    (num_experts divisible, not dense) is checked when the model is laid out."""
    ep = layout.trainer_expert_parallel_size
    check(ep >= 1, f"layout.trainer_expert_parallel_size={ep}: need at least 1")
    check(ep < 1 or dp_shard % ep == 0,
          f"layout.trainer_expert_parallel_size={ep} does not divide the dp_shard size {dp_shard} (num_trainer_ranks "
          f"/ (replicate x cp x tp)): expert parallelism splits the data-parallel shard ranks; use one of "
          f"{[size for size in range(1, dp_shard + 1) if dp_shard % size == 0]}")
    check(ep == 1 or layout.trainer_tensor_parallel_size == 1,
          f"layout.trainer_expert_parallel_size={ep} with trainer_tensor_parallel_size="
          f"{layout.trainer_tensor_parallel_size}: Molt does not tensor-parallelise MoE models; set tp to 1")


def _type_name(hint) -> str:
    return str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))


def field_type_errors(section: ConfigSection, prefix: str = "") -> list[str]:
    """One message per field whose value does not match its annotation (recipes assign plain Python,
    which nothing converts; `--set` converts, so its values always match)."""
    errors, hints = [], typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        key, value, hint = prefix + f.name, getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):
            errors += field_type_errors(value, f"{key}.")
        elif not _has_type(value, hint):
            got = (f"({', '.join(type(item).__name__ for item in value)})" if isinstance(value, tuple)
                   else type(value).__name__)
            errors.append(f"{key}={value!r}: expected {_type_name(hint)}, got {got}")
    return errors


def _has_type(value, hint) -> bool:
    """isinstance against an annotation: an int is not a bool, a float field takes an int, and a tuple
    is checked item by item (tuple[float, float] also by length)."""
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_has_type(item, args[0]) for item in value)
        return len(value) == len(args) and all(map(_has_type, value, args))
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in args)
    return isinstance(value, origin or hint)


# ---------------------------------------------------------------------------------------------
# Validation


def validate_config(cfg: MoltConfig, world_size: int | None = None, *, require_files: bool = True) -> None:
    """Cross-section checks done once at start-up; raises ConfigError naming the field.

    `require_files=False` (--dry-run) skips the existence checks of model.path, data.train_path and
    agent.path, which need only be there at run time."""
    errors = field_type_errors(cfg)
    if errors:  # the range checks below compare values and would fail on a value of the wrong type
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))

    def check(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)

    layout, rollout, train, algo = cfg.layout, cfg.rollout, cfg.train, cfg.algorithm
    check(layout.num_trainer_ranks >= 1, f"layout.num_trainer_ranks={layout.num_trainer_ranks}: need at least 1")
    check(layout.num_rollout_ranks >= 1, f"layout.num_rollout_ranks={layout.num_rollout_ranks}: need at least 1")
    tensor_parallel, gpus_per_node = layout.engine_tensor_parallel_size, layout.gpus_per_node
    check(tensor_parallel >= 1, f"layout.engine_tensor_parallel_size={tensor_parallel}: need at least 1")
    check(gpus_per_node >= 1, f"layout.gpus_per_node={gpus_per_node}: need at least 1")
    check(tensor_parallel < 1 or gpus_per_node < 1 or gpus_per_node % tensor_parallel == 0,
          f"layout.engine_tensor_parallel_size={tensor_parallel} does not divide layout.gpus_per_node="
          f"{gpus_per_node}: an engine's GPUs must share one node; use one of "
          f"{[size for size in range(1, gpus_per_node + 1) if gpus_per_node % size == 0]}")
    check_trainer_mesh(layout, check)
    check(cfg.device != "cpu" or layout.trainer_context_parallel_size == 1,
          f"layout.trainer_context_parallel_size={layout.trainer_context_parallel_size} with device='cpu': context "
          f"parallelism splits attention with PyTorch's CUDA kernels; it is a GPU layout (set 1 on CPU)")
    check(cfg.refit.backend in ("auto", "gloo", "nccl"), f"refit.backend={cfg.refit.backend!r}: use auto, gloo or nccl")
    check(cfg.device != "cpu" or cfg.refit.backend != "nccl",
          "refit.backend='nccl' with device='cpu': NCCL moves GPU memory; CPU runs refit over gloo (set auto or gloo)")
    check_colocate(cfg, check)
    check(layout.gpu_memory_gigabytes >= 0,
          f"layout.gpu_memory_gigabytes={layout.gpu_memory_gigabytes}: must be >= 0 (0 skips the check)")
    if world_size is not None:
        check(cfg.world_size == world_size,
              f"layout.num_trainer_ranks + layout.num_rollout_ranks = {layout.num_trainer_ranks} + "
              f"{layout.num_rollout_ranks} = {cfg.world_size}, but the job has {world_size} ranks; "
              f"set the split to add up to {world_size} or launch with --nproc_per_node={cfg.world_size}")
    check(bool(cfg.model.path), "model.path is empty: set it to a Hugging Face model directory")
    check(not require_files or not cfg.model.path or Path(cfg.model.path, "config.json").is_file(),
          f"model.path={cfg.model.path!r} has no config.json: point it at a Hugging Face model directory")
    check(cfg.model.dtype in ("float32", "bfloat16", "float16"),
          f"model.dtype={cfg.model.dtype!r}: use float32, bfloat16 or float16")
    check(cfg.device in ("auto", "cpu", "cuda"), f"device={cfg.device!r}: use auto, cpu or cuda")
    check(bool(cfg.data.train_path) and (not require_files or Path(cfg.data.train_path).is_file()),
          f"data.train_path={cfg.data.train_path!r} is not a file: point it at a .jsonl or .parquet prompt set")
    check(bool(cfg.agent.path) and (not require_files or Path(cfg.agent.path).is_file()),
          f"agent.path={cfg.agent.path!r} is not a file: point it at a Python file defining AgentRunner")
    check(cfg.seed >= 0, f"seed={cfg.seed}: must be >= 0 (the engines' samplers take unsigned seeds)")
    check(cfg.agent.max_turns >= 1, f"agent.max_turns={cfg.agent.max_turns}: need at least 1")
    check(cfg.agent.rollout_timeout_seconds > 0,
          f"agent.rollout_timeout_seconds={cfg.agent.rollout_timeout_seconds}: must be > 0")
    check(cfg.agent.on_context_exhausted in ("train_truncated", "fail"),
          f"agent.on_context_exhausted={cfg.agent.on_context_exhausted!r}: use train_truncated or fail")
    check(cfg.agent.on_failed_rollout in ("drop_group", "refill"),
          f"agent.on_failed_rollout={cfg.agent.on_failed_rollout!r}: use drop_group or refill")
    check(cfg.agent.max_refills_per_group >= 0,
          f"agent.max_refills_per_group={cfg.agent.max_refills_per_group}: must be >= 0 (0 never refills)")
    check(cfg.agent.max_failed_steps >= 0,
          f"agent.max_failed_steps={cfg.agent.max_failed_steps}: must be >= 0 (0 never stops the job)")
    check(rollout.prompts_per_step >= 1, f"rollout.prompts_per_step={rollout.prompts_per_step}: need at least 1")
    check(rollout.n_samples_per_prompt >= 1,
          f"rollout.n_samples_per_prompt={rollout.n_samples_per_prompt}: need at least 1")
    check(rollout.num_agent_workers >= 1,
          f"rollout.num_agent_workers={rollout.num_agent_workers}: need at least 1 (agent code runs only in "
          f"agent worker processes)")
    check(cfg.agent.max_concurrent_rollouts >= 1,
          f"agent.max_concurrent_rollouts={cfg.agent.max_concurrent_rollouts}: need at least 1")
    estimator = algo.advantage_estimator
    check(estimator in GROUP_ESTIMATORS + TOKEN_ESTIMATORS,
          f"algorithm.advantage_estimator={estimator!r}: use one of {', '.join(GROUP_ESTIMATORS + TOKEN_ESTIMATORS)}")
    check(estimator not in GROUP_ESTIMATORS or rollout.n_samples_per_prompt > 1,
          f"algorithm.advantage_estimator={estimator!r} needs rollout.n_samples_per_prompt > 1 "
          f"(got {rollout.n_samples_per_prompt}): its baseline is the rest of the prompt's group")
    check(0 < algo.gamma <= 1, f"algorithm.gamma={algo.gamma}: must be in (0, 1]")
    check(0 <= algo.gae_lambda <= 1, f"algorithm.gae_lambda={algo.gae_lambda}: must be in [0, 1]")
    check(0 <= algo.clip_eps_low < 1, f"algorithm.clip_eps_low={algo.clip_eps_low}: must be in [0, 1)")
    check(algo.clip_eps_high >= 0, f"algorithm.clip_eps_high={algo.clip_eps_high}: must be >= 0")
    check(algo.dual_clip == 0 or algo.dual_clip > 1, f"algorithm.dual_clip={algo.dual_clip}: use 0 (off) or > 1")
    check(algo.policy_loss in POLICY_LOSSES,
          f"algorithm.policy_loss={algo.policy_loss!r}: use one of {', '.join(POLICY_LOSSES)}")
    check(algo.dual_clip == 0 or algo.policy_loss == "ppo",
          f"algorithm.dual_clip={algo.dual_clip} caps PPO's token terms; algorithm.policy_loss={algo.policy_loss!r} "
          f"has none to cap: set dual_clip=0")
    check_loss_options(algo, check)
    level, mode, (low, high) = algo.importance_level, algo.importance_mode, algo.importance_band
    check(level in ("off", "token", "seq", "geo"),
          f"algorithm.importance_level={level!r}: use off, token, seq or geo")
    check(mode in ("mask", "clip", "trunc"), f"algorithm.importance_mode={mode!r}: use mask, clip or trunc")
    check(level not in ("seq", "geo") or mode == "mask",
          f"algorithm.importance_level={level!r} with importance_mode={mode!r}: seq and geo take only mask")
    check(0 <= low < high, f"algorithm.importance_band={algo.importance_band}: need 0 <= low < high")
    check(algo.entropy_coef >= 0, f"algorithm.entropy_coef={algo.entropy_coef}: must be >= 0")
    check(algo.kl_coef >= 0, f"algorithm.kl_coef={algo.kl_coef}: must be >= 0")
    check(algo.kl_estimator in ("k1", "k2", "k3"), f"algorithm.kl_estimator={algo.kl_estimator!r}: use k1, k2 or k3")
    check(algo.kl_placement in ("loss", "reward"),
          f"algorithm.kl_placement={algo.kl_placement!r}: use loss or reward")
    check(algo.kl_target >= 0, f"algorithm.kl_target={algo.kl_target}: must be >= 0 (0 = fixed kl_coef)")
    check(algo.kl_target == 0 or algo.kl_coef > 0,
          f"algorithm.kl_target={algo.kl_target} adapts kl_coef, which is 0: set a starting algorithm.kl_coef > 0")
    check(algo.kl_horizon > 0, f"algorithm.kl_horizon={algo.kl_horizon}: must be > 0")
    check(algo.critic_learning_rate > 0, f"algorithm.critic_learning_rate={algo.critic_learning_rate}: must be > 0")
    check(algo.value_clip >= 0, f"algorithm.value_clip={algo.value_clip}: must be >= 0 (0 = unclipped)")
    check(algo.max_staleness == 0 or level != "off",
          f"algorithm.max_staleness={algo.max_staleness} trains on tokens sampled by older weights: it needs "
          f"algorithm.importance_level (e.g. token) to correct for them")
    check(rollout.max_response_tokens < rollout.max_length,
          f"rollout.max_response_tokens={rollout.max_response_tokens} must be below "
          f"rollout.max_length={rollout.max_length}")
    check(rollout.max_response_tokens >= 1,
          f"rollout.max_response_tokens={rollout.max_response_tokens}: need at least 1")
    check(rollout.temperature > 0, f"rollout.temperature={rollout.temperature}: must be > 0")
    check(rollout.engine_threads >= 0,
          f"rollout.engine_threads={rollout.engine_threads}: must be >= 0 (0 = vLLM's default)")
    check(rollout.engine_start_timeout_seconds >= 0,
          f"rollout.engine_start_timeout_seconds={rollout.engine_start_timeout_seconds}: must be > 0, or 0 for "
          f"auto (scaled with the checkpoint's size)")
    check(rollout.top_p == 1.0,
          f"rollout.top_p={rollout.top_p}: must be 1.0; the trainer recomputes log-probs over the full vocabulary, "
          f"so nucleus sampling would make them differ from the behaviour log-probs (the sampling contract, "
          f"docs/agents.md)")
    check(0 <= rollout.engine_memory_fraction <= 1,
          f"rollout.engine_memory_fraction={rollout.engine_memory_fraction}: must be in (0, 1], or 0 to leave it unset")
    check(rollout.kv_cache_gigabytes >= 0,
          f"rollout.kv_cache_gigabytes={rollout.kv_cache_gigabytes}: must be > 0, or 0 to leave it unset")
    check(not (rollout.kv_cache_gigabytes > 0 and rollout.engine_memory_fraction > 0),
          f"rollout.kv_cache_gigabytes={rollout.kv_cache_gigabytes} and rollout.engine_memory_fraction="
          f"{rollout.engine_memory_fraction} both size the engine: set one of them and leave the other at 0 "
          f"(kv_cache_gigabytes, a byte budget, fits any machine with that much memory free)")
    if rollout.engine_args:  # vLLM's own argument names (engine_args_errors imports vLLM: only when needed)
        errors += engine_args_errors(rollout.engine_args)
    check(train.max_tokens_per_micro_batch >= rollout.max_length,
          f"train.max_tokens_per_micro_batch={train.max_tokens_per_micro_batch} must be >= "
          f"rollout.max_length={rollout.max_length} so the longest segment fits one micro-batch")
    check(train.num_steps >= 1, f"train.num_steps={train.num_steps}: need at least 1")
    check_trainer_options(train, rollout, check)
    check_sft_options(cfg.sft, check)
    check(algo.max_staleness >= 0, f"algorithm.max_staleness={algo.max_staleness}: must be >= 0 (0 = synchronous)")
    check(not rollout.partial_rollout or level != "off",
          f"rollout.partial_rollout=True continues rollouts under new weights, so one experience holds tokens "
          f"of several versions: it needs algorithm.importance_level (e.g. token, with importance_mode trunc) "
          f"to correct for them (algorithm.importance_level={level!r})")
    check(len(algo.filter_band) == 2 and algo.filter_band[0] < algo.filter_band[1],
          f"algorithm.filter_band={tuple(algo.filter_band)}: needs (low, high) with low < high "
          f"(e.g. (0.0, 1.0) drops all-wrong and all-right groups of 0/1 rewards)")
    check(algo.max_backfill_prompts >= 0,
          f"algorithm.max_backfill_prompts={algo.max_backfill_prompts}: must be >= 0 (0 never backfills)")
    check(algo.router_aux_loss_coef is None or algo.router_aux_loss_coef >= 0,
          f"algorithm.router_aux_loss_coef={algo.router_aux_loss_coef}: must be >= 0 (0 = off), or None for the "
          f"model config's router_aux_loss_coef")
    check(not algo.routing_replay or getattr(rollout, "capture_routes", None) is not False,
          "algorithm.routing_replay=True replays the routes the engines record, but rollout.capture_routes=False "
          "records none: leave rollout.capture_routes unset (on for MoE models) or set it True")
    check(not algo.filter_groups or rollout.n_samples_per_prompt > 1,
          f"algorithm.filter_groups=True needs rollout.n_samples_per_prompt > 1 (got "
          f"{rollout.n_samples_per_prompt}): a group of one has no spread of scores to keep")
    check(0 <= algo.overlong_buffer_tokens <= rollout.max_response_tokens,
          f"algorithm.overlong_buffer_tokens={algo.overlong_buffer_tokens}: must be in [0, rollout.max_response_tokens="
          f"{rollout.max_response_tokens}] (0 = no overlong penalty)")
    check(algo.overlong_penalty_factor >= 0,
          f"algorithm.overlong_penalty_factor={algo.overlong_penalty_factor}: must be >= 0")
    check(algo.kl_clamp >= 0, f"algorithm.kl_clamp={algo.kl_clamp}: must be >= 0 (0 = uncapped)")
    check(cfg.refit.bucket_megabytes > 0, f"refit.bucket_megabytes={cfg.refit.bucket_megabytes}: must be > 0")
    check(cfg.refit.timeout_seconds > 0, f"refit.timeout_seconds={cfg.refit.timeout_seconds}: must be > 0")
    check(cfg.checkpoint.interval_steps >= 0, f"checkpoint.interval_steps={cfg.checkpoint.interval_steps}: must be >= 0 (0 = never)")
    check(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last={cfg.checkpoint.keep_last}: must be >= 1")
    check(cfg.checkpoint.resume in ("", "auto") or os.path.isdir(cfg.checkpoint.resume),
          f"checkpoint.resume={cfg.checkpoint.resume!r}: '' | 'auto' | an existing step_<N> checkpoint directory")
    check(cfg.payloads.budget_megabytes >= 0, f"payloads.budget_megabytes={cfg.payloads.budget_megabytes}: must be >= 0 (0 spills every payload)")
    check(cfg.payloads.fetch_timeout_seconds > 0, f"payloads.fetch_timeout_seconds={cfg.payloads.fetch_timeout_seconds}: must be > 0")
    check(cfg.payloads.inline_bytes >= 0, f"payloads.inline_bytes={cfg.payloads.inline_bytes}: must be >= 0 (0 sends every payload through the store)")
    check(not cfg.payloads.node_id or bool(re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", cfg.payloads.node_id)),
          f"payloads.node_id={cfg.payloads.node_id!r}: 1-64 characters of letters, digits, '_', '.', '-'")
    check(cfg.refit.check_every_steps >= 0,
          f"refit.check_every_steps={cfg.refit.check_every_steps}: must be >= 0 (0 = never)")
    check(cfg.refit.max_attempts >= 1, f"refit.max_attempts={cfg.refit.max_attempts}: must be >= 1")
    check(cfg.metrics.wandb_mode in ("disabled", "offline", "online"),
          f"metrics.wandb_mode={cfg.metrics.wandb_mode!r}: use disabled, offline or online")
    if cfg.device != "auto":  # with auto, molt.train checks once it knows where the trainer computes
        try:
            check_device_options(cfg, cfg.device)
        except ConfigError as error:
            check(False, str(error))
    check_eval_options(cfg, check, require_files=require_files)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def config_warnings(cfg: MoltConfig) -> list[str]:
    """Settings that are valid but probably not what was meant; start-up logs each once."""
    algo = cfg.algorithm
    warnings = []
    if algo.kl_estimator == "k1" and algo.kl_placement == "loss" and algo.kl_coef > 0:
        # E_{y ~ pi}[grad log pi(y)] = 0: on tokens sampled from the policy, k1's gradient is zero in expectation.
        warnings.append(
            f"algorithm.kl_estimator='k1' with kl_placement='loss' and kl_coef={algo.kl_coef}: on tokens the "
            f"policy sampled, k1's gradient is zero in expectation, so this term pulls nothing toward the "
            f"reference (only noise); use kl_estimator='k3' or 'k2' in the loss, or kl_placement='reward' for k1")
    train = cfg.train
    if train.warmup_steps > train.num_steps:  # e.g. a recipe's warmup in a short trial run
        warnings.append(
            f"train.warmup_steps={train.warmup_steps} is more than train.num_steps={train.num_steps}: the whole run "
            f"warms up and never reaches train.learning_rate={train.learning_rate} (the last step runs at "
            f"{train.num_steps}/{train.warmup_steps} of it)")
    return warnings


DTYPES = ("float32", "bfloat16", "float16", "float64")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")  # molt.objectives.LOSS_AGGREGATIONS
LR_SCHEDULES = ("constant", "linear", "cosine")
NO_DECAY_GROUPS = ("norms", "biases", "embeddings")


def parse_activation_checkpointing(spec: str) -> int:
    """train.activation_checkpointing as a block stride: 0 = none, 1 = every block, k = every k-th."""
    if spec == "none":
        return 0
    if spec == "full":
        return 1
    match = re.fullmatch(r"every_n:(\d+)", spec)
    if match is None or int(match[1]) < 1:
        raise ConfigError(f"train.activation_checkpointing={spec!r}: use none, full or every_n:<k> with k >= 1 "
                          f"(e.g. every_n:2 checkpoints blocks 0, 2, 4, ...)")
    return int(match[1])


def check_loss_options(algo: AlgorithmConfig, check) -> None:
    """algorithm.loss_aggregation and the sequence trust region (docs/objectives.md)."""
    check(algo.loss_aggregation in LOSS_AGGREGATIONS,
          f"algorithm.loss_aggregation={algo.loss_aggregation!r}: use one of {', '.join(LOSS_AGGREGATIONS)}")
    check(algo.loss_constant_tokens >= 0,
          f"algorithm.loss_constant_tokens={algo.loss_constant_tokens}: must be >= 0 (0 = rollout.max_response_tokens)")
    check(algo.loss_constant_tokens == 0 or algo.loss_aggregation == "constant",
          f"algorithm.loss_constant_tokens={algo.loss_constant_tokens} sets the constant aggregation's divisor, which "
          f"algorithm.loss_aggregation={algo.loss_aggregation!r} does not use: set loss_aggregation=constant, or "
          f"loss_constant_tokens=0")
    check(algo.trust_region_kl >= 0, f"algorithm.trust_region_kl={algo.trust_region_kl}: must be >= 0 (0 = off)")
    check(algo.trust_region_weight_cap >= 1,
          f"algorithm.trust_region_weight_cap={algo.trust_region_weight_cap}: must be >= 1 (a cap below 1 would "
          f"shrink even the tokens on which trainer and engine agree)")
    check(algo.trust_region_kl == 0 or algo.importance_level in ("off", "token"),
          f"algorithm.trust_region_kl={algo.trust_region_kl} rejects sequences by their KL and "
          f"algorithm.importance_level={algo.importance_level!r} rejects them by their ratio: use one rule, e.g. "
          f"importance_level=token (or off) with the trust region")


def check_trainer_options(train: TrainConfig, rollout: RolloutConfig, check) -> None:
    """The train section's precision, memory and optimizer options."""
    check(train.param_dtype in DTYPES, f"train.param_dtype={train.param_dtype!r}: use one of {', '.join(DTYPES)}")
    check(train.compute_dtype in ("",) + DTYPES,
          f"train.compute_dtype={train.compute_dtype!r}: use '' (model.dtype) or one of {', '.join(DTYPES)}")
    try:
        parse_activation_checkpointing(train.activation_checkpointing)
    except ConfigError as error:
        check(False, str(error))
    check(train.logprob_chunk_tokens >= 1, f"train.logprob_chunk_tokens={train.logprob_chunk_tokens}: need at least 1")
    check(train.lr_schedule in LR_SCHEDULES,
          f"train.lr_schedule={train.lr_schedule!r}: use one of {', '.join(LR_SCHEDULES)}")
    check(train.warmup_steps >= 0, f"train.warmup_steps={train.warmup_steps}: must be >= 0 (0 = no warmup)")
    check(0.0 <= train.min_lr_ratio <= 1.0, f"train.min_lr_ratio={train.min_lr_ratio}: must be in [0, 1]")
    check(train.learning_rate > 0, f"train.learning_rate={train.learning_rate}: must be > 0")
    bad_factors = {prefix: factor for prefix, factor in train.lr_multipliers.items()
                   if not (isinstance(factor, (int, float)) and factor > 0)}
    check(not bad_factors, f"train.lr_multipliers={bad_factors}: each factor must be a number > 0")
    check(train.adam_eps > 0, f"train.adam_eps={train.adam_eps}: must be > 0")
    check(all(0 <= beta < 1 for beta in train.adam_betas),
          f"train.adam_betas={tuple(train.adam_betas)}: each must be in [0, 1)")
    check(train.weight_decay >= 0, f"train.weight_decay={train.weight_decay}: must be >= 0")
    check(train.max_grad_norm >= 0, f"train.max_grad_norm={train.max_grad_norm}: must be >= 0 (0 disables clipping)")
    unknown = [name for name in train.no_weight_decay_on if name not in NO_DECAY_GROUPS]
    check(not unknown, f"train.no_weight_decay_on={tuple(train.no_weight_decay_on)}: unknown {unknown}; "
                       f"use any of {', '.join(NO_DECAY_GROUPS)}")
    check(train.mini_batches_per_step >= 1,
          f"train.mini_batches_per_step={train.mini_batches_per_step}: need at least 1")
    check(train.mini_batches_per_step <= rollout.prompts_per_step * rollout.n_samples_per_prompt,
          f"train.mini_batches_per_step={train.mini_batches_per_step} exceeds the rollouts of a step "
          f"(rollout.prompts_per_step x n_samples_per_prompt = {rollout.prompts_per_step * rollout.n_samples_per_prompt})")
    check(train.ppo_epochs >= 1, f"train.ppo_epochs={train.ppo_epochs}: need at least 1")
    check(train.max_consecutive_nonfinite_steps >= 1,
          f"train.max_consecutive_nonfinite_steps={train.max_consecutive_nonfinite_steps}: need at least 1")


def check_eval_options(cfg: MoltConfig, check, *, require_files: bool = True) -> None:
    """The eval section: evaluation during training (molt.controller.evaluation) and `python -m molt.eval`."""
    evaluation = cfg.eval
    check(evaluation.every_steps >= 0, f"eval.every_steps={evaluation.every_steps}: must be >= 0 (0 = off)")
    check(evaluation.n_samples >= 1, f"eval.n_samples={evaluation.n_samples}: need at least 1 (the k of avg@k)")
    check(evaluation.temperature > 0, f"eval.temperature={evaluation.temperature}: must be > 0")
    check(0 < evaluation.top_p <= 1, f"eval.top_p={evaluation.top_p}: must be in (0, 1]")
    check(evaluation.max_response_tokens >= 0,
          f"eval.max_response_tokens={evaluation.max_response_tokens}: must be >= 0 (0 = rollout.max_response_tokens)")
    check(evaluation.max_response_tokens < cfg.rollout.max_length,
          f"eval.max_response_tokens={evaluation.max_response_tokens} must be below "
          f"rollout.max_length={cfg.rollout.max_length}")
    check(evaluation.max_prompts >= 0, f"eval.max_prompts={evaluation.max_prompts}: must be >= 0 (0 = all)")
    check(evaluation.holdout_rows >= 0, f"eval.holdout_rows={evaluation.holdout_rows}: must be >= 0")
    check(not (evaluation.data_path and evaluation.holdout_rows),
          f"eval.data_path={evaluation.data_path!r} and eval.holdout_rows={evaluation.holdout_rows} both name the "
          f"eval set: set one (holdout_rows splits data.train_path; leave data_path '')")
    # Checked when training will evaluate (python -m molt.eval checks the file it is given itself).
    check(not (evaluation.every_steps and evaluation.data_path and require_files)
          or Path(evaluation.data_path).is_file(),
          f"eval.data_path={evaluation.data_path!r} is not a file: point it at a .jsonl or .parquet prompt set")
    check(not evaluation.every_steps or bool(evaluation.data_path) or evaluation.holdout_rows > 0,
          f"eval.every_steps={evaluation.every_steps} needs an eval set: set eval.data_path, or eval.holdout_rows "
          f"to hold out rows of data.train_path")


def check_sft_options(sft: SFTConfig, check) -> None:
    """The sft section's ranges (molt.sft checks that its files exist when it runs)."""
    check(sft.num_steps >= 0, f"sft.num_steps={sft.num_steps}: must be >= 0 (0 = sft.epochs passes over the rows)")
    check(sft.epochs >= 1, f"sft.epochs={sft.epochs}: need at least 1")
    check(sft.batch_size >= 1, f"sft.batch_size={sft.batch_size}: need at least 1 row a step")


def check_colocate(cfg: MoltConfig, check) -> None:
    """layout.colocate and rollout.sleep_while_training against the layout, refit and algorithm."""
    layout, rollout = cfg.layout, cfg.rollout
    if layout.colocate:
        engine_gpus = layout.num_rollout_ranks * layout.engine_tensor_parallel_size
        check(engine_gpus == layout.num_trainer_ranks,
              f"layout.colocate=True puts each engine on trainer ranks' GPUs: layout.num_rollout_ranks="
              f"{layout.num_rollout_ranks} x layout.engine_tensor_parallel_size={layout.engine_tensor_parallel_size}"
              f" = {engine_gpus} must equal layout.num_trainer_ranks={layout.num_trainer_ranks}")
        # torchrun and srun give each node a contiguous block of ranks, and trainers come first, so a
        # node's engines (ranks T..) would land on other nodes than its trainers (ranks 0..T-1).
        check(cfg.device == "cpu" or layout.num_trainer_ranks <= layout.gpus_per_node,
              f"layout.colocate=True runs on one node: layout.num_trainer_ranks={layout.num_trainer_ranks} is more "
              f"than layout.gpus_per_node={layout.gpus_per_node}; use the disaggregated layout "
              f"(layout.colocate=False) across nodes")
        # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected", init.cc).
        check(cfg.refit.backend != "nccl",
              "refit.backend='nccl' with layout.colocate=True: the trainer's sender and the engine share a GPU and "
              "NCCL refuses a duplicate GPU in one communicator; set refit.backend=auto (gloo host staging)")
    check(not rollout.sleep_while_training or layout.colocate,
          "rollout.sleep_while_training=True frees an engine's GPU memory for the trainer rank on the same GPU, "
          "which only layout.colocate=True gives it: set layout.colocate=True or sleep_while_training=False")
    check(not rollout.sleep_while_training or cfg.algorithm.max_staleness == 0,
          f"rollout.sleep_while_training=True stops generation while the trainer steps, but "
          f"algorithm.max_staleness={cfg.algorithm.max_staleness} streams rollouts during the step: set "
          f"algorithm.max_staleness=0 (synchronous)")


def check_device_options(cfg: MoltConfig, device_type: str) -> None:
    """Settings that depend on where the trainer computes ('cpu' or 'cuda'), checked once it is known."""
    check_cpu_offload(cfg, device_type)
    rollout = cfg.rollout
    if rollout.sleep_while_training and device_type == "cpu":
        # vllm/platforms/interface.py, is_sleep_mode_available: CUDA, ROCm and XPU only.
        raise ConfigError("rollout.sleep_while_training=True on a CPU run: vLLM's sleep mode is CUDA-only (its CPU "
                          "backend refuses enable_sleep_mode); set rollout.sleep_while_training=false")
    if cfg.layout.colocate and device_type == "cuda" and (rollout.engine_memory_fraction <= 0
                                                          or rollout.kv_cache_gigabytes > 0):
        # vllm/v1/worker/utils.py, request_memory: an engine needs gpu_memory_utilization x the GPU free at
        # start even when kv_cache_memory_bytes sizes its cache, so a byte budget alone asks for vLLM's
        # default 0.92 of a GPU the trainer rank shares.
        raise ConfigError(f"layout.colocate=True on GPUs sizes each engine by rollout.engine_memory_fraction (now "
                          f"{rollout.engine_memory_fraction:g}), its share of the GPU it shares with a trainer rank: "
                          f"set it (e.g. 0.4; --dry-run shows what the trainer needs) and leave "
                          f"rollout.kv_cache_gigabytes at 0 (now {rollout.kv_cache_gigabytes:g})")


def engine_start_seconds(checkpoint_bytes: int, engines_per_node: int = 1) -> float:
    """The engine-start limit for a checkpoint of `checkpoint_bytes`: the `engines_per_node` engines of a
    node read the whole checkpoint at once from its storage, then compile and capture CUDA graphs
    (ENGINE_START_BASE_SECONDS)."""
    return (ENGINE_START_BASE_SECONDS
            + ENGINE_START_SECONDS_PER_GIGABYTE * engines_per_node * checkpoint_bytes / 2**30)


def count_engines_per_node(layout: LayoutConfig) -> int:
    """The most engines one node hosts (molt.distributed.placement.place_ranks: colocated, all on the one node)."""
    if layout.colocate:
        return layout.num_rollout_ranks
    return max(1, min(layout.num_rollout_ranks, layout.gpus_per_node // max(1, layout.engine_tensor_parallel_size)))


def checkpoint_bytes(model_path: str) -> int:
    """Bytes of the weight files (*.safetensors, *.bin) of a Hugging Face directory; 0 where there are none."""
    if not model_path or not os.path.isdir(model_path):
        return 0
    return sum(entry.stat().st_size for entry in os.scandir(model_path)
               if entry.is_file() and entry.name.endswith((".safetensors", ".bin")))


def engine_start_limit_seconds(cfg: MoltConfig, num_bytes: int | None = None) -> float:
    """The longest wait for the engines: rollout.engine_start_timeout_seconds, or when it is 0 (auto)
    engine_start_seconds of model.path's weight files (or of `num_bytes`, given when they are absent)."""
    if cfg.rollout.engine_start_timeout_seconds > 0:
        return cfg.rollout.engine_start_timeout_seconds
    return engine_start_seconds(checkpoint_bytes(cfg.model.path) if num_bytes is None else num_bytes,
                                count_engines_per_node(cfg.layout))


def resolve_enforce_eager(enforce_eager: bool | None, *, on_gpu: bool) -> bool:
    """rollout.enforce_eager, None = auto: CUDA graphs on GPUs (faster decode), eager on CPU, where
    vLLM's CPU backend would compile the model (slow starts, and no route capture: molt.rollout.route_capture)."""
    if enforce_eager is not None:
        return enforce_eager
    return not on_gpu


def check_cpu_offload(cfg: MoltConfig, device_type: str) -> None:
    """train.cpu_offload is a GPU memory control: refused where the trainer computes on CPU."""
    if cfg.train.cpu_offload and device_type == "cpu":
        raise ConfigError("train.cpu_offload=True on a CPU run: it keeps parameters, gradients and AdamW state in "
                          "host memory to save GPU memory, and a CPU trainer holds them there already; set "
                          "train.cpu_offload=false (or run on GPUs)")


def build_arg_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="recipe file, PATH[:FUNCTION] (default function: config)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the layout, start nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser("Print the resolved Molt config.").parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        validate_config(cfg)
    except ConfigError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    sys.stdout.write(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return 0

