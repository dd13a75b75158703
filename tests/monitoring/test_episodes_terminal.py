"""``astraflow episodes`` prints what models, environments and tools wrote: their control
characters (escape sequences that clear the screen, retitle the window or move the cursor) are
shown, not sent to the user's terminal."""

from __future__ import annotations

import time

from click.testing import CliRunner

from astraflow.cli import main
from astraflow.models import build_tokenizer
from storage.trajectories import open_trajectory_store
from tests.monitoring.episode_store import agentic, write_run

CLEAR, TITLE = "\x1b[2J\x1b[H", "\x1b]0;owned\x07"


def test_a_model_turn_and_a_task_with_escape_sequences_are_printed_escaped(tmp_path):
    tok = build_tokenizer()
    run_dir = write_run(tmp_path / "run", tok, old_batches=0)
    store = open_trajectory_store(str(run_dir / "trajectories"), "a", durable=False)
    episode = agentic(tok, "ag-escapes", ["hmm", f"done{CLEAR}{TITLE}"], {"a": 1, "b": 2})
    with store.writer("rollout-2") as w:
        time.sleep(0.002)  # the newest episode
        w.write(episode.to_stored())
    out = CliRunner().invoke(main, ["episodes", str(run_dir), "-n", "1"])
    assert out.exit_code == 0, out.output
    assert "\x1b" not in out.output and "\x07" not in out.output
    assert "done\\x1b[2J\\x1b[H\\x1b]0;owned\\x07" in out.output  # the model's turn, shown


def test_what_a_non_utf8_terminal_cannot_show_is_printed_escaped(tmp_path):
    """A model's text under a locale that is not UTF-8 (``PYTHONIOENCODING=ascii``, a Latin-1
    locale without Python's UTF-8 mode): shown escaped, not a UnicodeEncodeError traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tok = build_tokenizer()
    run_dir = write_run(tmp_path / "run", tok, old_batches=0)
    store = open_trajectory_store(str(run_dir / "trajectories"), "a", durable=False)
    episode = agentic(tok, "ag-unicode", ["hmm", "caf\u00e9 \ufffd"], {"a": 1, "b": 2})
    with store.writer("rollout-2") as w:
        time.sleep(0.002)  # the newest episode
        w.write(episode.to_stored())
    out = subprocess.run([sys.executable, "-m", "astraflow", "episodes", str(run_dir), "-n", "1"],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-3000:]
    assert b"caf\\xe9 \\ufffd" in out.stdout, out.stdout


def _solver_verifier_run(tmp_path):
    """A run directory of two policies with tokenizers of their own and one stored episode: the
    solver's answer (reward 0) and the verifier's verdict on it (reward 1)."""
    import yaml

    from astraflow.contracts import Provenance, Sequence, Trajectory
    from astraflow.models import build_bpe_tokenizer, init_model
    from storage.paths import RunPaths

    byte_tok, bpe_tok = build_tokenizer(), build_bpe_tokenizer(["is 12+30=42 right? Y", "no N"] * 50, vocab_size=400)
    solver = init_model(tmp_path / "solver", tokenizer=byte_tok)
    verifier = init_model(tmp_path / "verifier", tokenizer=bpe_tok)
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.config.write_text(yaml.safe_dump({"workload": {"name": "math"}, "storage": {"trajectories": None},
                                            "policies": [{"name": "solver", "model": str(solver)},
                                                         {"name": "verifier", "model": str(verifier)}]}))

    def seq(tok, prompt: str, answer: str, pid: int, reward: float) -> Sequence:
        p, c = tok.encode(prompt, add_special_tokens=False), tok.encode(answer, add_special_tokens=False)
        n = len(p) + len(c)
        return Sequence.build(tokens=p + c, loss_mask=[0] * len(p) + [1] * len(c), logprobs=[0.0] * n,
                              policy_ids=[-1] * len(p) + [pid] * len(c), versions=[-1] * len(p) + [0] * len(c),
                              reward=reward)

    traj = Trajectory(task_id="g/0", group_id="g", policies=("solver", "verifier"), workflow="solver_verifier",
                      kind="train", attempt=0, provenance=Provenance(node="rollout-0"),
                      sequences=(seq(byte_tok, "12+30=", "42", 0, 0.0),
                                 seq(bpe_tok, "is 12+30=42 right? ", "Y", 1, 1.0)))
    store = open_trajectory_store(str(paths.trajectories), "a", durable=False)
    with store.writer("rollout-0") as w:
        w.write(traj.to_stored())
    return paths.root


def test_a_sequence_is_decoded_with_the_tokenizer_of_the_policy_that_wrote_it(tmp_path):
    """Two policies with tokenizers of their own: the verifier's sequence (its prompt and its
    verdict) is decoded with the verifier's tokenizer, not the solver's."""
    import json

    out = CliRunner().invoke(main, ["episodes", str(_solver_verifier_run(tmp_path)), "-n", "2", "--json"])
    assert out.exit_code == 0, out.output
    texts = {e["seq_index"]: (e["prompt"], e["completion"]) for e in json.loads(out.output)["recent"]}
    assert texts == {0: ("12+30=", "42"), 1: ("is 12+30=42 right? ", "Y")}


def test_each_sequence_of_a_two_policy_episode_names_the_policy_that_wrote_it(tmp_path):
    """An episode of two policies is shown sequence by sequence, each with its own reward: the
    header names whose sequence (and so whose reward) it is, not only the episode's policies."""
    import json

    run = _solver_verifier_run(tmp_path)
    out = CliRunner().invoke(main, ["episodes", str(run), "-n", "2", "--json"])
    assert out.exit_code == 0, out.output
    assert {e["seq_index"]: (e["policy"], e["reward"]) for e in json.loads(out.output)["recent"]} == {
        0: ("solver", 0.0), 1: ("verifier", 1.0)}
    out = CliRunner().invoke(main, ["episodes", str(run), "-n", "2"])
    assert out.exit_code == 0, out.output
    heads = [line for line in out.output.splitlines() if "policies solver, verifier" in line]
    assert len(heads) == 2, out.output
    assert "written by verifier  reward 1 " in heads[0] and "written by solver  reward 0 " in heads[1], heads


