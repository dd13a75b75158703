"""The trainers' AdamW (``training.optim.adamw``): fused on the CPU, the same steps as torch's
default implementation, and an optimiser state saved by either loads into the other."""

from __future__ import annotations

import copy

import torch

from astraflow.training.optim import adamw

SETTINGS = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _steps(model, opt, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(5, 8, generator=gen)).pow(2).sum().backward()
        opt.step()


def test_fused_on_the_cpu_and_the_same_steps_as_the_default():
    fused_model, plain_model = _model(), _model()
    fused = adamw(fused_model.parameters(), **SETTINGS)
    plain = torch.optim.AdamW(plain_model.parameters(), **SETTINGS)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    _steps(fused_model, fused, 4, seed=1)
    _steps(plain_model, plain, 4, seed=1)
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_state_saved_by_either_loads_into_the_other():
    """A checkpoint of the default implementation resumes on the fused one (and back) and the
    steps after it are the ones the saving optimiser would have taken."""
    for make_saver, make_loader in ((torch.optim.AdamW, adamw), (adamw, torch.optim.AdamW)):
        a, b = _model(), _model()
        saver = make_saver(a.parameters(), **SETTINGS)
        _steps(a, saver, 3, seed=2)
        b.load_state_dict(a.state_dict())
        loader = make_loader(b.parameters(), **SETTINGS)
        loader.load_state_dict(copy.deepcopy(saver.state_dict()))  # as saved: not sharing its tensors
        _steps(a, saver, 2, seed=3)
        _steps(b, loader, 2, seed=3)
        for x, y in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_parameters_off_a_fused_device_get_the_default():
    meta = torch.nn.Linear(4, 4, device="meta")
    assert not adamw(meta.parameters(), **SETTINGS).defaults["fused"]
