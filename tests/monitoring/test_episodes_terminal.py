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
