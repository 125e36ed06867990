"""Agent worker processes (molt/rollout/agent_pool.py, molt/rollout/agent_worker.py): real worker processes
running real agent files against the real vLLM CPU engine and session endpoint of this test
process, which plays the rollout rank. Faults: a killed worker, a blocking agent, a worker
stuck past the rollout timeout, a rank that dies (RELIABILITY 8, 9, 12)."""

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from molt.config import MoltConfig
from molt.rollout.agent_pool import AgentWorkerPool
from test_payloads import Exploit

pytestmark = pytest.mark.e2e  # starts vLLM engines or torchrun jobs: not in the unit tier

ROOT = Path(__file__).resolve().parents[1]
FAULTS_AGENT = str(Path(__file__).parent / "agents" / "worker_faults.py")
TOOL_AGENT = str(ROOT / "configs" / "agents" / "addition_tool_openai.py")


def _request(rollout_id: int, group_id: int = 0, sample_index: int = 0, metadata: dict | None = None,
             max_tokens: int = 4) -> dict:
    """A rollout request as the controller sends it."""
    return {"rollout_id": rollout_id, "group_id": group_id, "sample_index": sample_index,
            "messages": [{"role": "user", "content": "3+5="}], "label": "8", "tools": None,
            "sampling": {"max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0}, "max_length": 256,
            "max_turns": 1, "policy_version": 0, "metadata": metadata}


def _start_pool(engine, endpoint, model_dir, agent_path: str, *, num_workers: int, timeout_seconds: float = 60.0,
                **pool_args) -> AgentWorkerPool:
    cfg = MoltConfig()
    cfg.model.path, cfg.agent.path = str(model_dir), agent_path
    cfg.rollout.num_agent_workers = num_workers
    cfg.agent.rollout_timeout_seconds = timeout_seconds

    async def start() -> AgentWorkerPool:
        pool = AgentWorkerPool(cfg, rank=1, **pool_args)
        kind = await pool.start()
        pool.attach(engine=engine.engine, endpoint=endpoint.endpoint if kind == "chat" else None)
        await pool.wait_ready()
        return pool

    return engine.run(start())


def _run_all(engine, pool, requests: list[dict]) -> list[dict]:
    async def run_all():
        return await asyncio.gather(*(pool.run(r) for r in requests))

    return engine.run(run_all(), 180)


def _served(directory: Path) -> list[tuple[int, int, int, int]]:
    """(pid, group_id, sample_index, vllm_imported) per rollout the faults agent ran."""
    path = directory / "served"
    return [tuple(int(x) for x in line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.fixture
def faults_dir(tmp_path, monkeypatch):
    """Where the faults agent keeps its markers; workers spawned after this inherit the variable."""
    monkeypatch.setenv("MOLT_TEST_FAULTS_DIR", str(tmp_path))
    return tmp_path


def test_env_rollouts_run_in_worker_processes_that_never_import_vllm(engine, endpoint, tiny_model_dir, faults_dir):
    pool = _start_pool(engine, endpoint, tiny_model_dir, FAULTS_AGENT, num_workers=2)
    try:
        outcomes = _run_all(engine, pool, [_request(i, group_id=0, sample_index=i) for i in range(8)])
    finally:
        engine.run(pool.close())
    tokenizer = engine.engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "3+5="}],
                                                            add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    for outcome in outcomes:
        assert outcome["failure"] == "", outcome["error"]
        (experience,) = outcome["experiences"]
        # The worker's own tokenizer rendered exactly what the engine's would.
        assert experience["token_ids"][:len(prompt)] == prompt
        assert experience["action_mask"] == [0] * len(prompt) + [1] * (len(experience["token_ids"]) - len(prompt))
        assert all(lp < 0 for lp, a in zip(experience["behavior_logprobs"], experience["action_mask"]) if a)
        # Nothing here blocks; the bound is generous for a loaded machine, where a worker can wait to run.
        assert 0 <= outcome["loop_lag_max_seconds"] < 5.0
    served = _served(faults_dir)
    pids = {pid for pid, *_ in served}
    assert len(served) == 8 and len(pids) == 2 and os.getpid() not in pids  # both workers took rollouts
    assert all(vllm_imported == 0 for *_, vllm_imported in served)
    assert not any(_alive(pid) for pid in pids), "a worker outlived pool.close()"


def test_chat_agents_open_their_sessions_on_the_rank_endpoint(engine, endpoint, tiny_model_dir):
    before = set(endpoint.endpoint.sessions)
    pool = _start_pool(engine, endpoint, tiny_model_dir, TOOL_AGENT, num_workers=1)
    try:
        outcomes = _run_all(engine, pool, [_request(i, max_tokens=8) for i in range(3)])
    finally:
        engine.run(pool.close())
    for outcome in outcomes:
        assert outcome["failure"] == "", outcome["error"]
        assert outcome["ledger"]["first_turn"] == 1
        assert all(sum(e["action_mask"]) > 0 for e in outcome["experiences"])
    assert set(endpoint.endpoint.sessions) == before  # each closed, its segments handed over


def test_crafted_pickles_sent_to_the_worker_socket_never_run(engine, endpoint, tiny_model_dir, faults_dir, tmp_path):
    """The rank's worker socket decodes msgpack from its own workers only: frames from a stranger
    (here crafted pickles) are dropped undecoded and the pool keeps serving."""
    import pickle

    import zmq

    marker = tmp_path / "pickle-ran"
    pool = _start_pool(engine, endpoint, tiny_model_dir, FAULTS_AGENT, num_workers=1)
    context = zmq.Context()
    stranger = context.socket(zmq.DEALER)
    try:
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(pool.address)
        evil = pickle.dumps(Exploit(marker))
        for frames in ([evil], [pickle.dumps({"type": "outcome", "rollout_id": Exploit(marker)})], [b"", evil]):
            stranger.send_multipart(frames)
        outcomes = _run_all(engine, pool, [_request(100 + i, group_id=7, sample_index=i) for i in range(2)])
    finally:
        stranger.close(0)
        context.term()
        engine.run(pool.close())
    assert not marker.exists()
    assert [o["failure"] for o in outcomes] == ["", ""], outcomes


def test_a_killed_worker_fails_its_rollouts_and_a_restarted_one_serves_the_next(
        engine, endpoint, tiny_model_dir, faults_dir, caplog):
    pool = _start_pool(engine, endpoint, tiny_model_dir, FAULTS_AGENT, num_workers=2)
    try:
        with caplog.at_level(logging.WARNING, logger="molt"):
            first = _run_all(engine, pool, [_request(i, group_id=1, sample_index=i) for i in range(6)])
        killed_pid = int((faults_dir / "killed").read_text())
        died = [o for o in first if o["failure"] == "agent_worker_died"]
        assert died and all(o["failure"] in ("", "agent_worker_died") for o in first), first
        assert 0 in {o["rollout_id"] for o in died}  # the rollout that killed it
        assert all(f"(pid {killed_pid}) died with exit code -9" in o["error"] for o in died)
        assert f"agent worker 0 (pid {killed_pid}) died with exit code -9" in caplog.text
        assert f"its {len(died)} in-flight rollouts fail as agent_worker_died; restarting it" in caplog.text

        async def restarted_ready():
            while not all(w.ready and w.alive for w in pool.workers):
                await asyncio.sleep(0.1)

        engine.run(asyncio.wait_for(restarted_ready(), 120))
        later = _run_all(engine, pool, [_request(10 + i, group_id=2, sample_index=i) for i in range(6)])
    finally:
        engine.run(pool.close())
    assert all(o["failure"] == "" for o in later), later
    later_pids = {pid for pid, group, *_ in _served(faults_dir) if group == 2}
    assert len(later_pids) == 2 and killed_pid not in later_pids  # the replacement took some of them
    assert not _alive(killed_pid)


def test_a_blocking_agent_is_reported_and_its_loop_lag_measured(engine, endpoint, tiny_model_dir, faults_dir, capfd):
    pool = _start_pool(engine, endpoint, tiny_model_dir, FAULTS_AGENT, num_workers=1)
    try:
        capfd.readouterr()
        (blocked,) = _run_all(engine, pool, [_request(0, metadata={"block_seconds": 1.5})])
        (quiet,) = _run_all(engine, pool, [_request(1)])
        worker_pid = pool.workers[0].process.pid
    finally:
        engine.run(pool.close())
    assert blocked["failure"] == "" and blocked["loop_lag_max_seconds"] >= 1.4, blocked
    assert quiet["loop_lag_max_seconds"] < 1.4  # measured since the previous outcome, not carried over from it
    stderr = capfd.readouterr().err  # the worker logs to the stderr it inherited
    assert f"agent worker 0 of rollout rank 1 (pid {worker_pid}): event loop blocked for 1." in stderr, stderr
    assert "user agent code is blocking the event loop" in stderr


def test_a_worker_stuck_past_the_rollout_timeout_is_killed_and_replaced(engine, endpoint, tiny_model_dir,
                                                                        faults_dir):
    pool = _start_pool(engine, endpoint, tiny_model_dir, FAULTS_AGENT, num_workers=1, timeout_seconds=5.0,
                       stuck_grace_seconds=1.0)
    try:
        started = time.monotonic()
        (stuck,) = _run_all(engine, pool, [_request(0, metadata={"block_seconds": 60})])
        stuck_seconds = time.monotonic() - started
        (after,) = _run_all(engine, pool, [_request(1)])
    finally:
        engine.run(pool.close())
    assert stuck["failure"] == "agent_worker_died" and "blocks its event loop" in stuck["error"], stuck
    # Killed once it held the rollout past the timeout + the grace (6 s), long before its 60 s block
    # ends; the upper bound is generous for a loaded machine.
    assert 6.0 <= stuck_seconds < 45
    assert after["failure"] == "", after["error"]
    assert pool.workers[0].incarnation == 1


WORKERS_OF_A_DYING_RANK = """
import asyncio, sys
from molt.config import MoltConfig
from molt.rollout.agent_pool import AgentWorkerPool

async def main():
    cfg = MoltConfig()
    cfg.agent.path = sys.argv[1]
    cfg.rollout.num_agent_workers = 2
    pool = AgentWorkerPool(cfg, rank=1)
    await pool.start()
    await pool.wait_ready()
    print(" ".join(str(w.process.pid) for w in pool.workers), flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_workers_do_not_outlive_a_rank_killed_with_sigkill(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(WORKERS_OF_A_DYING_RANK)
    socket_dir = tempfile.mkdtemp()  # the killed rank leaves its socket directory behind: in here
    rank = subprocess.Popen([sys.executable, str(script), TOOL_AGENT], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "TMPDIR": socket_dir})
    try:
        pids = [int(pid) for pid in rank.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait(30)
        shutil.rmtree(socket_dir, ignore_errors=True)
    deadline = time.monotonic() + 30  # they go within a second; generous for a loaded machine
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "agent workers outlived their rank"
