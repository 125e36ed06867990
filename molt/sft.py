"""Supervised fine-tuning on the trainer's FSDP2 actor, e.g. a warm start before RL:

    python -m molt.sft --config configs/<recipe>.py[:FUNCTION] [--set sft.num_steps=200 ...]
    torchrun --nproc_per_node=N -m molt.sft --config ...   # N data-parallel trainer ranks

The rows are chat rows (molt.controller.prompts): `messages` whose assistant turns are trained, optional
`tools`; a row in the RL format, whose messages end before the answer, trains on its `label` as the
assistant's reply. Each row is rendered with the model's chat template one message at a time (as the
session endpoint appends them), and the loss is minus the mean log-prob of the assistant turns'
tokens, each turn up to and including its end-of-turn token: a token mean over the step's batch on
every rank, like the RL loss. An MoE model adds its routers' load-balancing loss, as in
pretraining. Model building, sharding, precision, activation checkpointing, the optimizer and
micro-batching are the RL trainer's (molt.trainer.policy.build_policy), read from the `train`
section; the result is a Hugging Face model directory at sft.output_dir with `sft.json` (settings
and summary) beside it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from molt.config import (ConfigError, MoltConfig, build_arg_parser, check_cpu_offload, failing, field_type_errors,
                         load_config, raise_config_errors)
from molt.distributed.devices import resolve_device, trainer_device_type
from molt.distributed.slurm import map_slurm_environment
from molt.metrics import configure_logging
from molt.trace.images import ImageEncoder, row_messages

if TYPE_CHECKING:
    from molt.controller.prompts import PromptRow
    from molt.trace.experience import Experience
    from molt.trainer.actor import Actor
    from molt.trainer.batch import MicroBatch

logger = logging.getLogger("molt")

SETTINGS_FILE = "sft.json"
# The train section's fields SFT reads (the rest are RL's): a change to one of them retrains.
SFT_TRAIN_FIELDS = ("learning_rate", "lr_schedule", "warmup_steps", "min_lr_ratio", "lr_multipliers", "weight_decay",
                    "no_weight_decay_on", "adam_betas", "adam_eps", "max_grad_norm", "max_tokens_per_micro_batch",
                    "param_dtype", "compute_dtype", "activation_checkpointing", "cpu_offload",
                    "logprob_chunk_tokens", "packing", "freeze_router")


# -- rows -> token ids and loss masks --------------------------------------------------------------


def chat_messages(row: PromptRow, where: str) -> list[dict]:
    """The row's messages, with its label appended as the assistant's reply when they end before
    one (the RL row format); a ValueError naming `where` if nothing would be trained."""
    messages = list(row.messages)
    if messages[-1]["role"] != "assistant" and row.label:
        messages.append({"role": "assistant", "content": row.label})
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where}: no assistant turn and no 'label' to train on; add an assistant message "
                         f"or a label (the answer)")
    return messages


def tokenize_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(token ids, 0/1 loss mask) of a conversation rendered by the chat template one message at a
    time, each piece tokenized on its own as the session endpoint appends it: an assistant turn up
    to and including its end-of-turn token (the tokenizer's eos) is trained; the rest, and what the
    template puts after that token, is context. A template that re-renders earlier turns
    differently once later ones follow (e.g. one that drops past reasoning) cannot be cut this way
    and raises a ValueError."""
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for count, message in enumerate(messages, start=1):
        is_reply = message["role"] == "assistant"
        next_is_reply = count < len(messages) and messages[count]["role"] == "assistant"
        text = tokenizer.apply_chat_template(messages[:count], tools=tools, tokenize=False,
                                             add_generation_prompt=not is_reply and next_is_reply)
        if not text.startswith(rendered):
            raise ValueError(f"the chat template renders messages[:{count - 1}] differently once message {count - 1} "
                             f"({message['role']}) follows, so the assistant turns cannot be cut out of one "
                             f"rendering; SFT needs a template that only appends")
        piece = text[len(rendered):]
        if is_reply and tokenizer.eos_token and tokenizer.eos_token in piece:
            end = piece.index(tokenizer.eos_token) + len(tokenizer.eos_token)
            piece, text = piece[:end], rendered + piece[:end]
        piece_ids = tokenizer.encode(piece, add_special_tokens=False)
        ids += piece_ids
        mask += [int(is_reply)] * len(piece_ids)
        rendered = text
    return ids, mask


