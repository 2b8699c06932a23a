"""The experience bank's search index: cosine similarity over the stored key vectors, one index per task family.

    index = ExperienceIndex.build(((e.experience_id, e.task_family, e.key) for e in state.active()), dim=384)
    index.search(queries, ["minihack-maze", "sokoban"], k=5)   # per query [(experience_id, cosine), ...] best first
    index.add("exp-7", "sokoban", key); index.remove("exp-3")  # follow the op log
    index.save(directory); ExperienceIndex.load(directory)     # for bank snapshots

The index is derived state. The bank (`BankState`, rebuilt from `crl.experience-ops`) is the system of record; an
index is rebuilt from it in canonical order whenever in doubt, and its files are only a cache for snapshots.

Search is always within one task family, so every family has its own structure, chosen by its number of active
vectors:
- below `exact_threshold`: exact search with numpy, one `(Q, dim) @ (dim, N)` matmul per family, then argpartition
  and a sort. On this machine that was ~6x faster than USearch's own `exact=True` search, and it is exact.
- at or above it: a USearch HNSW graph (`metric="cos"`, `dtype="i8"` by default). A family switches when its size
  crosses the threshold in either direction, so a family's mode depends only on its size; switching up builds the
  graph from the family's vectors in insertion order. The graph proposes twice the candidates asked for, which are
  re-scored against the float32 vectors, so both modes report the same cosine for the same pair and order ties the
  same way.

Determinism: vectors are normalised to float32 on the way in; ties are broken by the smaller integer key, i.e. by
insertion order; each graph is only ever grown by one thread (`threads=1`), in key order (`build` grows the graphs of
different families side by side, one thread each). Building twice from the same items in the same order, with the
same settings, gives byte-identical files (a USearch graph grown by several threads at once does not).

Graph settings (`BankSettings.hnsw_*`, CRL_BANK__HNSW_*): connectivity and expansion_add shape the graph (build time,
file size, recall); expansion_search is a search-time knob only: USearch does not store it in the graph file, and
`set_expansion_search` changes it in place. The manifest records all three; a manifest without them was written with
the old fixed values (`LEGACY_HNSW`: 16, 128, 64) and loads with those. `load` restores what the files say and
checks the graph files against the manifest; whether that matches the configuration is the caller's decision
(`mismatches`): `LocalBank` rebuilds an index whose structure differs from its settings, and adopts the configured
expansion_search otherwise (docs/bank.md#index).

USearch keys are integers: each family hands out increasing integers on add and never reuses one in the life of the
object (a re-added id gets a new key); the id <-> key maps are saved in the manifest. USearch refuses a duplicate
key, so `add` of an existing id removes it first. Removal does not shrink a graph; rebuilding from the bank does.

Not thread-safe: a replica serialises writes against searches (docs/bank.md: writer lock, reader lock).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import numpy as np
import usearch
from usearch.index import Index

from pipeline.errors import InvalidArgumentError, UnknownItemError

MANIFEST = "manifest.json"
FORMAT = "crl.experience-index"
FORMAT_VERSION = 1
GRAPH_DTYPES = ("i8", "f16", "bf16", "f32")
"""USearch scalar kinds a graph may store its vectors in."""
_COMPACT_MIN_DEAD = 64
"""Dead rows an HNSW family's matrix keeps before it is compacted (and only once they outnumber the live ones)."""
DEFAULT_CONNECTIVITY = 16
DEFAULT_EXPANSION_ADD = 128
DEFAULT_EXPANSION_SEARCH = 128
"""The graph settings of a new index, as `BankSettings`' (expansion_search was 64: recall_at_10 0.87 at 100k
embedding-like vectors, where 128 reaches 0.96; benchmarks/retrieval.py)."""
LEGACY_HNSW = {"connectivity": 16, "expansion_add": 128, "expansion_search": 64}
"""What an index manifest that does not name a graph setting was built and searched with."""


