"""Benchmark the capture endpoint: single-turn chat rollouts through the per-session endpoint with
the real OpenAI SDK, side by side with the same prompts sent straight to the same vLLM engine
(PERF.md). Everything runs on one event loop against one real vLLM CPU engine started through Molt.

Paths (each rollout has a fixed sampling seed; the endpoint paths mix it with their session's own,
as the sampling contract says, so the work is equal in expectation and capture_generated_tokens
shows how equal it was):
- direct: render the chat template to token ids and run them through `RolloutEngine.stream` with
  one output at the end (what the endpoint itself calls for a non-streaming request);
- endpoint: open a session, build one `AsyncOpenAI` for it (as agents do), send one
  `chat.completions.create`, close the client and the session. The process shares one default
  TLS context between SDK clients, as Molt's rollout ranks do (`molt.agents.tls`);
- endpoint_responses: the same through the Responses API (`responses.create`), the OpenAI Agents
  SDK's default model;
- endpoint_raw_http (diagnostic): a session per rollout, but the request is plain JSON over one
  shared keep-alive aiohttp client, no SDK: what the endpoint itself (HTTP server, session,
  template, JSON) adds to the direct path.

One run prints one JSON line per figure, then the command that produced them:
- capture_rollouts_per_second: medians over rounds run A B C, C B A ... after a warm-up round
  (target endpoint / direct >= 0.95 for each SDK path; the diagnostic path's ratio alongside);
- capture_generated_tokens: prompt and completion tokens per path, to show the work was equal;
- capture_latency_p50_ms: per-rollout latency at the same concurrency;
- capture_sequential_latency_p50_ms: the same at concurrency 1, paths interleaved request by
  request, so queueing does not hide the endpoint's own overhead (target added <= 1 ms);
- capture_front_process_cpu_ms_per_rollout: CPU time of this process (event loop: SDK, endpoint,
  vLLM's front end; not the engine core) per rollout, per path;
- capture_sdk_client_construction_ms: p50 time to build one AsyncOpenAI with the SDK's own
  per-client CA loading and with Molt's shared default TLS context.

    python tools/bench/capture.py [--rollouts 256] [--concurrency 32] [--max-tokens 16 128] [--rounds 3] [--smoke]
"""

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bench_fixtures import load_repo_module, load_test_fixtures, parse_with_smoke

# vLLM, the OpenAI SDK and molt are imported inside functions: vLLM's engine core is spawned and
# re-imports this module, and should not pay for them.

MAX_LENGTH = 256
MODEL_NAME = "molt-tiny"
# --smoke (CI): 4 rollouts a round, 2 in flight, 4-token answers, 1 round, 2 sequential requests.
SMOKE_DEFAULTS = dict(rollouts=4, concurrency=2, max_tokens=[4], rounds=1, sequential_requests=2)


@dataclass(kw_only=True)
class RolloutTiming:
    """What one rollout cost and generated."""

    rollout_seconds: float  # whole rollout: session, client, template, request, close
    request_seconds: float  # the request alone: engine stream, or chat.completions.create
    client_seconds: float  # SDK client construction (0 for direct)
    prompt_tokens: int
    completion_tokens: int


@dataclass(kw_only=True)
class Workload:
    messages: list[list[dict]]  # [rollouts] chat messages of each rollout's prompt
    seeds: list[int]  # [rollouts] sampling seed of each rollout
    max_tokens: int


def build_workload(num_rollouts: int, max_tokens: int, seed: int) -> Workload:
    demo_data = load_repo_module("tools/make_demo_data.py", "molt_tools_make_demo_data")
    rows = demo_data.build_addition_rows(num_rollouts, random.Random(f"bench:{seed}"), "bench")
    return Workload(messages=[row["messages"] for row in rows],
                    seeds=[seed * 1_000_003 + index for index in range(num_rollouts)], max_tokens=max_tokens)


# -- the paths ------------------------------------------------------------------------------------

