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
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from schemas.arrays import finite_float16s
from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES
from schemas.experiences import MAX_EXPERIENCE_CHARS

_Int64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Version = Annotated[int, msgspec.Meta(ge=1)]
_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_EXPERIENCE_CHARS)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
"""An id's length, checked by msgspec as it decodes; its characters are checked after (`_ids_valid`)."""
_Time = Annotated[datetime, msgspec.Meta(tz=True)]


# gc=False on every record: they hold strings, numbers, bytes, times and records of their own kinds, never a
# reference cycle, so the cyclic collector need not track the millions a replay makes.
class ProducerRecord(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    worker: _Id
    instance: _Id


class KeyRecord(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """An op's key vector: `EmbeddingVector`'s fields, its components as the bytes of their base64."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    dim: Annotated[int, msgspec.Meta(gt=0, le=65536)]
    data: bytes

    def float16(self) -> np.ndarray:
        """The vector as float16, shape (dim,): a read-only view of the decoded bytes (as `EmbeddingVector`'s)."""
        return np.frombuffer(self.data, dtype="<f2")


class SourceRecord(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    experience_id: _Id
    expected_version: _Version


class _Envelope(msgspec.Struct, forbid_unknown_fields=True, gc=False, tag_field="kind"):
    schema_version: Literal[1]
    event_id: uuid.UUID
    run_id: _Id
    occurred_at: _Time
    producer: ProducerRecord


class AddedRecord(_Envelope, tag="ExperienceAdded"):
    """`ExperienceAdded`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceAdded"
    op_id: _Id
    experience_id: _Id
    task_family: _Id
    text: _Text
    key: KeyRecord
    generation_id: _Id
    extractor_version: _Int64
    source_trajectory_ids: Annotated[tuple[_Id, ...], msgspec.Meta(min_length=1)]


class RefinedRecord(_Envelope, tag="ExperienceRefined"):
    """`ExperienceRefined`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceRefined"
    op_id: _Id
    experience_id: _Id
    expected_version: _Version
    text: _Text
    key: KeyRecord | None
    generation_id: _Id
    extractor_version: _Int64
    source_trajectory_ids: tuple[_Id, ...]


class MergedRecord(_Envelope, tag="ExperienceMerged"):
    """`ExperienceMerged`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceMerged"
    op_id: _Id
    experience_id: _Id
    task_family: _Id
    text: _Text
    key: KeyRecord
    sources: Annotated[tuple[SourceRecord, ...], msgspec.Meta(min_length=2)]
    generation_id: _Id
    extractor_version: _Int64


class RetiredRecord(_Envelope, tag="ExperienceRetired"):
    """`ExperienceRetired`, as `read_op` returns it."""

    kind: ClassVar[str] = "ExperienceRetired"
    op_id: _Id
    experience_id: _Id
    expected_version: _Version
    reason: Literal["merge_discard", "capacity", "manual"]
    generation_id: _Id | None
    extractor_version: _Int64 | None


OpRecord = AddedRecord | RefinedRecord | MergedRecord | RetiredRecord
RECORD_TYPES: tuple[type[OpRecord], ...] = (AddedRecord, RefinedRecord, MergedRecord, RetiredRecord)

_DECODER = msgspec.json.Decoder(OpRecord)
_ENCODER = msgspec.json.Encoder()


def _ids_valid(*ids: str) -> bool:
    """Every id of printable ASCII and no space (msgspec checked their lengths): then surely `Id` (no white space
    at all). An id with other characters may still be one; `decode_op` decides those."""
    joined = "".join(ids)
    return joined.isascii() and joined.isprintable() and " " not in joined


def _key_valid(key: KeyRecord) -> bool:
    return len(key.data) == 2 * key.dim and finite_float16s(key.data)


def _added_valid(op: AddedRecord) -> bool:
    producer = op.producer
    return (_ids_valid(op.run_id, producer.worker, producer.instance, op.op_id, op.experience_id, op.task_family,
                       op.generation_id, *op.source_trajectory_ids)
            and _key_valid(op.key))


def _refined_valid(op: RefinedRecord) -> bool:
    producer = op.producer
    return (_ids_valid(op.run_id, producer.worker, producer.instance, op.op_id, op.experience_id, op.generation_id,
                       *op.source_trajectory_ids)
            and (op.key is None or _key_valid(op.key)))


def _merged_valid(op: MergedRecord) -> bool:
    producer, sources = op.producer, [source.experience_id for source in op.sources]
    return (len(set(sources)) == len(sources) and op.experience_id not in sources
            and _ids_valid(op.run_id, producer.worker, producer.instance, op.op_id, op.experience_id, op.task_family,
                           op.generation_id, *sources)
            and _key_valid(op.key))


def _retired_valid(op: RetiredRecord) -> bool:
    producer = op.producer
    return _ids_valid(op.run_id, producer.worker, producer.instance, op.op_id, op.experience_id,
                      op.generation_id or "")


_VALID: dict[type, Callable[[Any], bool]] = {AddedRecord: _added_valid, RefinedRecord: _refined_valid,
                                             MergedRecord: _merged_valid, RetiredRecord: _retired_valid}
"""The constraints of each op kind's schema that msgspec does not check (see the module's docstring)."""


def read_canonical(data: bytes) -> OpRecord | None:
    """The op of a canonical, valid record (see the module's docstring); None for any other record."""
    if len(data) > DEFAULT_MAX_PAYLOAD_BYTES:
        return None
    try:
        op = _DECODER.decode(data)
        canonical = _ENCODER.encode(op) == data
    except (msgspec.DecodeError, msgspec.EncodeError, UnicodeError):
        return None
    return op if canonical and _VALID[type(op)](op) else None
