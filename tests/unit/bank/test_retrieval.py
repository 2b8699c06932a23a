"""Experience retrieval: exactness against brute force, diversification worked by hand, batching and caching under
concurrent callers, empty families, lineage of what is served, and one end-to-end check with the real encoder.

Most tests use `HashEncoder`, a deterministic stand-in for the sentence encoder that counts its calls.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time

import numpy as np
import pytest
from experience_ops import add
from experience_ops import key as vector_key
from pydantic import ValidationError
from tiny_models import TINY

from pipeline.bank.replica import LocalBank
from pipeline.bank.retrieval import (
    Query,
    RetrievalSettings,
    Retriever,
    ServeRecord,
    diversify,
    query_text,
    start_query,
)
from pipeline.bank.synthetic import FAMILIES, embedding_like, synthetic_op_log
from pipeline.errors import InvalidArgumentError
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded, ExperienceRefined
from schemas.trajectories import ExperienceRef

WHO = Producer(worker="extractor", instance="extractor-0")
MODEL = "all-MiniLM-L6-v2"
OFF = {"diversity_lambda": 0.0, "recency_window_steps": 0}
"""Diversification off: the score is -rank alone."""
PAPER = {"diversity_lambda": 0.4, "recency_window_steps": 1, "similarity_margin": None}
"""The paper's diversification (Eq. 6) over every candidate, recency counted in steps."""


class HashEncoder:
    """Maps a text to a fixed embedding-like unit vector (seeded by its sha256); records every call."""

    def __init__(self, dim: int = 384, delay_s: float = 0.0, fixed: dict[str, np.ndarray] | None = None) -> None:
        self.dim = dim
        self.delay_s = delay_s
        self.fixed = fixed or {}
        self.calls: list[list[str]] = []

    def vector(self, text: str) -> np.ndarray:
        if text in self.fixed:
            vector = np.asarray(self.fixed[text], dtype=np.float32)
            return vector / np.linalg.norm(vector)
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        return embedding_like(np.random.default_rng(seed), 1, self.dim)[0]

    def encode(self, sentences: list[str], convert_to_numpy: bool = True,
               normalize_embeddings: bool = False) -> np.ndarray:
        self.calls.append(list(sentences))
        if self.delay_s:
            time.sleep(self.delay_s)  # lets concurrent callers queue up, as a real model's encode time does
        return np.stack([self.vector(text) for text in sentences])


class CountingBank(LocalBank):
    """A LocalBank that records the number of query rows of every search."""

    def __init__(self) -> None:
        super().__init__()
        self.searches: list[int] = []

    def search_candidates(self, queries, task_families, k):
        self.searches.append(len(task_families))
        return super().search_candidates(queries, task_families, k)


def added(op_id: str, experience_id: str, vector, family: str = "room", text: str | None = None) -> ExperienceAdded:
    return add(op_id, experience_id, text or f"tip {experience_id}", family, vector_key(*vector, model=MODEL))


def bank_of(ops: list) -> CountingBank:
    bank = CountingBank()
    for offset, op in enumerate(ops):
        bank.apply(op, offset)
    return bank


def brute_force(bank: LocalBank, query: np.ndarray, family: str, k: int) -> list[tuple[str, float]]:
    """Cosine top-k in float64 over the family's active experiences."""
    active = list(bank.state.active(family))
    keys = np.stack([e.key.astype(np.float64) for e in active])
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    scores = keys @ (query.astype(np.float64) / np.linalg.norm(query))
    order = np.argsort(-scores, kind="stable")[:k]
    return [(active[j].experience_id, float(scores[j])) for j in order]


# ------------------------------------------------------------------------------------------------------- exactness


