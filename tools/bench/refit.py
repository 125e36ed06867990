"""Benchmark the refit as the trainer runs it, FSDP2 or TP=2 trainer ranks into a TP=2 vLLM CPU engine.

Two gloo trainer ranks laid out as FSDP2 (dp_shard=2) or tensor parallel 2 send the bench model into
a vLLM CPU engine with two tensor-parallel workers, side by side with raw loopback TCP of the same
bytes (PERF.md).

Processes. This one hosts the engine (`RolloutEngine.start` with engine_tensor_parallel_size=2: an
engine core and two worker processes, one core each) and plays its rollout rank (rank 2). Two
spawned processes form a gloo world of 2 trainer ranks; for each layout they build the model with
`build_trainer_mesh` + `build_actor_model`, as `Trainer.__init__` does. The refit group is the real
one: the sender (refit rank 0) on trainer rank 0, the engine's workers refit ranks 1 and 2.

What runs unchanged: the trainer ranks' refit roles, `RefitCoordinator` on rank 0 (timed by
`TimedCoordinator`) and `RefitFollower` on rank 1 (molt.refit.coordinator), as `Trainer` builds them, with
the coordinator's waits (`await_paused`, `finish_refit`) over rank 0's `Mailbox` and its ZeroMQ `Router`;
and on the engine side the rollout rank's message handlers `RolloutService.join_refit`, `refit`,
`decide_refit` and `leave_refit`, so one refit is: 'refit' -> pause, prepare -> 'refit_paused'
-> 'refit_go' once every engine paused -> the trainer ranks gather and the sender broadcasts -> the workers receive and load -> resume ->
'refit_done'. What differs from a job: no prompt loader, optimizer, payloads or metrics; the rollout
rank has no agent workers or endpoint and its engine is idle (the pause waits for nothing); the
workers run `TimedRefitReceiver`, Molt's receiver with a stopwatch around each bucket's broadcast;
and between the warm-up and the timed refits, and after them, the controller asks for the engine's
counts and timings with a bench-only 'bench_stats' message (left out of the counts).

Layouts (--layouts): `fsdp2` (FSDP2 over 2 shards: each bucket's parameters are all-gathered from
both ranks), `tp2` (trainer tensor parallel 2, FSDP2 over 1 shard: gathered across the tp ranks),
and `plain` (reference: the plain Hugging Face model on trainer rank 0 alone, no gathers).

Per layout and bucket size, after one warm-up refit, --refits timed ones; one JSON line per figure:
- refit_broadcast_bytes_per_second: bytes / seconds of `WeightSender.broadcast` on the sending rank
  (gathers, copy and cast into the bucket buffer, gloo broadcast to both workers; each broadcast
  also waits while the workers load the previous bucket), against raw TCP (target ratio >= 0.5);
  split into the sender's time inside the refit group's broadcasts and the rest (gathers + copy).
- refit_end_to_end_bytes_per_second: bytes / seconds of `RefitCoordinator.attempt` on the controller,
  'refit' sent until every 'refit_done' is in (the engine's load returned and it resumed), against
  raw TCP (target ratio >= 0.3); with the wait for 'refit_paused' and the time after the broadcast.
- refit_engine_reload_seconds: per worker, `molt_receive_weights` minus the time it spent inside
  the refit group's broadcasts (bytes arriving, or the sender still gathering): vLLM's
  reload_weights (loading and processing the layers) plus Molt's clones; the slower worker's,
  and its share of the end to end.
- refit_control_messages: per refit and engine, the messages the rollout rank received and sent by
  type, the control bytes through the controller's router, the refit-group collectives (sender
  broadcasts, and each worker's receives) against the buckets, the engine's worker RPCs
  (`collective_rpc`, each reaching both workers) and engine-core calls, and the receive memory
  (`molt_receive_stats`).
- baseline_tcp_bytes_per_second: `sendall` of the model's bytes to a child process, measured first,
  before anything else starts.

    python tools/bench/refit.py [--layouts fsdp2,tp2,plain] [--bucket-megabytes 16,64] [--refits 3]
                                [--tcp-repeats 5] [--timeout-seconds 120] [--preset bench]
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import shlex
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from bench_fixtures import load_test_fixtures

from molt.config import MoltConfig
from molt.refit.backends import build_sender
from molt.refit.coordinator import RefitCoordinator, RefitFollower
from molt.rollout.worker_extension import WorkerExtension
from molt.transport.mailbox import Mailbox
from molt.transport.wire import Router, unpack

# The engine's workers import this file as module `refit` (TimedRefitReceiver is refit.receiver_cls;
# spawned processes get this script's folder on sys.path), so they import what it imports here too:
# the engine and the rollout rank's modules are imported inside functions.

TOOLS_DIR = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
NUM_TRAINER_RANKS = 2
ENGINE_TENSOR_PARALLEL = 2
ROLLOUT_RANK = NUM_TRAINER_RANKS  # world rank of the rollout rank in a job of this layout
LAYOUTS = {  # name -> (trainer tensor-parallel size, what the sender gathers from)
    "fsdp2": (1, "FSDP2 over 2 trainer ranks (dp_shard=2)"),
    "tp2": (2, "trainer tensor parallel 2 (2 ranks, FSDP2 over 1 shard)"),
    "plain": (1, "plain Hugging Face model on trainer rank 0 alone, no gathers (reference)"),
}


def build_bench_model(preset: str, seed: int) -> Path:
    """The bench model, generated once into $MOLT_CACHE_DIR by the same cache the tests use."""
    return load_test_fixtures().build_cached_tiny_model(preset=preset, seed=seed)


def count_model_bytes(model_dir: Path) -> int:
    from safetensors.torch import load_file

    return sum(tensor.nbytes for path in model_dir.glob("*.safetensors") for tensor in load_file(path).values())


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


# -- instruments -------------------------------------------------------------------------------

class TimedGroup:
    """Stands in for a refit gloo group: counts its broadcasts and the seconds the caller spends
    blocked in them (starting one, and waiting for it). The sender starts a bucket's broadcast and
    gathers the next bucket before waiting (WeightSender._broadcast_buckets), so on the sender this
    is the wire time the gathers did not hide; a worker waits at once, so there it is all of it."""

    def __init__(self, group):
        self.group = group
        self.num_broadcasts = 0
        self.seconds = 0.0

    def broadcast(self, tensors, options):
        started = time.perf_counter()
        work = self.group.broadcast(tensors, options)
        self.seconds += time.perf_counter() - started
        self.num_broadcasts += 1
        return TimedWork(work, self)


class TimedWork:
    def __init__(self, work, group: TimedGroup):
        self.work, self.group = work, group

    def wait(self):
        started = time.perf_counter()
        try:
            return self.work.wait()
        finally:
            self.group.seconds += time.perf_counter() - started


class TimedRefitReceiver(WorkerExtension):
    """Molt's receiver with a stopwatch, in each engine worker: per refit, the seconds of
    `molt_receive_weights` and the part of them spent inside the refit group's broadcasts."""

    def molt_join_refit_group(self, **group) -> None:
        super().molt_join_refit_group(**group)
        self._molt_group = TimedGroup(self._molt_group)

    def molt_receive_weights(self, version: int) -> None:
        group = self._molt_group
        wire_before, broadcasts_before = group.seconds, group.num_broadcasts
        started = time.perf_counter()
        super().molt_receive_weights(version)
        timing = {"version": version, "seconds": time.perf_counter() - started,
                  "wire_seconds": group.seconds - wire_before, "broadcasts": group.num_broadcasts - broadcasts_before}
        self._bench_timings = [*getattr(self, "_bench_timings", []), timing]

    def molt_bench_take_timings(self) -> list[dict]:
        """The timings of the refits since the last call."""
        timings, self._bench_timings = getattr(self, "_bench_timings", []), []
        return timings


