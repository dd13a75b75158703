"""A test-only workflow whose first engine call never returns: ``hanging_engine_call_test``
(``single_turn`` otherwise). Loaded through the ``module:name`` workflow form
(``tests.rollout.hanging_workflow:hanging_engine_call_test``)."""

from __future__ import annotations

import asyncio

from astraflow.rollout.workflows import WORKFLOWS, SingleTurn


class _Hung:
    """An engine whose ``generate`` waits for ever (a request the engine lost)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt_tokens, params):
        await asyncio.get_running_loop().create_future()  # never resolved


@WORKFLOWS.register("hanging_engine_call_test")
class HangingEngineCall(SingleTurn):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.episodes = 0
        self.hung: list[str] = []  # the tasks whose engine call hung

    async def run_episode(self, engines, task):
        self.episodes += 1
        if self.episodes == 1:
            self.hung.append(task.task_id)
            engines = {p: _Hung(e) for p, e in engines.items()}
        return await super().run_episode(engines, task)
