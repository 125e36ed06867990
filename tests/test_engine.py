"""The rollout engine on the real vLLM CPU engine: per-token policy versions, weight swaps with
requests in flight (partial rollout or not) or queued, a weight load failing part-way, sampling
seeds independent of batching, and the CPU thread binding of tensor-parallel engines."""

import asyncio
import json
import math
import re
import threading
import time
from collections import namedtuple

import pytest
import torch

from conftest import SHARED_ENGINE_KV_CACHE_GIGABYTES, SHARED_ENGINE_MAX_NUM_SEQS
from molt.agents.base import SamplingParams
from molt.config import DEFAULT_KV_CACHE_GIGABYTES, ConfigError, MoltConfig, apply_override, validate_config
from molt.refit.gloo import RefitSender
from molt.rollout.engine import (EngineStartError, RolloutEngine, build_engine_args, cpu_thread_binding,
                                 describe_memory_shortfall, token_versions)

pytestmark = pytest.mark.e2e  # starts vLLM engines or torchrun jobs: not in the unit tier

Span = namedtuple("Span", "version start end")  # the shape of vLLM's WeightVersionSpan


@pytest.mark.parametrize("spans, num_tokens, expected", [
    (None, 3, [7, 7, 7]),  # no span reported: the version at the request's start
    ([Span("default", 0, 2)], 2, [0, 0]),  # vLLM's label of the weights it loaded is version 0
    ([Span("3", 0, 2), Span("4", 2, 5)], 5, [3, 3, 4, 4, 4]),
    ([Span("3", 0, 2), Span("4", 2, 5)], 3, [3, 3, 4]),  # a stop string trimmed the tail
    ([Span("3", 0, 2), Span("4", 4, 3)], 3, [3, 3, 3]),  # ...even past a span's start
])
def test_token_versions_follow_the_spans(spans, num_tokens, expected):
    assert token_versions(spans, num_tokens, fallback=7) == expected


class TrainerSide:
    """A refit sender as the trainer has one (a plain Hugging Face model here), joined to the shared
    engine's refit group. It broadcasts from a thread, when `go` is set, while the engine swaps."""

    def __init__(self, engine, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.original = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        self.sender = RefitSender(self.model, is_sender=True, bucket_bytes=256 << 10, timeout_seconds=120)
        self.join(engine)

    def join(self, engine) -> None:
        """A fresh refit group with the engine's worker (again after a failed refit)."""
        port = self.sender.group_message("127.0.0.1", 2)["port"]
        joined = engine.submit(engine.engine.join_refit_group(host="127.0.0.1", port=port, rank=1, world_size=2,
                                                              timeout_seconds=120, plan=self.sender.wire_plan))
        self.sender.connect()
        joined.result(120)

    def set_weights(self, *, noise_seed: int | None) -> None:
        """The original weights, plus (with a seed) a perturbation visible in the log-probs."""
        generator = torch.Generator().manual_seed(noise_seed or 0)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(self.original[name])
                if noise_seed is not None:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.02)

    def broadcast_when(self, go: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=lambda: go.wait(120) and self.sender.broadcast(), daemon=True)
        thread.start()
        return thread


@pytest.fixture(scope="module")
def trainer_side(engine, tiny_model_dir):
    return TrainerSide(engine, tiny_model_dir)


def _prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


async def _collect(engine: RolloutEngine, prompt: list[int], seed: int, progress: list[int], index: int,
                   max_tokens: int = 200) -> dict:
    """One streamed generation; progress[index] follows its token count as the deltas arrive."""
    tokens, logprobs, versions, finish = [], [], None, None
    async for delta in engine.stream(prompt, SamplingParams(max_tokens=max_tokens), seed=seed):
        tokens += delta.token_ids
        logprobs += delta.logprobs
        versions = delta.policy_versions or versions
        finish = delta.finish_reason or finish
        progress[index] = len(tokens)
    return {"tokens": tokens, "logprobs": logprobs, "versions": versions, "finish": finish}


async def _until(predicate, timeout_seconds: float = 60) -> None:
    async with asyncio.timeout(timeout_seconds):
        while not predicate():
            await asyncio.sleep(0.002)


