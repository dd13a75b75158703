import copy
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import storage.weights as weights_mod
from astraflow.batches import Batch, BatchItem
from astraflow.contracts import Sequence, WeightVersion
from astraflow.training.grpo import token_logprobs
from astraflow.training.torch_backend import TorchBackend


def _batch(model, tok, rewards=(1.0, 0.0, 0.0, 1.0)):
    """A GRPO group of four completions of one prompt with their true behaviour log-probs."""
    prompt = tok("12+34=")["input_ids"]
    comps = [tok("46")["input_ids"], tok("47")["input_ids"], tok("5")["input_ids"], tok("46")["input_ids"]]
    seqs = []
    for c, r in zip(comps, rewards):
        c = c + [tok.eos_token_id]
        toks = torch.tensor([prompt + c])
        dev_toks = toks.to(model.device)  # the backend's device (a GPU where there is one)
        with torch.no_grad():
            lp = token_logprobs(model, dev_toks, torch.ones_like(dev_toks))[0].cpu().numpy()
        gen = np.arange(len(prompt) + len(c)) >= len(prompt)
        seqs.append(Sequence.build(toks[0].numpy(), gen, np.where(gen, lp, 0.0), np.where(gen, 0, -1),
                                   np.where(gen, 0, -1), r))
    mean = float(np.mean(rewards))
    std = float(np.std(rewards))
    items = tuple(BatchItem(sequence=s, loss_mask=s.loss_mask, group_mean=mean, group_std=std,
                            group_size=len(seqs), staleness=0, task_id=f"g/{i}") for i, s in enumerate(seqs))
    return Batch(policy="p", version=0, items=items)


def _seq_logprob(model, seq):
    t = torch.tensor([seq.tokens.tolist()], dtype=torch.long, device=model.device)
    with torch.no_grad():
        lp = token_logprobs(model, t, torch.ones_like(t))[0].cpu().numpy()
    return float(lp[seq.loss_mask].sum())


def test_train_step_moves_probability_towards_rewarded(tiny_model):
    be = TorchBackend(tiny_model, lr=3e-3)
    batch = _batch(be.model, be.tokenizer)
    good, bad = batch.items[0].sequence, batch.items[1].sequence
    g0, b0 = _seq_logprob(be.model, good), _seq_logprob(be.model, bad)
    first = be.train_step(batch)
    assert abs(first["ratio_mean"] - 1.0) < 1e-4  # on-policy: behaviour == current
    for _ in range(4):
        out = be.train_step(batch)
    assert np.isfinite(out["loss"]) and out["grad_norm"] > 0 and out["num_sequences"] == 4
    assert _seq_logprob(be.model, good) > g0 + 0.1
    assert _seq_logprob(be.model, bad) < b0 - 0.1


def test_micro_batching_is_the_same_step(tiny_model):
    a = TorchBackend(tiny_model, lr=1e-3)
    b = TorchBackend(tiny_model, lr=1e-3, micro_batch_size=1)
    batch = _batch(a.model, a.tokenizer)
    sa, sb = a.train_step(batch), b.train_step(batch)
    assert abs(sa["loss"] - sb["loss"]) < 1e-5
    assert abs(sa["grad_norm"] - sb["grad_norm"]) < 1e-4
    # the accumulated gradients are equal (Adam's first step ~ lr*sign(g) would amplify noise)
    gb = dict(b.model.named_parameters())
    for k, p in a.model.named_parameters():
        assert torch.allclose(p.grad, gb[k].grad, atol=1e-6), k


class _DirStore:
    """Minimal stand-in with the weight store's publish signature (used until
    ``storage.weights.WeightStore`` exists): one safetensors file + manifest per version."""

    def __init__(self, root):
        self.root = root

    def publish(self, policy, version, state_dict, meta):
        from safetensors.torch import save_file

        d = self.root / policy / f"v{version}"
        d.mkdir(parents=True)
        save_file({k: v.contiguous().clone() for k, v in state_dict.items()}, str(d / "model.safetensors"))
        (d / "manifest.json").write_text(json.dumps({"meta": meta}))
        return WeightVersion(policy=policy, version=version, manifest_path=str(d / "manifest.json"))


def test_publish_roundtrip_into_engine(tiny_model, tmp_path):
    from astraflow.rollout.hf_engine import HFEngine

    be = TorchBackend(tiny_model, lr=3e-3)
    be.train_step(_batch(be.model, be.tokenizer))
    real = getattr(weights_mod, "WeightStore", None)
    store = real(tmp_path / "ws") if real is not None else _DirStore(tmp_path)
    wv = be.publish(store, "p", 1)
    assert wv.version == 1 and wv.policy == "p"
    if real is None:
        from safetensors.torch import load_file

        sd = load_file(str(tmp_path / "p" / "v1" / "model.safetensors"))
        meta = json.loads((tmp_path / "p" / "v1" / "manifest.json").read_text())["meta"]
        assert meta["layout"] == "hf"
        eng = HFEngine(tiny_model)
        eng.load_weights(sd, 1)
        for k, v in be.state_dict().items():
            assert torch.equal(eng.model.state_dict()[k], v), k


