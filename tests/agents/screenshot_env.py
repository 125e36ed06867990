"""A test Env that shows a new screenshot at every turn, as a computer-use agent's environment would:
a 64x64 PNG of random pixels, different in every rollout and turn, shown with a one-line
observation. A prompt row with one image of its own and `metadata.screenshots` = 15 (write_prompts)
makes a rollout of agent.max_turns=16 carry 16 distinct images; the tiny Idefics3 reads each as
5 tiles (34 tokens with its markers). The reward varies within a group. Used by
tests/test_images_memory_e2e.py and tools/bench/images.py."""

import io
import json
import random
from pathlib import Path

from PIL import Image

from molt.agents import Env, Result, StepEnvRunner
from molt.trace.images import data_uri

SCREEN_SIZE = 64  # pixels a side: one global and 2 x 2 tiles in the tiny Idefics3


def screenshot(rng: random.Random) -> Image.Image:
    """Random pixels: every screenshot is a distinct image and its PNG does not compress (~12 kB)."""
    return Image.frombytes("RGB", (SCREEN_SIZE, SCREEN_SIZE), rng.randbytes(SCREEN_SIZE * SCREEN_SIZE * 3))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class ScreenshotEnv(Env):
    def __init__(self):
        self.rng = random.Random()  # seeded from the OS: no two rollouts see the same screens

    async def step(self, state):
        reward = float(len(state.action_text) % 2)
        if state.turn >= state.metadata["screenshots"]:
            return Result(reward=reward)
        return Result(reward=reward, terminated=False, observation=f"Screen {state.turn + 1}. Next?",
                      images=[screenshot(self.rng)])


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(ScreenshotEnv)


def write_prompts(path: Path, *, num_rows: int, screenshots: int, seed: int = 0) -> Path:
    """A JSONL prompt file for ScreenshotEnv: each row one screenshot of its own (an `images` data URI)
    and `metadata.screenshots` more to come, one per turn; a rollout then needs agent.max_turns >=
    screenshots + 1 to see them all."""
    rng = random.Random(seed)
    rows = [{"prompt": "Screen 0. What do you do?", "images": [data_uri(png(screenshot(rng)))], "label": "0",
             "metadata": {"screenshots": screenshots}} for _ in range(num_rows)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
