"""tools/bench/trainer.py's gpu_scale figure, scaled down: it runs on a GPU and its JSON lines are
sane; without CUDA it refuses with a message instead of failing somewhere inside."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench" / "trainer.py"
GPU_FIGURES = {"gpu_peak_memory_bytes", "gpu_tokens_per_second", "gpu_mfu"}


def run_bench(*arguments: str, env: dict | None = None, timeout_seconds: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *arguments], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_seconds)


@pytest.mark.gpu
def test_gpu_scale_figure_runs_scaled_down():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    done = run_bench("--figures", "gpu_scale", "--gpu-preset", "small", "--gpu-sequences", "2",
                     "--gpu-sequence-tokens", "1024", "--gpu-chunk-tokens", "512", "--gpu-warmup-steps", "1",
                     "--gpu-steps", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    records = {line["figure"]: line for line in lines if "figure" in line}
    assert set(records) == GPU_FIGURES and "command" in lines[-1]

    memory, speed, mfu = (records[name] for name in ("gpu_peak_memory_bytes", "gpu_tokens_per_second", "gpu_mfu"))
    for record in records.values():
        assert record["tokens_per_step"] == 2 * 1024 and record["micro_batches"] == 1
        assert record["all_stepped"], "a window skipped its optimizer step (non-finite loss or norm)"
    assert 50e6 < memory["params"] < 150e6  # the ~85M "small" preset
    # fp32 weights, gradients and both AdamW moments are all alive at the optimizer step.
    assert memory["baseline"] == 16 * memory["params"]
    assert memory["baseline"] <= memory["value"] < torch.cuda.get_device_properties(0).total_memory
    assert speed["value"] > 0 and math.isfinite(speed["value"])
    assert speed["value"] == pytest.approx(2 * 1024 / speed["step_seconds_median"], rel=1e-2)
    assert 0 < mfu["value"] < 1 and mfu["mfu_without_attention"] < mfu["value"]
    assert mfu["value"] == pytest.approx(mfu["flops_per_token"] * speed["value"] / mfu["baseline"], rel=1e-2)


def test_gpu_scale_refuses_without_cuda():
    """Runs on CPU: with no visible GPU the figure is refused up front, naming what is missing."""
    done = run_bench("--figures", "gpu_scale", env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
                     timeout_seconds=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "gpu_scale needs a CUDA device" in done.stderr and not done.stdout
