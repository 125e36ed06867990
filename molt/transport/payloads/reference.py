"""A payload reference: which node holds an offloaded payload, under which key, and how its bytes
split into tensors (DESIGN section 7). The same reference serves both reload paths (shared memory
or spill file on the owner's node, ZeroMQ from anywhere else) and travels inside the light
experience record as a msgpack-friendly dict, so `from_dict` checks every field."""

from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass

import torch

DTYPES = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
ALIGNMENT = 64  # every tensor starts on a cache line, so each can be viewed in place
LOCATIONS = ("shm", "file")
NODE_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
KEY_PATTERN = re.compile(r"[0-9a-f]{32}")
# Names of everything a store creates: molt-<node>-<pid>-<store token>-<token>[suffix]. The pid
# and store token form the owner's prefix, which the registry uses to find orphans.
STORE_NAME_PATTERN = re.compile(r"molt-(?P<node>[A-Za-z0-9_.-]{1,64})-(?P<pid>[0-9]{1,10})-(?P<store>[0-9a-f]{8})-"
                                r"(?P<token>[0-9a-f]{32})(?P<suffix>|\.safetensors|\.safetensors\.partial)")


@dataclass(frozen=True)
class TensorEntry:
    """Where one named tensor sits in a payload."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    offset: int  # bytes from the payload's first byte; a multiple of ALIGNMENT
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class PayloadRef:
    """An offloaded payload: the owning store's node, key and address, and the tensors' layout."""

    node: str  # node id of the owning store; a reload elsewhere goes over ZeroMQ
    key: str  # 32 hex digits, unique per payload, unguessable
    address: str  # the owning store's ZeroMQ address; "" if it serves none (readable on its node only)
    location: str  # "shm" (a shared-memory segment) or "file" (spilled to safetensors)
    name: str  # the segment's or spill file's name, without directory
    entries: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    def entry(self, name: str) -> TensorEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"payload {self.key} has no tensor {name!r}; it has {[e.name for e in self.entries]}")

    def to_dict(self) -> dict:
        return {"node": self.node, "key": self.key, "address": self.address, "location": self.location,
                "name": self.name,
                "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]}

    @classmethod
    def from_dict(cls, data: dict) -> PayloadRef:
        """The reference in `data`; ValueError naming the field if any field is malformed."""
        if not isinstance(data, dict) or set(data) != {"node", "key", "address", "location", "name", "entries"}:
            raise ValueError(f"malformed payload reference: expected keys node, key, address, location, name, "
                             f"entries; got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        node, key, address, location, name = (data[k] for k in ("node", "key", "address", "location", "name"))
        check_node_id(node)
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            raise ValueError(f"malformed payload reference: key must be 32 hex digits, got {key!r}")
        if not isinstance(address, str) or not (address == "" or address.startswith(("tcp://", "ipc://"))):
            raise ValueError(f"malformed payload reference: address must be a tcp:// or ipc:// URL (or '' for "
                             f"a store that does not serve), got {address!r}")
        if location not in LOCATIONS:
            raise ValueError(f"malformed payload reference: location must be one of {LOCATIONS}, got {location!r}")
        match = STORE_NAME_PATTERN.fullmatch(name) if isinstance(name, str) else None
        if match is None or match["node"] != node or (match["suffix"] == ".safetensors") != (location == "file") \
                or match["suffix"].endswith(".partial"):
            raise ValueError(f"malformed payload reference: name {name!r} is not a {location} name of node {node!r}")
        entries = data["entries"]
        if not isinstance(entries, list):
            raise ValueError(f"malformed payload reference: entries must be a list, got {type(entries).__name__}")
        ref = cls(node=node, key=key, address=address, location=location, name=name,
                  entries=tuple(parse_entry(e) for e in entries))
        if len({e.name for e in ref.entries}) != len(ref.entries):
            raise ValueError(f"malformed payload reference: duplicate tensor names in {[e.name for e in ref.entries]}")
        return ref


def parse_entry(item: object) -> TensorEntry:
    if not (isinstance(item, list) and len(item) == 5):
        raise ValueError(f"malformed payload entry: expected [name, dtype, shape, offset, nbytes], got {item!r:.200}")
    name, dtype, shape, offset, nbytes = item
    well_formed = (isinstance(name, str) and name and isinstance(dtype, str) and dtype in DTYPES
                   and isinstance(shape, list) and all(is_count(n) for n in shape)
                   and is_count(offset) and is_count(nbytes) and offset % ALIGNMENT == 0)
    if not well_formed:
        raise ValueError(f"malformed payload entry: {item!r:.200}")
    if math.prod(shape) * DTYPES[dtype].itemsize != nbytes:
        raise ValueError(f"malformed payload entry {name!r}: shape {shape} of {dtype} is not {nbytes} bytes")
    return TensorEntry(name, dtype, tuple(shape), offset, nbytes)


def is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # type(), not isinstance: True is not a count


def default_node_id(configured: str = "") -> str:
    """`configured`, or this machine's host name made a valid node id."""
    if configured:
        return check_node_id(configured)
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "node"


def check_node_id(node: object) -> str:
    if not isinstance(node, str) or not NODE_PATTERN.fullmatch(node):
        raise ValueError(f"node id must be 1-64 characters of letters, digits, '_', '.', '-'; got {node!r}")
    return node


def plan_layout(tensors: dict[str, torch.Tensor]) -> tuple[TensorEntry, ...]:
    """Entries packing `tensors` back to back in the given order, each aligned to ALIGNMENT."""
    entries, offset = [], 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"a payload maps non-empty names to tensors; got {name!r}: {type(tensor).__name__}")
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; payloads hold {sorted(DTYPES)}")
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
    return tuple(entries)


def view_entries(flat: torch.Tensor, entries: tuple[TensorEntry, ...], base: int = 0) -> dict[str, torch.Tensor]:
    """Each entry as a tensor viewing `flat` (uint8) from byte `base + entry.offset`, no copy."""
    tensors = {}
    for e in entries:
        dtype = DTYPES[e.dtype]
        if e.nbytes == 0:
            tensors[e.name] = torch.empty(e.shape, dtype=dtype)
        else:
            tensors[e.name] = flat[base + e.offset:base + e.offset + e.nbytes].view(dtype).view(e.shape)
    return tensors
