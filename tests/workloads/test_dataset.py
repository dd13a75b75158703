"""The ``dataset`` workload: every reader, the field layouts and presets, splits, prompt
rendering, and bad rows reported with their location instead of a crash."""

import json
from pathlib import Path

import pytest

from astraflow.workloads.base import make_workload

ROOT = Path(__file__).resolve().parents[2]

ROWS = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}", "level": i % 3}
        for i in range(40)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset(**params):
    return make_workload("dataset", params, seed=0)


def _write(tmp_path, fmt):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        return write_jsonl(tmp_path / "d.jsonl", ROWS)
    if fmt == "json":
        (tmp_path / "d.json").write_text(json.dumps(ROWS))
        return tmp_path / "d.json"
    if fmt == "parquet":
        ds.to_parquet(str(tmp_path / "d.parquet"))
        return tmp_path / "d.parquet"
    if fmt == "csv":
        ds.to_csv(str(tmp_path / "d.csv"), index=False)
        return tmp_path / "d.csv"
    ds.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk"])
def test_every_reader_gives_the_same_tasks(tmp_path, fmt):
    wl = dataset(path=str(_write(tmp_path, fmt)), preset="gsm8k", test_fraction=0.25)
    train, test = wl.tasks("train"), wl.tasks("eval")
    assert len(train) + len(test) == len(ROWS) and train and test
    by_text = {r["question"]: r for r in ROWS}
    for p in train + test:
        row = by_text[p["messages"][-1]["content"].split("\n")[0]]
        assert p["answer"] == str(2 * int(row["question"].split()[2]))
        assert p["solution"] == row["answer"]
        assert wl.reward(f"blah\n#### {p['answer']}", p) == 1.0
    assert not {p["text"] for p in train} & {p["text"] for p in test}


def test_seeded_split_is_deterministic_and_independent_of_row_order(tmp_path):
    a = dataset(path=str(write_jsonl(tmp_path / "a.jsonl", ROWS)), preset="gsm8k", test_fraction=0.3, seed=7)
    b = dataset(path=str(write_jsonl(tmp_path / "b.jsonl", ROWS[::-1])), preset="gsm8k", test_fraction=0.3, seed=7)
    assert {p["text"] for p in a.tasks("eval")} == {p["text"] for p in b.tasks("eval")}
    c = dataset(path=str(tmp_path / "a.jsonl"), preset="gsm8k", test_fraction=0.3, seed=8)
    assert {p["text"] for p in a.tasks("eval")} != {p["text"] for p in c.tasks("eval")}


def test_split_field_test_path_and_limits(tmp_path):
    rows = [dict(r, split="test" if i < 5 else "train") for i, r in enumerate(ROWS)]
    wl = dataset(path=str(write_jsonl(tmp_path / "s.jsonl", rows)), preset="gsm8k", split_field="split")
    assert len(wl.tasks("eval")) == 5 and len(wl.tasks("train")) == 35
    wl = dataset(path=str(write_jsonl(tmp_path / "tr.jsonl", ROWS[:30])), test_path=str(write_jsonl(tmp_path / "te.jsonl", ROWS[30:])),
                 preset="gsm8k", num_train=12, num_test=4)
    assert len(wl.tasks("train")) == 12 and len(wl.tasks("eval")) == 4
    assert all(p["row"].startswith("tr.jsonl") for p in wl.tasks("train"))


def test_datasetdict_on_disk_gives_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[:30]),
                         test=datasets.Dataset.from_list(ROWS[30:])).save_to_disk(str(tmp_path / "dd"))
    wl = dataset(path=str(tmp_path / "dd"), preset="gsm8k")
    assert len(wl.tasks("train")) == 30 and len(wl.tasks("eval")) == 10


def test_glob_reads_every_file(tmp_path):
    write_jsonl(tmp_path / "part-0.jsonl", ROWS[:20])
    write_jsonl(tmp_path / "part-1.jsonl", ROWS[20:])
    wl = dataset(path=str(tmp_path / "part-*.jsonl"), preset="gsm8k", test_fraction=0.2)
    assert len(wl.tasks("train")) + len(wl.tasks("eval")) == 40


