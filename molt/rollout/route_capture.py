"""Route capture on a rollout rank: the top-k expert ids the engine routed each token to, at each
MoE layer, per request (molt.trace.routes holds the representation: [tokens, layers, top_k] int16, -1 =
unknown).

Two paths fill the same tensor:

- CPU (where vLLM's own capture needs its Triton-only V2 model runner): `RouteCapture`, mixed into
  the engine's worker extension, gives each MoE layer's router the capture callback vLLM's native
  capture uses (`bind_routed_experts_capturer`: the router hands it the logical expert ids it
  selected, before any expert-parallel remapping), so a recorded route is the one the experts ran.
  A wrapper around the model runner's `execute_model` tells the callbacks where each request's
  tokens sit in the step's flattened batch (request order, tokens scheduled, first position = tokens
  computed before the step); each request keeps its rows of every step by absolute position, put
  together when the engine takes them (`molt_take_routes`, batched by `RouteTaker`). Positions a
  request was served from the prefix cache were computed by an earlier request: the worker also
  keeps the routes of every KV-cache block it computed (`BlockRoutes`) and fills them from there,
  -1 where it has none.
- GPU: vLLM's `enable_return_routed_experts` returns them on the finished completion
  (`native_routes`; never run on a GPU).

Both sort each (token, layer)'s ids ascending: vLLM's CPU router takes its top-k unsorted, so the
order carries no meaning, and a canonical one lets routes be compared element by element.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from molt.config import ConfigError
from molt.models.moe import EXPERT_COUNT_FIELDS, count_experts
from molt.trace.routes import UNKNOWN, decode_routes, encode_routes, pad_routes, unknown_routes

logger = logging.getLogger("molt")

# How long a worker keeps the routes of a finished request nobody took (an aborted stream, a score
# request), so that they cannot pile up.
UNTAKEN_ROUTES_SECONDS = 120.0
# vLLM makes request ids unique by appending '-' and 8 hex digits to the one the caller gave.
_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


@functools.lru_cache(maxsize=4096)  # called for every running request at every step
def external_request_id(internal_id: str) -> str:
    """The id the caller gave AsyncLLM, from the engine core's (which adds a random suffix unless
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set)."""
    return _INTERNAL_SUFFIX.sub("", internal_id)


# -- which engines capture ------------------------------------------------------------------------

def resolve_capture_routes(setting: bool | None, model_path: str) -> bool:
    """rollout.capture_routes made definite: None = on for MoE models, off for dense ones; True on a
    dense model is refused (there are no routes to capture)."""
    from transformers import AutoConfig

    if setting is False:
        return False
    is_moe = count_experts(AutoConfig.from_pretrained(model_path)) > 0
    if setting and not is_moe:
        raise ConfigError(f"rollout.capture_routes=True, but model.path={model_path!r} is a dense model (its config "
                          f"has none of {', '.join(EXPERT_COUNT_FIELDS)}): it routes no tokens to experts; "
                          f"leave rollout.capture_routes unset or set it False")
    return is_moe


def route_capture_path(cfg, *, on_cpu: bool) -> str | None:
    """How an engine records routes: None (it does not), 'workers' (RouteCapture, CPU) or 'native'
    (vLLM's own, GPU). The worker callbacks run only in an eager model: a compiled one (vLLM's
    CPU compilation, rollout.enforce_eager=False) would skip them and record nothing."""
    if not resolve_capture_routes(cfg.rollout.capture_routes, cfg.model.path):
        return None
    if not on_cpu:
        return "native"
    if cfg.rollout.enforce_eager is False:
        raise ConfigError("rollout.enforce_eager=False on a CPU engine compiles the model, and a compiled MoE layer "
                          "skips the callbacks that record routes (rollout.capture_routes, on for MoE models): set "
                          "rollout.enforce_eager=True, or rollout.capture_routes=False to run without routes")
    return "workers"


# -- worker side (CPU engines) --------------------------------------------------------------------

@dataclass
class StepLayout:
    """Where each request's tokens sit in one engine step's flattened batch, in batch order."""

    request_ids: list[str]  # [requests] the caller's ids (external_request_id)
    starts: list[int]  # [requests] absolute position of each request's first token in this step
    counts: list[int]  # [requests] tokens this step computes for each request
    # The attention group's KV-cache blocks, None where routes are not kept by block: each request's
    # row of the block table (position p's block is block_table[request, p // block size]), and the
    # slot (block id * block size + offset in the block) the step writes each token's KV to.
    block_table: np.ndarray | None = None  # [requests, blocks per request]
    slots: torch.Tensor | None = None  # [step tokens]


class BlockRoutes:
    """The routes of every KV-cache block this worker computed, by physical block id. A request
    served part of its prompt from vLLM's prefix cache never computes those positions; the request
    that computed the blocks did, and the blocks' routes are what it recorded. A block's rows are
    overwritten whenever its content is computed again (vLLM reuses freed block ids; after a refit
    the cache is reset and blocks are recomputed under the new weights), and vLLM shares only full
    blocks, every row of which the request that filled them wrote.

    Memory: block_size * layers * top_k * 2 bytes per block id up to the highest one computed, so at
    most the KV cache's block count (1 KiB a block on the tiny MoE; 96 KiB on Qwen3-30B-A3B's
    128-token blocks of 48 layers and top 8, under 1 % of the block's own KV cache)."""

    def __init__(self, block_size: int, num_layers: int, top_k: int):
        self.block_size = block_size
        self.rows = unknown_routes(0, num_layers, top_k)  # [block ids held * block_size, layers, top_k] by slot

    def write(self, slots: torch.Tensor, routes: torch.Tensor) -> None:
        """Store `routes` [tokens, layers, top_k], computed into KV-cache `slots` [tokens]."""
        if not len(slots):
            return
        needed = int(slots.max()) + 1
        if needed > len(self.rows):  # grown by doubling: block ids are handed out low first
            size = max(needed, 2 * len(self.rows))
            size = -(-size // self.block_size) * self.block_size
            grown = unknown_routes(size, self.rows.shape[1], self.rows.shape[2])
            grown[:len(self.rows)] = self.rows
            self.rows = grown
        self.rows[slots] = routes

    def read(self, block_ids: np.ndarray, num_positions: int) -> torch.Tensor:
        """[num_positions, layers, top_k] the routes of a request's first positions, held in blocks
        `block_ids` (its block table row); -1 in blocks never computed here."""
        positions = np.arange(num_positions)
        slots = torch.from_numpy(block_ids[positions // self.block_size].astype(np.int64) * self.block_size
                                 + positions % self.block_size)
        routes = unknown_routes(num_positions, self.rows.shape[1], self.rows.shape[2])
        held = slots < len(self.rows)
        routes[held] = self.rows[slots[held]]
        return routes


class RequestRoutes:
    """One request's routes: the rows of each step that computed some of its tokens, assembled only
    when taken (a decode step adds one row to every running request, and per-request tensor work
    in every step would cost more than the capture itself)."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.chunks: list[tuple[int, torch.Tensor]] = []  # (first position, [tokens, layers, top_k] rows)
        self.length = 0  # positions up to the last one recorded
        self.in_order = True  # each chunk starts where the one before ended (no recompute)

    def record(self, start: int, rows: torch.Tensor) -> None:
        self.in_order = self.in_order and (not self.chunks or start == self.length)
        self.chunks.append((start, rows))
        self.length = max(self.length, start + rows.shape[0])

    def take(self) -> torch.Tensor:
        """[length, layers, top_k]. A position computed twice (a recompute after a preemption, or
        after a refit that cleared the cache) keeps its first route (molt.trace.routes): the chunks are
        then written latest first, so earlier ones overwrite them where they know the position (a
        row is known at every MoE layer and unknown at every dense one, or unknown throughout where a
        prefix-cache hit found no block routes)."""
        if self.in_order:  # the common case: one concatenation after the positions never computed
            first = self.chunks[0][0] if self.chunks else 0
            return torch.cat([unknown_routes(first, self.num_layers, self.top_k)] + [rows for _, rows in self.chunks])
        routes = unknown_routes(self.length, self.num_layers, self.top_k)
        for start, rows in reversed(self.chunks):
            known = (rows[:, :, 0] != UNKNOWN).any(dim=1)[:, None, None]  # [rows, 1, 1]
            routes[start:start + len(rows)] = torch.where(known, rows, routes[start:start + len(rows)])
        return routes


class RouteRecorder:
    """Collects the routes of each engine step and files them per request."""

    def __init__(self, num_layers: int, top_k: int, read_layout: Callable[[dict[str, int]], StepLayout],
                 blocks: BlockRoutes | None = None):
        self.num_layers, self.top_k = num_layers, top_k
        self.blocks = blocks  # None: positions served from the prefix cache stay unknown
        # The step's layout from its tokens scheduled per request, read when its first route arrives:
        # by then the model runner has brought its batch up to date for the step.
        self.read_layout = read_layout
        self.scheduled: dict[str, int] = {}  # the step's tokens per request (engine core ids)
        self.requests: dict[str, RequestRoutes] = {}
        self.finished: OrderedDict[str, float] = OrderedDict()  # requests the engine finished -> when
        self.in_step = False
        self.layout: StepLayout | None = None
        self.step_routes: torch.Tensor | None = None  # [step tokens, layers, top_k]

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """A router's callback: topk_ids [batch tokens (maybe padded), top_k] of MoE layer `layer`.
        Forwards outside an engine step (profiling, warm-up) are ignored."""
        if not self.in_step:
            return
        if self.step_routes is None:
            self.layout = self.read_layout(self.scheduled)
            self.step_routes = unknown_routes(sum(self.layout.counts), self.num_layers, self.top_k)
        num_tokens = len(self.step_routes)
        self.step_routes[:, layer] = topk_ids[:num_tokens]  # (cast to int16 on assignment; sorted in end_step)

    def begin_step(self, scheduled: dict[str, int], finished_ids) -> None:
        """Before an engine step; `finished_ids`: the requests the engine finished since the last one."""
        self.in_step, self.scheduled, self.layout, self.step_routes = True, scheduled, None, None
        now = time.monotonic()
        for internal_id in finished_ids:
            request_id = external_request_id(internal_id)
            if request_id in self.requests:
                self.finished[request_id] = now
        while self.finished and now - next(iter(self.finished.values())) > UNTAKEN_ROUTES_SECONDS:
            self.requests.pop(self.finished.popitem(last=False)[0], None)

    def end_step(self) -> None:
        """File the step's routes under their requests."""
        self.in_step = False
        if self.step_routes is None:
            return
        layout, step_routes = self.layout, self.step_routes.sort(dim=-1).values
        by_block = self.blocks is not None and layout.block_table is not None
        if by_block:  # first: vLLM caches a block when it schedules its computation, so a request of
            # the same step may already be served it
            self.blocks.write(layout.slots, step_routes)
        for index, (request_id, start, rows) in enumerate(zip(layout.request_ids, layout.starts,
                                                              step_routes.split(layout.counts))):
            routes = self.requests.get(request_id)
            if routes is None:
                routes = self.requests[request_id] = RequestRoutes(self.num_layers, self.top_k)
                if start and by_block:  # first scheduled past a prefix-cache hit
                    routes.record(0, self.blocks.read(layout.block_table[index], start))
            routes.record(start, rows)
        self.layout = self.step_routes = None

    def take(self, request_ids: list[str]) -> dict[str, dict]:
        """The routes of `request_ids` (msgpack form, molt.trace.routes.encode_routes), forgotten here."""
        taken = {}
        for request_id in request_ids:
            routes = self.requests.pop(request_id, None)
            self.finished.pop(request_id, None)
            if routes is not None:
                taken[request_id] = encode_routes(routes.take())
        return taken


class RouteCapture:
    """Mixed into vLLM's worker class (through Molt's worker extension); `self.model_runner` is the
    worker's. With tensor parallelism every worker routes alike, so only tensor-parallel rank 0
    records."""

    def molt_enable_route_capture(self) -> bool:
        """Bind the capture callbacks and wrap the model runner; True where this worker records."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        if getattr(self, "_molt_routes", None) is not None or get_tensor_model_parallel_rank() != 0:
            return getattr(self, "_molt_routes", None) is not None
        runner = self.model_runner
        model_config = runner.model_config
        num_layers, top_k = model_config.get_total_num_hidden_layers(), model_config.get_num_experts_per_tok()
        group = find_route_block_group(runner)
        blocks = None if group is None else BlockRoutes(group[1], num_layers, top_k)
        recorder = RouteRecorder(num_layers, top_k, lambda scheduled: read_step_layout(runner, scheduled, group),
                                 blocks)
        bind_routed_experts_capturer(runner.get_model(), recorder)
        execute_model = runner.execute_model

        def execute_model_recording(scheduler_output, *args, **kwargs):
            recorder.begin_step(scheduler_output.num_scheduled_tokens, scheduler_output.finished_req_ids)
            try:
                return execute_model(scheduler_output, *args, **kwargs)
            finally:
                recorder.end_step()

        runner.execute_model = execute_model_recording
        self._molt_routes = recorder
        return True

    def molt_take_routes(self, request_ids: list[str]) -> dict[str, dict]:
        """Hand back the routes recorded for `request_ids` (the caller's ids) and forget them; a
        request with nothing recorded is left out. Empty on workers that do not record."""
        recorder = getattr(self, "_molt_routes", None)
        return {} if recorder is None else recorder.take(request_ids)

    def molt_num_held_routes(self) -> int:
        """Requests whose routes this worker holds (running, or finished and not yet taken)."""
        recorder = getattr(self, "_molt_routes", None)
        return 0 if recorder is None else len(recorder.requests)


def read_step_layout(runner, scheduled: dict[str, int], group: tuple[int, int] | None) -> StepLayout:
    """The layout of the step the model runner is executing: its persistent batch's request order
    (the order of the flattened input tokens), tokens computed before the step and, with `group`
    (find_route_block_group), the group's block table and slot mapping, as the runner prepared them
    for the step. Views, not copies: the runner changes neither before the step's end."""
    batch = runner.input_batch
    internal_ids = batch.req_ids[:batch.num_reqs]
    counts = [scheduled[request] for request in internal_ids]
    layout = StepLayout(request_ids=[external_request_id(request) for request in internal_ids],
                        starts=batch.num_computed_tokens_cpu[:batch.num_reqs].tolist(), counts=counts)
    if group is not None:
        table = batch.block_table[group[0]]
        layout.block_table = table.get_numpy_array()[:batch.num_reqs]
        layout.slots = table.slot_mapping.cpu[:sum(counts)]
    return layout


def find_route_block_group(runner) -> tuple[int, int] | None:
    """(index among the input batch's block tables, block size) of the KV-cache group whose blocks
    key the routes of prefix-cache hits: the first full-attention group, which keeps a block for
    every position (a sliding-window or Mamba group drops or reuses them). None, so that hits stay
    unknown, where there is none, where positions map to blocks through context parallelism, or
    where a KV connector may fill blocks no forward computed (their routes would be stale)."""
    from vllm.v1.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind

    if runner.vllm_config.kv_transfer_config is not None:
        logger.warning("route capture: a KV connector may load blocks this engine never computed; positions "
                       "served from the prefix cache will have no routes")
        return None
    index = 0
    for group in runner.kv_cache_config.kv_cache_groups:
        kind = get_kv_cache_spec_kind(group.kv_cache_spec)
        if kind == KVCacheSpecKind.ENCODER_ONLY_ATTENTION:
            continue  # the input batch keeps no block table for it
        if kind in (KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.MLA_ATTENTION):
            table = runner.input_batch.block_table[index]
            if table.dcp_world_size * table.pcp_world_size == 1 and table.block_size == group.kv_cache_spec.block_size:
                return index, table.block_size
            break
        index += 1
    logger.warning("route capture: no full-attention KV-cache group to key blocks by (%s); positions served "
                   "from the prefix cache will have no routes", runner.kv_cache_config.kv_cache_groups)
    return None


# -- engine side ----------------------------------------------------------------------------------

class RouteTaker:
    """Takes finished requests' routes from the engine's workers, one `collective_rpc` for all the
    requests that finish while the previous call is under way (a call waits for the engine step in
    progress, so requests finishing together share one)."""

    def __init__(self, llm):
        self.llm = llm
        self.waiting: dict[str, asyncio.Future] = {}
        self.draining: asyncio.Task | None = None
        self.num_calls = 0  # collective_rpc calls made, for the cost check

    async def take(self, request_id: str) -> torch.Tensor | None:
        """The routes the workers recorded for `request_id` ([positions recorded, layers, top_k]),
        or None where none were."""
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        if self.draining is None or self.draining.done():
            self.draining = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self.waiting:
            batch, self.waiting = self.waiting, {}
            self.num_calls += 1
            try:
                replies = await self.llm.collective_rpc("molt_take_routes", args=(list(batch),))
            except Exception as error:
                for future in batch.values():
                    if not future.done():
                        future.set_exception(error)
                continue
            routes = replies[0]  # tensor-parallel rank 0 records (RouteCapture)
            for request_id, future in batch.items():
                if not future.done():
                    future.set_result(decode_routes(routes.get(request_id)))


def native_routes(completion, num_tokens: int, dense_layers: list[int] = ()) -> torch.Tensor | None:
    """GPU path (never run on a GPU): vLLM's routed experts of a finished completion
    (`CompletionOutput.routed_experts`, numpy [prompt + response tokens - 1, layers, top_k], the
    last sampled token not run), as the CPU path's tensor: sorted ids, padded to num_tokens, and
    unknown (-1) at the `dense_layers` (`dense_layer_indices`)."""
    if completion.routed_experts is None:
        return None
    routes = torch.from_numpy(completion.routed_experts.astype("int16")).sort(dim=-1).values
    if dense_layers:
        # vLLM's capturer has a row for every decoder layer (get_total_num_hidden_layers) in a buffer
        # that starts at zero (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py,
        # RoutedExpertsCapturer.__init__: torch.zeros); only MoE layers write theirs, so a dense
        # layer would read as "expert 0" instead of Molt's unknown.
        routes[:, list(dense_layers)] = UNKNOWN
    return pad_routes(routes, num_tokens)


def dense_layer_indices(hf_config) -> list[int]:
    """The decoder layers of a MoE model that have no router, by the rule vLLM's model builds them
    with: Qwen2/Qwen3-MoE (vllm/model_executor/models/qwen3_moe.py: a layer in `mlp_only_layers`,
    or not every `decoder_sparse_step`-th), DeepSeek-V2/V3 and Kimi-K2 (deepseek_v2.py: the first
    `first_k_dense_replace`, and those off `moe_layer_freq`); every layer routes otherwise (Mixtral)."""
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = range(config.num_hidden_layers)
    if hasattr(config, "first_k_dense_replace"):
        frequency = getattr(config, "moe_layer_freq", 1) or 1
        return [i for i in layers if i < config.first_k_dense_replace or i % frequency]
    if hasattr(config, "decoder_sparse_step") or hasattr(config, "mlp_only_layers"):
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return [i for i in layers if i in dense or (i + 1) % step]
    return []


def count_unknown(routes: torch.Tensor | None, num_positions: int) -> int:
    """Positions among the first `num_positions` with no recorded route (all of them without routes)."""
    if routes is None:
        return num_positions
    return int((routes[:num_positions, :, 0] == UNKNOWN).all(dim=-1).sum())