def _restore(engine, trainer_side) -> None:
    """Put the original weights (version 0) back for the other tests sharing the engine."""
    trainer_side.set_weights(noise_seed=None)
    go = threading.Event()
    go.set()
    sender = trainer_side.broadcast_when(go)
    engine.run(engine.engine.swap_weights(0, partial_rollout=True))
    sender.join(120)


def test_partial_rollout_keeps_every_request_and_each_token_keeps_its_version_and_logprob(engine, trainer_side):
    rollout_engine = engine.engine
    prompt = _prompt(rollout_engine.tokenizer, "Count to one hundred.")
    num_requests = 8
    trainer_side.set_weights(noise_seed=1)
    go = threading.Event()
    go.set()
    sender = trainer_side.broadcast_when(go)

    async def generate_across_a_swap():
        progress = [0] * num_requests
        tasks = [asyncio.create_task(_collect(rollout_engine, prompt, 100 + i, progress, i)) for i in range(num_requests)]
        await _until(lambda: sum(p >= 8 for p in progress) >= num_requests // 2)
        before = list(progress)  # tokens that surely came before the swap
        await rollout_engine.swap_weights(1, partial_rollout=True)
        return before, await asyncio.gather(*tasks)

    try:
        before, results = engine.run(generate_across_a_swap())
        sender.join(120)
        new_scores = [engine.run(rollout_engine.score(prompt + r["tokens"])) for r in results]
    finally:
        _restore(engine, trainer_side)
    old_scores = [engine.run(rollout_engine.score(prompt + r["tokens"])) for r in results]

    assert all(r["finish"] in ("stop", "length") for r in results), [r["finish"] for r in results]  # none aborted
    spanning, gaps = 0, {"old": 0.0, "new": 0.0, "old_vs_new": 0.0}
    for seen, result, new, old in zip(before, results, new_scores, old_scores):
        tokens, versions = result["tokens"], result["versions"]
        assert len(versions) == len(tokens) == len(result["logprobs"])
        num_old = versions.count(0)
        assert versions == [0] * num_old + [1] * (len(tokens) - num_old)  # the swap happened once, in order
        assert num_old >= seen
        spanning += 0 < num_old < len(tokens)
        for position, (logprob, version) in enumerate(zip(result["logprobs"], versions)):
            scored = {0: old, 1: new}[version][len(prompt) + position]
            gaps["old" if version == 0 else "new"] = max(gaps["old" if version == 0 else "new"], abs(logprob - scored))
            if version == 1:
                gaps["old_vs_new"] = max(gaps["old_vs_new"], abs(old[len(prompt) + position] - scored))
    assert spanning >= 1, "no request was in flight across the swap; the test proved nothing"
    # Each token's log-prob is that of the weights that sampled it (the retained requests recomputed
    # their prefixes under the new weights), and the two weight sets are told apart.
    assert gaps["old"] <= 1e-3 and gaps["new"] <= 1e-3, gaps
    assert gaps["old_vs_new"] > 1e-2, gaps


def test_without_partial_rollout_in_flight_requests_finish_on_old_weights_and_queued_ones_wait(engine, trainer_side):
    # RELIABILITY 5 and 6: a pause aborts nothing; a request queued while paused neither is lost nor
    # starts early (every token it samples carries the new version).
    rollout_engine = engine.engine
    prompt = _prompt(rollout_engine.tokenizer, "Count to one hundred.")
    num_in_flight, num_queued = 4, 4
    trainer_side.set_weights(noise_seed=2)
    go = threading.Event()
    sender = trainer_side.broadcast_when(go)

    async def swap_with_requests_in_flight_and_queued():
        progress, queued_progress = [0] * num_in_flight, [0] * num_queued
        in_flight = [asyncio.create_task(_collect(rollout_engine, prompt, 200 + i, progress, i))
                     for i in range(num_in_flight)]
        await _until(lambda: sum(p >= 4 for p in progress) >= num_in_flight // 2)
        swap = asyncio.create_task(rollout_engine.swap_weights(2, partial_rollout=False))
        while not await rollout_engine.llm.is_paused():
            await asyncio.sleep(0.001)
        at_pause = list(progress)
        queued = [asyncio.create_task(_collect(rollout_engine, prompt, 300 + i, queued_progress, i, max_tokens=16))
                  for i in range(num_queued)]
        await asyncio.gather(*in_flight)  # 'wait': they finish before the weights change...
        await asyncio.sleep(0.3)
        held = list(queued_progress)  # ...and the queued ones have not started
        go.set()  # the trainer broadcasts
        await swap
        return at_pause, held, [t.result() for t in in_flight], await asyncio.gather(*queued)

    try:
        at_pause, held, finished, queued = engine.run(swap_with_requests_in_flight_and_queued())
        sender.join(120)
    finally:
        go.set()
        _restore(engine, trainer_side)
    assert all(r["finish"] in ("stop", "length") for r in finished + queued)
    assert any(len(r["tokens"]) > seen for r, seen in zip(finished, at_pause)), "nothing generated during the pause"
    assert all(r["versions"] == [0] * len(r["tokens"]) for r in finished)
    assert held == [0] * num_queued
    assert all(len(r["tokens"]) >= 1 and r["versions"] == [2] * len(r["tokens"]) for r in queued)


@pytest.mark.parametrize("partial_rollout", [True, False], ids=["keep", "wait"])
def test_requests_queued_in_the_scheduler_when_the_pause_lands_finish_wholly_on_the_new_weights(
        engine, trainer_side, partial_rollout):
    # RELIABILITY 6: more requests than the engine runs at once, so the last ones sit in vLLM's
    # waiting queue when the pause lands. None is lost, and none starts before the new weights
    # (every token it samples carries the new version); those already running keep their versions.
    rollout_engine = engine.engine
    llm = rollout_engine.llm
    max_num_seqs = llm.vllm_config.scheduler_config.max_num_seqs
    prompt = _prompt(rollout_engine.tokenizer, "Count to one hundred.")
    num_requests, max_tokens, new_version = max_num_seqs + 8, 32, 3
    trainer_side.set_weights(noise_seed=3)
    go = threading.Event()
    sender = trainer_side.broadcast_when(go)

    async def swap_with_requests_running_and_waiting():
        progress = [0] * num_requests
        tasks = [asyncio.create_task(_collect(rollout_engine, prompt, 400 + i, progress, i, max_tokens=max_tokens))
                 for i in range(num_requests)]
        # Every request was handed to the engine core before the pause (vLLM registers a request
        # with its output processor just before sending it, and a finished one leaves it), and
        # the first requests run.
        await _until(lambda: llm.get_num_unfinished_requests() + sum(t.done() for t in tasks) == num_requests
                     and any(progress))
        swap = asyncio.create_task(rollout_engine.swap_weights(new_version, partial_rollout=partial_rollout))
        while not await llm.is_paused():
            await asyncio.sleep(0.001)
        if not partial_rollout:  # 'wait': the running requests finish first, on the old weights
            await _until(lambda: all(t.done() or p == 0 for t, p in zip(tasks, progress)))
        # What was sampled before the pause (or during the drain) is delivered: no event marks that,
        # so a settle time, generous for a loaded machine (delivery takes milliseconds).
        await asyncio.sleep(1.0)
        held = list(progress)  # still paused: the weights have not changed yet
        go.set()  # the trainer broadcasts
        await swap
        return held, await asyncio.gather(*tasks)

    try:
        held, results = engine.run(swap_with_requests_running_and_waiting())
        sender.join(120)
    finally:
        go.set()
        _restore(engine, trainer_side)

    assert all(r["finish"] in ("stop", "length") for r in results), [r["finish"] for r in results]  # none lost
    assert all(len(r["versions"]) == len(r["tokens"]) == len(r["logprobs"]) >= 1 for r in results)
    waiting = [i for i, seen in enumerate(held) if seen == 0]
    # At most max_num_seqs requests ran when the pause landed; any other that had sampled under the
    # old weights had already finished (on a stop token: none was anywhere near max_tokens).
    num_stopped = sum(results[i]["finish"] == "stop" for i in range(num_requests) if held[i] > 0)
    assert len(waiting) >= max(1, num_requests - max_num_seqs - num_stopped), (len(waiting), num_stopped)
    for i in waiting:  # queued across the pause: started only on the new weights
        assert results[i]["versions"] == [new_version] * len(results[i]["tokens"]), i
    spanning = 0
    for i, result in enumerate(results):
        if held[i] == 0:
            continue
        tokens, versions = result["tokens"], result["versions"]
        if partial_rollout:  # 'keep': frozen at the pause, the rest sampled by the new weights
            assert versions == [0] * held[i] + [new_version] * (len(tokens) - held[i]), i
            spanning += held[i] < len(tokens)
        else:  # 'wait': finished wholly on the old weights during the pause
            assert held[i] == len(tokens) and versions == [0] * len(tokens), i
    assert spanning >= 1 or not partial_rollout, "no running request was kept across the swap"


def test_a_load_failing_part_way_leaves_the_engine_paused_until_a_refit_succeeds(engine, trainer_side):
    # RELIABILITY 29: the weights are loaded as their buckets arrive, so a load that fails part-way
    # leaves some layers new and the rest old. The engine then serves nothing (a request submitted
    # meanwhile waits) until a refit succeeds; what it samples after is wholly the new version's.
    rollout_engine = engine.engine
    llm = rollout_engine.llm
    prompt = _prompt(rollout_engine.tokenizer, "Count to one hundred.")
    version = rollout_engine.policy_version
    # The engine's plan names, in its second bucket, a weight the model lacks: vLLM's loader fails
    # there, after the first bucket's weights went in (the embeddings: a layer now new).
    sender = RefitSender(trainer_side.model, is_sender=True, bucket_bytes=256 << 10, timeout_seconds=5)
    plan = sender.wire_plan
    plan[1][0][0] = "model.layers.0.self_attn.no_such_proj.weight"
    port = sender.group_message("127.0.0.1", 2)["port"]
    joined = engine.submit(rollout_engine.join_refit_group(host="127.0.0.1", port=port, rank=1, world_size=2,
                                                           timeout_seconds=5, plan=plan))
    sender.connect()
    joined.result(60)
    trainer_side.set_weights(noise_seed=4)
    failing_sender = threading.Thread(target=lambda: _ignore_errors(sender.broadcast), daemon=True)
    failing_sender.start()
    progress = [0]
    try:
        with pytest.raises(Exception, match="no_such_proj"):
            engine.run(rollout_engine.swap_weights(version + 1, partial_rollout=False))
        assert engine.run(llm.is_paused()), "an engine holding a mix of weights must not resume"
        assert engine.run(llm.collective_rpc("molt_weights_intact")) == [False]
        waiting = engine.submit(_collect(rollout_engine, prompt, 500, progress, 0, max_tokens=16))
        time.sleep(1.0)
        assert progress == [0] and not waiting.done()  # paused: nothing sampled, nothing lost
        failing_sender.join(30)
        trainer_side.join(engine)  # as the trainer does after a failed attempt: a fresh group, then a retry
        go = threading.Event()
        go.set()
        retry = trainer_side.broadcast_when(go)
        engine.run(rollout_engine.swap_weights(version + 1, partial_rollout=False))
        retry.join(120)
        result = waiting.result(120)
        assert not engine.run(llm.is_paused())
        assert engine.run(llm.collective_rpc("molt_weights_intact")) == [True]
    finally:
        _restore(engine, trainer_side)
    assert result["finish"] in ("stop", "length") and result["versions"] == [version + 1] * len(result["tokens"])


def _ignore_errors(function) -> None:
    try:
        function()
    except Exception:
        pass


def test_cpu_thread_binding_splits_this_process_cores_across_the_workers():
    assert cpu_thread_binding([0, 1], 2) == "0|1"
    assert cpu_thread_binding([2, 3, 4, 5, 6], 2) == "2,3,4|5,6"
    assert cpu_thread_binding(list(range(8)), 4) == "0,1|2,3|4,5|6,7"
    assert cpu_thread_binding(list(range(8)), 2, threads_per_worker=2) == "0,1|4,5"  # rollout.engine_threads
    assert cpu_thread_binding([3], 2) == "3|3"  # fewer cores than workers: they share


def test_derived_seeds_make_samples_independent_of_batching(engine):
    llm, tokenizer = engine.engine.llm, engine.engine.tokenizer
    prompts = [_prompt(tokenizer, "3+5=")] * 3 + [_prompt(tokenizer, "2+2=")] * 3
    others = [_prompt(tokenizer, f"{i}+{i}=") for i in range(5, 9)]

    async def sample(with_other_requests: bool) -> list[list[int]]:
        # A fresh wrapper of the same engine: the same seed and no generations counted yet.
        rollout_engine = RolloutEngine(llm, tokenizer, seed=5)
        noise = [asyncio.create_task(rollout_engine.generate(p, SamplingParams(max_tokens=40)))
                 for p in (others if with_other_requests else [])]
        generations = await asyncio.gather(*[rollout_engine.generate(p, SamplingParams(max_tokens=12))
                                             for p in prompts])
        await asyncio.gather(*noise)
        return [g.token_ids for g in generations]

    alone, batched_with_others = engine.run(sample(False)), engine.run(sample(True))
    assert alone == batched_with_others
    assert len({tuple(ids) for ids in alone[:3]}) > 1  # copies of one prompt still sample differently


def test_a_burst_of_seeded_requests_beyond_the_token_budget_runs(engine):
    # Every request carries a seed; prompts that together exceed one engine step's token budget
    # would be prefilled in chunks, which kills vLLM's CPU engine for seeded requests (it cannot
    # rewind a CPU generator). RolloutEngine.start turns chunked prefill off on CPU.
    rollout_engine = engine.engine
    long_question = " ".join(f"{i}+{i}=" for i in range(12))
    prompts = [_prompt(rollout_engine.tokenizer, f"{long_question} ({n})") for n in range(120)]
    assert sum(map(len, prompts)) > 8192

    async def burst():
        return await asyncio.gather(*[rollout_engine.generate(p, SamplingParams(max_tokens=2)) for p in prompts])

    generations = engine.run(burst())
    assert all(g.finish_reason in ("stop", "length") and len(g.policy_versions) == len(g.token_ids) >= 1
               for g in generations)


# -- engine memory in bytes (rollout.kv_cache_gigabytes) and vLLM engine options (rollout.engine_args) --

def _engine_config(model_dir, **rollout) -> MoltConfig:
    cfg = MoltConfig()
    cfg.model.path, cfg.data.train_path, cfg.agent.path = str(model_dir), __file__, __file__
    cfg.rollout.max_length = 256
    for name, value in rollout.items():
        setattr(cfg.rollout, name, value)
    return cfg


def _naive_sequence_kv_bytes(model_dir, max_length: int, block_size: int) -> int:
    """K and V of every layer and KV head for one max_length sequence, in whole vLLM blocks, plus the
    block vLLM's pool holds back."""
    hf = json.loads((model_dir / "config.json").read_text())
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"] * 4  # float32
    return (math.ceil(max_length / block_size) + 1) * block_size * per_token


def test_an_engine_whose_kv_cache_cannot_hold_one_sequence_says_what_it_needs(tiny_model_dir):
    # A real engine start that vLLM refuses in its engine process (its message stays in that
    # process's log): the error raised here names the budget, what one sequence needs, and the field.
    needed_gib = _naive_sequence_kv_bytes(tiny_model_dir, 256, block_size=128) / 2**30  # vLLM CPU: 128-token blocks
    cfg = _engine_config(tiny_model_dir, kv_cache_gigabytes=0.0002)  # ~210 KB: one block and a bit
    with pytest.raises(EngineStartError) as raised:
        RolloutEngine.start(cfg, seed=0)
    message = str(raised.value)
    assert "rollout.kv_cache_gigabytes=0.0002" in message
    assert f"which needs about {needed_gib:.4g} GiB" in message
    suggested = float(re.search(r"raise rollout.kv_cache_gigabytes to at least ([\d.e-]+)", message)[1])
    assert needed_gib <= suggested < needed_gib * 1.001  # rounded up, so setting it is enough


def test_a_kv_cache_larger_than_the_free_memory_is_named_with_the_free_memory(tiny_model_dir):
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    cfg = _engine_config(tiny_model_dir, kv_cache_gigabytes=4096.0)
    vllm_config = build_engine_args(cfg, seed=0, backend="gloo").create_engine_config()
    assert vllm_config.cache_config.kv_cache_memory_bytes == 4096 * 2**30
    message = describe_memory_shortfall(cfg, vllm_config)
    free_gib, node = re.search(r"more than the ([\d.]+) GiB free of NUMA node (\d+)'s", message).groups()
    assert float(free_gib) == pytest.approx(get_memory_node_info(int(node)).available_memory / 2**30, rel=0.2)
    assert "lower rollout.kv_cache_gigabytes" in message
    cfg.rollout.kv_cache_gigabytes = 0.25  # fits: nothing to say
    assert describe_memory_shortfall(cfg, vllm_config) is None


def test_kv_cache_gigabytes_and_engine_memory_fraction_are_not_both_set(tiny_model_dir):
    cfg = _engine_config(tiny_model_dir, kv_cache_gigabytes=2.0, engine_memory_fraction=0.5)
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_gigabytes=2.0 and rollout.engine_memory_fraction=0.5 "
                                          r"both size the engine"):
        validate_config(cfg)
    cfg.rollout.engine_memory_fraction = 0.0
    validate_config(cfg)
    assert build_engine_args(cfg, seed=0, backend="gloo").kv_cache_memory_bytes == 2 * 2**30
    cfg.rollout.kv_cache_gigabytes, cfg.rollout.engine_memory_fraction = 0.0, 0.5  # a share, as vLLM sizes GPUs
    validate_config(cfg)
    args = build_engine_args(cfg, seed=0, backend="gloo")
    assert (args.gpu_memory_utilization, args.kv_cache_memory_bytes) == (0.5, None)
    cfg.rollout.engine_memory_fraction = 0.0  # neither: the default byte budget
    assert build_engine_args(cfg, seed=0, backend="gloo").kv_cache_memory_bytes == DEFAULT_KV_CACHE_GIGABYTES * 2**30


@pytest.mark.parametrize("engine_args, expected", [
    ({"max_num_seq": 8}, "rollout.engine_args['max_num_seq']: vLLM has no engine argument 'max_num_seq'; "
                         "did you mean 'max_num_seqs'?"),
    ({"enable_prefix_cache": False}, "did you mean 'enable_prefix_caching'?"),
    ({"tensor_parallel_size": 2}, "rollout.engine_args['tensor_parallel_size']: Molt sets this vLLM argument "
                                  "itself; set layout.engine_tensor_parallel_size"),
    ({"gpu_memory_utilization": 0.9}, "set rollout.engine_memory_fraction"),
    ({"kv_cache_memory_bytes": 2**30}, "set rollout.kv_cache_gigabytes"),
    ({"model": "other"}, "set model.path"),
    ({"worker_extension_cls": "x.Y"}, "set refit.receiver_cls"),
    ({"prefill_context_parallel_size": 2}, "rollout.engine_args['prefill_context_parallel_size']: Molt sets this "
                                           "vLLM argument itself; refit ranks count tensor-parallel workers only"),
])
def test_engine_args_refuse_unknown_and_molt_owned_names(tiny_model_dir, engine_args, expected):
    cfg = _engine_config(tiny_model_dir, engine_args=engine_args)
    with pytest.raises(ConfigError) as raised:  # at start-up
        validate_config(cfg)
    assert expected in str(raised.value)
    with pytest.raises(ConfigError, match=re.escape(expected)):  # and by whoever starts an engine directly
        build_engine_args(cfg, seed=0, backend="gloo")


def test_engine_args_can_be_set_from_the_command_line(tiny_model_dir):
    cfg = _engine_config(tiny_model_dir)
    apply_override(cfg, 'rollout.engine_args={"enable_prefix_caching": false, "max_num_seqs": 8}')
    validate_config(cfg)
    args = build_engine_args(cfg, seed=0, backend="gloo")
    assert (args.enable_prefix_caching, args.max_num_seqs) == (False, 8)
    with pytest.raises(ConfigError, match="expected dict"):
        apply_override(cfg, "rollout.engine_args=[1, 2]")


def test_engine_args_reach_the_started_engine(engine):
    # The shared engine passes max_num_seqs through rollout.engine_args (tests/conftest.py); the
    # engine core runs at most that many requests at once (the queued-requests test above relies on it).
    from vllm.config import SchedulerConfig

    vllm_config = engine.engine.llm.vllm_config
    assert SHARED_ENGINE_MAX_NUM_SEQS != SchedulerConfig.DEFAULT_MAX_NUM_SEQS
    assert vllm_config.scheduler_config.max_num_seqs == SHARED_ENGINE_MAX_NUM_SEQS
    assert vllm_config.cache_config.kv_cache_memory_bytes == int(SHARED_ENGINE_KV_CACHE_GIGABYTES * 2**30)
