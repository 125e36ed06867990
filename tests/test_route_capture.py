"""molt.rollout.route_capture without an engine: how a worker files each step's routes per request, keeps
the first route of a recomputed position, fills prefix-cache hits from the routes of the KV-cache
blocks it computed, forgets what nobody takes, and which models capture."""

import numpy as np
import pytest
import torch

from molt.config import ConfigError
from molt.config import MoltConfig
from molt.rollout import route_capture
from molt.rollout.route_capture import (BlockRoutes, RouteRecorder, StepLayout, count_unknown, external_request_id,
                                        dense_layer_indices, find_route_block_group, native_routes, resolve_capture_routes,
                                        route_capture_path)
from molt.trace.routes import decode_routes

NUM_LAYERS, TOP_K, NUM_EXPERTS = 3, 2, 8


def run_step(recorder: RouteRecorder, layout: StepLayout, routes: torch.Tensor, finished=()) -> None:
    """One engine step: each layer's router reports `routes[:, layer]` ([step tokens, top_k]), in
    reverse order per token as vLLM's unsorted top-k may, plus two padding rows."""
    recorder.read_layout = lambda scheduled: layout
    recorder.begin_step({}, finished)
    for layer in range(NUM_LAYERS):
        padded = torch.cat([routes[:, layer].flip(-1), torch.zeros(2, TOP_K, dtype=torch.int32)])
        recorder.capture(layer, padded.to(torch.int32))
    recorder.end_step()


