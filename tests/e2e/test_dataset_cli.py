"""The dataset workload through the real CLI: the word-problem example's data script, a short
run on a locally built chat-templated model, the bad-row report of ``astraflow check``, and
the real-cluster GSM8K config checked against a local model of the same family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def wordproblems(tmp_path_factory):
    out = tmp_path_factory.mktemp("wp")
    subprocess.run([sys.executable, "examples/wordproblems/make_data.py", "--out", str(out), "--train", "300",
                    "--test", "40"], cwd=ROOT, check=True, capture_output=True)
    return out


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_dataset_example_builds_a_bpe_chat_model_and_trains(wordproblems, tmp_path):
    data = yaml.safe_load((ROOT / "examples/wordproblems/config.yaml").read_text())
    pol = data["policies"][0]
    pol["model"] = str(tmp_path / "model")
    pol["init"].update(preset="tiny", vocab_size=400, warm_start_seconds=0, warm_start_steps=5)
    pol["init"].pop("warm_start_target")
    data["run"].update(max_steps=2, timeout_s=150)
    data["workload"]["params"].update(path=str(wordproblems / "train.jsonl"), test_path=str(wordproblems / "test.jsonl"),
                                      num_test=8)
    data["workload"].update(group_size=4, eval={"every": 2, "num_prompts": 8}, sampling={"max_new_tokens": 12})
    data["dataflow"]["batch_size"] = 8
    data["rollout"]["capacity"] = 16
    data["cluster"] = {"dashboard_port": 0}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = cli("run", str(cfg), "--run-dir", str(run_dir), timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "workload dataset: 300 train and 8 held-out prompts" in proc.stdout + proc.stderr
    from astraflow.models import load_model

    _, tok = load_model(tmp_path / "model")
    assert tok.chat_template and len(tok) > 262  # a trained BPE, not the byte-level tokenizer
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2]
    evals = [x for x in lines if "eval_accuracy" in x]
    assert [x["step"] for x in evals] == [0, 2] and all(x["eval_by_difficulty"] for x in evals)
    from storage.trajectories import open_trajectory_store
    from storage.trajectories.layout import EntryRef

    store = open_trajectory_store(str(run_dir / "trajectories"), mode="r")
    stored, = store.read([EntryRef(store.segments()[0], 0)])
    prompt = tok.decode(stored.tokens[~stored.loss_mask.astype(bool)])
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.e2e
def test_check_reports_bad_rows_with_their_location_and_fails_when_nothing_is_usable(wordproblems, tmp_path):
    rows = (wordproblems / "train.jsonl").read_text().splitlines()[:50]
    rows[3] = '{"question": "no answer here"}'
    rows[7] = "{broken"
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    base = ["--set", f"policies.0.model={tmp_path / 'none'}", "--set", f"workload.params.test_path={wordproblems / 'test.jsonl'}"]
    proc = cli("check", "examples/wordproblems/config.yaml", *base, "--set", f"workload.params.path={tmp_path / 'train.jsonl'}")
    assert proc.returncode == 0, proc.stderr
    assert "48 train" in proc.stderr and "train.jsonl line 4: missing field 'answer'" in proc.stderr
    assert "train.jsonl line 8: not JSON" in proc.stderr
    proc = cli("check", "examples/wordproblems/config.yaml", *base, "--set", f"workload.params.path={tmp_path / 'train.jsonl'}",
               "--set", "workload.params.prompt_field=prompt")
    assert proc.returncode == 2 and "no usable train rows" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("check", "examples/wordproblems/config.yaml", *base, "--set", "workload.params.reward=nope")
    assert proc.returncode == 2 and "workload.params.reward: unknown reward 'nope'" in proc.stderr


@pytest.mark.e2e
def test_real_cluster_gsm8k_config_checks_against_a_local_qwen2_model(wordproblems, tmp_path):
    """The Qwen2.5 GSM8K config cannot run here (no downloads); with its model path pointed at
    a locally built Qwen2 model with a chat template, GSM8K-layout files and its Slurm partitions
    named as this machine's Slurm names them (as a user at another site would), it validates."""
    from astraflow.models import build_bpe_tokenizer, init_model

    texts = [json.loads(x)["question"] for x in (wordproblems / "train.jsonl").read_text().splitlines()]
    init_model(tmp_path / "qwen", preset="tiny", arch="qwen2", tokenizer=build_bpe_tokenizer(texts, 400))
    proc = cli("check", "examples/real/qwen2.5-0.5b-gsm8k.yaml", "--set", f"policies.0.model={tmp_path / 'qwen'}",
               "--set", f"workload.params.path={wordproblems / 'train.jsonl'}",
               "--set", f"workload.params.test_path={wordproblems / 'test.jsonl'}",
               "--set", "partitions[trainer].slurm_partition=h100", "--set", "partitions[rollout].slurm_partition=h100")
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["workload"]["params"]["reward"] == "math_verify"
    assert {p["name"]: p["scheduler"] for p in resolved["partitions"]} == {"data": "local", "trainer": "slurm", "rollout": "slurm"}
    assert "workload dataset: 300 train and 40 held-out prompts" in proc.stderr
