"""Benchmark streaming against synchronous training on a long-tailed workload: two real torchrun
jobs (molt.train on the generated tiny model, one trainer and one rollout rank), the same recipe,
one synchronous (algorithm.max_staleness=0) and one streaming (max_staleness k, rollout.partial_rollout
on, token-level truncated importance correction in both jobs).

The workload (tools/bench/long_tail_agent.py): each rollout generates one answer, then waits on a
simulated tool whose latency is log-normal (median, sigma) and capped, so a step's slowest rollout
sets the synchronous step time while most rollouts finish early.

Figures over the steps after the warm-up ones, from each job's metrics.jsonl, one JSON line each,
then the command that produced them:
- async_trained_samples_per_second: rollouts trained (rollout/consumed) / wall time of those steps
  (time/step_seconds), per job, and streaming / synchronous (target >= 1.6);
- async_trainer_idle_share: time the trainer waited for rollouts (time/rollout) / step time, per job
  (target for streaming <= 0.10);
- async_job: per job, mean step, rollout-wait, train and refit seconds and the staleness of the
  trained tokens (staleness/mean, staleness/max).

    python tools/bench/async.py [--steps 30] [--warmup-steps 5] [--max-staleness 2] [--prompts 16]
        [--samples 8] [--max-tokens 16] [--latency-median 0.2] [--latency-sigma 1.0] [--latency-cap 1.0]
        [--hidden-size 384] [--out-dir runs/bench-async] [--smoke RUN_DIR]

--smoke RUN_DIR (CI, tests/test_bench_smoke.py) starts no job: it checks both jobs' recipes with
molt.train --dry-run and summarizes RUN_DIR's metrics.jsonl (a finished run) as both jobs'; its
figures mean nothing, it keeps the script from rotting.

The default workload puts the slowest tool call of a step (the cap) near the trainer's step time:
streaming hides tool latency up to about k steps of training; past that the trainer waits. The
default model (2 layers, hidden 384) makes a training step cost about what generating its batch
does, as in real runs; with the tests' hidden-128 model generation costs more than training on
shared CPU cores, so the trainer waits for generation however far rollouts run ahead.
"""

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from bench_fixtures import check_job, load_test_fixtures, read_metrics, run_job

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT = Path(__file__).resolve().parent / "long_tail_agent.py"


def job_sets(args, model_dir: Path, data_dir: Path, out: Path, *, max_staleness: int) -> dict:
    """One job's --set values. Streaming = max_staleness > 0 (partial rollout on)."""
    return {"model.path": model_dir, "data.train_path": data_dir / "train.jsonl", "agent.path": AGENT,
            "metrics.output_dir": out, "train.num_steps": args.steps, "train.learning_rate": 1e-4,
            "rollout.prompts_per_step": args.prompts, "rollout.n_samples_per_prompt": args.samples,
            "rollout.max_response_tokens": args.max_tokens, "rollout.max_length": 128,
            "refit.check_every_steps": 0, "algorithm.importance_level": "token",
            "algorithm.importance_mode": "trunc", "algorithm.max_staleness": max_staleness,
            "rollout.partial_rollout": max_staleness > 0}


def latency_env(args) -> dict[str, str]:
    """The tool latency settings, read by the agent workers (tools/bench/long_tail_agent.py)."""
    return {"MOLT_BENCH_LATENCY_MEDIAN_SECONDS": str(args.latency_median),
            "MOLT_BENCH_LATENCY_SIGMA": str(args.latency_sigma),
            "MOLT_BENCH_LATENCY_CAP_SECONDS": str(args.latency_cap)}


def build_model(fixtures, hidden_size: int) -> Path:
    """The tests' tiny model, or (with a hidden size) the same architecture that wide, cached alike."""
    if not hidden_size:
        return fixtures.build_cached_tiny_model()
    tool = fixtures.load_tool("make_tiny_model")
    target = fixtures.cache_root() / "models" / f"tiny-h{hidden_size}-seed0-{fixtures.generator_version('make_tiny_model')}"
    return fixtures.build_cached(target, lambda out_dir: tool.make_tiny_model(out_dir, hidden_size=hidden_size))


