"""Reading dataset files: values keep the type and text the file gave them, rows keep their
physical line, and a file that cannot be read is an error naming the file, where, and the fix."""

import csv
import gzip
import json
import re

import pytest

from astraflow.workloads.base import make_workload
from astraflow.workloads.datafiles import read_rows, resolve_path

PROMPTS = [f"what is {i} + 1?" for i in range(20)]


def dataset(path, **params):
    return make_workload("dataset", {"path": str(path), "test_path": str(path), **params}, seed=0)


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_integer_answers_stay_integers_beside_float_ones(tmp_path, fmt):
    """Arrow reads a column with one float as floats, "7" became "7.0": JSON is parsed here."""
    rows = [{"prompt": p, "answer": 7, "id": i} for i, p in enumerate(PROMPTS)]
    rows += [{"prompt": "half", "answer": 2.50, "id": 99}, {"prompt": "big", "answer": 1e3, "id": 100}]
    text = "\n".join(json.dumps(r) for r in rows) if fmt == "jsonl" else json.dumps(rows)
    (tmp_path / f"d.{fmt}").write_text(text.replace("2.5", "2.50").replace("1000.0", "1e3"))
    wl = dataset(tmp_path / f"d.{fmt}", id_field="id")
    answers = {p["text"]: p["answer"] for p in wl.tasks("train")}
    assert answers["what is 3 + 1?"] == "7" and answers["half"] == "2.50" and answers["big"] == "1e3"
    assert {p["id"] for p in wl.tasks("train")} >= {"0", "99"}
    payload = next(p for p in wl.tasks("train") if p["answer"] == "7")
    assert wl.reward("#### 7", payload) == 1.0


def write_csv(path, rows, encoding="utf-8"):
    with open(path, "w", newline="", encoding=encoding) as f:
        csv.writer(f).writerows([["prompt", "answer"], *rows])
    return path


def test_csv_locations_are_the_line_a_row_starts_on(tmp_path):
    rows = [["line one\nline two", "1"], ["q2", "007"], [], ["q3", "3", "x"], ["q4", "NA"]]
    path = write_csv(tmp_path / "m.csv", rows)
    rows = read_rows(str(path))
    assert [r.location for r in rows] == ["m.csv line 2", "m.csv line 4", "m.csv line 6", "m.csv line 7"]
    assert rows[0].fields == {"prompt": "line one\nline two", "answer": "1"} and rows[1].fields["answer"] == "007"
    assert rows[2].fields is None and rows[2].error == "3 fields under a header of 2"
    assert rows[3].fields == {"prompt": "q4", "answer": "NA"}  # text as written, not a missing value


