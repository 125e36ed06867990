"""The run configuration's schema: one dataclass per section, each field with a docstring that
states its units and sentinel values, and each section's `check()` of its own ranges.

A field that takes one of a fixed set of words is a `Literal[...]`: one rule (molt.config.fields)
checks every such field, in `--set` and in a recipe, and names the closest word. Rules that span
sections live in molt.config.validate."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from molt.choices import ImportanceLevel, ImportanceMode, KLEstimator, LossAggregation
from molt.config.engine_args import engine_args_errors

EngineDtype = Literal["float32", "bfloat16", "float16"]  # what vLLM serves
Dtype = Literal[EngineDtype, "float64"]  # what the trainer may store and compute in


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and the fix."""


def failing(*rules: tuple[bool, str]) -> list[str]:
    """The messages of the rules, (holds, message) pairs, that do not hold."""
    return [message for holds, message in rules if not holds]


def raise_config_errors(errors: list[str]) -> None:
    """One ConfigError listing every error, if there is any."""
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


class ConfigSection:
    """Base of every config dataclass: assigning a name that is not a field fails, so a recipe typo
    (`cfg.train.lerning_rate = 1e-4`) is refused instead of kept as an attribute nothing reads."""

    def __setattr__(self, name: str, value) -> None:
        if name not in self.__dataclass_fields__:
            raise ConfigError(_unknown_field_message(type(self), name))
        object.__setattr__(self, name, value)

    def check(self) -> list[str]:
        """This section's own range errors (a section without ranges has none)."""
        return []

    def at_least(self, name: str, low: int, note: str = "") -> tuple[bool, str]:
        """The rule `name >= low`, for check(): `train.num_steps=0: need at least 1` (a count) or
        `agent.max_failed_steps=-1: must be >= 0 (0 never stops the job)`."""
        value, count = getattr(self, name), type(self.__dataclass_fields__[name].default) is int
        need = "need at least 1" if count and low == 1 else f"must be >= {low}"
        return value >= low, f"{_section_prefix(type(self))}{name}={value}: {need}" + (f" ({note})" if note else "")

    def above(self, name: str, low: int) -> tuple[bool, str]:
        """The rule `name > low`, for check(): `rollout.temperature=0: must be > 0`."""
        return getattr(self, name) > low, f"{_section_prefix(type(self))}{name}={getattr(self, name)}: must be > {low}"


def closest(name: str, candidates: list[str], cutoff: float = 0.6) -> str | None:
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def _section_prefix(cls: type) -> str:
    """'train.' for TrainConfig, '' for the root MoltConfig."""
    return next((f"{f.name}." for f in dataclasses.fields(MoltConfig) if f.default_factory is cls), "")


def _unknown_field_message(cls: type, name: str) -> str:
    prefix, fields = _section_prefix(cls), list(cls.__dataclass_fields__)
    close = closest(name, fields)
    fix = f"did you mean {prefix + close!r}?" if close else f"its fields are {', '.join(fields)}"
    return f"{prefix}{name}: {cls.__name__} has no field {name!r}; {fix}"


