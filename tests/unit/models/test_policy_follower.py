"""Loading a published policy: the checkpoint's sha256 must match the event before a rollout worker uses it, and a
refused version is kept out while the worker goes on with the one it has."""

from __future__ import annotations

import pytest

from pipeline.errors import CheckpointError
from pipeline.models import TinyModelSettings, build_tiny, save_checkpoint
from pipeline.models.checkpoints import checkpoint_path
from pipeline.models.policy_follower import PolicyFollower, load_published
from pipeline.models.settings import GenerationSettings
from pipeline.runtime.log import MemoryLog
from schemas.base import Producer
from schemas.training import PolicyPublished

TINY = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                         vocab_size=300, corpus_episodes=2)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> PolicyPublished:
    directory = tmp_path_factory.mktemp("ckpt") / "v000001"
    info = save_checkpoint(directory, build_tiny(TINY))
    return PolicyPublished(run_id="r", producer=Producer(worker="actor_trainer", instance="t"), role="actor",
                           version=1, step=3, checkpoint_uri=directory.resolve().as_uri(),
                           sha256=info.manifest_sha256)


def test_a_published_policy_loads_after_its_sha256_checks_out(published):
    policy = load_published(published, "transformers", micro_batch_size=48)
    assert policy.micro_batch_size == 48
    assert checkpoint_path(published.checkpoint_uri).name == "v000001"


def test_a_wrong_sha256_is_refused(published):
    forged = published.model_copy(update={"sha256": "0" * 64})
    with pytest.raises(CheckpointError, match="expected 0000"):
        load_published(forged, "transformers")


def test_a_tampered_checkpoint_is_refused(published, tmp_path):
    import shutil

    copy = tmp_path / "v000001"
    shutil.copytree(checkpoint_path(published.checkpoint_uri), copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("32", "33", 1))
    tampered = published.model_copy(update={"checkpoint_uri": copy.as_uri()})
    with pytest.raises(CheckpointError):
        load_published(tampered, "transformers")


def test_unknown_backend_names_the_valid_ones(published):
    with pytest.raises(ValueError, match="valid values: transformers, vllm"):
        load_published(published, "onnx")


def test_the_rollout_worker_keeps_its_version_when_a_new_one_is_refused(published):
    from pipeline.actor.episodes import EpisodePlayer
    from workers.rollout import Rollout

    rollout = Rollout.__new__(Rollout)
    rollout.generation = GenerationSettings(micro_batch=8)
    rollout.seed_base = 0
    rollout.follower = PolicyFollower(MemoryLog().follow, "actor")  # never started
    rollout.player = EpisodePlayer.__new__(EpisodePlayer)
    rollout.player.policy, rollout.player.version = "the policy it had", 0
    rollout._load(published.model_copy(update={"sha256": "f" * 64}))
    assert rollout.player.version == 0 and rollout.player.policy == "the policy it had"
    assert rollout.follower.refused == {1}
    rollout._load(published)
    assert rollout.player.version == 1 and rollout.player.policy != "the policy it had"


# -- a new full version goes into the model held, in place --------------------------------------------------------


def _event(directory, version: int, sha256: str) -> PolicyPublished:
    return PolicyPublished(run_id="r", producer=Producer(worker="actor_trainer", instance="t"), role="actor",
                           version=version, step=version, checkpoint_uri=directory.resolve().as_uri(), sha256=sha256)


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory) -> tuple[PolicyPublished, PolicyPublished]:
    """Versions 1 and 2 of one policy: the trainer's update is stood in for by a deterministic change of every
    parameter; both are written with an optimiser state, as the trainer writes them."""
    import torch

    root = tmp_path_factory.mktemp("versions")
    policy = build_tiny(TINY)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    events = []
    for version in (1, 2):
        for parameter in policy.model.parameters():
            parameter.grad = torch.full_like(parameter, 0.5)
        optimizer.step()
        info = save_checkpoint(root / f"v{version:06d}", policy, optimizer=optimizer)
        events.append(_event(info.path, version, info.manifest_sha256))
    return events[0], events[1]


def _pointers(policy) -> dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in policy.model.state_dict().items()}


def test_a_full_version_is_copied_into_the_model_held(two_versions):
    import torch

    from pipeline.models.checkpoints import load_checkpoint, weight_hash

    v1, v2 = two_versions
    held = load_published(v1, "transformers")
    parameters, pointers, before = list(held.model.parameters()), _pointers(held), weight_hash(held.model)
    picked_up = load_published(v2, "transformers", current=held)
    fresh = load_checkpoint(checkpoint_path(v2.checkpoint_uri), v2.sha256).policy
    assert picked_up is held  # no model was built
    assert all(a is b for a, b in zip(parameters, held.model.parameters(), strict=True))
    assert _pointers(held) == pointers
    assert weight_hash(held.model) == weight_hash(fresh.model) != before
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(held.model.state_dict()[name], tensor), name
    assert held.model.lm_head.weight is held.model.model.embed_tokens.weight  # still tied
    assert held.base_checkpoint == v2.sha256


