"""The op log read fast: canonical records of `crl.experience-ops` decoded by msgspec into the bank's own records.

    op = read_op(record.value)      # an OpRecord, or for any other record what `decode_op` returns (or raises)
    state.apply(op, offset)         # BankState applies both alike

A replay spends most of its time decoding (docs/bank.md). `decode_op` parses, upcasts and validates any record a
client may write, through pydantic; `read_op` first tries a narrower path for the records this project's own
producers write, which is nearly all of them, and hands everything else to `decode_op`, which decides and names what
is wrong. The narrow path accepts a record only when all of these hold, and then returns what `decode_op` would have
returned, field for field, as a lighter object (`AddedRecord`, `RefinedRecord`, `MergedRecord`, `RetiredRecord`):

- msgspec decodes it into the op's struct (the current schema version's fields, every one present, none unknown,
  JSON types exact: no `1.0` for an integer, no `true` for one);
- msgspec encodes the struct back to the same bytes: the record is in the canonical form `encode` writes (field
  order, no white space, no duplicate keys, the plain spelling of every string), so no reading of an odd spelling
  can differ between the two decoders;
- every constraint of the schema holds, checked here conservatively: ids of printable ASCII (an id of other
  characters may be valid, and `decode_op` decides it), the `event_id` a UUID and `occurred_at` a date and time with
  its offset (both as msgspec reads them, which with the canonical form leaves the spelling `encode` writes), texts
  and lists of the allowed lengths, a key of finite float16s, as many as its `dim` says.

Whatever fails any of these goes to `decode_op`: a valid but unusual record is accepted there, an invalid one is
rejected there with its exact error. `tests/unit/bank/test_op_records.py` holds the two paths to the same answers on
generated records, valid and broken.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, ClassVar, Literal

import msgspec
import numpy as np

from schemas.arrays import finite_float16s
from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES
from schemas.experiences import MAX_EXPERIENCE_CHARS

_Int64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Version = Annotated[int, msgspec.Meta(ge=1)]
_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_EXPERIENCE_CHARS)]
_MAX_ID = 256


class ProducerRecord(msgspec.Struct, forbid_unknown_fields=True):
    worker: str
    instance: str


class KeyRecord(msgspec.Struct, forbid_unknown_fields=True):
    """An op's key vector: `EmbeddingVector`'s fields, its components as the bytes of their base64."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    dim: Annotated[int, msgspec.Meta(gt=0, le=65536)]
    data: bytes

    def float16(self) -> np.ndarray:
        """The vector as float16, shape (dim,): a read-only view of the decoded bytes (as `EmbeddingVector`'s)."""
        return np.frombuffer(self.data, dtype="<f2")


class SourceRecord(msgspec.Struct, forbid_unknown_fields=True):
    experience_id: str
    expected_version: _Version


class _Envelope(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind"):
    schema_version: Literal[1]
    event_id: uuid.UUID
    run_id: str
    occurred_at: datetime
    producer: ProducerRecord


class AddedRecord(_Envelope, tag="ExperienceAdded"):
    """`ExperienceAdded`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceAdded"
    op_id: str
    experience_id: str
    task_family: str
    text: _Text
    key: KeyRecord
    generation_id: str
    extractor_version: _Int64
    source_trajectory_ids: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]


class RefinedRecord(_Envelope, tag="ExperienceRefined"):
    """`ExperienceRefined`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceRefined"
    op_id: str
    experience_id: str
    expected_version: _Version
    text: _Text
    key: KeyRecord | None
    generation_id: str
    extractor_version: _Int64
    source_trajectory_ids: tuple[str, ...]


class MergedRecord(_Envelope, tag="ExperienceMerged"):
    """`ExperienceMerged`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceMerged"
    op_id: str
    experience_id: str
    task_family: str
    text: _Text
    key: KeyRecord
    sources: Annotated[tuple[SourceRecord, ...], msgspec.Meta(min_length=2)]
    generation_id: str
    extractor_version: _Int64


class RetiredRecord(_Envelope, tag="ExperienceRetired"):
    """`ExperienceRetired`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceRetired"
    op_id: str
    experience_id: str
    expected_version: _Version
    reason: Literal["merge_discard", "capacity", "manual"]
    generation_id: str | None
    extractor_version: _Int64 | None


OpRecord = AddedRecord | RefinedRecord | MergedRecord | RetiredRecord
RECORD_TYPES: tuple[type[OpRecord], ...] = (AddedRecord, RefinedRecord, MergedRecord, RetiredRecord)

_DECODER = msgspec.json.Decoder(OpRecord)
_ENCODER = msgspec.json.Encoder()


def _ids_valid(ids: list[str]) -> bool:
    """Every id non-empty, at most 256 characters, of printable ASCII and no space: then surely `Id` (no white space
    at all). An id with other characters may still be one; `decode_op` decides those."""
    joined = "".join(ids)
    return (joined.isascii() and joined.isprintable() and " " not in joined
            and min(map(len, ids)) > 0 and max(map(len, ids)) <= _MAX_ID)


def _key_valid(key: KeyRecord) -> bool:
    return len(key.data) == 2 * key.dim and finite_float16s(key.data)


def _valid(op: OpRecord) -> bool:
    """The constraints of the op's schema that msgspec did not check (see the module's docstring)."""
    if op.occurred_at.tzinfo is None:
        return False
    ids = [op.run_id, op.producer.worker, op.producer.instance, op.op_id, op.experience_id]
    if isinstance(op, AddedRecord):
        ids += [op.task_family, op.generation_id, *op.source_trajectory_ids]
        return _ids_valid(ids) and _key_valid(op.key)
    if isinstance(op, RefinedRecord):
        ids += [op.generation_id, *op.source_trajectory_ids]
        return _ids_valid(ids) and (op.key is None or _key_valid(op.key))
    if isinstance(op, MergedRecord):
        sources = [source.experience_id for source in op.sources]
        ids += [op.task_family, op.generation_id, *sources]
        return (len(set(sources)) == len(sources) and op.experience_id not in sources and _ids_valid(ids)
                and _key_valid(op.key))
    if op.generation_id is not None:
        ids.append(op.generation_id)
    return _ids_valid(ids)


def read_canonical(data: bytes) -> OpRecord | None:
    """The op of a canonical, valid record (see the module's docstring); None for any other record."""
    if len(data) > DEFAULT_MAX_PAYLOAD_BYTES:
        return None
    try:
        op = _DECODER.decode(data)
        canonical = _ENCODER.encode(op) == data
    except (msgspec.DecodeError, msgspec.EncodeError, UnicodeError):
        return None
    return op if canonical and _valid(op) else None
