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
