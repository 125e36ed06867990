"""Every script under tools/bench/ (and tools/gpu_check.sh) runs in CI at a tiny setting, so none can
rot unseen again (tools/bench/trainer.py crashed for a while and nothing noticed): each prints the
JSON figure lines its docstring promises, parsed and checked here, not only an exit status of 0.

Cost is shared: the benches that need no engine run as scripts in the unit tier; capture.py runs
its paths on the session's shared engine and endpoint; async.py, moe.py and images.py start no job:
--smoke dry-runs each job's recipe with molt.train --dry-run and summarizes the session's straight
run (tests/shared_jobs.py) as each job's metrics. tools/bench/refit.py has its own test
(tests/test_bench_refit.py, a TP=2 engine of its own)."""

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench"


def run_script(*command: str, env: dict | None = None, timeout_seconds: float = 240) -> list[dict]:
    """Run a bench script; its stdout must be JSON lines only, the last one the command."""
    done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_seconds)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines and lines[-1]["command"].startswith("python "), done.stdout[-2000:]
    return lines[:-1]


def by_figure(records: list[dict]) -> dict[str, dict]:
    return {record["figure"]: record for record in records}


def import_bench(name: str):
    """A bench script as a module (they import bench_fixtures from their own folder)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"molt_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# -- unit tier: no engine, no job ----------------------------------------------------------------


def test_trainer_bench_smoke():
    figures = by_figure(run_script(str(BENCH / "trainer.py"), "--smoke"))
    assert set(figures) == {"loss_head_peak_memory_bytes", "trainer_tokens_per_second", "packing_padding_share",
                            "packing_tokens_per_second"}
    trainer = figures["trainer_tokens_per_second"]
    assert trainer["value"] > 0 and trainer["baseline"] > 0
    # ratio = bare step seconds / Molt's = Molt's tokens/s over the bare loop's, same tokens
    assert trainer["ratio"] == pytest.approx(trainer["value"] / trainer["baseline"], rel=0.02)
    assert trainer["measured_steps"] == 1 and trainer["experiences"] == 4
    head = figures["loss_head_peak_memory_bytes"]
    assert head["tokens"] == 256 and 0 < head["value"] and 0 < head["baseline"]
    padding = figures["packing_padding_share"]
    assert 0 <= padding["value"] <= padding["baseline"] < 1
    assert figures["packing_tokens_per_second"]["value"] > 0


def test_payloads_bench_smoke():
    figures = by_figure(run_script(str(BENCH / "payloads.py"), "--smoke"))
    assert set(figures) == {"payloads_same_node_bytes_per_second", "payloads_same_node_first_touch_bytes_per_second",
                            "payloads_remote_bytes_per_second", "payloads_small_round_trip_seconds"}
    for name in ("payloads_same_node_bytes_per_second", "payloads_remote_bytes_per_second"):
        assert figures[name]["payload_bytes"] == 2**20 and figures[name]["value"] > 0 and figures[name]["ratio"] > 0
    small = figures["payloads_small_round_trip_seconds"]
    assert small["experiences"] == 16 and small["inline"] and small["value"] > 0


@pytest.mark.e2e  # its mesh part is a torchrun job
def test_gpu_check_cpu_smoke(tmp_path):
    """tools/gpu_check.sh --cpu-smoke: every part runs, reports its figures and passes on CPU (the
    log-prob part fails on bf16 logits rounded before the upcast: 8.7e-3 against float64)."""
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu-smoke"], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
                               "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=300)
    results = json_lines((tmp_path / "out" / "results.jsonl").read_text())
    assert json_lines(done.stdout) == results
    summaries = {record["part"]: record for record in results if "status" in record}
    assert list(summaries) == ["mesh", "fsdp2_1b", "logprobs_fp32", "pytest_gpu"], done.stderr[-3000:]
    for part in summaries:  # the log-prob part too: molt/trainer/logprobs.py computes bf16 logits in float32
        assert summaries[part]["status"] == "PASS", (tmp_path / "out" / f"{part}.log").read_text()[-3000:]

    figures = {record["figure"]: record for record in results if "figure" in record}
    mesh = figures["trainer_mesh"]
    assert mesh["ok"] and mesh["all_reduce"]["dp_group"] == {"sum": 1.0, "backend": "ProcessGroupGloo"}
    assert {"gpu_peak_memory_bytes", "gpu_tokens_per_second", "gpu_mfu"} <= set(figures)
    assert figures["gpu_mfu"]["baseline"] == 989e12
    counts = summaries["pytest_gpu"]["counts"]
    assert counts["tests"] >= 3 and counts["skipped"] == counts["tests"]  # no CUDA here: every gpu test skips

    logprobs = figures["logprobs_fp32_max_abs_error"]
    assert logprobs["logprobs_dtype"] == "torch.float32" and math.isfinite(logprobs["value"])
    assert logprobs["baseline"] > 1e-3  # bf16 logits upcast after: the error the part must tell apart
    assert logprobs["value"] <= 1e-4

    verdict = results[-1]
    assert verdict["gpu_check"] == "PASS" and verdict["cpu_smoke"] and done.returncode == 0


# -- e2e tier: the session's shared engine and straight run --------------------------------------


def test_capture_bench_smoke(engine, endpoint, capsys):
    capture = import_bench("capture")
    args = capture.parse_args(["--smoke"])
    capture.emit(capture.measure_client_construction())
    engine.run(capture.measure_paths(engine.engine, endpoint.endpoint, args))
    figures = by_figure(json_lines(capsys.readouterr().out))
    assert set(figures) == {"capture_sdk_client_construction_ms", "capture_rollouts_per_second",
                            "capture_generated_tokens", "capture_latency_p50_ms",
                            "capture_front_process_cpu_ms_per_rollout", "capture_sequential_latency_p50_ms"}
    paths = {"direct", "endpoint", "endpoint_responses", "endpoint_raw_http"}
    rates = figures["capture_rollouts_per_second"]
    assert all(rates[path] > 0 for path in paths) and rates["rollouts"] == 4 and rates["max_tokens"] == 4
    tokens = figures["capture_generated_tokens"]["completion_tokens_per_round"]
    assert set(tokens) == paths and all(0 < sum(rounds) <= 4 * 4 for rounds in tokens.values())
    assert figures["capture_sequential_latency_p50_ms"]["requests"] == 2


@pytest.mark.e2e
@pytest.mark.parametrize("name, figure_names", [
    ("async", {"async_job", "async_trained_samples_per_second", "async_trainer_idle_share"}),
    ("moe", {"moe_job", "moe_route_capture_overhead", "moe_route_payload_bytes_per_token", "moe_mismatch_kl"}),
    ("images", {"images_step", "images_memory"}),
])
def test_job_bench_smoke(name, figure_names, straight_run, tmp_path, monkeypatch, capsys):
    """The bench's jobs are dry-run (their recipes checked), the straight run summarized as theirs."""
    assert straight_run.returncode == 0, straight_run.stderr[-3000:]
    bench = import_bench(name)
    monkeypatch.setattr(sys, "argv", [f"tools/bench/{name}.py", "--smoke", str(straight_run.out),
                                      "--warmup-steps", "1", "--out-dir", str(tmp_path)])
    bench.main()
    lines = json_lines(capsys.readouterr().out)
    assert lines[-1]["command"].startswith("python ")
    records = lines[:-1]
    assert {record["figure"] for record in records} == figure_names
    rows = json_lines((straight_run.out / "metrics.jsonl").read_text())
    steps = sum(1 for row in rows if row.get("step", 0) >= 1)  # the optimizer steps' rows
    assert steps == 4  # the straight run: 4 steps
    jobs = [record for record in records if record["figure"] in ("async_job", "moe_job")]
    for job in jobs:
        assert job["run_dir"] == str(straight_run.out) and job["steps"] == steps - 1 and job["wall_seconds"] is None
    if name == "async":
        assert by_figure(records)["async_trained_samples_per_second"]["ratio"] == 1.0  # one run as both jobs
    if name == "images":
        assert [record["step"] for record in records if record["figure"] == "images_step"] == list(range(1, steps + 1))
        assert by_figure(records)["images_memory"]["steps"] == steps - 1


def test_smoke_options_are_documented_and_flags_win():
    """Each bench but refit.py (tests/test_bench_refit.py passes its tiny flags) takes --smoke; under
    it the smoke defaults apply and a flag given on the command line still wins."""
    for script in sorted(BENCH.glob("*.py")):
        source = script.read_text()
        if "def main(" in source and script.name != "refit.py":
            assert "--smoke" in source, f"{script.name} has no --smoke option"
    parse_with_smoke = import_bench("bench_fixtures").parse_with_smoke

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=30)
        parser.add_argument("--rounds", type=int, default=3)
        return parse_with_smoke(parser, {"steps": 2, "rounds": 1}, argv)

    assert (parse([]).steps, parse([]).rounds) == (30, 3)
    assert (parse(["--smoke"]).steps, parse(["--smoke"]).rounds) == (2, 1)
    assert (parse(["--smoke", "--steps", "5"]).steps, parse(["--smoke", "--steps", "5"]).rounds) == (5, 1)