@dataclass(kw_only=True)
class ModelConfig(ConfigSection):
    path: str = ""
    """Hugging Face model directory used by the trainer and the engines."""
    dtype: EngineDtype = "float32"
    """Parameter dtype on trainer and engines: float32 | bfloat16 | float16."""
    config_path: str = ""
    """--dry-run only: a Hugging Face config.json (or its directory) describing model.path's
    architecture, read when model.path has no config.json on this machine ('' = none); no weights."""

    def check(self) -> list[str]:
        return failing((bool(self.path), "model.path is empty: set it to a Hugging Face model directory"))


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

    def check(self) -> list[str]:
        tensor_parallel, gpus_per_node = self.engine_tensor_parallel_size, self.gpus_per_node
        engine_gpus = self.num_rollout_ranks * tensor_parallel
        return failing(
            self.at_least("num_trainer_ranks", 1),
            self.at_least("num_rollout_ranks", 1),
            self.at_least("engine_tensor_parallel_size", 1),
            self.at_least("gpus_per_node", 1),
            (tensor_parallel < 1 or gpus_per_node < 1 or gpus_per_node % tensor_parallel == 0,
             f"layout.engine_tensor_parallel_size={tensor_parallel} does not divide layout.gpus_per_node="
             f"{gpus_per_node}: an engine's GPUs must share one node; use one of "
             f"{[size for size in range(1, gpus_per_node + 1) if gpus_per_node % size == 0]}"),
            self.at_least("gpu_memory_gigabytes", 0, "0 skips the check"),
            (not self.colocate or engine_gpus == self.num_trainer_ranks,
             f"layout.colocate=True puts each engine on trainer ranks' GPUs: layout.num_rollout_ranks="
             f"{self.num_rollout_ranks} x layout.engine_tensor_parallel_size={tensor_parallel}"
             f" = {engine_gpus} must equal layout.num_trainer_ranks={self.num_trainer_ranks}"),
        ) + self.trainer_mesh_errors()

    def trainer_mesh_errors(self) -> list[str]:
        """The trainer mesh dp_replicate x dp_shard x cp x tp must tile num_trainer_ranks, and ep borrows
        from the dp_shard ranks (dp_shard = dp_shard_mod_ep x ep); the model's side (num_experts
        divisible, not dense) is checked when the model is laid out."""
        names = ("trainer_data_parallel_replicate", "trainer_context_parallel_size", "trainer_tensor_parallel_size")
        sizes = [getattr(self, name) for name in names]
        product = math.prod(max(size, 1) for size in sizes)
        dp_shard, ep = self.num_trainer_ranks // max(product, 1), self.trainer_expert_parallel_size
        return failing(
            *(self.at_least(name, 1) for name in names),
            (self.num_trainer_ranks % product == 0,
             f"layout.num_trainer_ranks={self.num_trainer_ranks} is not a multiple of trainer_data_parallel_replicate "
             f"x trainer_context_parallel_size x trainer_tensor_parallel_size = "
             f"{' x '.join(map(str, sizes))} = {product}: the trainer mesh is dp_replicate x "
             f"dp_shard x cp x tp"),
            self.at_least("trainer_expert_parallel_size", 1),
            (ep < 1 or dp_shard % ep == 0,
             f"layout.trainer_expert_parallel_size={ep} does not divide the dp_shard size {dp_shard} "
             f"(num_trainer_ranks / (replicate x cp x tp)): expert parallelism splits the data-parallel shard "
             f"ranks; use one of "
             f"{[size for size in range(1, dp_shard + 1) if dp_shard % size == 0]}"),
            (ep == 1 or self.trainer_tensor_parallel_size == 1,
             f"layout.trainer_expert_parallel_size={ep} with trainer_tensor_parallel_size="
             f"{self.trainer_tensor_parallel_size}: Molt does not tensor-parallelise MoE models; set tp to 1"),
        )


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
    on_failed_rollout: Literal["drop_group", "refill"] = "drop_group"
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
    on_context_exhausted: Literal["train_truncated", "fail"] = "train_truncated"
    """ChatAgents: a request whose conversation no longer fits rollout.max_length gets the API's
    context-length error; then train_truncated keeps the segments captured so far, marked truncated,
    with the agent's reward (context_exhausted_reward if the agent raised) | fail (the rollout fails)."""
    context_exhausted_reward: float = 0.0
    """train_truncated only: the reward of a rollout whose agent raised after its context was exhausted."""
    share_tls_context: bool = True
    """ChatAgents: SDK clients built per rollout share one default TLS context instead of loading the
    CA bundle each time (~30-50 ms of CPU per client; see molt/agents/tls.py)."""

    def check(self) -> list[str]:
        return failing(
            self.at_least("max_turns", 1),
            self.above("rollout_timeout_seconds", 0),
            self.at_least("max_refills_per_group", 0, "0 never refills"),
            self.at_least("max_failed_steps", 0, "0 never stops the job"),
            self.at_least("max_concurrent_rollouts", 1),
        )


