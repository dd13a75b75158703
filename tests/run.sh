#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up the environment, start a local Slurm for the
# Slurm tier, run pytest, stop what was started. This is the README's test command and what
# .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# 1. environment (.venv in the checkout; torch is pinned in pyproject so no CUDA build is pulled).
#    A machine that sets PYTHONDONTWRITEBYTECODE would make each of the suite's hundreds of Python
#    processes compile the project's modules again, and each pytest worker rewrite every test
#    module again: here they cache them (__pycache__, ignored by git)
unset PYTHONDONTWRITEBYTECODE
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv
fi
.venv/bin/pip install -q -e ".[test,megatron,plot]"

# 1b. Debian chromium + chromedriver for the browser test of the dashboard page (tests/monitoring);
#     Selenium drives them, nothing downloads a browser
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }
  else
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null
  fi
fi

# 1c. Debian bubblewrap for the code sandbox (astraflow/sandbox, tests/sandbox); with it installed
#     the sandbox tests must run, not skip
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }
  else
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null
  fi
fi
export ASTRAFLOW_REQUIRE_SANDBOX=1

# 2. a real local Slurm for the slurm tier (installs slurm-wlm + munge via apt when missing)
export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/astraflow-slurm}
slurm_started=0
if [ "${ASTRAFLOW_SKIP_SLURM:-0}" != 1 ]; then
  bash tests/slurm/local_slurm.sh start   # fails the run if Slurm cannot start (ASTRAFLOW_SKIP_SLURM=1 skips the tier)
  slurm_started=1
  export ASTRAFLOW_REQUIRE_SLURM=1
fi
cleanup() {
  if [ "$slurm_started" = 1 ]; then bash tests/slurm/local_slurm.sh stop || true; fi
}
trap cleanup EXIT

# 3. the suite (pytest exits 5 when it collected nothing: that is a failure here too) on three
#    pytest-xdist workers on two cores (--dist loadgroup: tests that must not run side by side
#    share a group, see tests/conftest.py): many end-to-end tests wait on paced runs, Slurm jobs
#    and process start-ups, which the other workers' tests fill; with two workers the cores were
#    left idle part of the time. ASTRAFLOW_TEST_WORKERS=N sets the count; 0 runs everything in
#    this one process.
workers=${ASTRAFLOW_TEST_WORKERS:-3}
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist loadgroup); fi
set +e
.venv/bin/python -m pytest "${parallel[@]}" "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
