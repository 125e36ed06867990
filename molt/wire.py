"""Messages between ranks: msgpack dicts over ZeroMQ. No pickle anywhere on the wire."""

from __future__ import annotations

import time

import msgpack
import zmq


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

    def send(self, identity: str, message: dict) -> None:
        self.socket.send_multipart([identity.encode(), pack(message)])

    def receive(self, timeout_seconds: float) -> tuple[str, dict]:
        """Next message from any rank; TimeoutError after `timeout_seconds`."""
        if not self.socket.poll(int(timeout_seconds * 1000)):
            raise TimeoutError(f"no message from any rank within {timeout_seconds:.0f}s")
        identity, frame = self.socket.recv_multipart()
        return identity.decode(), unpack(frame)

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