async def run_direct(engine, messages: list[dict], seed: int, max_tokens: int) -> RolloutTiming:
    from molt.agents.base import SamplingParams

    started = time.perf_counter()
    prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    sampling = SamplingParams(max_tokens=min(max_tokens, MAX_LENGTH - len(prompt_ids)), temperature=1.0)
    request_started = time.perf_counter()
    num_generated = 0
    async for delta in engine.stream(prompt_ids, sampling, seed=seed, incremental=False):
        num_generated += len(delta.token_ids)
    finished = time.perf_counter()
    return RolloutTiming(rollout_seconds=finished - started, request_seconds=finished - request_started,
                         client_seconds=0.0, prompt_tokens=len(prompt_ids), completion_tokens=num_generated)


async def run_endpoint(endpoint, messages: list[dict], seed: int, max_tokens: int, *,
                       api: str = "chat") -> RolloutTiming:
    """One rollout through the OpenAI SDK: `chat.completions.create` (api='chat') or
    `responses.create` (api='responses', the OpenAI Agents SDK's default model)."""
    from openai import AsyncOpenAI

    from molt.agents.base import SamplingParams

    started = time.perf_counter()
    session = endpoint.open_session(sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
                                    max_length=MAX_LENGTH)
    try:
        client_started = time.perf_counter()
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        request_started = time.perf_counter()
        try:
            if api == "chat":
                completion = await client.chat.completions.create(
                    model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=1.0, seed=seed)
                usage = (completion.usage.prompt_tokens, completion.usage.completion_tokens)
            else:
                response = await client.responses.create(model=MODEL_NAME, input=messages, max_output_tokens=max_tokens,
                                                         temperature=1.0, extra_body={"seed": seed})
                usage = (response.usage.input_tokens, response.usage.output_tokens)
            request_finished = time.perf_counter()
        finally:
            await client.close()
    finally:
        endpoint.close_session(session)
    return RolloutTiming(rollout_seconds=time.perf_counter() - started,
                         request_seconds=request_finished - request_started,
                         client_seconds=request_started - client_started,
                         prompt_tokens=usage[0], completion_tokens=usage[1])


async def run_raw_http(endpoint, http, messages: list[dict], seed: int, max_tokens: int) -> RolloutTiming:
    from molt.agents.base import SamplingParams

    started = time.perf_counter()
    session = endpoint.open_session(sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
                                    max_length=MAX_LENGTH)
    try:
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 1.0,
                "seed": seed}
        async with http.post(f"{session.base_url}/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {session.api_key}"}) as response:
            response.raise_for_status()
            completion = await response.json()
        finished = time.perf_counter()
    finally:
        endpoint.close_session(session)
    return RolloutTiming(rollout_seconds=finished - started, request_seconds=finished - started,
                         client_seconds=0.0, prompt_tokens=completion["usage"]["prompt_tokens"],
                         completion_tokens=completion["usage"]["completion_tokens"])


def build_paths(engine, endpoint, http) -> dict[str, Callable[[list[dict], int, int], Awaitable[RolloutTiming]]]:
    return {
        "direct": lambda messages, seed, max_tokens: run_direct(engine, messages, seed, max_tokens),
        "endpoint": lambda messages, seed, max_tokens: run_endpoint(endpoint, messages, seed, max_tokens),
        "endpoint_responses": lambda messages, seed, max_tokens: run_endpoint(
            endpoint, messages, seed, max_tokens, api="responses"),
        "endpoint_raw_http": lambda messages, seed, max_tokens: run_raw_http(
            endpoint, http, messages, seed, max_tokens),
    }


# -- rounds ---------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Round:
    seconds: float
    cpu_seconds: float  # CPU time of this process (event loop, SDK, endpoint, vLLM front end)
    rollouts: list[RolloutTiming]

    @property
    def rollouts_per_second(self) -> float:
        return len(self.rollouts) / self.seconds