def test_bad_settings():
    """The trainer's settings are checked once, by its config (the backend takes them as given)."""
    from pydantic import ValidationError

    from astraflow.training.config import TrainerConfig

    with pytest.raises(ValidationError, match="lr"):
        TrainerConfig(lr=0)
    with pytest.raises(ValidationError, match="micro_batch"):
        TrainerConfig(micro_batch=0)
    with pytest.raises(ValidationError, match="tensor_parallel.*backend: megatron"):
        TrainerConfig(tensor_parallel=2)


@pytest.mark.parametrize("off_policy", ["ppo_clip", "tis"])
def test_skipping_zero_advantage_sequences_is_the_same_step(tiny_model, off_policy):
    """A group that scored alike has advantage 0: skipping its forward/backward gives the same
    loss, gradient and weights as computing it (the loss is still normalised by every token).
    On the CPU: a GPU picks kernels by batch shape, and Adam's first steps turn last-bit
    differences of near-zero gradients into whole-lr differences of the weights."""
    full = TorchBackend(tiny_model, lr=1e-3, off_policy=off_policy, skip_zero_advantage=False, device="cpu")
    skip = TorchBackend(tiny_model, lr=1e-3, off_policy=off_policy, device="cpu")
    learning = _batch(full.model, full.tokenizer)
    alike = _batch(full.model, full.tokenizer, rewards=(1.0, 1.0, 1.0, 1.0))
    alike = tuple(replace(it, task_id=f"h/{i}") for i, it in enumerate(alike.items))
    batch = Batch(policy="p", version=0, items=learning.items + alike)
    assert sum(it.advantage == 0 for it in batch.items) == 4
    for _ in range(2):
        a, b = full.train_step(batch), skip.train_step(batch)
        assert a["trained_sequences"] == 8 and b["trained_sequences"] == 4
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5
    for (name, pa), pb in zip(full.model.named_parameters(), skip.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name


def test_a_batch_without_signal_still_steps_the_optimiser(tiny_model):
    """All advantages 0: nothing is computed, and the optimiser steps on a zero gradient exactly
    as it would have after computing one (AdamW's moments carry on)."""
    full = TorchBackend(tiny_model, lr=1e-3, skip_zero_advantage=False)
    skip = TorchBackend(tiny_model, lr=1e-3)
    signal = _batch(full.model, full.tokenizer)
    flat = _batch(full.model, full.tokenizer, rewards=(0.0, 0.0, 0.0, 0.0))
    for batch in (signal, flat, flat):
        full.train_step(batch)
        out = skip.train_step(batch)
    assert out["trained_sequences"] == 0 and out["loss"] == 0.0
    assert not {"ratio_mean", "clip_frac", "approx_kl"} & set(out)  # no token measured: no 0 plotted as a ratio
    for (name, pa), pb in zip(full.model.named_parameters(), skip.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name


def test_resuming_with_the_saved_optimiser_state_is_the_same_step(tiny_model, tmp_path):
    """Weights + optimiser state saved after two steps and loaded into a new backend: its
    third step is the uninterrupted backend's; with fresh moments it is not. The saved ``lr``
    does not override the resumed backend's own."""
    ref = TorchBackend(tiny_model, lr=1e-3)
    batch = _batch(ref.model, ref.tokenizer)
    for _ in range(2):
        ref.train_step(batch)
    torch.save(ref.optimizer_state(), tmp_path / "opt.pt")
    weights = ref.snapshot()
    resumed, fresh = TorchBackend(tiny_model, lr=1e-3), TorchBackend(tiny_model, lr=1e-3)
    for be in (resumed, fresh):
        be.load_state_dict(weights)
    resumed.load_optimizer_state(torch.load(tmp_path / "opt.pt", weights_only=True))
    for be in (ref, resumed, fresh):
        be.train_step(batch)
    after = ref.state_dict()
    assert all(torch.equal(after[k], v) for k, v in resumed.state_dict().items())
    assert not all(torch.allclose(after[k], v) for k, v in fresh.state_dict().items())
    other = TorchBackend(tiny_model, lr=5e-4)
    other.load_optimizer_state(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert other.optimizer.param_groups[0]["lr"] == 5e-4
    assert other.optimizer.state_dict()["state"][0]["step"] == 2


def test_bf16_autocast_trains_in_the_same_direction_with_fp32_state(tiny_model):
    """``precision="bf16"``: the forward/backward runs under bf16 autocast; the weights, their
    gradients and the optimiser state stay fp32; on-policy the ratio is 1 up to bf16 rounding,
    and the step moves probability towards the rewarded completions like the fp32 one."""
    fp32 = TorchBackend(tiny_model, lr=3e-3)
    bf16 = TorchBackend(tiny_model, lr=3e-3, precision="bf16")
    batch = _batch(fp32.model, fp32.tokenizer)
    good, bad = batch.items[0].sequence, batch.items[1].sequence
    g0, b0 = _seq_logprob(bf16.model, good), _seq_logprob(bf16.model, bad)
    first32, first16 = fp32.train_step(batch), bf16.train_step(batch)
    assert abs(first32["ratio_mean"] - 1.0) < 1e-4
    assert abs(first16["ratio_mean"] - 1.0) < 0.05 and first16["ratio_mean"] != first32["ratio_mean"]  # bf16 rounding
    for _ in range(4):
        out = bf16.train_step(batch)
    assert np.isfinite(out["loss"]) and out["grad_norm"] > 0
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(v.dtype == torch.float32 for st in bf16.optimizer.state.values() for k, v in st.items() if k != "step")
    assert all(v.dtype == torch.float32 for v in bf16.state_dict().values())  # master weights (published: publish_dtype)
    if bf16.device.type == "cpu":  # the CPU's bf16 flash-attention backward is slow: eager attention
        assert bf16.model.config._attn_implementation == "eager"
    assert _seq_logprob(bf16.model, good) > g0 + 0.1
    assert _seq_logprob(bf16.model, bad) < b0 - 0.1


def test_bf16_is_a_torch_backend_option():
    from astraflow.training.config import TrainerConfig

    assert TrainerConfig(precision="bf16").precision == "bf16"
    with pytest.raises(ValueError, match="precision"):
        TrainerConfig(precision="fp16")
    with pytest.raises(ValueError, match="trainer.precision"):
        TrainerConfig(backend="megatron", precision="bf16")


def test_a_model_with_dropout_trains_on_policy_at_ratio_one(tiny_model, tmp_path):
    """Dropout stays off in the policy-gradient pass: an on-policy batch's new log-probs are the
    engine's (ratio 1, nothing clipped), whatever the checkpoint's dropout settings."""
    import shutil

    model = tmp_path / "dropout"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.5}))
    be = TorchBackend(model, lr=1e-3, skip_zero_advantage=False)
    assert be.model.config.attention_dropout == 0.5
    out = be.train_step(_batch(be.model, be.tokenizer))
    assert abs(out["ratio_mean"] - 1.0) < 1e-4 and out["clip_frac"] == 0.0 and abs(out["approx_kl"]) < 1e-6