def test_untrained_text_between_two_answers_is_not_shown_as_the_models(tmp_path):
    """A workflow of the user's own (self-correction: an answer, a critique, a second answer) stores
    one sequence whose critique is untrained. The completion was every token from the first
    trained one on, shown as the model's text: the critique read as if the model wrote it, so a
    user could not see that it was masked out of the loss. ``parts`` gives the runs."""
    import json

    import yaml

    from astraflow.contracts import Provenance, Sequence, Trajectory
    from astraflow.models import init_model
    from storage.paths import RunPaths

    tok = build_tokenizer()
    model = init_model(tmp_path / "model", tokenizer=tok)
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.config.write_text(yaml.safe_dump({"workload": {"name": "math"}, "storage": {"trajectories": None},
                                            "policies": [{"name": "solver", "model": str(model)}]}))
    pieces = [("2+2=", False), ("5", True), (" Wrong. Again: ", False), ("4", True)]
    ids = [tok.encode(text, add_special_tokens=False) for text, _ in pieces]
    mask = [m for (_, m), i in zip(pieces, ids) for _ in i]
    n = len(mask)
    seq = Sequence.build(tokens=sum(ids, []), loss_mask=mask, logprobs=[0.0] * n,
                         policy_ids=[0 if m else -1 for m in mask], versions=[0 if m else -1 for m in mask],
                         reward=1.0)
    traj = Trajectory(task_id="g/0", group_id="g", policies=("solver",), workflow="self_correct", kind="train",
                      attempt=0, provenance=Provenance(node="rollout-0"), sequences=(seq,))
    store = open_trajectory_store(str(paths.trajectories), "a", durable=False)
    with store.writer("rollout-0") as w:
        w.write(traj.to_stored())
    out = CliRunner().invoke(main, ["episodes", str(paths.root), "-n", "1", "--json"])
    assert out.exit_code == 0, out.output
    e = json.loads(out.output)["recent"][0]
    assert (e["prompt"], e["completion"]) == ("2+2=", "5 Wrong. Again: 4")
    assert e["parts"] == [{"text": "5", "trained": True}, {"text": " Wrong. Again: ", "trained": False},
                          {"text": "4", "trained": True}]
    out = CliRunner().invoke(main, ["episodes", str(paths.root), "-n", "1"])
    assert out.exit_code == 0, out.output
    assert "2+2=5 Wrong. Again: 4\n" in out.output