def load_examples(path: str, tokenizer) -> list[Experience]:
    """Every row of `path` as an Experience whose action mask marks the trained tokens (rows checked
    by molt.controller.prompts: a bad one is a ValueError naming its file and line)."""
    from molt.controller.prompts import load_prompt_rows
    from molt.trace.experience import Experience

    examples, encoder = [], None
    for index, row in enumerate(load_prompt_rows(path)):
        where = f"{path}: row {index + 1}"
        messages, blobs = row_messages(chat_messages(row, where), row.images)
        ids, mask = tokenize_chat(tokenizer, messages, row.tools)
        images = None
        if blobs:  # each rendered placeholder becomes the image's run, as the endpoint expands it
            encoder = encoder or ImageEncoder(tokenizer.name_or_path)
            placeholders = [token == encoder.placeholder_id for token in ids]
            ids, images = encoder.expand(ids, blobs)
            mask = expand_context_mask(mask, placeholders, images.lengths)
        if not any(mask[1:]):  # the first token predicts nothing
            raise ValueError(f"{where}: its assistant turns render to no trainable token")
        examples.append(Experience(token_ids=ids, action_mask=mask, behavior_logprobs=[0.0] * len(ids),
                                   policy_versions=[0] * len(ids), images=images, reward=0.0, score=0.0,
                                   group_id=index, rollout_id=index))
    return examples


def expand_context_mask(mask: list[int], placeholders: list[bool], lengths: list[int]) -> list[int]:
    """The loss mask of ids whose placeholders (True) each became a run of `lengths[i]` context tokens."""
    expanded, runs = [], iter(lengths)
    for value, is_placeholder in zip(mask, placeholders):
        expanded += [0] * next(runs) if is_placeholder else [value]
    return expanded


def resolve_num_steps(cfg: MoltConfig, num_rows: int) -> int:
    """sft.num_steps, or sft.epochs passes of sft.batch_size rows (rounded up) when it is 0."""
    return cfg.sft.num_steps or math.ceil(cfg.sft.epochs * num_rows / cfg.sft.batch_size)


def iterate_batches(*, num_rows: int, batch_size: int, seed: int, first_step: int = 1) -> Iterator[list[int]]:
    """Each step's row indices from `first_step` on: `batch_size` distinct rows drawn from one
    seeded stream, so a row may recur in a later step before every row was seen (what the demo's
    warm start always did; on it, epoch-shuffled batches ended with a higher loss over 3 seeds). A
    resumed run replays the draws before `first_step`, so it continues as an uninterrupted one."""
    rng = random.Random(seed)
    step = 0
    while True:
        step += 1
        rows = rng.sample(range(num_rows), batch_size)
        if step >= first_step:
            yield rows


# -- one training step ------------------------------------------------------------------------------


