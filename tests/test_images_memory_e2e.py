"""Many screenshots per trajectory through a real torchrun job (tiny Idefics3, vLLM CPU): the images
stay in the rollout rank's payload store and reach the trainer rank that trains them; the
controller only gets light records, so neither the bytes it receives nor its memory grow with the
images. tools/bench/images.py runs the same job bigger (16 images x 64 rollouts) and prints the
figures; docs/benchmarks.md has them."""

import json
import statistics
import sys
from pathlib import Path

import pytest

from test_train_e2e import DEMO, _job_sets, _torchrun

sys.path.insert(0, str(Path(__file__).parent / "agents"))
from screenshot_env import write_prompts  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SCREEN_ENV = str(Path(__file__).parent / "agents" / "screenshot_env.py")
SCREENSHOTS = 7  # per rollout, after the prompt's own image: 8 images a trajectory
NUM_STEPS = 4
KIB = 1024


@pytest.fixture(scope="module")
def screenshot_job(tmp_path_factory, tiny_vlm_path, demo_data_dir):
    """4 steps of 8 prompts x 4 samples, each rollout 8 turns showing 8 distinct 64x64 images, on the
    demo layout: one trainer rank (rank 0, which is also the controller) and one rollout rank."""
    root = tmp_path_factory.mktemp("screenshots")
    prompts = write_prompts(root / "prompts.jsonl", num_rows=64, screenshots=SCREENSHOTS)
    sets = _job_sets(tiny_vlm_path, demo_data_dir, root / "run", **{
        "data.train_path": prompts, "agent.path": SCREEN_ENV, "agent.max_turns": SCREENSHOTS + 1,
        "train.num_steps": NUM_STEPS, "rollout.prompts_per_step": 8, "rollout.max_response_tokens": 4,
        "rollout.max_length": 1024,
        "refit.check_every_steps": 0, "train.learning_rate": 1e-4,
        # The random tiny model samples the <image> token now and then (1 of its 360), which fails the
        # rollout (sampled_image_token): refill it.
        "agent.on_failed_rollout": "refill", "agent.max_refills_per_group": 2})
    done = _torchrun(2, DEMO, sets, timeout_seconds=420)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] >= 1]
    assert [row["step"] for row in steps] == list(range(1, NUM_STEPS + 1))
    return steps


def test_every_trained_experience_carries_all_its_images(screenshot_job):
    for row in screenshot_job:
        trained = row["rollout/consumed"]
        assert trained >= 28 and row["rollout/segments_per_rollout"] == 1, row
        # No rollout has more than 1 + SCREENSHOTS images, so these totals mean each has all of them.
        assert row["rollout/images"] == (1 + SCREENSHOTS) * trained, row
        # One trainer rank trains the whole step: what it reloaded is every experience's images.
        assert row["train/rank0_images"] == row["rollout/images"], row
        assert row["rollout/image_bytes"] / trained > 1000 * KIB, row  # 8 x (5 tiles of 3x64x64 floats + PNG)
        assert row["train/num_action_tokens"] > 0, row


def test_image_bytes_stay_on_the_rollout_rank(screenshot_job):
    first, last = screenshot_job[0], screenshot_job[-1]
    # Every finished rollout's one experience went through the store (images are never inlined).
    finished = sum(row["rollout/num_rollouts"] - row["rollout/failed"] for row in screenshot_job)
    assert last["payloads/offloaded"] == finished and last["payloads/inlined"] == 0, last
    # Over steps 2..N the controller received well under 2 KiB per rollout (its outcome: the light
    # record, the rank's metrics; and the step's control messages), while each experience left
    # more than 1000 KiB of images at the rollout rank.
    received = last["controller/bytes_received_total"] - first["controller/bytes_received_total"]
    rollouts = sum(row["rollout/num_rollouts"] for row in screenshot_job[1:])
    image_bytes = sum(row["rollout/image_bytes"] for row in screenshot_job[1:])
    assert received / rollouts < 2 * KIB, (received, rollouts)
    assert received < image_bytes / 500, (received, image_bytes)


def test_controller_memory_does_not_grow_with_the_images(screenshot_job):
    """Trainer rank 0 is the controller's process in this layout. Its resident memory at the end of a
    step holds that step's reloaded images (~70 MB for 32 experiences), so it follows the step's
    size, and the allocator moves it by tens of MB either way: one step's figure is noise (CI saw
    1069, 984, 1075, 1076 MB). A process that kept every step's images would grow by a step's
    images each step; the least-squares slope over the steps must stay under half of that. One
    reading off by 90 MB moves the slope of 4 steps by at most 27 MB a step."""
    rss = [row["process/trainer_rank0_rss_bytes"] for row in screenshot_job]
    step_image_bytes = min(row["rollout/image_bytes"] for row in screenshot_job)
    assert slope(rss) < step_image_bytes / 2, (rss, step_image_bytes)


def slope(values: list[float]) -> float:
    """Least-squares slope of `values` against their index."""
    return statistics.linear_regression(range(len(values)), values).slope


def test_the_slope_tells_a_leak_from_noise():
    step = 71e6
    assert slope([1069e6, 984e6, 1075e6, 1076e6]) < step / 2  # seen in CI
    assert slope([945e6, 929e6, 910e6, 903e6]) < 0  # seen locally
    assert slope([1000e6 + k * step for k in range(4)]) == pytest.approx(step)  # a leak
    assert slope([1000e6, 1000e6 + step, 1000e6 + step, 1000e6 + 3 * step]) > step / 2  # a leak, one dip