# -- trainer ranks -----------------------------------------------------------------------------

def trainer_config(model_dir: str, layout: str, bucket_megabytes: float, timeout_seconds: float) -> MoltConfig:
    cfg = MoltConfig()
    cfg.model.path = model_dir
    cfg.layout.num_trainer_ranks = 1 if layout == "plain" else NUM_TRAINER_RANKS
    cfg.layout.trainer_tensor_parallel_size = LAYOUTS[layout][0]
    cfg.layout.engine_tensor_parallel_size = ENGINE_TENSOR_PARALLEL
    cfg.refit.backend = "gloo"
    cfg.refit.bucket_megabytes = bucket_megabytes
    cfg.refit.timeout_seconds = timeout_seconds
    cfg.refit.max_attempts = 1  # a failed refit stops the benchmark
    return cfg


class TimedCoordinator(RefitCoordinator):
    """Rank 0's RefitCoordinator, run unchanged and timed: each attempt's stages, with the sender's group
    wrapped in a TimedGroup."""

    def __init__(self, cfg: MoltConfig, model: torch.nn.Module, mailbox: Mailbox):
        sender = build_sender(cfg, model, is_sender=True, device=torch.device("cpu"))
        super().__init__(cfg, sender, mailbox, host=HOST, group=dist.group.WORLD, device=torch.device("cpu"))
        self.refits: list[dict] = []  # the timings of each attempt
        self.last_broadcast = (0.0, 0.0, 0)  # started, ended, bytes of the latest WeightSender.broadcast
        send = sender.broadcast

        def timed_broadcast(**kwargs) -> int:
            started = time.perf_counter()
            num_bytes = send(**kwargs)
            self.last_broadcast = (started, time.perf_counter(), num_bytes)
            return num_bytes

        sender.broadcast = timed_broadcast

    def open_group(self) -> None:
        super().open_group()
        self.sender.group = TimedGroup(self.sender.group)

    def attempt(self, version: int, attempt: int) -> str | None:
        group, router = self.sender.group, self.mailbox.router
        before = (group.seconds, group.num_broadcasts, router.bytes_sent + router.bytes_received)
        started = time.perf_counter()
        failure = super().attempt(version, attempt)
        ended = time.perf_counter()
        broadcast_started, broadcast_ended, num_bytes = self.last_broadcast
        self.refits.append({
            "bytes": num_bytes, "end_to_end_seconds": ended - started,
            "pause_ack_seconds": broadcast_started - started, "broadcast_seconds": broadcast_ended - broadcast_started,
            "after_broadcast_seconds": ended - broadcast_ended,
            "gloo_seconds": group.seconds - before[0], "collectives": group.num_broadcasts - before[1],
            "control_bytes": router.bytes_sent + router.bytes_received - before[2]})
        return failure