def test_without_diversification_results_are_the_brute_force_top_k() -> None:
    bank = bank_of(synthetic_op_log(600, seed=3))
    encoder = HashEncoder()
    k = 8
    retriever = Retriever(bank, encoder, RetrievalSettings(top_k=k, oversample=1, **OFF))
    queries = [(f"query {i}", FAMILIES[i % len(FAMILIES)]) for i in range(12)]
    for _round in range(2):  # serving twice changes nothing while diversification is off
        for (text, family), found in zip(queries, retriever.retrieve_many(queries), strict=True):
            expected = brute_force(bank, encoder.vector(text), family, k)
            assert [e.experience_id for e in found.experiences] == [i for i, _ in expected]
            np.testing.assert_allclose([e.score for e in found.experiences], [s for _, s in expected], atol=1e-5)
            assert [e.similarity_rank for e in found.experiences] == list(range(k))
            assert found.bank_offset == bank.offset
    one = retriever.retrieve(*queries[5])  # through the batcher: the same answer
    assert [e.experience_id for e in one.experiences] == [i for i, _ in brute_force(
        bank, encoder.vector(queries[5][0]), queries[5][1], k)]
    retriever.close()


def test_with_top_1_and_diversification_off_the_nearest_is_served_every_time() -> None:
    bank = bank_of(synthetic_op_log(300, seed=4))
    encoder = HashEncoder()
    retriever = Retriever(bank, encoder, RetrievalSettings(top_k=1, oversample=16, **OFF))
    nearest = brute_force(bank, encoder.vector("q"), "sokoban", 1)[0][0]
    for found in retriever.retrieve_many([("q", "sokoban")] * 5):
        assert [e.experience_id for e in found.experiences] == [nearest]
    assert retriever.served(nearest).count == 5


# ------------------------------------------------------------------------------------------------- diversification

# Three experiences whose similarity to the query "q" = (1, 0, 0, 0) falls A > B > C.
ABC = {"A": (1.0, 0.1, 0.0, 0.0), "B": (1.0, 0.5, 0.0, 0.0), "C": (1.0, 1.5, 0.0, 0.0)}


def abc_retriever(**settings: object) -> Retriever:
    bank = bank_of([added(f"op-{name}", name, vector) for name, vector in ABC.items()])
    encoder = HashEncoder(dim=4, fixed={"q": np.array([1.0, 0.0, 0.0, 0.0])})
    return Retriever(bank, encoder, RetrievalSettings(**{"top_k": 1, "oversample": 3, **PAPER, **settings}))


def serve_one(retriever: Retriever, step: int) -> tuple[str, float]:
    (experience,) = retriever.retrieve_many([Query("q", "room", step)])[0].experiences
    return experience.experience_id, experience.diversified_score


def test_diversification_by_hand() -> None:
    retriever = abc_retriever(recency_window_steps=2)
    assert serve_one(retriever, step=3) == ("A", 0.0)  # nothing served yet: s = -rank
    # step 5: A was served at step 3, outside the 2-step window: s_A = -0.4 log 2 = -0.277 > s_B = -1
    chosen, score = serve_one(retriever, step=5)
    assert chosen == "A" and score == pytest.approx(-0.4 * math.log(2))
    # A served twice, at this very step: s_A = -0.4 log 3 - 1 = -1.4394 < s_B = -1 (and s_C = -2).
    chosen, score = serve_one(retriever, step=5)
    assert (chosen, score) == ("B", -1.0)
    assert retriever.served("A") == ServeRecord(count=2, last_step=5)
    # step 6: A and B, both served at step 5, are within the window: s_A = -0.4 log 3 - 1 = -1.4394 beats
    # s_B = -1 - 0.4 log 2 - 1 = -2.277 and s_C = -2.
    chosen, score = serve_one(retriever, step=6)
    assert (chosen, score) == ("A", pytest.approx(-0.4 * math.log(3) - 1))
    # step 8: nothing recent (A last at 6, B at 5): s_A = -0.4 log 4 = -0.5545 > s_B = -1.277
    chosen, score = serve_one(retriever, step=8)
    assert chosen == "A"
    assert score == pytest.approx(-0.4 * math.log(4))
    assert score == pytest.approx(-0.55451774, abs=1e-8)


def test_identical_queries_in_one_batch_see_each_others_serves() -> None:
    retriever = abc_retriever()
    found = retriever.retrieve_many([("q", "room")] * 4)
    # slot 1: A (0); slot 2: A = -0.4 log 2 - 1 = -1.277 < B = -1 -> B; slot 3: A -1.277 > C -2 > B -2.277 -> A;
    # slot 4: A = -0.4 log 3 - 1 = -1.439 > C = -2 -> A.
    assert [r.experiences[0].experience_id for r in found] == ["A", "B", "A", "A"]
    np.testing.assert_allclose([r.experiences[0].diversified_score for r in found],
                               [0.0, -1.0, -0.4 * math.log(2) - 1, -0.4 * math.log(3) - 1])
    assert len(retriever.bank.searches) == 1 and retriever.bank.searches[0] == 1  # one row for the four


