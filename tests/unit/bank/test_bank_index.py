"""The experience index: exact mode against brute force, HNSW recall, mode switches, replaces and removals, files.

Vectors are embedding-like (a rank-32 Gaussian in 384-d plus a little noise, normalised): on uniform random vectors
HNSW recall means nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from usearch.index import Index

from pipeline.bank.index import ExperienceIndex

DIM = 384
BASIS = np.random.default_rng(12345).standard_normal((32, DIM))


def embedding_like(rng: np.random.Generator, count: int) -> np.ndarray:
    """(count, DIM) float32 unit vectors near a 32-dimensional subspace, like sentence embeddings."""
    vectors = rng.standard_normal((count, 32)) @ BASIS + 0.1 * rng.standard_normal((count, DIM))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


class Reference:
    """What the index should hold: id -> (family, vector), in insertion order (a replaced id moves to the end)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, np.ndarray]] = {}
        self._matrices: dict[str, tuple[list[str], np.ndarray]] = {}

    def add(self, experience_id: str, family: str, vector: np.ndarray) -> None:
        self.entries.pop(experience_id, None)
        self.entries[experience_id] = (family, vector)
        self._matrices.clear()

    def remove(self, experience_id: str) -> None:
        del self.entries[experience_id]
        self._matrices.clear()

    def search(self, query: np.ndarray, family: str, k: int) -> list[tuple[str, float]]:
        """Brute force in float64; the stable sort keeps insertion order among ties."""
        if family not in self._matrices:
            ids = [i for i, (f, _) in self.entries.items() if f == family]
            matrix = np.stack([self.entries[i][1] for i in ids]).astype(np.float64) if ids else np.empty((0, DIM))
            self._matrices[family] = ids, matrix / np.linalg.norm(matrix, axis=1, keepdims=True)
        ids, matrix = self._matrices[family]
        if not ids:
            return []
        q = query.astype(np.float64)
        q /= np.linalg.norm(q)
        scores = matrix @ q
        order = np.argsort(-scores, kind="stable")[:k]
        return [(ids[j], float(scores[j])) for j in order]


def assert_same(got: list[tuple[str, float]], expected: list[tuple[str, float]]) -> None:
    assert [i for i, _ in got] == [i for i, _ in expected]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], atol=1e-5)


def fill(index: ExperienceIndex, reference: Reference, family: str, vectors: np.ndarray, prefix: str) -> list[str]:
    ids = [f"{prefix}-{n}" for n in range(len(vectors))]
    for experience_id, vector in zip(ids, vectors, strict=True):
        index.add(experience_id, family, vector)
        reference.add(experience_id, family, vector)
    return ids


def recall_at(index: ExperienceIndex, reference: Reference, queries: np.ndarray, family: str, k: int) -> float:
    got = index.search(queries, [family] * len(queries), k)
    hits = 0
    for query, row in zip(queries, got, strict=True):
        expected = {i for i, _ in reference.search(query, family, k)}
        hits += len(expected & {i for i, _ in row})
    return hits / (k * len(queries))


@pytest.fixture(scope="module")
def hnsw_bank() -> tuple[ExperienceIndex, Reference, np.ndarray]:
    """5,000 'maze' vectors over a threshold of 100 (HNSW) beside 60 'room' vectors (exact), and 200 maze queries."""
    rng = np.random.default_rng(7)
    reference = Reference()
    items = [(f"maze-{n}", "maze", v) for n, v in enumerate(embedding_like(rng, 5000))]
    items += [(f"room-{n}", "room", v) for n, v in enumerate(embedding_like(rng, 60))]
    index = ExperienceIndex.build(items, dim=DIM, exact_threshold=100)
    for experience_id, family, vector in items:
        reference.add(experience_id, family, vector)
    return index, reference, embedding_like(rng, 200)


def test_exact_mode_equals_brute_force_within_each_family() -> None:
    rng = np.random.default_rng(0)
    index, reference = ExperienceIndex(DIM), Reference()
    for family, count in (("room", 50), ("maze", 120), ("sokoban", 7)):
        fill(index, reference, family, embedding_like(rng, count), family)
    queries = embedding_like(rng, 30)
    families = ["room", "maze", "sokoban"] * 10

    got = index.search(queries, families, k=10)

    assert index.mode == {"maze": "exact", "room": "exact", "sokoban": "exact"}
    assert (len(index), index.size("room"), index.size("maze"), index.size("sokoban")) == (177, 50, 120, 7)
    for query, family, row in zip(queries, families, got, strict=True):
        assert all(experience_id.startswith(f"{family}-") for experience_id, _ in row)
        assert_same(row, reference.search(query, family, 10))
    assert [len(row) for row in got[:3]] == [10, 10, 7]


