"""`--dry-run`: check a recipe at its real world size in one CPU process; nothing starts.

It validates the config, places every rank on a node and its GPUs, builds the trainer mesh over a
fake process group of the job's world size (rank 0's view), builds the model from its Hugging Face
config on the meta device (no weights), shards it with the trainer's FSDP2 units and reads rank 0's
shards from the DTensors, then prints bytes per trainer rank and per engine GPU. Every problem is a
ConfigError naming the field, raised after the lines that led to it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from molt.config import ConfigError, MoltConfig, failing, validate_config
from molt.models.moe import count_experts
from molt.distributed.placement import Placement, count_per_node, describe_launcher, place_ranks, span

GIB = 2**30
ROUTED_EXPERT = re.compile(r"(?:^|\.)experts\.")  # routed experts; a shared expert is dense compute
PROMPT_SAMPLE_ROWS = 1000  # prompt rows --dry-run validates (the job validates every row)


@dataclass(frozen=True)
class ModelFootprint:
    """Parameter counts of the model and of rank 0's FSDP2 shards."""

    architecture: str
    num_params: int
    num_routed_expert_params: int
    num_active_params: int | None  # per token, when the config names its experts and top-k
    num_head_params: int  # untied LM head (the critic has none); 0 when tied
    num_blocks: int
    largest_unit: tuple[str, int]  # (FSDP unit, unsharded parameters)
    rank0_shard_params: int  # parameters rank 0 holds after fully_shard, read from the DTensors
    mesh: str
    hidden_size: int
    vocab_size: int
    num_checkpointed_blocks: int  # decoder blocks under activation checkpointing


def describe_placements(cfg: MoltConfig, placements: list[Placement],
                        checkpoint_bytes: int | None = None) -> Iterator[str]:
    """The layout, each rank's node and GPUs, the refit backend, the trainer group's timeout and the
    launch command. `checkpoint_bytes`: the model's size where model.path is absent (the engine-start limit)."""
    from molt.distributed.timeouts import trainer_group_timeout
    from molt.refit.backends import resolve_backend

    layout, on_gpu = cfg.layout, cfg.device != "cpu"
    nodes: dict[int, list[Placement]] = {}
    for placement in placements:
        nodes.setdefault(placement.node, []).append(placement)
    num_gpus = len({(placement.node, gpu) for placement in placements for gpu in placement.gpus})  # colocate shares
    yield (f"layout: {cfg.world_size} ranks = {layout.num_trainer_ranks} trainer + {layout.num_rollout_ranks} "
           f"rollout" + (f"; {num_gpus} GPUs on {len(nodes)} node(s) of {layout.gpus_per_node} "
                         f"(layout.gpus_per_node)" if on_gpu else "; device=cpu: one machine, no GPUs"))
    if on_gpu:
        for node, members in nodes.items():
            used = sorted({gpu for member in members for gpu in member.gpus})
            yield (f"  node {node}: {len(members)} process(es), ranks {span([m.rank for m in members])}, "
                   f"GPUs {span(used)}")
    yield "ranks:"
    for placement in placements:
        where = (f"node {placement.node}, local rank {placement.local_rank}, "
                 f"GPU{'s' if len(placement.gpus) > 1 else ''} {span(list(placement.gpus))}: ") if on_gpu else ""
        if placement.is_trainer:
            tp = layout.trainer_tensor_parallel_size
            role = (f"trainer (data-parallel rank {placement.rank // tp}/{layout.num_trainer_ranks // tp}"
                    + (f", tensor-parallel rank {placement.rank % tp}/{tp}" if tp > 1 else "") + ")")
            role += " + rollout controller + refit sender" if placement.rank == 0 else ""
        else:
            role = (f"rollout: vLLM engine (tensor parallel {layout.engine_tensor_parallel_size}) + "
                    f"{cfg.rollout.num_agent_workers} agent worker process(es)")
        yield f"  rank {placement.rank}: {where}{role}"
    if layout.colocate:
        yield ("colocated (layout.colocate): each engine shares its GPUs with trainer ranks" if on_gpu else
               "colocated (layout.colocate): on CPU trainer and engine share the cores as in any CPU run; only the "
               "refit backend and the engine's memory sizing follow the flag")
    backend = resolve_backend(cfg.refit.backend, "cuda" if on_gpu else "cpu", colocate=layout.colocate)
    yield (f"refit backend: {backend} (refit.backend={cfg.refit.backend}"
           + (", layout.colocate: NCCL refuses two ranks on one GPU)" if layout.colocate and on_gpu else ")"))
    yield trainer_group_timeout(cfg, checkpoint_bytes).describe(cfg)
    if not on_gpu:
        return
    # A rollout rank is one process; its engine's workers take its GPUs.
    yield f"launch: {describe_launcher(count_per_node(placements))}"
    yield ("note: at start-up every rank checks its host, LOCAL_RANK and GPUs against this placement "
           "(molt.distributed.placement.check_placement); each rollout rank pins its engine to its GPUs with "
           "CUDA_VISIBLE_DEVICES (molt.train.pin_engine_gpus); neither has run on GPUs yet")


