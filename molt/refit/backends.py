"""Which weight-sync backend a run uses (refit.backend), and its trainer and engine halves."""

from __future__ import annotations

import torch

from molt.config import ConfigError, MoltConfig
from molt.refit.gloo import GlooEngineSync, RefitSender
from molt.refit.nccl import NcclEngineSync, NcclSender
from molt.refit.weight_sync import EngineWeightSync, WeightSender

BACKENDS = ("gloo", "nccl")


def resolve_backend(backend: str, trainer_device_type: str, *, colocate: bool = False) -> str:
    """'gloo' or 'nccl' from refit.backend ('auto' = nccl when the trainer computes on CUDA and every
    engine has GPUs of its own; gloo otherwise).

    Colocated (layout.colocate), the sender (trainer rank 0) and engine 0's worker sit on one GPU, and
    NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected", NCCL's
    init.cc; vLLM's NCCL weight-transfer engine builds exactly that group), so refit goes through host
    memory over gloo. vLLM 0.32's CUDA-IPC engine (vllm/distributed/weight_transfer/ipc_engine.py)
    would share the GPU tensors without a copy: the faster option for later (docs/gpu.md)."""
    if backend not in ("auto", *BACKENDS):
        raise ConfigError(f"refit.backend={backend!r}: use auto, gloo or nccl")
    if backend == "auto":
        return "nccl" if trainer_device_type == "cuda" and not colocate else "gloo"
    if backend == "nccl" and trainer_device_type != "cuda":
        raise ConfigError(f"refit.backend='nccl' but the trainer computes on {trainer_device_type}: NCCL moves GPU "
                          f"memory; set refit.backend=gloo (or auto)")
    if backend == "nccl" and colocate:
        raise ConfigError("refit.backend='nccl' with layout.colocate=True: the sender and an engine share a GPU and "
                          "NCCL refuses a duplicate GPU in one communicator; set refit.backend=auto (gloo)")
    return backend


def build_sender(cfg: MoltConfig, model: torch.nn.Module, *, is_sender: bool, device: torch.device) -> WeightSender:
    """The trainer half of the configured backend (every trainer rank builds one). `device`: where the
    trainer computes (Trainer.device, cuda:LOCAL_RANK on a GPU), never a parameter's device, which
    is the host under train.cpu_offload."""
    kwargs = dict(is_sender=is_sender, bucket_bytes=int(cfg.refit.bucket_megabytes * 2**20),
                  timeout_seconds=cfg.refit.timeout_seconds, engine_dtype=cfg.model.dtype, device=device)
    if resolve_backend(cfg.refit.backend, device.type, colocate=cfg.layout.colocate) == "nccl":
        return NcclSender(model, **kwargs)
    return RefitSender(model, **kwargs)


def build_engine_sync(backend: str) -> EngineWeightSync:
    """The engine half of `backend` ('gloo' or 'nccl')."""
    if backend == "nccl":
        return NcclEngineSync()
    return GlooEngineSync()
