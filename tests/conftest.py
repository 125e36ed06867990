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
