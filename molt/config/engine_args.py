"""Which `rollout.engine_args` names a run may pass to vLLM: the ones vLLM's AsyncEngineArgs has and
Molt does not set itself."""

import dataclasses
import difflib

# vLLM engine arguments Molt sets itself, each with what to do instead; rollout.engine_args may not set them.
MOLT_ENGINE_ARGS = {
    "model": "set model.path",
    "tokenizer": "set model.path (Molt and the engine read its tokenizer)",
    "dtype": "set model.dtype",
    "seed": "set seed (engine i, on the i-th rollout rank, gets seed + i)",
    "max_model_len": "set rollout.max_length",
    "tensor_parallel_size": "set layout.engine_tensor_parallel_size",
    "pipeline_parallel_size": "refit reaches tensor-parallel workers only: set layout.engine_tensor_parallel_size",
    "data_parallel_size": "each rollout rank hosts one engine: set layout.num_rollout_ranks",
    # vLLM's worker count per engine is pipeline x tensor x prefill-context parallel
    # (vllm/config/parallel.py, ParallelConfig.__post_init__); Molt gives engine e the refit rank offset
    # 1 + e * TP and vLLM adds each worker's rank inside the engine (weight_transfer/nccl_common.py,
    # worker_init_process_group), so PCP workers would take the next engine's ranks.
    # decode_context_parallel_size reuses the TP workers (no new ones) and stays allowed.
    "prefill_context_parallel_size": "refit ranks count tensor-parallel workers only (1 + engine x TP + "
                                     "worker), so more workers per engine would take the next engine's "
                                     "ranks: set layout.engine_tensor_parallel_size",
    "gpu_memory_utilization": "set rollout.engine_memory_fraction",
    "kv_cache_memory_bytes": "set rollout.kv_cache_gigabytes",
    "enforce_eager": "set rollout.enforce_eager",
    "enable_sleep_mode": "set rollout.sleep_while_training",
    "worker_extension_cls": "set refit.receiver_cls",
    "weight_transfer_config": "set refit.backend",
    "logprobs_mode": "the trainer needs the log-probs of the distribution sampled from (processed_logprobs)",
    "enable_chunked_prefill": "Molt turns it off on CPU, where a seeded request cannot rewind its sampler",
    "enable_return_routed_experts": "set rollout.capture_routes",
}


def engine_args_errors(engine_args: dict) -> list[str]:
    """One message per rollout.engine_args name that vLLM's AsyncEngineArgs lacks (with the closest
    one it has) or that Molt sets itself (with the field to set instead)."""
    # vLLM is imported here, not at the top: loading a config must not pay its import (seconds).
    from vllm.engine.arg_utils import AsyncEngineArgs

    valid = [f.name for f in dataclasses.fields(AsyncEngineArgs)]
    errors = []
    for name in engine_args:
        if name in MOLT_ENGINE_ARGS:
            errors.append(f"rollout.engine_args[{name!r}]: Molt sets this vLLM argument itself; "
                          f"{MOLT_ENGINE_ARGS[name]}")
        elif name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see vLLM's AsyncEngineArgs for the names"
            if close and close[0] in MOLT_ENGINE_ARGS:
                hint += f" Molt sets that one itself: {MOLT_ENGINE_ARGS[close[0]]}"
            errors.append(f"rollout.engine_args[{name!r}]: vLLM has no engine argument {name!r}; {hint}")
    return errors
