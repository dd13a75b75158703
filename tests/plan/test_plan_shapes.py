"""What ``astraflow plan`` simulates is what it reports: a pool's label is the GPUs of its
simulated nodes (also the sizes the search offers), a sim config's trainer takes the step time
reported, and numbers out of range (minutes, a calibration file's fields) exit 2 naming them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.config import RunConfig, load_config
from astraflow.plan.planner import MAX_MINUTES, MAX_STEPS, Calibration, PlanOptions, shape_for
from astraflow.plan.pools import NODES_PER_PROCESS, PlanError, Pool, parse_pool, sim_config
from astraflow.plan.simulate import _per_pool
from astraflow.rollout.sim_config import PRESETS

ROOT = Path(__file__).resolve().parents[2]
SIM = str(ROOT / "examples/sim/config.yaml")
AUTOSCALE = str(ROOT / "examples/sim/autoscale.yaml")


def _simulated(pool: Pool) -> dict[str, int]:
    """GPUs (engines) of the simulated run's rollout partitions for ``pool``, and its largest worker."""
    cfg = load_config(SIM)
    shape, _ = shape_for(cfg, PlanOptions())
    sim = RunConfig.model_validate(sim_config(cfg, [pool], shape))
    parts = [p for p in sim.partitions if p.role == "rollout"]
    assert all(p.hardware == pool.kind and p.name.startswith(f"pool_{pool.kind}") for p in parts)
    return {"gpus": sum(p.nodes * p.rollout["nodes_per_worker"] * p.rollout["engine"]["replicas"] for p in parts),
            "worker_nodes": max(p.rollout["nodes_per_worker"] for p in parts)}


@pytest.mark.parametrize("spec", ["h100=408", "h100=1000", "h100=400", "h100=4", "a100=8", "cpu=3", "h100=1208"])
def test_a_pool_simulates_exactly_the_gpus_of_its_label(spec):
    pool = parse_pool(spec, 8, None)
    got = _simulated(pool)
    assert got["gpus"] == pool.gpus == int(spec.split("=")[1])
    assert got["worker_nodes"] <= NODES_PER_PROCESS


def test_the_search_from_less_than_a_node_offers_only_sizes_pool_accepts():
    pool = parse_pool("h100=4", 8, None)
    factors = sorted({*(2 ** (k / 4) for k in range(-24, 25)), 2.97, 3.0, 5.0})
    sizes = []
    for f in factors:
        scaled = pool.scaled(f)
        assert parse_pool(scaled.label(), 8, None) == scaled  # --pool takes the label as it stands
        assert _simulated(scaled)["gpus"] == scaled.gpus
        sizes.append(scaled.gpus)
    assert sizes == sorted(sizes)  # a larger factor never gives fewer GPUs
    assert [pool.scaled(f).gpus for f in (0.25, 0.5, 2.0, 2.97, 3.0, 5.0)] == [1, 2, 8, 8, 16, 24]


def test_pools_of_whole_nodes_scale_in_whole_nodes():
    pool = parse_pool("h100=64", 8, None)
    assert [pool.scaled(f).gpus for f in (1 / 64, 0.5, 1.5, 2.0)] == [1, 32, 96, 128]
    with pytest.raises(ValueError, match="not one node nor whole nodes"):
        Pool("h100", 12, 8)


def test_a_pool_split_over_two_partitions_is_reported_as_one(tmp_path):
    """An uneven split puts a pool's last workers in ``pool_KIND.rest``: its episodes count for KIND."""
    nodes = {"a": {"partition": "pool_h100", "counters": {"episodes": 30}},
             "b": {"partition": "pool_h100.rest", "counters": {"episodes": 10}},
             "c": {"partition": "pool_a100", "counters": {"episodes": 40}},
             "d": {"partition": "trainer", "counters": {"episodes": 99}}}
    (tmp_path / "summary.json").write_text(json.dumps({"nodes": nodes}))
    out = _per_pool(tmp_path, SimpleNamespace(trajectories_per_s=8.0, tokens_per_s=800.0))
    assert set(out) == {"h100", "a100"}
    assert out["h100"]["share"] == pytest.approx(0.5) and out["h100"]["trajectories_per_s"] == pytest.approx(4.0)


