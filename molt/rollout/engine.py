"""The vLLM engine on a rollout rank: generation with token ids and log-probs, pause/resume, refit hooks."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
import logging
import math
import os


from molt.agents.base import SamplingParams
from molt.config import ConfigError, MoltConfig, resolve_enforce_eager
from molt.config.engine_args import engine_args_errors
from molt.distributed.devices import trainer_device_type
from molt.refit.backends import build_engine_sync, resolve_backend
from molt.refit.weight_sync import EngineWeightSync, RefitCancelled
from molt.rollout.route_capture import RouteTaker, count_unknown, dense_layer_indices, native_routes, route_capture_path
from molt.trace.generation import Generation, GenerationDelta
from molt.trace.images import ImageInputs, collapse_placeholders, count_stray_placeholders, image_digest, open_image
from molt.trace.routes import pad_routes

logger = logging.getLogger("molt")
ENGINE_SHUTDOWN_SECONDS = 30.0  # longest wait for the engine core to exit before it is killed
GIB = 2**30
SLEEP_LEVEL = 1  # vLLM sleep level while the trainer steps: weights offloaded to host memory, KV cache freed



class EngineStartError(RuntimeError):
    """The engine could not be built from the configured model."""


class RolloutEngine:
    """One vLLM AsyncLLM (engine core in its own process) plus Molt's weight version."""

    def __init__(self, llm, tokenizer, *, seed: int = 0, weight_sync: EngineWeightSync | None = None,
                 route_capture: str | None = None, image_token_id: int | None = None):
        self.llm = llm
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id  # the placeholder a chat template renders per image; None: no images
        self.seed = seed
        self.weight_sync = weight_sync or build_engine_sync("gloo")  # the engine half of refit (molt.refit.weight_sync)
        self.policy_version = 0
        # True while the workers hold weights the engine core does not label yet (a load completed but
        # its version label failed): such an engine must not serve, or new weights would pass as old.
        self.unlabelled_weights = False
        self._request_ids = itertools.count()
        # (policy version, prompt ids) -> generations of that prompt so far under that version; see _sampling_seed.
        self._prompt_counts: dict[tuple[int, int], int] = {}
        # Running totals over `stream` requests: prompt tokens submitted, and those the engine computed
        # (the rest were vLLM prefix-cache hits). Rollout ranks report them as rank metrics.
        self.prompt_tokens = 0
        self.prefill_tokens = 0
        # MoE routes (molt.rollout.route_capture): None = not recorded, 'workers' = recorded by the workers
        # (CPU), 'native' = returned by vLLM itself (GPU).
        self.route_capture = route_capture
        self._route_taker = RouteTaker(llm) if route_capture == "workers" else None
        self._route_capture_enabled: asyncio.Future | None = None
        # Running total over `stream` requests of prompt positions without a recorded route (~0: a
        # prefix-cache hit gets its blocks' routes; only blocks the workers never computed count).
        self.unrouted_tokens = 0
        self._dense_layer_list: list[int] | None = None  # see _dense_layers
        self.asleep = False  # vLLM sleep mode (rollout.sleep_while_training): see sleep / wake_up
        self._sleep_lock = asyncio.Lock()

    @classmethod
    def start(cls, cfg: MoltConfig, *, seed: int) -> RolloutEngine:
        """Build the engine; raises EngineStartError saying what failed and which field to change."""
        from transformers import AutoTokenizer
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        backend = resolve_backend(cfg.refit.backend, trainer_device_type(cfg.device), colocate=cfg.layout.colocate)
        route_capture = route_capture_path(cfg, on_cpu=current_platform.is_cpu())
        args = build_engine_args(cfg, seed=seed, backend=backend, native_routes=route_capture == "native")
        vllm_config = None
        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            vllm_config = args.create_engine_config()
            llm = AsyncLLM.from_vllm_config(vllm_config, enable_log_requests=args.enable_log_requests,
                                            disable_log_stats=args.disable_log_stats)
        except Exception as error:
            raise EngineStartError(describe_start_failure(cfg, vllm_config, error)) from error
        return cls(llm, tokenizer, seed=seed, weight_sync=build_engine_sync(backend), route_capture=route_capture,
                   image_token_id=getattr(vllm_config.model_config.hf_config, "image_token_id", None))

    async def generate(self, token_ids: list[int], sampling: SamplingParams,
                       images: ImageInputs | None = None) -> Generation:
        """The whole generation at once (one engine output, not one per step)."""
        sampled, logprobs, versions, finish_reason, routes = [], [], [], None, None
        async for delta in self.stream(token_ids, sampling, incremental=False, images=images):
            sampled += delta.token_ids
            logprobs += delta.logprobs
            versions = delta.policy_versions or versions
            finish_reason = delta.finish_reason or finish_reason
            routes = delta.routed_experts if delta.routed_experts is not None else routes
        return Generation(token_ids=sampled, logprobs=logprobs, policy_versions=versions,
                          finish_reason=finish_reason or "abort", routed_experts=routes)

    async def stream(self, token_ids: list[int], sampling: SamplingParams, *, stop: list[str] | None = None,
                     seed: int | None = None, incremental: bool = True,
                     top_logprobs: int | None = None, constraint: dict | None = None,
                     images: ImageInputs | None = None) -> AsyncIterator[GenerationDelta]:
        """Generate, yielding what each engine step added (`incremental`), or everything as one
        delta at the end, which spares the per-step outputs when no one reads them as they come.
        Closing the iterator early (e.g. the HTTP client went away) aborts the engine request.

        Per-token versions come from the engine core itself: it labels the output of every engine
        step with the weight version in force (`update_weight_version`, which Molt sets only while
        generation is paused, after loading the weights), and vLLM hands back those labels as spans
        over the output tokens when the request finishes. A token sampled before a refit therefore
        keeps the old version however late its delta is read here; a request retained across a
        partial-rollout refit has the old version up to the swap and the new one after it.

        Without `seed`, the request gets one derived from its prompt (see _sampling_seed), so what
        it samples does not depend on how vLLM happens to batch it with others. `top_logprobs`
        (k) adds each token's k most likely alternatives to the deltas. `constraint`: the keyword
        arguments of vLLM's StructuredOutputsParams (guided decoding; molt.endpoint.constraints);
        the log-probs are then those of the constrained distribution the tokens were sampled from.
        With route capture on (molt.rollout.route_capture), the last delta carries the routed experts of
        the prompt and the response. `images`: the prompt's images, whose expanded placeholder runs
        `token_ids` hold (molt.trace.images.ImageEncoder); vLLM gets each run as its one placeholder token
        and the files, expands them itself, and its expansion must equal `token_ids`."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        version = self.policy_version  # used only if vLLM reports no version span
        await self._enable_route_capture()
        request_id = f"molt-stream-{next(self._request_ids)}"
        params = VllmSamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, logprobs=top_logprobs or 0, stop=stop,
                                    seed=self._request_seed(token_ids, sampling, seed, images),
                                    output_kind=RequestOutputKind.DELTA if incremental else RequestOutputKind.FINAL_ONLY,
                                    structured_outputs=StructuredOutputsParams(**constraint) if constraint else None)
        num_sampled = 0
        prompt = self._prompt(token_ids, images)
        async for output in self.llm.generate(prompt, params, request_id=request_id):
            completion = output.outputs[0]
            if images and not num_sampled:
                self._check_expansion(output.prompt_token_ids, token_ids)
            sampled = list(completion.token_ids)
            if not num_sampled:  # the request's first output (vLLM sends none without tokens until the last)
                self.prompt_tokens += len(token_ids)
                self.prefill_tokens += len(token_ids) - (output.num_cached_tokens or 0)
            num_sampled += len(sampled)
            steps = completion.logprobs or []
            yield GenerationDelta(
                token_ids=sampled, logprobs=[float(step[token].logprob) for token, step in zip(sampled, steps)],
                text=completion.text, finish_reason=completion.finish_reason if output.finished else None,
                policy_versions=(token_versions(completion.weight_versions, num_sampled, version)
                                 if output.finished else None),
                stop_reason=completion.stop_reason if output.finished else None,
                top_logprobs=[top_alternatives(step, top_logprobs) for step in steps] if top_logprobs else None,
                routed_experts=(await self._take_routes(request_id, completion, len(token_ids), num_sampled)
                                if output.finished else None))

    def _prompt(self, token_ids: list[int], images: ImageInputs | None):
        from vllm.inputs import TokensPrompt

        if not images or not images.num_images:
            return TokensPrompt(prompt_token_ids=list(token_ids))
        if self.image_token_id is None:
            raise ValueError(f"the engine's model ({type(self.tokenizer).__name__} tokenizer) has no image_token_id "
                             f"in its config: it takes no images")
        stray = count_stray_placeholders(list(token_ids), images, self.image_token_id)
        if stray:
            raise ValueError(f"the prompt holds {stray} image placeholder token(s) outside its images (the policy "
                             f"sampled token {self.image_token_id} in an earlier turn): vLLM would take each for an "
                             f"image; the rollout cannot go on")
        return TokensPrompt(prompt_token_ids=collapse_placeholders(list(token_ids), images, self.image_token_id),
                            multi_modal_data={"image": [open_image(blob) for blob in images.encoded]})

    @staticmethod
    def _check_expansion(engine_ids, token_ids: list[int]) -> None:
        """vLLM's expansion of the image placeholders must be the processor's, or the trainer would
        train on other ids than the engine ran."""
        if engine_ids is not None and list(engine_ids) != list(token_ids):
            first = next((i for i, (a, b) in enumerate(zip(engine_ids, token_ids)) if a != b),
                         min(len(engine_ids), len(token_ids)))
            raise RuntimeError(f"vLLM expanded the prompt's images into {len(engine_ids)} ids, the model's processor "
                               f"into {len(token_ids)}; they first differ at position {first}: the engine and the "
                               f"processor of model.path disagree on how to show the images")

    async def _enable_route_capture(self) -> None:
        """Have the workers record routes (once, before the first request that needs them)."""
        if self.route_capture != "workers":
            return
        if self._route_capture_enabled is None:
            self._route_capture_enabled = asyncio.ensure_future(self.llm.collective_rpc("molt_enable_route_capture"))
        await self._route_capture_enabled

    def _dense_layers(self) -> list[int]:
        """The model's decoder layers without a router (native capture leaves them at 0, not -1)."""
        if self._dense_layer_list is None:
            self._dense_layer_list = dense_layer_indices(self.llm.model_config.hf_config)
        return self._dense_layer_list

    async def _take_routes(self, request_id: str, completion, num_prompt: int, num_sampled: int):
        """[prompt + response tokens, layers, top_k] routes of a finished request (None when not
        recorded), and the prompt positions without one added to unrouted_tokens."""
        if self.route_capture is None:
            return None
        num_tokens = num_prompt + num_sampled
        if self.route_capture == "native":
            routes = native_routes(completion, num_tokens, self._dense_layers())
        else:
            recorded = await self._route_taker.take(request_id)
            routes = None if recorded is None else pad_routes(recorded, num_tokens)
            if recorded is None and num_sampled:  # it sampled, so its prompt's last token ran
                logger.warning("the engine's workers recorded no routes for %s (%d tokens)", request_id, num_tokens)
        self.unrouted_tokens += count_unknown(routes, num_prompt)
        return routes

    def _request_seed(self, token_ids: list[int], sampling: SamplingParams, seed: int | None,
                      images: ImageInputs | None = None) -> int:
        """`seed` when given; else the rollout's seed (`sampling.seed`, eval rollouts) mixed with the
        prompt ids, so each turn of it samples anew; else one derived from the prompt (_sampling_seed).
        A rollout seed leaves _sampling_seed's counts alone: eval requests do not move training's seeds.
        Images count as part of the prompt (two images of one size expand to the same ids)."""
        if seed is not None:
            return seed
        if images:
            token_ids = [*token_ids, *(int(image_digest(blob), 16) & (2**62 - 1) for blob in images.encoded)]
        if sampling.seed is not None:
            return rollout_request_seed(sampling.seed, token_ids)
        return self._sampling_seed(token_ids)

    def _sampling_seed(self, token_ids: list[int]) -> int:
        """A sampling seed from the policy version, the prompt ids and how many generations of that
        prompt this version already ran. vLLM then samples each request from its own generator, so a
        run with fixed seeds samples the same tokens whatever batches its requests share (the global
        generator would hand each request different random numbers in every batching). Only the
        order in which identical prompts arrive matters (a group's rollouts: dispatch order)."""
        key = (self.policy_version, hash(tuple(token_ids)))
        occurrence = self._prompt_counts.get(key, 0)
        self._prompt_counts[key] = occurrence + 1
        return hash((self.seed, *key, occurrence)) & (2**63 - 1)

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token given its prefix at temperature 1 (first entry 0): the refit check."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        params = VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        final = None
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                              request_id=f"molt-score-{next(self._request_ids)}"):
            final = output
        return [0.0] + [float(step[token].logprob) for token, step in zip(token_ids[1:], final.prompt_logprobs[1:])]

    async def join_refit_group(self, **group) -> None:
        """Join the refit group a 'join_refit' message describes (molt.refit.weight_sync)."""
        await self.weight_sync.join(self.llm, group)

    async def receive_weights(self, version: int) -> None:
        """Receive one refit broadcast and load it; generation must be paused by the caller. The
        engine core labels what it samples from here on with `version` (see `stream`)."""
        await self.weight_sync.receive(self.llm, version)
        # Image features the vision tower computed under the old weights must not be reused. vLLM's
        # reload clears the workers' encoder cache but not the scheduler's record of it, and the next
        # request with a cached image then dies ("Encoder cache miss"): reset both, whatever the backend.
        await self.llm.reset_encoder_cache()
        self.unlabelled_weights = True
        await self.llm.update_weight_version(str(version))
        self.unlabelled_weights = False
        self.policy_version = version
        self._prompt_counts.clear()  # its keys carry the version: older ones can never match again

    async def swap_weights(self, version: int, *, partial_rollout: bool,
                           on_paused: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Pause generation, get the workers ready, then `on_paused` tells the controller and waits
        for its decision: True ('refit_go', sent once every engine has paused) receives one refit
        broadcast and resumes; False ('refit_cancel': some engine missed the pause) tears the refit
        group down at once without loading, resumes on the old weights under their old version label
        and raises RefitCancelled. Requests submitted meanwhile wait in the engine's queue; none is
        aborted.

        partial_rollout=False ('wait'): requests in flight first finish under the old weights, so
        no generation call spans two versions. partial_rollout=True ('keep'): they are frozen where
        they are and continue from their generated prefixes under the new weights. The cache is
        cleared in both modes: a retained request's KV cache was computed by the old weights, so
        it re-computes its prompt and prefix under the new ones, and every token sampled after the
        swap is a sample of the new policy given that prefix (its log-prob, too).

        A failure after some new weights reached the model leaves the engine paused: it holds a mix
        of old and new weights and serves nothing until a later refit succeeds (RELIABILITY 29). So
        does one after all of them did but before the engine core took their version label."""
        await self.llm.pause_generation(mode="keep" if partial_rollout else "wait", clear_cache=True)
        intact = True
        try:
            await self.weight_sync.prepare(self.llm, version)
            go = await on_paused() if on_paused is not None else True
            if not go:
                await self.weight_sync.abandon(self.llm)
                raise RefitCancelled(f"refit v{version} cancelled by the trainer (an engine missed the pause); "
                                     f"nothing was loaded, serving version {self.policy_version}")
            await self.receive_weights(version)
        except RefitCancelled:
            raise
        except BaseException:
            intact = await self._recover_weight_sync()
            raise
        finally:
            if intact:
                await self.llm.resume_generation()
            else:
                logger.error("refit v%d failed after part of its weights were loaded: the engine stays paused "
                             "until a refit succeeds", version)

    async def _recover_weight_sync(self) -> bool:
        try:
            return await self.weight_sync.recover(self.llm) and not self.unlabelled_weights
        except Exception:
            logger.exception("could not recover the engine's weight sync after a failed refit")
            return False

    async def sleep(self, level: int = SLEEP_LEVEL) -> None:
        """Free the engine's GPU memory while the trainer steps (rollout.sleep_while_training; GPU only).
        vLLM's AsyncLLM.sleep pauses the scheduler first; mode 'wait' lets requests in flight finish
        (the default 'abort' would drop them) and queues new ones until `wake_up`. Level 1 moves the
        weights to host memory and drops the KV cache, so a refit that fails still finds the old
        weights (level 2 drops them too). A no-op when asleep already."""
        async with self._sleep_lock:
            if self.asleep:
                return
            await self.llm.sleep(level=level, mode="wait")
            self.asleep = True

    async def wake_up(self) -> None:
        """Bring weights and KV cache back and resume scheduling (AsyncLLM.wake_up with no tags wakes
        everything, then the engine core resumes its scheduler); a no-op when awake."""
        async with self._sleep_lock:
            if not self.asleep:
                return
            await self.llm.wake_up()
            self.asleep = False

    async def leave_refit_group(self) -> None:
        await self.weight_sync.leave(self.llm)

    def shutdown(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            # vLLM's default gives the engine core 5 s after SIGTERM, then kills it with a warning;
            # on a loaded machine it needs longer to stop its workers.
            llm.shutdown(timeout=ENGINE_SHUTDOWN_SECONDS)
            # vLLM's __del__ shuts down again, and where the AsyncLLM lives until interpreter exit
            # (modules half torn down) that second shutdown raises and prints a traceback; it has
            # nothing left to do, so it becomes a no-op.
            llm.shutdown = lambda *args, **kwargs: None


def rollout_request_seed(rollout_seed: int, token_ids: list[int]) -> int:
    """The vLLM seed of one request of a rollout that carries its own seed (SamplingParams.seed)."""
    return hash((rollout_seed, hash(tuple(token_ids)))) & (2**63 - 1)


def build_engine_args(cfg: MoltConfig, *, seed: int, backend: str, native_routes: bool = False):
    """vLLM's AsyncEngineArgs of a rollout rank's engine: Molt's own settings, then rollout.engine_args.
    `native_routes`: vLLM returns each finished request's routed experts (GPU; molt.rollout.route_capture)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    errors = engine_args_errors(cfg.rollout.engine_args)
    if errors:
        raise ConfigError("\n".join(errors))
    if cfg.rollout.engine_threads > 0:
        os.environ.setdefault("OMP_NUM_THREADS", str(cfg.rollout.engine_threads))
    tensor_parallel = cfg.layout.engine_tensor_parallel_size
    if current_platform.is_cpu() and tensor_parallel > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
            sorted(os.sched_getaffinity(0)), tensor_parallel, cfg.rollout.engine_threads)
    on_gpu = not current_platform.is_cpu()
    memory = cfg.rollout.engine_memory(on_gpu=on_gpu, colocate=cfg.layout.colocate)
    arguments = dict(
        model=cfg.model.path,
        dtype=cfg.model.dtype,
        seed=seed,
        max_model_len=cfg.rollout.max_length,
        **memory,
        tensor_parallel_size=tensor_parallel,
        enforce_eager=resolve_enforce_eager(cfg.rollout.enforce_eager, on_gpu=on_gpu),
        # vLLM's sleep mode (cumem allocator) lets the engine hand its memory to the trainer rank on its GPU.
        enable_sleep_mode=cfg.rollout.sleep_while_training,
        # Behaviour log-probs must be those of the distribution actually sampled from
        # (after temperature), because the trainer recomputes them at that temperature.
        logprobs_mode="processed_logprobs",
        worker_extension_cls=cfg.refit.receiver_cls,
        # NCCL refit goes through vLLM's own weight-transfer engine in each worker (molt.refit.nccl).
        weight_transfer_config={"backend": "nccl"} if backend == "nccl" else None,
        disable_log_stats=True,
        # Every request carries a sampling seed (_sampling_seed). When vLLM throws away the
        # sample of a partial (chunked) prefill it rewinds that request's generator, which a CPU
        # generator cannot do: the engine dies ("CPU Generator does not use offset"). On CPU
        # each prefill therefore runs whole (max_num_batched_tokens grows to max_model_len).
        enable_chunked_prefill=not current_platform.is_cpu(),
        # Needs vLLM's V2 model runner (Triton) and prefix caching; never run on a GPU.
        enable_return_routed_experts=native_routes,
    )
    return AsyncEngineArgs(**{**arguments, **cfg.rollout.engine_args})


