"""Multi-hop questions over a generated knowledge base, answered with a ``search`` tool.

The built-in tool-use workload: a knowledge base of people, companies, cities and countries is
generated from the seed (nothing is downloaded) and written as one-line documents
(``Kalo born Mira``, ``Zorb ceo Kalo``). A question names a start entity and a chain of 1 to
``max_hops`` relations, in lookup order: ``Kalo works ceo born?`` asks where the CEO of the
company Kalo works for was born. The agent searches ``"<entity> <relation>"``, copies the entity
the result names into its next query, and finally answers with a plain turn holding the entity
name (``Mira``; an ``answer:`` prefix is tolerated). That turn ends the episode: reward 1 if it
names the answer, else 0 (an empty turn scores 0 too, there are no hints).

Everything is short on purpose: the policies are small local models (a few tokens per word),
so names have four letters, documents three words, questions no prose and no system prompt (set
``describe_tools`` for one), and a search returns ``top_k`` lines.

Retrieval is BM25 by ``bm25s``: maintained, fast sparse-matrix BM25 in pure Python on
numpy/scipy, with no server or JVM to run beside a RaaS node; exact lexical matching is what
generated entity names need (an embedding model knows nothing of ``Zorb``). The index is built
once per workload, on the first search, and shared by every episode's environment.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import threading
from typing import Any, Literal, Mapping

from pydantic import Field

from astraflow.agents.env import Action, EnvironmentBase, Message, StepResult
from astraflow.agents.tools import ToolBox, format_call, tool
from astraflow.agents.workload import AgentParams, AgentWorkload
from astraflow.workloads.base import WORKLOADS

#: relation -> (subject kind, object kind); every relation is functional (one object)
RELATIONS: dict[str, tuple[str, str]] = {
    "born": ("person", "city"),
    "works": ("person", "company"),
    "ceo": ("company", "person"),
    "hq": ("company", "city"),
    "country": ("city", "country"),
    "capital": ("country", "city"),
}
KINDS = ("person", "company", "city", "country")
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
#: distinct names ``_names`` can draw; it draws at most a quarter of them (far fewer collisions)
MAX_ENTITIES = (len(_CONSONANTS) * len(_VOWELS)) ** 2 // 4


class SearchParams(AgentParams):
    """The search workload's ``params``: the size of the knowledge base, the questions and
    the search results."""

    kb: Literal["per_task", "shared"] = "per_task"
    """``per_task``: every task has a knowledge base of its own, generated from the task's seed
    (new names every time: the agent must read and copy what it finds, it cannot remember
    answers; train and held-out tasks are drawn alike). ``shared``: one knowledge base for all
    tasks (raise the sizes below), held-out questions being other chains over the same facts."""
    num_people: int = Field(default=8, ge=2)
    """People in the knowledge base (each born in a city, working for a company)."""
    num_companies: int = Field(default=3, ge=1)
    """Companies (each with a CEO among its employees and a headquarters city)."""
    num_cities: int = Field(default=4, ge=1)
    """Cities (each in a country)."""
    num_countries: int = Field(default=2, ge=1)
    """Countries (each with a capital among its cities); at most ``num_cities``."""
    max_hops: int = Field(default=3, ge=1, le=3)
    """Lookups a question needs at most (its ``difficulty`` is its number of lookups)."""
    top_k: int = Field(default=2, ge=1, le=10)
    """Documents one search returns."""
    describe_tools: bool = False
    """Open each episode with a system message describing the tool (costs tokens every episode)."""
    num_train: int | None = Field(default=None, ge=1)
    """Questions in the train split; ``None``: 2000 with ``kb: per_task``, every question not
    held out with ``kb: shared``."""
    num_test: int = Field(default=200, ge=1)
    """Questions in the held-out split (disjoint from train)."""


def _names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct four-letter names (consonant-vowel twice, capitalised)."""
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2)).capitalize())
    return sorted(names)