def _trainer_step(cfg: RunConfig, shape) -> tuple[float, dict]:
    """The simulated trainer's step in simulated seconds, and its trainer section."""
    sim = RunConfig.model_validate(sim_config(cfg, [parse_pool("h100=8", 8, None)], shape))
    tr = sim.policies[0].trainer
    return tr.sim_step_seconds * sim.rollout.engine.sim.time_scale, tr.model_dump()


def test_a_sim_trainer_with_a_schedule_is_simulated_at_the_step_reported():
    cfg = load_config(AUTOSCALE)
    assert cfg.policies[0].trainer.sim_step_schedule  # the example changes its step mid-run
    shape, sources = shape_for(cfg, PlanOptions())
    step, tr = _trainer_step(cfg, shape)
    assert shape.step_seconds == pytest.approx(2.5 * 2.0)  # sim_step_seconds x the example's time scale
    assert step == pytest.approx(shape.step_seconds)
    assert tr["sim_step_schedule"] == {} and tr["sim_seconds_per_token"] == 0.0
    assert "sim_step_schedule left out" in sources["step_seconds"]


@pytest.mark.parametrize("base", [0.0, 0.0001])
def test_a_sim_trainers_per_token_time_is_in_the_step_reported(base):
    cfg = load_config(SIM, [f"policies.0.trainer.sim_step_seconds={base}",
                            "policies.0.trainer.sim_seconds_per_token=0.0005"])
    shape, sources = shape_for(cfg, PlanOptions())
    loss_tokens = cfg.dataflow.batch_size * cfg.rollout.engine.sim.length_mean  # a batch's responses
    assert shape.step_seconds == pytest.approx((base + 0.0005 * loss_tokens) * 10.0)  # time scale 10
    step, tr = _trainer_step(cfg, shape)
    assert step == pytest.approx(shape.step_seconds) and tr["sim_seconds_per_token"] == 0.0
    assert "sim_seconds_per_token" in sources["step_seconds"]


def test_a_sim_trainer_that_takes_no_time_exits_2_naming_the_fix():
    res = CliRunner().invoke(main, ["plan", SIM, "--pool", "h100=8", "--set", "policies.0.trainer.sim_step_seconds=0"])
    assert res.exit_code == 2, res.output
    assert "takes no time a step" in res.output and "give --step-seconds S" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args, needle", [
    (["--minutes", "1e307"], f"--minutes 1e+307: give more than 0 and at most {MAX_MINUTES:g} simulated minutes"),
    (["--minutes", "1e6"], f"at most {MAX_MINUTES:g} simulated minutes"),
    (["--minutes", "10", "--search-minutes", "5000"], "--search-minutes 5000: give more than 0 and at most"),
    (["--step-seconds", "0.0001", "--minutes", "100", "--time-scale", "1"],
     f"simulated steps; a run takes at most {MAX_STEPS}"),
])
def test_minutes_out_of_range_exit_2_naming_the_bound(args, needle):
    res = CliRunner().invoke(main, ["plan", SIM, "--pool", "h100=8", *args])
    assert res.exit_code == 2, res.output
    assert needle in " ".join(res.output.split()) and "Traceback" not in res.output


def _calibration(path: Path, **fields) -> Path:
    Calibration(PRESETS["cpu"], step_seconds=1.5, prompt_tokens=40, response_mean=30.0).save(path)
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))  # NaN as JSON's NaN, as json.dumps writes it
    return path


def test_a_saved_calibration_reads_back(tmp_path):
    cal = Calibration.load(_calibration(tmp_path / "c.json"))
    assert (cal.step_seconds, cal.prompt_tokens, cal.response_mean) == (1.5, 40, 30.0)


@pytest.mark.parametrize("field, value", [
    ("step_seconds", 0), ("step_seconds", math.nan), ("step_seconds", -1.0), ("step_seconds", math.inf),
    ("prompt_tokens", 0), ("prompt_tokens", -3), ("prompt_tokens", 2.5), ("response_mean", 0.0),
    ("response_mean", "200"), ("response_mean", None),
])
def test_a_calibration_out_of_range_exits_2_naming_file_and_field(tmp_path, field, value):
    path = _calibration(tmp_path / "cal.json", **{field: value})
    with pytest.raises(PlanError, match=f"{field} is"):
        Calibration.load(path)
    res = CliRunner().invoke(main, ["plan", SIM, "--pool", "local=1", "--calibration", str(path)])
    assert res.exit_code == 2, res.output
    flat = "".join(res.output.split())  # the message may wrap anywhere in the path
    assert f"--calibration{path}:{field}is" in flat and "Traceback" not in res.output


