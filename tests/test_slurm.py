"""Slurm: the srun variable mapping, the host-list expander, the sbatch scripts (run against stub
`srun`/`scontrol`, down to the host file that places the 1T recipe's uneven nodes), and a real
two-process job started the way srun starts it, without torchrun."""

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt.config import load_config
from molt.distributed.placement import claim_gpus, find_placement_problems, format_tasks_per_node, place_ranks
from molt.distributed.slurm import expand_hostlist, expand_tasks_per_node, job_host, map_slurm_environment

pytestmark = pytest.mark.e2e  # starts vLLM engines or torchrun jobs: not in the unit tier

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.py")
QWEN3 = str(ROOT / "configs" / "qwen3_30b_a3b_math_tool.py")
MOE_1T = str(ROOT / "configs" / "moe_1t.py")
SCRIPTS = [ROOT / "launch" / "slurm.sbatch", ROOT / "launch" / "slurm_srun.sbatch"]
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("hostlist, expected", [
    ("localhost", ["localhost"]),
    ("127.0.0.1", ["127.0.0.1"]),
    ("node[01-02]", ["node01", "node02"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[1-2]-ib,b[009-010]", ["a1-ib", "a2-ib", "b009", "b010"]),
    ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
])
def test_expand_hostlist_gives_scontrols_order(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("hostlist", ["node[01-02", "node]01", "node[a-b]", "node[[1]]", ""])
def test_expand_hostlist_refuses_what_it_cannot_read(hostlist):
    with pytest.raises(ValueError, match="Slurm host list"):
        expand_hostlist(hostlist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert expand_tasks_per_node("2") == [2]
    with pytest.raises(ValueError, match="tasks per node"):
        expand_tasks_per_node("8x2")


def _task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """The variables srun gives one task of a two-node job with 8 tasks per node."""
    return {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
            "SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
            "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "123456",
            "PATH": "/usr/bin", **extra}


def test_srun_tasks_of_two_nodes_get_torchruns_variables():
    first, tenth = _task(0, 0, 0), _task(9, 1, 1)
    map_slurm_environment(first)
    map_slurm_environment(tenth)
    assert {key: first[key] for key in TORCHRUN_VARIABLES} == {
        "RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu007", "MASTER_PORT": "23456"}
    assert {key: tenth[key] for key in TORCHRUN_VARIABLES} == {
        "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu007", "MASTER_PORT": "23456"}


def test_uneven_nodes_and_the_steps_own_node_list():
    # A step on part of the allocation: task 0 runs on the step's first node, not the job's.
    environ = _task(8, 0, 1, SLURM_NTASKS="12", SLURM_STEP_TASKS_PER_NODE="8,4",
                    SLURM_STEP_NODELIST="gpu[010,012]", SLURM_JOB_NODELIST="gpu[007-012]")
    map_slurm_environment(environ)
    assert (environ["WORLD_SIZE"], environ["LOCAL_WORLD_SIZE"], environ["MASTER_ADDR"]) == ("12", "4", "gpu010")
    # Only --ntasks-per-node known: it counts for every node; SLURM_NODELIST is the last resort.
    environ = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4",
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "cn[3-4]"}
    map_slurm_environment(environ)
    assert (environ["LOCAL_WORLD_SIZE"], environ["MASTER_ADDR"]) == ("2", "cn3")
    assert "MASTER_PORT" not in environ  # no job id to derive it from: torch's own default applies


def test_srun_tasks_of_the_1t_layout_get_its_local_ranks():
    # srun --distribution=arbitrary from the host file: 8 tasks on each of 16 nodes, then 1 on each of 8.
    step = {"SLURM_NTASKS": "136", "SLURM_STEP_TASKS_PER_NODE": "8(x16),1(x8)", "SLURM_TASKS_PER_NODE": "8(x24)",
            "SLURM_STEP_NODELIST": "gpu[001-024]", "SLURM_JOB_ID": "77"}
    for procid, nodeid, localid, local_world_size in ((0, 0, 0, "8"), (127, 15, 7, "8"), (128, 16, 0, "1"),
                                                       (135, 23, 0, "1")):
        environ = {**step, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid), "SLURM_LOCALID": str(localid)}
        map_slurm_environment(environ)
        assert (environ["RANK"], environ["LOCAL_RANK"], environ["LOCAL_WORLD_SIZE"], environ["MASTER_ADDR"]) == (
            str(procid), str(localid), local_world_size, "gpu001")


def test_torchruns_variables_are_never_overridden():
    # Under `srun torchrun`, each rank inherits the Slurm task's variables and torchrun's own.
    torchrun = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
                "MASTER_ADDR": "gpu008", "MASTER_PORT": "41234"}
    environ = {**_task(0, 0, 0), **torchrun}
    before = dict(environ)
    map_slurm_environment(environ)
    assert environ == before
    # What the launch script exported is kept; the rest is mapped.
    environ = _task(3, 3, 0, MASTER_ADDR="10.0.0.7", MASTER_PORT="29400")
    map_slurm_environment(environ)
    assert (environ["RANK"], environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("3", "10.0.0.7", "29400")
    # Outside Slurm nothing is added.
    environ = {"PATH": "/usr/bin"}
    map_slurm_environment(environ)
    assert environ == {"PATH": "/usr/bin"}


class _FakeProbe:
    """Stands in for the UDP socket job_host connects to find its outgoing interface."""

    connected_to = None

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def connect(self, address):
        _FakeProbe.connected_to = address

    def getsockname(self):
        return ("10.0.0.5", 40000)


def test_job_host_is_loopback_on_one_node_and_routable_across_nodes(monkeypatch):
    assert job_host({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}) == "127.0.0.1"
    names = {"trainer-host": "10.0.0.9", "gpu007": "10.0.0.1"}
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-host")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: names[name])
    monkeypatch.setattr(socket, "socket", _FakeProbe)
    two_nodes = {"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16", "MASTER_ADDR": "gpu007", "MASTER_PORT": "23456"}
    assert job_host(two_nodes) == "10.0.0.9"
    assert _FakeProbe.connected_to is None
    # /etc/hosts maps the host name to loopback: use the interface that reaches MASTER_ADDR.
    names["trainer-host"] = "127.0.1.1"
    assert job_host(two_nodes) == "10.0.0.5"
    assert _FakeProbe.connected_to == ("10.0.0.1", 23456)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_sbatch_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert os.access(script, os.X_OK)


def _run_script(script: Path, args: list[str], slurm: dict[str, str], tmp_path: Path,
                hosts: str = "node01 node02") -> subprocess.CompletedProcess:
    """Run an sbatch script as the batch step would, with stub `scontrol` (the allocation is `hosts`)
    and `srun` that record what the script asked for: arguments, rendezvous, host file."""
    env = _script_env(slurm, tmp_path, hosts)
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)


def _script_env(slurm: dict[str, str], tmp_path: Path, hosts: str = "node01 node02") -> dict[str, str]:
    """The batch step's environment, with the stubs first on PATH. `scontrol requeue` is recorded in
    scontrol.calls; with STUB_SRUN_WAIT set, srun runs until SIGUSR1, records it in srun.signal and
    exits STUB_SRUN_EXIT."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "%s\\n" $STUB_HOSTS\n'
                                    '[ "$1" = requeue ] && echo "$*" >> "$STUB_DIR/scontrol.calls"\nexit 0\n')
    (stubs / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$STUB_DIR/srun.args"\n'
                                'echo "$MASTER_ADDR:$MASTER_PORT" > "$STUB_DIR/srun.master"\n'
                                'echo "${SLURM_NTASKS_PER_NODE:-unset}" > "$STUB_DIR/srun.ntasks_per_node"\n'
                                'echo "${OMP_NUM_THREADS:-unset}" > "$STUB_DIR/srun.omp"\n'
                                'if [ -n "${SLURM_HOSTFILE:-}" ]; then\n'
                                '  cp "$SLURM_HOSTFILE" "$STUB_DIR/srun.hosts"\n'
                                'fi\n'
                                'if [ -n "${STUB_SRUN_WAIT:-}" ]; then\n'
                                '  trap \'echo USR1 > "$STUB_DIR/srun.signal"; exit "$STUB_SRUN_EXIT"\' USR1\n'
                                '  touch "$STUB_DIR/srun.started"\n'
                                '  while :; do sleep 0.05; done\n'
                                'fi\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SLURM_") and key not in TORCHRUN_VARIABLES + ("CONFIG", "OMP_NUM_THREADS")}
    env.update(PATH=f"{stubs}{os.pathsep}{env['PATH']}", PYTHON=sys.executable, STUB_DIR=str(tmp_path),
               STUB_HOSTS=hosts, TMPDIR=str(tmp_path), MOLT_CHECKPOINTS=str(tmp_path / "absent"),
               SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[01-02]", **slurm)
    return env


def test_the_torchrun_script_splits_the_recipes_ranks_over_the_nodes(tmp_path):
    four_ranks = ["--set", "layout.num_rollout_ranks=3"]
    done = _run_script(SCRIPTS[0], [DEMO, *four_ranks], {"SLURM_NNODES": "2"}, tmp_path)
    assert done.returncode == 0, done.stderr
    srun = (tmp_path / "srun.args").read_text().splitlines()
    torchrun = srun[srun.index("torch.distributed.run") + 1:]
    assert torchrun == ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node01:24242",
                        "--rdzv_id=4242", "-m", "molt.train", "--config", DEMO, *four_ranks]
    assert {"--ntasks=2", "--ntasks-per-node=1"} <= set(srun)
    assert (tmp_path / "srun.omp").read_text().strip() == "1"  # a CPU recipe (molt.distributed.devices.omp_num_threads)
    # The recipe may also come from CONFIG; 3 ranks cannot be split over 2 nodes.
    (tmp_path / "srun.args").unlink()
    done = _run_script(SCRIPTS[0], ["--set", "layout.num_trainer_ranks=2"], {"SLURM_NNODES": "2", "CONFIG": DEMO},
                       tmp_path)
    assert done.returncode == 2
    assert "the recipe has 3 ranks" in done.stderr and "2 nodes cannot share evenly" in done.stderr
    assert not (tmp_path / "srun.args").exists()


def test_the_torchrun_script_takes_the_placements_nodes_and_refuses_uneven_ones(tmp_path):
    done = _run_script(SCRIPTS[0], [QWEN3], {"SLURM_NNODES": "2"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert {"--nnodes=2", "--nproc_per_node=8"} <= set((tmp_path / "srun.args").read_text().splitlines())
    # A GPU recipe's 8 ranks a node share its cores (torchrun would give each 1: offloaded AdamW on one core).
    assert (tmp_path / "srun.omp").read_text().strip() == str(max(1, len(os.sched_getaffinity(0)) // 8))
    (tmp_path / "srun.args").unlink()
    done = _run_script(SCRIPTS[0], [QWEN3], {"SLURM_NNODES": "3"}, tmp_path)
    assert done.returncode == 2
    assert "the layout needs 2 nodes of 8 processes but the job has 3; submit with --nodes=2" in done.stderr
    done = _run_script(SCRIPTS[0], [MOE_1T], {"SLURM_NNODES": "24"}, tmp_path)
    assert done.returncode == 2
    assert "which torchrun cannot start; submit launch/slurm_srun.sbatch with --nodes=24" in done.stderr
    assert not (tmp_path / "srun.args").exists()


def test_the_torchrun_script_passes_sigusr1_on_and_requeues_after_a_clean_stop(tmp_path):
    """Slurm's --signal=B:USR1@120 signals the batch shell only: the script passes SIGUSR1 to srun
    (which signals the job step), waits for srun, and requeues the job when the step exited 0 (the
    ranks wrote a checkpoint); a step that failed is not requeued."""
    for srun_exit in (0, 1):
        run_dir = tmp_path / f"exit{srun_exit}"
        run_dir.mkdir()
        env = {**_script_env({"SLURM_NNODES": "2"}, run_dir), "STUB_SRUN_WAIT": "1", "STUB_SRUN_EXIT": str(srun_exit)}
        script = subprocess.Popen(["bash", str(SCRIPTS[0]), DEMO, "--set", "layout.num_rollout_ranks=3"], env=env,
                                  cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (run_dir / "srun.started").exists():
                assert script.poll() is None, script.communicate()
                assert time.monotonic() < deadline, "the stub srun never started"
                time.sleep(0.05)
            script.send_signal(signal.SIGUSR1)
            stdout, stderr = script.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(script.pid, signal.SIGKILL)  # the stub srun too, should the script have left it
        assert script.returncode == srun_exit, stderr
        assert (run_dir / "srun.signal").read_text().strip() == "USR1"
        if srun_exit == 0:
            assert (run_dir / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]
            assert "stopped on SIGUSR1 after a checkpoint; requeueing job 4242" in stdout
        else:
            assert not (run_dir / "scontrol.calls").exists()


def test_a_requeued_job_resumes_and_torchrun_ignores_sigusr1(tmp_path):
    done = _run_script(SCRIPTS[0], [DEMO, "--set", "layout.num_rollout_ranks=3"],
                       {"SLURM_NNODES": "2", "SLURM_RESTART_COUNT": "1"}, tmp_path)
    assert done.returncode == 0, done.stderr
    srun = (tmp_path / "srun.args").read_text().splitlines()
    assert srun[-4:] == ["--set", "layout.num_rollout_ranks=3", "--set", "checkpoint.resume=auto"]
    assert not (tmp_path / "scontrol.calls").exists()  # no signal: no requeue
    # The step runs torchrun under a shell that ignores SIGUSR1; the ranks inherit that.
    wrapper = srun[srun.index("bash"):srun.index(sys.executable)]
    survive = "import os, signal; os.kill(os.getpid(), signal.SIGUSR1); print('alive')"
    probe = subprocess.run([*wrapper, sys.executable, "-c", survive], capture_output=True, text=True, timeout=60)
    assert (probe.returncode, probe.stdout.strip()) == (0, "alive"), probe.stderr
    probe = subprocess.run([sys.executable, "-c", survive], capture_output=True, text=True, timeout=60)
    assert probe.returncode == -signal.SIGUSR1  # what torchrun's agent would do without the wrapper


def test_the_srun_script_starts_one_task_per_rank(tmp_path):
    done = _run_script(SCRIPTS[1], [DEMO, "--set", "train.num_steps=1"], {"SLURM_NNODES": "1"}, tmp_path,
                       hosts="node01")
    assert done.returncode == 0, done.stderr
    srun = (tmp_path / "srun.args").read_text().splitlines()
    assert srun == ["--ntasks=2", "--distribution=arbitrary", "--kill-on-bad-exit=1", sys.executable, "-m",
                    "molt.train", "--config", DEMO, "--set", "train.num_steps=1"]
    assert (tmp_path / "srun.hosts").read_text().split() == ["node01", "node01"]
    assert (tmp_path / "srun.master").read_text().strip() == "node01:24242"
    assert (tmp_path / "srun.omp").read_text().strip() == "1"  # a CPU recipe: engines and trainers share the cores
    assert not list(tmp_path.glob("molt-hosts-*"))  # the host file is removed when the script ends
    (tmp_path / "srun.args").unlink()
    # A CPU recipe's ranks split over the allocation's nodes; a GPU layout needs its own node count.
    done = _run_script(SCRIPTS[1], [DEMO], {"SLURM_NNODES": "2"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "srun.hosts").read_text().split() == ["node01", "node02"]
    (tmp_path / "srun.args").unlink()
    done = _run_script(SCRIPTS[1], [MOE_1T], {"SLURM_NNODES": "2"}, tmp_path)
    assert done.returncode == 2
    assert "the layout needs 24 nodes" in done.stderr and "submit with --nodes=24" in done.stderr
    done = _run_script(SCRIPTS[1], [DEMO, "--set", "layout.num_rollout_ranks=2"], {"SLURM_NNODES": "2"}, tmp_path)
    assert done.returncode == 2 and "the recipe has 3 ranks" in done.stderr
    assert not (tmp_path / "srun.args").exists()


def _arbitrary_distribution(hostfile: list[str], job_id: str) -> list[dict[str, str]]:
    """The variables srun --distribution=arbitrary gives each task: task i on line i's host, nodes
    numbered in the order the step's hosts first appear, tasks numbered per node in task order."""
    hosts = list(dict.fromkeys(hostfile))
    counts = [hostfile.count(host) for host in hosts]
    tasks, seen = [], {host: 0 for host in hosts}
    for procid, host in enumerate(hostfile):
        tasks.append({"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(len(hostfile)),
                      "SLURM_NODEID": str(hosts.index(host)), "SLURM_LOCALID": str(seen[host]),
                      "SLURM_STEP_TASKS_PER_NODE": format_tasks_per_node(counts),
                      "SLURM_STEP_NODELIST": ",".join(hosts), "SLURM_JOB_ID": job_id, "SLURMD_NODENAME": host})
        seen[host] += 1
    return tasks


def test_the_srun_script_places_the_1t_layout_as_the_dry_run_does(tmp_path):
    """The script's host file, srun's arbitrary distribution and molt.train's variable mapping give
    every rank of the 1T recipe the host, LOCAL_RANK and GPUs of its placement."""
    hosts = [f"gpu{index:03d}" for index in range(1, 25)]
    done = _run_script(SCRIPTS[1], [MOE_1T], {"SLURM_NNODES": "24"}, tmp_path, hosts=" ".join(hosts))
    assert done.returncode == 0, done.stderr
    hostfile = (tmp_path / "srun.hosts").read_text().split()
    assert hostfile == [host for host in hosts[:16] for _ in range(8)] + hosts[16:]
    assert (tmp_path / "srun.args").read_text().splitlines()[:3] == [
        "--ntasks=136", "--distribution=arbitrary", "--kill-on-bad-exit=1"]
    assert (tmp_path / "srun.ntasks_per_node").read_text().strip() == "unset"
    placements = place_ranks(load_config(MOE_1T, []).layout)
    claims = _claims_of_srun_tasks(hostfile, placements)
    assert find_placement_problems(placements, claims) == []
    assert (claims[135].host, claims[135].local_rank, claims[135].gpus) == ("gpu024", 0, tuple("01234567"))
    # The same ranks started 8 per node, as --ntasks-per-node=8 would, are refused.
    claims = _claims_of_srun_tasks([host for host in hosts[:17] for _ in range(8)], placements)
    assert "rank 129 expected local rank 0 on node 17 but the launcher gave LOCAL_RANK=1" in (
        find_placement_problems(placements, claims))


def _claims_of_srun_tasks(hostfile: list[str], placements: list) -> list:
    """What each task started from `hostfile` reports at start-up, on nodes of 8 GPUs."""
    claims = []
    for task in _arbitrary_distribution(hostfile, "4242"):
        map_slurm_environment(task)
        claims.append(claim_gpus(placements[int(task["RANK"])], host=task["SLURMD_NODENAME"],
                                 local_rank=int(task["LOCAL_RANK"]), local_world_size=int(task["LOCAL_WORLD_SIZE"]),
                                 node_gpus=list("01234567"), on_gpu=True))
    return claims


def _free_job_id() -> str:
    """A job id whose derived MASTER_PORT (20000 + id % 10000) is free on this machine now."""
    for _ in range(50):
        job_id = random.randrange(1_000_000, 9_000_000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", 20000 + job_id % 10000))
            except OSError:
                continue
        return str(job_id)
    raise AssertionError("no free port in 20000-29999")


@pytest.mark.timeout(600)  # a two-task job given 300 s
def test_two_plain_srun_tasks_train_without_torchrun(tmp_path, tiny_model_dir, demo_data_dir):
    """Two processes with only the variables srun gives its tasks (one node, localhost): molt.train
    maps them, rendezvouses, and trains with the real vLLM CPU engine."""
    out = tmp_path / "run"
    sets = {"model.path": tiny_model_dir, "data.train_path": Path(demo_data_dir) / "train.jsonl",
            "metrics.output_dir": out, "train.num_steps": 2, "rollout.prompts_per_step": 2,
            "rollout.n_samples_per_prompt": 2, "train.warmup_steps": 0, "eval.every_steps": 0,
            "algorithm.filter_groups": False}  # the demo's warmup, eval and filtering do not fit 2 steps
    args = [sys.executable, "-m", "molt.train", "--config", DEMO]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "TORCHELASTIC_")) and key not in TORCHRUN_VARIABLES}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SLURM_NTASKS="2", SLURM_NNODES="1",
                SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=_free_job_id())
    # Output to files, not pipes: the tasks are polled together, so one that fails stops the other
    # (which would otherwise wait for it at the rendezvous) instead of the test waiting out the timeout.
    logs = [tmp_path / f"task{task}.log" for task in range(2)]
    tasks = []
    for task, log in enumerate(logs):
        with log.open("w") as output:
            tasks.append(subprocess.Popen(
                args, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                env={**base, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NODEID": "0"}))
    deadline = time.monotonic() + 300
    while any(task.poll() is None for task in tasks) and time.monotonic() < deadline:
        if any(task.returncode for task in tasks):
            break
        time.sleep(0.5)
    for task in tasks:
        if task.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(task.pid, signal.SIGKILL)
            task.wait()
    for index, (task, log) in enumerate(zip(tasks, logs)):
        assert task.returncode == 0, f"task {index} exited {task.returncode}:\n{log.read_text()[-4000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["step"] >= 1] == [1, 2]
    assert all(row["train/num_action_tokens"] > 0 for row in rows if row["step"] >= 1)
