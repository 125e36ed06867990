import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_models import load_tool

from molt.controller.prompts import PromptRow, build_prompt_loader, load_prompt_rows

make_demo_data = load_tool("make_demo_data")
ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_demo_data_loads_from_jsonl_and_parquet(demo_data_dir):
    for split, num_rows in [("train", 4096), ("eval", 100)]:
        from_jsonl = load_prompt_rows(demo_data_dir / f"{split}.jsonl")
        from_parquet = load_prompt_rows(demo_data_dir / f"{split}.parquet")
        assert from_jsonl == from_parquet
        assert len(from_jsonl) == num_rows
    row = from_jsonl[0]
    a, b = row.metadata["a"], row.metadata["b"]
    assert row.messages == [{"role": "user", "content": f"{a}+{b}="}]
    assert row.label == str(a + b)
    assert row.tools is None and row.images is None


def test_demo_data_is_deterministic_from_seed(tmp_path):
    make_demo_data.make_demo_data(tmp_path / "first", num_train=64, num_eval=8, seed=3)
    make_demo_data.make_demo_data(tmp_path / "again", num_train=32, num_eval=8, seed=3)
    make_demo_data.make_demo_data(tmp_path / "other", num_train=64, num_eval=8, seed=4)
    first = (tmp_path / "first" / "train.jsonl").read_text()
    assert first.startswith((tmp_path / "again" / "train.jsonl").read_text())
    assert (tmp_path / "first" / "eval.jsonl").read_text() == (tmp_path / "again" / "eval.jsonl").read_text()
    assert first != (tmp_path / "other" / "train.jsonl").read_text()


def test_the_demo_eval_set_holds_each_of_the_100_sums_once(tmp_path):
    make_demo_data.make_demo_data(tmp_path / "data", num_train=8, seed=0)
    rows = load_prompt_rows(tmp_path / "data" / "eval.jsonl")
    assert sorted(row.messages[0]["content"] for row in rows) == sorted(f"{a}+{b}=" for a in range(10)
                                                                      for b in range(10))
    assert all(row.label == str(row.metadata["a"] + row.metadata["b"]) for row in rows)
    assert json.loads((tmp_path / "data" / "settings.json").read_text())["eval"] == make_demo_data.EVAL_LAYOUT


def test_prompt_field_becomes_a_user_message(tmp_path):
    path = write_jsonl(
        tmp_path / "rows.jsonl",
        [{"prompt": "2+2=", "label": 4, "tools": json.dumps([{"type": "function"}]), "images": ["a.png"]}],
    )
    assert load_prompt_rows(path) == [
        PromptRow(
            messages=[{"role": "user", "content": "2+2="}],
            label="4",
            tools=[{"type": "function"}],
            images=[str(tmp_path / "a.png")],  # relative to the prompt file
        )
    ]


