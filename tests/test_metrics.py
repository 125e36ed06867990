import json
import logging
import math
import time
from pathlib import Path

import pytest

from molt.metrics import MetricsLogger, ProcessResourceSampler, StageTimer, configure_logging


def make_logger(output_dir: Path, **overrides) -> MetricsLogger:
    kwargs = dict(output_dir=str(output_dir), run_name="test-run", config={"lr": 1e-6, "model": {"name": "tiny"}},
                  total_steps=3)
    return MetricsLogger(**(kwargs | overrides))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_has_one_line_per_step_with_step_first(tmp_path, caplog):
    metrics = make_logger(tmp_path)
    with caplog.at_level(logging.INFO, logger="molt"):
        metrics.log(1, {"reward/mean": 0.5, "throughput/tokens_per_second": 1234.4, "time/step_seconds": 1.234})
        # Readable before close: each line is flushed as it is written.
        assert read_jsonl(tmp_path / "metrics.jsonl") == [
            {"step": 1, "reward/mean": 0.5, "throughput/tokens_per_second": 1234.4, "time/step_seconds": 1.234}
        ]
        metrics.log(2, {"reward/mean": 0.75, "staleness/mean": 0.5})
    metrics.close()

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [list(row)[0] for row in rows] == ["step", "step"]
    assert rows[1] == {"step": 2, "reward/mean": 0.75, "staleness/mean": 0.5}
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-6, "model": {"name": "tiny"}}


def test_non_finite_values_become_null_and_warn_once_per_key(tmp_path, caplog):
    metrics = make_logger(tmp_path)
    with caplog.at_level(logging.WARNING, logger="molt"):
        metrics.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "reward/mean": 1.0})
        metrics.log(2, {"loss": float("nan"), "grad_norm": 2.0})
        assert metrics.nonfinite_counts == {"loss": 2, "grad_norm": 1}
        metrics.close()

    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": None, "grad_norm": None, "reward/mean": 1.0},
        {"step": 2, "loss": None, "grad_norm": 2.0},
    ]
    per_step_warnings = [r for r in caplog.records if "warned once per key" in r.getMessage()]
    assert len(per_step_warnings) == 2  # loss once, grad_norm once, though loss was NaN twice
    assert "{'loss': 2, 'grad_norm': 1}" in caplog.records[-1].getMessage()  # summary at close


def test_disabled_logger_writes_nothing(tmp_path, caplog):
    output_dir = tmp_path / "rank1"
    with caplog.at_level(logging.INFO, logger="molt"):
        metrics = make_logger(output_dir, enabled=False, wandb_mode="offline")
        metrics.log(1, {"reward/mean": float("nan")})
        metrics.close()
    assert not output_dir.exists()
    assert caplog.records == []


def test_invalid_wandb_mode_names_the_value(tmp_path):
    with pytest.raises(ValueError, match="'ofline'"):
        make_logger(tmp_path, wandb_mode="ofline")


def test_stage_timer_accumulates_and_resets():
    timer = StageTimer()
    started = time.perf_counter()
    for _ in range(2):
        with timer.stage("rollout"):
            time.sleep(0.02)
    with pytest.raises(RuntimeError), timer.stage("train"):  # a failing stage still counts
        time.sleep(0.01)
        raise RuntimeError("boom")
    wall_seconds = time.perf_counter() - started

    seconds = timer.pop()
    assert set(seconds) == {"time/rollout", "time/train"}
    assert seconds["time/rollout"] >= 0.04 and seconds["time/train"] >= 0.01
    # Bounded by the wall time the stages spanned, not a fixed figure a loaded machine can exceed.
    assert seconds["time/rollout"] + seconds["time/train"] <= wall_seconds
    assert timer.pop() == {}


def test_configure_logging_is_idempotent():
    molt_logger = logging.getLogger("molt")
    original = list(molt_logger.handlers)
    # Without the console handler an earlier test in this process may have added (which one runs
    # first depends on the order, e.g. on pytest-xdist's).
    molt_logger.handlers = [h for h in original if not getattr(h, "molt_console", False)]
    before = list(molt_logger.handlers)
    try:
        configure_logging(rank=0)
        configure_logging(rank=3)
        added = [h for h in molt_logger.handlers if h not in before]
        assert len(added) == 1
        line = added[0].format(logging.LogRecord("molt", logging.INFO, __file__, 1, "hello", None, None))
        assert line.endswith("[molt r3] INFO hello")
    finally:
        molt_logger.handlers = original