def build_trainer_model(layout: str, cfg: MoltConfig, rank: int) -> torch.nn.Module | None:
    """The model as this trainer rank holds it in `layout` (None: this rank sits the layout out)."""
    if layout == "plain":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32) if rank == 0 else None
    from molt.trainer.sharded_model import build_actor_model
    from molt.distributed.parallelize import ShardingPlan, build_trainer_mesh

    mesh = build_trainer_mesh(num_trainer_ranks=NUM_TRAINER_RANKS, device_type="cpu",
                              tensor_parallel_size=cfg.layout.trainer_tensor_parallel_size)
    return build_actor_model(cfg.model.path, mesh=mesh, device=torch.device("cpu"), plan=ShardingPlan.from_config(cfg),
                             logprob_chunk_tokens=cfg.train.logprob_chunk_tokens)


def take_engine_stats(mailbox: Mailbox, timeout_seconds: float) -> dict:
    """What the rollout rank counted since the last call (see `EngineRecorder`)."""
    mailbox.send_to_rollout_ranks({"type": "bench_stats"})
    return mailbox.expect("bench_stats", 1, timeout_seconds, "engine statistics")[0]


def bench_bucket_size(refit: RefitFollower, args, first_version: int) -> dict | None:
    """One refit group: join, a warm-up refit (first-touch buffers on every side), then the timed
    refits; the coordinator returns its timings and the engine's."""
    refit.connect()
    refit.push(first_version)
    if not isinstance(refit, TimedCoordinator):
        for index in range(args.refits):
            refit.push(first_version + 1 + index)
        return None
    take_engine_stats(refit.mailbox, args.timeout_seconds)  # drops the join and the warm-up
    refit.refits.clear()
    for index in range(args.refits):
        refit.push(first_version + 1 + index)
    engine = take_engine_stats(refit.mailbox, args.timeout_seconds)
    refit.mailbox.send_to_rollout_ranks({"type": "leave_refit"})
    refit.mailbox.expect("refit_left", 1, args.timeout_seconds, "refit group leave")
    refit.sender.close_group()
    return {"refits": refit.refits, "engine": engine, "buckets": len(refit.sender.buckets),
            "params": sum(len(bucket) for bucket in refit.sender.buckets)}


def run_trainer_rank(rank: int, port: int, model_dir: str, args, results) -> None:
    """One of the 2 trainer processes; rank 0 puts its router's address, then a record per layout and
    bucket size, then None on `results`."""
    torch.set_num_threads(1)  # two trainer ranks and two engine workers share the machine's cores
    store = dist.TCPStore(HOST, port, is_master=False)  # the rendezvous the benchmark's process serves
    dist.init_process_group("gloo", store=store, rank=rank, world_size=NUM_TRAINER_RANKS)
    mailbox = None
    if rank == 0:
        mailbox = Mailbox(Router(HOST), [ROLLOUT_RANK])
        results.put(mailbox.router.address)
        mailbox.expect("ready", 1, 600, "engine start")
    version = 1
    for layout in args.layouts:
        model = build_trainer_model(layout, trainer_config(model_dir, layout, 1, args.timeout_seconds), rank)
        for bucket_megabytes in args.bucket_megabytes:
            if model is not None:
                cfg = trainer_config(model_dir, layout, bucket_megabytes, args.timeout_seconds)
                refit = (TimedCoordinator(cfg, model, mailbox) if rank == 0 else  # this rank's role, as Trainer's
                         RefitFollower(cfg, build_sender(cfg, model, is_sender=False, device=torch.device("cpu")),
                                       group=dist.group.WORLD, device=torch.device("cpu")))
                record = bench_bucket_size(refit, args, version)
                if record is not None:
                    results.put({"layout": layout, "bucket_megabytes": bucket_megabytes, **record})
            version += args.refits + 1
            dist.barrier()
        del model
    if rank == 0:
        results.put(None)
        mailbox.router.close()
    dist.destroy_process_group()


# -- the rollout rank --------------------------------------------------------------------------

def engine_config(model_dir: Path, timeout_seconds: float) -> MoltConfig:
    cfg = MoltConfig()
    cfg.model.path = str(model_dir)
    cfg.rollout.max_length = 256
    cfg.rollout.kv_cache_gigabytes = 0.25  # per worker: bytes, so it fits any machine with 1 GiB free
    cfg.layout.engine_tensor_parallel_size = ENGINE_TENSOR_PARALLEL
    cfg.refit.backend = "gloo"
    cfg.refit.timeout_seconds = timeout_seconds
    cfg.refit.receiver_cls = f"{Path(__file__).stem}.{TimedRefitReceiver.__name__}"
    return cfg


class EngineRecorder:
    """Counts, by name, what the rollout rank does: messages received and sent (the bench's own
    'bench_*' left out), the engine's worker RPCs (collective_rpc) and its engine-core calls."""

    ENGINE_CORE_CALLS = ("pause_generation", "resume_generation", "update_weight_version")

    def __init__(self, service):
        self.counts = {"received": Counter(), "sent": Counter(), "worker_rpcs": Counter(), "engine_core_calls": Counter()}
        llm = service.engine.llm
        self.collective_rpc = llm.collective_rpc  # uncounted, for the bench's own queries
        llm.collective_rpc = self._counted(llm.collective_rpc, "worker_rpcs")
        for name in self.ENGINE_CORE_CALLS:
            setattr(llm, name, self._counted(getattr(llm, name), "engine_core_calls", name))
        send = service.send

        async def counted_send(message: dict) -> None:
            self.count("sent", message["type"])
            await send(message)

        service.send = counted_send

    def _counted(self, call, kind: str, name: str | None = None):
        async def counted(*args, **kwargs):
            self.count(kind, name or args[0])
            return await call(*args, **kwargs)
        return counted

    def count(self, kind: str, name: str) -> None:
        if not name.startswith("bench_"):
            self.counts[kind][name] += 1

    def take(self) -> dict[str, dict[str, int]]:
        counts = {kind: dict(counter) for kind, counter in self.counts.items()}
        for counter in self.counts.values():
            counter.clear()
        return counts


async def send_engine_stats(service, recorder: EngineRecorder, message: dict) -> None:
    counts = recorder.take()
    timings = await recorder.collective_rpc("molt_bench_take_timings")
    memory = await recorder.collective_rpc("molt_receive_stats")
    await service.send({"type": "bench_stats", "rank": service.rank, **counts, "worker_timings": timings,
                        "worker_receive_memory": memory})


