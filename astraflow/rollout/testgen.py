"""The ``solver_testgen`` workflow: a solver and a test generator trained from shared episodes.

Per episode, policy 0 (the solver) writes ``SOLUTIONS`` candidate bodies of the task's function
and policy 1 (the tester) writes one suite of asserts for it, each from the problem alone (they
do not see each other's text, so they generate concurrently). The solver's candidates are
scored by the workload's hidden tests; the suite is run in the sandbox against the reference
solution and against each distinct wrong candidate, and ``astraflow.workloads.testgen.
suite_reward`` turns those runs into the tester's reward. Every sandbox run goes through the
sandbox's ``arun`` (bounded concurrency, off the node's event loop) under
``rollout.reward_timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Mapping

from astraflow.agents.chat import prompt_ids
from astraflow.contracts import RolloutTask, Trajectory
from astraflow.rollout.engine import InferenceEngine
from astraflow.rollout.workflows import WORKFLOWS, WorkflowBase, sampling_for, turn_sequence
from astraflow.workloads.testgen import SUITE_NEW_TOKENS, TesterView, parse_suite, suite_reward


class _Unjudged:
    """The result of a suite run that ran past its deadline on the node (the sandbox's own
    timeout should end it first): counted as a sandbox error."""

    status, tests = "sandbox_error", ()


@WORKFLOWS.register("solver_testgen")
class SolverTestgen(WorkflowBase):
    """Policy 0 (solver) writes ``SOLUTIONS`` candidate solutions (one under greedy sampling:
    evaluation), each rewarded by the hidden tests; policy 1 (tester) writes one suite of
    asserts from the problem, rewarded by ``suite_reward``: 0 unless it is valid and passes on
    the reference, then 0.2 plus 0.8 times the fraction of the episode's wrong candidates it
    rejects (1.0 when none is wrong). The episode's score is the first candidate's reward
    (held-out pass@1 under greedy evaluation). The tester writes up to ``SUITE_NEW_TOKENS``."""

    num_policies = 2
    #: candidate solutions per episode (the solver's sequences; the tester has one)
    SOLUTIONS = 4

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tester_view = TesterView(self.workload)  # ValueError naming the fix for a non-code workload

    async def run_episode(self, engines: Mapping[str, InferenceEngine], task: RolloutTask) -> Trajectory:
        t0 = time.time()
        solver, tester = engines[task.policies[0]], engines[task.policies[1]]
        params = sampling_for(task, self.sampling)
        payload = task.prompt
        ps = prompt_ids(solver.tokenizer, self.workload, payload)
        pt = prompt_ids(tester.tokenizer, self.tester_view, payload)
        k = 1 if params.greedy else self.SOLUTIONS
        suite_params = replace(params, max_new_tokens=SUITE_NEW_TOKENS)
        *gens, gt = await asyncio.gather(*(solver.generate(ps, params) for _ in range(k)),
                                         tester.generate(pt, suite_params))
        texts = [solver.tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens]
        scores = await asyncio.gather(*(self.score(t, payload) for t in texts))
        suite_text = tester.tokenizer.decode(gt.tokens, skip_special_tokens=True)
        t_reward, info = await self.judge_suite(suite_text, payload, texts, scores)
        seqs = [turn_sequence(ps, g, 0, r) for g, r in zip(gens, scores)]
        tseq = turn_sequence(pt, gt, 1, t_reward)
        seqs.append(replace(tseq, rewards={k2: float(info[k2]) for k2 in ("valid", "passes_reference", "wrong",
                                                                         "rejected", "unjudged")}))
        stats = {"solver_pass": sum(s >= 1.0 for s in scores) / k, "tester_reward": t_reward,
                 "tester_valid": float(info["valid"]), "tester_passes_reference": float(info["passes_reference"]),
                 "tester_wrong": float(info["wrong"]), "tester_rejected": float(info["rejected"]),
                 "tester_unjudged": float(info["unjudged"])}
        episode = {"task": dict(payload), "turns": [
            *({"kind": "solver", "text": t, "reward": r} for t, r in zip(texts, scores)),
            {"kind": "tester", "text": suite_text, "reward": t_reward, "info": info}]}
        secs = sum(g.engine_seconds for g in gens) + gt.engine_seconds
        return replace(self.trajectory(task, seqs, t0, secs), score=scores[0], stats=stats, episode=episode)

    async def judge_suite(self, text: str, payload: Mapping[str, Any], candidates: list[str],
                          scores: list[float]) -> tuple[float, dict[str, Any]]:
        """``suite_reward`` of the suite ``text``: run against the reference solution and each
        distinct wrong candidate program (those whose hidden-test reward is below 1)."""
        suite = parse_suite(text, payload["entry_point"])
        ref = self.tester_view.reference_program(payload)
        if not suite.valid or ref is None:
            return suite_reward(suite, None, [])
        wrong = list(dict.fromkeys(self.workload.program(c, payload) for c, s in zip(candidates, scores) if s < 1.0))
        source = suite.source()
        reference, *runs = await asyncio.gather(*(self._run(p, source) for p in [ref, *wrong]))
        return suite_reward(suite, reference, runs)

    async def _run(self, program: str, tests: str) -> Any:
        from astraflow.sandbox import default_sandbox

        try:
            return await default_sandbox().arun(program, tests, deadline_s=self.reward_timeout_s)
        except TimeoutError:
            return _Unjudged()
