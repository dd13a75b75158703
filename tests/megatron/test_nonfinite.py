"""A step whose gradient is not finite (a nan behaviour log-prob) changes no weight on the
Megatron ranks and says so (``nonfinite_skipped``), as on the torch backend: the trainer counts
it, and the next publish is of finite weights."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from tests.megatron.helpers import MiniStore, grpo_batch, prompts, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.mark.timeout(300)
def test_a_nonfinite_step_changes_no_weight_and_is_reported(tmp_path):
    hf_dir = save_tiny_llama(tmp_path / "hf", tied=False)
    toks = prompts()
    with MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf_dir), lr=1e-3, start_timeout_s=300,
                                               step_timeout_s=300)) as be:
        before = {k: v.clone() for k, v in be.state_dict().items()}
        lp = be.logprobs(toks)
        lp[0, 6] = np.nan
        m = be.train_step(grpo_batch(toks, lp))
        assert m["nonfinite_skipped"] == 1.0 and not np.isfinite(m["grad_norm"])
        after = be.state_dict()
        assert all(bool((after[k] == v).all()) for k, v in before.items())
        good = be.train_step(grpo_batch(toks, be.logprobs(toks)))
        assert good["nonfinite_skipped"] == 0.0
        be.publish(MiniStore(tmp_path / "weights"), "p", 1)  # finite: published


def test_both_backends_default_to_the_same_optimiser():
    import dataclasses
    import inspect

    from astraflow.training.torch_backend import TorchBackend

    megatron = next(f for f in dataclasses.fields(MegatronBackendConfig) if f.name == "betas").default
    assert inspect.signature(TorchBackend.__init__).parameters["betas"].default == megatron
