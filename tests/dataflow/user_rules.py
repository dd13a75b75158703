"""A dataflow rule written outside the package: configs name it
``tests.dataflow.user_rules:every_nth_test`` (the module is imported, which registers it)."""

from __future__ import annotations

from pydantic import Field

from astraflow.configbase import Strict
from astraflow.dataflow.rules import CURATORS, AcceptAll, KeepAll


class EveryNthParams(Strict):
    n: int = Field(default=2, ge=1)
    """Accept prompts whose index is a multiple of this."""


@CURATORS.register("every_nth_test")
class EveryNth(AcceptAll):
    """Roll out every ``n``-th prompt only."""

    Params = EveryNthParams

    def __init__(self, params: EveryNthParams, seed: int = 0):
        self.n = params.n

    def accept(self, prompt_key: str, payload: dict) -> bool:
        return int(prompt_key[1:]) % self.n == 0


@CURATORS.register("stateless_test")
class Stateless:
    """A curator that is not a ``RuleBase``: no state methods, so no run could save it."""

    Params = EveryNthParams

    def __init__(self, params: EveryNthParams, seed: int = 0):
        self.n = params.n

    def accept(self, prompt_key: str, payload: dict) -> bool:
        return True

    def observe(self, prompt_key: str, rewards) -> None:
        pass


#: the group views ``DropTruncated`` was given, in order
SEEN_GROUPS: list = []


class DropTruncated(KeepAll):
    """Drop a group any of whose sequences was cut by its token budget (the group's view);
    named by its module attribute, registered nowhere."""

    def keep(self, rewards, group):
        SEEN_GROUPS.append(group)
        if "length" in group.finish_reasons:
            return False, "truncated"
        return True, None


class DropSecondPolicy(KeepAll):
    """Drop every group routed to the policy ``b`` (one policy starved while another trains)."""

    def keep(self, rewards, group):
        return group.policy != "b", "not_for_b"


@CURATORS.register("reject_all_test")
class RejectAll(AcceptAll):
    """Roll out no prompt (a curator that has come to skip everything)."""

    def accept(self, prompt_key: str, payload: dict) -> bool:
        return False
