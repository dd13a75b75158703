"""A resume reads the run's ``ledger.jsonl`` a line at a time: the memory it takes does not grow
with the length of the run (a days-long run's journal holds millions of lines)."""

from __future__ import annotations

import json
import tracemalloc

from astraflow.dataflow import durable


def test_reading_a_long_journal_holds_one_line_at_a_time(tmp_path):
    journal = tmp_path / "ledger.jsonl"
    with open(journal, "w") as f:
        for g in range(50_000):
            for k in range(4):
                f.write(json.dumps({"t": f"g{g}/{k}", "e": "created", "at": 1.0}) + "\n")
        f.write('{"t": "g7/0", "e": "consu')  # a last line cut short by a crash

    tracemalloc.start()
    try:
        highest = max(int(line["t"][1:].split("/")[0]) for line in durable.read_journal(journal))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert highest == 49_999
    assert peak < 2_000_000, f"{peak / 1e6:.1f} MB held while reading {journal.stat().st_size / 1e6:.1f} MB"
    assert len(durable.open_in_journal(journal)) == 200_000
    assert list(durable.read_journal(tmp_path / "none.jsonl")) == []
