"""The test suite's own distribution: under pytest-xdist (`--dist loadgroup`, pyproject.toml)
the tests sharing a module fixture run on one worker, so the fixture is built once
(`conftest.pytest_collection_modifyitems` marks them). pytest 9.2 silently broke this with
pytest-xdist 3.8 (its issue #1386): every worker then built the fixtures, the demo run too."""

from __future__ import annotations

import os

import pytest

BUILT = []


@pytest.fixture(scope="module")
def shared() -> int:
    BUILT.append(os.environ.get("PYTEST_XDIST_WORKER"))
    return len(BUILT)


@pytest.mark.parametrize("i", range(4))
def test_a_module_fixture_is_built_once_for_its_tests(request, shared, i):
    assert shared == 1
    # A worker of `--dist loadgroup` (pytest-xdist sets `loadgroup` there) appends the group to
    # the node id it reports, and the scheduler groups by that suffix.
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getoption("loadgroup", False):
        assert request.node.nodeid.endswith("@tests.test_xdist_groups"), request.node.nodeid