class KnowledgeBase:
    """The generated facts: ``facts[(entity, relation)] = object`` and ``kind[entity]``."""

    def __init__(self, p: SearchParams, seed: str | None = None):
        if p.num_countries > p.num_cities:
            raise ValueError(f"search workload: num_countries ({p.num_countries}) must be at most "
                             f"num_cities ({p.num_cities}): every country has a capital among its cities")
        if p.num_companies > p.num_people:
            raise ValueError(f"search workload: num_companies ({p.num_companies}) must be at most "
                             f"num_people ({p.num_people}): every company has a CEO among its employees")
        rng = random.Random(f"search-kb:{p.seed if seed is None else seed}")
        sizes = {"person": p.num_people, "company": p.num_companies, "city": p.num_cities,
                 "country": p.num_countries}
        if sum(sizes.values()) > MAX_ENTITIES:
            raise ValueError(f"search workload: {sum(sizes.values())} entities (num_people + num_companies + "
                             f"num_cities + num_countries) is more than the {MAX_ENTITIES} distinct four-letter "
                             "names there are: lower them")
        pool = _names(rng, sum(sizes.values()))
        rng.shuffle(pool)
        self.entities: dict[str, list[str]] = {}
        for k in KINDS:
            self.entities[k], pool = sorted(pool[:sizes[k]]), pool[sizes[k]:]
        self.kind = {e: k for k, es in self.entities.items() for e in es}
        people, companies = self.entities["person"], self.entities["company"]
        cities, countries = self.entities["city"], self.entities["country"]
        f: dict[tuple[str, str], str] = {}
        # every country gets a city first (its capital), then the rest go anywhere
        order = rng.sample(cities, len(cities))
        for i, c in enumerate(order):
            f[c, "country"] = countries[i] if i < len(countries) else rng.choice(countries)
            if i < len(countries):
                f[countries[i], "capital"] = c
        # every company gets an employee first (its CEO)
        staff = rng.sample(people, len(people))
        for i, person in enumerate(staff):
            company = companies[i] if i < len(companies) else rng.choice(companies)
            f[person, "works"] = company
            if i < len(companies):
                f[company, "ceo"] = person
            f[person, "born"] = rng.choice(cities)
        for company in companies:
            f[company, "hq"] = rng.choice(cities)
        self.facts = f

    def documents(self) -> list[str]:
        """One line per fact: ``"<subject> <relation> <object>"``."""
        return [f"{s} {r} {o}" for (s, r), o in sorted(self.facts.items())]

    def chains(self, max_hops: int) -> list[list[str]]:
        """Every question as its entity path interleaved with relations,
        ``[e0, r1, e1, ..., rn, en]``, 1 to ``max_hops`` hops, never revisiting an entity."""
        out: list[list[str]] = []

        def walk(path: list[str]) -> None:
            if len(path) > 1:
                out.append(list(path))
            if len(path) // 2 == max_hops:
                return
            for rel, (subj, _) in RELATIONS.items():
                nxt = self.facts.get((path[-1], rel)) if self.kind[path[-1]] == subj else None
                if nxt is not None and nxt not in path[::2]:
                    walk(path + [rel, nxt])

        for e in sorted(self.kind):
            walk([e])
        return out


class KnowledgeIndex:
    """BM25 over the documents, built on the first search (under a lock: tools run in a
    thread pool, so two episodes may search at once)."""

    def __init__(self, documents: list[str], top_k: int):
        self.documents, self.top_k = documents, top_k
        self._lock = threading.Lock()
        self._bm25: Any = None

    def _tokens(self, texts: list[str]):
        import bm25s

        logging.getLogger("bm25s").setLevel(logging.WARNING)  # it sets DEBUG: a line per index built

        # no stopwords: every word of a generated document is a name or a relation
        return bm25s.tokenize(texts, stopwords=None, return_ids=False, show_progress=False)

    def search(self, query: str) -> list[str]:
        """The ``top_k`` best documents for ``query`` (fewer if fewer share a word with it)."""
        import bm25s

        logging.getLogger("bm25s").setLevel(logging.WARNING)  # it sets DEBUG: a line per index built
        with self._lock:
            if self._bm25 is None:
                bm25 = bm25s.BM25()
                bm25.index(bm25s.tokenize(self.documents, stopwords=None, show_progress=False),
                           show_progress=False)
                self._bm25 = bm25
            words = self._tokens([query])
            if not words[0]:
                return []
            ids, scores = self._bm25.retrieve(words, k=min(self.top_k, len(self.documents)), show_progress=False)
        return [self.documents[i] for i, s in zip(ids[0], scores[0]) if s > 0]


def parse_answer(text: str) -> str:
    """The entity a plain turn answers: its first line without an ``answer:`` prefix and
    surrounding spaces or punctuation ('' if none)."""
    line = text.strip().split("\n", 1)[0]
    line = re.sub(r"^\s*answer\s*:", "", line, flags=re.IGNORECASE)
    return line.strip().strip(".!?\"' ")