def describe_start_failure(cfg: MoltConfig, vllm_config, error: Exception) -> str:
    """Why the engine did not start, and which field to change. vLLM reports a memory shortfall only
    in the engine process's log, so the KV-cache budget is compared here with what one sequence of
    rollout.max_length needs and with the memory free on this machine."""
    failure = f"{type(error).__name__}: {error}"
    memory = describe_memory_shortfall(cfg, vllm_config) if vllm_config is not None else None
    if memory:
        return f"the engine could not start: {memory} (vLLM: {failure})"
    engine_args = (f" and that vLLM takes rollout.engine_args={cfg.rollout.engine_args!r}"
                   if cfg.rollout.engine_args else "")
    return (f"vLLM could not start an engine on model.path={cfg.model.path!r}: {failure}. Check that it is a "
            f"Hugging Face model directory of an architecture vLLM supports (tools/make_tiny_model.py writes "
            f"one){engine_args}; if vLLM's log above says the KV cache did not fit, set rollout.kv_cache_gigabytes")


def describe_memory_shortfall(cfg: MoltConfig, vllm_config) -> str | None:
    """What is wrong with the engine's memory settings, if that can be told from here."""
    on_gpu = vllm_config.device_config.device_type != "cpu"
    budget = cfg.rollout.engine_memory(on_gpu=on_gpu, colocate=cfg.layout.colocate).get("kv_cache_memory_bytes")
    needed = sequence_kv_cache_bytes(vllm_config)
    length = f"one rollout.max_length={cfg.rollout.max_length}-token sequence"
    setting = (f"rollout.kv_cache_gigabytes={cfg.rollout.kv_cache_gigabytes:g}" if cfg.rollout.kv_cache_gigabytes
               else "the default when rollout.kv_cache_gigabytes is unset")
    if budget is not None and budget < needed:
        return (f"the KV cache of {budget / GIB:.4g} GiB per engine worker ({setting}) cannot hold {length}, "
                f"which needs about {needed / GIB:.4g} GiB: "
                f"raise rollout.kv_cache_gigabytes to at least {gigabytes_rounded_up(needed)} or lower "
                f"rollout.max_length")
    if vllm_config.device_config.device_type != "cpu":  # vLLM's GPU workers say what did not fit
        return None
    node, total, free = host_memory()
    if budget is not None and budget > free:
        return (f"the KV cache of {budget / GIB:.4g} GiB per engine worker ({setting}) is more than the "
                f"{free / GIB:.4g} GiB free of NUMA node "
                f"{node}'s {total / GIB:.4g} GiB: lower rollout.kv_cache_gigabytes (one sequence of "
                f"rollout.max_length needs about {needed / GIB:.4g} GiB) or free memory")
    fraction = cfg.rollout.engine_memory_fraction
    if budget is None and fraction * total > free:
        return (f"rollout.engine_memory_fraction={fraction:g} asks for {fraction * total / GIB:.4g} GiB of NUMA "
                f"node {node}'s {total / GIB:.4g} GiB, but {free / GIB:.4g} GiB are free: size the engine with "
                f"rollout.kv_cache_gigabytes instead ({length} needs about {needed / GIB:.4g} GiB of KV cache)")
    return None


