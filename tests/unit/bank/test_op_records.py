"""The op log's fast reader (`pipeline.bank.op_records`, `read_op`) against the full decoder (`decode_op`): it accepts
only what `decode_op` accepts, reads it as the same op, and the bank decides every op alike either way.

Run: pytest tests/unit/bank/test_op_records.py
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.bank.op_records import RECORD_TYPES, KeyRecord, OpRecord, read_canonical
from pipeline.bank.state import BankState, decode_op, read_op
from pipeline.bank.synthetic import synthetic_op_log
from schemas.codec import EventDecodeError, MalformedPayloadError, encode
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired

LOG = synthetic_op_log(1500, seed=3)
WIRE = [encode(op) for op in LOG]
KINDS = {cls.__name__: cls for cls in (ExperienceAdded, ExperienceRefined, ExperienceMerged, ExperienceRetired)}


def same_op(record: OpRecord, event: Any) -> bool:
    """The record holds what the event holds, field for field (keys as their float16 bytes)."""
    if record.kind != event.kind:
        return False
    for name in type(event).model_fields:
        mine, theirs = getattr(record, name), getattr(event, name)
        if name == "key":
            if (mine is None) != (theirs is None):
                return False
            if mine is not None and (mine.model, mine.dim, mine.float16().tobytes()) != (
                    theirs.model, theirs.dim, theirs.float16().tobytes()):
                return False
        elif name == "producer":
            if (mine.worker, mine.instance) != (theirs.worker, theirs.instance):
                return False
        elif name == "sources":
            if [(s.experience_id, s.expected_version) for s in mine] != [
                    (s.experience_id, s.expected_version) for s in theirs]:
                return False
        elif name != "kind" and mine != theirs:
            return False
    return True


def test_the_records_have_the_fields_of_the_events_in_their_order():
    # The canonical form is the events' own encoding: the same fields, in the same order.
    for record in RECORD_TYPES:
        event = KINDS[record.kind]
        assert ("kind", *record.__struct_fields__) == tuple(event.model_fields), record.kind


def test_every_record_the_project_writes_is_read_fast_as_the_event_it_encodes():
    for op, data in zip(LOG, WIRE, strict=True):
        record = read_canonical(data)
        assert record is not None, data[:200]
        assert same_op(record, op)
        assert same_op(record, decode_op(data))
    assert {type(read_op(data)).__name__ for data in WIRE} == {record.__name__ for record in RECORD_TYPES}


def test_the_bank_decides_every_op_alike_from_either_reader():
    events, records = BankState(), BankState()
    decided = [events.apply(decode_op(data), offset) for offset, data in enumerate(WIRE)]
    assert [records.apply(read_op(data), offset) for offset, data in enumerate(WIRE)] == decided
    assert records.state_hash() == events.state_hash()
    assert (records.applied, records.duplicates, records.rejected) == (events.applied, events.duplicates,
                                                                        events.rejected)
    assert records.rejected > 0 and records.duplicates > 0  # the log has stale ops and re-published ones
    key = next(e.key for e in records.experiences.values())
    assert not key.flags.writeable and key.dtype == np.dtype("<f2")


def test_what_the_fast_reader_declines_goes_to_the_full_decoder_which_decides():
    payload = json.loads(WIRE[0])
    spaced = json.dumps(payload).encode()  # valid, not in the canonical spelling
    assert read_canonical(spaced) is None
    assert same_op(read_canonical(WIRE[0]), read_op(spaced))
    unicode_id = json.dumps({**payload, "op_id": "op-\u00e9"}, separators=(",", ":"), ensure_ascii=False).encode()
    assert read_canonical(unicode_id) is None and read_op(unicode_id).op_id == "op-\u00e9"  # valid: decode_op says so
    with pytest.raises(MalformedPayloadError):
        read_op(None)
    with pytest.raises(MalformedPayloadError):
        read_op(b"not json")
    nan_key = dict(payload, key=dict(payload["key"], data=base64.b64encode(
        np.full(payload["key"]["dim"], np.nan, "<f2").tobytes()).decode()))
    with pytest.raises(EventDecodeError, match="NaN or infinite"):
        read_op(msgspec.json.encode(nan_key))


def test_a_key_record_is_a_read_only_float16_view():
    vector = KeyRecord(model="m", dim=2, data=np.array([0.5, -1.0], "<f2").tobytes()).float16()
    assert vector.tolist() == [0.5, -1.0] and not vector.flags.writeable


_TEXTS = st.one_of(
    st.sampled_from(["", "a", "a b", " ", "\t", "x\n", "\u00a0", "\u2028", "\x1c", "\x7f", "\u00e9", "\ud83d\ude00",
                     "x" * 256, "x" * 257, "y" * 4000, "y" * 4001, "1", "null"]),
    st.text(max_size=20),
)
_VALUES = st.one_of(
    _TEXTS,
    st.integers(-3, 3), st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 65536, 65537]),
    st.booleans(), st.none(), st.floats(allow_nan=False, allow_infinity=False),
    st.lists(_TEXTS, max_size=3),
    st.sampled_from(["2026-12-02T12:26:30Z", "2026-12-02T12:26:30.1Z", "2026-12-02T12:26:30+01:00",
                     "2026-12-02T12:26:30", "2026-02-30T12:26:30Z", "2026-12-02 12:26:30Z", "2026-12-02T24:00:00Z",
                     "2026-12-02T12:26:60Z", "2026-12-02t12:26:30z", "2026-12-02T12:26:30.1234567Z",
                     "2026-12-02T12:26:30-00:00", "2026-12-02T12:26:30+24:00",
                     "CD3808A6-F743-4B5D-84F9-E391E03DBF6D", "cd3808a6f7434b5d84f9e391e03dbf6d",
                     "{cd3808a6-f743-4b5d-84f9-e391e03dbf6d}", "cd3808a6-f743-4b5d-84f9-e391e03dbf6",
                     "merge_discard", "capacity", "retired"]),
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every field's path in a payload (into nested objects and lists)."""
    paths = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for name, value in items:
        paths.append((*prefix, name))
        paths += _paths(value, (*prefix, name))
    return paths


