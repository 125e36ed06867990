import base64
import io
import json

import numpy as np
import pytest
from fixtures_models import load_tool
from PIL import Image

from molt.controller.prompts import load_prompt_rows

make_vision_data = load_tool("make_vision_data")
make_demo_data = load_tool("make_demo_data")


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def decode_image(row, data_dir):
    """The row's image as a PIL image, from its data URI or its file beside the data."""
    url = row["messages"][0]["content"][0]["image_url"]["url"]
    if url.startswith("data:image/png;base64,"):
        return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert url.startswith("images/") and "images" not in row  # relative to the data file's directory
    return Image.open(data_dir / url)


@pytest.mark.parametrize("images", ["embed", "files"])
def test_rows_show_the_sum_their_label_holds(tmp_path, images):
    out = make_vision_data.make_vision_data(tmp_path, num_train=12, num_eval=5, seed=1, images=images)
    for split, num_rows in {"train": 12, "eval": 5}.items():
        rows = read_rows(out / f"{split}.jsonl")
        assert len(rows) == num_rows
        for row in rows:
            a, b = row["metadata"]["a"], row["metadata"]["b"]
            assert row["label"] == f"{a}+{b}={a + b}"
            image_part, text_part = row["messages"][0]["content"]
            assert image_part["type"] == "image_url" and text_part == {"type": "text", "text": make_vision_data.QUESTION}
            image = decode_image(row, out)
            image.load()  # decodes the whole PNG
            assert image.size == (make_vision_data.IMAGE_WIDTH, make_vision_data.IMAGE_HEIGHT)
            # The drawn image is the rendering of this row's problem, and it has ink on it.
            assert image.tobytes() == Image.open(io.BytesIO(make_vision_data.render_sum(a, b))).tobytes()
            assert (np.asarray(image) < 128).mean() > 0.05
    # Molt's loader accepts the rows as they are, and finds a file's image beside the data.
    loaded = load_prompt_rows(out / "eval.jsonl")
    assert [row.label for row in loaded] == [r["label"] for r in read_rows(out / "eval.jsonl")]
    url = loaded[0].messages[0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,") if images == "embed" else Image.open(url).size == (128, 64)


def test_rows_are_a_function_of_the_seed_and_match_the_text_demo(tmp_path):
    first = make_vision_data.make_vision_data(tmp_path / "first", num_train=16, num_eval=100, seed=3)
    again = make_vision_data.make_vision_data(tmp_path / "again", num_train=16, num_eval=100, seed=3)
    other = make_vision_data.make_vision_data(tmp_path / "other", num_train=16, num_eval=100, seed=4)
    for split in ("train", "eval"):
        assert (first / f"{split}.jsonl").read_bytes() == (again / f"{split}.jsonl").read_bytes()
        assert (first / f"{split}.jsonl").read_bytes() != (other / f"{split}.jsonl").read_bytes()
    # The same problems as the text demo's rows for the seed; the eval split holds each sum once.
    text = make_demo_data.make_demo_data(tmp_path / "text", num_train=16, num_eval=100, seed=3)
    for split in ("train", "eval"):
        problems = [(r["metadata"]["a"], r["metadata"]["b"]) for r in read_rows(first / f"{split}.jsonl")]
        assert problems == [(r["metadata"]["a"], r["metadata"]["b"]) for r in read_rows(text / f"{split}.jsonl")]
    eval_problems = {(r["metadata"]["a"], r["metadata"]["b"]) for r in read_rows(first / "eval.jsonl")}
    assert len(eval_problems) == 100


def test_each_sum_draws_a_different_image():
    images = {make_vision_data.render_sum(a, b) for a in range(10) for b in range(10)}
    assert len(images) == 100
    assert make_vision_data.render_sum(3, 5) == make_vision_data.render_sum(3, 5)


def test_files_layout_writes_each_image_once(tmp_path):
    out = make_vision_data.make_vision_data(tmp_path, num_train=40, num_eval=10, images="files")
    assert len(list((out / "images").glob("*.png"))) == 100
    with pytest.raises(ValueError, match="unknown images layout 'inline'"):
        make_vision_data.make_vision_data(tmp_path, images="inline")


def test_warm_start_rows_reply_with_the_equation_and_the_unsure_ones_miss_by_one_or_two(tmp_path):
    out = make_vision_data.make_vision_data(tmp_path, num_train=2000, num_eval=5)
    prompts = read_rows(out / "train.jsonl")
    sure, unsure = read_rows(out / "sft.jsonl"), read_rows(out / "sft_unsure.jsonl")
    assert len(sure) == len(unsure) == len(prompts)
    right = 0
    for prompt, sure_row, unsure_row in zip(prompts, sure, unsure):
        a, b = prompt["metadata"]["a"], prompt["metadata"]["b"]
        assert sure_row["messages"] == prompt["messages"] + [{"role": "assistant", "content": prompt["label"]}]
        assert unsure_row["messages"][:-1] == prompt["messages"]
        digits, _, result = unsure_row["messages"][-1]["content"].partition("=")
        assert digits == f"{a}+{b}"  # the digits are always read right
        assert int(result) >= 0 and abs(int(result) - (a + b)) <= 2
        right += int(result) == a + b
    assert abs(right / len(prompts) - make_vision_data.UNSURE_SHARE) < 0.04
    assert json.loads((out / "settings.json").read_text())["label"] == "equation"
