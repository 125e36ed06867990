"""What a payload store keeps on its node, and how it is read back there: shared-memory segments
(a 64-byte raw header, then the payload), safetensors spill files, and the owner registry.

Every name is `molt-<node>-<pid>-<store token>-<random token>[.safetensors]`, created with O_EXCL
and mode 0o600; readers refuse files that are not private to their uid. Each store registers its
prefix with an owner file beside the segments (`<prefix>owner`: pid, process start time, spill
dir); a store starting on the node removes the entries of every registered owner that no longer
runs (killed, or its pid reused), so a SIGKILL leaks nothing past the next start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
import struct
import tempfile

import numpy as np
import safetensors.torch
import torch

from molt.transport.payloads.reference import DTYPES, STORE_NAME_PATTERN, PayloadRef, view_entries

logger = logging.getLogger("molt")

# magic, key (16 raw bytes), payload bytes, and the key again once its consumer has copied the
# payload out: the consumer's free signal, which the owner collects (PayloadStore.reclaim).
HEADER = struct.Struct("<8s16sQ16s")
CONSUMED = slice(32, 48)
HEADER_BYTES = 64  # the header padded to the tensors' alignment
MAGIC = b"MOLTPAY1"
CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
OWNER_SUFFIX = "owner"
OWNER_PATTERN = re.compile(r"(?P<prefix>molt-(?P<node>[A-Za-z0-9_.-]{1,64})-(?P<pid>[0-9]{1,10})-[0-9a-f]{8}-)owner")


def default_spill_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"molt-payloads-{os.getuid()}")


def ensure_private_dir(path: str) -> str:
    """`path`, created 0o700 if missing; an existing one must be ours and closed to others."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"payload directory {path} must belong to uid {os.getuid()} with mode 0o700 "
                              f"(it has uid {info.st_uid}, mode {oct(info.st_mode & 0o777)}); "
                              f"choose another directory or fix its owner and mode")
    return path


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, without copying (numpy has no bfloat16: view as uint8)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def map_shared(fd: int) -> np.ndarray:
    """The whole file behind `fd` mapped shared, as uint8. The mapping lives as long as any view of
    it (a zero-copy send included) and holds no descriptor: mmap.mmap would keep a duplicate per
    mapping, and a store has thousands of segments. Mapping through /proc/self/fd maps exactly the
    file already opened and checked."""
    size = os.fstat(fd).st_size
    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


# -- writing ------------------------------------------------------------------------------------