def compute_sft_loss(actor: Actor, micro_batch: MicroBatch, denominator: float,
                     aux_loss_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's loss, -sum(log p of trained tokens) / `denominator`
    (the step's trained tokens over all ranks), plus the routers' load-balancing loss weighted by
    the micro-batch's share of those tokens; and its sums ("nll_sum", "tokens", "aux_sum")."""
    from molt.trainer.scoring import score_micro_batch

    mask = micro_batch.action_mask
    logprobs, _ = score_micro_batch(actor.model, micro_batch)
    nll_sum = -(logprobs * mask).sum()
    loss = nll_sum / denominator
    sums = {"nll_sum": nll_sum.detach(), "tokens": mask.sum()}
    if actor.routing is not None and aux_loss_coef > 0:
        aux_loss = actor.routing.load_balancing_loss()
        loss = loss + aux_loss_coef * aux_loss * mask.sum() / denominator
        sums["aux_sum"] = aux_loss.detach() * mask.sum()
    return loss, sums


def train_step(actor: Actor, micro_batches: list[MicroBatch], *, aux_loss_coef: float) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches of the step (collective over the actor's
    data-parallel group); skipped everywhere if the loss or gradient norm is not finite."""
    from molt.trainer.trainable import compute_window_denominator

    actor.model.train()
    denominator = compute_window_denominator(micro_batches, group=actor.group, device=actor.device)
    totals = torch.zeros(3, dtype=torch.float64, device=actor.device)  # nll_sum, tokens, aux_sum
    for micro_batch in micro_batches:
        micro_batch = micro_batch.to(actor.device)
        with actor.routes_of(micro_batch):  # activation checkpointing reruns the forward in backward
            loss, sums = compute_sft_loss(actor, micro_batch, denominator, aux_loss_coef)
            loss.backward()
        totals += torch.stack([sums["nll_sum"].double(), sums["tokens"].double(),
                               sums.get("aux_sum", torch.zeros(())).double().to(actor.device)])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=actor.group)
    nll_sum, tokens, aux_sum = totals.tolist()
    grad_norm, stepped = actor.step_optimizer(loss_is_finite=math.isfinite(nll_sum + aux_sum))
    metrics = {"loss": nll_sum / max(tokens, 1.0), "tokens": tokens, "grad_norm": grad_norm, "lr": actor.lr,
               "stepped": float(stepped)}
    if actor.routing is not None and aux_loss_coef > 0:
        metrics["router_aux_loss"] = aux_sum / max(tokens, 1.0)
    actor.advance_schedule()
    return metrics


# -- the Hugging Face model directory ---------------------------------------------------------------


def gather_hf_state(model, *, dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights under the names its checkpoint used (a fused MoE expert parameter
    as its per-expert tensors, as a refit sends them), in `dtype` on the CPU; every rank joins each
    parameter's gather, and only a rank with `keep` holds the result ({} elsewhere)."""
    from torch.distributed.tensor import DTensor

    from molt.models.hf_checkpoint import checkpoint_entries

    state = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if keep:
                for key, index, _ in checkpoint_entries(name, tuple(param.shape)):
                    state[key] = full[index].detach().to("cpu", dtype).contiguous().clone()
    return state


def write_hf_model(state: dict[str, torch.Tensor], base_path: str, out_dir: Path, record: dict) -> None:
    """A Hugging Face model directory: the weights as one safetensors file, and every other file of
    `base_path` (config, tokenizer, chat template, generation config); written aside, then renamed
    into place, so an interrupted run never leaves a half-written model where the old one was."""
    from safetensors.torch import save_file

    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for source in Path(base_path).iterdir():
        if source.is_file() and not source.name.endswith((".safetensors", ".safetensors.index.json", ".bin",
                                                           ".pt", ".pth")) and source.name != SETTINGS_FILE:
            shutil.copy2(source, staging / source.name)
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / SETTINGS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)


# -- settings, validation, the run ------------------------------------------------------------------


def sft_output_dir(cfg: MoltConfig) -> Path:
    return Path(cfg.sft.output_dir or os.path.join(cfg.output_dir, "model"))


def sft_settings(cfg: MoltConfig) -> dict:
    """What the trained model depends on, as recorded in sft.json: an output directory holding a
    model trained with equal settings is up to date (the demo's launchers rely on this)."""
    settings = {"base_model": cfg.model.path, "base_model_files": model_files_stamp(cfg.model.path),
                "data_file": file_stamp(cfg.sft.data_path),
                "model_dtype": cfg.model.dtype, "seed": cfg.seed, "device": cfg.device,
                "sft": {k: v for k, v in dataclasses.asdict(cfg.sft).items() if k != "output_dir"},
                "train": {name: getattr(cfg.train, name) for name in SFT_TRAIN_FIELDS},
                "router_aux_loss_coef": cfg.algorithm.router_aux_loss_coef}
    return json.loads(json.dumps(settings))  # tuples as lists, as read back from the file


def model_files_stamp(model_dir: str) -> dict[str, list[int]]:
    """Size and modification time of a model directory's config and weight files: a base model
    rewritten in place (a regenerated tiny model) makes an earlier warm start from it out of date,
    without reading the weights (which may be tens of GB)."""
    directory = Path(model_dir)
    if not directory.is_dir():
        return {}
    files = sorted(p for p in directory.iterdir()
                   if p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".pt"))
    return {p.name: file_stamp(p) for p in files}


def file_stamp(path: str | Path) -> list[int]:
    """[size, modification time in ns] of a file; [] when there is none."""
    path = Path(path)
    if not path.is_file():
        return []
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def is_up_to_date(cfg: MoltConfig) -> bool:
    """Whether sft.output_dir holds a model trained with these settings. A directory that exists
    but was not written by molt.sft is refused rather than replaced."""
    out = sft_output_dir(cfg)
    record = out / SETTINGS_FILE
    if record.is_file():
        return json.loads(record.read_text()).get("settings") == sft_settings(cfg)
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"sft.output_dir={str(out)!r} exists and has no {SETTINGS_FILE}, so molt.sft did not write "
                          f"it; point sft.output_dir at a new directory (or delete it) rather than replace it")
    return False


