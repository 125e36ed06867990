"""The controller's socket admits only the job's ranks (CURVE), decodes msgpack only and caps message
size: strangers, crafted pickles, malformed and oversize messages are dropped and logged, and it
keeps serving."""

import contextlib
import dataclasses
import logging
import pickle
import socket
import time

import msgpack
import pytest
import zmq

from molt.transport.wire import ControllerAddress, Router, connect_dealer, pack, unpack
from test_payloads import Exploit


def test_the_controller_socket_drops_crafted_pickles_and_keeps_serving(tmp_path):
    marker = tmp_path / "pickle-ran"
    pickle.loads(pickle.dumps(Exploit(tmp_path / "sanity")))  # the exploit works where pickle is used
    assert (tmp_path / "sanity").exists()
    router = Router("127.0.0.1")
    context = zmq.Context()
    dealer = connect_dealer(router.address, "rollout-1", context)
    try:
        evil = pickle.dumps(Exploit(marker))
        dealer.send(evil)  # as the message
        dealer.send(pickle.dumps({"type": "hello", "rank": Exploit(marker)}))
        dealer.send_multipart([pack({"type": "hello"}), evil])  # as an extra frame
        dealer.send(msgpack.packb(msgpack.ExtType(1, evil)))  # inside a msgpack extension
        dealer.send(b"")
        dealer.send(pack({"type": "hello", "rank": 1, "blob": evil}))  # a value: stays bytes
        identity, message = router.receive(10)
        assert identity == "rollout-1" and message["type"] == "hello" and message["blob"] == evil
        assert not marker.exists()
        dealer.send(pack({"type": "ready", "rank": 1}))
        assert router.receive(10)[1] == {"type": "ready", "rank": 1}
    finally:
        dealer.close(0)
        context.term()
        router.close()


def _wait_for_refusals(router: Router, count: int, timeout_seconds: float = 60, *, cut_off: int = 0) -> None:
    """Serve the router until it has refused `count` connections and refused or cut off `count +
    cut_off`; nothing may arrive meanwhile."""
    deadline = time.monotonic() + timeout_seconds
    while router.num_refused < count or router.num_refused + router.num_closed < count + cut_off:
        assert time.monotonic() < deadline, (f"refused {router.num_refused} and cut off {router.num_closed} "
                                             f"connections, expected {count} and {cut_off}")
        with pytest.raises(TimeoutError):
            router.receive(0.5)


def test_strangers_without_the_jobs_key_are_refused_and_the_controller_keeps_serving(caplog):
    router = Router("127.0.0.1")
    context = zmq.Context()
    plain = context.socket(zmq.DEALER)  # no CURVE at all: the one msgpack message
    own_key = context.socket(zmq.DEALER)  # CURVE with the controller's public key but its own client key
    own_key.curve_serverkey = router.address.server_key
    own_key.curve_publickey, own_key.curve_secretkey = zmq.curve_keypair()
    raw = socket.create_connection(("127.0.0.1", int(router.address.endpoint.rsplit(":", 1)[1])))
    rank = connect_dealer(router.address, "rollout-1", context)
    try:
        with caplog.at_level(logging.WARNING, logger="molt"):
            # The raw socket first, alone: libzmq reports it refused or cut off, by when its bytes arrive.
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + pack({"type": "shutdown"}))
            _wait_for_refusals(router, 0, cut_off=1)
            refused_before = router.num_refused
            for stranger in (plain, own_key):
                stranger.setsockopt(zmq.LINGER, 0)
                stranger.setsockopt(zmq.IDENTITY, b"rollout-1")  # posing as a rank
                stranger.connect(router.address.endpoint)
                # Not blocking: a DEALER whose handshake has already failed has no peer, and its send would
                # wait for one forever (it did, on a loaded machine); the refusal is what counts here.
                with contextlib.suppress(zmq.Again):
                    stranger.send(pack({"type": "shutdown"}), zmq.NOBLOCK)
            _wait_for_refusals(router, refused_before + 2)  # both fail the handshake
            rank.send(pack({"type": "ready", "rank": 1}))
            assert router.receive(30) == ("rollout-1", {"type": "ready", "rank": 1})
            router.send("rollout-1", {"type": "rollout"})
            assert unpack(rank.recv()) == {"type": "rollout"}
        assert "refused a connection" in caplog.text
        assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1  # a stray peer retries: one line
    finally:
        raw.close()
        for sock in (plain, own_key, rank):
            sock.close(0)
        context.term()
        router.close()


def test_a_rank_does_not_talk_to_a_server_without_the_controllers_key():
    router = Router("127.0.0.1")
    impostor = Router("127.0.0.1")  # another server key at the address a rank was given
    forged = dataclasses.replace(router.address, endpoint=impostor.address.endpoint)
    context = zmq.Context()
    rank = connect_dealer(forged, "rollout-1", context)
    try:
        rank.send(pack({"type": "ready", "rank": 1}))
        _wait_for_refusals(impostor, 1)  # the impostor cannot read it either: different client key
    finally:
        rank.close(0)
        context.term()
        router.close()
        impostor.close()


def test_a_ranks_malformed_and_oversize_messages_are_dropped_and_logged(caplog):
    router = Router("127.0.0.1", max_message_bytes=1 << 20)
    context = zmq.Context()
    rank = connect_dealer(router.address, "trainer-1", context)
    try:
        with caplog.at_level(logging.INFO, logger="molt"):
            rank.send(pack({"type": "hello", "rank": 1}))
            assert router.receive(30)[1] == {"type": "hello", "rank": 1}
            rank.send(pack(["not", "a", "map"]))
            rank.send(b"\xc1")  # never valid msgpack
            rank.send(pack({"type": "batch", "blob": bytes(2 << 20)}))  # over the cap
            deadline = time.monotonic() + 60
            while "a connection closed" not in caplog.text:
                assert time.monotonic() < deadline, "the oversize message's connection was never reported"
                with pytest.raises(TimeoutError):
                    router.receive(0.5)
            # The rank reconnects; what it sends then arrives. (What it sent between the oversize
            # message and the close went down with that connection.)
            rank.send(pack({"type": "ready", "rank": 1}))
            assert router.receive(60) == ("trainer-1", {"type": "ready", "rank": 1})
        malformed = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert len(malformed) == 2, caplog.text
        assert "1048576-byte cap" in caplog.text
        assert router.bytes_received < 1 << 20  # the oversize frame never reached the controller
    finally:
        rank.close(0)
        context.term()
        router.close()


def test_the_controller_address_travels_through_the_store_as_bytes_and_hides_its_secret():
    router = Router("127.0.0.1")
    try:
        address = ControllerAddress.from_bytes(router.address.to_bytes())
        assert address == router.address
        assert router.address.client_secret_key.decode() not in repr(address)
        with pytest.raises(ValueError, match="needs the controller's keys"):
            connect_dealer(router.address.endpoint, "rollout-1")
    finally:
        router.close()
