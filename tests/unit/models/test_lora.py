"""LoRA on the tiny preset, through the same trainer and replay as full fine-tuning: only the adapter trains,
versions after 0 hold the adapter alone and name their base by manifest sha256, a worker applies a newer adapter to
the base it holds, and `crl replay train` reproduces every step's weight hash bit for bit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pipeline.audit.archive import archive_root, archive_row, write_segments
from pipeline.audit.training_replay import replay_training
from pipeline.errors import CheckpointError, ConfigError
from pipeline.models.base import stream_seed
from pipeline.models.checkpoints import load_checkpoint, manifest_sha256, weight_hash
from pipeline.models.lora import is_lora
from pipeline.models.settings import LoraSettings, ModelSettings, TinyModelSettings
from pipeline.rl.settings import ActorTrainerSettings
from pipeline.rl.synthetic import synthetic_trajectories
from pipeline.rl.trainer import PolicyTrainer
from pipeline.rl.versions import checkpoints_root, version_dir
from schemas.base import Event, Producer
from schemas.topics import topic_of
from workers.actor_trainer import ClosedStep, actor_update

TINY = TinyModelSettings(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=512, corpus_episodes=4)
SETTINGS = ActorTrainerSettings(model=ModelSettings(tiny=TINY, lora=LoraSettings(rank=4, alpha=8, seed=3)),
                                lr=1e-2, threads=1, group_size=4, groups_per_step=2, micro_batch_size=5)


def rows(seed: int, n: int) -> list[int]:
    """Row seeds for a test call of `n` prompts: one stream per (seed, row)."""
    return [stream_seed("test", seed, row) for row in range(n)]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, record_actor_run) -> tuple[Path, list[Event]]:
    run_dir = tmp_path_factory.mktemp("run")
    events = record_actor_run(run_dir, SETTINGS)
    rows = [archive_row(event, topic_of(event).name, 0, offset, 0, b"k", log_id="log-1")
            for offset, event in enumerate(events)]
    write_segments(archive_root(run_dir), rows)
    return run_dir, events


def _root(run_dir: Path) -> Path:
    return checkpoints_root(run_dir, "actor")


def test_version_0_is_the_base_and_later_versions_hold_the_adapter_alone(lora_run):
    run_dir, _ = lora_run
    v0, v1 = version_dir(_root(run_dir), 0), version_dir(_root(run_dir), 1)
    assert (v0 / "model.safetensors").is_file() and not (v0 / "adapter.safetensors").exists()
    assert not (v1 / "model.safetensors").exists()
    manifest = json.loads((v1 / "manifest.json").read_text())
    assert manifest["base"] == {"path": "../v000000", "manifest_sha256": manifest_sha256(v0)}
    assert {"adapter.safetensors", "adapter_config.json", "optimizer.safetensors"} <= set(manifest["files"])
    assert json.loads((v1 / "adapter_config.json").read_text())["r"] == 4
    # The adapter is a small fraction of the model; only it has optimiser state.
    assert (v1 / "adapter.safetensors").stat().st_size < (v0 / "model.safetensors").stat().st_size / 5


def test_only_the_adapter_trains_and_the_base_weights_stay_those_of_version_0(lora_run):
    run_dir, _ = lora_run
    base = load_checkpoint(version_dir(_root(run_dir), 0)).policy.model.state_dict()
    v2 = load_checkpoint(version_dir(_root(run_dir), 2)).policy
    assert is_lora(v2.model)
    state = v2.model.state_dict()
    for name, tensor in base.items():
        adapted = re.sub(r"\.(q_proj|k_proj|v_proj|o_proj)\.", r".\1.base_layer.", name)
        key = next(k for k in (f"base_model.model.{adapted}", f"base_model.model.{name}") if k in state)
        assert torch.equal(state[key], tensor), name
    assert any("lora_B" in name and tensor.abs().sum() > 0 for name, tensor in state.items())


def test_a_newer_adapter_is_applied_to_the_base_a_worker_holds(lora_run):
    run_dir, _ = lora_run
    root = _root(run_dir)
    held = load_checkpoint(version_dir(root, 1)).policy
    base_tensor = next(t for n, t in held.model.named_parameters() if "base_layer" in n)
    pointer = base_tensor.data_ptr()
    newer = load_checkpoint(version_dir(root, 2), manifest_sha256(version_dir(root, 2)), reuse=held)
    assert newer.policy is held  # applied in place, the base not loaded again
    assert next(t for n, t in held.model.named_parameters() if "base_layer" in n).data_ptr() == pointer
    assert weight_hash(held.model) == json.loads((version_dir(root, 2) / "manifest.json").read_text())["weight_hash"]


def test_the_follower_sets_a_newer_adapter_in_place_and_leaves_the_optimizer_state_unread(lora_run, tmp_path):
    from pipeline.models.policy_follower import load_published
    from schemas.training import PolicyPublished

    run_dir, events = lora_run
    published = {e.version: e for e in events if isinstance(e, PolicyPublished) and e.role == "actor"}
    held = load_published(published[1], "transformers")
    pointers = {name: tensor.data_ptr() for name, tensor in held.model.state_dict().items()}
    picked_up = load_published(published[2], "transformers", current=held)
    assert picked_up is held
    assert {name: tensor.data_ptr() for name, tensor in held.model.state_dict().items()} == pointers
    assert held.full_precision is not None  # the merged copy's source, which the version's hash is over
    manifest = json.loads((version_dir(_root(run_dir), 2) / "manifest.json").read_text())
    assert weight_hash(held.full_precision.model) == manifest["weight_hash"]
    # A generating worker needs no optimiser state: version 2 without it still loads for the follower.
    copy = tmp_path / "actor"
    for version in (0, 2):
        target = version_dir(copy, version)
        target.mkdir(parents=True)
        for path in version_dir(_root(run_dir), version).iterdir():
            if path.name != "optimizer.safetensors":
                (target / path.name).write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors is listed in the manifest .* but missing"):
        load_checkpoint(version_dir(copy, 2))
    v2 = published[2].model_copy(update={"checkpoint_uri": version_dir(copy, 2).resolve().as_uri()})
    held = load_published(published[1], "transformers")
    assert load_published(v2, "transformers", current=held) is held


def test_a_tampered_adapter_is_refused_and_the_held_version_kept(lora_run, tmp_path):
    run_dir, _ = lora_run
    root = _root(run_dir)
    copy = tmp_path / "actor"
    for version in (0, 1, 2):
        source = version_dir(root, version)
        target = version_dir(copy, version)
        target.mkdir(parents=True)
        for path in source.iterdir():
            (target / path.name).write_bytes(path.read_bytes())
    held = load_checkpoint(version_dir(copy, 1)).policy
    before = weight_hash(held.model)
    adapter = version_dir(copy, 2) / "adapter.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"adapter.safetensors: sha256"):
        load_checkpoint(version_dir(copy, 2), reuse=held)
    assert weight_hash(held.model) == before
    # Other adapter values whose file hash the manifest agrees with: set in place, caught by the weight hash, undone.
    from safetensors.torch import load_file, save_file

    from pipeline.runtime.durable import file_sha256

    tensors = load_file(str(version_dir(root, 2) / "adapter.safetensors"))
    save_file({name: tensor * 2 for name, tensor in tensors.items()}, str(adapter), metadata={"format": "pt"})
    manifest_path = version_dir(copy, 2) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["adapter.safetensors"] = file_sha256(adapter)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="weight hash"):
        load_checkpoint(version_dir(copy, 2), reuse=held)
    assert weight_hash(held.model) == before


def test_replay_reproduces_every_lora_step_bit_for_bit(lora_run):
    run_dir, _ = lora_run
    report = replay_training(run_dir, "actor")
    assert report.ok, report.problem
    assert [(c.step, c.version, c.ok) for c in report.checks] == [(1, 1, True), (2, 2, True)]


@pytest.mark.parametrize("lora", [LoraSettings(), LoraSettings(rank=4, alpha=8, seed=3)], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_weights(lora, tmp_path):
    hashes = []
    for checkpointing in (False, True):
        settings = SETTINGS.model_copy(update={"model": ModelSettings(tiny=TINY, lora=lora,
                                                                      gradient_checkpointing=checkpointing)})
        trainer = PolicyTrainer("actor", settings, tmp_path / str(checkpointing), "run",
                                Producer(worker="actor_trainer", instance="t"))
        assert trainer.policy.model.is_gradient_checkpointing == checkpointing
        batch = sorted(synthetic_trajectories(trainer.policy, run_id="run", step=1, groups=2, group_size=4, seed=1),
                       key=lambda t: (t.group_id, t.slot))
        hashes.append(actor_update(trainer, settings, ClosedStep(1, batch, [], False, 0)).weight_hash_after)
    assert hashes[0] == hashes[1]


def test_a_vllm_role_cannot_train_a_lora_adapter():
    from pydantic import ValidationError

    from pipeline.settings import Settings

    with pytest.raises(ValidationError, match="vllm serves full checkpoints only"):
        Settings(rollout={"generation": {"backend": "vllm"}},
                 actor_trainer={"model": {"lora": {"rank": 8}}})


def test_a_run_cannot_switch_to_lora_when_it_resumes(lora_run, tmp_path):
    run_dir, _ = lora_run
    full = SETTINGS.model_copy(update={"model": ModelSettings(tiny=TINY)})
    with pytest.raises(ConfigError, match="cannot switch between LoRA and full fine-tuning"):
        PolicyTrainer("actor", full, _root(run_dir), "run", Producer(worker="actor_trainer", instance="t"))


def test_a_warm_start_leaves_no_gradient_behind(tmp_path):
    """Gradients a warm start leaves on the base would count in the first LoRA step's clipping norm: a trainer built
    on a warm-started policy steps exactly as one built on that policy's saved checkpoint (as replay is)."""
    from pipeline.rl.trainer import actor_batch
    from pipeline.rl.trainer_step import TrainerStep

    def warm(policy, _progress):
        policy.model.train()
        out = policy.model(torch.tensor([[1, 2, 3, 4]]))
        (out.logits.sum() * 1e6).backward()  # a huge stale gradient on every base weight
        return policy, {"steps": 1}

    trainer = PolicyTrainer("actor", SETTINGS, tmp_path / "actor", "run",
                            Producer(worker="actor_trainer", instance="t"), warm_start=warm)
    replayed = TrainerStep.resumed(load_checkpoint(version_dir(tmp_path / "actor", 0)), SETTINGS, 1.0)
    batch = sorted(synthetic_trajectories(trainer.policy, run_id="run", step=1, groups=2, group_size=4, seed=1),
                   key=lambda t: (t.group_id, t.slot))
    samples, _ = actor_batch(batch, SETTINGS)
    ours, theirs = trainer.update.run(samples, "grpo"), replayed.run(samples, "grpo")
    assert ours.grad_norm == theirs.grad_norm
    assert weight_hash(trainer.policy.model) == weight_hash(replayed.policy.model)


