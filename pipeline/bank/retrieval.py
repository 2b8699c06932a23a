"""Experience retrieval for guided episodes: embed the episode's query, search its task family, diversify.

    retriever = Retriever(bank, load_sentence_encoder("all-MiniLM-L6-v2"), RetrievalSettings())
    found = retriever.retrieve(query_text(task.goal, first_observation), task.task_family, step)  # ~1 ms + work
    trajectory.retrieved = tuple(e.ref() for e in found.experiences); trajectory.bank_offset = found.bank_offset
    retriever.close()

How one query is served (the paper's retrieval and its diversification stabiliser; docs/design.md):
1. Query: `query_text(goal, first_observation, key)` (`retrieval.key`: both, as the paper's code keys it, or either
   alone), embedded with the bank's sentence encoder (unit vectors). The same text keys the experiences an episode
   adds, so a query meets the experiences learnt on similar starts.
2. Candidates: the `top_k * oversample` nearest experiences of the query's task family by cosine similarity
   (`LocalBank.search_candidates`; the index keeps one structure per family, so the family filter is the search).
3. Margin: only candidates whose similarity is within `similarity_margin` of the best one's stay eligible (the
   `top_k` most similar always do), so diversification spreads serves over near-equivalent experiences and never
   hands an episode a clearly worse match, such as another task's lesson once the closest one has been served.
4. Diversification: the eligible candidate at 0-based similarity rank `r` (equally similar candidates, such as the
   lessons of one task keyed by its query, share a rank) scores
   `s = -r - diversity_lambda * log(1 + count) - [served to an episode of the last recency_window_steps steps]`,
   and the `top_k` best `s` are served (ties: the more similar first). Without it the same few experiences would
   guide every episode, and the extractor would get credit signal for only those.

Batching: concurrent `retrieve` calls go through one background batcher thread, which takes up to `max_batch`
queries, waiting at most `max_wait_s` after the first of them arrived. A batch makes one `encoder.encode` call (only
for distinct texts not in the LRU cache; the guided slots of one task share a query) and one
`bank.search_candidates` call (one row per distinct (text, family)); every caller then gets its own `Retrieval`,
or the batch's exception. `retrieve_many` serves a caller's own batch the same way, on the caller's thread.

How this departs from the paper's description:
- Recency counts training steps (the step of the episode served), not wall-clock seconds: the paper's 300 s is a
  fraction of a step at its scale and a whole run at ours. The margin (step 3) is ours: with the paper's bank of
  thousands of experiences the next-ranked candidate is a near-equivalent; with a few hundred it often is not.
- `count` and the last step served are what this Retriever served, kept per process. The bank's `retrievals` counter
  is event-derived (a `TrajectoryCompleted` reports what an episode used) and arrives only when the episode ends,
  minutes later; counting at serve time is what lets the concurrent slots of one step spread over experiences.
  Several rollout processes therefore diversify independently.
- Serving updates the counters right after ranking, query by query in batch order, under one lock. So identical
  queries in one batch see each other: with top-1, the second of four slots sharing a query is pushed off the
  experience the first one got when another candidate then scores higher (see `diversify`).
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, get_args

import numpy as np

from pipeline.bank.replica import Candidate, LocalBank
from pipeline.bank.settings import RetrievalKey, RetrievalSettings
from pipeline.errors import InvalidArgumentError, InvalidStateError
from schemas.trajectories import ExperienceRef, TrajectoryCompleted


class SentenceEncoder(Protocol):
    """What retrieval needs from an embedding model; a `SentenceTransformer` is one."""

    def encode(self, sentences: list[str], /, *, convert_to_numpy: bool = ...,
               normalize_embeddings: bool = ...) -> Any: ...


@dataclass(frozen=True)
class RetrievedExperience:
    """One experience as served to an episode: what the trajectory records, plus its text and how it ranked."""

    experience_id: str
    version: int
    """Version of the text that was served."""
    generation_id: str
    """Extractor generation that wrote that version: credit for the episode goes there."""
    text: str
    score: float
    """Cosine similarity between the query and the experience's key."""
    similarity_rank: int = 0
    """0-based rank of the experience among the query's candidates by similarity."""
    diversified_score: float = 0.0
    """`-rank - lambda * log(1 + count) - recent` at serve time; the eligible experiences served are the best by
    this."""

    def ref(self) -> ExperienceRef:
        return ExperienceRef(experience_id=self.experience_id, version=self.version, generation_id=self.generation_id)