def estimate_checkpoint_bytes(cfg: MoltConfig, model: ModelFootprint) -> int:
    """model.path's weight files where they are here, else parameters x model.dtype's width (what the
    engine-start limit scales with)."""
    import torch

    from molt.config import checkpoint_bytes

    return checkpoint_bytes(cfg.model.path) or model.num_params * getattr(torch, cfg.model.dtype).itemsize


def resolve_architecture(cfg: MoltConfig) -> tuple[str, str]:
    """(config.json source, which field named it): model.path's if it has one here, else model.config_path."""
    if cfg.model.path and Path(cfg.model.path, "config.json").is_file():
        return cfg.model.path, "model.path"
    if not cfg.model.config_path:
        raise ConfigError(
            f"model.path={cfg.model.path!r} has no config.json on this machine and model.config_path is empty: "
            f"--dry-run needs the architecture; set model.config_path to a Hugging Face config.json or its "
            f"directory (e.g. configs/hf/qwen3-30b-a3b)")
    source = Path(cfg.model.config_path)
    if not (source.is_file() or Path(source, "config.json").is_file()):
        raise ConfigError(f"model.config_path={cfg.model.config_path!r} is neither a config.json nor a directory "
                          f"holding one")
    return str(source), "model.config_path"


def measure_model(cfg: MoltConfig, source: str, source_field: str) -> ModelFootprint:
    """Build the model on the meta device and shard it like the trainer over a fake process group of
    the job's world size, as rank 0; only shapes exist, so a 1T model costs no memory."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.tensor import DTensor
    # Registers the "fake" backend: collectives return at once, so one process can play rank 0 of any size.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from molt.distributed.parallelize import ShardingPlan, build_trainer_mesh, count_checkpointed_blocks, shard_model
    from molt.models.vision_language import auto_model_class, text_backbone

    transformers.logging.set_verbosity_error()
    try:
        hf_config = transformers.AutoConfig.from_pretrained(source)
        with torch.device("meta"):
            model = auto_model_class(hf_config).from_config(hf_config, dtype=getattr(torch, cfg.train.param_dtype))
    except (ValueError, KeyError, OSError) as error:
        raise ConfigError(f"{source_field}={source!r}: cannot build a causal LM from its config.json: "
                          f"{type(error).__name__}: {error}") from error
    architecture = type(model).__name__  # fully_shard renames the class (FSDP<name>)
    named = dict(model.named_parameters())  # shared (tied) parameters appear once
    num_params = sum(p.numel() for p in named.values())
    num_routed = sum(p.numel() for name, p in named.items() if ROUTED_EXPERT.search(name))
    head = model.get_output_embeddings()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    ep = cfg.layout.trainer_expert_parallel_size  # a block gathers only its rank's share of the experts
    backbone = text_backbone(model)  # model.model, or a vision-language model's text tower
    prefix = next(name for name, module in model.named_modules() if module is backbone)
    blocks = {f"{prefix}.layers.{index}": sum(p.numel() // (ep if ROUTED_EXPERT.search(name) else 1)
                                              for name, p in block.named_parameters())
              for index, block in enumerate(backbone.layers)}
    in_blocks = sum(p.numel() for p in backbone.layers.parameters())
    units = {**blocks, "root (embeddings, final norm, LM head)": num_params - in_blocks}
    if dist.is_initialized():
        raise RuntimeError("--dry-run builds its own fake process group; run it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.world_size)
    try:
        # As in molt.train.run: the world group, the trainer ranks' group, the trainer mesh ("cpu"
        # here: the fake group has no devices; meta parameters stay on meta).
        layout = cfg.layout
        dist.new_group(list(range(layout.num_trainer_ranks)))
        mesh = build_trainer_mesh(num_trainer_ranks=layout.num_trainer_ranks, device_type="cpu",
                                  data_parallel_replicate=layout.trainer_data_parallel_replicate,
                                  tensor_parallel_size=layout.trainer_tensor_parallel_size,
                                  expert_parallel_size=layout.trainer_expert_parallel_size)
        plan = ShardingPlan.from_config(cfg)
        try:
            shard_model(model, backbone, mesh=mesh, plan=dataclasses.replace(plan, cpu_offload=False))
        except ValueError as error:  # a layout the model cannot take (its message names the field)
            raise ConfigError(str(error)) from error
        shards = [p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()]
        replicate = layout.trainer_data_parallel_replicate
        mesh_text = (f"{mesh.mesh!r}: dp_replicate {replicate} x dp_shard {mesh.dp_size // replicate} x tp "
                     f"{mesh.tp_size}, {mesh.dp_size} data-parallel rank(s)")
        if ep > 1:  # the experts' own split of dp_shard
            mesh_text += (f"; experts: dp_shard_mod_ep {mesh.dp_size // replicate // ep} x ep {ep}, "
                          f"each rank holds 1/{ep} of every MoE layer's experts")
    finally:
        dist.destroy_process_group()
    return ModelFootprint(
        architecture=architecture, num_params=num_params, num_routed_expert_params=num_routed,
        num_active_params=_active_params(hf_config, num_params, num_routed),
        num_head_params=0 if tied else head.weight.numel(), num_blocks=len(blocks),
        largest_unit=max(units.items(), key=lambda item: item[1]), rank0_shard_params=sum(shards), mesh=mesh_text,
        hidden_size=hf_config.get_text_config().hidden_size, vocab_size=hf_config.get_text_config().vocab_size,
        num_checkpointed_blocks=count_checkpointed_blocks(len(blocks), plan.checkpoint_every))


def _active_params(hf_config, num_params: int, num_routed: int) -> int | None:
    num_experts = count_experts(hf_config)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not num_routed or not num_experts or not top_k:
        return None
    return num_params - num_routed + num_routed * top_k // num_experts


def describe_memory(cfg: MoltConfig, model: ModelFootprint) -> Iterator[str]:
    """Bytes per trainer rank and per engine GPU, with the formulas; raises when they cannot fit.

    The formula (docs/training.md): with p the stored (master) bytes per parameter (train.param_dtype)
    and c the compute bytes (train.compute_dtype), a trainer rank holds its shard S of parameters
    (S x p), gradients (S x p) and AdamW moments (2 x S x p): 16 B/param for float32 master weights;
    plus the largest FSDP unit U gathered in the compute dtype (U x c) and its unsharded gradient on
    the way to the float32 reduce-scatter (U x 4); plus the loss head ((3 x chunk + hidden) x vocab x 4:
    a chunk's float32 logits, probabilities and gradient, and the head's float32 gradient accumulator);
    a frozen reference adds its shard in the compute dtype, a critic its own 16 B/param state.
    """
    from molt.distributed.parallelize import ShardingPlan

    layout, algo, train = cfg.layout, cfg.algorithm, cfg.train
    plan = ShardingPlan.from_config(cfg)
    p, c = plan.param_dtype.itemsize, plan.forward_dtype.itemsize
    trainers, shard = layout.num_trainer_ranks, model.rank0_shard_params
    where = "host memory (train.cpu_offload)" if plan.cpu_offload else "device"
    compute_name = str(plan.forward_dtype).removeprefix("torch.")
    yield (f"per trainer rank (stored {train.param_dtype}, {p} B/param; compute {compute_name} "
           f"(train.compute_dtype), {c} B/param; rank 0's shard, the largest: {shard:,} params, total / "
           f"{trainers} = {model.num_params / trainers:,.0f}):")
    yield f"  parameters       {_size(shard * p)}   shard x {p} B (master weights; {where})"
    yield f"  gradients        {_size(shard * p)}   shard x {p} B (sharded, in the master dtype; {where})"
    yield f"  AdamW states     {_size(2 * shard * p)}   2 x shard x {p} B (exp_avg, exp_avg_sq; {where})"
    state = 4 * shard * p
    if algo.kl_coef > 0:
        yield f"  reference model  {_size(shard * c)}   shard x {c} B (frozen, stored in the compute dtype; {where})"
        state += shard * c
    if algo.advantage_estimator == "gae":
        critic = -(-(model.num_params - model.num_head_params) // trainers) * p
        yield f"  critic           {_size(4 * critic)}   4 x (params - LM head) / {trainers} x {p} B (its own AdamW; {where})"
        state += 4 * critic
    unit_name, unit_params = model.largest_unit
    tensor_parallel = cfg.layout.trainer_tensor_parallel_size
    if tensor_parallel > 1:  # a rank gathers its tensor-parallel slice of the unit (norms, replicated, are small)
        unit_name, unit_params = f"{unit_name} / tensor parallel {tensor_parallel}", -(-unit_params // tensor_parallel)
    unit = unit_params * (c + 4)
    yield (f"  gathered unit    {_size(unit)}   largest FSDP unit, {unit_name}: {unit_params:,} params x ({c} B "
           f"gathered + 4 B float32 gradient for the reduce-scatter)")
    head = (3 * train.logprob_chunk_tokens + model.hidden_size) * model.vocab_size * 4
    yield (f"  loss head        {_size(head)}   (3 x train.logprob_chunk_tokens={train.logprob_chunk_tokens} + hidden "
           f"{model.hidden_size}) x vocab {model.vocab_size:,} x 4 B (float32 logits, probabilities and their "
           f"gradient per chunk; the LM head's float32 gradient accumulator)")
    kept = model.num_checkpointed_blocks * train.max_tokens_per_micro_batch * model.hidden_size * c
    yield from _describe_activations(cfg, model, kept)
    on_device = unit + head + kept + (0 if plan.cpu_offload else state)
    yield (f"  at least         {_size(on_device)}   on the {'GPU' if cfg.device != 'cpu' else 'device'}, before "
           f"other activations, prefetched units and allocator slack"
           + (f"; plus {_size(state).strip()} of host memory per rank" if plan.cpu_offload else ""))
    yield from _check_gpu_memory(cfg, model, on_device)


def _describe_activations(cfg: MoltConfig, model: ModelFootprint, kept: int) -> Iterator[str]:
    tokens, blocks = cfg.train.max_tokens_per_micro_batch, model.num_checkpointed_blocks
    if not blocks:
        yield ("  activations      not estimated (train.activation_checkpointing=none keeps every block's "
               "intermediates for backward)")
        return
    width = kept // (blocks * tokens * model.hidden_size)
    yield (f"  block inputs     {_size(kept)}   {blocks} checkpointed blocks x train.max_tokens_per_micro_batch="
           f"{tokens} x hidden {model.hidden_size} x {width} B (plus one block's recomputed intermediates"
           + (f", and the {model.num_blocks - blocks} blocks not checkpointed" if blocks < model.num_blocks else "")
           + ")")


def _check_gpu_memory(cfg: MoltConfig, model: ModelFootprint, needed: float) -> Iterator[str]:
    import torch

    layout = cfg.layout
    if cfg.device == "cpu":
        return
    width = getattr(torch, cfg.model.dtype).itemsize
    tensor_parallel = layout.engine_tensor_parallel_size
    engine = model.num_params * width / tensor_parallel
    yield (f"per engine GPU: ~{engine / GIB:.2f} GiB of weights = {model.num_params:,} params x {width} B "
           f"(model.dtype={cfg.model.dtype}) / tensor parallel {tensor_parallel}, before KV cache")
    gpu = layout.gpu_memory_gigabytes * GIB
    if gpu <= 0:
        yield "GPU memory: not checked (layout.gpu_memory_gigabytes=0)"
        return
    memory = cfg.rollout.engine_memory(on_gpu=True, colocate=layout.colocate)
    kv_cache_bytes = memory.get("kv_cache_memory_bytes")
    if kv_cache_bytes is None:  # a share of the GPU holds the weights, the activations and the KV cache
        fraction = memory["gpu_memory_utilization"]
        budget, engine_needs = fraction * gpu, engine
        sizing = f"rollout.engine_memory_fraction x layout.gpu_memory_gigabytes = {budget / GIB:.1f} GiB"
        engine_line = (f"engine weights {engine / GIB:.2f} GiB of the engine's {budget / GIB:.2f} GiB "
                       f"(rollout.engine_memory_fraction={cfg.rollout.engine_memory_fraction:g}"
                       + (", auto: 0.9 of its own GPU" if cfg.rollout.engine_memory_fraction <= 0 else "") + ")")
        fix = "raise rollout.engine_memory_fraction"
    else:  # the weights plus a KV cache of fixed size
        budget, engine_needs = gpu, engine + kv_cache_bytes
        sizing = f"layout.gpu_memory_gigabytes={layout.gpu_memory_gigabytes:g}"
        engine_line = (f"engine weights {engine / GIB:.2f} GiB + KV cache {kv_cache_bytes / GIB:.2f} GiB "
                       f"(rollout.kv_cache_gigabytes), before activations")
        fix = "lower rollout.kv_cache_gigabytes"
    yield (f"GPU memory: {layout.gpu_memory_gigabytes:g} GiB (layout.gpu_memory_gigabytes); a trainer rank needs at "
           f"least {needed / GIB:.2f} GiB; {engine_line}")
    trainer_share = gpu - budget  # colocated: the trainer rank has what the engine on its GPU leaves
    if layout.colocate:
        yield (f"colocated: the trainer rank on each GPU has {trainer_share / GIB:.1f} GiB = (1 - "
               f"rollout.engine_memory_fraction) x layout.gpu_memory_gigabytes while its engine is awake"
               + ("; rollout.sleep_while_training frees the engine's share during the step"
                  if cfg.rollout.sleep_while_training else ""))
    problems = failing(
        (not layout.colocate or needed <= trainer_share,
         f"a trainer rank needs at least {needed / GIB:.1f} GiB but its engine leaves it "
         f"{trainer_share / GIB:.1f} GiB of the GPU: lower rollout.engine_memory_fraction (now "
         f"{cfg.rollout.engine_memory_fraction:g}), set train.cpu_offload, or shard finer over more trainer ranks"),
        (needed <= gpu, f"a trainer rank needs at least {needed / GIB:.1f} GiB but layout.gpu_memory_gigabytes="
                        f"{layout.gpu_memory_gigabytes:g}: raise layout.num_trainer_ranks (now "
                        f"{layout.num_trainer_ranks}) to shard finer, or set train.cpu_offload"),
        (engine_needs <= budget,
         f"an engine GPU needs {engine_needs / GIB:.1f} GiB for its weights"
         f"{'' if kv_cache_bytes is None else ' and KV cache'} but gets {sizing}: raise "
         f"layout.engine_tensor_parallel_size (now {tensor_parallel}, at most layout.gpus_per_node="
         f"{layout.gpus_per_node}) or {fix}"))
    if problems:
        raise ConfigError("does not fit:\n  " + "\n  ".join(problems))


def _size(num_bytes: float) -> str:
    """Right-aligned in GiB, or MiB / KiB for a small model."""
    scale, unit = next((2**shift, name) for shift, name in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                       if num_bytes >= 2**shift or shift == 0)
    return f"{num_bytes / scale:8.2f} {unit}"


def describe_files(cfg: MoltConfig) -> Iterator[str]:
    yield f"files the run reads (--dry-run reports them and checks the first {PROMPT_SAMPLE_ROWS:,} prompt rows):"
    for name, path, needed in (("model.path", cfg.model.path, Path(cfg.model.path, "config.json")),
                               ("data.train_path", cfg.data.train_path, Path(cfg.data.train_path)),
                               ("agent.path", cfg.agent.path, Path(cfg.agent.path))):
        yield f"  {name}={path!r}: {'present' if needed.is_file() else 'not on this machine'}"
    yield from describe_prompt_sample(cfg)


def describe_prompt_sample(cfg: MoltConfig) -> Iterator[str]:
    """The prompt file's first rows, validated as the job validates every row before it starts."""
    from molt.controller.prompts import load_field_rows

    if not Path(cfg.data.train_path).is_file():
        return
    rows = load_field_rows("data.train_path", cfg.data.train_path, max_rows=PROMPT_SAMPLE_ROWS)
    yield (f"  data.train_path: the first {len(rows):,} row(s) are valid prompt rows (the job checks every row "
           f"before it starts)")


