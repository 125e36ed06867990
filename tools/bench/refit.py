"""Benchmark the refit: broadcast a >= 100 MB model from a trainer-side RefitSender into a real
vLLM CPU engine through Molt, side by side with raw loopback TCP of the same bytes (PERF.md).

One run prints one JSON line per figure, then the command that produced them:
- refit_broadcast_bytes_per_second: bytes / time of `RefitSender.broadcast` in the sender thread
  (gather + flatten + gloo broadcast), against raw TCP (target ratio >= 0.5);
- refit_end_to_end_bytes_per_second: bytes / time until `receive_weights` returns (adds the RPC
  into the engine and vLLM's reload_weights);
- refit_control_messages: collectives and engine RPCs counted during a refit, against the
  number of buckets and of parameters (target: O(buckets)).

The trainer side is the plain Hugging Face model (no FSDP2: one trainer rank, so the gathers are
no-ops and the figures isolate the transfer). The engine is idle, so no generation pause is needed.

    python tools/bench/refit.py [--bucket-megabytes 16,64,256] [--refits 5] [--tcp-repeats 5]
"""

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path

# torch, transformers, vLLM and molt are imported inside functions: the TCP baseline's child
# process re-imports this module (spawn) and should start without them.

TOOLS_DIR = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MEGABYTE = 1 << 20


