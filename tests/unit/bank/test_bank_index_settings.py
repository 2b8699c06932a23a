"""The HNSW graph settings (CRL_BANK__HNSW_*): they reach USearch, are saved and honoured on load, an old manifest
without them loads with the values it was built with, a snapshot index built with other settings is rebuilt, and a
bad value is refused."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from pipeline.bank.index import LEGACY_HNSW, ExperienceIndex
from pipeline.bank.replica import LocalBank
from pipeline.bank.settings import BankSettings
from pipeline.bank.snapshots import read_index, read_snapshot, write_snapshot
from pipeline.bank.state import BankState, Experience
from pipeline.settings import Settings

DIM = 384
BASIS = np.random.default_rng(12345).standard_normal((32, DIM))


def embedding_like(rng: np.random.Generator, count: int) -> np.ndarray:
    vectors = rng.standard_normal((count, 32)) @ BASIS + 0.1 * rng.standard_normal((count, DIM))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def items(count: int, seed: int = 0) -> list[tuple[str, str, np.ndarray]]:
    return [(f"e{n:04d}", "maze", v) for n, v in enumerate(embedding_like(np.random.default_rng(seed), count))]


def graph_settings(index: ExperienceIndex, family: str = "maze") -> tuple[int, int, int]:
    """What the family's USearch graph itself reports."""
    graph = index._families[family].graph
    assert graph is not None, "the family is in exact mode"
    return graph.connectivity, graph.expansion_add, graph.expansion_search


def state_of(count: int) -> BankState:
    state = BankState()
    state.key_model, state.key_dim = "all-MiniLM-L6-v2", DIM
    for experience_id, family, key in items(count):
        frozen = key.astype("<f2")
        frozen.setflags(write=False)
        state.experiences[experience_id] = Experience(
            experience_id=experience_id, task_family=family, text=f"tip {experience_id}", key=frozen, version=1,
            status="active", generation_id="gen", extractor_version=0, source_trajectory_ids=("traj",))
    state.next_offset = state.applied = count
    return state


def test_defaults_of_the_settings_and_of_the_index_agree() -> None:
    parameters = inspect.signature(ExperienceIndex.__init__).parameters
    options = BankSettings().hnsw_options()
    assert options == {name: parameters[name].default for name in ("connectivity", "expansion_add",
                                                                   "expansion_search")}
    assert options == LocalBank().hnsw


def test_graph_settings_reach_usearch_and_survive_save_and_load(tmp_path: Path) -> None:
    index = ExperienceIndex.build(items(300), dim=DIM, exact_threshold=100, connectivity=8, expansion_add=40,
                                  expansion_search=90)
    assert graph_settings(index) == (8, 40, 90)
    index.save(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["hnsw"] == {
        "metric": "cos", "dtype": "i8", "connectivity": 8, "expansion_add": 40, "expansion_search": 90}

    loaded = ExperienceIndex.load(tmp_path)

    assert graph_settings(loaded) == (8, 40, 90)
    assert (loaded.connectivity, loaded.expansion_add, loaded.expansion_search) == (8, 40, 90)
    queries = embedding_like(np.random.default_rng(1), 20)
    assert loaded.search(queries, ["maze"] * 20, 10) == index.search(queries, ["maze"] * 20, 10)


def test_environment_settings_reach_the_bank_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRL_BANK__HNSW_CONNECTIVITY", "12")
    monkeypatch.setenv("CRL_BANK__HNSW_EXPANSION_ADD", "48")
    monkeypatch.setenv("CRL_BANK__HNSW_EXPANSION_SEARCH", "200")
    monkeypatch.setenv("CRL_BANK__EXACT_THRESHOLD", "50")
    settings = Settings().bank

    bank = LocalBank(state_of(120), settings.exact_threshold, hnsw=settings.hnsw_options())

    assert bank.index is not None and bank.index.mode == {"maze": "hnsw"}
    assert graph_settings(bank.index) == (12, 48, 200)


def test_a_snapshot_records_the_settings_it_was_built_with(tmp_path: Path) -> None:
    state = state_of(150)
    path, _manifest = write_snapshot(tmp_path, state, "log-a", exact_threshold=100,
                                     hnsw={"connectivity": 10, "expansion_add": 30, "expansion_search": 70})
    index = read_index(path)
    assert index is not None and graph_settings(index) == (10, 30, 70)


def test_an_old_manifest_without_graph_settings_loads_with_the_old_values(tmp_path: Path) -> None:
    # Built as before the settings existed (16, 128; searched with 64), then the manifest stripped of them.
    ExperienceIndex.build(items(300), dim=DIM, exact_threshold=100, connectivity=16, expansion_add=128,
                          expansion_search=64).save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["hnsw"] = {"metric": "cos", "dtype": "i8"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))

    loaded = ExperienceIndex.load(tmp_path)

    assert graph_settings(loaded) == (16, 128, 64)  # not today's default expansion_search
    assert LEGACY_HNSW == {"connectivity": 16, "expansion_add": 128, "expansion_search": 64}
    # A bank configured with the defaults keeps that graph (same connectivity and expansion_add) and searches it
    # with its own expansion_search: no rebuild.
    state = state_of(300)
    bank = LocalBank(state, 100, index=loaded, hnsw=BankSettings().hnsw_options())
    assert bank.index is loaded
    assert graph_settings(loaded) == (16, 128, BankSettings().hnsw_expansion_search)


