"""The payload store and both reload paths (DESIGN section 7; RELIABILITY 17, 18, 20): bit-exact
round trips, spilling, a second node in its own process, crafted pickles, names and permissions,
killed consumers and producers, and flat resources over many cycles."""

import dataclasses
import json
import os
import pickle
import queue
import secrets
import signal
import stat
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import safetensors.torch
import torch
import zmq

from molt.trace.experience import Experience
from molt.transport.payloads import (
                                     PayloadClient, PayloadRef, PayloadStore, offload_experience, offload_record, reload_record, restore_experience,
                                     )
from molt.transport.payloads.fields import payload_nbytes
from molt.transport.payloads.reference import ALIGNMENT
from molt.transport.payloads.server import pack_header
from molt.transport.payloads.store import INLINE_BYTES
from payload_node import make_tensors

NODE_SCRIPT = Path(__file__).parent / "payload_node.py"
SHM_DIR = "/dev/shm"
KIB = 1 << 10


# -- helpers --------------------------------------------------------------------------------------


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)  # compares NaN payloads too


def assert_bit_exact(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(raw_bytes(got), raw_bytes(tensor)), name


def shm_entries(node: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(f"molt-{node}-"))


def wait_for(predicate, timeout_seconds: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_seconds}s")
        time.sleep(0.02)


def wire(ref: PayloadRef) -> PayloadRef:
    """The reference as the controller would receive it: through msgpack."""
    return PayloadRef.from_dict(msgpack.unpackb(msgpack.packb(ref.to_dict()), raw=False))


class NodeProcess:
    """tests/payload_node.py serving a store with its own node id in another process."""

    def __init__(self, node: str, spill_dir: Path, budget_bytes: int):
        self.process = subprocess.Popen(
            [sys.executable, str(NODE_SCRIPT), "serve", node, str(spill_dir), str(budget_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()
        hello = json.loads(self.lines.get(timeout=60))
        self.prefix, self.address = hello["prefix"], hello["address"]

    def ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self.lines.get(timeout=30))

    def offload(self, seed: int, scale: int = 1) -> PayloadRef:
        return wire(PayloadRef.from_dict(self.ask({"offload": seed, "scale": scale})))

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def quit(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write('{"quit": 1}\n')
            self.process.stdin.flush()
            self.process.wait(timeout=30)


@pytest.fixture
def node_id() -> str:
    return f"test{secrets.token_hex(4)}"  # unique: other test runs may share /dev/shm


@pytest.fixture
def spill_dir(tmp_path) -> Path:
    return tmp_path / "spill"


@pytest.fixture
def store(node_id, spill_dir):
    with PayloadStore(node_id, budget_bytes=4 << 20, spill_dir=str(spill_dir)) as store:
        yield store
    assert shm_entries(node_id) == []
    assert list(spill_dir.iterdir()) == []


# -- round trips ----------------------------------------------------------------------------------


def test_round_trip_is_bit_exact_for_every_field_type_on_both_paths(store, node_id, spill_dir):
    tensors = make_tensors(1, scale=4)
    tensors["transposed"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    same_node = PayloadClient(node_id, spill_dir=str(spill_dir))
    other_node = PayloadClient("elsewhere")
    try:
        ref = wire(store.offload(tensors))
        assert ref.location == "shm" and ref.node == node_id
        first = same_node.reload(ref, consume=False)
        assert_bit_exact(tensors, first)
        first["image"].fill_(0)  # a copy, not a view of shared memory: the store keeps its bytes
        assert_bit_exact(tensors, same_node.reload(ref))
        assert store.metrics()["payloads/live"] == 0  # consumed: freed through the segment header

        remote = other_node.reload(wire(store.offload(tensors)))
        assert_bit_exact(tensors, remote)
        remote["token_ids"].add_(1)  # received frames are writable tensors
        wait_for(lambda: store.metrics()["payloads/live"] == 0)
        assert store.metrics()["payloads/fetched"] == 1
    finally:
        same_node.close()
        other_node.close()


def test_experience_offload_restore_round_trip(store, node_id):
    experience = Experience(
        token_ids=[5, 9, 2, 7, 1], action_mask=[0, 0, 1, 1, 1], behavior_logprobs=[0.0, 0.0, -0.5, -1.25, -3.0],
        policy_versions=[-1, -1, 4, 4, 5], reward=1.0, score=0.5, group_id=3, rollout_id=11, segment_index=1,
        truncated=True, info={"turns": 2.0}, routed_experts=torch.randint(-1, 8, (5, 2, 2), dtype=torch.int16))
    extras = {"image": torch.randint(0, 256, (6, 5, 3), dtype=torch.uint8)}
    light, ref = offload_experience(store, experience, extras)
    assert light.token_ids == [] and light.reward == 1.0 and ref.entry("token_ids").shape == (5,)
    assert light.routed_experts is None and ref.entry("routed_experts").shape == (5, 2, 2)
    record = msgpack.unpackb(msgpack.packb({"experience": light.to_dict(), "payload": ref.to_dict()}), raw=False)
    client = PayloadClient(node_id, store=store)
    try:
        tensors = client.reload(PayloadRef.from_dict(record["payload"]))
    finally:
        client.close()
    restored, restored_extras = restore_experience(Experience.from_dict(record["experience"]), tensors)
    assert restored == experience and torch.equal(restored.routed_experts, experience.routed_experts)
    assert restored.routed_experts.dtype == torch.int16
    assert_bit_exact(extras, restored_extras)
    for name in ("token_ids", "routed_experts"):
        with pytest.raises(ValueError, match="token-axis"):
            offload_experience(store, experience, {name: torch.zeros(5)})


def test_sampling_temperatures_travel_in_the_payload_and_none_stays_none(store, node_id):
    """Per-token temperatures move into the payload with the other token-axis fields (float32, as
    the engine samples with them) and come back; None sends no tensor and comes back None."""
    store.inline_bytes = 0  # these experiences are short: they would travel inline, tested below
    temperatures = [1.0, 1.0, 0.75, 0.75, 1.5]  # float32-exact: the round trip is exact
    with_temperatures = Experience(
        token_ids=[5, 9, 2, 7, 1], action_mask=[0, 0, 1, 1, 1], behavior_logprobs=[0.0, 0.0, -0.5, -1.25, -3.0],
        policy_versions=[-1, -1, 4, 4, 5], temperatures=temperatures, reward=1.0, score=0.5, group_id=3,
        rollout_id=11)
    without = dataclasses.replace(with_temperatures, temperatures=None)
    client = PayloadClient(node_id, store=store)
    try:
        for experience in (with_temperatures, without):
            light, ref = offload_experience(store, experience)
            assert light.temperatures is None and light.token_ids == []
            assert ("temperatures" in [e.name for e in ref.entries]) == (experience.temperatures is not None)
            if experience.temperatures is not None:
                assert ref.entry("temperatures").dtype == "float32"
            tensors = client.reload(wire(ref))
            restored, extras = restore_experience(Experience.from_dict(light.to_dict()), tensors)
            assert restored == experience and extras == {}

            record = offload_record(store, experience)  # the path a rollout rank and a trainer rank take
            shipped = Experience.from_dict(msgpack.unpackb(msgpack.packb(record.to_dict()), raw=False))
            assert shipped.summary["num_tokens"] == 5 and shipped.temperatures is None
            assert reload_record(client, shipped) == experience
        with pytest.raises(ValueError, match="token-axis"):
            offload_experience(store, with_temperatures, {"temperatures": torch.ones(5)})
    finally:
        client.close()


def experience_of(num_tokens: int, *, temperatures: bool = False, seed: int = 0) -> Experience:
    """An experience whose lists take the most msgpack bytes a token can: token ids and versions
    past 2**16, float64 log-probs and temperatures that float32 cannot hold."""
    generator = torch.Generator().manual_seed(seed)
    action = (torch.arange(num_tokens) % 3 != 0).int()
    logprobs = -torch.rand(num_tokens, dtype=torch.float64, generator=generator) * action
    return Experience(
        token_ids=torch.randint(1 << 16, 1 << 30, (num_tokens,), generator=generator).tolist(),
        action_mask=action.tolist(), behavior_logprobs=logprobs.tolist(),
        policy_versions=[(1 << 16) + 7 if a else -1 for a in action.tolist()],
        temperatures=(0.3 + torch.rand(num_tokens, dtype=torch.float64, generator=generator)).tolist()
        if temperatures else None, reward=0.5, score=0.5, group_id=seed, rollout_id=seed)


def largest_inline_tokens(inline_bytes: int, num_float32_or_int32_fields: int) -> int:
    """The most tokens whose payload fits `inline_bytes`: a uint8 mask and 3 (4 with temperatures)
    fields of 4 bytes a token, each padded to ALIGNMENT."""
    def aligned(size: int) -> int:
        return -(-size // ALIGNMENT) * ALIGNMENT
    return max(n for n in range(inline_bytes + 1)
               if aligned(n) + num_float32_or_int32_fields * aligned(4 * n) <= inline_bytes)


def through_msgpack(record: Experience) -> Experience:
    return Experience.from_dict(msgpack.unpackb(msgpack.packb(record.to_dict()), raw=False))


def float32_rounded(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float32).tolist()


@pytest.mark.parametrize("temperatures", [False, True])
def test_short_experiences_travel_inline_and_longer_ones_through_shared_memory(
        store, node_id, spill_dir, temperatures):
    """At the inline threshold an experience is its own record: its lists cross msgpack exactly
    and the store holds nothing; one token more and it goes through shared memory as before, its
    floats rounded to float32. The store counts both, and frees the stored one once consumed."""
    assert store.inline_bytes == INLINE_BYTES  # the default, as a rollout rank runs it
    num_tokens = largest_inline_tokens(INLINE_BYTES, 4 if temperatures else 3)
    inline, stored = (experience_of(n, temperatures=temperatures, seed=n) for n in (num_tokens, num_tokens + 1))
    consumer = PayloadClient(node_id, spill_dir=str(spill_dir))  # same node, not the owner: a trainer rank
    try:
        record = offload_record(store, inline)
        assert record.payload is None and record.summary is None
        assert payload_nbytes(inline) <= INLINE_BYTES < payload_nbytes(stored)
        metrics = store.metrics()
        assert (metrics["payloads/inlined"], metrics["payloads/inlined_bytes"]) == (1, payload_nbytes(inline))
        assert metrics["payloads/offloaded"] == metrics["payloads/live"] == metrics["payloads/segments"] == 0
        assert shm_entries(node_id) == [f"{store.prefix}owner"]
        shipped = through_msgpack(record)
        # The record frame stays modest for the controller's socket: the lists take ~1.7x the payload.
        assert len(msgpack.packb(record.to_dict())) <= 1.75 * INLINE_BYTES
        assert reload_record(consumer, shipped) == inline  # exact: float64 log-probs and all
        assert type(shipped.token_ids[0]) is int and type(shipped.behavior_logprobs[1]) is float

        record = offload_record(store, stored)
        ref = PayloadRef.from_dict(record.payload)
        assert ref.location == "shm" and record.token_ids == [] and record.summary["num_tokens"] == num_tokens + 1
        assert payload_nbytes(stored) == sum(-(-e.nbytes // ALIGNMENT) * ALIGNMENT for e in ref.entries)
        assert store.metrics()["payloads/offloaded"] == store.metrics()["payloads/live"] == 1
        tensors = consumer.reload(wire(ref), consume=False)  # the payload itself: dtypes and shapes
        dtypes = {"token_ids": torch.int32, "action_mask": torch.uint8, "behavior_logprobs": torch.float32,
                  "policy_versions": torch.int32, **({"temperatures": torch.float32} if temperatures else {})}
        assert {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()} == {
            name: (dtype, (num_tokens + 1,)) for name, dtype in dtypes.items()}
        expected = dataclasses.replace(stored, behavior_logprobs=float32_rounded(stored.behavior_logprobs),
                                       temperatures=float32_rounded(stored.temperatures) if temperatures else None)
        assert reload_record(consumer, through_msgpack(record)) == expected
        wait_for(lambda: store.metrics()["payloads/live"] == 0)  # consumed, so freed
        metrics = store.metrics()
        assert (metrics["payloads/inlined"], metrics["payloads/offloaded"], metrics["payloads/freed"]) == (1, 1, 1)
        assert metrics["payloads/occupancy_bytes"] == 0 and metrics["payloads/pooled_segments"] == 1
    finally:
        consumer.close()


def test_inline_threshold_zero_stores_every_payload_and_negative_is_refused(node_id, spill_dir):
    with PayloadStore(node_id, spill_dir=str(spill_dir), inline_bytes=0, serve=False) as store:
        record = offload_record(store, experience_of(1))
        assert record.payload is not None and store.metrics()["payloads/inlined"] == 0
        client = PayloadClient(node_id, store=store)
        assert reload_record(client, record).token_ids == experience_of(1).token_ids
        client.close()
    with pytest.raises(ValueError, match="inline_bytes must be >= 0"):
        PayloadStore(node_id, spill_dir=str(spill_dir), inline_bytes=-1)


def test_spill_past_the_budget_reloads_from_file_on_both_paths(node_id, spill_dir, monkeypatch):
    small, big = make_tensors(1), make_tensors(2, scale=64)  # ~3 KiB and ~180 KiB
    same_node = PayloadClient(node_id, spill_dir=str(spill_dir))
    other_node = PayloadClient("elsewhere")
    try:
        with PayloadStore(node_id, budget_bytes=256 * KIB, spill_dir=str(spill_dir)) as store:
            kept = store.offload(small)
            spilled = [store.offload(big), store.offload(big)]
            assert kept.location == "shm" and all(ref.location == "file" for ref in spilled)
            files = sorted(p.name for p in spill_dir.iterdir())
            assert files == sorted(ref.name for ref in spilled)
            for path in spill_dir.iterdir():
                assert stat.S_IMODE(path.stat().st_mode) == 0o600
                assert set(safetensors.torch.load_file(path)) == set(big)  # a plain safetensors file
            metrics = store.metrics()
            assert metrics["payloads/spilled"] == 2 and metrics["payloads/spilled_bytes"] == 2 * spilled[0].nbytes
            assert metrics["payloads/segment_bytes"] <= 256 * KIB
            assert (metrics["payloads/spill_files"], metrics["payloads/spill_file_bytes"]) == (2, 2 * spilled[0].nbytes)
            assert (metrics["payloads/segments"], metrics["payloads/occupancy_bytes"]) == (1, kept.nbytes)

            assert_bit_exact(big, same_node.reload(wire(spilled[0])))
            assert_bit_exact(big, other_node.reload(wire(spilled[1])))
            assert_bit_exact(small, same_node.reload(wire(kept)))
            wait_for(lambda: store.metrics()["payloads/live"] == 0)
            assert list(spill_dir.iterdir()) == []
            metrics = store.metrics(reclaim=False)  # the gauges follow frees without a scan
            gauges = ("spill_files", "spill_file_bytes", "occupancy_bytes")
            assert [metrics[f"payloads/{name}"] for name in gauges] == [0, 0, 0]
            assert metrics["payloads/segments"] == metrics["payloads/pooled_segments"] == 1

            # A writer that dies between writing and renaming leaves only the .partial name.
            def crash(*args):
                raise OSError("crash")

            monkeypatch.setattr("molt.transport.payloads.files.os.replace", crash)
            with pytest.raises(OSError, match="crash"):
                store.offload(big)
            assert [p.suffix for p in spill_dir.iterdir()] == [".partial"]
        assert list(spill_dir.iterdir()) == [] and shm_entries(node_id) == []
    finally:
        same_node.close()
        other_node.close()


def test_pool_reuses_segments_and_evicts_them_before_spilling(node_id, spill_dir):
    budget = 3 * (256 * KIB + 64) + 64 * KIB  # three 256 KiB segments, with room for one 64 KiB one
    with PayloadStore(node_id, budget_bytes=budget, spill_dir=str(spill_dir)) as store:
        client = PayloadClient(node_id, store=store)
        names = set()
        for seed in range(20):
            ref = store.offload(make_tensors(seed))
            names.add(ref.name)
            assert_bit_exact(make_tensors(seed), client.reload(ref))
        assert len(names) == 1 and store.metrics()["payloads/segments"] == 1
        held = [store.offload(make_tensors(seed, scale=64)) for seed in range(4)]
        assert [ref.location for ref in held] == ["shm", "shm", "shm", "file"]
        metrics = store.metrics()
        assert metrics["payloads/pooled_segments"] == 0  # the pooled 64 KiB segment made room
        assert metrics["payloads/segment_bytes"] <= budget and metrics["payloads/occupancy_bytes"] > 0
        for seed, ref in enumerate(held):
            assert_bit_exact(make_tensors(seed, scale=64), client.reload(ref))
        assert store.metrics()["payloads/pooled_segments"] == 3
        client.close()


def test_remote_reload_from_a_second_node_process(node_id, spill_dir, tmp_path):
    other = f"{node_id}-b"
    node = NodeProcess(other, tmp_path / "spill-b", 256 * KIB)
    client = PayloadClient(node_id, spill_dir=str(spill_dir), timeout_seconds=10)
    local_on_b = PayloadClient(other, spill_dir=str(tmp_path / "spill-b"))
    try:
        in_memory, spilled = node.offload(3), node.offload(4, scale=64)
        assert (in_memory.node, in_memory.location, spilled.location) == (other, "shm", "file")
        assert_bit_exact(make_tensors(3), client.reload(in_memory))
        assert_bit_exact(make_tensors(4, scale=64), client.reload(spilled))
        wait_for(lambda: node.ask({"metrics": 1})["payloads/live"] == 0)
        with pytest.raises(ValueError, match="no payload"):
            client.reload(in_memory)

        # The same reference read on node B itself: straight from B's shared memory, another process.
        ref = node.offload(5)
        assert_bit_exact(make_tensors(5), local_on_b.reload(ref))
        wait_for(lambda: node.ask({"metrics": 1})["payloads/live"] == 0)
        assert node.ask({"metrics": 1})["payloads/fetched"] == 2  # the local read sent no fetch
    finally:
        client.close()
        local_on_b.close()
        node.quit()
    assert shm_entries(other) == [] and list((tmp_path / "spill-b").iterdir()) == []


def test_a_payload_is_consumed_once(store, node_id):
    same_node, other_node = PayloadClient(node_id), PayloadClient("elsewhere")
    try:
        ref = store.offload(make_tensors(1))
        same_node.reload(ref)
        with pytest.raises(ValueError, match="consumed already|freed already"):
            same_node.reload(ref)
        ref = store.offload(make_tensors(1))
        other_node.reload(ref)
        with pytest.raises(ValueError, match="no payload"):
            other_node.reload(ref)
    finally:
        same_node.close()
        other_node.close()


# -- hygiene --------------------------------------------------------------------------------------


class Exploit:
    """Unpickling this creates a directory: the proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_crafted_pickles_are_never_unpickled(store, node_id, tmp_path):
    marker = tmp_path / "pickle-ran"
    evil = pickle.dumps(Exploit(marker))
    pickle.loads(pickle.dumps(Exploit(tmp_path / "sanity")))  # the exploit works where pickle is used
    assert (tmp_path / "sanity").exists()
    ref = store.offload(make_tensors(1))
    valid = pack_header({"type": "fetch", "id": 1, "key": ref.key})
    requests = [
        [evil],  # the whole header
        [valid, evil],  # an extra frame after a valid header
        [evil, valid],
        [msgpack.packb(evil)],  # msgpack bin holding a pickle
        [msgpack.packb({"type": "fetch", "id": 1, "key": evil})],
        [msgpack.packb({"type": evil, "id": 1, "key": ref.key})],
        [msgpack.packb({"type": "fetch", "id": 1, "key": ref.key, "extra": evil})],
        [msgpack.packb(msgpack.ExtType(1, evil))],
    ]
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(store.address)
    try:
        for frames in requests:
            socket.send_multipart(frames)
            assert socket.poll(5000), f"no answer to {frames!r:.80}"
            reply = msgpack.unpackb(socket.recv_multipart()[0], raw=False)
            assert reply["type"] == "error", reply
        socket.send(evil * (8192 // len(evil) + 1))  # over the header size cap: the peer is dropped
        assert not socket.poll(300)
    finally:
        socket.close(0)

    # A rogue owner answering with a pickle: the client refuses it.
    rogue = context.socket(zmq.ROUTER)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    client = PayloadClient("elsewhere", timeout_seconds=5)
    rogue_ref = PayloadRef.from_dict({**ref.to_dict(), "address": f"tcp://127.0.0.1:{port}"})
    answer = threading.Thread(target=lambda: rogue.send_multipart([rogue.recv_multipart()[0], evil, evil]))
    answer.start()
    with pytest.raises(ValueError, match="header"):
        client.fetch(rogue_ref)
    answer.join()
    rogue.close(0)
    context.term()

    # A pickle in a shared-memory header, or in a reference: refused, never run.
    with open(os.path.join(SHM_DIR, ref.name), "r+b") as segment:
        original = segment.read(64)
        segment.seek(0)
        segment.write(evil[:64])
    same_node = PayloadClient(node_id)
    with pytest.raises(ValueError, match="does not hold payload"):
        same_node.reload(ref)
    for field in ["node", "key", "address", "location", "name", "entries"]:
        with pytest.raises(ValueError):
            PayloadRef.from_dict({**ref.to_dict(), field: evil})
    assert not marker.exists()

    with open(os.path.join(SHM_DIR, ref.name), "r+b") as segment:
        segment.write(original)
    assert_bit_exact(make_tensors(1), client.fetch(ref))  # the server still serves
    assert_bit_exact(make_tensors(1), same_node.reload(ref))
    client.close()
    same_node.close()


def test_malformed_references_are_refused(store):
    good = store.offload(make_tensors(1)).to_dict()
    entry = good["entries"][0]
    bad = [
        {**good, "name": "../../etc/passwd"},
        {**good, "name": good["name"].replace(good["node"], "other")},
        {**good, "location": "file"},  # a segment name is not a spill file name
        {**good, "key": "0" * 31},
        {**good, "address": "http://x"},
        {**good, "entries": [[entry[0], "object", entry[2], entry[3], entry[4]]]},
        {**good, "entries": [[entry[0], [1], entry[2], entry[3], entry[4]]]},  # unhashable dtype
        {**good, "entries": [[entry[0], entry[1], entry[2], entry[3], entry[4] + 1]]},  # bytes != shape
        {**good, "entries": [[entry[0], entry[1], entry[2], 3, entry[4]]]},  # unaligned
        {**good, "entries": [entry, entry]},
        {**good, "extra": 1},
    ]
    for data in bad:
        with pytest.raises(ValueError):
            PayloadRef.from_dict(data)
    with pytest.raises(ValueError, match="node id"):
        PayloadStore("bad/node")


def test_names_are_unguessable_and_files_private(store, node_id, spill_dir, tmp_path):
    refs = [store.offload(make_tensors(seed)) for seed in range(2)]
    names = [ref.name for ref in refs]
    assert names[0] != names[1] and all(name.startswith(store.prefix) for name in names)
    assert all(len(name) - len(store.prefix) == 32 for name in names)  # 128 random bits each
    assert stat.S_IMODE(spill_dir.stat().st_mode) == 0o700
    for name in shm_entries(node_id):  # segments and the owner file
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o600

    os.chmod(os.path.join(SHM_DIR, names[0]), 0o644)  # someone opened it up: readers refuse it
    client = PayloadClient(node_id)
    with pytest.raises(PermissionError, match="not a private file"):
        client.reload(refs[0])
    client.close()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(PermissionError, match="mode 0o700"):
        PayloadStore(f"{node_id}x", spill_dir=str(shared))


# -- processes that die ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["remote", "same_node"])
def test_a_consumer_killed_mid_transfer_leaves_nothing_behind(node_id, spill_dir, path):
    payload = {"big": torch.empty(48 << 20, dtype=torch.uint8).random_(generator=torch.Generator().manual_seed(0))}
    store = PayloadStore(node_id, budget_bytes=(64 << 20) + 64, spill_dir=str(spill_dir))  # one 64 MiB segment
    ref = store.offload(payload)
    spilled = store.offload(make_tensors(1))
    assert (ref.location, spilled.location) == ("shm", "file")
    consumer_node = "elsewhere" if path == "remote" else node_id
    consumer = subprocess.Popen([sys.executable, str(NODE_SCRIPT), "consume", consumer_node, json.dumps(ref.to_dict())],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert consumer.stdout.readline().strip() == "started"
        time.sleep(0.02 + secrets.randbelow(50) / 1000)
        consumer.send_signal(signal.SIGKILL)
        consumer.wait(timeout=10)
        assert consumer.returncode == -signal.SIGKILL
        assert store.metrics()["payloads/live"] == 2  # nothing freed, nothing lost
        client = PayloadClient("checker", timeout_seconds=10)
        assert_bit_exact(payload, client.reload(ref))  # the store still serves, and frees on consumption
        client.close()
        wait_for(lambda: store.metrics()["payloads/live"] == 1)
    finally:
        consumer.kill()
        consumer.wait()
        store.close()  # the spilled payload was never consumed: the owner's exit removes it
    assert shm_entries(node_id) == [] and list(spill_dir.iterdir()) == []


def test_a_killed_producer_is_cleaned_up_when_the_node_restarts_its_store(node_id, tmp_path):
    spill = tmp_path / "spill"
    victim, survivor = NodeProcess(node_id, spill, 256 * KIB), NodeProcess(node_id, spill, 256 * KIB)
    try:
        lost = [victim.offload(1), victim.offload(2, scale=64)]
        kept = survivor.offload(3)
        partial = spill / f"{victim.prefix}{secrets.token_hex(16)}.safetensors.partial"  # died mid-spill
        partial.write_bytes(b"x")
        partial.chmod(0o600)
        victim.kill()
        leftovers = [n for n in shm_entries(node_id) if n.startswith(victim.prefix)]
        assert sorted(leftovers) == sorted([lost[0].name, victim.prefix + "owner"])
        assert len(list(spill.iterdir())) == 2

        client = PayloadClient("elsewhere", timeout_seconds=1)
        with pytest.raises(TimeoutError, match="did not answer"):
            client.reload(lost[0])

        restarted = PayloadStore(node_id, spill_dir=str(spill))  # start-up removes the dead store's entries
        assert not [n for n in shm_entries(node_id) if n.startswith(victim.prefix)]
        assert list(spill.iterdir()) == []
        assert_bit_exact(make_tensors(3), client.reload(kept))  # a live store of the node is untouched
        client.close()
        restarted.close()
    finally:
        victim.kill()
        survivor.quit()
    assert shm_entries(node_id) == []


# -- resources over time --------------------------------------------------------------------------


def resources(node: str, spill_dir: Path) -> dict[str, int]:
    with open("/proc/self/statm") as f:
        rss_bytes = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"shm_entries": len(shm_entries(node)), "spill_files": len(list(spill_dir.iterdir())),
            "fds": len(os.listdir("/proc/self/fd")), "rss_bytes": rss_bytes}


def test_resources_stay_flat_over_300_offload_reload_cycles(node_id, spill_dir):
    # The budget holds two payloads of the largest class but not every class at once, so segments
    # are evicted and created all along, and the same-node client maps new ones all along.
    store = PayloadStore(node_id, budget_bytes=640 * KIB, spill_dir=str(spill_dir))
    same_node = PayloadClient(node_id, spill_dir=str(spill_dir))
    other_node = PayloadClient("elsewhere")
    payloads = {scale: make_tensors(scale, scale) for scale in (1, 32, 64, 256)}  # 64 KiB .. 1 MiB classes
    samples = []
    try:
        for number in range(300):
            # Frees from other processes travel by socket and may lag on a loaded box; a lagging free
            # would make this cycle spill. Each cycle starts once every earlier free arrived (a lost
            # free fails here), so what the samples see is what stays behind, not what is in flight.
            wait_for(lambda: store.metrics()["payloads/live"] == 0)
            scale = (1, 32, 64)[number % 3]
            near, far = store.offload(payloads[scale]), store.offload(payloads[scale])
            assert_bit_exact(payloads[scale], same_node.reload(near))
            assert_bit_exact(payloads[scale], other_node.reload(far))
            if number % 10 == 0:  # past the budget: through a spill file
                spilled = store.offload(payloads[256])
                assert spilled.location == "file"
                assert_bit_exact(payloads[256], same_node.reload(spilled))
            samples.append(resources(node_id, spill_dir))
        wait_for(lambda: store.metrics()["payloads/live"] == 0)
        assert store.metrics()["payloads/offloaded"] == 2 * 300 + 30
        assert store.metrics()["payloads/segments_evicted"] > 100
        assert list(spill_dir.iterdir()) == []
    finally:
        same_node.close()
        other_node.close()
        store.close()
    assert shm_entries(node_id) == []
    warm, late = samples[50:100], samples[250:]  # after warm-up, and at the end: every cycle phase in each
    assert max(s["fds"] for s in late) <= max(s["fds"] for s in warm)
    # Which pooled segments exist depends on when frees arrive, but never more than the budget holds
    # (plus the owner file); at most one spill file, this cycle's, freed by a message.
    assert max(s["shm_entries"] for s in samples[50:]) <= 1 + 640 * KIB // (64 * KIB + 64)
    assert max(s["spill_files"] for s in samples) <= 1
    rss_growth = statistics.median(s["rss_bytes"] for s in late) - statistics.median(s["rss_bytes"] for s in warm)
    assert rss_growth < 8 << 20, rss_growth
