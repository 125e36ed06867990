"""Build the generated test assets (tiny model, demo data) once and cache them outside git.

Assets live under $MOLT_CACHE_DIR (default ~/.cache/molt). Each directory name carries a hash
of its generator's source, so editing a generator makes a fresh directory instead of reusing a
stale one. Directories are built in a temporary sibling and renamed into place, so a crashed or
concurrent build never leaves a half-written asset behind.
"""

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

TOOLS_DIR = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py as a module (tools/ is scripts, not a package)."""
    path = TOOLS_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"molt_tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_root() -> Path:
    return Path(os.environ.get("MOLT_CACHE_DIR", Path.home() / ".cache" / "molt"))


def generator_version(tool_name: str) -> str:
    """Short hash of a generator's source: the cache key for what it writes."""
    return hashlib.sha256((TOOLS_DIR / f"{tool_name}.py").read_bytes()).hexdigest()[:10]


def build_cached(target: Path, build: Callable[[Path], object]) -> Path:
    """Return `target`, first running `build(dir)` into a temp dir renamed to it if missing."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the asset is meant to be shared
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_cached_tiny_model(*, preset: str = "tiny", seed: int = 0) -> Path:
    version = generator_version("make_tiny_model")
    target = cache_root() / "models" / f"{preset}-seed{seed}-{version}"
    tool = load_tool("make_tiny_model")
    return build_cached(target, lambda out_dir: tool.make_tiny_model(out_dir, preset=preset, seed=seed))


def build_cached_demo_data(*, seed: int = 0) -> Path:
    """The demo task in both formats: train/eval .jsonl and .parquet side by side."""
    version = generator_version("make_demo_data")
    target = cache_root() / "data" / f"demo-seed{seed}-{version}"
    tool = load_tool("make_demo_data")

    def build(out_dir: Path) -> None:
        for file_format in ("jsonl", "parquet"):
            tool.make_demo_data(out_dir, seed=seed, file_format=file_format)

    return build_cached(target, build)
