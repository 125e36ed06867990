"""Route capture in the real vLLM CPU engine on the tiny Qwen3-MoE (molt.rollout.route_capture): shapes, the
routes against a direct engine forward and against Hugging Face's router, prefix-cache hits (served
the routes of the blocks an earlier request computed), concurrent requests, and the refusal of
capture on a dense model. The engine is conftest's shared `moe_engine`."""

import asyncio

import pytest
import torch

from molt.agents.base import SamplingParams
from molt.config import ConfigError, MoltConfig
from molt.rollout.engine import RolloutEngine

# Engine and Hugging Face router logits are both fp32; a token whose k-th and (k+1)-th expert logits
# are closer than this may be routed either way by two correct implementations (a near tie).
NEAR_TIE = 1e-3
CPU_BLOCK_TOKENS = 128  # vLLM's CPU prefix cache keeps whole blocks of 128 tokens


@pytest.fixture(scope="module")
def hf_moe(moe_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32).eval()


def generate(engine_thread, prompt: list[int], max_tokens: int):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    return engine_thread.run(engine_thread.engine.generate(prompt, sampling))


def hf_router_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[tokens, layers, experts] router logits of Hugging Face's forward of `token_ids`."""
    with torch.no_grad():
        outputs = model(input_ids=torch.tensor([token_ids]), output_router_logits=True)
    return torch.stack([logits.reshape(len(token_ids), -1) for logits in outputs.router_logits], dim=1)


def compare_with_router(routes: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """(positions x layers that differ from the top-k of `logits`, of which near ties); routes and
    logits cover the same positions."""
    top_k = routes.shape[-1]
    expected = logits.topk(top_k, dim=-1).indices.sort(dim=-1).values
    ranked = logits.sort(dim=-1, descending=True).values
    near_tie = (ranked[..., top_k - 1] - ranked[..., top_k]).abs() < NEAR_TIE  # [tokens, layers]
    differs = (routes.long() != expected).any(dim=-1)
    return int(differs.sum()), int((differs & near_tie).sum())


@pytest.mark.e2e
def test_routes_cover_prompt_and_response_and_match_the_router(moe_engine, hf_moe):
    """Concurrent requests (one engine batch) each get their own routes, equal to the top-k of
    Hugging Face's fp32 router logits at every computed position (near ties excepted and counted),
    and equal to those of a fresh prefill of the same tokens (a direct engine forward)."""
    prompts = [[10 + (7 * index + 3 * position) % 250 for position in range(20 + 5 * index)] for index in range(6)]

    async def generate_all():
        sampling = SamplingParams(max_tokens=16, temperature=1.0)
        return await asyncio.gather(*(moe_engine.engine.generate(prompt, sampling) for prompt in prompts))

    generations = moe_engine.run(generate_all())
    differing = near_ties = 0
    for prompt, generation in zip(prompts, generations):
        tokens = prompt + generation.token_ids
        routes = generation.routed_experts
        assert routes.dtype == torch.int16 and routes.shape == (len(tokens), 2, 2), routes.shape
        assert (routes[:-1] >= 0).all(), "a computed position has no route"
        assert (routes[-1] == -1).all(), "the last sampled token never ran through the model"
        diff, ties = compare_with_router(routes[:-1], hf_router_logits(hf_moe, tokens)[:-1])
        differing, near_ties = differing + diff, near_ties + ties
    assert differing == near_ties, f"{differing - near_ties} routes differ from Hugging Face's away from a near tie"

    # The first generation's tokens again, as a new prompt (under 128 tokens: no prefix-cache hit).
    tokens = prompts[0] + generations[0].token_ids
    replay = generate(moe_engine, tokens, max_tokens=1).routed_experts
    assert (replay[:len(tokens)] >= 0).all()
    mismatched = (replay[:len(tokens) - 1] != generations[0].routed_experts[:-1]).any(dim=-1)
    logits = hf_router_logits(hf_moe, tokens)[:-1]
    _, ties = compare_with_router(replay[:len(tokens) - 1], logits)
    assert int(mismatched.sum()) <= ties, f"prefill and decode routed {int(mismatched.sum())} positions differently"
    print(f"routes differing from HF top-k: {differing} (all near ties < {NEAR_TIE}); prefill vs decode: "
          f"{int(mismatched.sum())}")


@pytest.mark.e2e
def test_prefix_cache_hits_get_the_routes_of_the_cached_blocks(moe_engine, hf_moe):
    """A request sharing a long prefix with an earlier one is served its first block from the prefix
    cache (it never computes those positions: prefill_tokens grows by the rest only), and gets
    there exactly the routes the earlier request recorded, which are Hugging Face's top-k (near ties
    excepted and counted); no position goes unrouted."""
    engine = moe_engine.engine
    prefix = [20 + position % 200 for position in range(CPU_BLOCK_TOKENS + 12)]
    first = generate(moe_engine, prefix + [5, 6, 7], max_tokens=4)
    assert (first.routed_experts[:-1] >= 0).all()
    unrouted_before, prefilled_before = engine.unrouted_tokens, engine.prefill_tokens
    prompt = prefix + [8, 9]
    second = generate(moe_engine, prompt, max_tokens=4)
    assert engine.prefill_tokens - prefilled_before == len(prompt) - CPU_BLOCK_TOKENS, "no prefix-cache hit"
    routes = second.routed_experts
    assert torch.equal(routes[:CPU_BLOCK_TOKENS], first.routed_experts[:CPU_BLOCK_TOKENS])
    assert (routes[:-1] >= 0).all()
    assert engine.unrouted_tokens == unrouted_before
    differing, near_ties = compare_with_router(routes[:-1], hf_router_logits(hf_moe, prompt + second.token_ids)[:-1])
    assert differing == near_ties, f"{differing - near_ties} routes differ from Hugging Face's away from a near tie"


@pytest.mark.e2e
def test_routes_of_a_streamed_request_come_on_its_last_delta(moe_engine):
    """Streaming: only the last delta carries routes, for the whole prompt and response; the worker
    forgets every request's routes once taken (this file's earlier requests' too)."""
    prompt = [30 + position for position in range(25)]

    async def collect():
        return [delta async for delta in moe_engine.engine.stream(prompt, SamplingParams(max_tokens=6))]

    deltas = moe_engine.run(collect())
    assert all(delta.routed_experts is None for delta in deltas[:-1])
    num_tokens = len(prompt) + sum(len(delta.token_ids) for delta in deltas)
    assert deltas[-1].routed_experts.shape[0] == num_tokens
    assert moe_engine.run(moe_engine.engine.llm.collective_rpc("molt_num_held_routes")) == [0]


def test_capture_on_a_dense_model_is_refused(tiny_model_dir):
    """rollout.capture_routes=True on a dense model fails at start, naming the field, before vLLM starts."""
    cfg = MoltConfig()
    cfg.model.path = str(tiny_model_dir)
    cfg.rollout.capture_routes = True
    with pytest.raises(ConfigError, match=r"rollout.capture_routes=True.*dense model"):
        RolloutEngine.start(cfg, seed=0)
