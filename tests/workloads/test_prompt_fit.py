"""Prompts longer than a policy's model can take with ``max_new_tokens``: said before the run
(``astraflow check`` and ``astraflow run``), refused when no train prompt fits; and a run's
failed tasks summarised by reason at its end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.launch import failure_reasons

ROOT = Path(__file__).resolve().parents[2]


def _short_model(tiny_model: Path, tmp_path: Path, positions: int) -> Path:
    """The session's tiny model with fewer positions (only config.json is read by the check)."""
    out = tmp_path / "short"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(config))
    return out


def _config(tmp_path: Path, model: Path, rows: list[dict], max_new: int = 16) -> Path:
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    data["workload"] = {"name": "dataset", "group_size": 2,
                        "params": {"path": str(data_file), "preset": "gsm8k", "test_fraction": 0.5},
                        "sampling": {"max_new_tokens": max_new}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _rows(n: int, long_at: set[int]) -> list[dict]:
    return [{"question": ("word " * 400 if i in long_at else "") + f"What is {i} plus 1?",
             "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(n)]


def test_check_names_the_prompts_that_do_not_fit_and_where_the_longest_is(tiny_model, tmp_path):
    model = _short_model(tiny_model, tmp_path, positions=256)
    res = CliRunner().invoke(main, ["check", str(_config(tmp_path, model, _rows(40, {7})))])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("policy solver:"))
    assert "are longer than the 240 tokens left for a prompt (256 positions less " \
           "workload.sampling.max_new_tokens 16)" in line, line
    assert "rows.jsonl line 8" in line and "lower max_new_tokens" in line, line
    train, held_out = line.split(": ", 1)[1].split(" and ")[:2]
    assert int(train.split()[0]) + int(held_out.split()[0]) == 1, line  # the one long row, in either split


def test_prompts_that_all_fit_say_nothing(tiny_model, tmp_path):
    model = _short_model(tiny_model, tmp_path, positions=256)
    res = CliRunner().invoke(main, ["check", str(_config(tmp_path, model, _rows(40, set())))])
    assert res.exit_code == 0 and "policy solver:" not in res.output, res.output


def test_a_run_whose_train_prompts_all_overflow_is_refused_before_it_starts(tiny_model, tmp_path):
    model = _short_model(tiny_model, tmp_path, positions=256)
    cfg = _config(tmp_path, model, _rows(40, set(range(40))))
    res = CliRunner().invoke(main, ["run", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "no train prompt fits" in res.output and "Traceback" not in res.output, res.output


def test_failure_reasons_are_the_commonest_first_and_bounded():
    ledger = {"failed_by_reason": {"a": 1, "b" * 500: 5, "c": 3, "d": 2}}
    said = failure_reasons(ledger)
    assert said.startswith("5x " + "b" * 237 + "...; 3x c; 2x d") and said.endswith("and 1 other reason"), said
    assert failure_reasons({"failed_by_reason": {}}) == "" and failure_reasons({}) == ""


def test_the_prompts_are_measured_against_a_model_init_builds_before_workers_start(tmp_path):
    """A model still to be built is measured once init has built it, before any worker starts."""
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "models" / "tiny")
    data["workload"]["sampling"]["max_new_tokens"] = 2047  # of the preset's 2048 positions: no prompt fits
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    check = CliRunner().invoke(main, ["check", str(tmp_path / "cfg.yaml")])
    assert check.exit_code == 0, check.output  # no model yet: nothing to measure with
    res = CliRunner().invoke(main, ["run", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2 and "no train prompt fits" in res.output, res.output
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()
    assert not (tmp_path / "run" / "jobs" / "submitted.json").exists()


def test_a_template_that_refuses_the_prompts_is_said_in_one_line_not_a_traceback(tiny_model, tmp_path):
    model = _short_model(tiny_model, tmp_path, positions=256)
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{{ raise_exception('this template takes no system role') }}"
    (model / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    res = CliRunner().invoke(main, ["check", str(_config(tmp_path, model, _rows(40, set())))])
    assert "Traceback" not in res.output, res.output
    assert res.exit_code == 2, res.output  # every rollout would fail on it: refused before anything starts
    text = " ".join(res.output.split())
    assert "cannot be rendered with" in text and "takes no system role" in text, res.output
    assert "fix the template" in text


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn(tiny_model):
    """Gemma's and Mistral's templates raise on a system message: the prompt is rendered as the
    episodes' first observation is, the system text at the head of the user's."""
    from astraflow.agents.chat import prompt_ids
    from astraflow.models import load_model

    tok = load_model(tiny_model)[1]
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role "
                         "not supported') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")

    class Workload:
        def render_messages(self, payload):
            return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": payload["q"]}]

    ids = prompt_ids(tok, Workload(), {"q": "1 + 1?"})
    assert tok.decode(ids) == "user: Be brief.\n\n1 + 1?\nassistant:"