class HnswOptions(TypedDict, total=False):
    """The graph settings `ExperienceIndex.build` passes through to the constructor."""

    connectivity: int
    expansion_add: int
    expansion_search: int
    graph_dtype: str


@dataclass
class _Family:
    """The vectors of one task family. Rows `[0, used)` are in ascending key order.

    In exact mode every row is live (`used == active`): a removal closes its gap at once, so the matmul has the same
    shape, hence the same float32 rounding, as on an index loaded from files. In HNSW mode the matrix only serves
    re-scoring by row, so removed rows stay as tombstones until they outnumber the live ones.
    """

    dim: int
    vectors: np.ndarray = field(init=False)  # (capacity, dim) float32, unit rows
    keys: np.ndarray = field(init=False)  # (capacity,) int64, ascending over [0, used)
    alive: np.ndarray = field(init=False)  # (capacity,) bool
    used: int = 0
    active: int = 0
    next_key: int = 0
    key_of: dict[str, int] = field(default_factory=dict)
    id_of: dict[int, str] = field(default_factory=dict)
    graph: Index | None = None
    """The HNSW graph while the family is at or above the threshold, else None (exact mode)."""

    def __post_init__(self) -> None:
        self.vectors = np.empty((16, self.dim), dtype=np.float32)
        self.keys = np.empty(16, dtype=np.int64)
        self.alive = np.zeros(16, dtype=bool)

    def append(self, experience_id: str, vector: np.ndarray) -> int:
        if self.used == len(self.keys):
            capacity = 2 * len(self.keys)
            self.vectors = np.resize(self.vectors, (capacity, self.dim))
            self.keys = np.resize(self.keys, capacity)
            self.alive = np.concatenate([self.alive, np.zeros(capacity - len(self.alive), dtype=bool)])
        key = self.next_key
        self.next_key += 1
        self.vectors[self.used] = vector
        self.keys[self.used] = key
        self.alive[self.used] = True
        self.used += 1
        self.active += 1
        self.key_of[experience_id] = key
        self.id_of[key] = experience_id
        return key

    def extend(self, experience_ids: Sequence[str], vectors: np.ndarray) -> None:
        """`append` for many rows at once (vectors: (n, dim) unit float32 rows; ids new to this family)."""
        count = len(experience_ids)
        if self.used + count > len(self.keys):
            capacity = max(2 * len(self.keys), self.used + count)
            self.vectors = np.resize(self.vectors, (capacity, self.dim))
            self.keys = np.resize(self.keys, capacity)
            self.alive = np.concatenate([self.alive, np.zeros(capacity - len(self.alive), dtype=bool)])
        keys = range(self.next_key, self.next_key + count)
        rows = slice(self.used, self.used + count)
        self.vectors[rows] = vectors
        self.keys[rows] = keys
        self.alive[rows] = True
        self.key_of.update(zip(experience_ids, keys, strict=True))
        self.id_of.update(zip(keys, experience_ids, strict=True))
        self.next_key += count
        self.used += count
        self.active += count

    def row(self, key: int) -> int:
        return int(np.searchsorted(self.keys[: self.used], key))

    def kill(self, experience_id: str) -> int:
        key = self.key_of.pop(experience_id)
        del self.id_of[key]
        self.alive[self.row(key)] = False
        self.active -= 1
        dead = self.used - self.active
        if self.graph is None or dead > max(self.active, _COMPACT_MIN_DEAD):
            self.compact()
        return key

    def compact(self) -> None:
        """Drop dead rows, keeping key order (row positions never decide a result; keys do)."""
        if self.used == self.active:
            return
        live = np.flatnonzero(self.alive[: self.used])
        self.vectors[: len(live)] = self.vectors[live]
        self.keys[: len(live)] = self.keys[live]
        self.alive[: len(live)] = True
        self.alive[len(live):] = False
        self.used = len(live)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """The active (keys, vectors) in key order."""
        if self.used == self.active:
            return self.keys[: self.used], self.vectors[: self.used]
        live = np.flatnonzero(self.alive[: self.used])
        return self.keys[live], self.vectors[live]


