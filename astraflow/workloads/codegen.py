"""Generated programming tasks: families of one- to three-line Python functions.

A *family* is a function shape (``return x + k``, ``return s[:k]``, ``return xs.count(k)``);
its *members* differ in their constants (``add_3``, ``add_17``), and each member is written
with several argument names (``x``, ``n``, ``value``), one task each. The held-out split is
made of whole members (a seeded hash of family and constants): an evaluation asks for
constants the policy never saw in that family, in families it did see.

Hidden tests are computed from the reference solution on seeded random inputs, one
``test_*`` function per input, so that a fraction-of-tests reward has steps in it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from astraflow.workloads.split import is_held_out

#: argument names by kind of argument (a member is written once with each)
ARG_NAMES = {"int": ("x", "n", "value", "num"), "str": ("s", "text", "word", "name"),
             "list": ("xs", "nums", "items", "values")}

#: the strings a ``{w}`` constant takes
WORDS = ("ab", "hi", "ok", "zz", "yes", "no", "abc", "pre", "x", "q")


@dataclass(frozen=True)
class Family:
    """A function shape: ``fname``, ``doc`` and ``body`` are templates over ``{x}`` (the
    argument) and the family's constants (``consts``: name -> values it takes)."""

    name: str
    kind: str
    fname: str
    doc: str
    body: str
    consts: dict[str, tuple[Any, ...]]


def _r(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(range(lo, hi + 1))


FAMILIES: tuple[Family, ...] = (
    Family("add", "int", "add_{k}", "Return {x} plus {k}.", "return {x} + {k}", {"k": _r(1, 30)}),
    Family("sub", "int", "sub_{k}", "Return {x} minus {k}.", "return {x} - {k}", {"k": _r(1, 30)}),
    Family("mul", "int", "times_{k}", "Return {x} times {k}.", "return {x} * {k}", {"k": _r(2, 20)}),
    Family("mod", "int", "mod_{k}", "Return {x} modulo {k}.", "return {x} % {k}", {"k": _r(2, 20)}),
    Family("affine", "int", "affine_{a}_{b}", "Return {a} times {x} plus {b}.", "return {a} * {x} + {b}",
           {"a": _r(2, 7), "b": _r(1, 7)}),
    Family("atleast", "int", "at_least_{k}", "Return the larger of {x} and {k}.", "return max({x}, {k})",
           {"k": _r(0, 25)}),
    Family("above", "int", "above_{k}", "Return True if {x} is greater than {k}, else False.",
           "return {x} > {k}", {"k": _r(0, 25)}),
    Family("pick", "int", "pick_{a}_{b}", "Return {a} if {x} is negative, else {b}.",
           "if {x} < 0:\n        return {a}\n    return {b}", {"a": _r(1, 6), "b": _r(1, 6)}),
    Family("first", "str", "first_{k}", "Return the first {k} characters of {x}.", "return {x}[:{k}]",
           {"k": _r(1, 12)}),
    Family("last", "str", "last_{k}", "Return the last {k} characters of {x}.", "return {x}[-{k}:]",
           {"k": _r(1, 12)}),
    Family("repeat", "str", "repeat_{k}", "Return {x} repeated {k} times.", "return {x} * {k}", {"k": _r(2, 9)}),
    Family("prefix", "str", "prefix_{w}", "Return {x} with '{w}' in front.", "return '{w}' + {x}", {"w": WORDS}),
    Family("suffix", "str", "suffix_{w}", "Return {x} with '{w}' at the end.", "return {x} + '{w}'", {"w": WORDS}),
    Family("total", "list", "total_plus_{k}", "Return the sum of {x} plus {k}.", "return sum({x}) + {k}",
           {"k": _r(1, 20)}),
    Family("count", "list", "count_{k}", "Return how many times {k} appears in {x}.", "return {x}.count({k})",
           {"k": _r(0, 9)}),
    Family("keep", "list", "keep_above_{k}", "Return the items of {x} that are greater than {k}.",
           "return [v for v in {x} if v > {k}]", {"k": _r(0, 9)}),
    Family("scale", "list", "scale_{k}", "Return {x} with every item multiplied by {k}.",
           "return [v * {k} for v in {x}]", {"k": _r(2, 12)}),
    Family("multiples", "list", "multiples_of_{k}", "Return the items of {x} that are divisible by {k}.",
           "result = []\n    for v in {x}:\n        if v % {k} == 0:\n            result.append(v)\n    return result",
           {"k": _r(2, 9)}),
)

FAMILY_NAMES = tuple(f.name for f in FAMILIES)


def _inputs(kind: str, rng: random.Random, n: int) -> list[Any]:
    if kind == "int":
        return [rng.randint(-30, 30) for _ in range(n)]
    if kind == "str":
        return ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(0, 14))) for _ in range(n)]
    return [[rng.randint(0, 20) for _ in range(rng.randint(0, 7))] for _ in range(n)]


def member_key(family: str, consts: dict[str, Any]) -> str:
    """A member's identity: its family and constants (not its argument name)."""
    return family + ":" + ",".join(f"{k}={consts[k]}" for k in sorted(consts))


def make_task(fam: Family, consts: dict[str, Any], arg: str, num_tests: int) -> dict[str, Any]:
    """The task payload of one member of ``fam`` written with argument ``arg``."""
    fmt = {"x": arg, **consts}
    fname = fam.fname.format(**fmt)
    prompt = f'def {fname}({arg}):\n    """{fam.doc.format(**fmt)}"""\n'
    reference = "    " + fam.body.format(**fmt) + "\n"
    namespace: dict[str, Any] = {}
    exec(prompt + reference, namespace)  # our own template: computes the expected outputs
    key = member_key(fam.name, consts)
    rng = random.Random(f"{key}:{arg}")
    tests = []
    for i, value in enumerate(_inputs(fam.kind, rng, num_tests)):
        expected = namespace[fname](value)
        tests.append(f"def test_{i}():\n    assert {fname}({value!r}) == {expected!r}\n")
    return {"id": f"{key}:{arg}", "prompt": prompt, "entry_point": fname, "tests": "\n".join(tests),
            "reference": reference, "family": fam.name, "difficulty": fam.name}


def generate(families: list[str] | None, seed: int, test_fraction: float, num_tests: int
             ) -> dict[str, list[dict[str, Any]]]:
    """Every task of the chosen families (all when ``None``), split into ``train`` and
    ``test`` by member. Unknown family names raise ``ValueError`` listing the known ones."""
    chosen = FAMILIES if families is None else tuple(f for f in FAMILIES if f.name in families)
    unknown = sorted(set(families or ()) - set(FAMILY_NAMES))
    if unknown:
        raise ValueError(f"code workload: unknown families {unknown}; known: {list(FAMILY_NAMES)}")
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for fam in chosen:
        names = sorted(fam.consts)
        for values in itertools.product(*(fam.consts[n] for n in names)):
            consts = dict(zip(names, values))
            which = "test" if is_held_out(member_key(fam.name, consts), seed, test_fraction) else "train"
            splits[which] += [make_task(fam, consts, arg, num_tests) for arg in ARG_NAMES[fam.kind]]
    return splits