def test_parquet_null_struct_fields_are_dropped(tmp_path):
    records = [
        {"messages": [{"role": "user", "content": "1+1=", "name": None}], "label": "2"},
        {"messages": [{"role": "user", "content": "1+2=", "name": "bob"}], "label": "3"},
    ]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    rows = load_prompt_rows(path)
    assert rows[0].messages == [{"role": "user", "content": "1+1="}]
    assert rows[1].messages == [{"role": "user", "content": "1+2=", "name": "bob"}]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"label": "8"}', "neither 'messages' nor 'prompt'"),
        ('{"messages": [{"role": "robot", "content": "hi"}]}', "role 'robot'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user"}]}', "no 'content'"),
        ('{"prompt": "1+1=", "label": [2]}', "'label' must be a string or number"),
        ('{"prompt": "1+1=", "tools": {"name": "f"}}', "'tools' must be a list"),
        ('{"prompt": "1+1=", "tools": "[{"}', "'tools' is a string but not valid JSON"),
        ('{"prompt": "1+1=", "metadata": 3}', "'metadata' must be an object"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": "1+1=",', "not valid JSON"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=message) as error:
        load_prompt_rows(path)
    assert f"{path}:3" in str(error.value)


def test_unknown_suffix_and_empty_file_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="use .jsonl or .parquet"):
        load_prompt_rows(tmp_path / "rows.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_prompt_rows(tmp_path / "empty.jsonl")


def test_loader_yields_lists_of_rows_and_drops_the_last_partial_batch(demo_data_dir):
    loader = build_prompt_loader(demo_data_dir / "eval.jsonl", batch_size=8, shuffle=False, seed=0)
    batches = list(loader)
    assert len(batches) == 100 // 8
    assert all(isinstance(batch, list) and len(batch) == 8 for batch in batches)
    assert all(isinstance(row, PromptRow) for row in batches[0])
    assert [row.metadata["index"] for row in batches[1]] == list(range(8, 16))


def test_loader_rejects_batch_larger_than_dataset(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1="}] * 3)
    with pytest.raises(ValueError, match="fewer than batch_size=4"):
        build_prompt_loader(path, batch_size=4, shuffle=True, seed=0)


def batch_indices(batches):
    return [[row.metadata["index"] for row in batch] for batch in batches]


def test_loader_resumes_mid_epoch_at_the_same_position(demo_data_dir):
    path = demo_data_dir / "eval.jsonl"
    loader = build_prompt_loader(path, batch_size=8, shuffle=True, seed=7)
    first_epoch = batch_indices(loader)
    iterator = iter(loader)
    seen = batch_indices([next(iterator) for _ in range(5)])
    state = loader.state_dict()
    remaining = batch_indices(iterator)
    assert seen + remaining != first_epoch  # each epoch is reshuffled

    resumed = build_prompt_loader(path, batch_size=8, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    assert batch_indices(resumed) == remaining
    # The epoch after the resumed one matches the uninterrupted run's next epoch too.
    assert batch_indices(resumed) == batch_indices(loader)


def test_loader_shuffle_is_seeded(demo_data_dir):
    path = demo_data_dir / "eval.jsonl"
    same = [batch_indices(build_prompt_loader(path, batch_size=8, shuffle=True, seed=1)) for _ in range(2)]
    other = batch_indices(build_prompt_loader(path, batch_size=8, shuffle=True, seed=2))
    assert same[0] == same[1] != other


def test_loader_resumes_at_an_epoch_boundary(demo_data_dir):
    path = demo_data_dir / "eval.jsonl"
    loader = build_prompt_loader(path, batch_size=8, shuffle=True, seed=7)
    batch_indices(loader)
    state = loader.state_dict()
    next_epochs = [batch_indices(loader), batch_indices(loader)]

    resumed = build_prompt_loader(path, batch_size=8, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    assert [batch_indices(resumed), batch_indices(resumed)] == next_epochs


def warnings_of(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]


def test_unknown_keys_warn_once_each_with_the_closest_key(tmp_path, caplog):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1=", "answer": "2", "lable": "2"}] * 3
                       + [{"prompt": "2+2=", "label": "4", "id": 7}])
    with caplog.at_level("WARNING", logger="molt"):
        rows = load_prompt_rows(path)
    assert [row.label for row in rows] == ["", "", "", "4"]  # an unknown key is not read as the label
    messages = sorted(warnings_of(caplog))
    assert len(messages) == 3
    assert messages[0].startswith(f"{path}:1: key 'answer' (in 3 row(s)) is not a prompt-row key and is ignored "
                                  "(did you mean 'label'?)")
    assert messages[1].startswith(f"{path}:1: key 'lable' (in 3 row(s))") and "did you mean 'label'?" in messages[1]
    assert messages[2].startswith(f"{path}:4: key 'id' (in 1 row(s)) is not a prompt-row key and is ignored; "
                                  "row keys are messages, prompt, label")


def test_parquet_rows_are_checked_like_jsonl_rows(tmp_path, caplog):
    records = [{"prompt": f"{i}+1=", "solution": str(i + 1), "metadata": {"a": i}} for i in range(5)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    with caplog.at_level("WARNING", logger="molt"):
        assert len(load_prompt_rows(path)) == 5
    assert warnings_of(caplog) == [f"{path}:row 0: key 'solution' (in 5 row(s)) is not a prompt-row key and is "
                                   "ignored (did you mean 'label'?); row keys are messages, prompt, label, tools, "
                                   "images, metadata"]
    records[2]["prompt"] = None
    pq.write_table(pa.Table.from_pylist(records), path)
    with pytest.raises(ValueError, match=f"{path}:row 2: row has neither 'messages' nor 'prompt'"):
        load_prompt_rows(path)


def test_a_sample_stops_reading_at_max_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "1+1="}\n' * 3 + b'{"prompt": "\xff"}\n')
    assert len(load_prompt_rows(path, max_rows=3)) == 3
    with pytest.raises(ValueError, match=f"{path}:4: not valid JSON .*UTF-8"):
        load_prompt_rows(path)


def run_rank0(tmp_path, model_dir, data_path, *sets):
    """molt.train as rank 0 of a 2-rank job whose other rank never comes: a rank 0 that reached
    the process group would wait there until the timeout."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, "-m", "molt.train", "--config", str(ROOT / "configs" / "demo.py"),
               "--set", f"model.path={model_dir}", "--set", f"data.train_path={data_path}",
               "--set", f"metrics.output_dir={tmp_path / 'run'}", "--set", "eval.every_steps=0"]
    for item in sets:
        command += ["--set", item]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_job_refuses_bad_prompts_before_the_process_group_starts(tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(20)])
    result = run_rank0(tmp_path, tiny_model_dir, path, "rollout.prompts_per_step=32")
    assert result.returncode == 2, result.stderr
    assert f"data.train_path='{path}' has 20 rows, fewer than rollout.prompts_per_step=32" in result.stderr

    with open(path, "a") as f:
        f.write('{"prompt": "9+9=", "label": {"value": 18}}\n')
    result = run_rank0(tmp_path, tiny_model_dir, path)
    assert result.returncode == 2, result.stderr
    assert f"data.train_path: {path}:21: 'label' must be a string or number, got {{'value': 18}}" in result.stderr
    assert "Traceback" not in result.stderr
