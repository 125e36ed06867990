"""What the benchmark scripts share: importing repository files that are not in a package, above all
the tests' generated-asset cache (tests/fixtures_models.py: tiny models and demo data, built once
into $MOLT_CACHE_DIR), so a benchmark measures the same models the tests run; the --smoke option;
and running (or, for --smoke, dry-running) the molt.train jobs that some benchmarks measure."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.py"


def load_repo_module(relative_path: str, name: str) -> ModuleType:
    """Import a repo file that is not part of a package (tests/ and tools/ are scripts)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_test_fixtures() -> ModuleType:
    """tests/fixtures_models.py: the $MOLT_CACHE_DIR cache the tests use (tiny models, demo data)."""
    return load_repo_module("tests/fixtures_models.py", "molt_tests_fixtures_models")


def parse_with_smoke(parser, smoke_defaults: dict, argv: list[str] | None = None):
    """Parse the command line; with --smoke, `smoke_defaults` replace the defaults first (flags given
    on the command line still win). --smoke is the tiny setting CI runs (tests/test_bench_smoke.py):
    seconds, not a measurement, so the script cannot rot unseen."""
    parser.add_argument("--smoke", action="store_true",
                        help=f"CI's tiny setting (seconds; figures not meaningful): {smoke_defaults}")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke_defaults)
        args = parser.parse_args(argv)
    return args


# -- the benchmarks that run molt.train jobs (async.py, moe.py, images.py) ------------------------


def job_command(sets: dict) -> list[str]:
    """The torchrun command of a one-trainer, one-rollout-rank job on the demo recipe with `sets`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "molt.train", "--config", str(DEMO_CONFIG)]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    return command


def run_job(sets: dict, out: Path, *, name: str, extra_env: dict[str, str] | None = None) -> float:
    """Run the job to the end (its output in out/job.log); returns its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", **(extra_env or {})}
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(out / "job.log", "w") as log:
        done = subprocess.run(job_command(sets), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {name} job failed (exit {done.returncode}); its output: {out / 'job.log'}")
    return time.perf_counter() - started


def check_job(sets: dict, *, name: str) -> None:
    """--smoke's stand-in for a job: molt.train's --dry-run of the same recipe, in this process
    (config keys and values, placement, the model's shards, a sample of the prompt rows), its report
    on stderr so stdout keeps only JSON lines."""
    sys.path.insert(0, str(REPO_ROOT))
    from molt.config import ConfigError, load_config
    from molt.dry_run import dry_run_report

    try:
        cfg = load_config(str(DEMO_CONFIG), [f"{key}={value}" for key, value in sets.items()])
        for line in dry_run_report(cfg):
            print(line, file=sys.stderr)
    except ConfigError as error:
        raise SystemExit(f"the {name} job's recipe fails molt.train --dry-run: {error}") from error


def read_metrics(run_dir: Path) -> list[dict]:
    """A finished run's metrics.jsonl rows."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist; --smoke takes the directory of a finished molt.train run "
                         "(its metrics.output_dir)")
    return [json.loads(line) for line in path.read_text().splitlines()]