def test_math_preset_reads_boxed_answers_and_difficulty(tmp_path):
    rows = [{"problem": f"Halve {i}.", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$.", "level": f"Level {1 + i % 5}"}
            for i in range(1, 30)]
    wl = dataset(path=str(write_jsonl(tmp_path / "m.jsonl", rows)), preset="math", test_fraction=0.3)
    p = wl.tasks("eval")[0]
    n = int(p["text"].split()[1].rstrip("."))
    assert p["answer"] == f"\\frac{{{n}}}{{2}}" and p["difficulty"].startswith("Level")
    assert "\\boxed{}" in p["text"]  # the preset's instruction
    assert wl.reward(f"so \\boxed{{{n / 2}}}", p) == 1.0
    assert wl.reward(f"so \\boxed{{{n + 1}}}", p) == 0.0


def test_custom_fields_template_system_prompt_and_messages(tmp_path):
    rows = [{"q": f"capital of country {i}", "a": f"city{i}", "lang": "en", "id": f"r{i}"} for i in range(20)]
    wl = dataset(path=str(write_jsonl(tmp_path / "c.jsonl", rows)), prompt_field="q", answer_field="a", id_field="id",
                 prompt_template="[{{ lang }}] {{ prompt }}?", system_prompt="Answer in one word.", test_fraction=0.5)
    p = wl.tasks("train")[0]
    assert p["messages"][0] == {"role": "system", "content": "Answer in one word."}
    assert p["messages"][1]["content"].startswith("[en] capital of country") and p["id"].startswith("r")
    assert wl.render_prompt(p) == f"Answer in one word.\n{p['messages'][1]['content']}\n"
    assert wl.reward(f" {p['answer']} ", p) == 1.0  # exact, the default reward
    chats = [{"messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i)} for i in range(20)]
    wl = dataset(path=str(write_jsonl(tmp_path / "m.jsonl", chats)), messages_field="messages", reward="numeric",
                 test_fraction=0.5)
    assert wl.tasks("train")[0]["messages"][-1]["content"].startswith("say ")


def test_bad_rows_are_counted_and_located_not_fatal(tmp_path):
    lines = [json.dumps(ROWS[0]), "", json.dumps({"question": "no answer"}), "{}", "not json at all",
             json.dumps({"question": "q", "answer": "#### seven"}), json.dumps(ROWS[1]), json.dumps(ROWS[2])]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(ROWS[3]) + "\n")
    wl = dataset(path=str(tmp_path / "bad.jsonl"), test_path=str(tmp_path / "test.jsonl"), preset="gsm8k", reward="numeric")
    assert len(wl.tasks("train")) == 3
    rep = wl.report
    assert sum(rep.bad.values()) == 4 and rep.rows == 8
    text = rep.summary()
    for where in ("bad.jsonl line 3: missing field 'answer'", "bad.jsonl line 4: empty row", "bad.jsonl line 5: not JSON",
                  "bad.jsonl line 6: answer the numeric reward cannot score"):
        assert where in text, text


def test_many_rows_bad_for_one_reason_leave_room_for_the_others_in_the_listing(tmp_path):
    """A file where most rows lack the field: three of them are listed, and a rarer reason still is."""
    lines = [json.dumps({"prompt": f"q{i}", "answer": "1"}) for i in range(40)] + ["not json at all"]
    lines += [json.dumps(r) for r in ROWS[:3]]
    (tmp_path / "many.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(ROWS[3]) + "\n")
    wl = dataset(path=str(tmp_path / "many.jsonl"), test_path=str(tmp_path / "test.jsonl"), preset="gsm8k")
    assert len(wl.tasks("train")) == 3
    text = wl.report.summary()
    assert text.count("missing field 'question'") == 1 + 3  # the count, then three rows
    assert "many.jsonl line 41: not JSON" in text and text.endswith("; ..."), text


def test_a_split_with_no_usable_row_is_an_error_naming_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "answer": "a"}] * 3)
    with pytest.raises(ValueError, match="no usable train rows.*missing field 'question'.*prompt_field"):
        dataset(path=str(path), preset="gsm8k").tasks("train")
    with pytest.raises(ValueError, match="does not exist"):
        dataset(path=str(tmp_path / "missing.jsonl")).tasks("train")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match="set workload.params.format"):
        dataset(path=str(tmp_path / "d.txt")).tasks("train")


