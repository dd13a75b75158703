"""Partition validation, worker names and the shared worker command line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from schedulers import Partition, make_scheduler, parse_worker_name, walltime_seconds, worker_command, worker_name

label = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.]{0,12}", fullmatch=True)


@given(name=label, region=label, hardware=label, role=st.sampled_from(["rollout", "trainer", "data"]),
       index=st.integers(0, 10**6))
def test_worker_name_round_trips(name, region, hardware, role, index):
    p = Partition(name=name, region=region, hardware=hardware, role=role)
    n = worker_name(p, index)
    assert parse_worker_name(n) == {"role": role, "partition": name, "region": region, "hardware": hardware,
                                    "index": index}


def test_worker_name_example():
    p = Partition(name="h100", scheduler="slurm", region="eu", hardware="H100", role="rollout")
    assert worker_name(p, 0) == "rollout-h100-eu-H100-0"
    for bad in ["rollout-h100-eu-H100", "boss-h100-eu-H100-0", "rollout-h100-eu-H100-x", "rollout-h-1-eu-H-0"]:
        with pytest.raises(ValueError, match="role-partition-region-hardware-index"):
            parse_worker_name(bad)


@pytest.mark.parametrize(
    "kw, fix",
    [
        (dict(name="h100-eu"), "no '-'"),
        (dict(name="a b"), "letters, digits"),
        (dict(region="eu/west"), "letters, digits"),
        (dict(nodes=-1), "use 0 or more"),
        (dict(cpus_per_node=0), "use 1 or more"),
        (dict(walltime="1h"), "HH:MM:SS"),
        (dict(walltime="01:75:00"), "minutes must be < 60"),
        (dict(walltime="00:00:00"), "positive time limit"),
        (dict(mem="4 GB"), "'4G'"),
        (dict(gres="gpu:h100:4"), "remove gres or set scheduler: slurm"),
        (dict(slurm_partition="gpu"), "remove slurm_partition or set scheduler: slurm"),
        (dict(scheduler="slurm", gres="gpu h100"), "name\\[:type\\]\\[:count\\]"),
        (dict(scheduler="slurm", gres="gpu:h100:4", gpus_per_node=2), "make them equal"),
        (dict(scheduler="slurm", gres="gpu:4", gpus_per_node=1), "asks for 4 GPU.*make them equal"),
        (dict(scheduler="slurm", gres="gpu:2"), "asks for 2 GPU.*gpus_per_node is 0"),
        (dict(scheduler="slurm", gres="nvme:1", gpus_per_node=4), "asks for no GPU.*add gpu:4 to gres"),
        (dict(scheduler="slurm", mem="1G", sbatch_options=["--mem-per-cpu=512M"]),
         "mem 1G and sbatch option --mem-per-cpu both set the job's memory.*keep one"),
        (dict(scheduler="slurm", gpus_per_node=2, sbatch_options=["--gpus-per-task=1"]),
         "--gpus-per-task and the partition's GPU request.*set gpus_per_node only"),
        (dict(scheduler="slurm", sbatch_options=("--time=10",)), "set walltime instead"),
        (dict(scheduler="slurm", sbatch_options=("account=x",)), "--option=value"),
        (dict(resources={"GPU-mem": 1}), "resource name"),
        (dict(resources={"GPU": -1}), ">= 0"),
        (dict(env={"1X": "y"}), "env variable name"),
        (dict(role="judge"), "rollout"),
        (dict(scheduler="pbs"), "local"),
        (dict(typo=1), "Extra inputs"),
    ],
)
def test_bad_partitions_say_how_to_fix(kw, fix):
    with pytest.raises(ValidationError, match=fix):
        Partition(**{"name": "p", **kw})


def test_partition_is_frozen_and_derives_worker_settings():
    p = Partition(name="h100", scheduler="slurm", gres="gpu:h100:4", gpus_per_node=4, cpus_per_node=8, mem="16G")
    with pytest.raises(ValidationError):
        p.nodes = 3
    assert p.worker_resources == {"rollout": 1.0, "GPU": 4.0}
    assert p.worker_threads == 8 and p.worker_memory_limit == "16GiB"
    assert Partition(name="c", mem="2048").worker_memory_limit == "2048MiB"
    # Slurm's --mem=0 (all of the node's memory): the job asks for it, the worker takes what it has
    assert Partition(name="c", mem="0").worker_memory_limit == "auto"
    assert Partition(name="c", mem="0G").worker_memory_limit == "auto"
    assert Partition(name="c", resources={"slots": 2}).worker_resources == {"slots": 2.0}
    assert "Slurm time limit" in Partition.model_fields["walltime"].description  # field docs reach the schema


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("5:30", 330), ("01:00:00", 3600), ("2-00", 172800),
                                           ("1-02:03", 93780), ("1-02:03:04", 93784), ("UNLIMITED", None)])
def test_walltime_forms(text, seconds):
    assert walltime_seconds(text) == seconds


def test_worker_command():
    cmd = worker_command("tcp://127.0.0.1:8786", "rollout-a-b-c-0", {"rollout": 1, "GPU": 0.5}, nthreads=2,
                         python="/py", host="127.0.0.1")
    assert cmd == ["/py", "-m", "schedulers.dask_main", "worker", "tcp://127.0.0.1:8786", "--name", "rollout-a-b-c-0",
                   "--nthreads", "2", "--memory-limit", "auto", "--resources", "GPU=0.5 rollout=1", "--no-nanny",
                   "--no-dashboard", "--death-timeout", "60", "--host", "127.0.0.1"]
    assert worker_command("/run/scheduler.json", "n", {}, python="/py")[4:6] == ["--scheduler-file", "/run/scheduler.json"]
    with pytest.raises(ValueError, match="not both"):
        worker_command("tcp://h:1", "n", {}, host="127.0.0.1", interface="lo")
    with pytest.raises(ValueError, match="tcp://host:port"):
        worker_command("h:1", "n", {})


def test_factory_lists_known_kinds(tmp_path):
    assert make_scheduler("local", log_dir=tmp_path).kind == "local"
    with pytest.raises(ValueError, match="'local', 'slurm'"):
        make_scheduler("pbs")


@pytest.mark.parametrize("opt", ["--comment=a --export=ALL", "--account=\"x\"", "--account='x'", "--x=a#b",
                                 "--x=$HOME", "--x=a\\b", "--x=`id`", "--qos=high\n", "--qos=high\n#SBATCH --export=ALL"])
def test_sbatch_option_values_sbatch_would_not_read_literally_are_refused(opt):
    with pytest.raises(ValidationError, match="without blanks, quotes"):
        Partition(name="x", scheduler="slurm", sbatch_options=(opt,))


def test_env_values_with_nul_are_refused():
    with pytest.raises(ValidationError, match="remove the NUL character"):
        Partition(name="x", env={"A": "a\x00b"})


@pytest.mark.parametrize("gres, gpus", [("gpu:4", 4), ("gpu:h100:4", 4), ("gpu", 1), ("gpu:h100", 1),
                                        ("nvme:1,gpu:2", 2), ("gpu:a100:8,nvme:1", 8)])
def test_gres_in_slurms_forms_agrees_with_gpus_per_node(gres, gpus):
    p = Partition(name="g", scheduler="slurm", gres=gres, gpus_per_node=gpus)
    assert p.worker_resources["GPU"] == gpus