def test_float16_keys_and_queries_are_accepted() -> None:
    rng = np.random.default_rng(1)
    index, reference = ExperienceIndex(DIM), Reference()
    vectors = embedding_like(rng, 40).astype(np.float16)
    fill(index, reference, "room", vectors, "room")
    queries = embedding_like(rng, 5).astype(np.float16)
    for query, row in zip(queries, index.search(queries, ["room"] * 5, k=4), strict=True):
        assert_same(row, reference.search(query, "room", 4))


@pytest.mark.parametrize("threshold", [10_000, 3])
def test_ties_are_broken_by_insertion_order(threshold: int) -> None:
    rng = np.random.default_rng(2)
    same = embedding_like(rng, 1)[0]
    index = ExperienceIndex(DIM, exact_threshold=threshold)
    for experience_id in ("c", "a", "b"):
        index.add(experience_id, "room", same * 2.0)  # scale does not matter to cosine
    index.add("far", "room", -same)

    assert index.mode == {"room": "exact" if threshold > 4 else "hnsw"}
    top = index.search(same[None, :], ["room"], k=2)[0]
    assert [i for i, _ in top] == ["c", "a"]
    everything = index.search(same[None, :], ["room"], k=4)[0]
    assert [i for i, _ in everything] == ["c", "a", "b", "far"]
    np.testing.assert_allclose([s for _, s in everything], [1.0, 1.0, 1.0, -1.0], atol=1e-6)


def test_hnsw_recall_at_10_on_embedding_like_vectors(hnsw_bank, monkeypatch: pytest.MonkeyPatch) -> None:
    index, reference, queries = hnsw_bank
    graph_searches: list[int] = []
    search = Index.search

    def counted(self: Index, vectors: np.ndarray, *args, **kwargs):
        graph_searches.append(len(vectors))
        return search(self, vectors, *args, **kwargs)

    monkeypatch.setattr(Index, "search", counted)

    recall = recall_at(index, reference, queries, "maze", k=10)

    print(f"HNSW recall@10 over 5,000 vectors, 200 queries: {recall:.4f}")
    assert index.mode == {"maze": "hnsw", "room": "exact"}
    assert recall >= 0.95
    assert graph_searches == [200]  # one batch search for all queries of the family
    # Scores are the float32 cosines of the returned pairs, whatever the graph's f16 distances said.
    row = index.search(queries[:1], ["maze"], k=10)[0]
    for experience_id, score in row:
        expected = float(queries[0].astype(np.float64) @ reference.entries[experience_id][1])
        assert score == pytest.approx(expected, abs=1e-5)
    assert [s for _, s in row] == sorted((s for _, s in row), reverse=True)
    # The exact family beside it is still exact.
    room = index.search(queries[:3], ["room"] * 3, k=5)
    for query, got in zip(queries[:3], room, strict=True):
        assert_same(got, reference.search(query, "room", 5))


def test_family_switches_mode_when_its_size_crosses_the_threshold() -> None:
    rng = np.random.default_rng(3)
    index, reference = ExperienceIndex(DIM, exact_threshold=100), Reference()
    vectors = embedding_like(rng, 150)
    queries = embedding_like(rng, 20)
    ids = fill(index, reference, "maze", vectors[:99], "maze")
    fill(index, reference, "room", vectors[99:109], "room")
    assert index.mode == {"maze": "exact", "room": "exact"}

    index.add("maze-99", "maze", vectors[109])
    reference.add("maze-99", "maze", vectors[109])
    assert index.mode == {"maze": "hnsw", "room": "exact"}
    for n, vector in enumerate(vectors[110:], start=100):
        index.add(f"maze-{n}", "maze", vector)
        reference.add(f"maze-{n}", "maze", vector)
    assert index.size("maze") == 140
    for query, row in zip(queries, index.search(queries, ["maze"] * 20, k=5), strict=True):
        assert_same(row, reference.search(query, "maze", 5))

    for experience_id in ids[:41]:
        index.remove(experience_id)
        reference.remove(experience_id)
    assert (index.size("maze"), index.mode["maze"]) == (99, "exact")
    for query, row in zip(queries, index.search(queries, ["maze"] * 20, k=5), strict=True):
        assert_same(row, reference.search(query, "maze", 5))


