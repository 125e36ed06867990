import sys
from pathlib import Path

import pytest

# Helpers beside this file import the same way under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))

from fixtures_models import build_cached_demo_data, build_cached_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The seed-0 "tiny" Qwen3 model directory (built once, cached outside git)."""
    return build_cached_tiny_model()


@pytest.fixture(scope="session")
def demo_data_dir() -> Path:
    """The seed-0 addition task: train/eval as .jsonl and .parquet (cached outside git)."""
    return build_cached_demo_data()


class EngineThread:
    """A real vLLM CPU engine (Molt's RolloutEngine) on an event loop in a background thread,
    shared by the tests of a session because engine start takes ~15-30 s here."""

    def __init__(self, model_dir: Path):
        import asyncio
        import threading

        from molt.config import MoltConfig
        from molt.engine import RolloutEngine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = MoltConfig()
        cfg.model.path = str(model_dir)
        cfg.rollout.max_length = 256

        async def start():
            return RolloutEngine.start(cfg, seed=0)

        self.engine = self.run(start())

    def run(self, coroutine, timeout_seconds: float = 300):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_seconds)

    def submit(self, coroutine):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def engine(tiny_model_dir) -> EngineThread:
    """One shared engine on the tiny model. Tests that change its weights must restore them."""
    thread = EngineThread(tiny_model_dir)
    yield thread
    thread.close()