# Each engine worker's KV cache when neither rollout.kv_cache_gigabytes nor engine_memory_fraction is set,
# on CPU: vLLM's CPU backend sizes by bytes, and a share of a NUMA node's memory varies from machine to machine.
DEFAULT_KV_CACHE_GIGABYTES = 1.0
# The share of its own GPU an engine fills when neither is set (vLLM 0.32's CacheConfig default is 0.92;
# 0.9 leaves the refit's NCCL buffers room).
DEFAULT_GPU_ENGINE_MEMORY_FRACTION = 0.9


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


    def check(self) -> list[str]:
        # vLLM's own argument names: engine_args_errors imports vLLM, so only when there are any.
        return failing(
            self.at_least("prompts_per_step", 1),
            self.at_least("n_samples_per_prompt", 1),
            self.at_least("num_agent_workers", 1, "agent code runs only in agent worker processes"),
            (self.max_response_tokens < self.max_length,
             f"rollout.max_response_tokens={self.max_response_tokens} must be below "
             f"rollout.max_length={self.max_length}"),
            self.at_least("max_response_tokens", 1),
            self.above("temperature", 0),
            self.at_least("engine_threads", 0, "0 = vLLM's default"),
            (self.engine_start_timeout_seconds >= 0,
             f"rollout.engine_start_timeout_seconds={self.engine_start_timeout_seconds}: must be > 0, or 0 for "
             f"auto (scaled with the checkpoint's size)"),
            (self.top_p == 1.0,
             f"rollout.top_p={self.top_p}: must be 1.0; the trainer recomputes log-probs over the full vocabulary, "
             f"so nucleus sampling would make them differ from the behaviour log-probs (the sampling contract, "
             f"docs/agents.md)"),
            (0 <= self.engine_memory_fraction <= 1,
             f"rollout.engine_memory_fraction={self.engine_memory_fraction}: must be in (0, 1], or 0 to leave it "
             f"unset"),
            (self.kv_cache_gigabytes >= 0,
             f"rollout.kv_cache_gigabytes={self.kv_cache_gigabytes}: must be > 0, or 0 to leave it unset"),
            (not (self.kv_cache_gigabytes > 0 and self.engine_memory_fraction > 0),
             f"rollout.kv_cache_gigabytes={self.kv_cache_gigabytes} and rollout.engine_memory_fraction="
             f"{self.engine_memory_fraction} both size the engine: set one of them and leave the other at 0 "
             f"(kv_cache_gigabytes, a byte budget, fits any machine with that much memory free)"),
        ) + (engine_args_errors(self.engine_args) if self.engine_args else [])
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


# train.activation_checkpointing: none | full | every_n:<k>, k >= 1
ACTIVATION_CHECKPOINTING = re.compile(r"none|full|every_n:0*[1-9]\d*")


def activation_checkpointing_error(spec: str) -> str:
    return (f"train.activation_checkpointing={spec!r}: use none, full or every_n:<k> with k >= 1 "
            f"(e.g. every_n:2 checkpoints blocks 0, 2, 4, ...)")


def parse_activation_checkpointing(spec: str) -> int:
    """train.activation_checkpointing as a block stride: 0 = none, 1 = every block, k = every k-th."""
    if ACTIVATION_CHECKPOINTING.fullmatch(spec) is None:
        raise ConfigError(activation_checkpointing_error(spec))
    if spec in ("none", "full"):
        return int(spec == "full")
    return int(spec.removeprefix("every_n:"))


