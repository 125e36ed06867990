"""Start-up validation: the type of every field (and the Literal rule), each section's own ranges
(`MoltConfig.check`), then the rules that span sections and the files a run reads, all reported at
once in one ConfigError that names each field and the fix. Settings that depend on where the trainer
computes are checked once that is known (check_device_options); config_warnings lists settings that
are valid but probably not what was meant."""

from __future__ import annotations

from pathlib import Path

from molt.config.fields import field_type_errors
from molt.config.schema import GROUP_ESTIMATORS, ConfigError, MoltConfig, failing, raise_config_errors


def validate_config(cfg: MoltConfig, world_size: int | None = None, *, require_files: bool = True) -> None:
    """Checks done once at start-up; raises ConfigError naming the field.

    `require_files=False` (--dry-run) skips the existence checks of model.path, data.train_path and
    agent.path, which need only be there at run time."""
    # The range checks below compare values and would fail on a value of the wrong type.
    raise_config_errors(field_type_errors(cfg))
    errors = cfg.check() + cross_section_errors(cfg, world_size) + missing_file_errors(cfg, require_files)
    if cfg.device != "auto":  # with auto, molt.train checks once it knows where the trainer computes
        try:
            check_device_options(cfg, cfg.device)
        except ConfigError as error:
            errors.append(str(error))
    raise_config_errors(errors)


def missing_file_errors(cfg: MoltConfig, require_files: bool) -> list[str]:
    """The files a run reads; with require_files=False (--dry-run) only that they are named."""
    def is_file(path: str) -> bool:
        return bool(path) and (not require_files or Path(path).is_file())

    evaluation = cfg.eval
    return failing(
        (not require_files or not cfg.model.path or Path(cfg.model.path, "config.json").is_file(),
         f"model.path={cfg.model.path!r} has no config.json: point it at a Hugging Face model directory"),
        (is_file(cfg.data.train_path),
         f"data.train_path={cfg.data.train_path!r} is not a file: point it at a .jsonl or .parquet prompt set"),
        (is_file(cfg.agent.path),
         f"agent.path={cfg.agent.path!r} is not a file: point it at a Python file defining AgentRunner"),
        # Only when training will evaluate (python -m molt.eval checks the file it is given itself).
        (not (evaluation.every_steps and evaluation.data_path) or is_file(evaluation.data_path),
         f"eval.data_path={evaluation.data_path!r} is not a file: point it at a .jsonl or .parquet prompt set"),
    )


def cross_section_errors(cfg: MoltConfig, world_size: int | None = None) -> list[str]:
    """The rules that tie one section's fields to another's, or to the job's `world_size` (if given)."""
    layout, rollout, train, algo = cfg.layout, cfg.rollout, cfg.train, cfg.algorithm
    rollouts_per_step = rollout.prompts_per_step * rollout.n_samples_per_prompt
    return failing(
        (world_size is None or cfg.world_size == world_size,
         f"layout.num_trainer_ranks + layout.num_rollout_ranks = {layout.num_trainer_ranks} + "
         f"{layout.num_rollout_ranks} = {cfg.world_size}, but the job has {world_size} ranks; "
         f"set the split to add up to {world_size} or launch with --nproc_per_node={cfg.world_size}"),
        (cfg.device != "cpu" or layout.trainer_context_parallel_size == 1,
         f"layout.trainer_context_parallel_size={layout.trainer_context_parallel_size} with device='cpu': context "
         f"parallelism splits attention with PyTorch's CUDA kernels; it is a GPU layout (set 1 on CPU)"),
        (cfg.device != "cpu" or cfg.refit.backend != "nccl",
         "refit.backend='nccl' with device='cpu': NCCL moves GPU memory; CPU runs refit over gloo (set auto or gloo)"),
        # torchrun and srun give each node a contiguous block of ranks, and trainers come first, so a
        # node's engines (ranks T..) would land on other nodes than its trainers (ranks 0..T-1).
        (not layout.colocate or cfg.device == "cpu" or layout.num_trainer_ranks <= layout.gpus_per_node,
         f"layout.colocate=True runs on one node: layout.num_trainer_ranks={layout.num_trainer_ranks} is more "
         f"than layout.gpus_per_node={layout.gpus_per_node}; use the disaggregated layout "
         f"(layout.colocate=False) across nodes"),
        # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected", init.cc).
        (not layout.colocate or cfg.refit.backend != "nccl",
         "refit.backend='nccl' with layout.colocate=True: the trainer's sender and the engine share a GPU and "
         "NCCL refuses a duplicate GPU in one communicator; set refit.backend=auto (gloo host staging)"),
        (not rollout.sleep_while_training or layout.colocate,
         "rollout.sleep_while_training=True frees an engine's GPU memory for the trainer rank on the same GPU, "
         "which only layout.colocate=True gives it: set layout.colocate=True or sleep_while_training=False"),
        (not rollout.sleep_while_training or algo.max_staleness == 0,
         f"rollout.sleep_while_training=True stops generation while the trainer steps, but "
         f"algorithm.max_staleness={algo.max_staleness} streams rollouts during the step: set "
         f"algorithm.max_staleness=0 (synchronous)"),
        (algo.advantage_estimator not in GROUP_ESTIMATORS or rollout.n_samples_per_prompt > 1,
         f"algorithm.advantage_estimator={algo.advantage_estimator!r} needs rollout.n_samples_per_prompt > 1 "
         f"(got {rollout.n_samples_per_prompt}): its baseline is the rest of the prompt's group"),
        (not algo.filter_groups or rollout.n_samples_per_prompt > 1,
         f"algorithm.filter_groups=True needs rollout.n_samples_per_prompt > 1 (got "
         f"{rollout.n_samples_per_prompt}): a group of one has no spread of scores to keep"),
        (not rollout.partial_rollout or algo.importance_level != "off",
         f"rollout.partial_rollout=True continues rollouts under new weights, so one experience holds tokens "
         f"of several versions: it needs algorithm.importance_level (e.g. token, with importance_mode trunc) "
         f"to correct for them (algorithm.importance_level={algo.importance_level!r})"),
        (not algo.routing_replay or rollout.capture_routes is not False,
         "algorithm.routing_replay=True replays the routes the engines record, but rollout.capture_routes=False "
         "records none: leave rollout.capture_routes unset (on for MoE models) or set it True"),
        (0 <= algo.overlong_buffer_tokens <= rollout.max_response_tokens,
         f"algorithm.overlong_buffer_tokens={algo.overlong_buffer_tokens}: must be in [0, rollout.max_response_tokens="
         f"{rollout.max_response_tokens}] (0 = no overlong penalty)"),
        (train.max_tokens_per_micro_batch >= rollout.max_length,
         f"train.max_tokens_per_micro_batch={train.max_tokens_per_micro_batch} must be >= "
         f"rollout.max_length={rollout.max_length} so the longest segment fits one micro-batch"),
        (train.mini_batches_per_step <= rollouts_per_step,
         f"train.mini_batches_per_step={train.mini_batches_per_step} exceeds the rollouts of a step "
         f"(rollout.prompts_per_step x n_samples_per_prompt = {rollouts_per_step})"),
        (cfg.eval.max_response_tokens < rollout.max_length,
         f"eval.max_response_tokens={cfg.eval.max_response_tokens} must be below "
         f"rollout.max_length={rollout.max_length}"),
    )