def test_an_empty_held_out_split_of_a_small_file_suggests_test_path(tmp_path):
    """A few good rows, none drawn by the seeded test_fraction: the rows are fine, the split is not."""
    path = write_jsonl(tmp_path / "few.jsonl", ROWS[:3])
    wl = dataset(path=str(path), preset="gsm8k", test_fraction=0.01)
    fix = r"The seeded test_fraction \(0.01\) held out none of the 3 usable rows: set test_path .* larger test_fraction"
    with pytest.raises(ValueError, match=r"no usable test rows.*used 3 train, 0 test. " + fix):
        wl.tasks("train")
    with pytest.raises(ValueError, match="held out all 3 usable rows: add rows, or set a smaller test_fraction"):
        dataset(path=str(path), preset="gsm8k", test_fraction=0.99).tasks("train")
    with pytest.raises(ValueError, match="missing field 'prompt'.*Check the field names"):  # bad rows: the fields
        dataset(path=str(path), test_fraction=0.01).tasks("train")


def test_a_datasetdict_without_the_held_out_split_names_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"no split 'test' \(it has \['train'\]\): set train_split / test_split"):
        dataset(path=str(tmp_path / "dd"), preset="gsm8k").tasks("train")


def test_bad_params_fail_at_construction():
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        dataset(path="x.jsonl", reward="nope")
    with pytest.raises(ValueError, match="prompt_template does not compile"):
        dataset(path="x.jsonl", prompt_template="{{ unclosed")
    with pytest.raises(ValueError, match="preset"):
        dataset(path="x.jsonl", preset="squad")


def test_relative_data_paths_resolve_against_the_start_directory(tmp_path):
    """Workers start elsewhere: the resolved config holds absolute data paths, also in a mix."""
    import yaml

    from astraflow.config import config_from_dict

    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    data = yaml.safe_load((ROOT / "examples" / "wordproblems" / "config.yaml").read_text())
    data["policies"][0]["model"] = "models/none"
    data["workload"]["params"].update(path="data/train.jsonl", test_path=None, test_fraction=0.2)
    cfg = config_from_dict(data, base_dir=tmp_path)
    assert cfg.workload.params["path"] == str(tmp_path / "data" / "train.jsonl")
    assert cfg.policies[0].model == tmp_path / "models" / "none"
    data = yaml.safe_load((ROOT / "examples" / "wordproblems" / "config.yaml").read_text())
    data["policies"][0]["model"] = "models/none"
    data["policies"][0].pop("init")
    data["workload"] = {"name": "mix", "params": {"sources": {
        "words": {"workload": "dataset", "weight": 1, "params": {"path": "data/*.jsonl", "preset": "gsm8k"}},
        "sums": {"workload": "math", "weight": 1}}}}
    with pytest.raises(ValueError, match="models/none does not exist"):  # validation ran on resolved paths
        config_from_dict(data, base_dir=tmp_path)
    resolved = data["workload"]["params"]["sources"]["words"]["params"]["path"]
    assert resolved == str(tmp_path / "data" / "*.jsonl")


def test_a_prompt_repeated_under_other_ids_stays_in_one_split(tmp_path):
    """With ``id_field``, the seeded split still goes by the prompt: the same question under
    several ids (a dataset's duplicates, augmented copies) never lands in both splits."""
    rows = [dict(r, id=f"{i}-{copy}") for copy in range(4) for i, r in enumerate(ROWS)]
    wl = dataset(path=str(write_jsonl(tmp_path / "dup.jsonl", rows)), preset="gsm8k", id_field="id",
                 test_fraction=0.3)
    train, test = wl.tasks("train"), wl.tasks("eval")
    assert train and test
    assert not {p["text"] for p in train} & {p["text"] for p in test}


def test_a_gsm8k_solution_cut_off_after_its_marker_is_skipped(tmp_path):
    """A solution ending in a bare ``####`` has no final answer: skipped and counted, not kept with
    the worked solution as its answer."""
    rows = [{"question": "q1", "answer": "3 + 4 = 7, then 7 * 2 = 14\n####"},
            {"question": "q2", "answer": "5 + 6 = 11\n#### "}, *ROWS]
    wl = dataset(path=str(write_jsonl(tmp_path / "cut.jsonl", rows)), preset="gsm8k", test_fraction=0.25)
    tasks = wl.tasks("train") + wl.tasks("eval")
    assert len(tasks) == len(ROWS) and all("####" not in p["answer"] for p in tasks)
    assert wl.report.bad == {"nothing after the final ####": 2}
    assert "cut.jsonl line 1: nothing after the final ####" in wl.report.summary()


