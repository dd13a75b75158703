"""``benchmarks/batch_rows.py`` builds a served batch, checks that both ways of assembling it
give the same items, and reports their times side by side."""

from benchmarks.batch_rows import main


def test_both_ways_make_the_same_batch_and_are_reported(capsys):
    out = main(["--batch-size", "32", "--tokens", "6,40", "--reps", "2"])
    for tokens in (6, 40):
        assert out[f"columns_us_per_seq_{tokens}"] > 0 and out[f"per_row_us_per_seq_{tokens}"] > 0
        assert out[f"speedup_{tokens}"] > 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")