async def run_round(path, workload: Workload, num_rollouts: int, concurrency: int) -> Round:
    """`num_rollouts` rollouts of `path`, at most `concurrency` in flight (a pool of workers)."""
    timings: list[RolloutTiming | None] = [None] * num_rollouts
    next_index = iter(range(num_rollouts))

    async def worker() -> None:
        for index in next_index:
            timings[index] = await path(workload.messages[index], workload.seeds[index], workload.max_tokens)

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_rollouts))))
    return Round(seconds=time.perf_counter() - started, cpu_seconds=time.process_time() - cpu_started,
                 rollouts=timings)


async def run_concurrent(paths, workload: Workload, args) -> dict[str, list[Round]]:
    """A warm-up round of each path, then `args.rounds` timed rounds ordered A B C, C B A, ..."""
    names = list(paths)
    for name in names:
        await run_round(paths[name], workload, min(args.rollouts, 2 * args.concurrency), args.concurrency)
    rounds: dict[str, list[Round]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            rounds[name].append(await run_round(paths[name], workload, args.rollouts, args.concurrency))
    return rounds


async def run_sequential(paths, workload: Workload, num_requests: int) -> dict[str, list[RolloutTiming]]:
    """Concurrency 1, paths interleaved request by request with the same prompt and seed."""
    timings: dict[str, list[RolloutTiming]] = {name: [] for name in paths}
    for index in range(num_requests):
        slot = index % len(workload.messages)
        for name, path in paths.items():
            timings[name].append(await path(workload.messages[slot], workload.seeds[slot], workload.max_tokens))
    return timings


# -- report ---------------------------------------------------------------------------------------

def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def p50_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 3)


def added_latency(latency: dict[str, float]) -> dict:
    """Each path's added p50 over direct (target 1 ms for the SDK paths)."""
    return {"added_ms": round(latency["endpoint"] - latency["direct"], 3),
            "responses_added_ms": round(latency["endpoint_responses"] - latency["direct"], 3),
            "diagnostic_added_ms": {name: round(value - latency["direct"], 3) for name, value in latency.items()
                                    if name not in ("direct", "endpoint", "endpoint_responses")}}


def report_concurrent(rounds: dict[str, list[Round]], args, max_tokens: int) -> None:
    rates = {name: statistics.median(r.rollouts_per_second for r in runs) for name, runs in rounds.items()}
    setting = {"rollouts": args.rollouts, "concurrency": args.concurrency, "max_tokens": max_tokens,
               "rounds": args.rounds}
    emit({"figure": "capture_rollouts_per_second", **{name: round(rate, 2) for name, rate in rates.items()},
          "ratio": round(rates["endpoint"] / rates["direct"], 3),
          "responses_ratio": round(rates["endpoint_responses"] / rates["direct"], 3), "target_ratio": 0.95,
          "diagnostic_ratios": {name: round(rate / rates["direct"], 3) for name, rate in rates.items()
                                if name not in ("direct", "endpoint", "endpoint_responses")},
          "all": {name: [round(r.rollouts_per_second, 2) for r in runs] for name, runs in rounds.items()},
          **setting})
    emit({"figure": "capture_generated_tokens", "max_tokens": max_tokens,
          "completion_tokens_per_round": {name: [sum(t.completion_tokens for t in r.rollouts) for r in runs]
                                          for name, runs in rounds.items()},
          "prompt_tokens_per_round": {name: [sum(t.prompt_tokens for t in r.rollouts) for r in runs]
                                      for name, runs in rounds.items()}})
    latency = {name: round(statistics.median(p50_ms([t.rollout_seconds for t in r.rollouts]) for r in runs), 3)
               for name, runs in rounds.items()}
    request = {name: round(statistics.median(p50_ms([t.request_seconds for t in r.rollouts]) for r in runs), 3)
               for name, runs in rounds.items()}
    emit({"figure": "capture_latency_p50_ms", **latency,
          **added_latency(latency), "target_added_ms": 1.0, "request_only": request, **setting})
    emit({"figure": "capture_front_process_cpu_ms_per_rollout",
          **{name: round(statistics.median(1000 * r.cpu_seconds / len(r.rollouts) for r in runs), 3)
             for name, runs in rounds.items()}, **setting})


