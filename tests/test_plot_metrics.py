import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "plot_metrics.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def load_tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(run_dir: Path) -> Path:
    run_dir.mkdir()
    path = run_dir / "metrics.jsonl"
    rows = [{"step": step, "reward/mean": step / 40 + (step % 3) * 0.05, "loss": None} for step in range(1, 41)]
    rows.append({"step": 40, "reward/mean": 2.0})  # a resumed run re-logs step 40: the last line wins
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 41, "rew')  # killed mid-line
    return path


def test_plot_writes_a_png(tmp_path):
    tool = load_tool()
    jsonl = write_run(tmp_path / "grpo-demo")

    out = tool.plot_metrics(jsonl, tmp_path / "reward.png")

    data = Path(out).read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1024


def test_read_metric_keeps_last_value_per_step_and_skips_bad_lines(tmp_path):
    tool = load_tool()
    steps, values = tool.read_metric(write_run(tmp_path / "run"), "reward/mean")
    assert steps == list(range(1, 41))
    assert values[-1] == 2.0
    with pytest.raises(ValueError, match="'loss'.*keys present: \\['loss', 'reward/mean'\\]"):
        tool.read_metric(tmp_path / "run" / "metrics.jsonl", "loss")  # all null


def test_rolling_mean_matches_a_naive_loop():
    tool = load_tool()
    values = [float(v) for v in range(25)]
    expected = []
    for i in range(len(values)):
        start = max(0, i - 9)
        expected.append(sum(values[start : i + 1]) / (i + 1 - start))
    assert tool.compute_rolling_mean(values, 10) == pytest.approx(expected)


def test_command_line_prints_the_default_output_path(tmp_path):
    jsonl = write_run(tmp_path / "run")
    result = subprocess.run([sys.executable, str(TOOL), str(jsonl)], capture_output=True, text=True, check=True)
    out = Path(result.stdout.strip())
    assert out == tmp_path / "run" / "reward_mean.png"
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_nan_and_null_values_are_skipped_and_a_run_without_any_ends_without_a_traceback(tmp_path):
    tool = load_tool()
    run = tmp_path / "run"
    run.mkdir()
    jsonl = run / "metrics.jsonl"
    # JSON has no NaN, but Python's json module writes and reads it; MetricsLogger writes null.
    jsonl.write_text('{"step": 1, "reward/mean": NaN}\n{"step": 2, "reward/mean": null}\n{"step": 3, "reward/mean": 0.5}\n')
    assert tool.read_metric(jsonl, "reward/mean") == ([3], [0.5])
    assert Path(tool.plot_metrics(jsonl, tmp_path / "reward.png")).read_bytes().startswith(PNG_SIGNATURE)

    # Every rollout of every step failed: no reward at all. The tool says so, exit status 1, no traceback.
    jsonl.write_text('{"step": 1, "reward/mean": null, "rollout/failed": 16}\n{"step": 2, "reward/mean": NaN}\n')
    result = subprocess.run([sys.executable, str(TOOL), str(jsonl)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "no finite values of 'reward/mean'" in result.stderr and "rollout/failed_*" in result.stderr
    assert "no plot written" in result.stderr and not (run / "reward_mean.png").exists()


def write_run_with_eval(run_dir: Path) -> Path:
    """Training rows for steps 1-20 and eval rows (their own lines, as molt.trainer.loop logs them) at 0, 10, 20."""
    run_dir.mkdir()
    rows = [{"step": step, "reward/mean": step / 20} for step in range(1, 21)]
    for step in (0, 10, 20):
        rows.insert(step, {"step": step, "eval/avg@4": 0.1 + step / 40, "eval/pass@4": 0.5, "eval/step": step})
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_eval_curve_is_found_and_drawn_beside_the_reward(tmp_path, monkeypatch):
    tool = load_tool()
    jsonl = write_run_with_eval(tmp_path / "run")
    assert tool.find_eval_key(jsonl) == "eval/avg@4"
    assert tool.find_eval_key(write_run(tmp_path / "plain")) is None
    assert tool.read_metric(jsonl, "eval/avg@4") == ([0, 10, 20], [0.1, 0.35, 0.6])
    assert tool.read_metric(jsonl, "reward/mean")[0] == list(range(1, 21))  # eval rows do not disturb it
    drawn = []
    real_plot = tool.plt.Axes.plot

    def recording_plot(self, *args, **kwargs):
        drawn.append((list(args[0]), list(args[1]), kwargs.get("label")))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(tool.plt.Axes, "plot", recording_plot)
    out = tool.plot_metrics(jsonl, tmp_path / "reward.png")
    assert Path(out).read_bytes().startswith(PNG_SIGNATURE)
    assert ([0, 10, 20], [0.1, 0.35, 0.6], "eval/avg@4 (eval set)") in drawn
    drawn.clear()
    tool.plot_metrics(jsonl, tmp_path / "reward.png", eval_key=None)
    assert [label for *_, label in drawn] == ["reward/mean", "rolling mean (10 steps)"]
