"""Shared fixtures for the ML tests: one tiny model directory per session."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from astraflow.models import init_model

    return str(init_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0))


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(1)
