"""tools/bench/refit.py, scaled down to the tiny tensor-parallel model: both trainer layouts refit a
TP=2 CPU engine through the trainer's own refit path, stdout holds only JSON lines, and the control
figures are what the refit protocol promises (four messages per refit and engine, one collective
per bucket on the sender and on each worker, two worker RPCs and three engine-core calls)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

# starts vLLM engines (not in the unit tier); the bench's limit is 300 s
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench" / "refit.py"
LAYOUTS = ("fsdp2", "tp2")


def test_refit_bench_runs_both_layouts_against_a_tensor_parallel_engine(tiny_tp_model_dir):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny-tp", "--layouts", ",".join(LAYOUTS), "--bucket-megabytes",
         "0.25", "--refits", "2", "--tcp-repeats", "1", "--timeout-seconds", "60"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]  # every stdout line is JSON
    assert lines[-1]["command"].startswith("python ")
    figures = {(line["figure"], line.get("layout")): line for line in lines[:-1]}
    model_bytes = sum(t.nbytes for t in load_file(tiny_tp_model_dir / "model.safetensors").values())
    assert figures["baseline_tcp_bytes_per_second", None]["bytes"] == model_bytes
    for layout in LAYOUTS:
        broadcast = figures["refit_broadcast_bytes_per_second", layout]
        end_to_end = figures["refit_end_to_end_bytes_per_second", layout]
        assert broadcast["bytes"] == end_to_end["bytes"] == model_bytes
        assert 0 < broadcast["seconds_median"] < end_to_end["seconds_median"]
        assert len(end_to_end["seconds_all"]) == 2
        reload = figures["refit_engine_reload_seconds", layout]
        assert len(reload["per_worker"]) == 2 and reload["value"] > 0
        control = figures["refit_control_messages", layout]
        buckets = control["buckets"]
        assert buckets > 1, "0.25 MiB buckets split the tiny model"
        assert control["collectives_per_refit"] == buckets
        assert control["worker_receives_per_refit"] == [buckets, buckets]
        assert control["messages_received_per_refit_per_engine"] == {"refit": 1, "refit_go": 1}
        assert control["messages_sent_per_refit_per_engine"] == {"refit_done": 1, "refit_paused": 1}
        assert control["engine_worker_rpcs_per_refit"] == {"molt_prepare_refit": 1, "molt_receive_weights": 1}
        assert control["engine_core_calls_per_refit"] == {
            "pause_generation": 1, "resume_generation": 1, "update_weight_version": 1}
        assert all(memory["buffer_bytes"] <= 0.25 * 2**20 for memory in control["worker_receive_memory"])
