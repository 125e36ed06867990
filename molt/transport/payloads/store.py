"""A node's payload store (DESIGN section 7): holds offloaded tensors until their consumer has them.

Storage is a pool of reusable shared-memory segments (files in `shm_dir`, normally /dev/shm) under
a byte budget; a payload that does not fit spills to a safetensors file in `spill_dir`. A freed
segment goes back to the pool for the next payload of its size class (powers of two, so experiences
of similar length share segments and their pages stay warm); when a new segment would pass the
budget, pooled segments are unlinked first, and only then does a payload spill. A payload of at
most `inline_bytes` need not come here at all: its record carries it (`admit_inline`, used by
`molt.transport.payloads.fields.offload_record`), as object stores inline small objects, since any trip
through the store costs a short experience several times what msgpack costs it. File formats,
names and the orphan registry: `molt.transport.payloads.files`.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from molt.transport.payloads.files import (
                                           CONSUMED, CREATE_FLAGS, HEADER, HEADER_BYTES, MAGIC, byte_view, default_spill_dir, ensure_private_dir,
                                           map_shared, read_spill_file, register_owner, remove_orphans, remove_prefix, remove_quietly, write_spill_file,
                                           )
from molt.transport.payloads.reference import PayloadRef, TensorEntry, check_node_id, plan_layout
from molt.transport.payloads.server import PayloadServer

logger = logging.getLogger("molt")

MIN_SEGMENT_BYTES = 4 << 10  # one page: a short experience takes no more
# Payloads up to this size travel inline (see admit_inline): below it a trip through the store costs
# 2.4-10x what msgpack costs the whole record, just past it about 2x (tools/bench/payloads.py,
# docs/benchmarks.md). About 2500 tokens of an experience; at most 56 KiB as msgpack lists.
INLINE_BYTES = 32 << 10


@dataclass
class Segment:
    """One shared-memory file, mapped while the store (or a send from it) uses it."""

    name: str
    capacity: int  # payload bytes it holds (its size class); the file is HEADER_BYTES larger
    memory: np.ndarray  # uint8 [HEADER_BYTES + capacity]


@dataclass
class StoredPayload:
    ref: PayloadRef
    segment: Segment | None  # None when spilled
    path: str | None  # the spill file, when spilled
    key_bytes: bytes  # the key as the segment header holds it, for the consumed check


def segment_capacity(nbytes: int) -> int:
    """The size class of a payload: the next power of two, at least MIN_SEGMENT_BYTES."""
    return max(MIN_SEGMENT_BYTES, 1 << max(0, nbytes - 1).bit_length())


class PayloadStore:
    """Holds the payloads offloaded on this node until a consumer frees them.

    `offload()` may be called from any thread (not racing `close()`). Unless `serve=False`, a server thread
    (`molt.transport.payloads.server`) answers other processes' fetches and frees at `address`; bind `host`
    to an interface the consuming nodes can reach. The store removes everything it made on
    `close()` and at interpreter exit; after a SIGKILL, the next store of the node does.
    `inline_bytes`: the largest payload that `admit_inline` lets travel in its record (0: none).
    """

    def __init__(self, node_id: str, *, budget_bytes: int = 1 << 30, spill_dir: str | None = None,
                 shm_dir: str = "/dev/shm", host: str = "127.0.0.1", serve: bool = True,
                 inline_bytes: int = INLINE_BYTES):
        self.node_id = check_node_id(node_id)
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 (0 spills everything), got {budget_bytes}")
        if inline_bytes < 0:
            raise ValueError(f"inline_bytes must be >= 0 (0 stores every payload), got {inline_bytes}")
        self.budget_bytes = budget_bytes
        self.inline_bytes = inline_bytes
        self.shm_dir = shm_dir
        self.spill_dir = ensure_private_dir(spill_dir or default_spill_dir())
        self.prefix = f"molt-{node_id}-{os.getpid()}-{secrets.token_hex(4)}-"
        self.lock = threading.Lock()
        self.next_reclaim = 0.0  # monotonic time before which offload does not scan for consumed payloads
        self.payloads: dict[str, StoredPayload] = {}
        self.pooled: dict[int, list[Segment]] = {}  # capacity -> free segments
        self.segment_bytes = 0  # shared memory held, live and pooled, headers included
        self.live_count = {"shm": 0, "file": 0}  # live payloads by location, kept as they come and go
        self.live_bytes = {"shm": 0, "file": 0}
        self.counters = {"offloaded": 0, "freed": 0, "fetched": 0, "spilled": 0, "spilled_bytes": 0,
                         "inlined": 0, "inlined_bytes": 0, "segments_created": 0, "segments_evicted": 0}
        self.closed = False
        remove_orphans(node_id, shm_dir, self.spill_dir)
        self.owner_path = register_owner(shm_dir, self.prefix, self.spill_dir)
        atexit.register(self.close)
        self.server = None
        self.address = ""
        if serve:
            self.server = PayloadServer(self, host)
            self.address = self.server.address

    def offload(self, tensors: Mapping[str, torch.Tensor]) -> PayloadRef:
        """Copies `tensors` (CPU or not, any layout) into the store; the reference reloads them bit
        for bit, in this order, from any node."""
        if self.closed:
            raise RuntimeError(f"payload store {self.prefix}* is closed")
        entries = plan_layout(dict(tensors))
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        key = secrets.token_hex(16)
        nbytes = max((e.offset + e.nbytes for e in entries), default=0)
        segment = self.take_segment(nbytes)
        if segment is not None:
            self.write_segment(segment, key, nbytes, entries, tensors)
            location, name, path = "shm", segment.name, None
        else:
            location, path = "file", write_spill_file(self.spill_dir, self.prefix, tensors)
            name = os.path.basename(path)
        ref = PayloadRef(node=self.node_id, key=key, address=self.address, location=location, name=name,
                         entries=entries)
        with self.lock:
            self.payloads[key] = StoredPayload(ref, segment, path, bytes.fromhex(key))
            self.live_count[location] += 1
            self.live_bytes[location] += nbytes
            self.counters["offloaded"] += 1
            if path is not None:
                self.counters["spilled"] += 1
                self.counters["spilled_bytes"] += nbytes
        return ref

    def admit_inline(self, nbytes: int) -> bool:
        """Whether a payload of `nbytes` is small enough (at most `inline_bytes`) to travel inline in
        its record rather than be offloaded here; if so, it is counted as inlined (nothing is stored,
        so nothing is freed later)."""
        if nbytes > self.inline_bytes:
            return False
        with self.lock:
            self.counters["inlined"] += 1
            self.counters["inlined_bytes"] += nbytes
        return True

    def free(self, key: str) -> bool:
        """Drops a payload (its segment goes back to the pool); False if the key is unknown."""
        with self.lock:
            return self.drop(key)

    def reclaim(self) -> int:
        """Frees the payloads whose same-node consumers marked them consumed in their segment
        header; the server thread calls this a few times a second, offload when it lacks a pooled
        segment (see take_segment)."""
        with self.lock:
            return self.reclaim_locked()

    def reclaim_locked(self) -> int:
        start = time.monotonic()
        consumed = [key for key, stored in self.payloads.items()
                    if stored.segment is not None and stored.segment.memory[CONSUMED].tobytes() == stored.key_bytes]
        for key in consumed:
            self.drop(key)
        # The scan visits every live payload; spacing scans by ten times their cost keeps a burst of
        # offloads, each short of a pooled segment, from going quadratic in the payloads alive.
        now = time.monotonic()
        self.next_reclaim = now + 10 * (now - start)
        return len(consumed)

    def drop(self, key: str) -> bool:
        stored = self.payloads.pop(key, None)
        if stored is None:
            return False
        self.counters["freed"] += 1
        self.live_count[stored.ref.location] -= 1
        self.live_bytes[stored.ref.location] -= stored.ref.nbytes
        if stored.segment is not None:
            stored.segment.memory[:HEADER.size] = 0  # a stale reader sees no key
            self.pool(stored.segment)
        if stored.path is not None:
            remove_quietly(stored.path)
        return True

    def export(self, key: str) -> tuple[PayloadRef, list[np.ndarray]] | None:
        """For the server: the payload's reference and one buffer per tensor, straight out of
        shared memory (or read from its spill file); None if the key is unknown."""
        with self.lock:
            stored = self.payloads.get(key)
            if stored is None:
                return None
            self.counters["fetched"] += 1
            if stored.segment is not None:
                memory = stored.segment.memory
                return stored.ref, [memory[HEADER_BYTES + e.offset:HEADER_BYTES + e.offset + e.nbytes]
                                    for e in stored.ref.entries]
        tensors = read_spill_file(stored.path, stored.ref)
        return stored.ref, [byte_view(tensors[e.name]) for e in stored.ref.entries]

    def metrics(self, *, reclaim: bool = True) -> dict[str, float]:
        """The store's gauges and counters. `reclaim` first frees what same-node consumers marked
        consumed, a scan of every live payload; without it this costs the same however many are
        live (the rollout rank sends these with every outcome), and payloads consumed since the
        server thread's last reclaim still count as live."""
        with self.lock:
            if reclaim:
                self.reclaim_locked()
            num_pooled = sum(len(segments) for segments in self.pooled.values())
            return {
                "payloads/live": len(self.payloads),
                "payloads/occupancy_bytes": self.live_bytes["shm"],  # payload bytes in shared memory
                "payloads/segments": self.live_count["shm"] + num_pooled,
                "payloads/pooled_segments": num_pooled,
                "payloads/segment_bytes": self.segment_bytes,  # shared memory held, <= budget_bytes
                "payloads/budget_bytes": self.budget_bytes,
                "payloads/spill_files": self.live_count["file"],
                "payloads/spill_file_bytes": self.live_bytes["file"],
                **{f"payloads/{name}": value for name, value in self.counters.items()},
            }

    def close(self) -> None:
        """Stops the server and removes every segment and spill file this store made."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.server is not None:
            self.server.close()
        with self.lock:
            for stored in self.payloads.values():
                if stored.segment is not None:
                    self.destroy_segment(stored.segment)
                if stored.path is not None:
                    remove_quietly(stored.path)
            for segments in self.pooled.values():
                for segment in segments:
                    self.destroy_segment(segment)
            self.payloads.clear()
            self.pooled.clear()
            self.live_count = {"shm": 0, "file": 0}
            self.live_bytes = {"shm": 0, "file": 0}
        remove_prefix(self.prefix, [self.shm_dir, self.spill_dir])  # the owner file, and any leftover
        remove_quietly(self.owner_path)

    def __enter__(self) -> PayloadStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the segment pool ---------------------------------------------------------------------

    def take_segment(self, nbytes: int) -> Segment | None:
        """A pooled or new segment for `nbytes`, or None if the budget cannot hold one."""
        capacity = segment_capacity(nbytes)
        size = HEADER_BYTES + capacity
        if size > self.budget_bytes:
            return None
        with self.lock:
            # Consumed payloads refill the pool; a scan for them is paced unless the budget is short.
            if not self.pooled.get(capacity) and (self.segment_bytes + size > self.budget_bytes
                                                  or time.monotonic() >= self.next_reclaim):
                self.reclaim_locked()
            if self.pooled.get(capacity):
                return self.pooled[capacity].pop()
            while self.segment_bytes + size > self.budget_bytes and self.evict_pooled():
                pass
            if self.segment_bytes + size > self.budget_bytes:
                return None
            return self.create_segment(capacity)

    def write_segment(self, segment: Segment, key: str, nbytes: int, entries: tuple[TensorEntry, ...],
                      tensors: dict[str, torch.Tensor]) -> None:
        try:
            for entry, tensor in zip(entries, tensors.values()):
                start = HEADER_BYTES + entry.offset
                segment.memory[start:start + entry.nbytes] = byte_view(tensor)
            header = HEADER.pack(MAGIC, bytes.fromhex(key), nbytes, bytes(16))
            segment.memory[:HEADER.size] = np.frombuffer(header, dtype=np.uint8)
        except BaseException:
            with self.lock:
                self.pool(segment)
            raise

    def pool(self, segment: Segment) -> None:
        self.pooled.setdefault(segment.capacity, []).append(segment)

    def create_segment(self, capacity: int) -> Segment | None:
        name = self.prefix + secrets.token_hex(16)
        path = os.path.join(self.shm_dir, name)
        size = HEADER_BYTES + capacity
        fd = os.open(path, CREATE_FLAGS | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: a full /dev/shm must mean "spill", not SIGBUS on a later write.
            os.posix_fallocate(fd, 0, size)
            memory = map_shared(fd)
        except (OSError, RuntimeError) as error:  # RuntimeError: torch could not map it
            logger.warning("payload store: no shared memory for a %d-byte segment (%s); spilling", size, error)
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        self.segment_bytes += size
        self.counters["segments_created"] += 1
        return Segment(name, capacity, memory)

    def evict_pooled(self) -> bool:
        """Unlinks the largest pooled segment to make room; False if the pool is empty."""
        capacities = [capacity for capacity, segments in self.pooled.items() if segments]
        if not capacities:
            return False
        self.destroy_segment(self.pooled[max(capacities)].pop())
        self.counters["segments_evicted"] += 1
        return True

    def destroy_segment(self, segment: Segment) -> None:
        self.segment_bytes -= HEADER_BYTES + segment.capacity
        # Unmapped once the last view goes: a zero-copy send still in flight keeps it until done.
        segment.memory = None
        remove_quietly(os.path.join(self.shm_dir, segment.name))