def test_a_bfloat16_generation_copy_merges_the_adapter_and_the_next_version_loads_onto_its_float32_source(lora_run):
    from pipeline.models.base import SamplingParams
    from pipeline.models.policy_follower import load_published
    from schemas.training import PolicyPublished

    run_dir, events = lora_run
    root = _root(run_dir)
    published = {e.version: e for e in events if isinstance(e, PolicyPublished)}
    held = load_published(published[1], "transformers", precision="bfloat16")
    assert held.full_precision is not None and is_lora(held.full_precision.model)
    assert not is_lora(held.model)  # the adapter is merged into the copy's weights
    assert {p.dtype for p in held.model.parameters()} == {torch.bfloat16}
    source_hash = weight_hash(held.full_precision.model)
    assert source_hash == json.loads((version_dir(root, 1) / "manifest.json").read_text())["weight_hash"]
    # The copy samples what the float32 version would, up to bfloat16 rounding of its log-probs.
    prompts = [[5, 6, 7, 8], [9, 10]]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    ours = held.generate(prompts, greedy, seeds=rows(0, len(prompts)))
    theirs = held.full_precision.generate(prompts, greedy, seeds=rows(0, len(prompts)))
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
        torch.testing.assert_close(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), atol=0.1, rtol=0)
    source, pointers = held.full_precision, _pointers(held)
    newer = load_published(published[2], "transformers", precision="bfloat16", current=held)
    assert newer.full_precision is source  # the adapter went onto the float32 source in place
    assert newer is held and _pointers(newer) == pointers  # and the merged weights into the copy held
    assert weight_hash(newer.full_precision.model) == json.loads(
        (version_dir(root, 2) / "manifest.json").read_text())["weight_hash"]
    _assert_same_tensors(newer, source.for_generation("bfloat16"))  # what a new copy would hold, bit for bit
    as_float32 = load_published(published[2], "transformers", current=held)  # a float32 copy, merged too
    assert as_float32.full_precision is source and not is_lora(as_float32.model)
    assert {p.dtype for p in as_float32.model.parameters()} == {torch.float32}


