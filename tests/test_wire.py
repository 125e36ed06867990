"""The controller's socket decodes msgpack only: crafted pickles are dropped, never run, and it keeps serving."""

import pickle

import msgpack
import zmq

from molt.wire import Router, connect_dealer, pack
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