def sequence_kv_cache_bytes(vllm_config) -> int:
    """About the KV cache one engine worker needs for one sequence of max_model_len tokens: K and V
    (one latent with MLA) x attention layers x the worker's KV heads x head size x the cache dtype's
    width, per token, in whole blocks, plus the block vLLM holds back. Exact for plain attention."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    width = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model).itemsize
    per_token = ((1 if model.use_mla else 2) * model.get_num_layers_by_block_type(parallel, "attention")
                 * model.get_num_kv_heads(parallel) * model.get_head_size() * width)
    num_blocks = -(-model.max_model_len // cache.block_size) + 1
    return num_blocks * cache.block_size * per_token


def gigabytes_rounded_up(num_bytes: int) -> str:
    """num_bytes in GiB to 4 significant digits, rounded up: a budget of that many GiB holds them."""
    scale = 10 ** (3 - math.floor(math.log10(num_bytes / GIB)))
    return f"{math.ceil(num_bytes / GIB * scale) / scale:.4g}"


def host_memory() -> tuple[int, int, int]:
    """(NUMA node, total bytes, free bytes) of the memory vLLM's CPU backend sizes an engine by."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_allowed_cpu_list()[0].numa_node
    info = get_memory_node_info(node)
    return node, info.total_memory, info.available_memory


