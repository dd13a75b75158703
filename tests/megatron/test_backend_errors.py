"""A rank that dies is reported with its log, and the other ranks are stopped (real processes)."""

from __future__ import annotations

import pytest
import torch

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig, RankError
from tests.megatron.helpers import save_tiny_llama


@pytest.mark.timeout(90)
def test_rank_failure_raises_rank_error_with_log_tail(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", tied=False)
    with pytest.raises(RankError) as err:
        MegatronBackend(MegatronBackendConfig(
            hf_checkpoint=str(hf), tp_size=1 if torch.cuda.device_count() == 1 else 2,  # a rank per GPU
            loss_fn="no_such_module_xyz:grpo_loss",
            start_timeout_s=60, log_dir=str(tmp_path / "logs"),
        ))
    assert "no_such_module_xyz" in str(err.value) and "during 'init'" in str(err.value)


def test_parallel_sizes_are_checked(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", tied=False)
    with pytest.raises(ValueError, match=r"tp_size \(1\) and dp_size \(0\) must be 1 or more"):
        MegatronBackendConfig(hf_checkpoint=str(hf), dp_size=0)
    # every replica's share is normalised by the whole batch: the loss must take that count
    with pytest.raises(ValueError, match="dp_size=2 needs a loss_fn that takes num_tokens"):
        MegatronBackendConfig(hf_checkpoint=str(hf), dp_size=2, loss_fn="tests.megatron.helpers:grpo_loss_fallback")
