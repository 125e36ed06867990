import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

# Helpers beside this file import the same way under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))

from fixtures_models import build_cached_demo_data, build_cached_tiny_model  # noqa: E402
from shared_jobs import eight_prompts_data, evaluating_straight_run, straight_run  # noqa: E402, F401  (session jobs)
from worker_groups import check_groups, make_scheduler, order_for_workers  # noqa: E402


# Markers and the default time limit are in pytest.ini.

# Fixtures that start a vLLM engine: a test that uses one belongs to the e2e tier.
ENGINE_FIXTURES = {"engine", "endpoint", "moe_engine", "vlm_engine", "vlm_endpoint"}
# How long a test that outlived its time limit gets to unwind (its finally blocks and fixtures stop
# what it started) before the run is stopped hard, its processes killed.
TIMEOUT_GRACE_SECONDS = 60
HARD_STOP_KEY = pytest.StashKey[threading.Timer]()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """A test that uses the shared engine is e2e whatever its file says, so the fast tier never
    starts an engine; tests that start engines or torchrun jobs themselves mark their files e2e."""
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
    check_groups(items)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the order the files are handed out in
        order_for_workers(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With -n: a file, or a group of files sharing a session job or engine, per worker at a time
    (tests/worker_groups.py)."""
    return make_scheduler(config, log)


def _descendants(pid: int, started_after_ticks: int = 0) -> list[int]:
    """Every process under `pid` (started after `started_after_ticks`, in clock ticks since boot),
    from /proc: torchrun's ranks run in sessions of their own, so process groups do not find them."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append((int(entry), int(fields[19])))
    found, stack = [], [pid]
    while stack:
        for child, started_ticks in children.get(stack.pop(), []):
            if started_ticks >= started_after_ticks:
                found.append(child)
            stack.append(child)
    return found


def _now_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test stopped by its time limit leaves no job behind: the processes it started (torchrun
    jobs, engines, workers; not the session's fixtures, started before it) are killed."""
    started_ticks = _now_ticks()
    try:
        return (yield)
    except BaseException as error:
        if "from pytest-timeout" in str(error):
            _kill(_descendants(os.getpid(), started_after_ticks=started_ticks))
        raise


def pytest_timeout_set_timer(item, settings):
    """Back the signal method with a hard stop: a test the signal cannot interrupt (blocked in C
    code) is reported with every thread's stack, and its processes are killed before pytest exits."""
    import pytest_timeout

    def stop():
        item.config.get_terminal_writer().line(f"\n{item.nodeid} still running {TIMEOUT_GRACE_SECONDS} s past its "
                                               f"{settings.timeout} s time limit: killing its processes, stopping")
        _kill(_descendants(os.getpid()))
        pytest_timeout.timeout_timer(item, settings)  # dumps the stacks and exits

    timer = threading.Timer(settings.timeout + TIMEOUT_GRACE_SECONDS, stop)
    timer.name, timer.daemon = f"hard stop of {item.nodeid}", True
    timer.start()
    item.stash[HARD_STOP_KEY] = timer
    # None: pytest-timeout's own hook still sets the signal timer.


def pytest_timeout_cancel_timer(item):
    timer = item.stash.get(HARD_STOP_KEY, None)
    if timer is not None:
        timer.cancel()


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
def moe_model_dir() -> Path:
    """The seed-0 "moe" Qwen3-MoE model directory: 2 layers of 4 experts, top 2 (built once, cached)."""
    return build_cached_tiny_model(preset="moe")


@pytest.fixture(scope="session")
def tiny_vlm_path() -> Path:
    """The seed-0 "vlm" Idefics3 model directory with its processor: a square image is 20 <image>
    tokens (built once, cached)."""
    return build_cached_tiny_model(preset="vlm")


@pytest.fixture(scope="session")
def demo_data_dir() -> Path:
    """The seed-0 addition task: train/eval as .jsonl and .parquet (cached outside git)."""
    return build_cached_demo_data()


SHARED_ENGINE_KV_CACHE_GIGABYTES = 0.25  # the tiny model's ~262k tokens: the same on any machine
SHARED_ENGINE_MAX_NUM_SEQS = 64  # vLLM: 128; 64 of the burst test's prompts still exceed a step's 2048 tokens


class EngineThread:
    """A real vLLM CPU engine (Molt's RolloutEngine) on an event loop in a background thread,
    shared by the tests of a session because engine start takes ~15-30 s here."""

    def __init__(self, model_dir: Path):
        import asyncio
        import threading

        from molt.config import MoltConfig
        from molt.rollout.engine import RolloutEngine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = MoltConfig()
        cfg.model.path = str(model_dir)
        cfg.rollout.max_length = 256
        cfg.rollout.kv_cache_gigabytes = SHARED_ENGINE_KV_CACHE_GIGABYTES
        # A vLLM argument passed through (tests/test_engine.py checks it took effect); fewer running
        # requests also keep the tests that fill the scheduler short.
        cfg.rollout.engine_args = {"max_num_seqs": SHARED_ENGINE_MAX_NUM_SEQS}

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


@pytest.fixture(scope="session")
def moe_engine(moe_model_dir) -> EngineThread:
    """One shared engine on the tiny Qwen3-MoE, capturing routes (rollout.capture_routes is on for
    MoE by default). Tests that change its weights must restore them."""
    thread = EngineThread(moe_model_dir)
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def vlm_engine(tiny_vlm_path) -> EngineThread:
    """One shared engine on the tiny Idefics3 vision-language model."""
    thread = EngineThread(tiny_vlm_path)
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
def vlm_endpoint(vlm_engine) -> EndpointThread:
    """A real session endpoint over the shared vision-language engine."""
    thread = EndpointThread(vlm_engine)
    yield thread
    vlm_engine.run(thread.endpoint.stop())


@pytest.fixture(scope="session")
def tiny_tool_model_dir() -> Path:
    """"tiny" warm-started to call the calculator tool under every framework's tool declaration and
    then answer (tests/fixtures_models.py build_cached_tool_model; built once, ~1 min, cached)."""
    from fixtures_models import build_cached_tool_model

    return build_cached_tool_model()