def summarize(out: Path, warmup_steps: int) -> dict:
    rows = read_metrics(out)
    measured = [r for r in rows if r["step"] > warmup_steps]
    if not measured:
        raise SystemExit(f"{out}: no step after the {warmup_steps} warm-up steps; raise --steps")
    seconds = sum(r["time/step_seconds"] for r in measured)

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in measured)

    return {"steps": len(measured), "trained_samples_per_second": sum(r["rollout/consumed"] for r in measured) / seconds,
            "idle_share": sum(r["time/rollout"] for r in measured) / seconds,
            "step_seconds": mean("time/step_seconds"), "rollout_wait_seconds": mean("time/rollout"),
            "train_seconds": mean("time/train"), "refit_seconds": mean("time/refit"),
            "staleness_mean": mean("staleness/mean"), "staleness_max": max(r["staleness/max"] for r in measured),
            "reward_mean": mean("reward/mean")}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per job")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the figures")
    parser.add_argument("--max-staleness", type=int, default=2, help="k of the streaming job")
    parser.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    parser.add_argument("--samples", type=int, default=8, help="rollout.n_samples_per_prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="rollout.max_response_tokens")
    parser.add_argument("--latency-median", type=float, default=0.2, help="tool latency median, seconds")
    parser.add_argument("--latency-sigma", type=float, default=1.0, help="log-normal sigma of the tool latency")
    parser.add_argument("--latency-cap", type=float, default=1.0, help="longest tool latency, seconds")
    parser.add_argument("--hidden-size", type=int, default=384,
                        help="hidden size of the generated 2-layer model (0: the tests' tiny model, 128)")
    parser.add_argument("--out-dir", default="runs/bench-async", help="the two jobs' run directories and logs")
    parser.add_argument("--smoke", type=Path, metavar="RUN_DIR",
                        help="CI's smoke run: check each job's recipe with molt.train --dry-run instead of running "
                             "it, and summarize RUN_DIR (a finished molt.train run) as both jobs' metrics")
    args = parser.parse_args()
    fixtures = load_test_fixtures()
    # --smoke: the tests' tiny model (cached by the test session) instead of building the hidden-384 one.
    model_dir = build_model(fixtures, 0 if args.smoke else args.hidden_size)
    data_dir = fixtures.build_cached_demo_data()
    figures = {}
    for name, staleness in (("synchronous", 0), ("streaming", args.max_staleness)):
        out = (REPO_ROOT / args.out_dir / name).resolve()
        sets = job_sets(args, model_dir, data_dir, out, max_staleness=staleness)
        if args.smoke:
            check_job(sets, name=name)
            wall, out = None, args.smoke
        else:
            wall = round(run_job(sets, out, name=name, extra_env=latency_env(args)), 1)
        figures[name] = summarize(out, args.warmup_steps)
        emit({"figure": "async_job", "job": name, "max_staleness": staleness, "partial_rollout": staleness > 0,
              "wall_seconds": wall, "run_dir": str(out), **{k: round(v, 4) for k, v in figures[name].items()}})
    sync, stream = figures["synchronous"], figures["streaming"]
    emit({"figure": "async_trained_samples_per_second", "synchronous": round(sync["trained_samples_per_second"], 2),
          "streaming": round(stream["trained_samples_per_second"], 2),
          "ratio": round(stream["trained_samples_per_second"] / sync["trained_samples_per_second"], 3),
          "target_ratio": 1.6})
    emit({"figure": "async_trainer_idle_share", "synchronous": round(sync["idle_share"], 3),
          "streaming": round(stream["idle_share"], 3), "target_streaming": 0.10})
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
