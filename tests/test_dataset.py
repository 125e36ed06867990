import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures_models import load_tool

from molt.dataset import PromptRow, build_prompt_loader, load_prompt_rows

make_demo_data = load_tool("make_demo_data")


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
            images=["a.png"],
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