@pytest.mark.parametrize("threshold", [10_000, 50])
def test_add_of_an_existing_id_replaces_its_vector(threshold: int) -> None:
    rng = np.random.default_rng(4)
    index, reference = ExperienceIndex(DIM, exact_threshold=threshold), Reference()
    vectors = embedding_like(rng, 81)
    fill(index, reference, "room", vectors[:80], "room")
    old, new = vectors[5], vectors[80]

    index.add("room-5", "room", new)

    assert (len(index), index.size("room")) == (80, 80)
    assert index.search(new[None, :], ["room"], k=1)[0][0] == ("room-5", pytest.approx(1.0, abs=1e-6))
    assert all(experience_id != "room-5" or score < 0.99
               for experience_id, score in index.search(old[None, :], ["room"], k=80)[0])
    # Moving an id to another family takes it out of the first one.
    index.add("room-5", "maze", old)
    assert (index.size("room"), index.size("maze")) == (79, 1)
    assert "room-5" not in [i for i, _ in index.search(old[None, :], ["room"], k=80)[0]]
    assert index.search(old[None, :], ["maze"], k=3)[0] == [("room-5", pytest.approx(1.0, abs=1e-6))]


@pytest.mark.parametrize("threshold", [10_000, 100])
def test_removed_ids_are_never_returned(threshold: int) -> None:
    rng = np.random.default_rng(5)
    index, reference = ExperienceIndex(DIM, exact_threshold=threshold), Reference()
    vectors = embedding_like(rng, 400)
    ids = fill(index, reference, "maze", vectors, "maze")
    removed = ids[::3]  # 134 removals: enough to compact the exact matrix
    for experience_id in removed:
        index.remove(experience_id)
        reference.remove(experience_id)

    assert (len(index), index.size("maze")) == (266, 266)
    assert ids[0] not in index and ids[1] in index
    assert index.mode == {"maze": "exact" if threshold > 266 else "hnsw"}
    got = index.search(vectors, ["maze"] * 400, k=10)
    assert not {i for row in got for i, _ in row} & set(removed)
    for query, row in zip(vectors[:50], got[:50], strict=True):
        assert_same(row, reference.search(query, "maze", 10))
    with pytest.raises(KeyError, match="maze-0"):
        index.remove("maze-0")
    with pytest.raises(KeyError, match="never-added"):
        index.remove("never-added")


def test_save_and_load_give_identical_results_in_both_modes(hnsw_bank, tmp_path: Path) -> None:
    index, _, queries = hnsw_bank
    index.save(tmp_path)

    loaded = ExperienceIndex.load(tmp_path)

    assert loaded.mode == {"maze": "hnsw", "room": "exact"}
    assert (len(loaded), loaded.size("maze"), loaded.size("room")) == (5060, 5000, 60)
    for family in ("maze", "room"):
        assert loaded.search(queries, [family] * 200, k=10) == index.search(queries, [family] * 200, k=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "family-0000.npy", "family-0000.usearch", "family-0001.npy", "manifest.json"]