def random_routes(num_tokens: int, seed: int) -> torch.Tensor:
    """[num_tokens, layers, top_k] distinct sorted expert ids per (token, layer)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, NUM_LAYERS, NUM_EXPERTS, generator=generator)
    return scores.topk(TOP_K, dim=-1).indices.sort(dim=-1).values.to(torch.int16)


def take(recorder: RouteRecorder, request_id: str) -> torch.Tensor | None:
    return decode_routes(recorder.take([request_id]).get(request_id))


def test_steps_are_filed_per_request_by_absolute_position():
    """A prefill of two requests (one starting past a 4-token prefix-cache hit), then decodes: each
    request gets its own rows at its own positions, -1 where nothing was computed."""
    recorder = RouteRecorder(NUM_LAYERS, TOP_K, read_layout=None)
    prefill = random_routes(5 + 3, seed=0)
    run_step(recorder, StepLayout(request_ids=["a", "b"], starts=[0, 4], counts=[5, 3]), prefill)
    decodes = [random_routes(2, seed=step) for step in range(1, 4)]
    for step, rows in enumerate(decodes):
        run_step(recorder, StepLayout(request_ids=["b", "a"], starts=[7 + step, 5 + step], counts=[1, 1]), rows)
    routes_a, routes_b = take(recorder, "a"), take(recorder, "b")
    expected_a = torch.cat([prefill[:5]] + [rows[1:] for rows in decodes])
    expected_b = torch.cat([torch.full((4, NUM_LAYERS, TOP_K), -1, dtype=torch.int16), prefill[5:]]
                           + [rows[:1] for rows in decodes])
    assert torch.equal(routes_a, expected_a)
    assert torch.equal(routes_b, expected_b)
    assert recorder.requests == {} and take(recorder, "a") is None  # taken means forgotten


def test_a_recomputed_position_keeps_its_first_route():
    """A request preempted (or retained across a refit that cleared the cache) recomputes its
    prefix; the positions keep the routes recorded first (molt.trace.routes)."""
    recorder = RouteRecorder(NUM_LAYERS, TOP_K, read_layout=None)
    first, again = random_routes(6, seed=1), random_routes(8, seed=2)
    run_step(recorder, StepLayout(request_ids=["a"], starts=[0], counts=[6]), first)
    run_step(recorder, StepLayout(request_ids=["a"], starts=[0], counts=[8]), again)
    assert torch.equal(take(recorder, "a"), torch.cat([first, again[6:]]))


BLOCK = 4  # tokens per KV-cache block in the block-store tests (vLLM's CPU engine: 128)
UNKNOWN_ROWS = torch.full((BLOCK, NUM_LAYERS, TOP_K), -1, dtype=torch.int16)


def block_step(recorder: RouteRecorder, requests: list[tuple[str, int, int, list[int]]], seed: int) -> torch.Tensor:
    """One engine step of (request, first position, tokens, block table row) in batch order, with
    the KV-cache slot of each token as vLLM's slot mapping gives it; returns the step's routes
    ([step tokens, layers, top_k])."""
    width = max(len(blocks) for *_, blocks in requests)
    table = np.array([blocks + [0] * (width - len(blocks)) for *_, blocks in requests], dtype=np.int32)
    slots = [blocks[position // BLOCK] * BLOCK + position % BLOCK
             for _, start, count, blocks in requests for position in range(start, start + count)]
    layout = StepLayout(request_ids=[request for request, *_ in requests],
                        starts=[start for _, start, _, _ in requests], counts=[count for _, _, count, _ in requests],
                        block_table=table, slots=torch.tensor(slots, dtype=torch.int64))
    routes = random_routes(sum(layout.counts), seed)
    run_step(recorder, layout, routes)
    return routes


def test_prefix_cache_hits_take_the_routes_of_the_blocks_that_hold_them():
    """A request first scheduled past a prefix-cache hit gets, at the positions it was served, the
    routes the request that computed those blocks recorded (block b, row p % block size); -1 in a
    block this worker never computed; its own steps after that as usual."""
    recorder = RouteRecorder(NUM_LAYERS, TOP_K, read_layout=None, blocks=BlockRoutes(BLOCK, NUM_LAYERS, TOP_K))
    # "a" prefills 6 tokens into blocks 5, 2 beside "z" (3 tokens), then decodes 3. vLLM caches a block
    # when it schedules it, so "y" is served a's block 5 in the step that computes it.
    prefill = block_step(recorder, [("z", 0, 3, [1]), ("a", 0, 6, [5, 2]), ("y", 4, 2, [5, 8])], seed=10)
    decodes = [block_step(recorder, [("a", 6 + step, 1, [5, 2, 40])], seed=11 + step) for step in range(3)]
    routes_a = take(recorder, "a")
    assert torch.equal(routes_a, torch.cat([prefill[3:9]] + decodes))
    assert torch.equal(take(recorder, "y"), torch.cat([prefill[3:7], prefill[9:]]))
    # "b" shares a's first two blocks (8 positions) and computes 2 more; "c" has block 5 cached but
    # block 9 came from elsewhere (never computed here).
    rows_b = block_step(recorder, [("b", 8, 2, [5, 2, 6]), ("c", 8, 1, [5, 9, 4])], seed=20)
    assert torch.equal(take(recorder, "b"), torch.cat([routes_a[:8], rows_b[:2]]))
    assert torch.equal(take(recorder, "c"), torch.cat([routes_a[:4], UNKNOWN_ROWS, rows_b[2:]]))
    # A block id past every one computed so far (the store grows lazily) is unknown too.
    block_step(recorder, [("d", 4, 1, [77, 3])], seed=21)
    assert (take(recorder, "d")[:BLOCK] == -1).all()


def test_a_reused_block_serves_the_routes_of_its_latest_content():
    """vLLM hands a freed block to new content (and recomputes blocks after a refit resets the
    cache): a later hit on it gets the routes of the computation that wrote it last."""
    recorder = RouteRecorder(NUM_LAYERS, TOP_K, read_layout=None, blocks=BlockRoutes(BLOCK, NUM_LAYERS, TOP_K))
    block_step(recorder, [("a", 0, 4, [2])], seed=30)
    again = block_step(recorder, [("b", 0, 5, [2, 6])], seed=31)  # block 2 recomputed (new content)
    block_step(recorder, [("c", 4, 2, [2, 8])], seed=32)
    assert torch.equal(take(recorder, "c")[:BLOCK], again[:BLOCK])


def test_a_hit_without_block_routes_yields_to_a_later_recompute():
    """The first route recorded wins (molt.trace.routes), but an unknown one is not a route: a position a
    hit could not fill takes the route of a later recompute (a preempted request), a filled one
    keeps the route it was served."""
    recorder = RouteRecorder(NUM_LAYERS, TOP_K, read_layout=None, blocks=BlockRoutes(BLOCK, NUM_LAYERS, TOP_K))
    cached = block_step(recorder, [("a", 0, 4, [3])], seed=40)
    first = block_step(recorder, [("b", 8, 1, [3, 9, 5])], seed=41)  # block 3 known, block 9 not
    recompute = block_step(recorder, [("b", 0, 9, [4, 6, 5])], seed=42)  # after a preemption
    assert torch.equal(take(recorder, "b"), torch.cat([cached, recompute[BLOCK:2 * BLOCK], first]))


def test_hit_routes_are_keyed_by_the_full_attention_group():
    """A hybrid model's KV cache has several groups, each with its own block table: the routes are
    keyed by the full-attention group's (a sliding-window group frees blocks out of the window);
    without one, or with a KV connector that can fill blocks no forward computed, none (hits then
    stay unknown). The KV-cache groups and block tables are vLLM's own; the model runner that would
    hold them needs a hybrid MoE model the tests do not have."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    window = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=32)
    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.float32)

    def runner(specs, kv_transfer_config=None):
        groups = [KVCacheGroupSpec([f"layer{index}"], spec) for index, spec in enumerate(specs)]
        tables = MultiGroupBlockTable(max_num_reqs=2, max_num_batched_tokens=64, pin_memory=False,
                                      device=torch.device("cpu"), block_sizes=[spec.block_size for spec in specs],
                                      max_num_blocks=[4] * len(specs))
        return SimpleNamespace(kv_cache_config=KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups),
                               input_batch=SimpleNamespace(block_table=tables),
                               vllm_config=SimpleNamespace(kv_transfer_config=kv_transfer_config))

    assert find_route_block_group(runner([full])) == (0, 32)
    assert find_route_block_group(runner([window, full])) == (1, 32)
    assert find_route_block_group(runner([window])) is None
    assert find_route_block_group(runner([full], kv_transfer_config=object())) is None


