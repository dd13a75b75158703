"""Fixtures of the workload tests."""

import pytest

from astraflow.workloads import mathcheck


@pytest.fixture(autouse=True, scope="module")
def _stop_math_verify_workers():
    """The math_verify reward starts worker processes on first use: a module's tests stop them."""
    yield
    mathcheck.close()
