"""What the benchmark scripts share: importing repository files that are not in a package, above all
the tests' generated-asset cache (tests/fixtures_models.py: tiny models and demo data, built once
into $MOLT_CACHE_DIR), so a benchmark measures the same models the tests run."""

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_repo_module(relative_path: str, name: str) -> ModuleType:
    """Import a repo file that is not part of a package (tests/ and tools/ are scripts)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_test_fixtures() -> ModuleType:
    """tests/fixtures_models.py: the $MOLT_CACHE_DIR cache the tests use (tiny models, demo data)."""
    return load_repo_module("tests/fixtures_models.py", "molt_tests_fixtures_models")


def parse_with_smoke(parser, smoke_defaults: dict, argv: list[str] | None = None):
    """Parse the command line; with --smoke, `smoke_defaults` replace the defaults first (flags given
    on the command line still win). --smoke is the tiny setting CI runs (tests/test_bench_smoke.py):
    seconds, not a measurement, so the script cannot rot unseen."""
    parser.add_argument("--smoke", action="store_true",
                        help=f"CI's tiny setting (seconds; figures not meaningful): {smoke_defaults}")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke_defaults)
        args = parser.parse_args(argv)
    return args
