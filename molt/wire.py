"""Messages between ranks: msgpack dicts over ZeroMQ. No pickle anywhere on the wire."""

from __future__ import annotations

import logging
import time

import msgpack
import zmq


logger = logging.getLogger("molt")


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict:
    message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    if not isinstance(message, dict) or "type" not in message:
        raise ValueError(f"malformed message: expected a map with 'type', got {type(message).__name__}")
    return message


class Router:
    """The controller's socket: every other rank connects to it with its own identity."""

    def __init__(self, host: str):
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.bytes_sent = 0  # message bytes through this socket, each way (the controller's traffic)
        self.bytes_received = 0

    def send(self, identity: str, message: dict) -> None:
        frame = pack(message)
        self.bytes_sent += len(frame)
        self.socket.send_multipart([identity.encode(), frame])

    def receive(self, timeout_seconds: float) -> tuple[str, dict]:
        """Next message from any rank; TimeoutError after `timeout_seconds`. A frame that is not a
        msgpack message (a stray client, a crafted payload) is logged and dropped, never decoded further."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            if not self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"no message from any rank within {timeout_seconds:.0f}s")
            identity, *frames = self.socket.recv_multipart()
            self.bytes_received += sum(len(frame) for frame in frames)
            try:
                if len(frames) != 1:
                    raise ValueError(f"expected one frame, got {len(frames)}")
                return identity.decode(), unpack(frames[0])
            except (ValueError, UnicodeDecodeError, msgpack.UnpackException) as error:
                logger.warning("controller socket: dropped a malformed message from %r: %s", identity[:64], error)

    def receive_until(self, deadline: float) -> tuple[str, dict]:
        return self.receive(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.socket.close(0)


def connect_dealer(address: str, identity: str, context: zmq.Context | None = None) -> zmq.Socket:
    socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket
