"""Refit over gloo: the bucket plan, and weights broadcast from 2 FSDP2 trainer ranks into a real
vLLM engine, received into one bucket-sized buffer and loaded as they arrive."""

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from molt.refit.gloo import RefitSender
from molt.refit.weight_sync import BucketEntry, plan_buckets

# starts vLLM engines (not in the unit tier); refits wait up to 240 s
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NUM_REFITS = 3
PROBE = list(range(3, 45))


def test_plan_buckets_keeps_order_dtype_and_budget():
    entries = [BucketEntry("a", "float32", (10,)), BucketEntry("b", "float32", (10,)),
               BucketEntry("c", "bfloat16", (4,)), BucketEntry("d", "float32", (100,)),
               BucketEntry("e", "float32", (5,)), BucketEntry("f", "float32", (5,))]
    buckets = plan_buckets(entries, bucket_bytes=80)
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert [e for b in buckets for e in b] == entries
    for bucket in buckets:
        assert len({e.dtype for e in bucket}) == 1
        assert len(bucket) == 1 or sum(e.num_bytes for e in bucket) <= 80


def test_plan_is_O_buckets_for_a_real_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sender = RefitSender(model, is_sender=True, bucket_bytes=1 << 20, timeout_seconds=10)
    num_params = len(list(model.parameters()))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(sender.buckets) == -(-total // (1 << 20))  # ceil: one dtype, no parameter above 1 MiB
    assert len(sender.buckets) < num_params
    assert sorted(e[0] for b in sender.wire_plan for e in b) == sorted(n for n, _ in model.named_parameters())


def _trainer_rank(rank: int, world_size: int, model_dir: str, port_file: str, num_refits: int):
    from molt.trainer.scoring import compute_token_logprobs
    from molt.trainer.sharded_model import build_actor_model
    from molt.distributed.parallelize import ShardingPlan, TrainerMesh

    mesh = TrainerMesh.from_group(dist.group.WORLD, "cpu")
    model = build_actor_model(model_dir, mesh=mesh, device=torch.device("cpu"), plan=ShardingPlan())
    shards = list(model.parameters())
    sender = RefitSender(model, is_sender=rank == 0, bucket_bytes=256 << 10, timeout_seconds=60)
    if rank == 0:  # tells the test the rendezvous port, as the join message tells the engines
        port = sender.group_message("127.0.0.1", 2)["port"]
        Path(f"{port_file}.tmp").write_text(str(port))
        os.replace(f"{port_file}.tmp", port_file)
        sender.connect()
    probes = []
    generator = torch.Generator().manual_seed(rank)
    for _ in range(num_refits):
        with torch.no_grad():  # each rank changes its own shard: the gathered weights are new
            for param in shards:
                local = param.to_local()
                local.add_(torch.randn(local.shape, generator=generator) * 0.02)
        sender.broadcast()
        ids = torch.tensor([PROBE])
        with torch.no_grad():
            probes.append(compute_token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0].tolist())
        model.reshard()  # FSDP2 leaves the root gathered after a forward without backward
    return {"probes": probes, "num_buckets": len(sender.buckets)}


def test_back_to_back_refits_from_two_fsdp_ranks_match_the_trainer(engine, tiny_model_dir, tmp_path):
    """Several buckets, layers straddling bucket boundaries (the attention's q and k in one bucket,
    its v in the next), one receive buffer reused by all: the weights vLLM held on to across a
    boundary were copied out of the buffer before it was overwritten, or the engine would not match."""
    port_file = tmp_path / "refit-port"
    from transformers import AutoModelForCausalLM

    plan_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plan = RefitSender(plan_model, is_sender=False, bucket_bytes=256 << 10, timeout_seconds=60).wire_plan
    results: dict = {}

    def trainers():
        try:
            results["ranks"] = run_ranks(_trainer_rank, 2, str(tiny_model_dir), str(port_file), NUM_REFITS,
                                         timeout_seconds=240)
        except BaseException as error:  # surfaced below
            results["error"] = error

    before = engine.run(engine.engine.score(PROBE))
    thread = threading.Thread(target=trainers)
    thread.start()
    deadline = time.monotonic() + 240
    while not port_file.exists():
        assert thread.is_alive() and time.monotonic() < deadline, f"trainer rank 0 named no port: {results}"
        time.sleep(0.1)
    port = int(port_file.read_text())
    engine.run(engine.engine.join_refit_group(host="127.0.0.1", port=port, rank=1, world_size=2,
                                              timeout_seconds=60, plan=plan), timeout_seconds=240)
    engine_probes, stats = [], []
    for version in range(1, NUM_REFITS + 1):
        engine.run(engine.engine.receive_weights(version), timeout_seconds=120)
        engine_probes.append(engine.run(engine.engine.score(PROBE)))
        stats += engine.run(engine.engine.llm.collective_rpc("molt_receive_stats"))
    thread.join(240)
    if "error" in results:
        raise results["error"]
    trainer_probes = results["ranks"][0]["probes"]
    assert results["ranks"][0]["num_buckets"] > 1  # the test exercises several buckets
    assert engine.engine.policy_version == NUM_REFITS
    first_gap = max(abs(a - b) for a, b in zip(before[1:], trainer_probes[0][1:]))
    assert first_gap > 1e-2, "the perturbation must be visible, or this test could not fail"
    for engine_logprobs, trainer_logprobs in zip(engine_probes, trainer_probes):
        gap = max(abs(a - b) for a, b in zip(engine_logprobs[1:], trainer_logprobs[1:]))
        assert gap <= 1e-4
    # Receive memory: one buffer the size of the largest bucket, plus what vLLM held on to across a
    # boundary, which is less than one decoder layer.
    largest_bucket = max(sum(BucketEntry(n, d, tuple(s)).num_bytes for n, d, s in bucket) for bucket in plan)
    model_bytes = sum(p.numel() * p.element_size() for p in plan_model.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in plan_model.model.layers[0].parameters())
    for stat in stats:
        assert stat["buffer_bytes"] == largest_bucket < model_bytes / 4
        assert stat["detached_bytes"] > 0 and 0 < stat["held_bytes_max"] < layer_bytes
    _restore_engine_weights(engine, tiny_model_dir, plan)


def _restore_engine_weights(engine, model_dir, plan) -> None:
    """Put the original weights back for the other tests sharing this engine."""
    from transformers import AutoModelForCausalLM

    send_weights_to_engine(engine, AutoModelForCausalLM.from_pretrained(model_dir))


def send_weights_to_engine(engine, model) -> None:
    """Refit a shared engine (an EngineThread) with `model`'s weights as version 0 (a test that
    changed them puts the generated ones back)."""
    sender = RefitSender(model, is_sender=True, bucket_bytes=256 << 10, timeout_seconds=60)
    port = sender.group_message("127.0.0.1", 2)["port"]
    joined = engine.submit(engine.engine.join_refit_group(host="127.0.0.1", port=port, rank=1, world_size=2,
                                                          timeout_seconds=60, plan=sender.wire_plan))
    sender.connect()
    joined.result(60)
    received = engine.submit(engine.engine.receive_weights(0))
    sender.broadcast()
    received.result(60)


def refit_outside_vllm(sender: RefitSender):
    """One broadcast of `sender` into a RefitReceiver in a thread, outside vLLM: (bytes sent, the
    receiver, {name: tensor} as received)."""
    from molt.refit.receiver import RefitReceiver

    class StandaloneReceiver(RefitReceiver):  # no tensor-parallel state to ask
        def molt_tensor_parallel_rank(self) -> int:
            return 0

    port = sender.group_message("127.0.0.1", 2)["port"]
    receiver, received = StandaloneReceiver(), {}

    def receive():
        receiver.molt_join_refit_group(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_seconds=30,
                                       plan=sender.wire_plan)
        received.update({name: tensor.clone() for name, tensor in receiver.molt_stream_weights()})

    thread = threading.Thread(target=receive)
    thread.start()
    sender.connect()
    sent = sender.broadcast()
    thread.join(30)
    return sent, receiver, received


def test_buckets_carry_the_engine_dtype_and_the_sender_casts_into_them(model_path):
    """fp32 master weights, a bf16 engine: the plan names bfloat16, the wire carries 2-byte values,
    and what arrives is each weight cast to bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    sender = RefitSender(model, is_sender=True, bucket_bytes=16 << 10, timeout_seconds=30, engine_dtype="bfloat16")
    assert {entry[1] for bucket in sender.wire_plan for entry in bucket} == {"bfloat16"}
    sent, receiver, received = refit_outside_vllm(sender)
    parameters = dict(model.named_parameters())
    assert sent == sum(p.numel() * 2 for p in parameters.values())
    assert received.keys() == parameters.keys()
    for name, parameter in parameters.items():
        assert received[name].dtype == torch.bfloat16
        assert torch.equal(received[name], parameter.detach().to(torch.bfloat16)), name
    largest = max(sum(e.num_bytes for e in bucket) for bucket in sender.buckets)
    assert receiver.molt_receive_stats()["buffer_bytes"] == largest < sent  # one bucket's buffer, not the model's


def test_the_refit_rendezvous_is_bound_before_its_port_is_named():
    """The sender's store listens on the port the join message names from the moment it is named:
    no other process can take it in between, and a worker joining there forms the group."""
    from molt.refit.gloo import join_refit_rendezvous, make_refit_group

    sender = RefitSender(torch.nn.Linear(4, 2), is_sender=True, bucket_bytes=1 << 10, timeout_seconds=30)
    message = sender.group_message("127.0.0.1", 2)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", message["port"]))
    received = {}

    def worker():
        group = make_refit_group(join_refit_rendezvous("127.0.0.1", message["port"], 2, 30), 1, 2, 30)
        tensor = torch.zeros(2, dtype=torch.int64)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([tensor], options).wait()
        received["tensor"] = tensor

    thread = threading.Thread(target=worker)
    thread.start()
    sender.connect()
    options = dist.BroadcastOptions()
    options.rootRank = 0
    sender.group.broadcast([torch.tensor([7, message["port"]])], options).wait()
    thread.join(30)
    assert received["tensor"].tolist() == [7, message["port"]]
