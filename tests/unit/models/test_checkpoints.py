"""Checkpoints: a save/load round trip reproduces weights, sampling and log-probs exactly; the manifest's bytes are
deterministic; tampering, missing files and wrong hashes raise `CheckpointError`; optimiser state resumes
bit-identically.

Run: pytest tests/unit/models/test_checkpoints.py -q   (CPU, ~10 s)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import SMALL

from pipeline.errors import CheckpointError
from pipeline.models import (
    SamplingParams,
    TinyModelSettings,
    TransformersPolicy,
    build_tiny,
    load_checkpoint,
    load_optimizer_tensors,
    manifest_sha256,
    optimizer_tensors,
    save_checkpoint,
    weight_hash,
)
from pipeline.models.base import stream_seed
from pipeline.models.checkpoints import MANIFEST

PROMPTS = ["Goal: reach the staircase down\nAction:", "Observation:\n|.@.|\n|..>|\nAction: north\nAction:"]


def rows(seed: int, n: int) -> list[int]:
    """Row seeds for a test call of `n` prompts: one stream per (seed, row)."""
    return [stream_seed("test", seed, row) for row in range(n)]


MODEL_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "manifest.json"}


def _adamw(policy: TransformersPolicy) -> torch.optim.AdamW:
    return torch.optim.AdamW(policy.model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _train_step(policy: TransformersPolicy, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One deterministic update: raise the log-prob of a fixed sampled batch."""
    generations = policy.generate(PROMPTS, SamplingParams(max_new_tokens=6), seeds=rows(seed, len(PROMPTS)))
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    logps = policy.token_logprobs([g.prompt_token_ids for g in generations], [g.token_ids for g in generations])
    (-torch.cat(logps).mean()).backward()
    optimizer.step()
    policy.model.eval()


# -- round trip ---------------------------------------------------------------------------------------------------


def test_round_trip_reproduces_weights_sampling_and_logprobs(policy: TransformersPolicy, tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "v0", policy, metadata={"role": "actor", "version": 0})
    assert info.path == tmp_path / "v0"
    assert info.weight_hash == weight_hash(policy.model)
    assert info.manifest_sha256 == manifest_sha256(info.path)
    loaded = load_checkpoint(info.path, expected_sha256=info.manifest_sha256)
    assert weight_hash(loaded.policy.model) == info.weight_hash
    assert loaded.policy.model.lm_head.weight is loaded.policy.model.model.embed_tokens.weight
    assert loaded.policy.tokenizer.get_vocab() == policy.tokenizer.get_vocab()
    assert loaded.manifest["metadata"] == {"role": "actor", "version": 0}
    assert loaded.optimizer_tensors is None and loaded.optimizer_param_groups is None

    sampling = SamplingParams(max_new_tokens=10, temperature=0.9)
    generations = policy.generate(PROMPTS, sampling, seeds=rows(21, len(PROMPTS)))
    assert loaded.policy.generate(PROMPTS, sampling, seeds=rows(21, len(PROMPTS))) == generations
    with torch.no_grad():
        args = ([g.prompt_token_ids for g in generations], [g.token_ids for g in generations], 0.9)
        for original, reloaded in zip(policy.token_logprobs(*args), loaded.policy.token_logprobs(*args), strict=True):
            assert torch.equal(original, reloaded)


