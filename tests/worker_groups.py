"""How the suite is spread over pytest-xdist workers (`-n N`, which `launch/test.sh` passes).

A worker takes a file at a time, so a file's module-scoped jobs start once. Files whose tests share
a session-scoped job or engine go to one worker together, so that job starts once too: the session
straight runs take ~60 s of CPU each. The plain `engine` (~15 s) starts on each worker instead: most
files use it. Collection refuses a test whose file uses a shared fixture outside its group.

Files that start jobs or engines are handed out first, the groups before them, so that the longest
work starts early and the unit tests fill the gaps at the end (xdist's own order puts the files
with the most tests first, which are the unit tests).
"""

import pytest

# Session fixture -> the group of files that use it.
GROUP_OF_FIXTURE = {"straight_run": "straight-run", "evaluating_straight_run": "straight-run",
                    "moe_engine": "moe-engine", "vlm_engine": "vlm-engine", "vlm_endpoint": "vlm-engine",
                    "tiny_tool_model_dir": "tool-model"}
GROUP_FILES = {
    "straight-run": ["test_bench_smoke.py", "test_checkpoint_e2e.py", "test_eval_e2e.py", "test_resume_e2e.py",
                     "test_streaming_e2e.py"],
    "moe-engine": ["test_route_capture_e2e.py", "test_routes.py", "test_routing_replay.py"],
    "vlm-engine": ["test_images_e2e.py", "test_vision_trainer.py"],
    "tool-model": ["test_constraints_e2e.py", "test_frameworks_e2e.py"],
}
GROUP_OF_FILE = {file: group for group, files in GROUP_FILES.items() for file in files}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def scope_of(nodeid: str) -> str:
    """What one worker runs together: the file's group, or the file."""
    return GROUP_OF_FILE.get(file_of(nodeid), nodeid.split("::", 1)[0])


def check_groups(items: list[pytest.Item]) -> None:
    """Refuse a test that uses a shared session fixture from a file outside that fixture's group."""
    for item in items:
        for fixture in sorted(GROUP_OF_FIXTURE.keys() & set(getattr(item, "fixturenames", ()))):
            group = GROUP_OF_FIXTURE[fixture]
            if GROUP_OF_FILE.get(file_of(item.nodeid)) != group:
                raise pytest.UsageError(
                    f"{item.nodeid} uses the session fixture {fixture!r}: add {file_of(item.nodeid)!r} to "
                    f"GROUP_FILES[{group!r}] in tests/worker_groups.py, so the fixture starts on one worker")


def order_for_workers(items: list[pytest.Item]) -> None:
    """Grouped files first, then the other files with an e2e test, then the rest; each file's tests
    stay together and in order."""
    heavy = {file_of(item.nodeid) for item in items if item.get_closest_marker("e2e")}

    def rank(item: pytest.Item) -> int:
        file = file_of(item.nodeid)
        return 0 if file in GROUP_OF_FILE else 1 if file in heavy else 2

    items.sort(key=rank)


def make_scheduler(config: pytest.Config, log):
    """xdist's scheduler by scope, with a file's group (or the file) as the scope, in collection
    order; for `-n N` alone (xdist's --dist load, which would split a file's tests over workers).
    Another --dist is left to xdist."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # xdist is in the dev extra; only -n runs reach here

    class ByFileAndGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False  # keep order_for_workers' order
    return ByFileAndGroup(config, log)
