"""The vision recipe in a real torchrun job: a ChatAgent sends each row's image through the OpenAI
SDK, the engine samples, the experience's images go into the rollout rank's payload store, the
trainer trains on them, the weights come back into the engine (its log-probs checked against the
trainer's), the eval runs on images; and molt.sft on image rows. On the generated, untrained tiny
Idefics3, so what is checked is the pipeline, not learning (the demo's figures are in docs/images.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_e2e import DEMO, ROOT, _metrics_rows, _torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def vision_data(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "tools"))
    from make_vision_data import make_vision_data

    return make_vision_data(tmp_path_factory.mktemp("vision-data"), num_train=64, num_eval=8, seed=0)


def test_the_vision_recipe_trains_on_images_through_the_openai_sdk(tmp_path, tiny_vlm_path, vision_data):
    out = tmp_path / "run"
    sets = {"model.path": tiny_vlm_path, "data.train_path": vision_data / "train.jsonl",
            "eval.data_path": vision_data / "eval.jsonl", "eval.every_steps": 2, "eval.n_samples": 2,
            "metrics.output_dir": out, "train.num_steps": 2, "rollout.prompts_per_step": 4,
            "rollout.n_samples_per_prompt": 4, "refit.check_every_steps": 2, "algorithm.filter_groups": False,
            "train.warmup_steps": 0, "agent.on_failed_rollout": "refill", "agent.max_refills_per_group": 4}
    done = _torchrun(2, f"{DEMO}:vision", [f"{key}={value}" for key, value in sets.items()], timeout_seconds=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = _metrics_rows(out)
    steps = [row for row in rows if "rollout/images" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        # One image per experience, counted from the light records; the trainer reloaded them all.
        # (At least 3 of the 4 groups: the random model samples its image token now and then, which
        # fails the rollout; refills make up for most.)
        assert row["rollout/images"] == row["rollout/consumed"] >= 12
        assert row["train/rank0_images"] == row["rollout/images"]
        assert row["rollout/image_bytes"] > row["rollout/images"] * 100_000  # its pixels: 3 tiles of 3x64x64 float32
    assert steps[-1]["refit/max_abs_logprob_diff"] < 1e-3
    # The controller got records, not images: well under the images' bytes.
    assert steps[-1]["controller/bytes_received_total"] < sum(row["rollout/image_bytes"] for row in steps) / 4
    evals = [row for row in rows if "eval/avg@2" in row]
    assert [row["step"] for row in evals] == [0, 2] and all(0 <= row["eval/avg@2"] <= 1 for row in evals)


def test_sft_trains_on_image_rows(tmp_path, tiny_vlm_path, vision_data):
    output = tmp_path / "warm"
    args = [sys.executable, "-m", "molt.sft", "--config", f"{DEMO}:sft_vision",
            "--set", f"model.path={tiny_vlm_path}", "--set", f"sft.data_path={vision_data / 'sft.jsonl'}",
            "--set", f"sft.output_dir={output}", "--set", "sft.num_steps=4", "--set", "sft.batch_size=8"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    settings = json.loads((output / "sft.json").read_text())["settings"]
    assert settings["sft"]["num_steps"] == 4 and settings["train"]["lr_multipliers"] == {
        "model.vision_model.": 3.0, "model.connector.": 3.0}
    from safetensors.torch import load_file

    before, after = load_file(tiny_vlm_path / "model.safetensors"), load_file(output / "model.safetensors")
    moved = [name for name in before if not before[name].equal(after[name])]
    assert any(name.startswith("model.vision_model.") for name in moved)  # the pixels reached the loss
    assert (output / "preprocessor_config.json").exists() or (output / "processor_config.json").exists()
