"""Benchmark mixture-of-experts training on CPU: what route capture costs and what routing replay buys.

Three real torchrun jobs (molt.train, one trainer and one rollout rank) on the generated tiny
Qwen3-MoE (tools/make_tiny_model.py --preset moe), the demo's addition task, synchronous
(algorithm.max_staleness=0, so a step's time is its rollouts plus its training), the same seed:
- capture_off: rollout.capture_routes=False;
- capture_on: routes recorded, not replayed (the diagnostics measure route alignment);
- replay: routes recorded and replayed (algorithm.routing_replay=True).
The engine and the trainer's forward run in --dtype (bfloat16 by default: kernels that round
differently are what makes the trainer's router disagree with the engine's).

Figures over the steps after the warm-up ones, one JSON line each, then the command:
- moe_route_capture_overhead: mean step seconds with capture on / off (target <= 1.10), and the
  rollout (generation) seconds of each;
- moe_route_payload_bytes_per_token: what routes add to a trace, [layers, top_k] int16 per token,
  for this model and for Qwen3-30B-A3B's 48 layers x top 8;
- moe_mismatch_kl: train/mismatch_kl (per action token, KL of behaviour to trainer), the largest and
  the mean p99 |trainer - behaviour| log-prob, without and with replay, with route alignment and
  coverage. The untrained tiny MoE earns no reward on the task, so the weights never change and
  these figures are the engine's and the trainer's kernels alone.

    python tools/bench/moe.py [--steps 12] [--warmup-steps 2] [--dtype bfloat16] [--out-dir runs/bench-moe]
                              [--smoke RUN_DIR]

--smoke RUN_DIR (CI, tests/test_bench_smoke.py) starts no job: it checks the three jobs' recipes with
molt.train --dry-run and summarizes RUN_DIR's metrics.jsonl (a finished run, dense or not) as each
job's; its figures mean nothing, it keeps the script from rotting.
"""

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from bench_fixtures import check_job, load_test_fixtures, read_metrics, run_job

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT = REPO_ROOT / "configs" / "agents" / "addition.py"
JOBS = {"capture_off": {"rollout.capture_routes": False},
        "capture_on": {"rollout.capture_routes": True},
        "replay": {"rollout.capture_routes": True, "algorithm.routing_replay": True}}
QWEN3_30B_A3B = (48, 8)  # MoE layers, experts per token


def job_sets(args, model_dir: Path, data_dir: Path, out: Path, settings: dict) -> dict:
    """One job's --set values: the shared recipe plus the job's `settings`."""
    return {"model.path": model_dir, "data.train_path": data_dir / "train.jsonl", "agent.path": AGENT,
            "metrics.output_dir": out, "train.num_steps": args.steps, "train.learning_rate": 5e-4,
            "model.dtype": args.dtype, "rollout.prompts_per_step": args.prompts,
            "rollout.n_samples_per_prompt": args.samples, "refit.check_every_steps": 0,
            "algorithm.max_staleness": 0, "rollout.partial_rollout": False, **settings}


def summarize(out: Path, warmup_steps: int) -> dict:
    rows = read_metrics(out)
    measured = [r for r in rows if r.get("step", 0) > warmup_steps]
    if not measured:
        raise SystemExit(f"{out}: no step after the {warmup_steps} warm-up steps; raise --steps")

    def mean(key: str) -> float | None:
        values = [r[key] for r in measured if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    return {"steps": len(measured), "step_seconds": mean("time/step_seconds"), "rollout_seconds": mean("time/rollout"),
            "train_seconds": mean("time/train"), "mismatch_kl": mean("train/mismatch_kl"),
            "logprob_diff_max": max((r.get("diagnostics/logprob_diff_max") or 0.0) for r in measured),
            "logprob_diff_p99": mean("diagnostics/logprob_diff_p99"),
            "route_alignment": mean("diagnostics/route_alignment"), "route_coverage": mean("diagnostics/r3_coverage"),
            "reward_mean": mean("reward/mean")}


def emit(record: dict) -> None:
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in record.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per job")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    parser.add_argument("--samples", type=int, default=16, help="rollout.n_samples_per_prompt")
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype: the engine's and the trainer's forward")
    parser.add_argument("--out-dir", default="runs/bench-moe", help="the jobs' run directories and logs")
    parser.add_argument("--smoke", type=Path, metavar="RUN_DIR",
                        help="CI's smoke run: check each job's recipe with molt.train --dry-run instead of running "
                             "it, and summarize RUN_DIR (a finished molt.train run) as every job's metrics")
    args = parser.parse_args()
    fixtures = load_test_fixtures()
    model_dir, data_dir = fixtures.build_cached_tiny_model(preset="moe"), fixtures.build_cached_demo_data()
    config = json.loads((model_dir / "config.json").read_text())
    figures = {}
    for name, settings in JOBS.items():
        out = (REPO_ROOT / args.out_dir / name).resolve()
        sets = job_sets(args, model_dir, data_dir, out, settings)
        if args.smoke:
            check_job(sets, name=name)
            wall, out = None, args.smoke
        else:
            wall = run_job(sets, out, name=name)
        figures[name] = summarize(out, args.warmup_steps)
        emit({"figure": "moe_job", "job": name, "wall_seconds": wall, "run_dir": str(out), **figures[name]})
    off, on, replay = figures["capture_off"], figures["capture_on"], figures["replay"]
    emit({"figure": "moe_route_capture_overhead", "step_seconds_off": off["step_seconds"],
          "step_seconds_on": on["step_seconds"], "ratio": on["step_seconds"] / off["step_seconds"],
          "rollout_seconds_off": off["rollout_seconds"], "rollout_seconds_on": on["rollout_seconds"],
          "target_ratio": 1.10})
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    emit({"figure": "moe_route_payload_bytes_per_token", "this_model": layers * top_k * 2,
          "qwen3_30b_a3b": QWEN3_30B_A3B[0] * QWEN3_30B_A3B[1] * 2})
    emit({"figure": "moe_mismatch_kl", "dtype": args.dtype, "without_replay": on["mismatch_kl"],
          "with_replay": replay["mismatch_kl"], "logprob_diff_max_without": on["logprob_diff_max"],
          "logprob_diff_max_with": replay["logprob_diff_max"], "logprob_diff_p99_without": on["logprob_diff_p99"],
          "logprob_diff_p99_with": replay["logprob_diff_p99"], "route_alignment": on["route_alignment"],
          "route_coverage": on["route_coverage"]})
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
