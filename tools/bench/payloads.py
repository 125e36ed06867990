"""Benchmark payload delivery (DESIGN section 7): reloading multi-MB experience payloads from a
payload store in another process, side by side with the raw copy and transfer of the same bytes.

A child process (this file with --serve) owns a PayloadStore and a raw ZeroMQ ROUTER; it offloads
payloads on request (token-axis fields of --tokens tokens plus a uint8 image filling the payload
to --megabytes MiB). This process reloads them through a PayloadClient: with the owner's node id
(same node: copied out of the mapped segment, then marked consumed in its header) and with another
node id (remote: fetched over loopback TCP, then freed with a message). Each figure's reloads and
its baseline are timed alternately, so load from other processes hits both alike.

One run prints one JSON line per figure, then the command that produced them:
- payloads_same_node_bytes_per_second: warm reloads (each payload dropped before the next, so the
  allocator reuses its pages), against a warm memcpy of the same bytes between two buffers that
  are already mapped (target ratio >= 0.5);
- payloads_same_node_first_touch_bytes_per_second: the first --repeats reloads of the process, all
  held at once, so every destination page is touched for the first time, against a memcpy into
  fresh anonymous pages (reported, no target);
- payloads_remote_bytes_per_second: remote reloads (fetch + free), against one raw ZeroMQ request
  and a reply of the same bytes, sent and received without copies (target ratio >= 0.8);
- payloads_small_round_trip_seconds, once per --small-tokens value: what a training step of short
  experiences costs per experience (the CPU demo's case): --small-count experiences of that many
  tokens turned into light records by offload_record while all stay live, each record sent
  through msgpack as the controller gets it, then reloaded on the same node by another client;
  against msgpack-encoding and decoding the same experiences whole, all held as well (the path
  payloads replaced; target ratio >= 0.5 at 64 tokens). `value` is with the store's inline
  threshold (--inline-bytes): experiences whose payload fits it travel whole in the record, the
  rest through shared memory; `stored_*` is every experience through the store (inline_bytes=0).

    python tools/bench/payloads.py [--megabytes 8] [--tokens 32768] [--repeats 20] [--warmup 3]
                                   [--small-count 512] [--small-tokens 64 [1024 ...]] [--inline-bytes 32768]
                                   [--smoke]
"""

import argparse
import ctypes
import json
import mmap
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import torch
import zmq

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # run from anywhere without installing molt

from molt.trace.experience import Experience  # noqa: E402
from molt.transport.payloads import (  # noqa: E402
                                     PayloadClient, PayloadRef, PayloadStore, experience_tensors, offload_record, reload_record)
from molt.transport.payloads.fields import payload_nbytes  # noqa: E402
from molt.transport.payloads.files import byte_view  # noqa: E402
from molt.transport.payloads.store import INLINE_BYTES  # noqa: E402
from bench_fixtures import parse_with_smoke  # noqa: E402

OWNER_NODE = "bench-owner"
# --smoke (CI): 1 MiB payloads, 3 timed reloads, a step of 16 short experiences.
SMOKE_DEFAULTS = dict(megabytes=1.0, tokens=1024, repeats=3, warmup=1, small_count=16)
MEGABYTE = 1 << 20


