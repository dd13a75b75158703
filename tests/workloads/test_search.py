"""The search workload: a deterministic knowledge base and splits, correct answer chains, BM25
finding what the expert asks for, the expert succeeding through the real agent loop, wrong
answers scoring 0 (its CLI run: ``tests/e2e/test_agent_cli.py``)."""

from __future__ import annotations

import asyncio

import pytest

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.env import Action, signature_problems
from astraflow.agents.episode import run_agent_episode
from astraflow.models import build_tokenizer
from astraflow.workloads.base import make_workload
from astraflow.workloads.search import SearchEnv, parse_answer
from tests.agents.test_episode import scripted

SMALL = {"kb": "shared", "num_people": 40, "num_companies": 8, "num_cities": 8, "num_countries": 3,
         "num_train": 150, "num_test": 40}


@pytest.fixture(scope="module")
def wl():
    return make_workload("search", SMALL, seed=0)


def test_knowledge_base_and_splits_are_deterministic_and_disjoint(wl):
    again = make_workload("search", SMALL, seed=0)
    assert again.kb.documents() == wl.kb.documents()
    assert again.tasks("train") == wl.tasks("train") and again.tasks("eval") == wl.tasks("eval")
    other = make_workload("search", SMALL, seed=1)
    assert other.kb.documents() != wl.kb.documents()
    train, held = wl.tasks("train"), wl.tasks("eval")
    assert len(train) == 150 and len(held) == 40
    assert not {t["question"] for t in train} & {t["question"] for t in held}
    assert {t["difficulty"] for t in held} == {1, 2, 3}
    # the held-out split does not depend on how many train questions are asked for
    assert make_workload("search", {**SMALL, "num_train": 20}, seed=0).tasks("eval") == held
    with pytest.raises(ValueError, match="split"):
        wl.tasks("test")
    with pytest.raises(ValueError, match="fewer than num_test"):
        make_workload("search", {**SMALL, "num_train": 10_000}, seed=0).tasks("train")
    with pytest.raises(ValueError, match="num_countries"):
        make_workload("search", {**SMALL, "num_countries": 9}, seed=0)


def test_answer_chains_follow_the_facts(wl):
    for t in wl.tasks("train") + wl.tasks("eval"):
        chain = t["chain"]
        assert t["difficulty"] == len(chain) // 2 and 1 <= t["difficulty"] <= 3
        assert t["question"] == " ".join([chain[0]] + chain[1::2]) + "?"
        for i in range(0, len(chain) - 1, 2):
            assert wl.kb.facts[chain[i], chain[i + 1]] == chain[i + 2]
        assert t["answer"] == chain[-1] and len(set(chain[::2])) == len(chain[::2])  # no entity twice


def test_bm25_ranks_the_needed_document_first(wl):
    for t in wl.tasks("eval"):
        chain = t["chain"]
        for i in range(0, len(chain) - 1, 2):
            lines = wl.index.search(f"{chain[i]} {chain[i + 1]}")
            assert len(lines) == 2 and lines[0] == f"{chain[i]} {chain[i + 1]} {chain[i + 2]}"
    assert wl.index.search("Qqqq xyzzy") == [] and wl.index.search("?") == []
    # one index, shared by every episode's environment
    envs = [wl.environment() for _ in range(2)]
    for env in envs:
        asyncio.run(env.reset(wl.tasks("eval")[0]))
    assert envs[0].index is envs[1].index is wl.index


def _expert_episode(wl, task, tok):
    env = wl.environment()

    async def generate(tokens, max_new):
        return await scripted(tok, [env.expert_action()])(tokens, max_new)

    return asyncio.run(run_agent_episode(generate, ChatRenderer(tok), env, task, wl.limits(64)))


@pytest.mark.parametrize("kb", ["shared", "per_task"])
def test_expert_succeeds_through_the_agent_loop(kb):
    tok = build_tokenizer()
    assert not signature_problems(SearchEnv)
    wl = make_workload("search", {"kb": kb, **({} if kb == "per_task" else SMALL)}, seed=0)
    for task in wl.tasks("eval")[:12]:
        log = _expert_episode(wl, task, tok)
        assert log.done and log.success == 1.0 and log.reward == 1.0 and log.truncated is None
        assert log.tool_calls == task["difficulty"] and log.invalid_calls == 0
        assert len(log.tokens) < 400


@pytest.mark.parametrize("text,ok", [("Mira", 1.0), ("answer: mira.", 1.0), (" Mira\nbecause", 1.0),
                                     ("Kalo", 0.0), ("", 0.0), ("the answer is Mira", 0.0)])
def test_answers_are_scored(text, ok):
    assert parse_answer("Answer: Mira!") == "Mira"
    env = make_workload("search", SMALL, seed=0).environment()
    asyncio.run(env.reset({"question": "Kalo born?", "answer": "Mira", "chain": ["Kalo", "born", "Mira"],
                           "difficulty": 1}))
    res = asyncio.run(env.step(Action(text=text)))
    assert res.done and res.reward == ok and res.info["success"] == ok


def test_per_task_knowledge_bases_are_the_tasks_own():
    """Each task searches a knowledge base of its own (new names), made from the task's seed;
    train and held-out tasks never share one, and difficulties take turns."""
    wl = make_workload("search", {"num_train": 30, "num_test": 12}, seed=0)
    train, held = wl.tasks("train"), wl.tasks("eval")
    assert make_workload("search", {"num_train": 30, "num_test": 12}, seed=0).tasks("train") == train
    assert not {t["kb"] for t in train} & {t["kb"] for t in held}
    assert [t["difficulty"] for t in held[:6]] == [1, 2, 3, 1, 2, 3]
    for t in train + held:
        from astraflow.workloads.search import KnowledgeBase

        facts = KnowledgeBase(wl.params, seed=t["kb"]).facts
        chain = t["chain"]
        assert all(facts[chain[i], chain[i + 1]] == chain[i + 2] for i in range(0, len(chain) - 1, 2))
    a, b = wl.environment(), wl.environment()
    asyncio.run(a.reset(held[0]))
    asyncio.run(b.reset(held[1]))
    assert a.index.documents != b.index.documents
    with pytest.raises(ValueError, match="kb: shared"):
        wl.index_of({"question": "x?"})


def test_more_entities_than_names_is_refused_not_drawn_forever():
    from astraflow.workloads.search import MAX_ENTITIES, SearchWorkload

    with pytest.raises(ValueError, match=f"more than the {MAX_ENTITIES} distinct four-letter names"):
        SearchWorkload(num_people=MAX_ENTITIES).tasks("train")