def token_versions(spans, num_tokens: int, fallback: int) -> list[int]:
    """[num_tokens] the weight version of each output token, from vLLM's `weight_versions` spans
    (label, first token, end). Molt labels its refits with the version number; the label vLLM
    gives the weights it loaded at start ("default") is version 0. Each token takes the last span
    starting at or before it, so spans past a stop-string trim cannot misalign the rest."""
    if not spans:
        return [fallback] * num_tokens
    versions, span_index = [], 0
    for position in range(num_tokens):
        while span_index + 1 < len(spans) and spans[span_index + 1].start <= position:
            span_index += 1
        label = spans[span_index].version
        versions.append(int(label) if label.lstrip("-").isdigit() else 0)
    return versions


def top_alternatives(step: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one step of vLLM's log-probs (which also holds the sampled token)."""
    ranked = sorted(step.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0)
    return [(token, float(entry.logprob)) for token, entry in ranked if entry.rank is not None and entry.rank <= k][:k]


def cpu_thread_binding(cores: list[int], num_workers: int, threads_per_worker: int = 0) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `num_workers` tensor-parallel CPU workers: vLLM's
    default binds each worker to a NUMA node of its own and refuses to start with fewer nodes than
    workers (one node is the common case), so the cores this process may run on are split into
    `num_workers` contiguous groups, one per worker ('0|1' for 2 workers on cores 0 and 1), each at
    most `threads_per_worker` cores when that is set (rollout.engine_threads). With fewer cores than
    workers, workers share cores. Rollout ranks on one machine bind the same cores unless the launcher
    gives each its own affinity (taskset, srun --cpu-bind)."""
    if len(cores) < num_workers:
        groups = [[cores[worker % len(cores)]] for worker in range(num_workers)]
    else:
        size, extra = divmod(len(cores), num_workers)
        starts = [worker * size + min(worker, extra) for worker in range(num_workers + 1)]
        groups = [cores[starts[worker]:starts[worker + 1]] for worker in range(num_workers)]
    if threads_per_worker > 0:
        groups = [group[:threads_per_worker] for group in groups]
    return "|".join(",".join(str(core) for core in group) for group in groups)
