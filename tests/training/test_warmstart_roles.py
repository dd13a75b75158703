"""Warm starts of the second roles (verifier, selector): the examples are the workflows' own
prompts with the right targets, and a few SFT steps on them lower the loss."""

import random

import pytest

from astraflow.training.config import ModelInit
from astraflow.models import load_model
from astraflow.training.warmstart import _encode_pairs, task_examples, warm_start
from astraflow.workloads.math import make_dataset
from astraflow.workloads.prompts import parse_pick, parse_verdict, retry_prompt, select_prompt, verify_prompt

WL = {"digits": 2, "num_test": 20}


def test_verify_examples_are_half_right_with_matching_verdicts():
    items = make_dataset(WL, "train")[:400]
    pairs = task_examples("verify", items, random.Random(0))
    n_yes = 0
    for it, (prompt, target) in zip(items, pairs):
        q = f"{it['question']}="
        assert prompt.startswith(q) and prompt.endswith("?")
        cand = prompt[len(q):-1]
        assert prompt == verify_prompt(q, cand)
        right = int(cand) == int(it["answer"])
        if not right:
            assert 1 <= abs(int(cand) - int(it["answer"])) <= 3
        # the verifier's own working (the right sum), then the verdict
        assert target == str(it["answer"]) + ("Y" if right else "N")
        assert parse_verdict(target) is right
        n_yes += right
    assert 0.4 < n_yes / len(items) < 0.6


def test_the_verdict_is_the_last_y_or_n_after_any_working():
    assert parse_verdict("Y") is True and parse_verdict(" n") is False
    assert parse_verdict("46N") is False and parse_verdict("46Y") is True
    assert parse_verdict("no, 46 Y") is True  # the last one counts
    assert parse_verdict("46") is None and parse_verdict("") is None


def test_solve_retry_examples_mix_first_turns_and_retries_after_a_wrong_answer():
    items = make_dataset(WL, "train")[:400]
    pairs = task_examples("solve_retry", items, random.Random(2))
    retries = 0
    for it, (prompt, target) in zip(items, pairs):
        q = f"{it['question']}="
        assert target.startswith(str(it["answer"]))  # always the right answer
        if prompt == q:
            continue
        retries += 1
        rejected = prompt[len(q):].split(" no. ")[0]
        assert prompt == retry_prompt(q, rejected) and prompt.endswith(q)  # the workflow's own retry turn
        assert 1 <= abs(int(rejected) - int(it["answer"])) <= 3
    assert 0.4 < retries / len(items) < 0.6


def test_select_examples_have_exactly_one_right_candidate():
    items = make_dataset(WL, "train")[:400]
    pairs = task_examples("select", items, random.Random(1))
    firsts = 0
    for it, (prompt, target) in zip(items, pairs):
        q = f"{it['question']}="
        a1, a2 = prompt[len(q):-1].split("|")
        assert prompt == select_prompt(q, a1, a2)
        ok = [int(a) == int(it["answer"]) for a in (a1, a2)]
        assert sum(ok) == 1
        # the selector's own working (the right sum), then the position of the candidate equal to it
        assert target == str(it["answer"]) + (">1" if ok[0] else ">2")
        assert parse_pick(target) == (1 if ok[0] else 2)
        firsts += ok[0]
    assert 0.4 < firsts / len(items) < 0.6


def test_the_pick_is_the_digit_after_the_last_arrow():
    assert parse_pick("46>1") == 1 and parse_pick(" 46 > 2") == 2
    assert parse_pick("1") == 1 and parse_pick("2") == 2  # a bare pick
    assert parse_pick("4>6>2") == 2  # the last one counts
    assert parse_pick("46") is None and parse_pick("46>") is None and parse_pick("") is None
    assert parse_pick("46>3") is None
    assert parse_pick("12") is None and parse_pick("125") is None  # working with no pick after it
    assert parse_pick("46>12") is None and parse_pick("46>21") is None  # a number after the arrow, not a pick
    assert parse_pick("46>1.") == 1 and parse_pick("46> 2 because") == 2


def test_solve_examples_and_unknown_task():
    items = make_dataset(WL, "train")[:3]
    assert task_examples("solve", items, random.Random(0)) == [(f"{i['question']}=", i["answer"]) for i in items]
    with pytest.raises(ValueError, match="known tasks"):
        task_examples("judge", items, random.Random(0))


def test_targets_carry_the_loss_only(tiny_model):
    _, tok = load_model(tiny_model)
    ids, att, lm = _encode_pairs(tok, [("3+4=7?", "Y"), ("3+4=7|8?", "1")])
    for row in range(2):
        masked = ids[row][lm[row]].tolist()
        assert masked[-1] == tok.eos_token_id and tok.decode(masked[:-1]) in ("Y", "1")


@pytest.mark.parametrize("task", ["verify", "select"])
def test_role_warm_start_lowers_the_loss(tiny_model, tmp_path, task):
    losses = []
    res = warm_start(tiny_model, tmp_path / task, steps=40, lr=3e-3, batch_size=32, workload=WL, task=task,
                     eval_every=20, eval_size=20, progress=False, on_eval=lambda r: losses.append(r["loss"]))
    assert res["steps"] == 40 and 0.0 <= res["acc"] <= 1.0
    # the first loss (a near-uniform guess over 320 symbols) is ~ln(320) = 5.8; both targets hold
    # the role's own sum (digits that take longer to learn) before its 1-symbol verdict or pick
    assert losses[-1] < 2.0
    load_model(tmp_path / task)  # a loadable HF directory


