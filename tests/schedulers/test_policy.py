"""The allowlists of partition env variables and extra sbatch options (schedulers/policy.py)."""

from __future__ import annotations

import pytest

from schedulers import Partition
from schedulers.policy import (DEFAULT_SBATCH_OPTIONS_ALLOWLIST, DEFAULT_WORKER_ENV_ALLOWLIST, PolicyError,
                               WorkerPolicy, env_allowed)

LOADERS = ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PATH", "BASH_ENV", "ENV",
           "PERL5LIB", "RUBYLIB", "NODE_OPTIONS", "DYLD_INSERT_LIBRARIES", "IFS", "PS4", "SHELLOPTS",
           "MALLOC_CHECK_", "GLIBC_TUNABLES", "CUDA_INJECTION64_PATH", "NCCL_NET_PLUGIN",
           "DASK_DISTRIBUTED__WORKER__PRELOAD", "DASK_CONFIG", "HOME", "XDG_CONFIG_HOME", "HF_ENDPOINT",
           "WANDB_BASE_URL", "https_proxy", "SSL_CERT_FILE", "TRITON_CACHE_DIR", "HF_HOME"]


@pytest.mark.parametrize("name", LOADERS)
def test_loader_and_interpreter_variables_are_refused_by_default_and_by_any_pattern(name):
    assert not env_allowed(name, DEFAULT_WORKER_ENV_ALLOWLIST)
    assert not env_allowed(name, ("*", "LD_*", "PYTHON*"))
    assert env_allowed(name, (name,))  # the owner may name it exactly


# Dask lower-cases what follows DASK_ and reads whole configs from these: each can run code in a worker
DASK_LOADERS = ["DASK_distributed__worker__preload", "DASK_Distributed__Comm__Require_Encryption",
                "DASK_INTERNAL_INHERIT_CONFIG", "DASK_ROOT_CONFIG", "DASK_LOGGING__VERSION", "DASK_logging__handlers",
                "DASK_DISTRIBUTED__LOGGING_FILE_CONFIG"]


@pytest.mark.parametrize("name", DASK_LOADERS)
def test_dask_settings_that_load_code_are_refused_by_any_pattern_whatever_their_case(name):
    assert not env_allowed(name, ("*", "DASK_*"))
    assert env_allowed(name, (name,))


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_IB_HCA", "NCCL_DEBUG",
                                  "TORCH_NCCL_BLOCKING_WAIT", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE",
                                  "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "TMPDIR", "LC_ALL"])
def test_common_tuning_variables_pass_by_default(name):
    assert env_allowed(name, DEFAULT_WORKER_ENV_ALLOWLIST)


def test_problems_name_the_partition_the_variable_and_the_fix():
    part = Partition(name="gpu", scheduler="slurm", env={"LD_PRELOAD": "/tmp/x.so", "FOO": "1", "OMP_NUM_THREADS": "4"},
                     sbatch_options=("--qos=high", "--export=ALL,LD_PRELOAD=x", "--chdir=/tmp", "--exp=ALL",
                                     "--array=0-3"))
    problems = WorkerPolicy().problems(part)
    assert problems[0].startswith("partitions[gpu].env: FOO is not in cluster.worker_env_allowlist: remove it")
    assert "add 'FOO' to cluster.worker_env_allowlist in the run's config" in problems[0]
    assert "LD_PRELOAD is not in cluster.worker_env_allowlist (it can load code" in problems[1]
    assert [p.split(":")[1].split()[0] for p in problems[2:]] == ["--export", "--chdir", "--exp", "--array"]
    assert "add '--chdir' to cluster.sbatch_options_allowlist" in problems[3]
    assert "--array cannot be used (one worker is one job" in problems[5]
    with pytest.raises(PolicyError, match="FOO"):
        WorkerPolicy().check(part)
    assert WorkerPolicy().check(Partition(name="ok", scheduler="slurm", env={"OMP_NUM_THREADS": "4"},
                                          sbatch_options=("--account=proj", "--exclusive"))) is None


def test_explicit_entries_extend_the_policy():
    part = Partition(name="gpu", scheduler="slurm", env={"LD_LIBRARY_PATH": "/opt/site/lib"},
                     sbatch_options=("--chdir=/scratch",))
    policy = WorkerPolicy.of([*DEFAULT_WORKER_ENV_ALLOWLIST, "LD_LIBRARY_PATH"],
                             [*DEFAULT_SBATCH_OPTIONS_ALLOWLIST, "--chdir"])
    assert policy.problems(part) == []
    assert WorkerPolicy.of(["CUDA_*"]).problems(Partition(name="x", env={"OMP_NUM_THREADS": "1"}))  # replaces


@pytest.mark.parametrize("sbatch, needle", [
    (["--time"], r"rendered from the partition \(walltime\)"),
    (["--array"], "--array cannot be allowed"),
    (["account"], "is not an sbatch option name"),
    (["--qos=high"], "is not an sbatch option name"),
])
def test_bad_sbatch_allowlist_entries_are_refused(sbatch, needle):
    with pytest.raises(ValueError, match=needle):
        WorkerPolicy.of(None, sbatch)


def test_bad_env_allowlist_entries_are_refused():
    with pytest.raises(ValueError, match="not variable names or fnmatch patterns"):
        WorkerPolicy.of(["A B"])


def test_refusals_map_partitions_to_why():
    parts = {"a": Partition(name="a", env={"PYTHONPATH": "/x"}), "b": Partition(name="b")}
    assert list(WorkerPolicy().refusals(parts)) == ["a"]