def _set(node: Any, path: tuple, value: Any, remove: bool) -> None:
    for part in path[:-1]:
        node = node[part]
    if remove:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def _key_data(draw: Any, dim: int) -> str:
    values = np.array(draw(st.lists(st.sampled_from([0.0, -0.0, 1.5, 65504.0, np.inf, -np.inf, np.nan]),
                                    min_size=dim, max_size=dim)), "<f2")
    text = base64.b64encode(values.tobytes()).decode()
    return draw(st.sampled_from([text, text.rstrip("="), text + "=", text[:-4], text.replace("A", "-"), text + "AA=="]))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_broken_or_odd_record_is_read_fast_only_when_the_full_decoder_reads_it_the_same(data):
    payload = json.loads(data.draw(st.sampled_from(WIRE[:60])))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(payload)
        path = data.draw(st.sampled_from([*paths, ("extra_field",), ("key", "extra")]))
        if path[-1] == "data" and path[0] == "key":
            dim = payload["key"].get("dim")
            dim = dim if type(dim) is int and 0 <= dim <= 400 else 2
            value: Any = _key_data(data.draw, data.draw(st.sampled_from([dim, 2, 3])))
        else:
            value = data.draw(_VALUES)
        try:
            _set(payload, path, value, remove=data.draw(st.booleans()) and path[-1] not in ("extra_field", "extra"))
        except (KeyError, IndexError, TypeError):
            continue
    spelling = data.draw(st.sampled_from(["msgspec", "compact", "ascii"]))
    if spelling == "msgspec":
        try:
            wire = msgspec.json.encode(payload)
        except UnicodeEncodeError:  # a lone surrogate: only an escape can write it
            spelling = "ascii"
    if spelling != "msgspec":
        wire = json.dumps(payload, separators=(",", ":"), ensure_ascii=spelling == "ascii").encode("utf-8",
                                                                                                 "surrogatepass")
    fast = read_canonical(wire)
    try:
        full = decode_op(wire)
    except EventDecodeError:
        full = None
    if fast is not None:
        assert full is not None, f"read fast, but decode_op rejects it: {wire[:300]!r}"
        assert same_op(fast, full)
    if full is None:
        with pytest.raises(EventDecodeError):
            read_op(wire)