def test_a_slot_is_served_as_if_its_groups_earlier_slots_had_just_been_served_whatever_came_before() -> None:
    # Deterministic mode: slot j of a group gets what the j-th of identical queries in one fresh batch would get
    # (A, B, A, A, as above), not what this process served before it.
    retriever = abc_retriever()
    slots = [retriever.retrieve_slot(Query("q", "room", 5), earlier) for earlier in range(4)]
    assert [r.experiences[0].experience_id for r in slots] == ["A", "B", "A", "A"]
    np.testing.assert_allclose([r.experiences[0].diversified_score for r in slots],
                               [0.0, -1.0, -0.4 * math.log(2) - 1, -0.4 * math.log(3) - 1])
    for _ in range(3):
        serve_one(retriever, step=5)  # the process-wide counters move ...
    again = retriever.retrieve_slot(Query("q", "room", 5), 1)
    assert again.experiences[0].experience_id == "B" and again.bank_offset == slots[1].bank_offset  # ... not this
    assert retriever.served("B").count == 1, "retrieve_slot leaves the counters of retrieve_many alone"


def test_the_similarity_margin_keeps_clearly_worse_matches_out() -> None:
    # similarities to q: A 1/sqrt(1.01) = 0.99504, B 1/sqrt(1.25) = 0.89443, C 1/sqrt(3.25) = 0.55470
    within = abc_retriever(similarity_margin=0.05)  # only A is within 0.05 of the best: it guides every slot
    assert [r.experiences[0].experience_id for r in within.retrieve_many([("q", "room")] * 4)] == ["A"] * 4
    wider = abc_retriever(similarity_margin=0.11)  # A and B (0.1006 below): the serves alternate, C never comes
    assert [r.experiences[0].experience_id for r in wider.retrieve_many([("q", "room")] * 4)] == ["A", "B", "A", "A"]
    # next step, nothing recent: A (count 3) -0.4 log 4 = -0.55 > B -1.28; then A -1.64 < B -1.28; then B -2.44 < A
    assert [r.experiences[0].experience_id for r in wider.retrieve_many([Query("q", "room", 1)] * 4)] == [
        "A", "B", "A", "A"]
    assert wider.served("C").count == 0
    # top_k 2 with a margin that admits A alone: the two most similar are always eligible
    two = abc_retriever(similarity_margin=0.0, top_k=2)
    assert [e.experience_id for e in two.retrieve_many([("q", "room")])[0].experiences] == ["A", "B"]


def test_diversify_breaks_ties_by_similarity_rank() -> None:
    bank = bank_of([added(f"op-{name}", name, vector) for name, vector in ABC.items()])
    candidates = bank.search_candidates(np.array([[1.0, 0.0, 0.0, 0.0]]), ["room"], 3)[0][0]
    settings = RetrievalSettings(top_k=3, oversample=1, diversity_lambda=0.0, recency_window_steps=3,
                                 similarity_margin=None)
    served = {"A": ServeRecord(count=1, last_step=8)}  # A recent at step 10: s_A = -1 = s_B
    ranked = diversify(candidates, served, step=10, settings=settings)
    assert [(e.experience_id, e.similarity_rank, e.diversified_score) for e in ranked] == [
        ("A", 0, -1.0), ("B", 1, -1.0), ("C", 2, -2.0)]
    later = diversify(candidates, served, step=11, settings=settings)  # 3 steps on: no longer recent
    assert [(e.experience_id, e.diversified_score) for e in later] == [("A", 0.0), ("B", -1.0), ("C", -2.0)]


# ------------------------------------------------------------------------------------------ batching and caching