def test_routes_nobody_takes_are_forgotten(monkeypatch):
    """A finished request's routes stay for UNTAKEN_ROUTES_SECONDS (the engine takes them right after
    its last output), then go, so aborted streams cannot grow the worker's memory."""
    recorder = RouteRecorder(NUM_LAYERS, TOP_K, read_layout=None)
    layout = StepLayout(request_ids=["a", "b"], starts=[0, 0], counts=[2, 2])
    run_step(recorder, layout, random_routes(4, seed=3))
    run_step(recorder, StepLayout(request_ids=["b"], starts=[2], counts=[1]), random_routes(1, seed=4),
             finished=["a-0123abcd"])
    assert set(recorder.requests) == {"a", "b"}  # "a" finished, not yet expired
    monkeypatch.setattr(route_capture, "UNTAKEN_ROUTES_SECONDS", 0.0)
    run_step(recorder, StepLayout(request_ids=["b"], starts=[3], counts=[1]), random_routes(1, seed=5))
    assert set(recorder.requests) == {"b"}


def test_forwards_outside_engine_steps_are_ignored():
    """vLLM's profiling and warm-up forwards run the routers with no step scheduled."""
    recorder = RouteRecorder(NUM_LAYERS, TOP_K, read_layout=None)
    recorder.capture(0, torch.zeros(4, TOP_K, dtype=torch.int32))
    assert recorder.requests == {}


def test_external_request_id_strips_vllms_suffix():
    assert external_request_id("molt-stream-12-0a1b2c3d") == "molt-stream-12"
    assert external_request_id("molt-stream-12") == "molt-stream-12"  # no randomisation: unchanged


