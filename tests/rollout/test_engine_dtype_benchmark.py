"""``benchmarks/engine_dtype.py`` runs end to end on a model it is given and reports the two
engines' times and their ratio."""

import pytest

from benchmarks.engine_dtype import main


def test_times_both_engines_on_the_same_batch(tiny_model, capsys):
    out = main(["--reps", "1", "--model", str(tiny_model), "--prompts", "2", "--group", "2"])
    assert out["rows"] == 4 and out["reps"] == 1 and out["model"] == str(tiny_model)
    assert out["fp32_ms_per_batch"] > 0 and out["bf16_ms_per_batch"] > 0
    assert out["bf16_speedup"] == pytest.approx(out["fp32_ms_per_batch"] / out["bf16_ms_per_batch"], rel=0.01)
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")


def test_a_directory_without_a_model_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no HF model directory"):
        main(["--model", str(tmp_path)])
