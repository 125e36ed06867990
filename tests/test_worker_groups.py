"""How the suite is spread over xdist workers (tests/worker_groups.py)."""

from types import SimpleNamespace

import pytest
from worker_groups import check_groups, order_for_workers, scope_of


def _item(nodeid: str, *fixtures: str, e2e: bool = False) -> SimpleNamespace:
    """Stands in for a pytest.Item: the three things the grouping reads."""
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                           get_closest_marker=lambda name: "mark" if e2e and name == "e2e" else None)


def test_a_group_is_one_scope_and_any_other_file_its_own():
    assert scope_of("tests/test_resume_e2e.py::test_a") == scope_of("tests/test_checkpoint_e2e.py::test_b[x]")
    assert scope_of("tests/test_resume_e2e.py::test_a") == "straight-run"
    assert scope_of("tests/test_config.py::test_a") == scope_of("tests/test_config.py::TestX::test_b")
    assert scope_of("tests/test_config.py::test_a") == "tests/test_config.py"


def test_a_shared_fixture_outside_its_group_is_refused_naming_the_file_and_the_group():
    check_groups([_item("tests/test_resume_e2e.py::test_a", "straight_run", "engine"),
                  _item("tests/test_config.py::test_a", "engine")])
    with pytest.raises(pytest.UsageError, match=r"tests/test_new\.py::test_a uses the session fixture 'moe_engine': "
                                                r"add 'test_new\.py' to GROUP_FILES\['moe-engine'\]"):
        check_groups([_item("tests/test_new.py::test_a", "moe_engine")])


def test_groups_then_files_with_e2e_tests_then_the_rest_each_file_in_order():
    items = [_item("tests/test_a.py::t1"), _item("tests/test_b.py::t1"), _item("tests/test_b.py::t2", e2e=True),
             _item("tests/test_a.py::t2"), _item("tests/test_routes.py::t1", "moe_engine")]
    order_for_workers(items)
    assert [item.nodeid for item in items] == [
        "tests/test_routes.py::t1", "tests/test_b.py::t1", "tests/test_b.py::t2", "tests/test_a.py::t1",
        "tests/test_a.py::t2"]