def test_rows_of_other_splits_are_counted_by_reason(tmp_path):
    """With split_field, rows of neither split are skipped but counted by their value (a value
    differing only in case is named as such), so the report says where rows went."""
    values = ["train", "test", "validation", "Train"]
    rows = [dict(r, split=values[i % 4]) for i, r in enumerate(ROWS)]
    wl = dataset(path=str(write_jsonl(tmp_path / "s.jsonl", rows)), preset="gsm8k", split_field="split")
    assert len(wl.tasks("train")) == 10 and len(wl.tasks("eval")) == 10
    rep, wanted = wl.report, "(not train_split 'train' / test_split 'test'"
    assert not rep.bad and rep.other_splits == {f"split value 'validation' {wanted})": 10,
                       f"split value 'Train' {wanted}: it differs from train_split 'train' only in case, "
                       "and values must match exactly)": 10}
    text = rep.summary()
    assert "40 rows read, used 10 train, 10 test; 20 rows of other splits skipped (10 split value" in text, text
    assert "bad rows" not in text and "s.jsonl line" not in text

    # a split_field holding a value per row: a few values by name, the rest under one reason
    rows = [dict(r, split="train" if i < 20 else "test" if i < 25 else f"v{i}") for i, r in enumerate(ROWS)]
    del rows[-1]["split"]
    wl = dataset(path=str(write_jsonl(tmp_path / "v.jsonl", rows)), preset="gsm8k", split_field="split")
    assert len(wl.tasks("train")) == 20
    other = wl.report.other_splits
    assert sum(other.values()) == 15 and len(other) == 7
    assert other[f"split value 'v25' {wanted})"] == 1
    assert other[f"split values beyond the first 5 {wanted})"] == 9
    assert other[f"no value in split field 'split' {wanted})"] == 1


def test_a_failing_user_reward_is_named_in_the_workloads_reward(tmp_path):
    wl = dataset(path=str(write_jsonl(tmp_path / "r.jsonl", ROWS)), preset="gsm8k",
                 reward="tests.workloads.test_rewards:user_nan")
    with pytest.raises(RuntimeError, match="^reward tests.workloads.test_rewards:user_nan returned nan"):
        wl.reward("#### 2", wl.tasks("train")[0])


def test_a_prompt_or_answer_that_is_a_list_or_an_object_is_a_bad_row_not_its_repr(tmp_path):
    """TRL's conversational layout (``prompt`` holding chat messages) and a list of accepted
    answers would otherwise become their Python repr: a prompt no one wrote, an answer nothing
    matches. They are skipped and located, the messages with the field to set."""
    good = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    rows = good + [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"},
                   {"prompt": "2+2?", "answer": ["4", "four"]}, {"prompt": {"text": "3+3?"}, "answer": "6"}]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", good)
    wl = dataset(path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "test.jsonl"))
    assert sorted(t["answer"] for t in wl.tasks("train")) == ["0", "2", "4"]
    text = wl.report.summary()
    for where in ("train.jsonl line 4: field 'prompt' is a list, not text (chat messages? set messages_field: prompt)",
                  "train.jsonl line 5: field 'answer' is a list, not text or a number",
                  "train.jsonl line 6: field 'prompt' is a dict, not text"):
        assert where in text, text


