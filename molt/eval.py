"""Evaluate a model with a run's agent file and eval settings, outside training:

    python -m molt.eval --config configs/demo.py [--set eval.n_samples=8] [--checkpoint DIR] [--out eval.json]

One process starts one engine and the agent workers of one rollout rank (molt.rollout.agent_pool: the same
agent file runs the same way as in training) and runs eval.n_samples rollouts of each prompt of the
eval set (eval.data_path, or eval.holdout_rows of data.train_path), with the eval sampling settings
and the same per-sample seeds as an eval during training (molt.controller.evaluation). No trainer, no torchrun.

--checkpoint: a Hugging Face model directory, or a Molt `step_<N>` checkpoint (its actor weights are
exported to a Hugging Face directory first, as tools/export_hf.py does); without it, model.path
(the base model). Prints the metrics as JSON; --out writes them with every sample's record.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from molt.config import ConfigError, MoltConfig, build_arg_parser, load_config, validate_config
from molt.controller.evaluation import EvalSample, build_eval_requests, compute_eval_metrics, sample_from_outcome, split_eval_rows
from molt.controller.prompts import PromptRow, load_field_rows
from molt.distributed.devices import apply_vllm_worker_start_method
from molt.distributed.lifetime import die_with_owner, mark_owner
from molt.metrics import configure_logging

if __name__ == "__mp_main__":  # a process this command spawned (its engine core, an agent worker): it dies with it
    die_with_owner()

logger = logging.getLogger("molt")

PROGRESS_SECONDS = 10.0  # how often a long eval logs how far it got
EXPORT_TOOL = Path(__file__).resolve().parents[1] / "tools" / "export_hf.py"


def read_eval_rows(cfg: MoltConfig) -> list[PromptRow]:
    """The eval set of `cfg` (eval.data_path, or eval.holdout_rows of data.train_path)."""
    if not cfg.eval.data_path and not cfg.eval.holdout_rows:
        raise ConfigError("no eval set: set eval.data_path to a prompt file, or eval.holdout_rows to hold out rows "
                          "of data.train_path")
    if cfg.eval.data_path:
        if not Path(cfg.eval.data_path).is_file():
            raise ConfigError(f"eval.data_path={cfg.eval.data_path!r} is not a file: point it at a .jsonl or .parquet "
                              f"prompt set")
        return split_eval_rows(cfg, [])[1]
    return split_eval_rows(cfg, load_field_rows("data.train_path", cfg.data.train_path))[1]


def resolve_model_dir(checkpoint: str, cfg: MoltConfig, scratch_dir: str) -> str:
    """The Hugging Face directory to evaluate: `checkpoint` itself when it is one, else a Molt
    checkpoint's actor exported into `scratch_dir` (its recorded base model, else model.path)."""
    path = Path(checkpoint)
    if (path / "config.json").is_file():
        return str(path)
    from molt.trainer.checkpoint import COMPLETE

    if not (path / COMPLETE).is_file():
        raise ConfigError(f"--checkpoint {checkpoint!r} is neither a Hugging Face model directory (no config.json) "
                          f"nor a complete Molt step_<N> checkpoint (no {COMPLETE} marker)")
    if not EXPORT_TOOL.is_file():
        raise ConfigError(f"--checkpoint {checkpoint!r} is a Molt checkpoint, and exporting it needs tools/export_hf.py "
                          f"of a Molt checkout; export it yourself and pass the Hugging Face directory")
    spec = importlib.util.spec_from_file_location("molt_tools_export_hf", EXPORT_TOOL)
    export_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_tool)
    base = json.loads((path / "state.json").read_text()).get("model_path") or cfg.model.path
    logger.info("exporting the actor of %s (base model %s) to a Hugging Face directory", path, base)
    return str(export_tool.export_hf(path, Path(scratch_dir) / "model", base))