def describe_context_parallel(cfg: MoltConfig) -> Iterator[str]:
    """Context parallelism is validated, not run: the training loop does not shard sequences yet."""
    cp = cfg.layout.trainer_context_parallel_size
    if cp == 1:
        return
    tokens = cfg.train.max_tokens_per_micro_batch
    problems = failing(
        (tokens % (2 * cp) == 0, f"train.max_tokens_per_micro_batch={tokens} must be a multiple of 2 x "
                                 f"layout.trainer_context_parallel_size={cp} (load-balanced causal sharding)"),
        (not cfg.train.packing, "train.packing=True: context-parallel attention takes plain causal rows, not packed "
                                "ones; set train.packing=False"),
        (cfg.algorithm.importance_level not in ("seq", "geo"),
         f"algorithm.importance_level={cfg.algorithm.importance_level!r} sums over whole sequences, which context "
         f"parallelism splits across ranks; use token"))
    if problems:
        raise ConfigError("context parallelism:\n  " + "\n  ".join(problems))
    yield (f"context parallel {cp}: each sequence split over {cp} ranks (sdpa ring attention, "
           f"{tokens // cp} tokens of a micro-batch per rank); valid, but molt.train does not run it yet and "
           f"refuses layout.trainer_context_parallel_size > 1 at start-up")


