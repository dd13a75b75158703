"""Fixtures for the scheduler-backend tests."""

from tests.schedulers.dask_fixtures import dask_scheduler  # noqa: F401  (a fixture)