def _unit_rows(vectors: np.ndarray, dim: int, what: str) -> np.ndarray:
    """`vectors` (N, dim) as float32 unit rows; a wrong width, a non-finite value or a zero row is a ValueError."""
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        width = vectors.shape[-1] if vectors.ndim else 0
        raise InvalidArgumentError(f"{what} has {width} dimensions (shape {vectors.shape}), but this index holds "
                                   f"{dim}-d vectors")
    if not np.issubdtype(vectors.dtype, np.floating):
        raise InvalidArgumentError(f"{what} must be floating point, not {vectors.dtype}")
    wide = vectors.astype(np.float64)
    if not np.isfinite(wide).all():
        raise InvalidArgumentError(f"{what} holds NaN or infinite values")
    norms = np.linalg.norm(wide, axis=1, keepdims=True)
    if (norms == 0).any():
        raise InvalidArgumentError(f"{what} holds a zero vector, which has no cosine similarity")
    return np.ascontiguousarray(wide / norms, dtype=np.float32)


def _top_k(scores: np.ndarray, keys: np.ndarray, k: int) -> np.ndarray:
    """Per row the columns of the `k` best scores, best first, ties to the smaller key.

    scores (Q, N), N >= k; keys (N,) ascending. Returns (Q, k).
    """
    rows, columns = scores.shape
    if k < columns:
        chosen = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # (Q, k), unordered
        kth = np.take_along_axis(scores, chosen, axis=1).min(axis=1)  # (Q,)
        # argpartition picks arbitrarily among columns tied with the k-th score: redo those rows by key.
        for row in np.flatnonzero((scores >= kth[:, None]).sum(axis=1) > k):
            better = np.flatnonzero(scores[row] > kth[row])
            tied = np.flatnonzero(scores[row] == kth[row])[: k - len(better)]
            chosen[row] = np.concatenate([better, tied])
    else:
        chosen = np.broadcast_to(np.arange(columns), (rows, columns)).copy()
    chosen_scores = np.take_along_axis(scores, chosen, axis=1)
    order = np.lexsort((keys[chosen], -chosen_scores), axis=-1)
    return np.take_along_axis(chosen, order, axis=1)