def write_private_file(path: str, data: bytes) -> None:
    fd = os.open(path, CREATE_FLAGS | os.O_WRONLY, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def write_spill_file(directory: str, prefix: str, tensors: dict[str, torch.Tensor]) -> str:
    """Writes `tensors` as a safetensors file aside, then renames it into place: the final name
    never shows a partial file. No fsync: spill files need not outlive the node's processes."""
    seen, owned = set(), {}
    for name, tensor in tensors.items():  # safetensors refuses tensors that share storage
        pointer = tensor.untyped_storage().data_ptr()
        owned[name] = tensor.clone() if pointer in seen and tensor.numel() else tensor
        seen.add(pointer)
    path = os.path.join(directory, f"{prefix}{secrets.token_hex(16)}.safetensors")
    write_private_file(path + ".partial", safetensors.torch.save(owned))
    os.replace(path + ".partial", path)
    return path


# -- reading on the owner's node ----------------------------------------------------------------


def map_segment(path: str) -> np.ndarray:
    """Another store's segment, mapped shared read-write (the consumer marks it consumed)."""
    fd = open_private(path, os.O_RDWR)
    try:
        return map_shared(fd)
    finally:
        os.close(fd)


def copy_out(segment: np.ndarray, ref: PayloadRef) -> dict[str, torch.Tensor]:
    """The payload's tensors, copied out of its mapped segment (uint8) into one fresh buffer."""
    check_segment_header(segment, ref)
    flat = torch.empty(ref.nbytes, dtype=torch.uint8)
    np.copyto(flat.numpy(), segment[HEADER_BYTES:HEADER_BYTES + ref.nbytes])
    check_segment_header(segment, ref)  # it was not freed and reused meanwhile
    return view_entries(flat, ref.entries)


def mark_consumed(segment: np.ndarray, ref: PayloadRef) -> None:
    segment[CONSUMED] = np.frombuffer(bytes.fromhex(ref.key), dtype=np.uint8)


def check_segment_header(segment: np.ndarray, ref: PayloadRef) -> None:
    if len(segment) < HEADER_BYTES + ref.nbytes:
        raise ValueError(f"segment {ref.name} has {len(segment)} bytes, too few for payload {ref.key}")
    magic, key, nbytes, consumed = HEADER.unpack(segment[:HEADER.size].tobytes())
    if magic != MAGIC or key.hex() != ref.key or nbytes != ref.nbytes:
        raise ValueError(f"segment {ref.name} does not hold payload {ref.key}: it was freed already, or "
                         f"never written")
    if consumed == key:
        raise ValueError(f"payload {ref.key} was consumed already; reload with consume=False to read it twice")


def read_spill_file(path: str, ref: PayloadRef) -> dict[str, torch.Tensor]:
    with open(open_private(path), "rb") as file:
        loaded = safetensors.torch.load(file.read())
    expected = {e.name: (DTYPES[e.dtype], e.shape) for e in ref.entries}
    found = {name: (t.dtype, tuple(t.shape)) for name, t in loaded.items()}
    if found != expected:
        raise ValueError(f"spill file {path} holds {found}, but payload {ref.key} is {expected}")
    return {e.name: loaded[e.name] for e in ref.entries}


def open_private(path: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of a regular file that is ours and closed to others."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"payload file {path} is not a private file of uid {os.getuid()} "
                              f"(uid {info.st_uid}, mode {oct(info.st_mode & 0o777)}); refusing to read it")
    return fd


# -- cleanup and the owner registry -------------------------------------------------------------


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def list_names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def is_own_file(path: str) -> bool:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()


def remove_prefix(prefix: str, directories: list[str]) -> int:
    """Removes our regular files named `prefix*` in `directories`; returns how many."""
    removed = 0
    for directory in directories:
        for name in list_names(directory):
            path = os.path.join(directory, name)
            if name.startswith(prefix) and is_own_file(path):
                remove_quietly(path)
                removed += 1
    return removed


def register_owner(shm_dir: str, prefix: str, spill_dir: str) -> str:
    """Writes the store's owner file: its process start time and spill directory, under its prefix."""
    path = os.path.join(shm_dir, prefix + OWNER_SUFFIX)
    write_private_file(path, json.dumps({"start": process_start(os.getpid()), "spill_dir": spill_dir}).encode())
    return path


def read_owner(path: str) -> tuple[int | None, str | None]:
    """(start time, spill directory) from an owner file; Nones where it is unreadable or cut short."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(4096))
        start, spill_dir = record.get("start"), record.get("spill_dir")
    except (OSError, ValueError, AttributeError):
        return None, None
    return (start if type(start) is int else None), (spill_dir if isinstance(spill_dir, str) else None)


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None without /proc): with the pid it
    names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def is_running(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: another user's process has the pid
        return False
    return start is None or process_start(pid) in (None, start)


def remove_orphans(node_id: str, shm_dir: str, spill_dir: str) -> None:
    """Removes segments, spill files and owner files of this node's stores that no longer run."""
    owners: dict[str, tuple[int, int | None, str | None]] = {}  # prefix -> pid, start time, spill dir
    for name in list_names(shm_dir):
        match = OWNER_PATTERN.fullmatch(name)
        if match is not None and match["node"] == node_id and is_own_file(os.path.join(shm_dir, name)):
            owners[match["prefix"]] = (int(match["pid"]), *read_owner(os.path.join(shm_dir, name)))
    dead = {prefix for prefix, (pid, start, _) in owners.items() if not is_running(pid, start)}
    for directory in [shm_dir, spill_dir]:  # entries whose owner file is gone: judge by the pid alone
        for name in list_names(directory):
            match = STORE_NAME_PATTERN.fullmatch(name)
            if match is not None and match["node"] == node_id:
                prefix = name[:match.start("token")]
                if prefix not in owners and not is_running(int(match["pid"]), None):
                    dead.add(prefix)
    for prefix in dead:
        directories = {shm_dir, spill_dir, owners.get(prefix, (0, None, None))[2] or spill_dir}
        count = remove_prefix(prefix, [d for d in directories if os.path.isdir(d)])
        logger.info("payload store: removed %d entries of stopped store %s*", count, prefix)