def test_a_float32_generation_copy_merges_the_adapter_and_takes_later_versions_in_place(lora_run):
    from pipeline.models.base import SamplingParams
    from pipeline.models.policy_follower import load_published
    from schemas.training import PolicyPublished

    run_dir, events = lora_run
    published = {e.version: e for e in events if isinstance(e, PolicyPublished)}
    held = load_published(published[1], "transformers")
    source, pointers = held.full_precision, _pointers(held)
    assert source is not None and is_lora(source.model) and not is_lora(held.model)
    assert {p.dtype for p in held.model.parameters()} == {torch.float32}
    newer = load_published(published[2], "transformers", current=held)
    assert newer is held and newer.full_precision is source and _pointers(newer) == pointers
    assert weight_hash(source.model) == json.loads(
        (version_dir(_root(run_dir), 2) / "manifest.json").read_text())["weight_hash"]
    _assert_same_tensors(newer, source.for_generation("float32"))
    # The merged copy samples what the adapter does: the same tokens, log-probs within float32 rounding.
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    for sampling in (SamplingParams(max_new_tokens=6, temperature=0.0), SamplingParams(max_new_tokens=6)):
        ours = newer.generate(prompts, sampling, seeds=rows(0, len(prompts)))
        theirs = source.generate(prompts, sampling, seeds=rows(0, len(prompts)))
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def _pointers(policy) -> dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in policy.model.state_dict().items()}