def test_a_calibrations_engine_field_out_of_range_is_named_in_one_line(tmp_path):
    path = _calibration(tmp_path / "cal.json")
    data = json.loads(path.read_text())
    data["engine"]["single_tokens_per_s"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        Calibration.load(path)
    assert "engine.single_tokens_per_s is -1: Input should be greater than 0" in str(err.value)
    assert "\n" not in str(err.value) and "pydantic" not in str(err.value)


def test_a_pool_past_the_simulated_node_bound_exits_2_and_the_search_stays_within_it():
    from astraflow.plan.pools import MAX_NODES, PlanError, parse_pool

    assert parse_pool(f"h100={MAX_NODES * 8}", 8, None).nodes == MAX_NODES
    with pytest.raises(PlanError, match=f"at most {MAX_NODES} nodes a pool"):
        parse_pool(f"h100={(MAX_NODES + 1) * 8}", 8, None)
    out = CliRunner().invoke(main, ["plan", "examples/sim/config.yaml", "--pool", "h100=800000"])
    assert out.exit_code == 2 and "--gpus-per-node" in out.output, out.output
    big = parse_pool(f"a100={MAX_NODES // 2 * 8}", 8, None)
    assert big.scaled(min(64.0, MAX_NODES / big.nodes)).nodes <= MAX_NODES  # the search's largest factor


def test_a_megatron_trainer_with_parallel_sizes_is_simulated_by_one_sim_trainer():
    """The sim trainer trains no model: the plan's config drops the Megatron sizes it would refuse."""
    cfg = load_config(str(ROOT / "examples/math/config.yaml"),
                      ["policies.0.trainer.backend=megatron", "policies.0.trainer.tensor_parallel=2"])
    shape, _ = shape_for(cfg, PlanOptions(step_seconds=1.0))
    sim = RunConfig.model_validate(sim_config(cfg, [parse_pool("h100=8", 8, None)], shape))
    tr = sim.policies[0].trainer
    assert (tr.backend, tr.tensor_parallel, tr.data_parallel) == ("sim", 1, 1)


def test_a_multi_turn_workflow_is_planned_with_a_warning_that_says_what_is_simulated():
    """The plan runs one engine request per episode: an agentic config is planned as single-turn
    episodes, and the plan says so before it runs (here it then stops at the repeated pool)."""
    res = CliRunner().invoke(main, ["plan", str(ROOT / "examples/calculator/config.yaml"), "--pool", "h100=8",
                                    "--pool", "h100=16", "--step-seconds", "2"])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert "warning: workflow agent runs episodes of several engine requests" in said
    assert "each hardware kind once" in said


def test_each_pool_reports_how_stale_its_sequences_were(tmp_path):
    """The data layer's per-node staleness counts, summed over each pool's nodes (a node group's
    members are named after their worker; the data layer knows each one's partition)."""
    nodes = {"w1": {"partition": "pool_h100", "counters": {"episodes": 30}},
             "w2": {"partition": "pool_a100", "counters": {"episodes": 10}},
             "w3": {"partition": "pool_cpu", "counters": {"episodes": 0}}}
    dl = {"nodes": {"w1.n0": {"partition": "pool_h100"}, "w1.n1": {"partition": "pool_h100.rest"},
                    "w2.n0": {"partition": "pool_a100"}, "t": {"partition": "trainer"}},
          "consumed_staleness_by_node": {"w1.n0": {"0": 8, "1": 1}, "w1.n1": {"0": 1}, "w2.n0": {"2": 3, "5": 1},
                                         "t": {"9": 4}}}
    (tmp_path / "summary.json").write_text(json.dumps({"nodes": nodes, "data_layer": dl}))
    out = _per_pool(tmp_path, SimpleNamespace(trajectories_per_s=8.0, tokens_per_s=800.0))
    assert {k: out["h100"][f"staleness_{k}"] for k in ("p50", "p90", "max")} == {"p50": 0, "p90": 0, "max": 1}
    assert {k: out["a100"][f"staleness_{k}"] for k in ("p50", "p90", "max")} == {"p50": 2, "p90": 5, "max": 5}
    assert out["cpu"]["staleness_max"] is None  # nothing of it was trained on