def test_loaded_index_keeps_removals_and_never_reuses_integer_keys(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    vectors = embedding_like(rng, 30)
    for threshold in (10_000, 10):
        index = ExperienceIndex(DIM, exact_threshold=threshold)
        for n, vector in enumerate(vectors[:20]):
            index.add(f"e{n}", "room", vector)
        index.remove("e19")
        index.remove("e3")
        directory = tmp_path / str(threshold)
        directory.mkdir()
        index.save(directory)

        loaded = ExperienceIndex.load(directory)
        assert "e19" not in loaded and "e3" not in loaded and len(loaded) == 18
        assert loaded.search(vectors[:20], ["room"] * 20, k=20) == index.search(vectors[:20], ["room"] * 20, k=20)
        loaded.add("e20", "room", vectors[20])
        loaded.save(directory)
        room = json.loads((directory / "manifest.json").read_text())["families"]["room"]
        assert room["entries"][-2:] == [["e18", 18], ["e20", 20]]
        assert (room["next_key"], room["mode"]) == (21, "exact" if threshold > 19 else "hnsw")


def test_two_builds_from_the_same_items_give_byte_identical_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    items = [(f"maze-{n}", "maze", v) for n, v in enumerate(embedding_like(rng, 700))]
    items += [(f"room-{n}", "room", v) for n, v in enumerate(embedding_like(rng, 200))]
    items = [items[j] for j in rng.permutation(len(items))]  # families interleaved, as in a bank
    first, second = tmp_path / "first", tmp_path / "second"
    for directory in (first, second):
        directory.mkdir()
        built = ExperienceIndex.build(items, dim=DIM, exact_threshold=500)
        assert built.mode == {"maze": "hnsw", "room": "exact"}
        built.save(directory)

    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert "family-0000.usearch" in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    manifest = (first / "manifest.json").read_text()
    assert str(tmp_path) not in manifest


def test_wrong_dimensions_and_zero_vectors_raise_value_error() -> None:
    rng = np.random.default_rng(9)
    index = ExperienceIndex(DIM)
    index.add("a", "room", embedding_like(rng, 1)[0])

    with pytest.raises(ValueError, match=r"383.*384"):
        index.add("b", "room", np.ones(383, dtype=np.float32))
    with pytest.raises(ValueError, match=r"383.*384"):
        index.search(np.ones((2, 383), dtype=np.float32), ["room", "room"], k=1)
    with pytest.raises(ValueError, match=r"385.*384"):
        ExperienceIndex.build([("c", "room", np.ones(385, dtype=np.float32))], dim=DIM)
    with pytest.raises(ValueError, match="zero vector"):
        index.add("b", "room", np.zeros(DIM, dtype=np.float32))
    with pytest.raises(ValueError, match="zero vector"):
        index.search(np.zeros((1, DIM), dtype=np.float32), ["room"], k=1)
    assert "b" not in index and len(index) == 1


def test_k_larger_than_a_family_returns_all_and_empty_families_return_nothing() -> None:
    rng = np.random.default_rng(10)
    index, reference = ExperienceIndex(DIM), Reference()
    fill(index, reference, "room", embedding_like(rng, 4), "room")
    queries = embedding_like(rng, 3)

    got = index.search(queries, ["room", "unknown", "room"], k=50)

    assert [len(row) for row in got] == [4, 0, 4]
    assert_same(got[0], reference.search(queries[0], "room", 50))
    for n in range(4):
        index.remove(f"room-{n}")
    assert index.size("room") == 0 and len(index) == 0
    assert index.search(queries, ["room"] * 3, k=5) == [[], [], []]


def test_build_equals_adding_one_by_one_and_refuses_a_repeated_id(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    items = [(f"maze-{n}", "maze", v) for n, v in enumerate(embedding_like(rng, 300))]
    items += [(f"room-{n}", "room", v.astype(np.float16)) for n, v in enumerate(embedding_like(rng, 40))]
    built = ExperienceIndex.build(items, dim=DIM, exact_threshold=200)
    added = ExperienceIndex(DIM, exact_threshold=200)
    for experience_id, family, key in items:
        added.add(experience_id, family, key)
    for index, directory in ((built, tmp_path / "built"), (added, tmp_path / "added")):
        directory.mkdir()
        index.save(directory)
    # The same normalised float32 rows, keys and manifest (graphs differ: `add` grows one from the threshold on).
    for name in ("family-0000.npy", "family-0001.npy", "manifest.json"):
        assert (tmp_path / "built" / name).read_bytes() == (tmp_path / "added" / name).read_bytes(), name
    with pytest.raises(ValueError, match=r"room-0.*twice"):
        ExperienceIndex.build([*items, items[-40]], dim=DIM)


@pytest.mark.parametrize("graph_dtype", ["i8", "f16"])
def test_graph_dtype_is_saved_and_honoured_on_load(graph_dtype: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    vectors = embedding_like(rng, 400)
    index = ExperienceIndex.build([(f"e{n}", "maze", v) for n, v in enumerate(vectors)], dim=DIM,
                                  exact_threshold=100, graph_dtype=graph_dtype)
    index.save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["hnsw"]["dtype"] == graph_dtype
    if graph_dtype == "f16":  # a file from before the i8 default had no other choice; drop the key to be sure
        del manifest["hnsw"]["dtype"]
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    loaded = ExperienceIndex.load(tmp_path)
    assert loaded.graph_dtype == graph_dtype
    queries = embedding_like(rng, 20)
    assert loaded.search(queries, ["maze"] * 20, 5) == index.search(queries, ["maze"] * 20, 5)
    with pytest.raises(ValueError, match="graph_dtype"):
        ExperienceIndex(DIM, graph_dtype="f64")


def test_graphs_of_several_families_grow_side_by_side_and_stay_byte_identical(tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    maze = [(f"maze-{n}", "maze", v) for n, v in enumerate(embedding_like(rng, 300))]
    room = [(f"room-{n}", "room", v) for n, v in enumerate(embedding_like(rng, 260))]
    together = ExperienceIndex.build([*maze, *room], dim=DIM, exact_threshold=200)  # two graphs, two threads
    assert together.mode == {"maze": "hnsw", "room": "hnsw"}
    (tmp_path / "together").mkdir()
    together.save(tmp_path / "together")
    for family, items in (("maze", maze), ("room", room)):  # each family alone: one graph, no pool
        alone = tmp_path / family
        alone.mkdir()
        ExperienceIndex.build(items, dim=DIM, exact_threshold=200).save(alone)
        assert (alone / "family-0000.usearch").read_bytes() == (
            tmp_path / "together" / f"family-{'0000' if family == 'maze' else '0001'}.usearch").read_bytes()
