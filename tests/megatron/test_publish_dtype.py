"""The Megatron backend publishes bf16 shards with ``publish_dtype: bf16``: every floating
tensor of the version is the fp32 shard the ranks hold, cast to bf16, and the version maps to
the HF layout as an fp32 one does (TP=2 with tied embeddings: the fused, sharded layouts). Its
probe is of the bf16 weights, and computing it leaves the ranks' fp32 parameters as they were."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from astraflow.weightconv import megatron_to_hf  # noqa: E402
from storage.checkpoint import read_checkpoint  # noqa: E402
from tests.megatron.helpers import (  # noqa: E402
    MiniStore, grpo_batch, loss_fn_name, prompts, save_tiny_llama, torch_probe,
)

pytestmark = pytest.mark.megatron


@pytest.mark.timeout(150)
def test_bf16_shards_are_the_fp32_shards_cast(tmp_path):
    from transformers import AutoConfig

    tp = 2
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} on a GPU host needs {tp} GPUs")
    hf_dir = save_tiny_llama(tmp_path / "hf", tied=True)
    with MegatronBackend(MegatronBackendConfig(
        hf_checkpoint=str(hf_dir), tp_size=tp, lr=1e-3, loss_fn=loss_fn_name(), publish_dtype="bf16",
        start_timeout_s=120, step_timeout_s=120,
    )) as be:
        toks = prompts()
        be.train_step(grpo_batch(toks, be.logprobs(toks)))
        trained = be.logprobs(toks)
        wv = be.publish(MiniStore(tmp_path / "weights"), "p", 1)
        # the probe's rounding of the parameters is undone bit for bit
        assert np.array_equal(be.logprobs(toks), trained)
        (tmp_path / "fp32").mkdir()
        be._call("save", {"dir": str(tmp_path / "fp32")}, 120)  # the same weights, as the ranks hold them
    meta = json.loads(Path(wv.manifest_path).read_text())["meta"]
    assert meta["dtype"] == "bf16"
    bf16, fp32 = read_checkpoint(Path(wv.manifest_path).parent), read_checkpoint(tmp_path / "fp32")
    assert set(bf16) == set(fp32)
    for k, v in fp32.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert bf16[k].dtype == want.dtype and torch.equal(bf16[k], want), k
    cfg = AutoConfig.from_pretrained(hf_dir)
    hf16, hf32 = megatron_to_hf(bf16, cfg), megatron_to_hf(fp32, cfg)
    assert all(torch.equal(hf16[k], v.to(torch.bfloat16)) for k, v in hf32.items())
    # the probe is the torch path's on the bf16 version, nearer to it than to the fp32 weights
    got = np.asarray(meta["probe"]["logprobs"])
    err16 = np.abs(got - torch_probe(hf16, cfg)["logprobs"]).max()
    err32 = np.abs(got - torch_probe(hf32, cfg)["logprobs"]).max()
    assert err16 < 1e-4 and err16 < err32, (err16, err32)


def test_publish_dtype_is_checked():
    with pytest.raises(ValueError, match="publish_dtype must be fp32 or bf16"):
        MegatronBackendConfig(hf_checkpoint="/nonexistent", publish_dtype="fp16")
