"""Benchmark memory under many screenshots per trajectory: one real torchrun job (molt.train on the
tiny Idefics3 of tools/make_tiny_model.py --preset vlm, one trainer rank and one rollout rank, vLLM
CPU) whose Env (tests/agents/screenshot_env.py) shows a new 64x64 screenshot at every turn, so each
rollout carries --screenshots + 1 distinct images (its prompt's and one per turn), with --prompts x
--samples rollouts in flight per step (synchronous: max_staleness 0).

Images always travel as payloads (molt.transport.payloads): they stay in the rollout rank's payload store
until the trainer rank that trains them reloads them; the controller, which runs in trainer rank
0's process in this layout, gets light records. From the job's metrics.jsonl, per step:
- images and their bytes (files + processor tensors) the step's experiences carried (rollout/images,
  rollout/image_bytes), and what trainer rank 0 reloaded (train/rank0_images);
- bytes the controller's socket received that step (delta of controller/bytes_received_total), in
  all and per rollout (each rollout sends it one outcome: its light record and the rank's metrics);
- bytes the controller sent per rollout (the requests: the prompt row's messages, whose image is
  a data URI in them, and the step's control messages);
- the rollout rank's payload store at the step's last outcome (payloads/occupancy_bytes,
  payloads/segment_bytes) and the rollout rank's resident memory;
- trainer rank 0's (= the controller's) resident memory at the end of the step.

Prints one JSON line per step (figure images_step), then the summary (figure images_memory: the
controller's bytes per rollout against the images' bytes per trained experience, and the growth of
trainer rank 0's RSS from the first step after --warmup-steps to the last), then the command.

    python tools/bench/images.py [--steps 10] [--warmup-steps 2] [--screenshots 15] [--prompts 8]
        [--samples 8] [--out-dir runs/bench-images] [--smoke RUN_DIR]

--smoke RUN_DIR (CI, tests/test_bench_smoke.py) starts no job: it checks the job's recipe with
molt.train --dry-run and summarizes RUN_DIR's metrics.jsonl (a finished run, images or not) as
its; its figures mean nothing, it keeps the script from rotting.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path

from bench_fixtures import check_job, load_repo_module, load_test_fixtures, read_metrics, run_job

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_FILE = "tests/agents/screenshot_env.py"
MEGABYTE = 1e6


def job_sets(args, model_dir: Path, prompts: Path, out: Path) -> dict:
    """The job's --set values."""
    return {"model.path": model_dir, "data.train_path": prompts, "agent.path": REPO_ROOT / ENV_FILE,
            "agent.max_turns": args.screenshots + 1, "metrics.output_dir": out, "train.num_steps": args.steps,
            "train.learning_rate": 1e-4, "train.warmup_steps": 0, "rollout.prompts_per_step": args.prompts,
            "rollout.n_samples_per_prompt": args.samples, "rollout.max_response_tokens": 4,
            "rollout.max_length": 1024, "refit.check_every_steps": 0, "eval.every_steps": 0,
            "algorithm.filter_groups": False, "algorithm.max_staleness": 0, "rollout.partial_rollout": False,
            # The random tiny model samples the <image> token now and then (1 of its 360), which fails
            # the rollout (sampled_image_token): refill it.
            "agent.on_failed_rollout": "refill", "agent.max_refills_per_group": 2}


