"""Run-config rules that need the workflow or the workload built: what ``RunConfig``'s
cross-checks ask of them, each raising a ``ValueError`` whose message says how to fix the file."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from astraflow.sandbox.config import SandboxConfig, deadline_problem
from astraflow.training.config import PolicyConfig
from astraflow.workloads.config import WorkloadConfig


def check_workflow(name: str, n_policies: int) -> None:
    """``workload.workflow`` names a workflow class that drives ``n_policies`` policies."""
    from astraflow.rollout.workflows import not_a_workflow, workflow_class

    try:
        wf = workflow_class(name)
    except (ValueError, ImportError) as err:
        raise ValueError(f"workload.workflow: {err}") from None
    why = not_a_workflow(wf)
    if why:
        raise ValueError(
            f"workload.workflow: {name!r} {why}; name a workflow class (a subclass of "
            "astraflow.rollout.workflows.WorkflowBase with num_policies and async run_episode(engines, task)) "
            "or a registered workflow, e.g. single_turn")
    if wf.num_policies != n_policies:
        raise ValueError(
            f"workload.workflow {name!r} drives {wf.num_policies} policies but policies names "
            f"{n_policies}: list one policy per role, in the workflow's order")


def checked_workload(cfg: WorkloadConfig) -> Any:
    """The workload ``cfg`` names, built (cheap: workloads generate their prompts lazily, in
    ``tasks()``); a user's workload whose constructor rejects its params is caught here."""
    from astraflow.workloads.base import make_workload

    try:
        return make_workload(cfg.name, cfg.params, cfg.seed)
    except (ValueError, TypeError) as err:
        raise ValueError(f"workload ({cfg.name}): {err}") from None


def check_sandbox_deadlines(workload: Any, sandbox: SandboxConfig, reward_timeout_s: float) -> None:
    """Each source that runs code in the sandbox (a mixture's sources each, else the workload
    itself) can finish an execution within the reward deadline."""
    from astraflow.workloads.mix import MixtureWorkload

    for part in workload.sources.values() if isinstance(workload, MixtureWorkload) else [workload]:
        if getattr(part, "uses_sandbox", False):
            why = deadline_problem(sandbox, getattr(getattr(part, "cfg", None), "timeout_s", None), reward_timeout_s)
            if why:
                raise ValueError(why)


def check_policy_inits(policies: Sequence[PolicyConfig], workload: Any, workload_name: str, agentic: bool,
                       simulated: Callable[[PolicyConfig], bool]) -> None:
    """Each policy's model exists or its ``init`` section can build it from this workload."""
    for i, pol in enumerate(policies):
        before = [p.name for p in policies[:i]]
        init = pol.init
        if init is not None and init.start_from is not None and init.start_from not in before:
            raise ValueError(
                f"policies[{pol.name}].init.start_from: {init.start_from!r} is not a policy listed before "
                f"{pol.name!r}; name one of {before} (models are built in the order of `policies`)")
        demos = agentic or hasattr(workload, "demonstration")
        if init is not None and init.warm_starts and workload_name != "math" and not demos:
            # named by the bound that asks for the warm start (a bound in steps alone, say)
            field, fix = (("warm_start_seconds", "set it to 0 (and drop warm_start_steps)")
                          if init.warm_start_seconds > 0 else
                          ("warm_start_steps", "drop warm_start_steps (and leave warm_start_seconds at 0)"))
            raise ValueError(
                f"policies[{pol.name}].init.{field}: the supervised warm start trains on "
                f"the math workload's generator, an agentic workload's expert or a workload's "
                f"demonstrations (the dataset workload's reference solutions), not on workload "
                f"{workload_name!r}; {fix} or point model at a directory built by a math config")
        tester = init is not None and init.task == "test"
        if tester and (not callable(getattr(workload, "program", None)) or not hasattr(workload, "demonstration")):
            raise ValueError(
                f"policies[{pol.name}].init.task: 'test' teaches the test generator of a code workload "
                f"(workload.name: code, workflow solver_testgen); workload {workload_name!r} has no "
                "programs to test: use another task")
        if init is not None and init.warm_starts and workload_name != "math" and init.task not in ("solve", "test"):
            raise ValueError(
                f"policies[{pol.name}].init.task: {init.task!r} is a role of the math workload's "
                f"warm start; with workload {workload_name!r} leave it at 'solve' ('test' for "
                "the tester of a code workload)")
        if init is None and not pol.model.exists() and not simulated(pol):
            raise ValueError(
                f"policies[{pol.name}].model: {pol.model} does not exist; point it at an HF model "
                "directory you have (config.json, weights, tokenizer: nothing is downloaded at run time), "
                "or add an `init:` section to build a small model from scratch")