def dry_run_report(cfg: MoltConfig) -> Iterator[str]:
    """The dry run's lines, in order; raises ConfigError (naming the field) at the first problem."""
    validate_config(cfg, require_files=False)
    placements = place_ranks(cfg.layout)
    source, field = resolve_architecture(cfg)
    model = measure_model(cfg, source, field)
    yield from describe_placements(cfg, placements, estimate_checkpoint_bytes(cfg, model))
    device = {"cpu": "cpu", "cuda": "cuda"}.get(cfg.device, "cuda where visible, else cpu")
    yield (f"trainer mesh: {model.mesh} over ranks 0-{cfg.layout.num_trainer_ranks - 1} (a fake process group of "
           f"{cfg.world_size} ranks; device type {device} at run time); FSDP2 units: {model.num_blocks} decoder "
           f"blocks + the root")
    yield from describe_context_parallel(cfg)
    shown = os.path.relpath(source) if Path(source).resolve().is_relative_to(Path.cwd()) else source
    yield f"model: {model.architecture} from {shown} ({field}), built on the meta device"
    dense = model.num_params - model.num_routed_expert_params
    counts = f"  parameters: {model.num_params:,} = {dense:,} dense"
    if model.num_routed_expert_params:
        counts += f" + {model.num_routed_expert_params:,} routed-expert"
    if model.num_active_params is not None:
        counts += f"; {model.num_active_params:,} active per token"
    yield counts
    yield from describe_memory(cfg, model)
    yield from describe_files(cfg)
    yield f"ok: the config is valid for {cfg.world_size} ranks"