@dataclass(kw_only=True)
class TrainConfig(ConfigSection):
    num_steps: int = 100
    """Optimizer steps to run."""
    learning_rate: float = 1e-5
    """AdamW peak learning rate (lr_schedule shapes it over the steps)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
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
    no_weight_decay_on: tuple[Literal["norms", "biases", "embeddings"], ...] = ()
    """Parameters exempt from weight decay: any of norms, biases, embeddings (e.g. (norms, biases))."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    max_tokens_per_micro_batch: int = 8192
    """Tokens per forward/backward on one trainer rank: packed tokens with packing, else rows x longest row."""
    param_dtype: Dtype = "float32"
    """Stored (master) dtype of trained weights, their gradients and AdamW state: float32 | bfloat16 |
    float64. The engines serve model.dtype; refit casts to it."""
    compute_dtype: Literal["", Dtype] = ""
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

    def check(self) -> list[str]:
        bad_factors = {prefix: factor for prefix, factor in self.lr_multipliers.items()
                       if not (isinstance(factor, (int, float)) and factor > 0)}
        return failing(
            self.at_least("num_steps", 1),
            (ACTIVATION_CHECKPOINTING.fullmatch(self.activation_checkpointing) is not None,
             activation_checkpointing_error(self.activation_checkpointing)),
            self.at_least("logprob_chunk_tokens", 1),
            self.at_least("warmup_steps", 0, "0 = no warmup"),
            (0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]"),
            self.above("learning_rate", 0),
            (not bad_factors, f"train.lr_multipliers={bad_factors}: each factor must be a number > 0"),
            self.above("adam_eps", 0),
            (all(0 <= beta < 1 for beta in self.adam_betas),
             f"train.adam_betas={tuple(self.adam_betas)}: each must be in [0, 1)"),
            self.at_least("weight_decay", 0),
            self.at_least("max_grad_norm", 0, "0 disables clipping"),
            self.at_least("mini_batches_per_step", 1),
            self.at_least("ppo_epochs", 1),
            self.at_least("max_consecutive_nonfinite_steps", 1),
        )


# Advantage estimators whose baseline is the rest of the prompt's group (the others work per token).
GroupEstimator = Literal["grpo", "dr_grpo", "group_mean", "rloo"]
GROUP_ESTIMATORS = get_args(GroupEstimator)


