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