async def serve_rollout_rank(service, recorder: EngineRecorder, trainers: list, results, tcp_rate: float) -> None:
    """The rollout rank's message loop (RolloutService.serve's dispatch, refit messages only), until
    trainer rank 0 has put its last record; reports each record as it comes."""
    handlers = {**service.handlers(), "bench_stats": lambda message: send_engine_stats(service, recorder, message)}
    await service.send({"type": "ready", "rank": service.rank})
    while True:
        if await service.socket.poll(200):
            message = unpack(await service.socket.recv())
            recorder.count("received", message["type"])
            service.spawn_task(service.guarded(handlers[message["type"]], message))
        while not results.empty():
            record = results.get()
            if record is None:
                return
            report(record, tcp_rate)
        for rank, process in enumerate(trainers):
            # Rank 0 puts its last record before it exits, so its exit with nothing queued is a failure too.
            if process.exitcode not in (None, 0) or (rank == 0 and process.exitcode == 0 and results.empty()):
                raise RuntimeError(f"trainer rank {rank} exited (code {process.exitcode}) before the benchmark "
                                   f"ended; its traceback is on stderr")


async def run_benchmark(args, model_dir: Path) -> None:
    from molt.rollout.engine import RolloutEngine
    from molt.rollout.rank import RolloutService

    num_bytes = count_model_bytes(model_dir)
    tcp_rates = measure_tcp_bytes_per_second(num_bytes, args.tcp_repeats)  # first, on a quiet machine
    tcp_rate = statistics.median(tcp_rates)
    emit({"figure": "baseline_tcp_bytes_per_second", "bytes": num_bytes, "value": round(tcp_rate),
          "all": [round(r) for r in tcp_rates]})
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    # The trainer ranks' rendezvous, served here on a port the OS picked (no window for another
    # process to take it between choosing and binding).
    rendezvous = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    trainers = [context.Process(target=run_trainer_rank, args=(rank, rendezvous.port, str(model_dir), args, results),
                                daemon=True)
                for rank in range(NUM_TRAINER_RANKS)]
    for process in trainers:
        process.start()
    engine = service = None
    try:
        cfg = engine_config(model_dir, args.timeout_seconds)
        engine = RolloutEngine.start(cfg, seed=0)  # ~30 s; the trainer ranks build their first model meanwhile
        address = await asyncio.to_thread(results.get, timeout=300)
        service = RolloutService(cfg, ROLLOUT_RANK, address, HOST)
        service.engine = engine
        await serve_rollout_rank(service, EngineRecorder(service), trainers, results, tcp_rate)
        for process in trainers:
            process.join(timeout=60)
    finally:
        for process in trainers:
            if process.is_alive():
                process.kill()
        if service is not None:
            service.socket.close(0)
        if engine is not None:
            engine.shutdown()


# -- report ------------------------------------------------------------------------------------

def rounded_median(values) -> float:
    return round(statistics.median(values), 4)


def per_refit(counts: dict[str, int], num_refits: int) -> dict[str, float]:
    return {name: count / num_refits for name, count in sorted(counts.items())}