def test_an_answer_listed_alone_is_that_answer(tmp_path):
    """A list of accepted answers holding one (OlympiadBench's ``final_answer: ["$42$"]``) is that
    answer, as its repr scored under math_verify before lists were bad rows; two stay a bad row."""
    rows = [{"prompt": f"{i}+{i}?", "answer": [f"${2 * i}$"]} for i in range(3)] + [{"prompt": "1+1?", "answer": [2]}]
    write_jsonl(tmp_path / "train.jsonl", rows + [{"prompt": "2+2?", "answer": ["4", "four"]}])
    write_jsonl(tmp_path / "test.jsonl", rows)
    wl = dataset(path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "test.jsonl"), reward="math_verify")
    tasks = sorted(wl.tasks("train"), key=lambda t: t["answer"])
    assert [t["answer"] for t in tasks] == ["$0$", "$2$", "$4$", "2"]
    assert [wl.reward("\\boxed{4}", t) for t in tasks] == [0.0, 0.0, 1.0, 0.0]
    assert "train.jsonl line 5: field 'answer' is a list, not text or a number" in wl.report.summary()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_dotted_field_name_reaches_into_nested_objects(tmp_path, fmt):
    """An answer under ``solution.final`` (a JSON object, a Parquet struct) was a "missing field"
    on every row; naming the object itself says which dotted path to set."""
    rows = [{"meta": {"id": f"r{i}", "level": i % 2}, "problem": {"text": f"{i}+{i}?"},
             "solution": {"final": 2 * i, "steps": "..."}} for i in range(6)]
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "n.jsonl", rows)
    else:
        import datasets

        path = tmp_path / "n.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    wl = dataset(path=str(path), test_path=str(path), prompt_field="problem.text", answer_field="solution.final",
                 id_field="meta.id", difficulty_field="meta.level", reward="numeric")
    task = next(t for t in wl.tasks("train") if t["id"] == "r3")
    assert (task["text"], task["answer"], task["difficulty"]) == ("3+3?", "6", "1")
    with pytest.raises(ValueError, match=r"field 'solution' is a dict, not text or a number \(an object with keys "
                                         r"\['final', 'steps'\]: set answer_field: solution.final, a dotted path"):
        dataset(path=str(path), test_path=str(path), prompt_field="problem.text",
                answer_field="solution").tasks("train")


def test_a_whole_number_in_a_float_column_is_read_as_the_integer(tmp_path):
    """Arrow stores a Parquet column of answers holding one fraction as floats: the answer 7 read
    as "7.0" scored 0 under the default ``exact`` reward for "#### 7"."""
    import pandas as pd

    prompts = [f"q{i}" for i in range(8)]
    pd.DataFrame({"prompt": prompts, "answer": [2.5] + list(range(7))}).to_parquet(tmp_path / "f.parquet")
    wl = dataset(path=str(tmp_path / "f.parquet"), test_path=str(tmp_path / "f.parquet"))
    answers = {t["text"]: t["answer"] for t in wl.tasks("train")}
    assert answers == {"q0": "2.5", **{f"q{i}": str(i - 1) for i in range(1, 8)}}
    assert wl.reward("#### 6", next(t for t in wl.tasks("train") if t["text"] == "q7")) == 1.0


def test_an_empty_prompt_or_answer_is_told_apart_from_a_missing_one(tmp_path):
    """A row whose prompt is ``""`` was reported as missing its field: the user looked for a typo in
    the field name instead of the blank values."""
    rows = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(4)]
    rows += [{"prompt": "", "answer": "1"}, {"prompt": "1+1?", "answer": " "}, {"answer": "3"}]
    write_jsonl(tmp_path / "e.jsonl", rows)
    wl = dataset(path=str(tmp_path / "e.jsonl"), test_path=str(tmp_path / "e.jsonl"))
    assert len(wl.tasks("train")) == 4
    text = wl.report.summary()
    for where in ("e.jsonl line 5: empty field 'prompt'", "e.jsonl line 6: empty field 'answer'",
                  "e.jsonl line 7: missing field 'prompt'"):
        assert where in text, text


@pytest.mark.parametrize("template", [
    "{{ prompt }}", "{{prompt}}\n", "Q: {{ prompt }}\r\nA:", "a\rb {{  prompt }} c {{prompt}}\n\n", "no prompt", "",
    "{{ prompt }}\nGive your reasoning, then the final answer after \"####\".", "} {{ prompt }} {",
    "{{ prompt|upper }}", "{{- prompt }}", "{% raw %}{{ prompt }}{% endraw %}", "[{{ lang }}] {{ prompt }}",
])
def test_a_template_that_only_places_the_prompt_renders_as_jinja_does(template):
    """Text around ``{{ prompt }}`` is rendered by joining (large datasets read faster); the
    result is Jinja's, newlines included, and any other template is Jinja's own."""
    from jinja2 import StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    from astraflow.workloads.templates import _PromptOnly, compile_template

    jinja = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(template)
    compiled = compile_template(template)
    assert isinstance(compiled, _PromptOnly) == ("lang" not in template and "|" not in template
                                                 and "{%" not in template and "{{-" not in template)
    for value in ("hello", "multi\r\nline\n", "{{ not a template }}", "ünï 😀", "", "  spaced  "):
        fields = {"prompt": value, "lang": "en"}
        assert compiled.render(fields) == jinja.render(fields)