def test_native_routes_match_the_worker_path():
    """The GPU path's array (one row short: the last token never ran; vLLM's id order) becomes the
    same sorted, padded int16 tensor."""
    from vllm.outputs import CompletionOutput

    routes = random_routes(5, seed=6)
    completion = CompletionOutput(index=0, text="", token_ids=[1, 2], cumulative_logprob=None, logprobs=None,
                                  routed_experts=routes.flip(-1).numpy().astype(np.uint8))
    native = native_routes(completion, 6)
    assert native.dtype == torch.int16 and torch.equal(native[:5], routes) and (native[5] == -1).all()
    assert count_unknown(native, 6) == 1 and count_unknown(None, 4) == 4


def test_native_routes_mark_dense_layers_unknown():
    """vLLM's native capture has a row for every decoder layer, zeros where no router wrote (a
    DeepSeek-style model's first dense layers): Molt's trace says -1 there, as the CPU path does.
    Before the fix the dense layer came back as expert 0."""
    from vllm.outputs import CompletionOutput

    array = np.zeros((4, 3, 2), dtype=np.uint8)  # layer 0 dense (vLLM never writes it), layers 1-2 routed
    array[:, 1:] = np.array([3, 1], dtype=np.uint8)
    completion = CompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=None, logprobs=None,
                                  routed_experts=array)
    native = native_routes(completion, 5, dense_layers=[0])
    assert (native[:4, 0] == -1).all() and (native[:4, 1:] == torch.tensor([1, 3], dtype=torch.int16)).all()
    assert (native[4] == -1).all()


def test_dense_layers_follow_vllms_rules():
    """Which layers have no router, per family, as vLLM's models build them (qwen3_moe.py,
    deepseek_v2.py); a model with neither field routes every layer."""
    from types import SimpleNamespace

    deepseek = SimpleNamespace(num_hidden_layers=6, first_k_dense_replace=2, moe_layer_freq=2)
    assert dense_layer_indices(deepseek) == [0, 1, 3, 5]
    kimi = SimpleNamespace(num_hidden_layers=4, first_k_dense_replace=1)  # no moe_layer_freq: every layer after
    assert dense_layer_indices(kimi) == [0]
    qwen = SimpleNamespace(num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2)
    assert dense_layer_indices(qwen) == [0, 2, 4]
    assert dense_layer_indices(SimpleNamespace(num_hidden_layers=3, num_local_experts=8)) == []


def test_capture_is_on_for_moe_models_only(tiny_model_dir):
    from fixtures_models import build_cached_tiny_model

    moe_dir = str(build_cached_tiny_model(preset="moe"))
    assert resolve_capture_routes(None, moe_dir) is True
    assert resolve_capture_routes(False, moe_dir) is False
    assert resolve_capture_routes(None, str(tiny_model_dir)) is False
    with pytest.raises(ConfigError, match=r"rollout.capture_routes=True.*dense model"):
        resolve_capture_routes(True, str(tiny_model_dir))


def test_a_compiled_cpu_engine_cannot_capture():
    """vLLM's CPU compilation (rollout.enforce_eager=False) skips the routers' capture callbacks
    (measured: every route came back unknown), so capture there is refused at start; GPU engines
    use vLLM's own capture."""
    from fixtures_models import build_cached_tiny_model

    cfg = MoltConfig()
    cfg.model.path = str(build_cached_tiny_model(preset="moe"))
    assert route_capture_path(cfg, on_cpu=True) == "workers"
    assert route_capture_path(cfg, on_cpu=False) == "native"
    cfg.rollout.enforce_eager = False
    with pytest.raises(ConfigError, match=r"rollout.enforce_eager=False.*rollout.capture_routes=False"):
        route_capture_path(cfg, on_cpu=True)
    cfg.rollout.capture_routes = False
    assert route_capture_path(cfg, on_cpu=True) is None