async def run_eval_rollouts(cfg: MoltConfig, rows: list[PromptRow], engine, endpoint=None,
                            progress_seconds: float = PROGRESS_SECONDS) -> list[EvalSample]:
    """Every eval sample of `rows`, run by agent workers of this process on `engine` (and, for a
    ChatAgent, `endpoint`, the session endpoint over it); in eval-set order."""
    from molt.rollout.agent_pool import AgentWorkerPool
    from molt.transport.dispatch import decode_outcome

    pool = AgentWorkerPool(cfg, rank=0)
    try:
        kind = await pool.start()
        if kind == "chat" and endpoint is None:
            raise ConfigError(f"agent.path={cfg.agent.path!r} is a ChatAgent: it needs a session endpoint")
        pool.attach(engine=engine, endpoint=endpoint)
        await pool.wait_ready()
        requests = build_eval_requests(cfg, rows, engine.policy_version)
        started, reported, finished = time.monotonic(), time.monotonic(), 0

        async def run_one(rollout_id: int, request: dict) -> EvalSample:
            nonlocal finished, reported
            outcome = decode_outcome(await pool.run({**request, "rollout_id": rollout_id}))
            finished += 1
            if time.monotonic() - reported >= progress_seconds:
                reported = time.monotonic()
                logger.info("eval: %d of %d samples (%.0f%%) in %.0f s", finished, len(requests),
                            100 * finished / len(requests), reported - started)
            return sample_from_outcome(outcome, request["sample_index"])

        return list(await asyncio.gather(*(run_one(i, r) for i, r in enumerate(requests))))
    finally:
        await pool.close()


async def evaluate_model(cfg: MoltConfig, rows: list[PromptRow]) -> list[EvalSample]:
    """Start one engine on model.path (and a session endpoint for a ChatAgent), run the eval, stop them."""
    from molt.endpoint.server import SessionEndpoint
    from molt.rollout.engine import RolloutEngine

    engine = RolloutEngine.start(cfg, seed=cfg.seed)
    endpoint = SessionEndpoint(engine, engine.tokenizer, model_name=Path(cfg.model.path).name,
                               host=cfg.agent.endpoint_host, tool_call_parser=cfg.rollout.tool_call_parser,
                               image_root=cfg.agent.image_root)
    await endpoint.start()
    try:
        return await run_eval_rollouts(cfg, rows, engine, endpoint)
    finally:
        await endpoint.stop()
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser("Evaluate a model (a checkpoint, or the base model) with a run's agent file.")
    parser.add_argument("--checkpoint", default="",
                        help="a Hugging Face model directory or a Molt step_<N> checkpoint (default: model.path)")
    parser.add_argument("--out", default="", help="write the metrics and every sample's record to this JSON file")
    args = parser.parse_args(argv)
    configure_logging(0)
    mark_owner()  # what this process spawns (engine core, agent workers) dies with it, even on SIGKILL
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the metrics' JSON
    try:
        cfg = load_config(args.config, args.set)
        validate_config(cfg)
        rows = read_eval_rows(cfg)
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    logger.info("eval set: %d prompts x %d samples", len(rows), cfg.eval.n_samples)
    # No torch.distributed world here, but the engine starts as a rollout rank's does, on GPU as on CPU.
    apply_vllm_worker_start_method(os.environ, cfg.device)
    if args.dry_run:
        return 0
    with tempfile.TemporaryDirectory(prefix="molt-eval-") as scratch:
        try:
            if args.checkpoint:
                cfg.model.path = resolve_model_dir(args.checkpoint, cfg, scratch)
        except ConfigError as error:
            logger.error("%s", error)
            return 2
        started = time.monotonic()
        samples = asyncio.run(evaluate_model(cfg, rows))
    metrics = compute_eval_metrics(samples, k=cfg.eval.n_samples, success_threshold=cfg.eval.success_threshold)
    metrics["eval/seconds"] = time.monotonic() - started
    sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
    if args.out:
        report = {"metrics": metrics, "model": args.checkpoint or cfg.model.path, "config": cfg.to_dict(),
                  "samples": [sample.to_dict() for sample in samples]}
        Path(args.out).write_text(json.dumps(report) + "\n")
        logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so recipes and this code share one MoltConfig class.
    from molt.eval import main as imported_main

    sys.exit(imported_main())