def _assert_same_tensors(policy, other) -> None:
    ours, theirs = policy.model.state_dict(), other.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_bfloat16_autocast_updates_keep_float32_weights_and_replay_bit_for_bit(tmp_path, record_actor_run, lora_run):
    settings = SETTINGS.model_copy(update={"model": SETTINGS.model.model_copy(update={"precision": "bfloat16"})})
    events = record_actor_run(tmp_path, settings)
    rows = [archive_row(event, topic_of(event).name, 0, offset, 0, b"k", log_id="log-1")
            for offset, event in enumerate(events)]
    write_segments(archive_root(tmp_path), rows)
    report = replay_training(tmp_path, "actor")
    assert report.ok, report.problem
    assert [(c.step, c.version, c.ok) for c in report.checks] == [(1, 1, True), (2, 2, True)]
    loaded = load_checkpoint(version_dir(_root(tmp_path), 2)).policy
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    # The same first batch as the float32 run (version 0 samples it), another update: the autocast took effect.
    from schemas.training import TrainStepCompleted

    def first_update(recorded: list[Event]) -> TrainStepCompleted:
        return next(e for e in recorded if isinstance(e, TrainStepCompleted) and e.step == 1)

    ours, theirs = first_update(events), first_update(lora_run[1])
    assert ours.weight_hash_before == theirs.weight_hash_before
    assert ours.weight_hash_after != theirs.weight_hash_after