def report_sequential(timings: dict[str, list[RolloutTiming]], max_tokens: int) -> None:
    """Added latency = p50 of the per-request differences to the direct run of the same prompt and
    seed right before it (paired, so the engine's own step-time noise mostly cancels)."""
    latency = {name: p50_ms([t.rollout_seconds for t in runs]) for name, runs in timings.items()}
    request = {name: p50_ms([t.request_seconds for t in runs]) for name, runs in timings.items()}
    added = {name: p50_ms([t.rollout_seconds - d.rollout_seconds for t, d in zip(runs, timings["direct"])])
             for name, runs in timings.items() if name != "direct"}
    emit({"figure": "capture_sequential_latency_p50_ms", "max_tokens": max_tokens, **latency,
          "added_ms": added["endpoint"], "responses_added_ms": added["endpoint_responses"], "target_added_ms": 1.0,
          "diagnostic_added_ms": {name: value for name, value in added.items()
                                  if name not in ("endpoint", "endpoint_responses")},
          "request_only": request,
          "completion_tokens": {name: sum(t.completion_tokens for t in runs) for name, runs in timings.items()},
          "requests": len(timings["direct"])})


def measure_client_construction(repeats: int = 20) -> dict:
    """p50 ms to build one AsyncOpenAI, before and after Molt shares the default TLS context."""
    from openai import AsyncOpenAI

    from molt.agents.tls import share_default_tls_context

    def p50_construction() -> float:
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused")
            seconds.append(time.perf_counter() - started)
        return p50_ms(seconds)

    sdk_default = p50_construction()
    share_default_tls_context()
    return {"figure": "capture_sdk_client_construction_ms", "sdk_default": sdk_default,
            "shared_tls_context": p50_construction()}


# -- main -----------------------------------------------------------------------------------------

async def measure_paths(engine, endpoint, args) -> None:
    """Every figure but the client construction's, on a running engine and its started endpoint
    (tests/test_bench_smoke.py calls this on the tests' shared engine, named MODEL_NAME too)."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        paths = build_paths(engine, endpoint, http)
        for max_tokens in args.max_tokens:
            workload = build_workload(args.rollouts, max_tokens, args.seed)
            report_concurrent(await run_concurrent(paths, workload, args), args, max_tokens)
            report_sequential(await run_sequential(paths, workload, args.sequential_requests), max_tokens)


async def run_benchmark(args, model_dir: Path) -> None:
    from molt.config import MoltConfig
    from molt.endpoint.server import SessionEndpoint
    from molt.rollout.engine import RolloutEngine

    emit(measure_client_construction())  # also installs the shared context, as rollout ranks do
    cfg = MoltConfig()
    cfg.model.path = str(model_dir)
    cfg.rollout.max_length = MAX_LENGTH
    cfg.rollout.kv_cache_gigabytes = 0.25  # ~262k tokens of the tiny model, whatever the machine
    engine = RolloutEngine.start(cfg, seed=0)
    endpoint = SessionEndpoint(engine, engine.tokenizer, model_name=MODEL_NAME)
    try:
        await endpoint.start()
        await measure_paths(engine, endpoint, args)
    finally:
        await endpoint.stop()
        engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts per timed round and path")
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts in flight at once")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[16, 128],
                        help="max_tokens of each request; one set of figures per value")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per path (after one warm-up)")
    parser.add_argument("--sequential-requests", type=int, default=48,
                        help="requests per path at concurrency 1")
    parser.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = parse_with_smoke(build_parser(), SMOKE_DEFAULTS, argv)
    if min(args.rollouts, args.concurrency, *args.max_tokens, args.rounds, args.sequential_requests) < 1:
        raise SystemExit("--rollouts, --concurrency, --max-tokens, --rounds and --sequential-requests "
                         "must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the JSON lines readable
    fixtures = load_test_fixtures()
    model_dir = fixtures.build_cached_tiny_model()
    asyncio.run(run_benchmark(args, model_dir))
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