def test_an_episodes_statistics_are_shown_with_its_reward(tmp_path):
    """How a code episode ended (its tests: passed, wrong, timed out, the fraction passed) is in the
    text view, not only in ``--json``: a reward of 0 alone does not say whether the program was
    wrong or too slow."""
    import dataclasses

    from tests.monitoring.episode_store import single_turn

    run_dir = write_run(tmp_path / "run", build_tokenizer(), old_batches=0)
    store = open_trajectory_store(str(run_dir / "trajectories"), "a", durable=False)
    stats = {"code_pass": 0.0, "code_wrong": 0.0, "code_timeout": 1.0, "code_tests_frac": 0.25}
    with store.writer("rollout-2") as w:
        time.sleep(0.002)  # the newest episode
        w.write(dataclasses.replace(single_turn("code-1", 0.0), stats=stats).to_stored())
    out = CliRunner().invoke(main, ["episodes", str(run_dir), "-n", "1"])
    assert out.exit_code == 0, out.output
    assert "code_pass 0  code_tests_frac 0.25  code_timeout 1  code_wrong 0" in out.output


def test_a_policy_or_workload_the_run_has_not_is_named_with_the_ones_it_has(tmp_path):
    """A misspelt ``--policy`` or ``--workload`` says so and lists the run's names, rather than
    blaming the filters as a reward range that matched nothing would."""
    run_dir = write_run(tmp_path / "run", build_tokenizer(), old_batches=0)
    out = CliRunner().invoke(main, ["episodes", str(run_dir), "--policy", "solvr"])
    assert out.exit_code == 2, out.output
    assert "--policy 'solvr' is not one of this run's policies (solver)" in out.output, out.output
    out = CliRunner().invoke(main, ["episodes", str(run_dir), "--workload", "maths"])
    assert out.exit_code == 2 and "--workload 'maths' is not one of this run's workloads (" in out.output, out.output
    out = CliRunner().invoke(main, ["episodes", str(run_dir), "--min-reward", "50"])
    assert out.exit_code == 2 and "none matches the filters" in out.output, out.output


def test_a_call_the_tool_refused_is_shown_with_its_name_and_why(tmp_path):
    """A well-formed call to a tool that does not exist is invalid without a read error: shown
    as the call and the tool's answer, not as ``invalid tool call: None``."""
    from astraflow.agents.tools import format_call

    tok = build_tokenizer()
    run_dir = write_run(tmp_path / "run", tok, old_batches=0)
    store = open_trajectory_store(str(run_dir / "trajectories"), "a", durable=False)
    episode = agentic(tok, "ag-refused", [format_call("mul", {"a": 2, "b": 3}), "6"], {"a": 2, "b": 3})
    with store.writer("rollout-2") as w:
        time.sleep(0.002)  # the newest episode
        w.write(episode.to_stored())
    out = CliRunner().invoke(main, ["episodes", str(run_dir), "-n", "1"])
    assert out.exit_code == 0, out.output
    assert "None" not in out.output, out.output
    assert 'invalid tool call: mul({"a": 2, "b": 3}) -> error: unknown tool' in out.output, out.output
