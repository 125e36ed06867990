"""Reloading payloads on the consuming rank (DESIGN section 7). One reference, two paths:

- on the owner's node, the segment is mapped (once: the owner reuses its segments, so the client
  keeps a few mappings) and the payload copied out into fresh tensors; the consumer then marks it
  consumed in the segment header, and the owner frees it from there. A spilled payload is read
  from its file and freed with a message;
- from any other node, the owner's store sends the tensors over ZeroMQ as raw frames, received
  without a copy; the consumer then frees it with a message.

Either way nothing is freed before the consuming rank holds its tensors."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict

import numpy as np
import torch
import zmq

from molt.transport.payloads.files import copy_out, default_spill_dir, map_segment, mark_consumed, read_spill_file
from molt.transport.payloads.reference import DTYPES, PayloadRef, check_node_id
from molt.transport.payloads.server import REPLY_FIELDS, pack_header, parse_header
from molt.transport.payloads.store import PayloadStore

logger = logging.getLogger("molt")

SWEEP_EVERY_RELOADS = 64  # how often mappings of segments the owner has unlinked are dropped


class PayloadClient:
    """Reloads and frees payloads for one process on node `node_id`. Not thread-safe.

    `store`: this process's own store, if any, so that freeing its payloads skips the socket.
    `max_mapped_segments`: segments kept mapped between reloads (each one of the owner's pooled
    segments, so a handful covers a steady stream of similar payloads).
    """

    def __init__(self, node_id: str, *, spill_dir: str | None = None, shm_dir: str = "/dev/shm",
                 timeout_seconds: float = 60.0, store: PayloadStore | None = None, max_mapped_segments: int = 64):
        self.node_id = check_node_id(node_id)
        self.spill_dir = spill_dir or default_spill_dir()
        self.shm_dir = shm_dir
        self.timeout_seconds = timeout_seconds
        self.store = store
        self.max_mapped_segments = max_mapped_segments
        self.mappings: OrderedDict[str, np.ndarray] = OrderedDict()  # segment name -> its bytes, mapped
        self.num_reloads = 0
        self.context = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}  # owner address -> DEALER
        self.request_ids = itertools.count()

    def reload(self, ref: PayloadRef, *, consume: bool = True) -> dict[str, torch.Tensor]:
        """The payload's tensors, in its order; then (`consume`) frees it at the owner. The tensors
        of one payload share one buffer."""
        self.num_reloads += 1
        if self.num_reloads % SWEEP_EVERY_RELOADS == 0:
            self.drop_stale_mappings()
        if ref.node == self.node_id:
            try:
                return self.reload_here(ref, consume)
            except FileNotFoundError:  # not where this rank looks (its shm_dir or spill_dir differs)
                logger.debug("payload %s is not in %s or %s here; fetching it from %s",
                             ref.key, self.shm_dir, self.spill_dir, ref.address)
        tensors = self.fetch(ref)
        if consume:
            self.release(ref)
        return tensors

    def reload_here(self, ref: PayloadRef, consume: bool) -> dict[str, torch.Tensor]:
        """The payload read on its owner's node: copied out of its mapped segment, or its spill file."""
        if ref.location == "file":
            tensors = read_spill_file(os.path.join(self.spill_dir, ref.name), ref)
            if consume:
                self.release(ref)
            return tensors
        segment = self.segment(ref.name)
        tensors = copy_out(segment, ref)
        if consume and self.is_own(ref):
            self.store.free(ref.key)
        elif consume:
            mark_consumed(segment, ref)
        return tensors

    def fetch(self, ref: PayloadRef) -> dict[str, torch.Tensor]:
        """The payload from its owner over ZeroMQ, each tensor viewing its received frame."""
        header, frames = self.request(ref, "fetch")
        sizes = [e.nbytes for e in ref.entries]
        if header["sizes"] != sizes or len(frames) != len(sizes) or [len(f) for f in frames] != sizes:
            raise ValueError(f"payload {ref.key} from {ref.address} does not match its reference: frames of "
                             f"{[len(f) for f in frames]} bytes, expected {sizes}")
        tensors = {}
        for entry, frame in zip(ref.entries, frames):
            dtype = DTYPES[entry.dtype]
            if entry.nbytes == 0:
                tensors[entry.name] = torch.empty(entry.shape, dtype=dtype)
            else:
                tensors[entry.name] = torch.frombuffer(frame.buffer, dtype=dtype).view(entry.shape)
        return tensors

    def free(self, ref: PayloadRef) -> bool:
        """Frees the payload at its owner and waits; False if the owner no longer had it."""
        if self.is_own(ref):
            return self.store.free(ref.key)
        header, _ = self.request(ref, "free")
        return header["found"]

    def release(self, ref: PayloadRef) -> None:
        """Frees the payload at its owner without waiting for the answer (ZeroMQ delivers it while
        both processes live; if the owner died, there is nothing left to free)."""
        if self.is_own(ref):
            self.store.free(ref.key)
            return
        socket = self.socket(ref.address)
        while socket.poll(0):  # answers to earlier releases, so they never pile up
            header = parse_header(socket.recv_multipart()[0], REPLY_FIELDS)
            if header["type"] == "error" or not header.get("found", True):
                logger.warning("payload store at %s: releasing a payload failed: %s", ref.address, header)
        socket.send(pack_header({"type": "free", "id": next(self.request_ids), "key": ref.key}))

    def is_own(self, ref: PayloadRef) -> bool:
        return self.store is not None and ref.node == self.store.node_id and ref.address == self.store.address

    def socket(self, address: str) -> zmq.Socket:
        if not address:
            raise ValueError("this payload's store does not serve (serve=False): it can be reloaded only on its "
                             "own node, from shared memory or its spill directory")
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.sockets[address] = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 1000)  # releases still queued at close get a second to go
            socket.connect(address)
        return socket

    def request(self, ref: PayloadRef, kind: str) -> tuple[dict, list[zmq.Frame]]:
        """Sends one request to the owner and waits for its reply (answers to releases and to
        earlier, abandoned requests are skipped)."""
        socket = self.socket(ref.address)
        request_id = next(self.request_ids)
        socket.send(pack_header({"type": kind, "id": request_id, "key": ref.key}))
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not socket.poll(int(remaining * 1000) + 1):
                raise TimeoutError(f"payload store of node {ref.node} at {ref.address} did not answer {kind} "
                                   f"{ref.key} within {self.timeout_seconds:.0f}s; is its rank alive?")
            frames = socket.recv_multipart(copy=False)
            header = parse_header(frames[0].bytes, REPLY_FIELDS)
            if header["id"] != request_id:
                continue
            if header["type"] == "error":
                raise ValueError(f"payload store of node {ref.node} refused {kind} {ref.key}: {header['error']}")
            if header["key"] != ref.key or header["type"] != {"fetch": "payload", "free": "freed"}[kind]:
                raise ValueError(f"payload store at {ref.address} answered {kind} {ref.key} with {header!r:.200}")
            return header, frames[1:]

    def segment(self, name: str) -> np.ndarray:
        """The named segment's bytes, mapped once and kept (least recently used goes first)."""
        if name in self.mappings:
            self.mappings.move_to_end(name)
            return self.mappings[name]
        while len(self.mappings) >= max(1, self.max_mapped_segments):
            self.mappings.popitem(last=False)  # unmapped with its last view
        self.mappings[name] = map_segment(os.path.join(self.shm_dir, name))
        return self.mappings[name]

    def drop_stale_mappings(self) -> None:
        """Unmaps segments the owner has unlinked (evicted or closed): their memory goes now."""
        for name in [n for n in self.mappings if not os.path.exists(os.path.join(self.shm_dir, n))]:
            del self.mappings[name]

    def close(self) -> None:
        self.mappings.clear()
        for socket in self.sockets.values():
            socket.close()
        self.sockets.clear()
        self.context.term()