@pytest.mark.parametrize("settings", [{}, {"off_policy": "m2po"}, {"kl_coef": 0.1}, {"micro_batch_size": 2}])
def test_sharing_the_prompt_is_the_same_step(tiny_model, settings):
    """Each distinct prompt forwarded once (``share_prompt``): the gradients of a plain step, for
    fewer forwarded tokens, with M2PO's mask, a KL penalty and micro-batches alike."""
    whole = TorchBackend(tiny_model, lr=1e-3, share_prompt=False, device="cpu", **settings)
    shared = TorchBackend(tiny_model, lr=1e-3, device="cpu", **settings)
    batch = _batch(whole.model, whole.tokenizer)
    a, b = whole.train_step(batch), shared.train_step(batch)  # the first also checks sharing against the plain way
    assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4
    gb = dict(shared.model.named_parameters())
    for k, p in whole.model.named_parameters():
        assert torch.allclose(p.grad, gb[k].grad, atol=1e-6), k
    assert shared.train_step(batch)["forwarded_tokens"] < whole.train_step(batch)["forwarded_tokens"]


def test_an_optimiser_state_of_the_default_adamw_resumes_on_the_fused_one(tiny_model):
    """A checkpoint saved before the trainers used the fused AdamW (its groups say ``fused:
    None``, its step counts lie on the CPU) resumes on the fused one. Torch places the step
    counts by the groups it loads (a fused group's on its parameters' device, where the fused
    kernel wants them: on a GPU it refuses one left on the CPU), so those must be this
    optimiser's, not the checkpoint's."""
    old = TorchBackend(tiny_model, lr=1e-3)
    d = old.optimizer.defaults
    old.optimizer = torch.optim.AdamW(old.model.parameters(), lr=d["lr"], betas=d["betas"],
                                      weight_decay=d["weight_decay"])  # as the backend made it before
    batch = _batch(old.model, old.tokenizer)
    old.train_step(batch)
    saved = copy.deepcopy(old.optimizer_state())  # as saved: not sharing its tensors
    assert not saved["param_groups"][0]["fused"]
    resumed = TorchBackend(tiny_model, lr=1e-3)
    resumed.load_state_dict(old.snapshot())
    loaded = []
    resumed.optimizer.register_load_state_dict_pre_hook(lambda opt, sd: loaded.extend(sd["param_groups"]))
    resumed.load_optimizer_state(saved)
    assert [g["fused"] for g in loaded] == [True] and resumed.optimizer.param_groups[0]["fused"] is True
    for p in resumed.model.parameters():
        step = resumed.optimizer.state[p]["step"]
        assert step.device == p.device and step.dtype == torch.float32 and float(step) == 1.0
    old.train_step(batch)
    resumed.train_step(batch)
    after = old.state_dict()
    for k, v in resumed.state_dict().items():
        torch.testing.assert_close(v, after[k], rtol=1e-5, atol=1e-6)