@dataclass(kw_only=True)
class AlgorithmConfig(ConfigSection):
    advantage_estimator: Literal[GroupEstimator, "reinforce_pp", "gae"] = "grpo"
    """grpo | dr_grpo | group_mean | rloo (per rollout, within its prompt group) | reinforce_pp |
    gae (per token; gae trains a critic). Formulas in docs/objectives.md."""
    gamma: float = 1.0
    """reinforce_pp, gae: discount per action token (observation tokens between turns cost none)."""
    gae_lambda: float = 0.95
    """gae: the GAE lambda (1 = Monte-Carlo returns minus values)."""
    whiten_advantages: bool = True
    """gae: whiten the advantages over the batch's action tokens (reinforce_pp always whitens)."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """ppo (clipped token ratios) | gspo (clipped sequence ratio, Zheng et al. 2025) | cispo (REINFORCE
    with a clipped stop-gradient token weight, MiniMax-M1); formulas in docs/objectives.md."""
    clip_eps_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_eps_high: float = 0.2
    """PPO ratio clip above 1 (raise for DAPO's clip-higher)."""
    dual_clip: float = 0.0
    """Dual clip: cap the loss of a negative-advantage token at -c * A; c > 1, 0 = off."""
    loss_aggregation: LossAggregation = "token_mean"
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
    importance_level: Literal["off", ImportanceLevel] = "off"
    """Correct the trainer/engine mismatch with importance weights exp(trainer - behaviour log-prob):
    off | token | seq | geo (token+trunc = TIS, token+mask = IcePop, geo+mask = seq-mask-tis)."""
    importance_mode: ImportanceMode = "trunc"
    """mask (weight 0 outside importance_band) | clip (clamp into the band) | trunc (cap at its top);
    seq and geo take only mask."""
    importance_band: tuple[float, float] = (0.5, 2.0)
    """[low, high] for the importance ratio (trunc uses only high)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = off; > 0 computes the entropy over the vocabulary each micro-batch)."""
    kl_coef: float = 0.0
    """Weight of the KL to a frozen reference copy of the initial policy; 0 = no reference model."""
    kl_estimator: KLEstimator = "k3"
    """k1 | k2 | k3 (Schulman's estimators of KL(policy || reference), per action token)."""
    kl_placement: Literal["loss", "reward"] = "loss"
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

    def check(self) -> list[str]:
        level, mode, (low, high) = self.importance_level, self.importance_mode, self.importance_band
        return failing(
            (0 < self.gamma <= 1, f"algorithm.gamma={self.gamma}: must be in (0, 1]"),
            (0 <= self.gae_lambda <= 1, f"algorithm.gae_lambda={self.gae_lambda}: must be in [0, 1]"),
            (0 <= self.clip_eps_low < 1, f"algorithm.clip_eps_low={self.clip_eps_low}: must be in [0, 1)"),
            self.at_least("clip_eps_high", 0),
            (self.dual_clip == 0 or self.dual_clip > 1, f"algorithm.dual_clip={self.dual_clip}: use 0 (off) or > 1"),
            (self.dual_clip == 0 or self.policy_loss == "ppo",
             f"algorithm.dual_clip={self.dual_clip} caps PPO's token terms; algorithm.policy_loss={self.policy_loss!r} "
             f"has none to cap: set dual_clip=0"),
            self.at_least("loss_constant_tokens", 0, "0 = rollout.max_response_tokens"),
            (self.loss_constant_tokens == 0 or self.loss_aggregation == "constant",
             f"algorithm.loss_constant_tokens={self.loss_constant_tokens} sets the constant aggregation's divisor, "
             f"which algorithm.loss_aggregation={self.loss_aggregation!r} does not use: set "
             f"loss_aggregation=constant, or loss_constant_tokens=0"),
            self.at_least("trust_region_kl", 0, "0 = off"),
            self.at_least("trust_region_weight_cap", 1,
                          "a cap below 1 would shrink even the tokens on which trainer and engine agree"),
            (self.trust_region_kl == 0 or level in ("off", "token"),
             f"algorithm.trust_region_kl={self.trust_region_kl} rejects sequences by their KL and "
             f"algorithm.importance_level={level!r} rejects them by their ratio: use one rule, e.g. "
             f"importance_level=token (or off) with the trust region"),
            (level not in ("seq", "geo") or mode == "mask",
             f"algorithm.importance_level={level!r} with importance_mode={mode!r}: seq and geo take only mask"),
            (0 <= low < high, f"algorithm.importance_band={self.importance_band}: need 0 <= low < high"),
            self.at_least("entropy_coef", 0),
            self.at_least("kl_coef", 0),
            self.at_least("kl_target", 0, "0 = fixed kl_coef"),
            (self.kl_target == 0 or self.kl_coef > 0,
             f"algorithm.kl_target={self.kl_target} adapts kl_coef, which is 0: set a starting algorithm.kl_coef > 0"),
            self.above("kl_horizon", 0),
            self.above("critic_learning_rate", 0),
            self.at_least("value_clip", 0, "0 = unclipped"),
            (self.max_staleness == 0 or level != "off",
             f"algorithm.max_staleness={self.max_staleness} trains on tokens sampled by older weights: it needs "
             f"algorithm.importance_level (e.g. token) to correct for them"),
            self.at_least("max_staleness", 0, "0 = synchronous"),
            (len(self.filter_band) == 2 and self.filter_band[0] < self.filter_band[1],
             f"algorithm.filter_band={tuple(self.filter_band)}: needs (low, high) with low < high "
             f"(e.g. (0.0, 1.0) drops all-wrong and all-right groups of 0/1 rewards)"),
            self.at_least("max_backfill_prompts", 0, "0 never backfills"),
            (self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
             f"algorithm.router_aux_loss_coef={self.router_aux_loss_coef}: must be >= 0 (0 = off), or None for the "
             f"model config's router_aux_loss_coef"),
            self.at_least("overlong_penalty_factor", 0),
            self.at_least("kl_clamp", 0, "0 = uncapped"),
        )


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

    def check(self) -> list[str]:
        """Ranges only: molt.sft checks that its files exist when it runs."""
        return failing(
            self.at_least("num_steps", 0, "0 = sft.epochs passes over the rows"),
            self.at_least("epochs", 1),
            (self.batch_size >= 1, f"sft.batch_size={self.batch_size}: need at least 1 row a step"),
        )


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
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """How weights reach the engines: 'gloo' (host memory over TCP; what CPU runs use), 'nccl'
    (vLLM's NCCL weight-transfer engine, GPU to GPU), 'auto' = nccl when the trainer runs on CUDA."""
    receiver_cls: str = "molt.rollout.worker_extension.WorkerExtension"
    """The class vLLM mixes into its workers to receive and load weights and record MoE routes (a
    subclass of molt.rollout.worker_extension.WorkerExtension may change how weights are loaded); a
    dotted path importable in the engine's worker processes."""

    def check(self) -> list[str]:
        return failing(
            self.above("bucket_megabytes", 0),
            self.above("timeout_seconds", 0),
            self.at_least("check_every_steps", 0, "0 = never"),
            self.at_least("max_attempts", 1),
        )


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

    def check(self) -> list[str]:
        return failing(
            self.at_least("interval_steps", 0, "0 = never"),
            self.at_least("keep_last", 1),
            (self.resume in ("", "auto") or os.path.isdir(self.resume),
             f"checkpoint.resume={self.resume!r}: '' | 'auto' | an existing step_<N> checkpoint directory"),
        )


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

    def check(self) -> list[str]:
        return failing(
            self.at_least("budget_megabytes", 0, "0 spills every payload"),
            self.above("fetch_timeout_seconds", 0),
            self.at_least("inline_bytes", 0, "0 sends every payload through the store"),
            (not self.node_id or bool(re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.node_id)),
             f"payloads.node_id={self.node_id!r}: 1-64 characters of letters, digits, '_', '.', '-'"),
        )


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

    def due(self, step: int) -> bool:
        """Whether the policy after `step` training steps is evaluated (step 0: the initial policy)."""
        if not self.every_steps:
            return False
        return self.at_start if step == 0 else step % self.every_steps == 0

    def check(self) -> list[str]:
        """Ranges only; validate_config checks the eval file when training will evaluate (python -m
        molt.eval checks the file it is given itself)."""
        return failing(
            self.at_least("every_steps", 0, "0 = off"),
            self.at_least("n_samples", 1, "the k of avg@k"),
            self.above("temperature", 0),
            (0 < self.top_p <= 1, f"eval.top_p={self.top_p}: must be in (0, 1]"),
            self.at_least("max_response_tokens", 0, "0 = rollout.max_response_tokens"),
            self.at_least("max_prompts", 0, "0 = all"),
            self.at_least("holdout_rows", 0),
            (not (self.data_path and self.holdout_rows),
             f"eval.data_path={self.data_path!r} and eval.holdout_rows={self.holdout_rows} both name the "
             f"eval set: set one (holdout_rows splits data.train_path; leave data_path '')"),
            (not self.every_steps or bool(self.data_path) or self.holdout_rows > 0,
             f"eval.every_steps={self.every_steps} needs an eval set: set eval.data_path, or eval.holdout_rows "
             f"to hold out rows of data.train_path"),
        )


@dataclass(kw_only=True)
class MetricsConfig(ConfigSection):
    output_dir: str = ""
    """Run directory for metrics.jsonl, config.json and W&B files ('' = runs/<name>)."""
    wandb_mode: Literal["disabled", "offline", "online"] = "disabled"
    """W&B: disabled | offline | online."""
    wandb_project: str = "molt"
    """W&B project name."""


@dataclass(kw_only=True)
class MoltConfig(ConfigSection):
    name: str = "run"
    """Run name, used for the output directory and W&B."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
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

    def check(self) -> list[str]:
        """Every section's own range errors, and the run's own fields'."""
        sections = [value for value in vars(self).values() if isinstance(value, ConfigSection)]
        own = failing(self.at_least("seed", 0, "the engines' samplers take unsigned seeds"))
        return own + [error for section in sections for error in section.check()]
