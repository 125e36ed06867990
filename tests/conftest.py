import sys
from pathlib import Path

import pytest

# Helpers beside this file import the same way under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))

from fixtures_models import build_cached_demo_data, build_cached_tiny_model  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (deselected on CPU by launch/test.sh)")
    config.addinivalue_line("markers", "e2e: starts vLLM engines or torchrun jobs (launch/test.sh --unit leaves them out)")


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> str:
    """A tied-embedding 2-layer Qwen3 with a 64-token vocabulary, for trainer-side tests (actor,
    critic): small enough for exact fp64 comparisons against naive per-token loops."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=128, vocab_size=64, max_position_embeddings=128,
        tie_word_embeddings=True, initializer_range=0.1,
    )
    path = tmp_path_factory.mktemp("tiny-qwen3")
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The seed-0 "tiny" Qwen3 model directory (built once, cached outside git)."""
    return build_cached_tiny_model()


@pytest.fixture(scope="session")
def tiny_tp_model_dir() -> Path:
    """"tiny" with two KV heads, so tensor parallelism of 2 splits whole heads (built once, cached)."""
    return build_cached_tiny_model(preset="tiny-tp")


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


class EndpointThread:
    """The session endpoint on the shared engine's loop; sessions are opened from test threads."""

    def __init__(self, engine: EngineThread):
        from molt.endpoint.server import SessionEndpoint

        self.engine_thread = engine
        self.endpoint = SessionEndpoint(engine.engine, engine.engine.tokenizer, model_name="molt-tiny")

        async def start():
            await self.endpoint.start()

        engine.run(start())

    def open_session(self, *, max_tokens: int = 16, temperature: float = 1.0, max_length: int = 256):
        from molt.agents.base import SamplingParams

        return self.endpoint.open_session(sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature),
                                          max_length=max_length)

    def close_session(self, session) -> None:
        self.endpoint.close_session(session)


@pytest.fixture(scope="session")
def endpoint(engine) -> EndpointThread:
    """A real session endpoint (aiohttp on loopback) over the shared real engine."""
    thread = EndpointThread(engine)
    yield thread
    engine.run(thread.endpoint.stop())


@pytest.fixture(scope="session")
def tiny_tool_model_dir() -> Path:
    """"tiny" warm-started to call the calculator tool under every framework's tool declaration and
    then answer (tests/fixtures_models.py build_cached_tool_model; built once, ~1 min, cached)."""
    from fixtures_models import build_cached_tool_model

    return build_cached_tool_model()
