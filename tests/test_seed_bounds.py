"""Seeds are 0 to 2**32 - 1, what torch and numpy take: one beyond is refused by ``astraflow
check`` (exit 2) naming its key, not by torch or numpy once the run has started."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli_errors import _config, _invoke

SIM = str(Path(__file__).resolve().parents[1] / "examples" / "sim" / "config.yaml")


@pytest.mark.parametrize("sim, setting, key", [
    (False, "run.seed=18446744073709551616", "run.seed: Input should be less than 4294967296"),
    (False, "run.seed=-1", "run.seed: Input should be greater than or equal to 0"),
    (False, "policies.solver.init.seed=4294967296", "policies[solver].init.seed: Input should be less than 4294967296"),
    (True, "workload.seed=-1", "workload.seed: Input should be greater than or equal to 0"),
    (True, "workload.params.seed=4294967296", "workload.params.seed: Input should be less than 4294967296"),
])
def test_a_seed_out_of_range_is_refused_naming_its_key(tmp_path, sim, setting, key):
    res = _invoke("check", SIM if sim else str(_config(tmp_path)), "--set", setting)
    assert res.exit_code == 2, res.output
    assert key in res.output


def test_the_largest_seeds_check(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "run.seed=4294967295", "--set", "workload.seed=4294967295",
                  "--set", "policies.solver.init.seed=4294967295")
    assert res.exit_code == 0, res.output