def read_wandb_records(path: Path) -> list:
    """Parse a .wandb file: a 7-byte header, then LevelDB-log framed protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block_size, position, payload, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block_size - position % block_size < 7:  # too little room for a chunk header: padding
            position += block_size - position % block_size
            continue
        length, chunk_type = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        payload += data[position + 7 : position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):  # FULL or LAST chunk ends a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def history_rows(records: list) -> list[dict]:
    """Each history record as {key: value}, with W&B's own step under "_step"."""
    return [{"_step": record.history.step.num}
            | {"/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """Belt and braces: offline everywhere, and W&B's own cache/config kept inside the test dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def test_wandb_offline_run_lands_under_output_dir(tmp_path, wandb_offline):
    output_dir = tmp_path / "run"
    metrics = make_logger(output_dir, wandb_mode="offline", wandb_project="molt-test")
    metrics.log(1, {"reward/mean": 0.25})
    metrics.log(2, {"reward/mean": 0.5, "loss": float("nan")})
    metrics.close()

    (wandb_file,) = output_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = read_wandb_records(wandb_file)
    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("molt-test", "test-run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["lr"] == 1e-6 and config["model"] == {"name": "tiny"}
    history = {row["trainer/step"]: row for row in history_rows(records)}
    assert history[1]["reward/mean"] == 0.25
    assert history[2]["reward/mean"] == 0.5
    assert math.isnan(history[2]["loss"])  # W&B keeps the NaN; only the JSONL needs null
    assert len(read_jsonl(output_dir / "metrics.jsonl")) == 2


def test_wandb_resume_continues_the_same_run(tmp_path, wandb_offline):
    """A resumed job passes the checkpoint's run id: its steps land in the same W&B run."""
    output_dir = tmp_path / "run"
    first = make_logger(output_dir, wandb_mode="offline", wandb_project="molt-test")
    run_id = first.run_id
    for step in (1, 2, 3):  # the job checkpoints at step 1, logs 2 and 3, then dies
        first.log(step, {"reward/mean": step / 10})
    first.close()
    time.sleep(1.1)  # an offline run's directory is named by the second it started in
    resumed = make_logger(output_dir, wandb_mode="offline", wandb_project="molt-test", wandb_run_id=run_id)
    assert resumed.run_id == run_id
    for step in (2, 3, 4):  # resumed from step 1: steps 2 and 3 come again
        resumed.log(step, {"reward/mean": step / 10 + 1})
    resumed.close()
    files = sorted(output_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # one per job, both of the one run (wandb sync uploads them into it)
    rows = [row for path in files for row in history_rows(read_wandb_records(path))]
    # W&B drops a step below the last one it saw: its own step keeps rising across the resume,
    # and the trainer step, the charts' x axis, is a value that may repeat.
    assert [row["_step"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert [row["trainer/step"] for row in rows] == [1, 2, 3, 2, 3, 4]
    assert rows[-1]["reward/mean"] == pytest.approx(1.4)
    metric_records = [record.metric for path in files for record in read_wandb_records(path)
                      if record.WhichOneof("record_type") == "metric"]
    assert any(metric.glob_name == "*" and metric.step_metric == "trainer/step" for metric in metric_records)
    assert [row["step"] for row in read_jsonl(output_dir / "metrics.jsonl")] == [1, 2, 3, 2, 3, 4]


def test_process_resource_sampler_reads_proc_at_most_once_per_interval():
    sampler = ProcessResourceSampler("probe", interval_seconds=3600)
    first = sampler.read()
    assert set(first) == {"process/probe_rss_bytes", "process/probe_open_fds"} and first["process/probe_rss_bytes"] > 0
    assert sampler.read() is first  # within the interval: the last reading, /proc not read
    sampler.interval_seconds = 0
    second = sampler.read()
    assert second is not first and set(second) == set(first)
