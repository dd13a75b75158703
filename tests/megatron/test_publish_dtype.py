"""The Megatron backend publishes bf16 shards with ``publish_dtype: bf16``: every floating
tensor of the version is the fp32 shard the ranks hold, cast to bf16, and the version maps to
the HF layout as an fp32 one does (TP=2 with tied embeddings: the fused, sharded layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from astraflow.weightconv import megatron_to_hf  # noqa: E402
from storage.checkpoint import read_checkpoint  # noqa: E402
from tests.megatron.helpers import MiniStore, grpo_batch, loss_fn_name, prompts, save_tiny_llama  # noqa: E402

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
        wv = be.publish(MiniStore(tmp_path / "weights"), "p", 1)
        (tmp_path / "fp32").mkdir()
        be._call("save", {"dir": str(tmp_path / "fp32")}, 120)  # the same weights, as the ranks hold them
    assert json.loads(Path(wv.manifest_path).read_text())["meta"]["dtype"] == "bf16"
    bf16, fp32 = read_checkpoint(Path(wv.manifest_path).parent), read_checkpoint(tmp_path / "fp32")
    assert set(bf16) == set(fp32)
    for k, v in fp32.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert bf16[k].dtype == want.dtype and torch.equal(bf16[k], want), k
    cfg = AutoConfig.from_pretrained(hf_dir)
    hf16, hf32 = megatron_to_hf(bf16, cfg), megatron_to_hf(fp32, cfg)
    assert all(torch.equal(hf16[k], v.to(torch.bfloat16)) for k, v in hf32.items())


def test_publish_dtype_is_checked():
    with pytest.raises(ValueError, match="publish_dtype must be fp32 or bf16"):
        MegatronBackendConfig(hf_checkpoint="/nonexistent", publish_dtype="fp16")
