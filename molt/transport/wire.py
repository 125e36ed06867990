"""Messages between ranks: msgpack dicts over ZeroMQ. No pickle anywhere on the wire.

The controller's socket is a CURVE server: rank 0 makes a key pair for it and one for its peers
at start-up and hands both to the job's ranks through the torch.distributed store (which every
rank already trusts for rendezvous), so only the job's ranks can connect and what they send is
encrypted. A connection without the job's key fails its handshake and never delivers a message;
a malformed message is dropped; a message over the size cap closes its connection. Each is logged
and the controller goes on. (The agent workers' socket, molt.rollout.agent_pool, is an ipc:// socket in a
private 0700 directory: only this user reaches it.)
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message


logger = logging.getLogger("molt")

# The largest message the controller accepts. The largest legitimate ones are a rollout's outcome and
# a step's batched records, whose small payloads travel inline (tens of KiB per experience): tens of
# MiB at most. libzmq closes the connection of a peer that sends more, before reading it into memory.
MAX_MESSAGE_BYTES = 256 << 20
WARNING_INTERVAL_SECONDS = 60.0  # refused and closed connections are each logged at most this often
HANDSHAKE_FAILURES = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
                      zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a CURVE peer with the controller's key",
                      zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key is not this job's"}


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict:
    message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    if not isinstance(message, dict) or "type" not in message:
        raise ValueError(f"malformed message: expected a map with 'type', got {type(message).__name__}")
    return message


@dataclass(frozen=True)
class ControllerAddress:
    """Where the controller listens, and the job's CURVE keys (Z85) a rank connects with."""

    endpoint: str  # tcp://host:port
    server_key: bytes  # the controller's public key: a rank refuses a server without its secret half
    client_public_key: bytes  # the one client key the controller admits
    client_secret_key: bytes = field(repr=False)  # never in a log line

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.endpoint, self.server_key, self.client_public_key, self.client_secret_key])

    @classmethod
    def from_bytes(cls, data: bytes) -> ControllerAddress:
        return cls(*msgpack.unpackb(data, raw=False))


class JobKey:
    """The controller's ZAP check: admits the job's client key only."""

    def __init__(self, public_key: bytes):
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public_key)


class Router:
    """The controller's socket: every other rank connects to it with its own identity (connect_dealer)
    and the job's keys, which `address` carries."""

    def __init__(self, host: str, max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.context = zmq.Context()  # its own: the authenticator answers this context's handshakes
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self.authenticator = ThreadAuthenticator(self.context)
        self.authenticator.start()
        self.authenticator.configure_curve_callback("*", credentials_provider=JobKey(client_public))
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.socket.curve_server = True
        self.socket.curve_secretkey = server_secret
        self.socket.curve_publickey = server_public
        self.max_message_bytes = max_message_bytes
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | sum(HANDSHAKE_FAILURES))
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = ControllerAddress(f"tcp://{host}:{port}", server_public, client_public, client_secret)
        # The controller's traffic through this socket, each way: messages (well-formed ones, in) and
        # bytes. A send counts once ZeroMQ has taken it: one to a rank that is not connected raises
        # instead (ROUTER_MANDATORY) and counts nothing.
        self.messages_sent = self.messages_received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.num_refused = 0  # connections that failed the handshake
        self.num_closed = 0  # connections closed after the handshake, or cut off before it
        self.next_warning: dict[str, float] = {}  # kind of warning -> when it may next be logged
        self.last_event = 0  # the monitor's previous event

    def send(self, identity: str, message: dict) -> None:
        """Hand one message to ZeroMQ; ConnectionError naming `identity` when no such rank is connected."""
        frame = pack(message)
        try:
            self.socket.send_multipart([identity.encode(), frame])
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            raise ConnectionError(f"{identity} is not connected to the controller (it exited, or never "
                                  f"connected): its {message.get('type')!r} message was not sent") from error
        self.messages_sent += 1
        self.bytes_sent += len(frame)

    def receive(self, timeout_seconds: float) -> tuple[str, dict]:
        """Next message from any rank; TimeoutError after `timeout_seconds`. A frame that is not a
        msgpack message (a crafted payload, a bug) is logged and dropped, never decoded further;
        refused and dropped connections are logged as they happen."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            ready = dict(self.poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self.monitor in ready:
                self.log_connection_event(recv_monitor_message(self.monitor))
            if self.socket not in ready:
                if not ready:
                    raise TimeoutError(f"no message from any rank within {timeout_seconds:.0f}s")
                continue
            identity, *frames = self.socket.recv_multipart()
            self.bytes_received += sum(len(frame) for frame in frames)
            try:
                if len(frames) != 1:
                    raise ValueError(f"expected one frame, got {len(frames)}")
                sender, message = identity.decode(), unpack(frames[0])
                self.messages_received += 1
                return sender, message
            except (ValueError, UnicodeDecodeError, msgpack.UnpackException) as error:
                logger.warning("controller socket: dropped a malformed message from %r: %s", identity[:64],
                               str(error) or type(error).__name__)

    def log_connection_event(self, event: dict) -> None:
        """A connection that fails the CURVE handshake reports that, then its disconnection, back to
        back (the context's one I/O thread emits both in one call); a disconnection on its own is a
        rank's connection closing, or a peer that does not speak ZeroMQ cut off."""
        kind, previous = event["event"], self.last_event
        self.last_event = kind
        if kind in HANDSHAKE_FAILURES:
            self.num_refused += 1
            self.warn_rarely("refused", f"refused a connection ({HANDSHAKE_FAILURES[kind]}); {self.num_refused} "
                                        f"refused so far. Only this job's ranks hold its key")
        elif previous not in HANDSHAKE_FAILURES:
            # Ranks close their connections as they finish, so a closed connection is news, not a
            # warning; a rank that died mid-run is named by the wait that misses its messages.
            self.num_closed += 1
            self.warn_rarely("closed", level=logging.INFO, text=f"a connection closed ({self.num_closed} so far): a rank exited, or sent a "
                                       f"message over the {self.max_message_bytes}-byte cap, which was dropped (it "
                                       f"reconnects if it lives); or a peer that does not speak ZeroMQ was cut off")

    def warn_rarely(self, kind: str, text: str, level: int = logging.WARNING) -> None:
        """A stray peer retries several times a second: one line per kind a minute."""
        now = time.monotonic()
        if now >= self.next_warning.get(kind, 0.0):
            self.next_warning[kind] = now + WARNING_INTERVAL_SECONDS
            logger.log(level, "controller socket: %s", text)

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)
        self.authenticator.stop()
        self.context.term()


def connect_dealer(address: ControllerAddress | str, identity: str, context: zmq.Context | None = None) -> zmq.Socket:
    """A rank's socket to the controller, authenticated with the job's client key (it refuses a
    server without the controller's secret key); or, given an ipc:// address, a plain one."""
    socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    if isinstance(address, ControllerAddress):
        socket.curve_serverkey = address.server_key
        socket.curve_publickey = address.client_public_key
        socket.curve_secretkey = address.client_secret_key
        address = address.endpoint
    elif not address.startswith("ipc://"):
        raise ValueError(f"{address!r}: a TCP peer needs the controller's keys (pass its ControllerAddress)")
    socket.connect(address)
    return socket