class ExperienceIndex:
    """Per-family cosine search over experience key vectors (exact below `exact_threshold`, HNSW at or above)."""

    def __init__(self, dim: int, exact_threshold: int = 10_000, *, connectivity: int = DEFAULT_CONNECTIVITY,
                 expansion_add: int = DEFAULT_EXPANSION_ADD, expansion_search: int = DEFAULT_EXPANSION_SEARCH,
                 graph_dtype: str = "i8") -> None:
        """
        dim: length of every key vector (384 for all-MiniLM-L6-v2).
        exact_threshold: a family with this many active vectors or more is searched through HNSW, else exactly.
        connectivity: HNSW graph degree (USearch's M); more is better recall, bigger files, slower adds.
        expansion_add: candidate list size while inserting (efConstruction); 128 -> 32 traded recall for ~3x adds.
        expansion_search: candidate list size while searching (ef); USearch raises it to the candidates asked for
            (twice k) when that is larger. Not part of the graph: `set_expansion_search` changes it in place.
        The defaults are `BankSettings`' (CRL_BANK__HNSW_*); benchmarks/retrieval.py measures them at 100k vectors.
        graph_dtype: how the graph stores vectors. "i8" (the default) made single-query searches ~30% faster and adds
            ~50% faster than "f16" at 100k vectors on the 2-core machine, at the same recall: the graph only
            proposes candidates, which are re-scored against the float32 vectors. Files record it; `load` honours it.
        """
        for name, value, least in (("dim", dim, 1), ("exact_threshold", exact_threshold, 1),
                                   ("connectivity", connectivity, 2), ("expansion_add", expansion_add, 1),
                                   ("expansion_search", expansion_search, 1)):
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < least:
                raise InvalidArgumentError(f"{name} must be an integer >= {least}, got {value!r}")
        self.dim = int(dim)
        self.exact_threshold = int(exact_threshold)
        self.connectivity = int(connectivity)
        self.expansion_add = int(expansion_add)
        self.expansion_search = int(expansion_search)
        if graph_dtype not in GRAPH_DTYPES:
            raise InvalidArgumentError(f"graph_dtype must be one of {', '.join(GRAPH_DTYPES)}, got {graph_dtype!r}")
        self.graph_dtype = graph_dtype
        self._families: dict[str, _Family] = {}
        self._family_of: dict[str, str] = {}

    @classmethod
    def build(cls, items: Iterable[tuple[str, str, np.ndarray]], dim: int, exact_threshold: int = 10_000,
              **hnsw: Unpack[HnswOptions]) -> ExperienceIndex:
        """An index of `items` (experience_id, task_family, key), added in the given (canonical) order.

        Each family's graph, if it needs one, is built once at the end from its vectors in that order.
        """
        index = cls(dim, exact_threshold, **hnsw)
        ids: dict[str, list[str]] = {}
        keys: dict[str, list[np.ndarray]] = {}
        for experience_id, task_family, key in items:
            if not isinstance(experience_id, str) or not isinstance(task_family, str):
                raise InvalidArgumentError("experience_id and task_family must be str")
            if experience_id in index._family_of:
                raise InvalidArgumentError(f"experience {experience_id!r} is given twice")
            index._family_of[experience_id] = task_family
            ids.setdefault(task_family, []).append(experience_id)
            keys.setdefault(task_family, []).append(np.asarray(key))
        for task_family in sorted(ids):
            # One normalisation per family: row by row it computes exactly what `add` computes for one vector.
            shapes = {vector.shape for vector in keys[task_family]}
            if len(shapes) != 1 or len(next(iter(shapes))) != 1:
                raise InvalidArgumentError(f"keys of {task_family!r} must all be ({dim},) vectors, got shapes "
                                           f"{sorted(shapes)}")
            vectors = _unit_rows(np.stack(keys[task_family]), index.dim, f"keys of {task_family!r}")
            family = index._families[task_family] = _Family(index.dim)
            family.extend(ids[task_family], vectors)
        index._grow_graphs([family for family in index._families.values() if family.active >= index.exact_threshold])
        return index

    # ----------------------------------------------------------------------------------------------- writes

    def add(self, experience_id: str, task_family: str, key: np.ndarray) -> None:
        """Index `key` for `experience_id` in `task_family`; an id already indexed is replaced (it gets a new key)."""
        for family in self._put(experience_id, task_family, key):
            self._settle(family)

    def remove(self, experience_id: str) -> None:
        """Forget `experience_id`; KeyError if it is not indexed."""
        if experience_id not in self._family_of:
            raise UnknownItemError(f"experience {experience_id!r} is not in the index")
        self._settle(self._detach(experience_id))

    def _put(self, experience_id: str, task_family: str, key: np.ndarray) -> list[str]:
        """Store the vector without settling modes (so a replace at the threshold does not rebuild a graph)."""
        if not isinstance(experience_id, str) or not isinstance(task_family, str):
            raise InvalidArgumentError("experience_id and task_family must be str")
        key = np.asarray(key)
        if key.ndim != 1:
            raise InvalidArgumentError(f"key of {experience_id!r} must be one ({self.dim},) vector, got shape "
                                       f"{key.shape}")
        vector = _unit_rows(key[None, :], self.dim, f"key of {experience_id!r}")
        touched = []
        if experience_id in self._family_of:
            touched.append(self._detach(experience_id))
        family = self._families.get(task_family)
        if family is None:
            family = self._families[task_family] = _Family(self.dim)
        new_key = family.append(experience_id, vector[0])
        self._family_of[experience_id] = task_family
        if family.graph is not None:
            family.graph.add(new_key, vector[0], threads=1)
        touched.append(task_family)
        return touched

    def _detach(self, experience_id: str) -> str:
        task_family = self._family_of.pop(experience_id)
        family = self._families[task_family]
        key = family.kill(experience_id)
        if family.graph is not None:
            family.graph.remove(key)
        return task_family

    def _settle(self, task_family: str) -> None:
        """Put the family in the mode its size calls for."""
        family = self._families[task_family]
        if family.active >= self.exact_threshold and family.graph is None:
            self._grow_graphs([family])
        elif family.active < self.exact_threshold and family.graph is not None:
            family.graph = None
            family.compact()

    def _grow_graphs(self, families: list[_Family]) -> None:
        """Give each of `families` an HNSW graph of its live vectors, added in key order on one thread, so the graph is
        deterministic. Several families grow at once, one thread each: USearch releases the GIL while adding, and on
        the 2-core machine two 8,000-vector graphs took 1.7 s together where they took 3.8 s one after the other."""

        def grow(family: _Family) -> None:
            keys, vectors = family.live()
            graph = self._new_graph()
            graph.add(keys.astype(np.uint64), vectors, threads=1)
            family.graph = graph

        workers = min(len(families), os.cpu_count() or 1)
        if workers <= 1:
            for family in families:
                grow(family)
            return
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="index-build") as pool:
            list(pool.map(grow, families))  # list(): re-raises the first failure

    def _new_graph(self) -> Index:
        return Index(ndim=self.dim, metric="cos", dtype=self.graph_dtype, connectivity=self.connectivity,
                     expansion_add=self.expansion_add, expansion_search=self.expansion_search)

    # ----------------------------------------------------------------------------------------------- reads

    def search(self, queries: np.ndarray, task_families: Sequence[str], k: int) -> list[list[tuple[str, float]]]:
        """Per query, up to `k` (experience_id, cosine similarity) of its family, best first.

        queries (Q, dim) float32/float16; task_families[i] is query i's family. A family without experiences gives [].
        All queries of a family go through one matmul (exact) or one batch search (HNSW).
        """
        queries = np.asarray(queries)
        if queries.ndim != 2:
            raise InvalidArgumentError(f"queries must be a (Q, {self.dim}) matrix, got shape {queries.shape}")
        if len(task_families) != queries.shape[0]:
            raise InvalidArgumentError(f"{queries.shape[0]} queries but {len(task_families)} task families")
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise InvalidArgumentError(f"k must be an integer >= 1, got {k!r}")
        if queries.shape[0] == 0:
            return []
        unit = _unit_rows(queries, self.dim, "queries")
        results: list[list[tuple[str, float]]] = [[] for _ in range(len(task_families))]
        by_family: dict[str, list[int]] = {}
        for position, task_family in enumerate(task_families):
            by_family.setdefault(task_family, []).append(position)
        for task_family, positions in by_family.items():
            family = self._families.get(task_family)
            if family is None or family.active == 0:
                continue
            count = min(int(k), family.active)
            batch = unit[positions]  # (q, dim)
            if family.graph is None:
                keys, scores = self._search_exact(family, batch, count)
            else:
                keys, scores = self._search_graph(family, batch, count)
            for position, row_keys, row_scores in zip(positions, keys, scores, strict=True):
                results[position] = [(family.id_of[int(key)], float(score))
                                     for key, score in zip(row_keys, row_scores, strict=True) if key >= 0]
        return results

    @staticmethod
    def _search_exact(family: _Family, batch: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(q, count) keys and cosines, best first."""
        keys = family.keys[: family.used]
        scores = batch @ family.vectors[: family.used].T  # (q, active): exact mode keeps no dead rows
        best = _top_k(scores, keys, count)  # (q, count)
        return keys[best], np.take_along_axis(scores, best, axis=1)

    @staticmethod
    def _search_graph(family: _Family, batch: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(q, count) keys and cosines re-scored in float32, best first; key -1 where the graph found fewer."""
        # Twice the candidates, re-scored: the i8 graph's distances are coarse near the k-th place.
        assert family.graph is not None  # `search` sends only families in graph mode here
        wanted = min(2 * count, family.active)
        matches = family.graph.search(batch, wanted, threads=1)  # one thread: no pool start-up for a few queries
        found = np.asarray(matches.keys, dtype=np.int64).reshape(len(batch), -1)  # (q, count)
        counts = np.asarray(getattr(matches, "counts", [found.shape[1]])).reshape(-1)  # (q,)
        valid = np.arange(found.shape[1])[None, :] < counts[:, None]  # (q, count)
        found = np.where(valid, found, family.keys[0])
        rows = np.searchsorted(family.keys[: family.used], found)  # (q, count)
        scores = np.einsum("qd,qcd->qc", batch, family.vectors[rows])  # (q, count)
        scores[~valid] = -np.inf
        order = np.lexsort((found, -scores), axis=-1)  # (q, count)
        found = np.where(valid, found, -1)
        picked = np.arange(len(batch))[:, None], order[:, :count]
        return found[picked], scores[picked]

    def __len__(self) -> int:
        return len(self._family_of)

    def size(self, task_family: str) -> int:
        """Active experiences of `task_family` (0 for a family never seen)."""
        family = self._families.get(task_family)
        return 0 if family is None else family.active

    def __contains__(self, experience_id: object) -> bool:
        return experience_id in self._family_of

    @property
    def mode(self) -> dict[str, str]:
        """Family -> "exact" | "hnsw", for every family ever added to (an emptied family stays, as "exact")."""
        return {name: "exact" if family.graph is None else "hnsw" for name, family in sorted(self._families.items())}

    # ----------------------------------------------------------------------------------------------- settings

    @property
    def settings(self) -> dict[str, Any]:
        """exact_threshold and the graph settings, as `build` takes them (graph_dtype included)."""
        return {"exact_threshold": self.exact_threshold, "connectivity": self.connectivity,
                "expansion_add": self.expansion_add, "expansion_search": self.expansion_search,
                "graph_dtype": self.graph_dtype}

    def mismatches(self, exact_threshold: int, **hnsw: Unpack[HnswOptions]) -> dict[str, tuple[Any, Any]]:
        """The settings in which this index is not what `build(items, dim, exact_threshold, **hnsw)` would make:
        name -> (this index's value, the given one); {} when it is.

        Only what shapes the structure counts: exact_threshold (which families have a graph), connectivity and
        expansion_add (how each graph was grown) and graph_dtype when given. expansion_search is not in the graph
        (USearch files are byte-identical whatever it was), so it never counts: `set_expansion_search` adopts it.
        """
        wanted: dict[str, Any] = {"exact_threshold": exact_threshold, "connectivity": hnsw.get("connectivity"),
                                  "expansion_add": hnsw.get("expansion_add"), "graph_dtype": hnsw.get("graph_dtype")}
        current = self.settings
        return {name: (current[name], value) for name, value in wanted.items()
                if value is not None and value != current[name]}

    def set_expansion_search(self, expansion_search: int) -> None:
        """Search every graph, present and future, with this candidate list size (no rebuild: it is a search knob)."""
        if (not isinstance(expansion_search, int | np.integer) or isinstance(expansion_search, bool)
                or expansion_search < 1):
            raise InvalidArgumentError(f"expansion_search must be an integer >= 1, got {expansion_search!r}")
        self.expansion_search = int(expansion_search)
        for family in self._families.values():
            if family.graph is not None:
                # USearch declares this setter after another property's, which mypy reads as no setter at all.
                family.graph.expansion_search = self.expansion_search  # type: ignore[misc]

    # ----------------------------------------------------------------------------------------------- files

    def save(self, directory: Path) -> None:
        """Write the index into the existing `directory`: per family `family-NNNN.npy` (its unit float32 vectors in
        key order) and, in HNSW mode, `family-NNNN.usearch`; then `manifest.json`. No clocks, no absolute paths."""
        directory = Path(directory)
        if not directory.is_dir():
            raise InvalidArgumentError(f"{directory} is not an existing directory")
        families: dict[str, Any] = {}
        for number, (name, family) in enumerate(sorted(self._families.items())):
            stem = f"family-{number:04d}"
            keys, vectors = family.live()
            np.save(directory / f"{stem}.npy", np.ascontiguousarray(vectors, dtype="<f4"), allow_pickle=False)
            graph_file = None
            if family.graph is not None:
                graph_file = f"{stem}.usearch"
                family.graph.save(str(directory / graph_file))
            families[name] = {
                "mode": "exact" if family.graph is None else "hnsw",
                "vectors": f"{stem}.npy",
                "graph": graph_file,
                "next_key": family.next_key,
                "entries": [[family.id_of[int(key)], int(key)] for key in keys],
            }
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "usearch_version": usearch.__version__,
            "dim": self.dim,
            "exact_threshold": self.exact_threshold,
            "hnsw": {"metric": "cos", "dtype": self.graph_dtype, "connectivity": self.connectivity,
                     "expansion_add": self.expansion_add, "expansion_search": self.expansion_search},
            "families": families,
        }
        (directory / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, directory: Path) -> ExperienceIndex:
        """The index saved in `directory`, with the settings its manifest names; ValueError if its files disagree with
        the manifest. It is not checked against any configuration here: see `mismatches` (a `LocalBank` given a
        loaded index rebuilds it when they differ)."""
        directory = Path(directory)
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise InvalidArgumentError(f"{directory} holds no {FORMAT} v{FORMAT_VERSION} manifest")
        hnsw = manifest.get("hnsw", {})
        # A manifest that does not name a setting was written with the old fixed values (LEGACY_HNSW), and files
        # written before i8 hold f16 graphs.
        index = cls(manifest["dim"], manifest["exact_threshold"],
                    **{name: hnsw.get(name, value) for name, value in LEGACY_HNSW.items()},
                    graph_dtype=hnsw.get("dtype", "f16"))
        for name, saved in manifest["families"].items():
            vectors = np.load(directory / saved["vectors"], allow_pickle=False)
            entries = saved["entries"]
            if vectors.shape != (len(entries), index.dim) or vectors.dtype != np.float32:
                raise InvalidArgumentError(f"{directory / saved['vectors']}: {vectors.dtype} {vectors.shape}, expected "
                                 f"float32 ({len(entries)}, {index.dim})")
            family = index._families[name] = _Family(index.dim)
            for (experience_id, key), vector in zip(entries, vectors, strict=True):
                if key < family.next_key or experience_id in index._family_of:
                    raise InvalidArgumentError(f"{directory / MANIFEST}: entry {experience_id!r} -> {key} is out of "
                                               "order or repeated")
                family.next_key = key  # keys were handed out ascending; gaps are removed experiences
                family.append(experience_id, vector)
                index._family_of[experience_id] = name
            family.next_key = saved["next_key"]
            if saved["graph"] is not None:
                graph = index._new_graph()
                graph.load(str(directory / saved["graph"]))
                if len(graph) != family.active:
                    raise InvalidArgumentError(f"{directory / saved['graph']} holds {len(graph)} vectors, the manifest "
                                     f"{family.active}")
                if graph.connectivity != index.connectivity:  # the file's header wins over the constructor's value
                    raise InvalidArgumentError(f"{directory / saved['graph']} was built with connectivity "
                                               f"{graph.connectivity}, the manifest says {index.connectivity}")
                family.graph = graph
        return index
