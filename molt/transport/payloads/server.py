"""The payload store's ZeroMQ face (DESIGN section 7): a ROUTER socket, served by one thread, that
answers other ranks' fetches and frees. No pickle: a request is exactly one msgpack header frame
with known keys of known types; a payload goes back as one msgpack header frame and one raw frame
per tensor, sent zero-copy straight out of shared memory.

    fetch {id, key} -> payload {id, key, sizes} + one frame per tensor, or error {id, error}
    free {id, key}  -> freed {id, key, found}
"""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import zmq

from molt.transport.payloads.reference import KEY_PATTERN

logger = logging.getLogger("molt")

MAX_HEADER_BYTES = 4096
RECLAIM_SECONDS = 0.1
REQUEST_FIELDS = {"type": str, "id": int, "key": str}
REPLY_FIELDS = {
    "payload": {"type": str, "id": int, "key": str, "sizes": list},
    "freed": {"type": str, "id": int, "key": str, "found": bool},
    "error": {"type": str, "id": int, "error": str},
}


def pack_header(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def parse_header(frame: bytes, fields_by_type: dict[str, dict[str, type]]) -> dict:
    """The msgpack map in `frame` if it has exactly the fields its "type" calls for, with exactly
    their types; ValueError otherwise. Nothing in the frame is ever executed or unpickled."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ValueError(f"header frame of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several types for garbage; all mean "not a header"
        raise ValueError(f"header frame is not msgpack: {type(error).__name__}") from None
    fields = fields_by_type.get(header.get("type")) if isinstance(header, dict) else None
    if fields is None:
        raise ValueError(f"header must be a map with type in {sorted(fields_by_type)}; got {header!r:.100}")
    if set(header) != set(fields) or any(type(header[k]) is not t for k, t in fields.items()):
        expected = ", ".join(f"{k}: {t.__name__}" for k, t in fields.items())
        raise ValueError(f"{header['type']} header must have exactly {{{expected}}}; got {header!r:.200}")
    if "key" in header and not KEY_PATTERN.fullmatch(header["key"]):
        raise ValueError(f"payload key must be 32 hex digits, got {header['key']!r:.50}")
    return header


class PayloadServer:
    """Serves one PayloadStore on `tcp://<host>:<random port>` from a daemon thread."""

    def __init__(self, store, host: str):
        self.store = store
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)  # libzmq drops peers that send more
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"payload-server-{store.node_id}", daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            next_reclaim = 0.0
            while not self.stopping.is_set():
                if self.socket.poll(100):
                    self.handle(self.socket.recv_multipart())
                if time.monotonic() >= next_reclaim:  # frees that same-node consumers left in shm
                    self.store.reclaim()
                    next_reclaim = time.monotonic() + RECLAIM_SECONDS
        finally:
            self.socket.close(0)

    def handle(self, frames: list[bytes]) -> None:
        identity, body, request_id = frames[0], frames[1:], -1
        try:
            if len(body) != 1:
                raise ValueError(f"a request is one header frame, got {len(body)} frames")
            request = parse_header(body[0], {"fetch": REQUEST_FIELDS, "free": REQUEST_FIELDS})
            request_id, key = request["id"], request["key"]
            if request["type"] == "free":
                found = self.store.free(key)
                self.socket.send_multipart([identity, pack_header(
                    {"type": "freed", "id": request_id, "key": key, "found": found})])
                return
            exported = self.store.export(key)
            if exported is None:
                raise ValueError(f"no payload {key} on node {self.store.node_id} (never stored, or already freed)")
            ref, buffers = exported
            header = {"type": "payload", "id": request_id, "key": key, "sizes": [e.nbytes for e in ref.entries]}
            # copy=False: frames leave straight from shared memory (pyzmq still copies small ones).
            self.socket.send_multipart([identity, pack_header(header), *buffers], copy=False)
        except Exception as error:  # a bad request must not stop the server
            if not isinstance(error, ValueError):
                logger.warning("payload server %s: request failed: %r", self.address, error)
            self.socket.send_multipart([identity, pack_header(
                {"type": "error", "id": request_id, "error": str(error)})])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.context.term()