def test_concurrent_callers_are_batched_and_each_gets_its_own_result() -> None:
    bank = bank_of(synthetic_op_log(800, seed=5))
    encoder = HashEncoder(delay_s=0.005)
    # A generous wait keeps the test independent of how fast 64 threads wake on a loaded machine; 64 callers
    # fill exactly four batches, so no batch waits it out.
    settings = RetrievalSettings(top_k=2, oversample=4, max_batch=16, max_wait_s=0.5, **OFF)
    retriever = Retriever(bank, encoder, settings)
    tasks = [(f"goal of task {t}", FAMILIES[t % len(FAMILIES)]) for t in range(16)]
    callers = [tasks[c // 4] for c in range(64)]  # 4 guided slots per task share its query
    expected = {task: [e.experience_id for e in found.experiences] for task, found in
                zip(tasks, Retriever(bank, HashEncoder(), settings).retrieve_many(tasks), strict=True)}
    bank.searches.clear()
    results: list = [None] * 64
    start = threading.Barrier(64)

    def call(caller: int) -> None:
        start.wait()
        results[caller] = retriever.retrieve(*callers[caller])

    threads = [threading.Thread(target=call, args=(c,)) for c in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    for caller, found in enumerate(results):
        assert [e.experience_id for e in found.experiences] == expected[callers[caller]]
        assert found.bank_offset == bank.offset
    encoded = [text for call in encoder.calls for text in call]
    assert all(len(set(call)) == len(call) for call in encoder.calls)  # deduplicated within a call
    assert sorted(encoded) == sorted(text for text, _ in tasks)  # and never again from the cache
    assert len(encoder.calls) <= 64 // 16 * 2
    assert len(bank.searches) <= 64 // 16 * 2
    assert all(rows <= 16 for rows in bank.searches)
    metrics = retriever.metrics()
    assert metrics["retrieval/queries"] == 64 and metrics["retrieval/batches"] == len(bank.searches)
    assert metrics["retrieval/encoded_texts"] == 16
    retriever.retrieve(*tasks[3])  # a repeated query text is not encoded again
    assert len([text for call in encoder.calls for text in call]) == 16
    retriever.close()


def test_a_batch_waits_for_company_at_most_max_wait_and_not_at_all_once_full() -> None:
    bank = bank_of(synthetic_op_log(30, seed=12))
    with Retriever(bank, HashEncoder(), RetrievalSettings(max_wait_s=0.3)) as lone:
        began = time.perf_counter()
        lone.retrieve("q", "sokoban")
        assert 0.29 <= time.perf_counter() - began < 3.0
    with Retriever(bank, HashEncoder(), RetrievalSettings(max_batch=1, max_wait_s=30.0)) as full:
        began = time.perf_counter()
        full.retrieve("q", "sokoban")
        assert time.perf_counter() - began < 3.0


def test_the_cache_is_lru_and_bounded() -> None:
    bank = bank_of(synthetic_op_log(50, seed=6))
    encoder = HashEncoder()
    retriever = Retriever(bank, encoder, RetrievalSettings(cache_size=2))
    for text in ("a", "b", "a", "c", "b"):  # "c" evicts "b" (least recently used), so "b" is encoded again
        retriever.retrieve_many([(text, "sokoban")])
    assert encoder.calls == [["a"], ["b"], ["c"], ["b"]]
    uncached = Retriever(bank, encoder := HashEncoder(), RetrievalSettings(cache_size=0))
    uncached.retrieve_many([("a", "sokoban"), ("a", "minihack-room")])
    uncached.retrieve_many([("a", "sokoban")])
    assert encoder.calls == [["a"], ["a"]]


def test_an_exception_reaches_every_caller_of_the_batch_and_the_batcher_survives() -> None:
    class Failing(HashEncoder):
        def encode(self, sentences, **kwargs):
            if any("boom" in text for text in sentences):
                raise RuntimeError("encoder failed")
            return super().encode(sentences, **kwargs)

    bank = bank_of(synthetic_op_log(50, seed=7))
    encoder = Failing()
    retriever = Retriever(bank, encoder, RetrievalSettings(max_batch=4, max_wait_s=0.5))
    errors: list = [None] * 4

    def call(caller: int) -> None:
        try:
            retriever.retrieve("boom" if caller == 0 else f"fine {caller}", "sokoban")
        except RuntimeError as exc:
            errors[caller] = exc

    threads = [threading.Thread(target=call, args=(c,)) for c in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [str(e) for e in errors] == ["encoder failed"] * 4  # the batch of 4 filled before the 0.5 s wait ended
    assert retriever.retrieve("fine again", "sokoban").bank_offset == bank.offset
    retriever.close()


def test_close_stops_the_batcher_and_refuses_new_queries() -> None:
    retriever = Retriever(bank_of(synthetic_op_log(20, seed=8)), HashEncoder())
    assert retriever.retrieve("q", "sokoban").bank_offset == retriever.bank.offset
    retriever.close()
    retriever.close()
    assert retriever._batcher is not None and not retriever._batcher.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        retriever.retrieve("q", "sokoban")


# ------------------------------------------------------------------------------------------ families and lineage


def test_a_family_without_experiences_gets_nothing_at_the_current_offset() -> None:
    bank = bank_of(synthetic_op_log(100, seed=9))
    retriever = Retriever(bank, HashEncoder())
    empty, full = retriever.retrieve_many([("q", "nethack-unseen"), ("q", "sokoban")])
    assert empty.experiences == () and empty.bank_offset == bank.offset
    assert len(full.experiences) == 1
    assert Retriever(CountingBank(), HashEncoder()).retrieve_many([("q", "sokoban")])[0].experiences == ()


def test_served_experiences_come_only_from_the_query_family() -> None:
    bank = bank_of(synthetic_op_log(400, seed=11))
    retriever = Retriever(bank, HashEncoder(), RetrievalSettings(top_k=5))
    for family in FAMILIES:
        for found in retriever.retrieve_many([(f"q{i}", family) for i in range(5)]):
            assert {bank.state.experiences[e.experience_id].task_family for e in found.experiences} == {family}


def test_refs_carry_the_version_and_generation_that_wrote_the_served_text() -> None:
    ops = [
        added("op-1", "e1", (1.0, 0.0, 0.0, 0.0), text="keep to the walls"),
        added("op-2", "e2", (0.0, 1.0, 0.0, 0.0), text="unrelated"),
        ExperienceRefined(run_id="r", producer=WHO, op_id="op-3", experience_id="e1", expected_version=1,
                          text="keep to the walls, then go down", generation_id="gen-refine", extractor_version=1),
    ]
    bank = bank_of(ops[:2])
    retriever = Retriever(bank, HashEncoder(dim=4, fixed={"q": np.array([1.0, 0.0, 0.0, 0.0])}),
                          RetrievalSettings(**OFF))
    before = retriever.retrieve_many([("q", "room")])[0]
    assert before.experiences[0].ref() == ExperienceRef(experience_id="e1", version=1, generation_id="gen-op-1")
    bank.apply(ops[2], 2)
    after = retriever.retrieve_many([("q", "room")])[0]
    (served,) = after.experiences
    assert served.ref() == ExperienceRef(experience_id="e1", version=2, generation_id="gen-refine")
    assert served.text == "keep to the walls, then go down"
    assert (before.bank_offset, after.bank_offset) == (2, 3)


# --------------------------------------------------------------------------------------------- settings and query


def test_settings_reject_bad_values_and_stay_frozen() -> None:
    for bad in ({"top_k": 0}, {"max_batch": 0}, {"oversample": 0}, {"max_wait_s": -1.0},
                {"diversity_lambda": -0.1}, {"recency_window_steps": -1}, {"similarity_margin": -0.1},
                {"cache_size": -1}, {"topk": 1}):
        with pytest.raises(ValidationError):
            RetrievalSettings(**bad)
    with pytest.raises(ValidationError, match=r"recency_window_s was replaced by retrieval\.recency_window_steps"):
        RetrievalSettings(recency_window_s=300)
    with pytest.raises(ValidationError):
        RetrievalSettings().top_k = 2  # type: ignore[misc]


def test_query_text_is_goal_then_first_observation() -> None:
    assert query_text(" Reach the stairs. ", "You see a dark room.\n") == (
        "Goal: Reach the stairs.\nObservation: You see a dark room.")
    assert RetrievalSettings().key == "goal-and-first-observation"  # the paper's code's key is the default


def test_the_key_setting_keeps_the_goal_or_the_first_observation_alone() -> None:
    assert query_text(" Reach the stairs. ", "You see a dark room.\n", "goal") == "Goal: Reach the stairs."
    assert query_text(" Reach the stairs. ", "You see a dark room.\n", "first-observation") == (
        "Observation: You see a dark room.")
    with pytest.raises(InvalidArgumentError, match="unknown retrieval key 'task'; valid values: goal-and-first"):
        query_text("Reach the stairs.", "You see a dark room.", "task")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="key"):
        RetrievalSettings(key="task")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- the real encoder


def test_real_minilm_retrieves_the_experience_learnt_on_a_similar_start() -> None:
    from pipeline.bank.embeddings import load_sentence_encoder

    encoder = load_sentence_encoder(MODEL)
    sources = {
        "stairs": query_text("Reach the staircase down (>).", "A lit room; the staircase is two squares east."),
        "key": query_text("Pick up the key and open the locked door.", "A key lies on the floor by a closed door."),
        "boulder": query_text("Push every boulder onto a target.", "Boulders and targets in a small warehouse."),
    }
    keys = encoder.encode(list(sources.values()), convert_to_numpy=True, normalize_embeddings=True)
    bank = bank_of([added(f"op-{name}", name, key, family="minihack") for name, key in zip(sources, keys, strict=True)])
    retriever = Retriever(bank, encoder, RetrievalSettings(top_k=3, **OFF))
    query = query_text("Go down the stairs (>).", "You are in a bright room, the stairs are to the east.")
    found = retriever.retrieve(query, "minihack").experiences
    retriever.close()
    assert found[0].experience_id == "stairs"
    vector = encoder.encode([query], convert_to_numpy=True, normalize_embeddings=True)[0]
    expected = brute_force(bank, vector, "minihack", 3)
    assert [e.experience_id for e in found] == [i for i, _ in expected]
    np.testing.assert_allclose([e.score for e in found], [s for _, s in expected], atol=1e-5)


def test_lessons_keyed_alike_share_a_rank_so_serves_spread_over_all_of_them():
    # three lessons of one task, keyed by its query (similarity 1 each), and another task's: one rank for the three,
    # so the counts alone decide and each is served once before any twice (ranked by position, the first would
    # be served until 0.4 log(1 + n) > 1, i.e. 12 times in a row)
    vectors = {"A1": [1.0, 0, 0, 0], "A2": [1.0, 0, 0, 0], "A3": [1.0, 0, 0, 0], "B": [0.8, 0.6, 0, 0]}
    bank = bank_of([added(f"op-{name}", name, np.array(v)) for name, v in vectors.items()])
    encoder = HashEncoder(dim=4, fixed={"q": np.array([1.0, 0.0, 0.0, 0.0])})
    retriever = Retriever(bank, encoder, RetrievalSettings(top_k=1, oversample=4, recency_window_steps=0))
    served = [r.experiences[0] for r in retriever.retrieve_many([("q", "room")] * 6)]
    assert sorted(e.experience_id for e in served[:3]) == ["A1", "A2", "A3"]
    assert sorted(e.experience_id for e in served[3:]) == ["A1", "A2", "A3"]
    assert {e.similarity_rank for e in served} == {0}


def test_the_other_task_control_serves_only_what_lies_outside_the_margin():
    # A 0.995 and B 0.894 lie within 0.15 of the best; C 0.555 alone lies outside: the control serves C every time
    control = abc_retriever(similarity_margin=0.15, serve="other-task")
    found = control.retrieve_many([("q", "room")] * 3)
    assert [(r.experiences[0].experience_id, r.experiences[0].similarity_rank) for r in found] == [("C", 2)] * 3
    # outside a margin of 0.05 lie B and C, and the match A never comes. The control has no similarity term: ties
    # go in sha256 order of the ids (C's 6b23... before B's df7e...). C (s = 0), then B (C: -0.4 log 2 - 1 recent
    # = -1.277 < 0), then C again (both -1.277, sha256 order), then B (C: -0.4 log 3 - 1 = -1.439 < -1.277).
    wider = abc_retriever(similarity_margin=0.05, serve="other-task")
    served = [r.experiences[0] for r in wider.retrieve_many([("q", "room")] * 4)]
    assert [e.experience_id for e in served] == ["C", "B", "C", "B"]
    assert [e.similarity_rank for e in served] == [2, 1, 2, 1], "the similarity rank is recorded as it is"
    with pytest.raises(ValidationError, match="needs a similarity_margin"):
        RetrievalSettings(serve="other-task", similarity_margin=None)
    # k = top_k * oversample = 1 candidate would hold only the match A; the control looks past it to C
    narrow = abc_retriever(similarity_margin=0.15, serve="other-task", oversample=1)
    assert narrow.retrieve_many([("q", "room")])[0].experiences[0].experience_id == "C"


def test_below_the_similarity_floor_nothing_is_served():
    # the best candidate, A, is 0.99504 similar to q
    assert abc_retriever(min_similarity=0.99).retrieve_many([("q", "room")])[0].experiences[0].experience_id == "A"
    below = abc_retriever(min_similarity=0.996)
    assert below.retrieve_many([("q", "room")])[0].experiences == ()
    assert below.served("A").count == 0
    # within the margin of A (0.15) lies B (0.894), but below the floor: A is served every time, B never
    floor = abc_retriever(similarity_margin=0.15, min_similarity=0.9)
    assert [r.experiences[0].experience_id for r in floor.retrieve_many([("q", "room")] * 3)] == ["A"] * 3


def test_a_merge_keyed_by_its_sources_is_found_by_their_queries_where_one_keyed_by_its_text_is_not() -> None:
    from pipeline.bank.embeddings import load_sentence_encoder
    from pipeline.extractor.ops import merged_key
    from schemas.experiences import ExperienceMerged, VersionedExperience

    encoder = load_sentence_encoder(MODEL)
    corridors = [query_text(f"reach the staircase down (>) of the {name} corridor", f"Where: {where}")
                 for name, where in (("amber heron", "altar 1 west; sink 1 east"),
                                     ("pale newt", "altar 1 east; grave 1 west"),
                                     ("copper lynx", "fountain 1 west; altar 1 east"))]
    other = query_text("push every boulder onto a target", "Boulders and targets in a small warehouse.")
    keys = encoder.encode([*corridors, other], convert_to_numpy=True, normalize_embeddings=True)
    lesson = "The staircase down is on the altar's side."
    text_key = encoder.encode([lesson], convert_to_numpy=True, normalize_embeddings=True)[0]
    ops: list = [added("op-a", "a", keys[0], family="corridor"), added("op-b", "b", keys[1], family="corridor"),
                 added("op-w", "warehouse", keys[3], family="corridor")]

    def merged(key: EmbeddingVector) -> ExperienceMerged:
        return ExperienceMerged(
            run_id="r", producer=WHO, op_id="op-m", experience_id="m", task_family="corridor", text=lesson, key=key,
            generation_id="gen-m", extractor_version=0,
            sources=(VersionedExperience(experience_id="a", expected_version=1),
                     VersionedExperience(experience_id="b", expected_version=1)))

    by_sources = merged(merged_key(MODEL, [keys[0], keys[1]]))
    by_text = merged(EmbeddingVector.from_array(MODEL, text_key))
    for query in corridors:  # the sources' own corridors and a third, unseen one
        vector = encoder.encode([query], convert_to_numpy=True, normalize_embeddings=True)[0]
        found = dict(brute_force(bank_of([*ops, by_sources]), vector, "corridor", 2))
        assert next(iter(found)) == "m", "the merge is the nearest lesson to every corridor's query"
        text_found = dict(brute_force(bank_of([*ops, by_text]), vector, "corridor", 2))
        assert found["m"] > text_found.get("m", -1.0) + 0.1, "keyed by its text, the merge is far from any query"


def test_an_added_experience_is_keyed_by_its_trajectorys_start_as_the_queries_are() -> None:
    from pipeline.models import build_tiny
    from pipeline.rl.synthetic import synthetic_trajectories

    trajectory = synthetic_trajectories(build_tiny(TINY), run_id="r", step=0, groups=1, group_size=1, seed=3)[0]
    first = trajectory.turns[0].observation
    for key in ("goal-and-first-observation", "goal", "first-observation"):
        assert start_query(trajectory, key) == query_text(trajectory.goal, first, key)
    assert start_query(trajectory) == f"Goal: {trajectory.goal.strip()}\nObservation: {first.strip()}"
    assert start_query(trajectory.model_copy(update={"turns": ()}), "first-observation") == "Observation: "