def validate_sft_config(cfg: MoltConfig, world_size: int) -> None:
    """What a SFT run needs (a ConfigError naming the field): every process is a trainer rank, the
    train and sft sections' ranges, and the model and data files."""
    raise_config_errors(field_type_errors(cfg))
    errors = failing(
        (bool(cfg.model.path) and Path(cfg.model.path, "config.json").is_file(),
         f"model.path={cfg.model.path!r} has no config.json: point it at the Hugging Face model directory to train"),
        (bool(cfg.sft.data_path) and Path(cfg.sft.data_path).is_file(),
         f"sft.data_path={cfg.sft.data_path!r} is not a file: point it at .jsonl or .parquet chat rows"),
        (cfg.seed >= 0, f"seed={cfg.seed}: must be >= 0"),
        (cfg.layout.trainer_context_parallel_size == 1,
         f"layout.trainer_context_parallel_size={cfg.layout.trainer_context_parallel_size}: molt.sft does not "
         f"shard sequences; set 1"))
    # Every process of a SFT job trains.
    errors += dataclasses.replace(cfg.layout, num_trainer_ranks=world_size).trainer_mesh_errors()
    errors += cfg.train.check() + cfg.sft.check() + cfg.checkpoint.check()
    errors += failing(
        (cfg.sft.num_steps == 0 or cfg.train.warmup_steps <= cfg.sft.num_steps,
         f"train.warmup_steps={cfg.train.warmup_steps}: must be at most sft.num_steps={cfg.sft.num_steps}"),
        (cfg.algorithm.router_aux_loss_coef is None or cfg.algorithm.router_aux_loss_coef >= 0,
         f"algorithm.router_aux_loss_coef={cfg.algorithm.router_aux_loss_coef}: must be >= 0 (0 = off), or None "
         f"for the model config's router_aux_loss_coef"))
    raise_config_errors(errors)
    check_cpu_offload(cfg, trainer_device_type(cfg.device))


def init_process_group(device: str, rank: int, world_size: int) -> None:
    """Under torchrun (or srun) the job's group; in a plain process a group of one, in memory."""
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=30)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world_size, timeout=timeout)


def read_examples(cfg: MoltConfig) -> list[Experience]:
    """sft.data_path's rows, rendered and tokenized, before any process group or model starts; a bad
    row is a ConfigError naming the file and line (or row)."""
    from transformers import AutoTokenizer

    try:
        return load_examples(cfg.sft.data_path, AutoTokenizer.from_pretrained(cfg.model.path))
    except ValueError as error:
        raise ConfigError(f"sft.data_path: {error}") from None


