"""Sharded loading of Hugging Face checkpoints: build the model with no parameter memory, shard it
with FSDP2, then let each rank read only its own slices of the safetensors files.

    model = build_empty_model(path, dtype=torch.bfloat16)   # parameters on meta, buffers real
    shard_causal_lm(model, mesh=mesh)                       # TP and FSDP2 on the meta model
    report = load_sharded_weights(model, path, device=device)

So host memory per node stays about one model's size (each rank holds 1/N of it) instead of
one model per rank, as `from_pretrained` on every rank would cost.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
# Private, but it is the one function that says which slice of a global tensor a DTensor holds
# (torch.distributed.checkpoint uses it for the same purpose); _StridedShard is how DTensor writes
# FSDP2's shard of a tensor-parallel part.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import AutoConfig

from molt.models.vision_language import auto_model_class

logger = logging.getLogger("molt")

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(kw_only=True)
class LoadReport:
    """What `load_sharded_weights` did on this rank."""

    bytes_read: int  # bytes of tensor data this rank read from the checkpoint files
    loaded: list[str]  # parameters filled from the checkpoint
    missing: list[str]  # parameters with no checkpoint key: allocated but uninitialised
    unexpected: int  # checkpoint keys that name no parameter (e.g. lm_head.weight for a backbone)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, every parameter a module registers goes to the meta device; buffers stay.

    Building under `torch.device("meta")` would also put buffers on meta, and the non-persistent
    ones (a rotary embedding's `inv_freq`) are computed from the config at construction and are
    not in the checkpoint, so they could not be restored generically. Parameters are typically
    made with `torch.empty`, whose pages are never touched before the move, so construction costs
    no resident memory. Not thread-safe: it patches `nn.Module.register_parameter` for the block.
    """
    register_parameter = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta_param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta_param.__dict__.update(param.__dict__)
            param = meta_param
        register_parameter(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter


def build_empty_model(
    model_path: str, *, dtype: torch.dtype, auto_class: type | None = None
) -> nn.Module:
    """The model of `model_path`'s config.json with its parameters on the meta device.

    Buffers are real CPU tensors computed from the config; tied input/output embeddings stay one
    shared parameter. Shard it with FSDP2, then fill it with `load_sharded_weights`.

    Args:
        dtype: the parameters' dtype (the checkpoint's is cast to it at load).
        auto_class: `AutoModel` for the backbone alone (the critic's); None picks from the config:
            `AutoModelForImageTextToText` for a vision-language model, else `AutoModelForCausalLM`
            (molt.models.vision_language.auto_model_class).
    """
    config = AutoConfig.from_pretrained(model_path)
    auto_class = auto_class or auto_model_class(config)
    with parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def load_sharded_weights(model: nn.Module, model_path: str, *, device: torch.device) -> LoadReport:
    """Allocate each parameter's local shard on `device` and fill it from the checkpoint.

    Expects every parameter on the meta device (from `build_empty_model`, after `shard_model`).
    A DTensor parameter reads only its local slice (`local_index`: FSDP2's Shard(0) chunk, possibly
    empty, of a tensor-parallel rank's Shard(0) or Shard(1) part, or of the whole tensor when
    replicated over tp); a plain parameter is read whole. Names match checkpoint keys exactly (a
    tied parameter loads from whichever of its names the checkpoint holds), except fused MoE expert
    tensors, which are assembled from the per-expert keys (see `plan_expert_reads`). Missing
    parameters are left uninitialised for the caller to fill (the critic zero-inits its value
    head). Not a collective.
    """
    key_files = find_checkpoint_files(model_path)
    reads, missing = plan_reads(model, key_files)
    known_keys = {read.key for read in reads} | {name for name, _ in model.named_parameters(remove_duplicate=False)}
    unexpected = sum(key not in known_keys for key in key_files)
    if not reads and missing:
        raise ValueError(
            f"no parameter name matches a checkpoint key (the model has e.g. {missing[0]!r}, the "
            f"checkpoint {min(key_files)!r}); a bare backbone needs the causal LM's 'model.' "
            f"prefix, so wrap it as molt.trainer.critic.ValueModel does")
    materialize_on_device(model, device)
    bytes_read = read_into_shards(model, reads, key_files)
    loaded = list(dict.fromkeys(read.name for read in reads))
    logger.info("loaded %d parameters (%.1f MB read on this rank) from %s; %d missing %s; %d "
                "unexpected checkpoint keys", len(loaded), bytes_read / 1e6, model_path, len(missing),
                missing[:5], unexpected)
    return LoadReport(bytes_read=bytes_read, loaded=loaded, missing=missing, unexpected=unexpected)


@dataclass(frozen=True)
class TensorRead:
    """Checkpoint tensor `key` goes into parameter `name`: as a whole (expert None), or as rows
    `row_offset`.. of expert `expert` of a fused [experts, rows, cols] expert parameter."""

    key: str
    name: str
    expert: int | None = None
    row_offset: int = 0


def plan_reads(model: nn.Module, key_files: dict[str, Path]) -> tuple[list[TensorRead], list[str]]:
    """The reads that fill `model` from the checkpoint, and the parameters nothing fills."""
    names_by_param: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(param, []).append(name)
    reads, missing = [], []
    for param, names in names_by_param.items():
        key = next((name for name in names if name in key_files), None)
        if key is not None:
            reads.append(TensorRead(key=key, name=names[0]))
        elif expert_reads := plan_expert_reads(names[0], param.shape, key_files):
            reads.extend(expert_reads)
        else:
            missing.append(names[0])
    return reads, missing


def read_into_shards(model: nn.Module, reads: list[TensorRead], key_files: dict[str, Path]) -> int:
    """Carry out `reads` file by file; returns the bytes read."""
    reads_by_file: dict[Path, list[TensorRead]] = {}
    for read in reads:
        reads_by_file.setdefault(key_files[read.key], []).append(read)
    bytes_read = 0
    # One file open at a time: safetensors maps the file, and the pages read count towards this
    # process's resident memory until the file is closed.
    for file, file_reads in reads_by_file.items():
        with safe_open(file, framework="pt") as checkpoint:
            for read in file_reads:
                bytes_read += copy_into_shard(checkpoint, read, model.get_parameter(read.name))
    return bytes_read


# A fused expert parameter's per-expert source keys, in the order they are concatenated on dim 1;
# transformers' own conversion for Qwen2/Qwen3-MoE-style checkpoints (conversion_mapping.py). The one
# table for both directions: checkpoint -> fused at load, fused -> checkpoint names at refit.
FUSED_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class ExpertPart:
    """Checkpoint tensor `key` is rows `row_offset`.. (`rows` of them) of expert `expert` of a
    fused [experts, rows, cols] expert parameter."""

    key: str
    expert: int
    row_offset: int
    rows: int

    @property
    def index(self) -> tuple[int, slice]:
        """Where the part sits in the fused tensor: `fused[part.index]` is the checkpoint tensor."""
        return self.expert, slice(self.row_offset, self.row_offset + self.rows)


def split_fused_experts(name: str, shape: tuple[int, ...]) -> list[ExpertPart]:
    """For `<prefix>.experts.gate_up_proj` [experts, 2 x inter, hidden] (or `down_proj`), which
    checkpoints (and vLLM's loaders) hold per expert as `<prefix>.experts.<e>.gate_proj.weight`
    and so on: one part per expert and projection. Empty if `name` is no such parameter."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in FUSED_EXPERT_PARTS or len(shape) != 3:
        return []
    parts = FUSED_EXPERT_PARTS[leaf]
    rows = shape[1] // len(parts)
    return [ExpertPart(key=f"{prefix}.{expert}.{part}.weight", expert=expert, row_offset=i * rows, rows=rows)
            for expert in range(shape[0]) for i, part in enumerate(parts)]


def checkpoint_entries(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple, tuple[int, ...]]]:
    """(checkpoint key, index into the parameter, shape) for each tensor parameter `name` is stored
    as in a checkpoint: itself (index ()) or, for a fused expert parameter, one per expert part.
    What a refit sends, so that the engine loads the names it loaded from disk."""
    parts = split_fused_experts(name, shape)
    if not parts:
        return [(name, (), tuple(shape))]
    return [(part.key, part.index, (part.rows, shape[2])) for part in parts]


def plan_expert_reads(name: str, shape: torch.Size, key_files: dict[str, Path]) -> list[TensorRead]:
    """The reads of a fused expert parameter (`split_fused_experts`) from its per-expert keys.
    Empty if `name` is no such parameter or a key is absent."""
    reads = [TensorRead(key=part.key, name=name, expert=part.expert, row_offset=part.row_offset)
             for part in split_fused_experts(name, shape)]
    return reads if all(read.key in key_files for read in reads) else []


def find_checkpoint_files(model_path: str) -> dict[str, Path]:
    """Each tensor key of the checkpoint in `model_path` and the safetensors file holding it."""
    directory = Path(model_path)
    index_path = directory / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {key: directory / file_name for key, file_name in weight_map.items()}
    single_file = directory / SAFETENSORS_FILE
    if single_file.is_file():
        with safe_open(single_file, framework="pt") as checkpoint:
            return dict.fromkeys(checkpoint.keys(), single_file)
    if any(directory.glob("pytorch_model*.bin")):
        raise ValueError(
            f"{model_path} holds only pytorch_model*.bin weights, which cannot be read in slices; "
            f"convert them to safetensors first, e.g. AutoModelForCausalLM.from_pretrained(path)"
            f".save_pretrained(new_path) on one machine")
    raise FileNotFoundError(
        f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {model_path}; point model_path at a "
        f"Hugging Face model directory with safetensors weights")


def materialize_on_device(model: nn.Module, device: torch.device) -> None:
    """Allocate every parameter (the local shard of a DTensor) on `device`, uninitialised, and
    move the buffers there with their values.

    `to_empty` also lets FSDP2 re-register its padded shard storage (`FSDPModule._apply`). But it
    empties buffers, so they are saved first and put back; and it gives each module its own new
    plain parameter (FSDP2's DTensors are swapped in place instead), so tied parameters are
    re-tied after it.
    """
    params = _module_tensors(model, "_parameters")
    buffers = _module_tensors(model, "_buffers")
    for module, name, param in params:
        if not param.is_meta:
            raise ValueError(
                f"parameter {name} of {type(module).__name__} is on {param.device}, not the meta "
                f"device; build the model with build_empty_model so loading discards no weights")
    for module, name, buffer in buffers:
        if buffer.is_meta:
            raise ValueError(
                f"buffer {name} of {type(module).__name__} is on the meta device, so its value is "
                f"lost; build the model with build_empty_model, which keeps buffers real")
    model.to_empty(device=device)
    kept: dict[int, nn.Parameter] = {}  # by original parameter: the first alias's new one
    for module, name, param in params:
        module._parameters[name] = kept.setdefault(id(param), module._parameters[name])
    moved: dict[int, torch.Tensor] = {}  # by original buffer, so shared buffers stay shared
    for module, name, buffer in buffers:
        if id(buffer) not in moved:
            moved[id(buffer)] = buffer.to(device)
        module._buffers[name] = moved[id(buffer)]


def _module_tensors(model: nn.Module, kind: str) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) for each entry of every module's `_parameters` or `_buffers`,
    shared tensors once per module that holds them."""
    return [(module, name, tensor) for module in model.modules()
            for name, tensor in getattr(module, kind).items() if tensor is not None]


def copy_into_shard(checkpoint: safe_open, read: TensorRead, param: nn.Parameter) -> int:
    """Copy this rank's part of `read` into `param`'s local shard (cast to its dtype); returns the
    bytes read from the file."""
    local = param.to_local() if isinstance(param, DTensor) else param.data
    index = local_index(param) if isinstance(param, DTensor) else ()
    if read.expert is not None:
        return copy_expert_part(checkpoint, read, local, index, param.shape)
    source = checkpoint.get_slice(read.key)
    _check_shape(read.key, source.get_shape(), param.shape)
    if local.numel() == 0:
        return 0  # an empty shard (a dim 0 smaller than the number of ranks)
    tensor = source[index] if index else checkpoint.get_tensor(read.key)
    with torch.no_grad():
        local.copy_(tensor)
    return tensor.nbytes


def copy_expert_part(checkpoint: safe_open, read: TensorRead, local: torch.Tensor,
                     index: tuple[slice, ...], shape: torch.Size) -> int:
    """Copy one expert's part into a fused expert parameter, if this rank holds that expert."""
    if index and any(part != slice(0, size) for part, size in zip(index[1:], shape[1:])):
        raise ValueError(
            f"{read.name} is sharded on a dim other than 0 ({index}); fused expert tensors load "
            f"only when sharded over experts (FSDP2's default Shard(0))")
    first_expert = index[0].start if index else 0
    if not first_expert <= read.expert < first_expert + local.shape[0]:
        return 0
    tensor = checkpoint.get_tensor(read.key)  # a view of the mapped file: read when copied
    rows = shape[1] // len(FUSED_EXPERT_PARTS[read.name.rpartition(".")[2]])
    _check_shape(read.key, tensor.shape, (rows, shape[2]))
    with torch.no_grad():
        local[read.expert - first_expert, read.row_offset:read.row_offset + rows].copy_(tensor)
    return tensor.nbytes


def _check_shape(key: str, checkpoint_shape: list[int], expected: tuple[int, ...]) -> None:
    if tuple(checkpoint_shape) != tuple(expected):
        raise ValueError(
            f"checkpoint tensor {key} has shape {tuple(checkpoint_shape)} but the model expects "
            f"{tuple(expected)}; the config.json does not match the weights")


def local_index(param: DTensor) -> tuple[slice, ...]:
    """The slice of the global tensor that `param`'s local shard holds, one slice per dim.

    Any mix of Shard (FSDP2's dim 0, tensor parallelism's dim 0 or 1) and Replicate over the mesh
    dims. FSDP2 over a tensor-parallel parameter shards the tp rank's part again, which DTensor
    writes as a _StridedShard on the dp dim: each rank still holds one box of the global tensor
    (torch.distributed.checkpoint records it as one offset and size the same way)."""
    for placement in param.placements:
        if not isinstance(placement, (Shard, _StridedShard, Replicate)):
            raise ValueError(
                f"cannot load a parameter placed as {param.placements}: only Shard and Replicate "
                f"placements map onto a slice of the checkpoint tensor")
    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, local_shape))
