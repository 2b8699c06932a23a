"""Claim checks (schemas/codec.py): large events keep their token ids and log-probs in the blob store, and get them
back on decode; a missing, altered or unfitting blob is a clear error naming the event and the blob."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import ClassVar

import pytest

from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.harness import RawRecord, run_worker
from pipeline.runtime.runner import Origin, Worker
from schemas.base import Event
from schemas.codec import (
    BULKY_FIELDS,
    ClaimCheckError,
    ClaimChecks,
    PayloadTooLargeError,
    decode,
    encode,
)
from schemas.examples import example_events
from schemas.topics import EVENT_TYPES, TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted, Turn


def _trajectory(turns: int, prompt_tokens: int) -> TrajectoryCompleted:
    example = next(e for e in example_events("claims") if isinstance(e, TrajectoryCompleted))
    played = [Turn(observation=f"turn {t}", prompt_token_ids=tuple((t + i) % 5000 for i in range(prompt_tokens)),
                   response_token_ids=(7, 8, t), sampling_logprobs=(-0.5, -0.25, -0.125), response_text="go",
                   action="north", valid=True, reward=0.0) for t in range(turns)]
    return TrajectoryCompleted.model_validate(example.model_dump() | {"turns": played, "num_actions": turns})


def _blob_files(store: BlobStore) -> list:
    return sorted(p for p in store.root.rglob("*") if p.is_file())


def test_a_large_event_leaves_its_arrays_in_the_store_and_decodes_to_itself(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    event = _trajectory(turns=3, prompt_tokens=4)
    inline = encode(event)
    assert encode(event, claims=ClaimChecks(store, threshold_bytes=len(inline))) == inline  # at the threshold: inline
    record = encode(event, claims=ClaimChecks(store, threshold_bytes=len(inline) - 1))
    assert _blob_files(store) and len(_blob_files(store)) == 1
    payload = json.loads(record)
    blob = _blob_files(store)[0].read_bytes()
    assert payload["claim_check"] == {"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    # Every array is emptied in place, and the blob maps each one's path to its wire string: turn 1's prompt is the
    # int32 little-endian bytes of (1, 2, 3, 4), base64.
    assert {turn["prompt_token_ids"] for turn in payload["turns"]} == {""}
    arrays = json.loads(blob)
    assert len(arrays) == 9 and arrays["turns/1/prompt_token_ids"] == "AQAAAAIAAAADAAAABAAAAA=="
    assert arrays["turns/2/sampling_logprobs"] == json.loads(inline)["turns"][2]["sampling_logprobs"]
    assert decode(TRAJECTORIES, record, blobs=store) == event
    # the same event gives the same record and the same single blob
    assert encode(event, claims=ClaimChecks(store, threshold_bytes=10)) == record
    assert len(_blob_files(store)) == 1


def test_forty_turns_of_ten_thousand_token_prompts_fit_under_the_cap_as_a_claim_check(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    event = _trajectory(turns=40, prompt_tokens=10_000)
    with pytest.raises(PayloadTooLargeError, match=r"encodes to \d+ bytes, over the 1048576-byte payload cap"):
        encode(event)
    record = encode(event, claims=ClaimChecks(store, threshold_bytes=256 * 1024))
    assert len(encode(event, max_bytes=1 << 30)) > 2_000_000 and len(record) < 16 * 1024
    assert decode(TRAJECTORIES, record, blobs=store) == event


def test_an_event_still_too_large_without_its_arrays_names_both_sizes(tmp_path):
    event = _trajectory(turns=2, prompt_tokens=2).model_copy(update={"final_observation": "x" * 5000})
    with pytest.raises(PayloadTooLargeError, match=r"encodes to \d+ bytes \(\d+ bytes before its arrays went to "):
        encode(event, max_bytes=4000, claims=ClaimChecks(BlobStore(tmp_path), threshold_bytes=100))


def test_a_claim_check_that_cannot_be_redeemed_names_the_event_and_the_blob(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    event = _trajectory(turns=2, prompt_tokens=3)
    record = encode(event, claims=ClaimChecks(store, threshold_bytes=100))
    sha256 = json.loads(record)["claim_check"]["sha256"]
    named = rf"TrajectoryCompleted {event.event_id}.*{sha256}"
    with pytest.raises(ClaimCheckError, match=rf"{named} .*no blob store"):
        decode(TRAJECTORIES, record)
    path = _blob_files(store)[0]
    original = path.read_bytes()
    path.write_bytes(original.replace(b"AQAAAA", b"AgAAAA", 1))  # one token id changed, same size
    with pytest.raises(ClaimCheckError, match=rf"{named}.*the claim check says {len(original)} bytes, {sha256}"):
        decode(TRAJECTORIES, record, blobs=store)
    path.unlink()
    with pytest.raises(ClaimCheckError, match=rf"{named} \({len(original)} bytes\) is missing from the blob store"):
        decode(TRAJECTORIES, record, blobs=store)
    path.write_bytes(original)
    bad_ticket = json.loads(record) | {"claim_check": {"sha256": "abc", "size": 1}}
    with pytest.raises(ClaimCheckError, match="malformed claim check"):
        decode(TRAJECTORIES, json.dumps(bad_ticket).encode(), blobs=store)
    inlined = json.loads(record)
    inlined["turns"][0]["prompt_token_ids"] = "AQAAAA=="  # an array the blob would overwrite
    with pytest.raises(ClaimCheckError, match="names turns/0/prompt_token_ids, which is not an emptied array"):
        decode(TRAJECTORIES, json.dumps(inlined).encode(), blobs=store)


def test_the_bulky_fields_are_every_token_id_and_log_prob_array_of_the_schemas():
    def base64_fields(schema: dict, found: set[str]) -> None:
        for definition in [schema, *schema.get("$defs", {}).values()]:
            for name, field in definition.get("properties", {}).items():
                if field.get("contentEncoding") == "base64":
                    found.add(name)

    found: set[str] = set()
    for event_type in EVENT_TYPES.values():
        base64_fields(event_type.model_json_schema(), found)
    assert found - {"data"} == BULKY_FIELDS  # `data`: an embedding's float16 components (1 KiB), left inline


class Capture(Worker):
    name = "capture"
    consumes = (TRAJECTORIES,)
    got: ClassVar[list[Event]] = []

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        self.got.append(event)
        return [event.model_copy(update={"trajectory_id": "t-2"})]


def test_a_worker_reads_claim_checks_writes_its_large_outputs_as_claim_checks_and_dead_letters_a_missing_blob(
        tmp_path):
    store = BlobStore(tmp_path / "blobs")
    event = _trajectory(turns=4, prompt_tokens=50)
    record = encode(event, claims=ClaimChecks(store, threshold_bytes=1000))
    missing = _trajectory(turns=5, prompt_tokens=50)
    orphan = encode(missing, claims=ClaimChecks(BlobStore(tmp_path / "elsewhere"), threshold_bytes=1000))
    Capture.got = []
    result = run_worker(Capture(), [RawRecord(TRAJECTORIES.name, record), RawRecord(TRAJECTORIES.name, orphan)],
                        blobs=store, claim_check_bytes=1000)
    assert Capture.got == [event]
    assert [output.trajectory_id for output in result.outputs] == ["t-2"]
    assert result.outputs[0].turns == event.turns  # read back from the store it wrote its arrays to
    (_, _, published, _), *_ = [d for d in result.runner.output_log.delivered if d[0] == TRAJECTORIES.name]
    assert "claim_check" in json.loads(published)
    letter = result.dead_letters[0]
    assert letter.error_class == "ClaimCheckError" and str(missing.event_id) in letter.error_message
    assert "is missing from the blob store" in letter.error_message