def step_figures(rows: list[dict]) -> list[dict]:
    """One record per step; the controller's bytes are the step's share of the running total."""
    figures, before = [], None
    for row in rows:
        totals = row["controller/bytes_received_total"], row["controller/bytes_sent_total"]
        step_received, step_sent = (None, None) if before is None else (totals[0] - before[0], totals[1] - before[1])
        before = totals
        rollouts = row["rollout/num_rollouts"]  # each sent the controller one outcome (refills and failures too)
        figures.append({
            "figure": "images_step", "step": row["step"], "rollouts": int(rollouts),
            "failed": int(row["rollout/failed"]), "experiences": int(row["rollout/consumed"]),
            "images": int(row["rollout/images"]), "trainer_rank0_images": int(row["train/rank0_images"]),
            "image_megabytes": round(row["rollout/image_bytes"] / MEGABYTE, 1),
            "controller_received_kilobytes": None if step_received is None else round(step_received / 1e3, 1),
            "controller_received_bytes_per_rollout":
                None if step_received is None else round(step_received / rollouts),
            # Requests carry the prompt row's messages, its own image as a data URI among them.
            "controller_sent_bytes_per_rollout": None if step_sent is None else round(step_sent / rollouts),
            "payload_store_megabytes": round(row["payloads/occupancy_bytes"] / MEGABYTE, 1),
            "payload_segments_megabytes": round(row["payloads/segment_bytes"] / MEGABYTE, 1),
            "rollout_rank_rss_megabytes": round(row["process/rollout_rank_rss_bytes"] / MEGABYTE, 1),
            "trainer_rank0_rss_megabytes": round(row["process/trainer_rank0_rss_bytes"] / MEGABYTE, 1),
            "step_seconds": round(row["time/step_seconds"], 1)})
    return figures


def summarize(figures: list[dict], warmup_steps: int) -> dict:
    measured = figures[warmup_steps:]
    if len(measured) < 2:
        raise SystemExit(f"{len(figures)} steps leave fewer than 2 after the {warmup_steps} warm-up steps; raise --steps")
    experiences, rollouts = sum(f["experiences"] for f in measured), sum(f["rollouts"] for f in measured)
    received = sum(f["controller_received_kilobytes"] * 1e3 for f in measured)
    rss = [f["trainer_rank0_rss_megabytes"] for f in measured]
    rollout_rss = [f["rollout_rank_rss_megabytes"] for f in measured]
    return {"figure": "images_memory", "steps": len(measured),
            "images_per_experience": round(sum(f["images"] for f in measured) / experiences, 2),
            "image_bytes_per_experience": round(sum(f["image_megabytes"] for f in measured) * MEGABYTE / experiences),
            "controller_bytes_per_rollout": round(received / rollouts),
            "image_megabytes_per_step": round(sum(f["image_megabytes"] for f in measured) / len(measured), 1),
            "controller_kilobytes_per_step": round(received / 1e3 / len(measured), 1),
            "trainer_rank0_rss_megabytes_first_last_max": [rss[0], rss[-1], max(rss)],
            "trainer_rank0_rss_growth_megabytes": round(rss[-1] - rss[0], 1),
            "rollout_rank_rss_megabytes_first_last_max": [rollout_rss[0], rollout_rss[-1], max(rollout_rss)]}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="first steps left out of the summary (step 1 also builds the optimizer state)")
    parser.add_argument("--screenshots", type=int, default=15, help="screenshots per rollout after the prompt's image")
    parser.add_argument("--prompts", type=int, default=8, help="rollout.prompts_per_step")
    parser.add_argument("--samples", type=int, default=8, help="rollout.n_samples_per_prompt")
    parser.add_argument("--out-dir", default="runs/bench-images", help="the job's run directory, prompts and log")
    parser.add_argument("--smoke", type=Path, metavar="RUN_DIR",
                        help="CI's smoke run: check the job's recipe with molt.train --dry-run instead of running "
                             "it, and summarize RUN_DIR (a finished molt.train run) as its metrics")
    args = parser.parse_args()
    fixtures = load_test_fixtures()
    model_dir = fixtures.build_cached_tiny_model(preset="vlm")
    out = (REPO_ROOT / args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    screenshot_env = load_repo_module(ENV_FILE, "molt_bench_screenshot_env")
    prompts = screenshot_env.write_prompts(out / "prompts.jsonl", num_rows=args.prompts * args.steps,
                                           screenshots=args.screenshots)
    sets = job_sets(args, model_dir, prompts, out / "run")
    if args.smoke:
        check_job(sets, name="images")
        wall, run_dir = None, args.smoke
    else:
        wall, run_dir = round(run_job(sets, out / "run", name="images"), 1), out / "run"
    rows = read_metrics(run_dir)
    figures = step_figures([row for row in rows if row["step"] >= 1])
    for figure in figures:
        emit(figure)
    emit({**summarize(figures, args.warmup_steps), "wall_seconds": wall, "run_dir": str(run_dir)})
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