def test_csv_with_a_byte_order_mark_reads_its_header(tmp_path):
    """Excel's "CSV UTF-8" starts with a BOM, which must not become part of the first column's name."""
    path = write_csv(tmp_path / "excel.csv", [[p, str(i)] for i, p in enumerate(PROMPTS)], encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    assert read_rows(str(path))[0].fields == {"prompt": PROMPTS[0], "answer": "0"}
    assert len(dataset(path).tasks("train")) == len(PROMPTS)


def test_json_lines_in_a_json_file_skip_only_the_bad_line(tmp_path):
    lines = [json.dumps({"prompt": p, "answer": "1"}) for p in PROMPTS[:4]]
    lines.insert(2, '{"prompt": "broken')
    for name in ("x.json", "x.jsonl"):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        rows = read_rows(str(tmp_path / name))
        assert [r.fields is None for r in rows] == [False, False, True, False, False]
        assert rows[2].location == f"{name} line 3"
        assert rows[2].error == "not JSON: Invalid control character at column 19", rows[2].error
        wl = dataset(tmp_path / name)
        assert len(wl.tasks("train")) == 4 and f"{name} line 3: not JSON" in wl.report.summary()


_UNREADABLE = [
    ("cut.json", b'[{"prompt": "a", "answer": "1"},\n', r"cut.json is not valid JSON: .* at line 2 column 1; "
                                                        r"fix the file there .*JSON lines"),
    ("latin.csv", "prompt,answer\nq,1\ncafé,2\n".encode("latin1"),
     r"latin.csv is not UTF-8 \(byte 0xe9 on line 3\); save it as UTF-8 .*iconv -f latin1"),
    ("wide.csv", "prompt,answer\nq,1\n".encode("utf-16"), r"wide.csv is UTF-16 .*iconv -f utf-16"),
    ("header.csv", b"prompt,answer\n", r"header.csv holds no rows .*only its header.*fix workload.params.path"),
    ("empty.jsonl", b"\n", r"empty.jsonl holds no rows"),
    ("none.json", b"[]", r"none.json holds no rows"),
    ("quote.csv", b'prompt,answer\nq,1\n"never closed,2\n', r"quote.csv line 3 is not valid CSV .*unclosed quote"),
    ("wrapped.json", json.dumps({"data": [{"prompt": "a", "answer": "1"}]}, indent=1).encode(),
     r"wrapped.json holds one JSON object \(keys \['data'\]\), not rows; write the rows as a JSON list.*"
     r"under key 'data'; .*jq -c '.data\[\]' FILE"),
    # PowerShell 5's `ConvertTo-Json > data.json` writes UTF-16: the encoding, not the field names, is the fix
    ("ps.json", json.dumps([{"prompt": "a", "answer": "1"}] * 3, indent=4).encode("utf-16"),
     r"ps.json is UTF-16, not UTF-8; save it as UTF-8 or convert it: iconv -f utf-16"),
    ("wide.jsonl", "\n".join([json.dumps({"prompt": "a", "answer": "1"})] * 3).encode("utf-16"),
     r"wide.jsonl is UTF-16, not UTF-8; .*iconv -f utf-16 "),
    ("wider.jsonl", json.dumps({"prompt": "a", "answer": "1"}).encode("utf-32"), r"wider.jsonl is UTF-32, not UTF-8"),
    ("list.jsonl", json.dumps([{"prompt": p, "answer": "1"} for p in PROMPTS], indent=2).encode(),
     r"list.jsonl is one JSON list, not JSON lines .*set workload.params.format: json, or name the file .json"),
    ("oneline.jsonl", json.dumps([{"prompt": p, "answer": "1"} for p in PROMPTS]).encode(),
     r"oneline.jsonl is one JSON list, not JSON lines"),
    ("data.jsonl.gz", gzip.compress(b'{"prompt": "a", "answer": "1"}\n', mtime=0),
     r"data.jsonl.gz is compressed; decompress it \(gunzip -k .*data.jsonl.gz\)"),
]


@pytest.mark.parametrize("name, data, message", _UNREADABLE, ids=[case[0] for case in _UNREADABLE])
def test_unreadable_files_name_the_file_where_and_the_fix(tmp_path, name, data, message):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=message):  # ValueError: the CLI's exit 2 with the message
        dataset(tmp_path / name).tasks("train")


def test_a_file_whose_rows_do_not_parse_names_its_format_not_the_fields(tmp_path):
    """No row parsed, or the only row wraps the rows: changing the field names cannot help."""
    (tmp_path / "d.gz").write_bytes(gzip.compress(b'{"prompt": "a", "answer": "1"}\n', mtime=0))
    with pytest.raises(ValueError, match=r"d.gz is compressed; decompress it \(gunzip -k"):
        dataset(tmp_path / "d.gz", format="jsonl").tasks("train")
    write_csv(tmp_path / "csv.jsonl", [[p, "1"] for p in PROMPTS])
    with pytest.raises(ValueError, match=r"not JSON.*No row parsed at all, so the file is not in the format its "
                                         r"suffix names: .*set workload.params.format"):
        dataset(tmp_path / "csv.jsonl").tasks("train")
    with pytest.raises(ValueError, match=r"No row parsed at all, so the file is not jsonl"):
        dataset(tmp_path / "csv.jsonl", format="jsonl").tasks("train")
    rows = [{"prompt": p, "answer": "1"} for p in PROMPTS]
    (tmp_path / "one.json").write_text(json.dumps({"version": 1, "data": rows}))  # json.dump on one line
    with pytest.raises(ValueError, match=r"one.json line 1 is one JSON object, not a row: the rows are under key "
                                         r"'data'; take them out as JSON lines: jq -c '.data\[\]' FILE"):
        dataset(tmp_path / "one.json").tasks("train")
    # rows whose prompt is chat messages are rows, not wrappers, with or without messages_field set
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}],
                                                     "answer": "1"}))
    with pytest.raises(ValueError, match="not chat messages ending with a user turn.*Check the field names"):
        dataset(tmp_path / "chat.jsonl", messages_field="messages").tasks("train")
    with pytest.raises(ValueError, match="missing field 'prompt'.*Check the field names"):
        dataset(tmp_path / "chat.jsonl").tasks("train")


