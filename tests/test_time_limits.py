"""The suite's own rules (pytest.ini, tests/conftest.py): every test has a time limit, a test that
outlives it is named with where it hung and leaves no job behind, markers are registered, and a
test that uses the shared engine is e2e. Each case runs pytest on a generated test file."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HANGING = '''
import subprocess, sys
import pytest

JOB = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(worker.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(2)
def test_a_job_that_hangs(tmp_path):
    # A job in a session of its own whose worker is in another, as torchrun starts its ranks.
    job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True, start_new_session=True)
    with open({pids!r}, "w") as pids:
        pids.write(f"{{job.pid}} {{job.stdout.readline().strip()}}")
    job.wait()


def test_the_next_test_still_runs():
    pass
'''

ENGINE_USER = '''
import pytest


def test_uses_the_shared_engine(engine):
    pass


def test_plain():
    pass


@pytest.mark.e2ee
def test_misspelt_marker():
    pass
'''


def _pytest(test_file: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest with the repository's pytest.ini and tests/conftest.py on one generated file."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pytest.ini"), "--rootdir", str(test_file.parent),
               "-p", "conftest", "-p", "no:cacheprovider", str(test_file), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=test_file.parent, timeout=120)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# In one pytest process, and in a worker of two (pytest-xdist, as launch/test.sh --fast runs the unit tier).
@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one process", "xdist"])
def test_a_test_past_its_time_limit_is_named_with_its_stack_and_its_jobs_are_killed(tmp_path, workers):
    pids = tmp_path / "pids"
    test_file = tmp_path / "test_hanging.py"
    test_file.write_text(HANGING.format(pids=str(pids)))
    done = _pytest(test_file, "-q", *workers)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "FAILED test_hanging.py::test_a_job_that_hangs - Failed: Timeout (>2.0s)" in done.stdout
    assert "Failed: Timeout (>2.0s) from pytest-timeout." in done.stdout
    hung_at = HANGING.splitlines().index("    job.wait()") + 1
    assert f"test_hanging.py:{hung_at}: " in done.stdout  # where it hung, in its traceback
    assert "1 failed, 1 passed" in done.stdout  # the run went on
    job, worker = (int(pid) for pid in pids.read_text().split())
    deadline = time.monotonic() + 30  # SIGKILLed before the next test; generous for a loaded machine
    while (_alive(job) or _alive(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(job) and not _alive(worker), "the hung test's job outlived it"


def test_every_test_has_a_limit_engine_users_are_e2e_and_unknown_markers_are_refused(tmp_path):
    test_file = tmp_path / "test_markers.py"
    test_file.write_text(ENGINE_USER)
    done = _pytest(test_file, "--collect-only", "-m", "not e2e")
    assert done.returncode == 2 and "'e2ee' not found in `markers` configuration option" in done.stdout, done.stdout
    test_file.write_text(ENGINE_USER.replace("@pytest.mark.e2ee\n", ""))
    done = _pytest(test_file, "--collect-only", "-m", "not e2e")
    assert done.returncode == 0, done.stdout[-4000:]
    assert "timeout: 300.0s" in done.stdout and "timeout method: signal" in done.stdout
    assert "<Function test_plain>" in done.stdout and "test_uses_the_shared_engine" not in done.stdout
    assert "2/3 tests collected (1 deselected)" in done.stdout