@dataclass(frozen=True)
class Retrieval:
    """What one query got, and the bank version it was served from."""

    experiences: tuple[RetrievedExperience, ...]
    """Best first; empty when the task family has no experiences."""
    bank_offset: int
    """Next experience-op offset the bank had applied when it served these (TrajectoryCompleted.bank_offset)."""


def query_text(goal: str, first_observation: str, key: RetrievalKey = "goal-and-first-observation") -> str:
    """The retrieval query of an episode: by default (`retrieval.key`) its goal and its first observation, one
    labelled line each, as the paper's code keys it; `key="goal"` the goal line alone, `"first-observation"` the
    observation line alone.

    Experiences are keyed by this same text of the episode they came from, so both sides must build it here, with
    the run's one `retrieval.key`.
    """
    goal_line, observation_line = f"Goal: {goal.strip()}", f"Observation: {first_observation.strip()}"
    if key == "goal":
        return goal_line
    if key == "first-observation":
        return observation_line
    if key != "goal-and-first-observation":
        raise InvalidArgumentError(f"unknown retrieval key {key!r}; valid values: {', '.join(get_args(RetrievalKey))}")
    return f"{goal_line}\n{observation_line}"


def start_query(trajectory: TrajectoryCompleted, key: RetrievalKey = "goal-and-first-observation") -> str:
    """The start query of the episode `trajectory` records (`query_text` of its goal and first observation): what
    keys an experience learnt from it, so that a later episode starting alike is served it."""
    return query_text(trajectory.goal, trajectory.turns[0].observation if trajectory.turns else "", key)


class Query(NamedTuple):
    """One episode's retrieval request."""

    text: str
    """`query_text(goal, first_observation, key)`, or `query_text(goal, question)` for a question the episode
    asked."""
    task_family: str
    step: int = 0
    """Training step of the episode: recency is counted in steps."""


@dataclass
class ServeRecord:
    """What this process served of one experience."""

    count: int = 0
    last_step: int | None = None
    """Step of the last episode it was served to."""


def eligible(candidates: Sequence[Candidate], settings: RetrievalSettings) -> list[tuple[int, Candidate]]:
    """The candidates diversification may choose from: those within `similarity_margin` of the best similarity,
    and at least the `top_k` most similar, none below `min_similarity` (so none at all when even the best is
    below it); under `serve="other-task"` (a control) only those outside the margin, whatever their similarity.
    candidates: most similar first. Returns (similarity rank, candidate) pairs."""
    # Competition ranking: equally similar candidates (one task's lessons share its query's key) share a rank, so
    # the rank term does not favour whichever of them the index happened to list first.
    ranked, rank = [], 0
    for position, candidate in enumerate(candidates):
        if position and candidate.score != candidates[position - 1].score:
            rank = position
        ranked.append((rank, candidate))
    if settings.min_similarity is not None and settings.serve == "match":
        # an episode is better served nothing than a stranger's lesson
        ranked = [(rank, c) for rank, c in ranked if c.score >= settings.min_similarity]
    if settings.similarity_margin is None or not candidates:
        return ranked
    floor = candidates[0].score - settings.similarity_margin
    if settings.serve == "other-task":  # the control: only what lies outside the margin
        return [(r, c) for r, c in ranked if c.score < floor]
    return [(r, c) for r, c in ranked if r < settings.top_k or c.score >= floor]


def diversify(candidates: Sequence[Candidate], served: Mapping[str, ServeRecord], step: int,
              settings: RetrievalSettings) -> list[RetrievedExperience]:
    """The `top_k` eligible candidates by `s = -r - lambda * log(1 + count) - recent`, best first (ties: lower `r`).

    candidates: one query's candidates, most similar first (r: their competition rank by similarity, equal
    similarities sharing one). served: the counters at serve time.
    step: the episode's training step; an experience last served within `recency_window_steps` steps is recent.
    """
    control = settings.serve == "other-task"
    scored = []
    for rank, candidate in eligible(candidates, settings):
        record = served.get(candidate.experience_id)
        count = 0 if record is None else record.count
        recent = (record is not None and record.last_step is not None
                  and step - record.last_step < settings.recency_window_steps)
        # The control draws other tasks' lessons as a shuffle would: no similarity term, ties in a fixed
        # pseudo-random order, so an episode's lesson is of no task in particular (the nearest task's side would
        # otherwise agree or not with the query's for all of its serves at once).
        score = -(0 if control else rank) - settings.diversity_lambda * math.log1p(count) - (1.0 if recent else 0.0)
        order = hashlib.sha256(candidate.experience_id.encode()).hexdigest() if control else ""
        scored.append((score, rank, order, candidate))
    scored.sort(key=lambda item: (-item[0], item[2], item[1]))
    return [RetrievedExperience(c.experience_id, c.version, c.generation_id, c.text, c.score, rank, score)
            for score, rank, _order, c in scored[: settings.top_k]]