class SearchEnv(EnvironmentBase):
    """One episode: the question, searches through its knowledge base's index, a scored answer."""

    step_timeout_s = 10.0

    def __init__(self, workload: "SearchWorkload"):
        super().__init__()
        self.workload = workload
        self.index: KnowledgeIndex | None = None

        def search(query: str) -> str:
            """Search the knowledge base: the best matching lines."""
            return "\n".join(self.index.search(query)) or "no results"

        self.tools = ToolBox([tool(search, timeout_s=5.0)])
        self.task: Mapping[str, Any] = {}
        self._expert_turn = 0

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        self.task, self._expert_turn = task, 0
        self.index = self.workload.index_of(task)
        first = [{"role": "user", "content": task["question"]}]
        if self.workload.params.describe_tools:
            first.insert(0, {"role": "system", "content": "Tools:\n" + self.tools.describe()})
        return first

    async def step(self, action: Action) -> StepResult:
        got = parse_answer(action.text)
        ok = bool(got) and got.lower() == str(self.task["answer"]).lower()
        return StepResult(reward=float(ok), done=True, info={"success": float(ok), "answer": got})

    def expert_action(self) -> str:
        """The scripted expert's next turn: one search per hop along the hidden chain
        (``"<entity> <relation>"``), then the answer."""
        chain, i = self.task["chain"], self._expert_turn
        self._expert_turn += 1
        if 2 * i + 1 < len(chain):
            return format_call("search", {"query": f"{chain[2 * i]} {chain[2 * i + 1]}"})
        return str(self.task["answer"])


@WORKLOADS.register("search")
class SearchWorkload(AgentWorkload):
    """Multi-hop questions over a generated knowledge base with a BM25 ``search`` tool
    (``workload.params`` are ``SearchParams`` fields)."""

    Params = SearchParams

    def __init__(self, seed: int = 0, **params: Any):
        super().__init__(seed=seed, **params)
        self.kb = KnowledgeBase(self.params) if self.params.kb == "shared" else None
        self.index = KnowledgeIndex(self.kb.documents(), self.params.top_k) if self.kb else None
        self._splits: dict[str, list[dict[str, Any]]] | None = None

    def index_of(self, task: Mapping[str, Any]) -> KnowledgeIndex:
        """The index a task searches: its own knowledge base's, or the shared one."""
        if "kb" in task:
            return KnowledgeIndex(KnowledgeBase(self.params, seed=task["kb"]).documents(), self.params.top_k)
        if self.index is None:
            raise ValueError("search workload: a task without its own knowledge base ('kb') needs kb: shared")
        return self.index

    def _per_task_splits(self) -> dict[str, list[dict[str, Any]]]:
        """Tasks with a knowledge base each, seeded by split and index (train and held-out never
        share one), difficulties 1..max_hops in turn."""
        p = self.params
        out: dict[str, list[dict[str, Any]]] = {}
        for split, n in (("eval", p.num_test), ("train", p.num_train or 2000)):
            tasks = []
            for i in range(n):
                kb_seed = f"{p.seed}:{split}:{i}"
                hops = 1 + i % p.max_hops
                chains = [c for c in KnowledgeBase(p, seed=kb_seed).chains(hops) if len(c) // 2 == hops]
                if not chains:
                    raise ValueError(f"search workload: a knowledge base this small has no {hops}-hop "
                                     "question; raise num_people / num_companies / num_cities")
                tasks.append({**self.payload(random.Random(kb_seed).choice(chains)), "kb": kb_seed})
            out[split] = tasks
        return out

    def _make_splits(self) -> dict[str, list[dict[str, Any]]]:
        """Questions of each difficulty in a seed-fixed hashed order; held-out takes the first
        ``num_test`` (difficulties interleaved), train the next ``num_train``."""
        p = self.params
        by_hops: dict[int, list[list[str]]] = {}
        for chain in self.kb.chains(p.max_hops):
            by_hops.setdefault(len(chain) // 2, []).append(chain)

        def h(chain: list[str]) -> bytes:
            return hashlib.blake2b(f"{p.seed}:{' '.join(chain)}".encode(), digest_size=8).digest()

        queues = [sorted(cs, key=h) for _, cs in sorted(by_hops.items())]
        order: list[list[str]] = []
        while any(queues):
            for q in queues:
                if q:
                    order.append(q.pop(0))
        want = p.num_test + (p.num_train or 1)
        if len(order) < want:
            raise ValueError(f"search workload: the knowledge base has {len(order)} questions, fewer than "
                             f"num_test + num_train = {want}; lower them or raise "
                             "num_people / num_companies / num_cities")
        payloads = [self.payload(c) for c in order]
        end = None if p.num_train is None else p.num_test + p.num_train
        return {"eval": payloads[:p.num_test], "train": payloads[p.num_test:end]}

    @staticmethod
    def payload(chain: list[str]) -> dict[str, Any]:
        """A task: the question, its answer, its hidden chain and its ``difficulty`` (hops)."""
        return {"question": f"{chain[0]} {' '.join(chain[1::2])}?", "answer": chain[-1],
                "chain": list(chain), "difficulty": len(chain) // 2}

    def tasks(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"search workload: split must be 'train' or 'eval', got {split!r}")
        if self._splits is None:
            self._splits = self._per_task_splits() if self.params.kb == "per_task" else self._make_splits()
        return self._splits[split]

    def environment(self) -> SearchEnv:
        return SearchEnv(self)