def build_bench_model(preset: str, seed: int) -> Path:
    """The bench model, generated once into $MOLT_CACHE_DIR by the same cache the tests use."""
    spec = importlib.util.spec_from_file_location("molt_tests_fixtures_models",
                                                  TOOLS_DIR.parent / "tests" / "fixtures_models.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    return fixtures.build_cached_tiny_model(preset=preset, seed=seed)


# -- raw TCP baseline --------------------------------------------------------------------------

def receive_rounds(port: int, num_bytes: int, num_rounds: int) -> None:
    """Child process: receive `num_rounds` x `num_bytes` into one preallocated buffer, acking each."""
    buffer = memoryview(bytearray(num_bytes))
    with socket.create_connection((HOST, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(num_rounds):
            received = 0
            while received < num_bytes:
                count = sock.recv_into(buffer[received:], num_bytes - received)
                if count == 0:
                    raise ConnectionError(f"sender closed after {received} of {num_bytes} bytes")
                received += count
            sock.sendall(b"k")


def measure_tcp_bytes_per_second(num_bytes: int, repeats: int) -> list[float]:
    """Bytes/s of `sendall` from a preallocated buffer to a receiving child, until its ack; one
    untimed warm-up round first (page faults on both buffers)."""
    payload = memoryview(bytearray(num_bytes))
    with socket.socket() as server:
        server.bind((HOST, 0))
        server.listen(1)
        child = multiprocessing.get_context("spawn").Process(
            target=receive_rounds, args=(server.getsockname()[1], num_bytes, repeats + 1))
        child.start()
        conn, _ = server.accept()
    rates = []
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for round_index in range(repeats + 1):
            started = time.perf_counter()
            conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise ConnectionError("receiver closed before acknowledging a round")
            if round_index > 0:
                rates.append(num_bytes / (time.perf_counter() - started))
    child.join(timeout=30)
    return rates


# -- refit through Molt ------------------------------------------------------------------------

class CountingGroup:
    """Stands in for the sender's gloo group: counts and times each broadcast (waited here)."""

    def __init__(self, group):
        self.group = group
        self.num_broadcasts = 0
        self.seconds = 0.0

    def broadcast(self, tensors, options):
        started = time.perf_counter()
        work = self.group.broadcast(tensors, options)
        work.wait()
        self.seconds += time.perf_counter() - started
        self.num_broadcasts += 1
        return work


def count_engine_rpcs(engine) -> dict[str, int]:
    """Wrap the engine's collective_rpc so the benchmark sees every RPC a refit makes."""
    counts: dict[str, int] = {}
    original = engine.llm.collective_rpc

    async def counted(method, *args, **kwargs):
        counts[method] = counts.get(method, 0) + 1
        return await original(method, *args, **kwargs)

    engine.llm.collective_rpc = counted
    return counts


async def join_group(engine, sender, timeout_seconds: float) -> None:
    from molt.refit import find_free_port

    port = find_free_port(HOST)
    join = asyncio.create_task(engine.join_refit_group(
        host=HOST, port=port, rank=1, world_size=2, timeout_seconds=timeout_seconds, plan=sender.wire_plan))
    await asyncio.to_thread(sender.open_group, HOST, port, 2)
    await join
    sender.group = CountingGroup(sender.group)


async def run_refit(engine, sender, version: int) -> dict[str, float]:
    """One refit: the engine receives and reloads while the sender broadcasts in a thread."""

    def timed_broadcast() -> tuple[int, float]:
        started = time.perf_counter()
        num_bytes = sender.broadcast()
        return num_bytes, time.perf_counter() - started

    collective_before = sender.group.seconds
    started = time.perf_counter()
    receive = asyncio.create_task(engine.receive_weights(version))
    num_bytes, broadcast_seconds = await asyncio.to_thread(timed_broadcast)
    await receive
    return {"bytes": num_bytes, "end_to_end_seconds": time.perf_counter() - started,
            "broadcast_seconds": broadcast_seconds,
            "collective_seconds": sender.group.seconds - collective_before}


async def bench_bucket_size(engine, model, bucket_megabytes: float, args, rpc_counts: dict[str, int],
                            first_version: int) -> tuple[list[dict], dict]:
    from molt.refit import RefitSender

    sender = RefitSender(model, is_sender=True, bucket_bytes=int(bucket_megabytes * MEGABYTE),
                         timeout_seconds=args.timeout_seconds)
    await join_group(engine, sender, args.timeout_seconds)
    await run_refit(engine, sender, first_version)  # warm-up: first-touch receive buffers
    broadcasts_before, rpcs_before = sender.group.num_broadcasts, dict(rpc_counts)
    runs = [await run_refit(engine, sender, first_version + 1 + i) for i in range(args.refits)]
    control = {
        "buckets": len(sender.buckets),
        "broadcasts_per_refit": (sender.group.num_broadcasts - broadcasts_before) / args.refits,
        "engine_rpcs_per_refit": (sum(rpc_counts.values()) - sum(rpcs_before.values())) / args.refits,
        "params": sum(len(bucket) for bucket in sender.buckets),
    }
    await engine.leave_refit_group()
    sender.close_group()
    return runs, control


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def report(bucket_megabytes: float, runs: list[dict], control: dict, tcp_rate: float) -> None:
    num_bytes = runs[0]["bytes"]
    end_to_end = statistics.median(r["end_to_end_seconds"] for r in runs)
    broadcast = statistics.median(r["broadcast_seconds"] for r in runs)
    collective = statistics.median(r["collective_seconds"] for r in runs)
    common = {"bucket_megabytes": bucket_megabytes, "bytes": num_bytes, "refits": len(runs),
              "baseline_tcp_bytes_per_second": round(tcp_rate)}
    emit({"figure": "refit_broadcast_bytes_per_second", **common, "value": round(num_bytes / broadcast),
          "ratio": round(num_bytes / broadcast / tcp_rate, 3), "target_ratio": 0.5,
          "seconds_median": round(broadcast, 4), "gloo_broadcast_seconds_median": round(collective, 4),
          "flatten_copy_seconds_median": round(broadcast - collective, 4),
          "gloo_only_bytes_per_second": round(num_bytes / collective),
          "sender": "plain Hugging Face model, no FSDP2 (single trainer rank)"})
    emit({"figure": "refit_end_to_end_bytes_per_second", **common, "value": round(num_bytes / end_to_end),
          "ratio": round(num_bytes / end_to_end / tcp_rate, 3), "seconds_median": round(end_to_end, 4),
          "seconds_all": [round(r["end_to_end_seconds"], 4) for r in runs],
          "engine_reload_seconds_estimate": round(end_to_end - broadcast, 4)})
    emit({"figure": "refit_control_messages", "bucket_megabytes": bucket_megabytes, **control,
          # By design (molt/trainer.py push_weights): one 'refit' message to each rollout rank per
          # refit and one 'refit_done' back; the bucket plan travels once, at join.
          "control_messages_per_engine": 1, "plan_messages_per_engine_per_join": 1})


async def run_benchmark(args, model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from molt.config import MoltConfig
    from molt.engine import RolloutEngine

    cfg = MoltConfig()
    cfg.model.path = str(model_dir)
    cfg.rollout.max_length = 256
    cfg.rollout.engine_memory_fraction = 0.1
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = RolloutEngine.start(cfg, seed=0)
    try:
        rpc_counts = count_engine_rpcs(engine)
        tcp_rates = await asyncio.to_thread(measure_tcp_bytes_per_second, num_bytes, args.tcp_repeats)
        tcp_rate = statistics.median(tcp_rates)
        emit({"figure": "baseline_tcp_bytes_per_second", "bytes": num_bytes, "value": round(tcp_rate),
              "all": [round(r) for r in tcp_rates]})
        version = 1
        for bucket_megabytes in args.bucket_megabytes:
            runs, control = await bench_bucket_size(engine, model, bucket_megabytes, args, rpc_counts, version)
            version += args.refits + 1
            report(bucket_megabytes, runs, control, tcp_rate)
    finally:
        engine.shutdown()


def parse_bucket_sizes(values: list[str] | None) -> list[float]:
    sizes = [float(item) for value in values or ["16,64,256"] for item in value.split(",") if item]
    if not sizes or min(sizes) <= 0:
        raise SystemExit(f"--bucket-megabytes {values!r}: give positive sizes, e.g. 16,64,256")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-megabytes", action="append",
                        help="refit bucket size(s) in MiB; repeatable or a comma list (default 16,64,256)")
    parser.add_argument("--refits", type=int, default=5, help="timed refits per bucket size (after one warm-up)")
    parser.add_argument("--tcp-repeats", type=int, default=5, help="timed raw TCP rounds (after one warm-up)")
    parser.add_argument("--timeout-seconds", type=float, default=120.0, help="refit group timeout")
    parser.add_argument("--preset", default="bench", help="tools/make_tiny_model.py preset (>= 100 MB)")
    args = parser.parse_args()
    args.bucket_megabytes = parse_bucket_sizes(args.bucket_megabytes)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the JSON lines readable
    model_dir = build_bench_model(args.preset, seed=0)
    asyncio.run(run_benchmark(args, model_dir))
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
