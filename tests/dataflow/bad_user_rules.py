"""Dataflow rules with a user's bugs, for ``test_rule_errors.py``: configs name them as
``tests.dataflow.bad_user_rules:<Class>`` (registered nowhere: the run's list of known rules stays
the shipped ones)."""

from __future__ import annotations

from astraflow.dataflow.rules import RuleBase


class Boom(RuleBase):
    """accept raises after two calls."""

    def __init__(self, params, seed=0):
        self.n = 0

    def accept(self, prompt_key, payload):
        self.n += 1
        if self.n > 2:
            raise KeyError("curator_bug")
        return True

    def observe(self, prompt_key, rewards):
        pass


class SetState(RuleBase):
    """keeps a set in its state."""

    def __init__(self, params, seed=0):
        self.seen = set()

    def accept(self, prompt_key, payload):
        return True

    def observe(self, prompt_key, rewards):
        self.seen.add(prompt_key)


class TupleKeys(RuleBase):
    """keeps a dict with tuple keys, filled as groups end."""

    def __init__(self, params, seed=0):
        self.pairs = {}

    def accept(self, prompt_key, payload):
        return True

    def observe(self, prompt_key, rewards):
        self.pairs[(prompt_key, len(rewards))] = 1


class BareKeep(RuleBase):
    """returns a bare bool instead of (bool, reason)."""

    def keep(self, rewards):
        return True


class Dropper(RuleBase):
    """leaves every group but the first out."""

    def order(self, groups, version, max_staleness):
        return [0] if groups else []


class EmptyMean(RuleBase):
    """keep calls a library that raises inside it (the mean of no rewards)."""

    def __init__(self, params, seed=0):
        pass

    def keep(self, rewards):
        import statistics

        return statistics.mean([r for r in rewards if r > 9]) > 0, None