def report(record: dict, tcp_rate: float) -> None:
    runs, engine = record["refits"], record["engine"]
    num_refits, num_bytes = len(runs), runs[0]["bytes"]
    broadcast = statistics.median(r["broadcast_seconds"] for r in runs)
    end_to_end = statistics.median(r["end_to_end_seconds"] for r in runs)
    common = {"layout": record["layout"], "trainer": LAYOUTS[record["layout"]][1],
              "bucket_megabytes": record["bucket_megabytes"], "bytes": num_bytes, "refits": num_refits,
              "baseline_tcp_bytes_per_second": round(tcp_rate)}
    emit({"figure": "refit_broadcast_bytes_per_second", **common, "value": round(num_bytes / broadcast),
          "ratio": round(num_bytes / broadcast / tcp_rate, 3), "target_ratio": 0.5,
          "seconds_median": round(broadcast, 4), "seconds_all": [round(r["broadcast_seconds"], 4) for r in runs],
          "sender_gloo_seconds_median": rounded_median(r["gloo_seconds"] for r in runs),
          "gathers_and_copy_seconds_median": rounded_median(r["broadcast_seconds"] - r["gloo_seconds"] for r in runs)})
    emit({"figure": "refit_end_to_end_bytes_per_second", **common, "value": round(num_bytes / end_to_end),
          "ratio": round(num_bytes / end_to_end / tcp_rate, 3), "target_ratio": 0.3,
          "seconds_median": round(end_to_end, 4), "seconds_all": [round(r["end_to_end_seconds"], 4) for r in runs],
          "pause_ack_seconds_median": rounded_median(r["pause_ack_seconds"] for r in runs),
          "after_broadcast_seconds_median": rounded_median(r["after_broadcast_seconds"] for r in runs)})
    workers = engine["worker_timings"]  # [worker][refit]
    if any(len(timings) != num_refits for timings in workers):
        raise RuntimeError(f"expected {num_refits} receive timings per worker, got {[len(t) for t in workers]}")
    reloads = [max(w[i]["seconds"] - w[i]["wire_seconds"] for w in workers) for i in range(num_refits)]
    emit({"figure": "refit_engine_reload_seconds", **common, "value": rounded_median(reloads),
          "share_of_end_to_end": round(statistics.median(reloads) / end_to_end, 3),
          "per_worker": [{"receive_seconds_median": rounded_median(t["seconds"] for t in timings),
                          "in_broadcasts_seconds_median": rounded_median(t["wire_seconds"] for t in timings),
                          "reload_seconds_median": rounded_median(t["seconds"] - t["wire_seconds"] for t in timings)}
                         for timings in workers]})
    emit({"figure": "refit_control_messages", "layout": record["layout"],
          "bucket_megabytes": record["bucket_megabytes"], "refits": num_refits, "buckets": record["buckets"],
          "params": record["params"],
          "collectives_per_refit": statistics.fmean(r["collectives"] for r in runs),
          "worker_receives_per_refit": [statistics.fmean(t["broadcasts"] for t in timings) for timings in workers],
          "messages_received_per_refit_per_engine": per_refit(engine["received"], num_refits),
          "messages_sent_per_refit_per_engine": per_refit(engine["sent"], num_refits),
          "control_bytes_per_refit": statistics.fmean(r["control_bytes"] for r in runs),
          "engine_worker_rpcs_per_refit": per_refit(engine["worker_rpcs"], num_refits),
          "engine_core_calls_per_refit": per_refit(engine["engine_core_calls"], num_refits),
          # The bucket plan travels once per engine, in its join message.
          "plan_messages_per_engine_per_join": 1,
          "worker_receive_memory": engine["worker_receive_memory"]})


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def keep_stdout_for_json() -> None:
    """The JSON lines alone on stdout: this process prints them to a copy of stdout, and file
    descriptor 1 (what the engine's and trainer ranks' processes, and native code, write to)
    becomes stderr."""
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)


def parse_list(values: list[str] | None, default: str) -> list[str]:
    return [item for value in values or [default] for item in value.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", action="append",
                        help=f"trainer layouts, repeatable or a comma list, of {', '.join(LAYOUTS)} (default all)")
    parser.add_argument("--bucket-megabytes", action="append",
                        help="refit bucket size(s) in MiB; repeatable or a comma list (default 16,64)")
    parser.add_argument("--refits", type=int, default=3, help="timed refits per layout and bucket size (after one warm-up)")
    parser.add_argument("--tcp-repeats", type=int, default=5, help="timed raw TCP rounds (after one warm-up)")
    parser.add_argument("--timeout-seconds", type=float, default=120.0, help="refit.timeout_seconds")
    parser.add_argument("--preset", default="bench", help="tools/make_tiny_model.py preset (bench: ~220 MB)")
    args = parser.parse_args()
    args.layouts = parse_list(args.layouts, ",".join(LAYOUTS))
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    args.bucket_megabytes = [float(size) for size in parse_list(args.bucket_megabytes, "16,64")]
    if not args.bucket_megabytes or min(args.bucket_megabytes) <= 0:
        raise SystemExit(f"--bucket-megabytes {args.bucket_megabytes}: give positive sizes, e.g. 16,64")
    if args.refits < 1:
        raise SystemExit(f"--refits {args.refits}: give at least 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported; its processes inherit it
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    keep_stdout_for_json()
    model_dir = build_bench_model(args.preset, seed=0)
    asyncio.run(run_benchmark(args, model_dir))
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