def run_sft(cfg: MoltConfig, rank: int, world_size: int, examples: list[Experience]) -> dict:
    """Train on `examples` (read_examples), then write the model directory (rank 0); returns the
    summary (on every rank)."""
    from molt.console import ToolProgress
    from molt.distributed.parallelize import build_trainer_mesh
    from molt.trainer.batch import build_windows, share_step_batch
    from molt.trainer.checkpoint import checkpoint_run_id, load_checkpoint, new_run_id, resolve_resume, save_checkpoint
    from molt.trainer.policy import build_policy

    torch.manual_seed(cfg.seed)
    num_steps = resolve_num_steps(cfg, len(examples))
    device_type = trainer_device_type(cfg.device)
    init_process_group(device_type, rank, world_size)
    try:
        device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
        layout = cfg.layout
        mesh = build_trainer_mesh(num_trainer_ranks=world_size, device_type=device.type,
                                  data_parallel_replicate=layout.trainer_data_parallel_replicate,
                                  tensor_parallel_size=layout.trainer_tensor_parallel_size,
                                  expert_parallel_size=layout.trainer_expert_parallel_size)
        policy = build_policy(cfg, mesh=mesh, device=device, num_steps=num_steps)
        actor, pad_token_id, micro_batch_layout = policy.actor, policy.pad_token_id, policy.micro_batch_layout
        aux_loss_coef = actor.routing.aux_loss_coef if actor.routing is not None else 0.0
        group = dist.group.WORLD
        resume_path = resolve_resume(cfg.checkpoint.resume, cfg.checkpoint_dir)
        run_id = checkpoint_run_id(resume_path) if resume_path else new_run_id()
        first_step, losses = 1, []
        if resume_path is not None:
            state = load_checkpoint(resume_path, trainables={"actor": actor}, group=group, rank=rank)
            actor.load_schedule_state(state["schedule"])
            first_step, losses = state["step"] + 1, state["losses"]
            logger.info("resumed from %s: step %d", resume_path, state["step"])
        logger.info("sft: %d rows, %d steps of %d rows on %d rank(s), %s micro-batches, load-balancing loss %s",
                    len(examples), num_steps, cfg.sft.batch_size, world_size, micro_batch_layout,
                    f"x {aux_loss_coef:g}" if aux_loss_coef > 0 else "off")
        progress = ToolProgress(num_steps - first_step + 1, desc="sft") if rank == 0 else None
        started, tokens = time.perf_counter(), 0.0
        batches = iterate_batches(num_rows=len(examples), batch_size=cfg.sft.batch_size, seed=cfg.seed,
                                  first_step=first_step)
        for step, rows in zip(range(first_step, num_steps + 1), batches):
            batch = [examples[i] for i in rows]
            shares, counts = share_step_batch(batch, num_ranks=mesh.dp_size, num_windows=1,
                                              max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
                                              layout=micro_batch_layout)
            micro_batches = build_windows([batch[i] for i in shares[mesh.dp_rank]], num_windows=1,
                                          micro_batch_counts=counts, pad_token_id=pad_token_id,
                                          max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
                                          layout=micro_batch_layout, temperature=1.0)[0]
            metrics = train_step(actor, micro_batches, aux_loss_coef=aux_loss_coef)
            if not metrics["stepped"]:
                logger.warning("sft step %d: non-finite loss (%s) or gradient norm (%s); the step was skipped",
                               step, metrics["loss"], metrics["grad_norm"])
            losses.append(metrics["loss"])
            tokens += metrics["tokens"]
            if progress is not None:
                progress.update(loss=metrics["loss"], lr=metrics["lr"])
            interval = cfg.checkpoint.interval_steps
            if interval and step % interval == 0 and step < num_steps:
                save_checkpoint(cfg.checkpoint_dir, step, trainables={"actor": actor}, group=group, rank=rank,
                                state={"step": step, "model_path": cfg.model.path, "losses": losses,
                                       "schedule": actor.schedule_state()} if rank == 0 else None,
                                keep_last=cfg.checkpoint.keep_last, run_id=run_id)
        if progress is not None:
            progress.close()
        seconds = time.perf_counter() - started
        summary = {"steps": num_steps, "rows": len(examples), "first_loss": losses[0], "last_loss": losses[-1],
                   "trained_tokens_per_second": tokens / max(seconds, 1e-9), "train_seconds": seconds,
                   "load_balancing_loss_coef": aux_loss_coef, "micro_batch_layout": micro_batch_layout,
                   "ranks": world_size, "losses": losses}
        state = gather_hf_state(actor.model, dtype=getattr(torch, cfg.model.dtype), keep=rank == 0)
        if rank == 0:
            write_hf_model(state, cfg.model.path, sft_output_dir(cfg), {"settings": sft_settings(cfg),
                                                                       "summary": summary})
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser("Supervised fine-tuning on chat rows (one process, or under torchrun).").parse_args(argv)
    map_slurm_environment(os.environ)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    configure_logging(rank)
    started = time.perf_counter()
    try:
        cfg = load_config(args.config, args.set)
        validate_sft_config(cfg, world_size)
        if is_up_to_date(cfg):
            logger.info("sft: %s already holds a model trained with these settings (%s); nothing to do",
                        sft_output_dir(cfg), SETTINGS_FILE)
            return 0
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    try:
        examples = read_examples(cfg)
        num_steps = resolve_num_steps(cfg, len(examples))
        if cfg.sft.batch_size > len(examples):
            raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} exceeds the {len(examples)} rows of "
                              f"sft.data_path={cfg.sft.data_path!r}: lower it or add rows")
        if cfg.train.warmup_steps > num_steps:
            raise ConfigError(f"train.warmup_steps={cfg.train.warmup_steps}: must be at most the run's {num_steps} "
                              f"steps (sft.num_steps, or sft.epochs over {len(examples)} rows)")
        if not args.dry_run and cfg.checkpoint.interval_steps and not cfg.checkpoint.resume:
            from molt.trainer.checkpoint import check_fresh_start

            check_fresh_start(cfg.checkpoint_dir, overwrite=cfg.checkpoint.overwrite, rank=rank)
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    if args.dry_run:
        logger.info("sft: would train %s on %d rows of %s for %d steps into %s", cfg.model.path, len(examples),
                    cfg.sft.data_path, num_steps, sft_output_dir(cfg))
        return 0
    summary = run_sft(cfg, rank, world_size, examples)
    if rank == 0:
        logger.info("sft: %d steps, loss %.4f -> %.4f, %.0f trained tokens/s, %.1f s training, %.1f s wall; "
                    "model in %s",
                    summary["steps"], summary["first_loss"], summary["last_loss"],
                    summary["trained_tokens_per_second"], summary["train_seconds"], time.perf_counter() - started,
                    sft_output_dir(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