def test_a_snapshot_index_built_with_other_settings_is_rebuilt(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    state = state_of(300)
    path, _manifest = write_snapshot(tmp_path / "snapshots", state, "log-a", exact_threshold=100,
                                     hnsw={"connectivity": 8, "expansion_add": 40, "expansion_search": 90})
    restored, _ = read_snapshot(path)
    saved = read_index(path)
    assert saved is not None and graph_settings(saved) == (8, 40, 90)
    configured = BankSettings(hnsw_connectivity=16, hnsw_expansion_add=64, hnsw_expansion_search=100)

    with caplog.at_level(logging.WARNING, logger="pipeline.bank.replica"):
        bank = LocalBank(restored, 100, index=saved, hnsw=configured.hnsw_options())

    assert bank.index is not saved and bank.index is not None
    assert graph_settings(bank.index) == (16, 64, 100)
    assert "connectivity=8" in caplog.text and "connectivity=16" in caplog.text
    # The rebuild is the index a fresh build with the configured settings gives, byte for byte.
    fresh = ExperienceIndex.build(((e.experience_id, e.task_family, e.key) for e in restored.active()), dim=DIM,
                                  exact_threshold=100, **configured.hnsw_options())
    for name, index in (("rebuilt", bank.index), ("fresh", fresh)):
        (tmp_path / name).mkdir()
        index.save(tmp_path / name)
    for file in sorted(p.name for p in (tmp_path / "fresh").iterdir()):
        assert (tmp_path / "rebuilt" / file).read_bytes() == (tmp_path / "fresh" / file).read_bytes(), file
    # Another exact_threshold is another structure too.
    other = LocalBank(restored, 1000, index=read_index(path), hnsw={"connectivity": 8, "expansion_add": 40})
    assert other.index is not None and other.index.mode == {"maze": "exact"}


def test_expansion_search_is_not_in_the_graph_file(tmp_path: Path) -> None:
    for expansion_search in (32, 256):
        (tmp_path / str(expansion_search)).mkdir()
        ExperienceIndex.build(items(300), dim=DIM, exact_threshold=100,
                              expansion_search=expansion_search).save(tmp_path / str(expansion_search))
    graph = "family-0000.usearch"
    assert (tmp_path / "32" / graph).read_bytes() == (tmp_path / "256" / graph).read_bytes()
    index = ExperienceIndex.load(tmp_path / "32")
    index.set_expansion_search(256)
    assert graph_settings(index)[2] == 256 and index.expansion_search == 256


def test_a_manifest_that_disagrees_with_its_graph_file_is_refused(tmp_path: Path) -> None:
    ExperienceIndex.build(items(300), dim=DIM, exact_threshold=100, connectivity=8).save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["hnsw"]["connectivity"] = 16
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="connectivity 8"):
        ExperienceIndex.load(tmp_path)


@pytest.mark.parametrize(("field", "value"), [
    ("hnsw_connectivity", 1), ("hnsw_connectivity", 0), ("hnsw_connectivity", 1000), ("hnsw_expansion_add", 0),
    ("hnsw_expansion_search", 0), ("hnsw_expansion_search", -5), ("hnsw_expansion_search", "many"),
    ("hnsw_expansion_search", 12.5),
])
def test_a_bad_graph_setting_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        BankSettings(**{field: value})


def test_the_index_refuses_bad_graph_settings_too() -> None:
    with pytest.raises(ValueError, match="connectivity"):
        ExperienceIndex(DIM, connectivity=1)
    with pytest.raises(ValueError, match="expansion_add"):
        ExperienceIndex(DIM, expansion_add=0)
    index = ExperienceIndex(DIM)
    with pytest.raises(ValueError, match="expansion_search"):
        index.set_expansion_search(0)
    assert index.expansion_search == BankSettings().hnsw_expansion_search