def test_checkpoint_holds_only_safetensors_json_and_tokenizer_files(policy: TransformersPolicy,
                                                                     tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "v0", policy, optimizer=_adamw(policy))
    names = {p.name for p in info.path.iterdir()}
    assert names == MODEL_FILES | {"optimizer.safetensors"}  # no .bin / .pt / pickle
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0"]  # the staging directory is gone
    manifest = json.loads((info.path / MANIFEST).read_text())
    assert set(manifest) == {"format", "files", "weight_hash", "metadata", "optimizer_param_groups"}
    assert manifest["format"] == 1
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert list(manifest["files"]) == sorted(manifest["files"])
    header_length = int.from_bytes((info.path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((info.path / "model.safetensors").read_bytes()[8 : 8 + header_length])
    assert "lm_head.weight" not in header and "model.embed_tokens.weight" in header  # the tied weight, once


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_both_loaders_restore_the_exact_tokenizer_and_weights(corpus: list[str], architecture: str,
                                                              tmp_path: Path) -> None:
    # AutoTokenizer alone would turn a qwen2 checkpoint's tokenizer into Qwen2Tokenizer (another pre-tokenizer
    # regex, one more token): these loaders must not.
    original = build_tiny(SMALL.model_copy(update={"architecture": architecture}), corpus=corpus)
    info = save_checkpoint(tmp_path / "v0", original)
    texts = [*PROMPTS, *corpus[:4], "café ✓  x . y", "12345 678"]
    for reloaded in (load_checkpoint(info.path).policy, TransformersPolicy.from_pretrained(info.path)):
        assert weight_hash(reloaded.model) == info.weight_hash
        assert len(reloaded.tokenizer) == len(original.tokenizer) == reloaded.model.config.vocab_size
        assert reloaded.tokenizer.get_vocab() == original.tokenizer.get_vocab()
        assert [reloaded.encode(t) for t in texts] == [original.encode(t) for t in texts]
        assert reloaded.eos_token_ids == original.eos_token_ids and reloaded.pad_token_id == original.pad_token_id


def test_manifest_bytes_are_deterministic(policy: TransformersPolicy, corpus: list[str], tmp_path: Path) -> None:
    first = save_checkpoint(tmp_path / "a", policy, metadata={"b": 2, "a": [1, 2]})
    rebuilt = build_tiny(SMALL, corpus=corpus)
    second = save_checkpoint(tmp_path / "b", rebuilt, metadata={"a": [1, 2], "b": 2})
    assert first.manifest_sha256 == second.manifest_sha256
    assert (first.path / MANIFEST).read_bytes() == (second.path / MANIFEST).read_bytes()
    different = save_checkpoint(tmp_path / "c", policy, metadata={"a": [1, 2], "b": 3})
    assert different.manifest_sha256 != first.manifest_sha256


def test_saving_into_an_existing_directory(policy: TransformersPolicy, corpus: list[str], tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "v1", policy, metadata={"step": 1})
    assert save_checkpoint(tmp_path / "v1", policy, metadata={"step": 1}) == info  # same content: a no-op
    other = build_tiny(SMALL.model_copy(update={"seed": 7}), corpus=corpus)
    before = {p.name: p.read_bytes() for p in info.path.iterdir()}
    with pytest.raises(CheckpointError, match="already holds a different checkpoint"):
        save_checkpoint(tmp_path / "v1", other, metadata={"step": 1})
    assert {p.name: p.read_bytes() for p in info.path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


# -- verification -------------------------------------------------------------------------------------------------


def test_flipped_byte_in_the_weights_is_detected(policy: TransformersPolicy, tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "v0", policy)
    weights = info.path / "model.safetensors"
    recorded = json.loads((info.path / MANIFEST).read_text())["files"]["model.safetensors"]
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors") as caught:
        load_checkpoint(info.path, expected_sha256=info.manifest_sha256)
    assert recorded in str(caught.value)


def test_wrong_expected_sha256_is_detected(policy: TransformersPolicy, tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "v0", policy)
    with pytest.raises(CheckpointError, match=f"sha256 {info.manifest_sha256}, expected {'0' * 64}"):
        load_checkpoint(info.path, expected_sha256="0" * 64)


def test_missing_file_is_detected(policy: TransformersPolicy, tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "v0", policy)
    (info.path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer.json.*missing"):
        load_checkpoint(info.path)
    (info.path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"manifest.json is missing"):
        load_checkpoint(info.path)


def test_weights_that_differ_from_the_recorded_weight_hash_are_detected(policy: TransformersPolicy,
                                                                         tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "v0", policy)
    manifest = json.loads((info.path / MANIFEST).read_text())
    manifest["weight_hash"] = "f" * 64  # every file hash still matches; only the loaded weights disagree
    (info.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"weight hash {info.weight_hash} after loading, manifest says f{{64}}"):
        load_checkpoint(info.path)


# -- optimiser state ----------------------------------------------------------------------------------------------


def test_optimizer_tensors_flatten_the_state(policy: TransformersPolicy, corpus: list[str]) -> None:
    trained = build_tiny(SMALL, corpus=corpus)
    optimizer = _adamw(trained)
    _train_step(trained, optimizer, seed=0)
    tensors, groups = optimizer_tensors(optimizer)
    count = len(list(trained.model.parameters()))
    assert set(tensors) == {f"state.{i}.{key}" for i in range(count) for key in ("step", "exp_avg", "exp_avg_sq")}
    assert tensors["state.0.step"].shape == () and float(tensors["state.0.step"]) == 1.0
    assert json.loads(json.dumps(groups)) == groups
    assert groups[0]["betas"] == [0.9, 0.99] and groups[0]["lr"] == 1e-2 and groups[0]["params"] == list(range(count))


def test_python_scalar_state_becomes_a_lossless_0d_tensor(policy: TransformersPolicy) -> None:
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    first = next(iter(policy.model.parameters()))
    optimizer.state[first]["step"] = 0.1
    optimizer.state[first]["count"] = 3
    tensors, _ = optimizer_tensors(optimizer)
    assert tensors["state.0.step"].dtype == torch.float64 and tensors["state.0.step"].item() == 0.1
    assert tensors["state.0.count"].dtype == torch.int64 and tensors["state.0.count"].item() == 3


def test_resumed_optimizer_steps_bit_identically(corpus: list[str], tmp_path: Path) -> None:
    straight = build_tiny(SMALL, corpus=corpus)
    straight_optimizer = _adamw(straight)
    _train_step(straight, straight_optimizer, seed=0)
    after_one = weight_hash(straight.model)
    _train_step(straight, straight_optimizer, seed=1)
    after_two = weight_hash(straight.model)
    assert after_one != after_two

    interrupted = build_tiny(SMALL, corpus=corpus)
    optimizer = _adamw(interrupted)
    _train_step(interrupted, optimizer, seed=0)
    info = save_checkpoint(tmp_path / "v1", interrupted, optimizer=optimizer, metadata={"step": 1})
    assert info.weight_hash == after_one

    loaded = load_checkpoint(info.path, expected_sha256=info.manifest_sha256)
    resumed = _adamw(loaded.policy)
    assert loaded.optimizer_tensors is not None and loaded.optimizer_param_groups is not None
    load_optimizer_tensors(resumed, loaded.optimizer_tensors, loaded.optimizer_param_groups)
    assert resumed.param_groups[0]["betas"] == (0.9, 0.99)
    _train_step(loaded.policy, resumed, seed=1)
    assert weight_hash(loaded.policy.model) == after_two

    # Without the saved moments the same step lands elsewhere: the state is what makes it identical.
    fresh = load_checkpoint(info.path)
    _train_step(fresh.policy, _adamw(fresh.policy), seed=1)
    assert weight_hash(fresh.policy.model) != after_two


def test_optimizer_state_for_other_parameters_is_rejected(policy: TransformersPolicy, corpus: list[str]) -> None:
    trained = build_tiny(SMALL, corpus=corpus)
    optimizer = _adamw(trained)
    _train_step(trained, optimizer, seed=0)
    tensors, groups = optimizer_tensors(optimizer)
    two_groups = torch.optim.AdamW([{"params": [trained.model.model.norm.weight]},
                                    {"params": [trained.model.lm_head.weight]}])
    with pytest.raises(CheckpointError, match="does not fit this optimizer"):
        load_optimizer_tensors(two_groups, tensors, groups)


# -- one pass: hashed while written, verified while read ----------------------------------------------------------

HANDOFF_TINY = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                 vocab_size=300, corpus_episodes=2)
# What `save_checkpoint` wrote for the model below before it hashed in the same pass (save_file, then file_sha256
# of the written files): the format, and so every recorded hash, must not change.
PINNED = {
    "model.safetensors": "844b2ad7abf48c34662597fe6d52ba8098d7bb58a1857dc385b2c181ba339efe",
    "optimizer.safetensors": "4456b704ef5968178a11c7c9663c7c5a1f0289f11cffcde218039797c5f72dc1",
    "weight_hash": "0a01dd1a4e6f44a5a43f52e0c47b947b91a38578b8c465e13d9f073e9fe182ac",
    "adapter.safetensors": "e0699ca68dc17b532789a87379408636a752dfe667194e595404e2b3917ab651",
    "adapter_config.json": "3c4165a1d91408271ea322912bd646995f6a9f22a8b81ae824ad72f02a5cee92",
    "adapter_weight_hash": "ba2262b71a80a87e1ca50464c3d7138ed3a34345a28999e2dacbb01684bc9ac4",
}


def test_hashes_computed_while_writing_are_those_of_the_files_and_of_before(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from pipeline.models.checkpoints import _untied_state_dict
    from pipeline.models.lora import with_lora
    from pipeline.models.settings import LoraSettings
    from pipeline.runtime.durable import file_sha256

    policy = build_tiny(HANDOFF_TINY)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
    for parameter in policy.model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    info = save_checkpoint(tmp_path / "v0", policy, optimizer=optimizer, metadata={"version": 0})
    manifest = json.loads((info.path / MANIFEST).read_text())
    # Each recorded hash is that of the file as it lies on disk, and of the bytes the old writer produced.
    assert manifest["files"] == {p.name: file_sha256(p) for p in info.path.iterdir() if p.name != MANIFEST}
    save_file(_untied_state_dict(policy.model), str(tmp_path / "old.safetensors"), metadata={"format": "pt"})
    assert (info.path / "model.safetensors").read_bytes() == (tmp_path / "old.safetensors").read_bytes()
    assert info.manifest_sha256 == file_sha256(info.path / MANIFEST)
    assert manifest["files"]["model.safetensors"] == PINNED["model.safetensors"]
    assert manifest["files"]["optimizer.safetensors"] == PINNED["optimizer.safetensors"]
    assert info.weight_hash == manifest["weight_hash"] == PINNED["weight_hash"]

    adapted = with_lora(load_checkpoint(info.path).policy, LoraSettings(rank=2, alpha=4, seed=1))
    for name, parameter in adapted.model.named_parameters():
        if "lora_B" in name:
            parameter.data.fill_(0.5)
    lora_info = save_checkpoint(tmp_path / "v1", adapted, metadata={"version": 1}, base=info)
    lora_manifest = json.loads((lora_info.path / MANIFEST).read_text())
    assert lora_manifest["files"] == {p.name: file_sha256(p) for p in lora_info.path.iterdir() if p.name != MANIFEST}
    assert lora_manifest["files"]["adapter.safetensors"] == PINNED["adapter.safetensors"]
    assert lora_manifest["files"]["adapter_config.json"] == PINNED["adapter_config.json"]
    assert lora_info.weight_hash == PINNED["adapter_weight_hash"]
    assert weight_hash(load_checkpoint(lora_info.path, lora_info.manifest_sha256).policy.model) == lora_info.weight_hash


def test_safetensors_bytes_are_read_as_the_library_reads_them(tmp_path: Path) -> None:
    from safetensors.torch import load, save

    from pipeline.models.checkpoints import safetensors_tensors

    tensors = {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7, "bf16": torch.tensor([1.5, -2.25, 3e-3],
                                                                                         dtype=torch.bfloat16),
        "i64": torch.tensor(-(2**40), dtype=torch.int64), "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros((0, 5), dtype=torch.float16), "u8": torch.tensor([[0, 255]], dtype=torch.uint8),
    }
    data = save(tensors, metadata={"format": "pt"})
    read = safetensors_tensors(bytearray(data), tmp_path / "x.safetensors")
    expected = load(data)
    assert read.keys() == expected.keys() == tensors.keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape and torch.equal(read[name], tensor)
    # Written as the library writes it, streamed: the library only serialised the one-element stand-ins.
    import safetensors.torch

    from pipeline.models.checkpoints import write_safetensors
    from pipeline.runtime.durable import file_sha256

    serialised: list[set[int]] = []
    library_save = safetensors.torch.save

    def recording_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
        serialised.append({t.numel() for t in tensors.values()})
        return library_save(tensors, metadata=metadata)

    for metadata in ({"format": "pt"}, None):
        safetensors.torch.save = recording_save
        try:
            sha256 = write_safetensors(tmp_path / f"streamed-{metadata}", tensors, metadata=metadata)
        finally:
            safetensors.torch.save = library_save
        safetensors.torch.save_file(tensors, str(tmp_path / f"library-{metadata}"), metadata=metadata)
        assert (tmp_path / f"streamed-{metadata}").read_bytes() == (tmp_path / f"library-{metadata}").read_bytes()
        assert sha256 == file_sha256(tmp_path / f"library-{metadata}")
    assert serialised == [{1}, {1}]
    truncated = bytearray(data[:-3])  # the last tensor's bytes run past the end
    with pytest.raises(CheckpointError, match=r"x.safetensors is not a readable safetensors file"):
        safetensors_tensors(truncated, tmp_path / "x.safetensors")


def test_write_hashed_and_read_hashed_name_the_bytes_in_one_pass(tmp_path: Path) -> None:
    import hashlib

    from pipeline.runtime.durable import BLOCK, read_hashed, write_hashed

    assert write_hashed(tmp_path / "abc", b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    data, sha256 = read_hashed(tmp_path / "abc")
    assert (bytes(data), sha256) == (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    blocks = bytes(range(256)) * (2 * BLOCK // 256) + b"tail"  # two whole blocks and a part of one
    assert write_hashed(tmp_path / "big", blocks) == hashlib.sha256(blocks).hexdigest()
    data, sha256 = read_hashed(tmp_path / "big")
    assert (bytes(data), sha256) == (blocks, hashlib.sha256(blocks).hexdigest())
    with pytest.raises(FileExistsError):
        write_hashed(tmp_path / "abc", b"other")  # a file is written once