@dataclass
class RetrievalCounters:
    """Totals since the Retriever started (see `Retriever.metrics`)."""

    queries: int = 0
    batches: int = 0
    encoded_texts: int = 0
    encode_calls: int = 0
    cache_hits: int = 0


@dataclass
class _Request:
    query: Query
    arrived: float
    """`time.monotonic()` when the caller queued it: the batch deadline counts from its first request."""
    future: Future[Retrieval]


_STOP = object()
"""Queued by `close`: the batcher serves what was queued before it, then exits."""


class Retriever:
    """Batched, cached, diversified experience retrieval over a `LocalBank` (or a `BankReplica`). Thread-safe."""

    def __init__(self, bank: LocalBank, encoder: SentenceEncoder,
                 settings: RetrievalSettings = RetrievalSettings()) -> None:  # frozen: one shared default is safe
        """
        bank: what to search; searched under its reader lock, so a replica may apply ops meanwhile.
        encoder: embeds query texts (`encode(texts, convert_to_numpy=True, normalize_embeddings=True)` -> (n, dim));
            it must be the model the bank's keys come from.
        """
        self.bank = bank
        self.encoder = encoder
        self.settings = settings
        self.counters = RetrievalCounters()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._served: dict[str, ServeRecord] = {}
        self._serve_lock = threading.Lock()
        """Guards ranking + serve updates (and the counters), so each batch sees every serve before it."""
        self._queue: queue.SimpleQueue[_Request | object] = queue.SimpleQueue()
        self._lifecycle = threading.Lock()
        self._batcher: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------------------- callers

    def retrieve(self, query: str, task_family: str, step: int = 0) -> Retrieval:
        """Experiences for one episode of training step `step`. Blocks while the batcher gathers concurrent queries
        (<= max_wait_s) and serves the batch; raises whatever that batch raised."""
        request = _Request(Query(query, task_family, step), time.monotonic(), Future())
        with self._lifecycle:
            if self._closed:
                raise InvalidStateError("the retriever is closed")
            if self._batcher is None:
                self._batcher = threading.Thread(target=self._run_batcher, name="retrieval-batcher", daemon=True)
                self._batcher.start()
            self._queue.put(request)
        return request.future.result()

    def retrieve_many(self, queries: Sequence[Query | tuple[str, str]]) -> list[Retrieval]:
        """Serve queries (`Query`, or `(text, task_family)` at step 0) as one batch on this thread, whatever their
        number: one encode for the distinct uncached texts, one search, then ranking and serving in the given order."""
        if not queries:
            return []
        requests = [Query(*query) for query in queries]
        vectors_by_text = self._embed(list(dict.fromkeys(query.text for query in requests)))
        # identical (text, family) pairs share one search row
        distinct = list(dict.fromkeys((query.text, query.task_family) for query in requests))
        row_of = {pair: row for row, pair in enumerate(distinct)}
        matrix = np.stack([vectors_by_text[text] for text, _family in distinct])  # (distinct, dim)
        k = self.settings.top_k * self.settings.oversample
        if self.settings.serve == "other-task":
            # The control looks past every lesson of the query's own task, however many that task has gathered.
            k = max(k, len(self.bank.state.experiences))
        candidates, bank_offset = self.bank.search_candidates(matrix, [family for _text, family in distinct], k)
        results = []
        with self._serve_lock:
            for query in requests:
                row = row_of[(query.text, query.task_family)]
                chosen = diversify(candidates[row], self._served, query.step, self.settings)
                for experience in chosen:
                    record = self._served.setdefault(experience.experience_id, ServeRecord())
                    record.count += 1
                    record.last_step = query.step if record.last_step is None else max(record.last_step, query.step)
                results.append(Retrieval(tuple(chosen), bank_offset))
            self.counters.queries += len(queries)
            self.counters.batches += 1
        return results

    def retrieve_slot(self, query: Query, earlier: int) -> Retrieval:
        """Deterministic mode's retrieval: `query` alone (one encode, one search row), diversified as if the `earlier`
        guided slots of its group had just been served the same query, from fresh counters. So what a slot gets is a
        function of the bank state and its slot, not of which episodes this process served before it; the counters
        this Retriever keeps for `retrieve_many` are left alone."""
        vectors = self._embed([query.text])
        k = self.settings.top_k * self.settings.oversample
        if self.settings.serve == "other-task":
            k = max(k, len(self.bank.state.experiences))
        candidates, bank_offset = self.bank.search_candidates(vectors[query.text][None, :], [query.task_family], k)
        served: dict[str, ServeRecord] = {}
        chosen: list[RetrievedExperience] = []
        for _ in range(earlier + 1):
            chosen = diversify(candidates[0], served, query.step, self.settings)
            for experience in chosen:
                record = served.setdefault(experience.experience_id, ServeRecord())
                record.count, record.last_step = record.count + 1, query.step
        with self._serve_lock:
            self.counters.queries += 1
            self.counters.batches += 1
        return Retrieval(tuple(chosen), bank_offset)

    def served(self, experience_id: str) -> ServeRecord:
        """A copy of what this Retriever has served of `experience_id` (count 0 if never)."""
        with self._serve_lock:
            record = self._served.get(experience_id, ServeRecord())
            return ServeRecord(record.count, record.last_step)

    def metrics(self) -> dict[str, float]:
        with self._serve_lock:
            c = self.counters
            return {
                "retrieval/queries": c.queries,
                "retrieval/batches": c.batches,
                "retrieval/mean_batch_size": c.queries / c.batches if c.batches else 0.0,
                "retrieval/encode_calls": c.encode_calls,
                "retrieval/encoded_texts": c.encoded_texts,
                "retrieval/cache_hits": c.cache_hits,
            }

    def close(self, timeout_s: float = 10.0) -> None:
        """Serve what is queued, stop the batcher; later `retrieve` calls raise. Idempotent."""
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            batcher = self._batcher
            if batcher is not None:
                self._queue.put(_STOP)
        if batcher is not None:
            batcher.join(timeout_s)

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- internals

    def _embed(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Unit float32 vectors for distinct `texts`: cached ones from the LRU, the rest from one encode call."""
        found: dict[str, np.ndarray] = {}
        with self._cache_lock:
            for text in texts:
                vector = self._cache.get(text)
                if vector is not None:
                    self._cache.move_to_end(text)
                    found[text] = vector
        missing = [text for text in texts if text not in found]
        if missing:
            encoded = np.asarray(self.encoder.encode(missing, convert_to_numpy=True, normalize_embeddings=True),
                                 dtype=np.float32)
            if encoded.ndim != 2 or encoded.shape[0] != len(missing):
                raise InvalidArgumentError(f"the encoder returned shape {encoded.shape} for {len(missing)} texts")
            with self._cache_lock:
                for text, vector in zip(missing, encoded, strict=True):
                    found[text] = vector
                    if self.settings.cache_size:
                        self._cache[text] = vector
                        self._cache.move_to_end(text)
                while len(self._cache) > self.settings.cache_size:
                    self._cache.popitem(last=False)
        with self._serve_lock:
            self.counters.cache_hits += len(texts) - len(missing)
            self.counters.encoded_texts += len(missing)
            self.counters.encode_calls += bool(missing)
        return found

    def _run_batcher(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                return
            assert isinstance(first, _Request)
            batch = [first]
            deadline = first.arrived + self.settings.max_wait_s
            while len(batch) < self.settings.max_batch:
                remaining = deadline - time.monotonic()
                try:
                    # Past the deadline (the batcher was busy), take only what is already queued.
                    item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                assert isinstance(item, _Request)
                batch.append(item)
            self._serve(batch)

    def _serve(self, batch: list[_Request]) -> None:
        try:
            results = self.retrieve_many([request.query for request in batch])
        except BaseException as exc:  # noqa: BLE001 - every caller in the batch gets it; the batcher lives on
            for request in batch:
                request.future.set_exception(exc)
            return
        for request, result in zip(batch, results, strict=True):
            request.future.set_result(result)