def test_model_init_task_field():
    assert ModelInit().task == "solve"
    assert ModelInit(task="verify").task == "verify"
    with pytest.raises(ValueError):
        ModelInit(task="judge")


def test_a_role_can_start_from_an_earlier_policys_model(tiny_model, tmp_path):
    """``init.start_from``: the verifier is built from the solver's model (one base model for
    every role), not from a random initialisation."""
    import torch

    from astraflow.runtime.model_build import build_model

    out = build_model(tmp_path / "verifier", ModelInit(preset="mini", seed=5, task="verify"), base=tiny_model)
    (a, _), (b, _) = load_model(tiny_model), load_model(out)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)  # the preset is unused


def test_start_from_must_name_an_earlier_policy(tiny_model):
    from astraflow.config import ConfigError, config_from_dict
    from tests.conftest import tiny_config

    base = tiny_config(tiny_model).model_dump(mode="json")
    base["workload"]["workflow"] = "solver_verifier"
    base["policies"] = [
        {"name": "solver", "model": str(tiny_model)},
        {"name": "verifier", "model": "/nonexistent/verifier", "init": {"task": "verify", "start_from": "solver"}},
    ]
    cfg = config_from_dict(base)
    assert cfg.policies[1].init.start_from == "solver"
    base["policies"][1]["init"]["start_from"] = "verifier"
    with pytest.raises(ConfigError, match=r"start_from: 'verifier' is not a policy listed before.*\['solver'\]"):
        config_from_dict(base)


def test_a_warm_start_bounded_in_steps_builds_the_same_model_twice(tmp_path):
    """``warm_start_steps`` (``astraflow model init --warm-start-steps``): the seeded warm start
    stops at the same step on any machine, so two builds are bit-identical."""
    import torch
    from click.testing import CliRunner

    from astraflow.cli import main
    from astraflow.models import init_model

    outs = []
    for name in ("one", "two"):
        res = CliRunner().invoke(main, ["model", "init", str(tmp_path / name), "--preset", "tiny",
                                        "--warm-start-steps", "3", "--warm-start-lr", "3e-3"])
        assert res.exit_code == 0, res.output
        outs.append(load_model(tmp_path / name)[0].state_dict())
    init = load_model(init_model(tmp_path / "init", preset="tiny", seed=0))[0].state_dict()
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in init)
    assert not all(torch.equal(outs[0][k], init[k]) for k in init)  # it did train


def test_a_warm_start_that_ends_at_its_bound_short_of_its_target_says_so(tiny_model, tmp_path):
    """The run goes on from the weaker model, and its log names the model to remove and the
    bound to raise."""
    import io

    from rich.console import Console

    from astraflow.runtime.model_build import build_model
    from astraflow.runtime.progress import Progress
    from astraflow.workloads.config import WorkloadConfig

    out = io.StringIO()
    progress = Progress(console=Console(file=out, width=400, highlight=False))
    model = tmp_path / "solver"
    init = ModelInit(warm_start_steps=2, warm_start_target=0.9)
    build_model(model, init, WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}), progress,
                base=tiny_model)
    log = out.getvalue()
    assert "warning: the warm start reached its bound (2 steps)" in log
    assert "short of its target 0.9" in log and f"remove {model} and raise init.warm_start_steps" in log
    assert load_model(model)  # kept for later runs


def test_the_warm_starts_log_line_names_its_target_as_well_as_its_bound(tiny_model, tmp_path):
    """A target usually ends the warm start long before its bound in steps: the line a log shows
    while it runs says both, so "for 1500 steps" does not promise a wait the target cuts short."""
    import io

    from rich.console import Console

    from astraflow.runtime.model_build import build_model
    from astraflow.runtime.progress import Progress
    from astraflow.workloads.config import WorkloadConfig

    out = io.StringIO()
    progress = Progress(console=Console(file=out, width=400, highlight=False))
    init = ModelInit(warm_start_steps=2, warm_start_target=0.9)
    build_model(tmp_path / "solver", init, WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}),
                progress, base=tiny_model)
    assert "supervised warm start (solve) for up to 2 steps, until held-out accuracy 0.9 ..." in out.getvalue()


def test_the_warm_start_trains_on_the_threads_it_is_given_and_gives_them_back(tiny_model, tmp_path, monkeypatch):
    """torch's default (every core) spins its threads against the run's other processes on a busy
    machine: a run's warm start uses its trainer's ``threads``, and the process keeps its own."""
    import torch

    import astraflow.runtime.model_build as mb
    from astraflow.workloads.config import WorkloadConfig

    seen = []
    real = mb._warm_start
    monkeypatch.setattr(mb, "_warm_start", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k)))
    before = torch.get_num_threads()
    wanted = 3 if before != 3 else 2
    mb.build_model(tmp_path / "solver", ModelInit(warm_start_steps=1),
                   WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}), base=tiny_model, threads=wanted)
    assert seen == [wanted] and torch.get_num_threads() == before


def test_a_run_builds_its_model_on_its_trainers_threads(tmp_path, monkeypatch):
    """``prepare_models`` passes each policy's ``trainer.threads`` to the build."""
    import astraflow.runtime.model_build as mb
    from astraflow.runtime.progress import Progress
    from tests.conftest import tiny_config

    got = {}

    def build(out, init, *args, threads=1, **kwargs):
        got["threads"] = threads
        out.mkdir()

    monkeypatch.setattr(mb, "build_model", build)
    cfg = tiny_config(tmp_path / "missing-model", **{"policies.0.trainer.threads": 2, "policies.0.init": {"preset": "tiny"}})
    mb.prepare_models(cfg, Progress())
    assert got == {"threads": 2}