def test_a_json_list_after_much_whitespace_is_a_list(tmp_path):
    (tmp_path / "ws.json").write_text("\n" * 70 + " " * 70_000 + json.dumps([{"prompt": p, "answer": "1"}
                                                                             for p in PROMPTS], indent=1))
    rows = read_rows(str(tmp_path / "ws.json"))
    assert len(rows) == len(PROMPTS) and rows[0].location == "ws.json row 1" and rows[0].fields["prompt"] == PROMPTS[0]


@pytest.mark.parametrize("fmt", ["auto", "parquet"])
def test_a_directory_of_hub_shards_names_the_glob_to_use(tmp_path, fmt):
    """``huggingface-cli download --repo-type dataset`` gives a directory of parquet shards, not a
    ``save_to_disk`` one: the error names the globs that read it."""
    import datasets

    main = tmp_path / "gsm8k" / "main"
    main.mkdir(parents=True)
    (tmp_path / "gsm8k" / ".cache").mkdir()
    (tmp_path / "gsm8k" / "README.md").write_text("# gsm8k")
    rows = [{"prompt": p, "answer": "1"} for p in PROMPTS]
    for name, part in (("train-00000-of-00002", rows[:8]), ("train-00001-of-00002", rows[8:16]),
                       ("test-00000-of-00001", rows[16:])):
        datasets.Dataset.from_list(part).to_parquet(str(main / f"{name}.parquet"))
    for path in (main, tmp_path / "gsm8k"):
        with pytest.raises(ValueError, match=re.escape(f"{path} is a directory of data files, not one written by "
                                                       "datasets' save_to_disk; point workload.params.path at the "
                                                       f"training files with a glob: path: {main}/train-*.parquet "
                                                       f"(and test_path: {main}/test-*.parquet)") + "$"):
            dataset(path, format=fmt).tasks("train")
    wl = make_workload("dataset", {"path": f"{main}/train-*.parquet", "test_path": f"{main}/test-*.parquet"}, seed=0)
    assert len(wl.tasks("train")) == 16 and len(wl.tasks("test")) == 4


def test_a_tilde_in_a_data_path_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    write_csv(tmp_path / "data" / "t.csv", [[p, "1"] for p in PROMPTS])
    assert resolve_path("~/data/t.csv", "/elsewhere") == str(tmp_path / "data" / "t.csv")
    assert resolve_path("~/data/*.csv", "/elsewhere") == str(tmp_path / "data" / "*.csv")
    assert resolve_path("data/t.csv", tmp_path) == str(tmp_path / "data" / "t.csv")
    assert len(read_rows("~/data/t.csv")) == len(read_rows("~/data/*.csv")) == len(PROMPTS)


@pytest.mark.parametrize("missing", ["nothere.csv", "nothere-*.csv"])
def test_a_missing_held_out_file_names_test_path_not_path(tmp_path, missing):
    write_csv(tmp_path / "t.csv", [[p, "1"] for p in PROMPTS])
    params = {"path": str(tmp_path / "t.csv"), "test_path": str(tmp_path / missing)}
    with pytest.raises(ValueError, match=r"workload\.params\.test_path") as err:
        make_workload("dataset", params, seed=0).tasks("test")
    assert "workload.params.path" not in str(err.value)


def test_a_compressed_held_out_file_names_test_path(tmp_path):
    write_csv(tmp_path / "t.csv", [[p, "1"] for p in PROMPTS])
    with gzip.open(tmp_path / "held.csv.gz", "wt") as f:
        f.write("prompt,answer\nwhat?,1\n")
    params = {"path": str(tmp_path / "t.csv"), "test_path": str(tmp_path / "held.csv.gz")}
    with pytest.raises(ValueError, match=r"is compressed.*point workload\.params\.test_path at that"):
        make_workload("dataset", params, seed=0).tasks("test")
