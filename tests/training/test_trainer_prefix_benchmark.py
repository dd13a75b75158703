"""``benchmarks/trainer_prefix.py`` runs end to end on a model it is given: both backends take the
same batches, the shared one forwards fewer tokens, and the two steps agree."""

from benchmarks.trainer_prefix import main


def test_times_both_backends_on_the_same_batches(tiny_model, capsys):
    out = main(["--steps", "2", "--model", str(tiny_model), "--prompts", "2", "--samples", "4", "--new-tokens", "3"])
    assert out["seconds_per_step_shared"] > 0 and out["seconds_per_step_whole"] > 0
    assert out["forwarded_tokens_ratio"] < 1 and out["max_relative_gap"] < 1e-4
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT {")