def build_payload(megabytes: float, tokens: int) -> dict[str, torch.Tensor]:
    """A multi-turn experience's token-axis tensors plus one image making up the rest of the bytes."""
    generator = torch.Generator().manual_seed(0)
    experience = Experience(
        token_ids=torch.randint(0, 150_000, (tokens,), generator=generator).tolist(),
        action_mask=(torch.rand(tokens, generator=generator) < 0.5).int().tolist(),
        behavior_logprobs=(-torch.rand(tokens, generator=generator)).tolist(),
        policy_versions=[3] * tokens, reward=1.0, score=1.0, group_id=0, rollout_id=0)
    tensors = experience_tensors(experience)
    used = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors.values())
    image_bytes = int(megabytes * MEGABYTE) - used
    if image_bytes < 3:
        raise SystemExit(f"--megabytes {megabytes} is too small for {tokens} tokens; raise it or lower --tokens")
    tensors["image"] = torch.randint(0, 256, (image_bytes // 3, 1, 3), dtype=torch.uint8, generator=generator)
    return tensors


# -- the owner process ------------------------------------------------------------------------


def serve(args) -> None:
    """The owning process: offloads on request ("offload N" on stdin -> N reference lines) and
    answers raw requests with the same number of bytes."""
    payload = build_payload(args.megabytes, args.tokens)
    num_bytes = sum(t.numel() * t.element_size() for t in payload.values())
    store = PayloadStore(OWNER_NODE, budget_bytes=(args.repeats + 4) * 2 * num_bytes)
    raw = zmq.Context().socket(zmq.ROUTER)
    raw_address = f"tcp://127.0.0.1:{raw.bind_to_random_port('tcp://127.0.0.1')}"
    # The payload's own bytes: an untouched bytes(n) would be zero pages, all one page in cache.
    raw_reply = b"".join(byte_view(t).tobytes() for t in payload.values())
    threading.Thread(target=serve_raw, args=(raw, raw_reply), daemon=True).start()
    print(json.dumps({"raw_address": raw_address, "bytes": num_bytes}), flush=True)
    for line in sys.stdin:
        command, count = line.split()
        if command != "offload":
            break
        for _ in range(int(count)):
            print(json.dumps(store.offload(payload).to_dict()), flush=True)
    store.close()


def serve_raw(socket: zmq.Socket, reply: bytes) -> None:
    while True:
        identity, _ = socket.recv_multipart()
        socket.send_multipart([identity, reply], copy=False)


class Owner:
    """This process's handle on the owner child."""

    def __init__(self, args):
        command = [sys.executable, __file__, "--serve", "--megabytes", str(args.megabytes),
                   "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.process.stdout.readline())
        self.raw_address, self.bytes = hello["raw_address"], hello["bytes"]

    def offload(self, count: int) -> list[PayloadRef]:
        self.process.stdin.write(f"offload {count}\n")
        self.process.stdin.flush()
        return [PayloadRef.from_dict(json.loads(self.process.stdout.readline())) for _ in range(count)]

    def close(self) -> None:
        self.process.stdin.write("quit 0\n")
        self.process.stdin.close()
        self.process.wait(timeout=30)


# -- measurements -------------------------------------------------------------------------------


class Baselines:
    """The same bytes moved without Molt: memcpy between mapped buffers, memcpy into fresh pages,
    and one raw ZeroMQ request whose reply carries them."""

    def __init__(self, num_bytes: int, raw_address: str):
        self.num_bytes = num_bytes
        self.source = torch.ones(num_bytes, dtype=torch.uint8)
        self.target = torch.zeros(num_bytes, dtype=torch.uint8)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.connect(raw_address)

    def memcpy_warm(self) -> float:
        start = time.perf_counter()
        ctypes.memmove(self.target.data_ptr(), self.source.data_ptr(), self.num_bytes)
        return time.perf_counter() - start

    def memcpy_fresh_pages(self) -> float:
        pages = mmap.mmap(-1, self.num_bytes)
        view = torch.frombuffer(pages, dtype=torch.uint8)
        start = time.perf_counter()
        ctypes.memmove(view.data_ptr(), self.source.data_ptr(), self.num_bytes)
        seconds = time.perf_counter() - start
        del view
        pages.close()
        return seconds

    def raw_zmq(self) -> float:
        start = time.perf_counter()
        self.socket.send(b"x")
        self.socket.recv(copy=False)
        return time.perf_counter() - start

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def timed_reload(client: PayloadClient, ref: PayloadRef, held: list | None = None) -> float:
    start = time.perf_counter()
    tensors = client.reload(ref)
    seconds = time.perf_counter() - start
    if held is not None:
        held.append(tensors)
    return seconds


def measure(owner: Owner, client: PayloadClient, baseline, repeats: int, warmup: int,
            held: list | None = None) -> tuple[float, float]:
    """Median seconds of reloads of fresh payloads and of the baseline, timed alternately so that
    load from other processes hits both alike."""
    reloads, baselines = [], []
    for ref in owner.offload(warmup + repeats):
        reloads.append(timed_reload(client, ref, held))
        baselines.append(baseline())
    return statistics.median(reloads[warmup:]), statistics.median(baselines[warmup:])


def build_small_experiences(count: int, tokens: int) -> list[Experience]:
    generator = torch.Generator().manual_seed(1)
    return [Experience(
        token_ids=torch.randint(0, 150_000, (tokens,), generator=generator).tolist(),
        action_mask=[0] * (tokens // 2) + [1] * (tokens - tokens // 2),
        behavior_logprobs=(-torch.rand(tokens, generator=generator)).tolist(),
        policy_versions=[-1] * (tokens // 2) + [3] * (tokens - tokens // 2), reward=1.0, score=1.0,
        group_id=index, rollout_id=index) for index in range(count)]


def through_msgpack(experience: Experience) -> Experience:
    return Experience.from_dict(msgpack.unpackb(msgpack.packb(experience.to_dict()), raw=False))


def small_round_trips(experiences: list[Experience], repeats: int, inline_bytes: int) -> dict[str, float]:
    """Median seconds per experience of a step's offloads, records through msgpack and reloads,
    with `inline_bytes` ("value") and with every payload stored ("stored"), and of the msgpack
    baseline, timed in turn; and the bytes of one record with `inline_bytes` as msgpack."""
    store = PayloadStore("bench-small", budget_bytes=1 << 30, inline_bytes=inline_bytes)
    consumer = PayloadClient("bench-small")  # same node, not the owner: marks consumed, as a trainer rank
    timings = {"value": [], "stored": [], "baseline": []}
    try:
        first = offload_record(store, experiences[0])
        record_bytes = len(msgpack.packb(first.to_dict()))
        reload_record(consumer, first)
        for _ in range(repeats):
            for name, threshold in (("value", inline_bytes), ("stored", 0)):
                store.inline_bytes = threshold
                start = time.perf_counter()
                records = [through_msgpack(offload_record(store, experience)) for experience in experiences]
                for record in records:
                    reload_record(consumer, record)
                timings[name].append((time.perf_counter() - start) / len(experiences))
            start = time.perf_counter()
            records = [through_msgpack(experience) for experience in experiences]  # held, as the step's are
            timings["baseline"].append((time.perf_counter() - start) / len(experiences))
            del records
    finally:
        consumer.close()
        store.close()
    return {**{name: statistics.median(values) for name, values in timings.items()}, "record_bytes": record_bytes}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def run(args) -> None:
    owner = Owner(args)
    baselines = Baselines(owner.bytes, owner.raw_address)
    same_node = PayloadClient(OWNER_NODE)
    remote = PayloadClient("bench-consumer")
    try:
        # First: every reloaded payload held, so each lands on pages this process never touched.
        first_touch, memcpy_fresh = measure(owner, same_node, baselines.memcpy_fresh_pages, args.repeats, 0, held=[])
        warm, memcpy_warm = measure(owner, same_node, baselines.memcpy_warm, args.repeats, args.warmup)
        remote_seconds, raw_seconds = measure(owner, remote, baselines.raw_zmq, args.repeats, args.warmup)
    finally:
        same_node.close()
        remote.close()
        baselines.close()
        owner.close()
    num_bytes = owner.bytes
    common = {"payload_bytes": num_bytes, "tokens": args.tokens, "repeats": args.repeats}
    emit({"figure": "payloads_same_node_bytes_per_second", **common, "value": round(num_bytes / warm),
          "baseline_memcpy_warm_bytes_per_second": round(num_bytes / memcpy_warm),
          "ratio": round(memcpy_warm / warm, 3), "target_ratio": 0.5, "seconds_median": round(warm, 6),
          "path": "copy out of the mapped shared-memory segment into a fresh tensor, then mark it consumed"})
    emit({"figure": "payloads_same_node_first_touch_bytes_per_second", **common,
          "value": round(num_bytes / first_touch),
          "baseline_memcpy_fresh_pages_bytes_per_second": round(num_bytes / memcpy_fresh),
          "ratio": round(memcpy_fresh / first_touch, 3), "seconds_median": round(first_touch, 6),
          "path": "as above, every payload held, into never-touched pages; new segments mapped on first use"})
    emit({"figure": "payloads_remote_bytes_per_second", **common, "value": round(num_bytes / remote_seconds),
          "baseline_raw_zmq_bytes_per_second": round(num_bytes / raw_seconds),
          "ratio": round(raw_seconds / remote_seconds, 3), "target_ratio": 0.8,
          "seconds_median": round(remote_seconds, 6),
          "path": "fetch over loopback TCP (header + one raw frame per tensor, zero-copy), then free"})
    for tokens in args.small_tokens:
        experiences = build_small_experiences(args.small_count, tokens)
        small = small_round_trips(experiences, args.repeats, args.inline_bytes)
        nbytes = payload_nbytes(experiences[0])
        emit({"figure": "payloads_small_round_trip_seconds", "experiences": args.small_count, "tokens": tokens,
              "repeats": args.repeats, "payload_bytes": nbytes, "inline_bytes": args.inline_bytes,
              "inline": nbytes <= args.inline_bytes, "record_bytes": small["record_bytes"],
              "value": round(small["value"], 7), "baseline_msgpack_seconds": round(small["baseline"], 7),
              "ratio": round(small["baseline"] / small["value"], 3), "target_ratio": 0.5 if tokens == 64 else None,
              "stored_seconds": round(small["stored"], 7),
              "stored_ratio": round(small["baseline"] / small["stored"], 3),
              "path": "offload_record of a step's experiences, all live, each record through msgpack, then "
                      "reload_record by a same-node client"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=8.0, help="payload size in MiB")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens of the experience in each payload")
    parser.add_argument("--repeats", type=int, default=20, help="timed transfers per figure")
    parser.add_argument("--warmup", type=int, default=3, help="untimed transfers before the warm figures")
    parser.add_argument("--small-count", type=int, default=512, help="experiences in the small-payload figure")
    parser.add_argument("--small-tokens", type=int, nargs="+", default=[64],
                        help="tokens of each small experience (one figure per value)")
    parser.add_argument("--inline-bytes", type=int, default=INLINE_BYTES,
                        help="the store's inline threshold for the small figures (payloads.inline_bytes)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the owner child
    args = parse_with_smoke(parser, SMOKE_DEFAULTS)
    if args.serve:
        serve(args)
        return
    run(args)
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