def check_device_options(cfg: MoltConfig, device_type: str) -> None:
    """Settings that depend on where the trainer computes ('cpu' or 'cuda'), checked once it is known."""
    check_cpu_offload(cfg, device_type)
    rollout = cfg.rollout
    if rollout.sleep_while_training and device_type == "cpu":
        # vllm/platforms/interface.py, is_sleep_mode_available: CUDA, ROCm and XPU only.
        raise ConfigError("rollout.sleep_while_training=True on a CPU run: vLLM's sleep mode is CUDA-only (its CPU "
                          "backend refuses enable_sleep_mode); set rollout.sleep_while_training=false")
    if cfg.layout.colocate and device_type == "cuda" and (rollout.engine_memory_fraction <= 0
                                                          or rollout.kv_cache_gigabytes > 0):
        # vllm/v1/worker/utils.py, request_memory: an engine needs gpu_memory_utilization x the GPU free at
        # start even when kv_cache_memory_bytes sizes its cache, so a byte budget alone asks for vLLM's
        # default 0.92 of a GPU the trainer rank shares.
        raise ConfigError(f"layout.colocate=True on GPUs sizes each engine by rollout.engine_memory_fraction (now "
                          f"{rollout.engine_memory_fraction:g}), its share of the GPU it shares with a trainer rank: "
                          f"set it (e.g. 0.4; --dry-run shows what the trainer needs) and leave "
                          f"rollout.kv_cache_gigabytes at 0 (now {rollout.kv_cache_gigabytes:g})")


def check_cpu_offload(cfg: MoltConfig, device_type: str) -> None:
    """train.cpu_offload is a GPU memory control: refused where the trainer computes on CPU."""
    if cfg.train.cpu_offload and device_type == "cpu":
        raise ConfigError("train.cpu_offload=True on a CPU run: it keeps parameters, gradients and AdamW state in "
                          "host memory to save GPU memory, and a CPU trainer holds them there already; set "
                          "train.cpu_offload=false (or run on GPUs)")


def config_warnings(cfg: MoltConfig) -> list[str]:
    """Settings that are valid but probably not what was meant; start-up logs each once."""
    algo, train = cfg.algorithm, cfg.train
    return failing(
        # E_{y ~ pi}[grad log pi(y)] = 0: on tokens sampled from the policy, k1's gradient is zero in expectation.
        (algo.kl_estimator != "k1" or algo.kl_placement != "loss" or algo.kl_coef <= 0,
         f"algorithm.kl_estimator='k1' with kl_placement='loss' and kl_coef={algo.kl_coef}: on tokens the "
         f"policy sampled, k1's gradient is zero in expectation, so this term pulls nothing toward the "
         f"reference (only noise); use kl_estimator='k3' or 'k2' in the loss, or kl_placement='reward' for k1"),
        (train.warmup_steps <= train.num_steps,  # e.g. a recipe's warmup in a short trial run
         f"train.warmup_steps={train.warmup_steps} is more than train.num_steps={train.num_steps}: the whole run "
         f"warms up and never reaches train.learning_rate={train.learning_rate} (the last step runs at "
         f"{train.num_steps}/{train.warmup_steps} of it)"),
    )