def test_a_tampered_full_version_leaves_the_model_held_as_it_was(two_versions, tmp_path):
    import json
    import shutil

    from pipeline.models.checkpoints import weight_hash
    from pipeline.runtime.durable import file_sha256

    v1, v2 = two_versions
    copy = tmp_path / "v000002"
    shutil.copytree(checkpoint_path(v2.checkpoint_uri), copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    held = load_published(v1, "transformers")
    before, pointers = weight_hash(held.model), _pointers(held)
    recorded = json.loads((copy / "manifest.json").read_text())["files"]["model.safetensors"]
    with pytest.raises(CheckpointError, match=rf"model.safetensors: sha256 {file_sha256(weights)}, manifest says "
                                              rf"{recorded}"):
        load_published(v2.model_copy(update={"checkpoint_uri": copy.as_uri()}), "transformers",
                       current=held)
    # The manifest made to agree with the flipped file: only the weight hash can tell, before anything is copied.
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = file_sha256(weights)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    forged = v2.model_copy(update={"checkpoint_uri": copy.as_uri(), "sha256": file_sha256(copy / "manifest.json")})
    with pytest.raises(CheckpointError, match=rf"weight hash [0-9a-f]{{64}} after loading, manifest says "
                                              rf"{manifest['weight_hash']}"):
        load_published(forged, "transformers", current=held)
    assert weight_hash(held.model) == before and _pointers(held) == pointers


def test_a_bfloat16_copy_is_refreshed_in_place(two_versions):
    import torch

    from pipeline.models.checkpoints import load_checkpoint

    v1, v2 = two_versions
    held = load_published(v1, "transformers", precision="bfloat16")
    source, pointers = held.full_precision, _pointers(held)
    picked_up = load_published(v2, "transformers", current=held, precision="bfloat16")
    assert picked_up is held and held.full_precision is source and _pointers(held) == pointers
    fresh = load_checkpoint(checkpoint_path(v2.checkpoint_uri), v2.sha256).policy.for_generation("bfloat16")
    for name, tensor in fresh.model.state_dict().items():
        assert held.model.state_dict()[name].dtype == torch.bfloat16 and torch.equal(held.model.state_dict()[name],
                                                                                   tensor), name


def test_a_version_of_another_architecture_is_built_anew(two_versions, tmp_path):
    from pipeline.models.checkpoints import weight_hash

    v1, _ = two_versions
    other = build_tiny(TINY.model_copy(update={"intermediate_size": 48}))
    info = save_checkpoint(tmp_path / "v000003", other)
    held = load_published(v1, "transformers")
    loaded = load_published(_event(info.path, 3, info.manifest_sha256), "transformers", current=held)
    assert loaded is not held and weight_hash(loaded.model) == info.weight_hash
    assert loaded.model.config.intermediate_size == 48 and held.model.config.intermediate_size == 64


class _Engine:
    """Stands in for `vllm.LLM`: `collective_rpc` runs the callable on one worker whose model records what its
    `load_weights` was given (vLLM itself needs CUDA and is not installed here)."""

    def __init__(self) -> None:
        import types

        self.loaded: dict[str, object] = {}
        self.prefix_cache_resets = 0
        model = types.SimpleNamespace(load_weights=lambda weights: self.loaded.update(dict(weights)))
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))

    def collective_rpc(self, method, args=()):
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1


def test_the_vllm_backend_hands_a_full_version_to_the_running_engine(two_versions, tmp_path):
    import json
    import shutil

    import torch
    from safetensors.torch import load_file

    from pipeline.models.vllm_backend import VllmPolicy

    v1, v2 = two_versions
    served = VllmPolicy.__new__(VllmPolicy)  # what __init__ leaves, without starting an engine
    served.llm = engine = _Engine()
    served.checkpoint_files = json.loads((checkpoint_path(v1.checkpoint_uri) / "manifest.json").read_text())["files"]
    assert load_published(v2, "vllm", current=served) is served
    expected = load_file(str(checkpoint_path(v2.checkpoint_uri) / "model.safetensors"))
    assert engine.loaded.keys() == expected.keys()
    assert all(torch.equal(engine.loaded[name], tensor) for name, tensor in expected.items())
    assert engine.prefix_cache_resets == 1
    assert served.checkpoint_files == json.loads((checkpoint_path(v2.checkpoint_uri) / "manifest.json").read_text())[
        "files"]
    # A flipped byte is refused before the engine is touched.
    copy = tmp_path / "v000002"
    shutil.copytree(checkpoint_path(v2.checkpoint_uri), copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-5] ^= 0x01
    (copy / "model.safetensors").write_bytes(bytes(data))
    engine.loaded.clear()
    with pytest.raises(CheckpointError, match=r"model.safetensors: sha256"):
        served.load_version(copy, v2.sha256)
    assert engine.loaded == {} and engine.prefix_cache_resets == 1
    # Another architecture is not loaded into the running engine: the caller starts a new one.
    served.checkpoint_files = {**served.checkpoint_files, "config.json": "0" * 64}
    assert served.load_version(checkpoint_path(v2.checkpoint_uri), v2.sha256) is False
    assert engine.loaded == {}
