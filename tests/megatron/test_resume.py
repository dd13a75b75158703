"""The Megatron backend resumes: a committed version loads into a new backend (any TP size), its
optimiser state round-trips through ``torch.save`` / ``torch.load(weights_only=True)`` and the
next step is the uninterrupted run's, also under another TP size (the moments cut again for
it), a state of another backend is refused (the ranks keep running), and a ``Trainer`` on a
megatron config continues from its latest committed version.

Real rank processes over gloo and the real ``WeightStore``; the data layer is the recorder the
trainer-loop tests use. Tolerance as the parity tests: 1e-4 nats per token.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from storage.weights import WeightStore  # noqa: E402
from tests.megatron.helpers import grpo_batch, hf_logprobs, loss_fn_name, prompts, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.megatron
TOL = 1e-4


def _backend(hf_dir, tp: int) -> MegatronBackend:
    return MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf_dir), tp_size=tp, lr=1e-3, loss_fn=loss_fn_name(),
                                                 start_timeout_s=120, step_timeout_s=120))


def _roundtrip(state: dict) -> dict:
    """Through ``torch.save`` and back the way the trainer reads it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """TP=2, tied embeddings: two steps, v2 committed, its optimiser state saved, then the
    uninterrupted third step. A new TP=2 backend resumes from v2 and the saved state and takes
    the same third step; a TP=1 backend loads v2, takes the third step with fresh moments, then
loads v2 again with the TP=2 optimiser state and takes it again."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("TP=2 on a GPU host needs 2 GPUs (NCCL, one per rank); CPU hosts run it over gloo")
    tmp = tmp_path_factory.mktemp("resume")
    hf_dir = save_tiny_llama(tmp / "hf", tied=True)
    store = WeightStore(tmp / "weights", keep_last=5)
    toks = prompts()
    out: dict = {"toks": toks, "hf_dir": hf_dir}
    with _backend(hf_dir, 2) as a:
        for step in (1, 2):
            a.train_step(grpo_batch(toks, a.logprobs(toks), seed=step))
        a.publish(store, "p", 2)
        out["v2_logprobs"], out["v2_state"] = a.logprobs(toks), a.state_dict()
        out["saved_optimizer"] = _roundtrip(a.optimizer_state())
        out["batch3"] = grpo_batch(toks, out["v2_logprobs"], seed=3)
        a.train_step(out["batch3"])
        out["uninterrupted"] = a.state_dict()
    committed = store.load("p", 2)
    out["committed"] = committed
    with _backend(hf_dir, 2) as b:
        b.load_state_dict(committed)
        out["resumed_logprobs"], out["resumed_state"] = b.logprobs(toks), b.state_dict()
        b.load_optimizer_state(out["saved_optimizer"])
        b.train_step(out["batch3"])
        out["resumed_step"] = b.state_dict()
    with _backend(hf_dir, 1) as c:
        c.load_state_dict(committed)
        out["tp1_logprobs"] = c.logprobs(toks)
        with pytest.raises(ValueError) as err:
            c.load_optimizer_state({"state": {}, "param_groups": []})  # the torch backend's kind
        out["foreign_error"] = str(err.value)
        c.train_step(out["batch3"])  # refused without harm: the ranks go on, with fresh moments
        out["fresh_moments_step"] = c.state_dict()
        c.load_state_dict(committed)
        c.load_optimizer_state(out["saved_optimizer"])  # saved under TP=2
        c.train_step(out["batch3"])
        out["tp1_resumed_step"] = c.state_dict()
        c.load_state_dict({k: v.to(torch.bfloat16) for k, v in out["v2_state"].items()})
        out["bf16_loaded"] = c.state_dict()
    return out


@pytest.mark.timeout(300)
def test_a_committed_version_loads_into_a_new_backend(runs):
    assert _max_diff(runs["resumed_state"], runs["v2_state"]) == 0.0  # fp32 version: the exact weights
    assert np.abs(runs["resumed_logprobs"] - runs["v2_logprobs"]).max() < TOL
    # gathered under HF names: an HF Llama holding them computes the trainer's log-probs
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(runs["hf_dir"])
    assert np.abs(hf_logprobs(runs["v2_state"], cfg, runs["toks"]) - runs["v2_logprobs"]).max() < TOL


@pytest.mark.timeout(300)
def test_the_saved_optimiser_state_continues_with_the_same_step(runs):
    saved = runs["saved_optimizer"]
    assert saved["layout"] == {"tensor_parallel": 2, "data_parallel": 1, "pipeline_parallel": 1}
    assert len(saved["ranks"]) == 2
    moments = saved["ranks"][0]["state"]["embedding.word_embeddings.weight"]
    assert int(moments["step"]) == 2 and moments["exp_avg"].shape == (160, 64)  # rank 0's half of the vocabulary
    moved = _max_diff(runs["uninterrupted"], runs["v2_state"])
    assert moved > 1e-4  # the third step really moved the weights
    assert _max_diff(runs["resumed_step"], runs["uninterrupted"]) < 1e-6
    # with fresh moments the same step lands elsewhere: the saved ones made the difference
    assert _max_diff(runs["fresh_moments_step"], runs["uninterrupted"]) > 100 * 1e-6


@pytest.mark.timeout(300)
def test_a_layout_change_loads_the_weights_and_the_moments(runs):
    assert np.abs(runs["tp1_logprobs"] - runs["v2_logprobs"]).max() < TOL  # weights reshard to any TP size
    # the TP=2 moments, cut again for TP=1, take the uninterrupted step (to float rounding of
    # the other reduction order); fresh moments land far from it
    assert _max_diff(runs["tp1_resumed_step"], runs["uninterrupted"]) < 1e-5
    assert _max_diff(runs["fresh_moments_step"], runs["uninterrupted"]) > 100 * 1e-5
    assert "not an optimiser state of the Megatron backend" in runs["foreign_error"]


@pytest.mark.timeout(300)
def test_bf16_weights_are_upcast_into_the_fp32_parameters(runs):
    want = {k: v.to(torch.bfloat16).float() for k, v in runs["v2_state"].items()}
    got = runs["bf16_loaded"]
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(300)
def test_a_resumed_trainer_continues_from_its_latest_committed_version(tmp_path):
    """A megatron trainer stopped at v2 (optimiser state saved, versions published in bf16):
    a new one on the same directories starts at v2 with the fp32 master weights and the saved
    moments, and its next step is the one the first trainer would have taken. The ranks log to
    the trainer's ``log_dir`` (a run's logs directory), the backend works in the worker's private
    directory (Dask's ``temporary-directory``) and removes its work directory when closed."""
    import dask
    from transformers import AutoConfig, LlamaForCausalLM

    from astraflow.training.config import TrainerConfig
    from astraflow.training.trainer import Trainer
    from tests.training.test_trainer_loop import _DataLayer

    hf_dir = save_tiny_llama(tmp_path / "hf", tied=False)
    toks = prompts()
    hf_sd = {k: v.detach() for k, v in LlamaForCausalLM.from_pretrained(hf_dir).state_dict().items()}
    batch = grpo_batch(toks, hf_logprobs(hf_sd, AutoConfig.from_pretrained(hf_dir), toks))
    cfg = TrainerConfig(backend="megatron", lr=1e-3, optimizer_checkpoint_every=1, publish_dtype="bf16")

    def trainer() -> Trainer:
        return Trainer(policy="p", cfg=cfg, model_path=str(hf_dir), weights_root=str(tmp_path / "weights"),
                       keep_versions=5, data_layer=_DataLayer(batch), max_steps=10,
                       optimizer_path=str(tmp_path / "trainer_state" / "p" / "optimizer.pt"),
                       log_dir=str(tmp_path / "logs" / "trainer-p"))

    private = tmp_path / "private"
    private.mkdir()
    first = trainer()
    try:
        with dask.config.set({"temporary-directory": str(private)}):
            assert first.start(run_loop=False) == 0
        workdir = first.backend._workdir
        assert workdir.parent == private and workdir.is_dir()
        assert (tmp_path / "logs" / "trainer-p" / "megatron-rank0.log").exists()
        first.step()
        first.step()
        first.save_optimizer()  # what stop() saves: v2's optimiser state (with the master weights)
        master = first.backend.state_dict()
        first.backend.train_step(batch)  # the step an uninterrupted run takes next
        uninterrupted = first.backend.state_dict()
    finally:
        first.backend.close()
    assert not workdir.exists()
    assert WeightStore(tmp_path / "weights").versions("p") == [0, 1, 2]

    second = trainer()
    try:
        assert second.start(run_loop=False) == 2
        assert second.state()["optimizer_resumed_from"] == 2
        assert _max_diff(second.backend.state_dict(), master) == 0.0  # not the bf16-rounded version
        second.step()
        assert second.state()["version"] == 3
        assert _max_diff(second.backend.state_dict(), uninterrupted) < 1e-6
    finally:
        second.backend.close()


@pytest.mark.timeout(300)
def test_a_version_megatron_published_resumes_on_the_torch_backend(runs):
    """A run may change ``trainer.backend`` when it resumes: the torch backend reads the
    Megatron checkpoint names of the committed version."""
    import shutil

    from astraflow.models import build_tokenizer
    from astraflow.training.torch_backend import TorchBackend

    model = Path(shutil.copytree(runs["hf_dir"], runs["hf_dir"].with_name("hf_with_tokenizer")))
    build_tokenizer().save_pretrained(model)  # the test model has none; the backend loads one
    tb = TorchBackend(str(model), device="cpu")
    tb.load_state_dict(runs["committed"])
    assert _max_diff(tb.state_dict(), runs["v2_state"]) == 0.0
