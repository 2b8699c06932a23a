"""The fast decode of float16 vectors off the wire (`schemas.arrays._wire_float16s`) and the op topic's adapter
without a string cache: the same events and the same errors as the general path they short-cut.

Run: pytest tests/unit/schemas/test_float16_wire_decode.py
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from pipeline.bank.synthetic import synthetic_op_log
from schemas.arrays import EmbeddingVector, PackedFloats, _floats, _from_base64, _wire_float16s
from schemas.codec import InvalidEventError, decode, encode
from schemas.topics import EXPERIENCE_OPS_TOPIC


def general_path(text: str) -> PackedFloats:
    """What `_floats` did with a wire string before the fast path (and still does for anything it declines)."""
    wire = _from_base64(text, "<f2")
    if not np.isfinite(wire).all():
        raise ValueError("NaN or infinite values are not allowed")
    return PackedFloats(wire.tobytes(), "<f2")


@pytest.mark.parametrize(("text", "values"), [
    ("ADw=", (1.0,)),          # 0x3C00
    ("/3s=", (65504.0,)),      # 0x7BFF, the largest finite float16
    ("AIA=", (-0.0,)),         # 0x8000
    ("AQA=", (2.0**-24,)),     # 0x0001, the smallest subnormal
    ("ADwAwA==", (1.0, -2.0)),  # 0x3C00, 0xC000
    ("", ()),
])
def test_finite_values_decode_to_their_packed_bytes(text: str, values: tuple[float, ...]) -> None:
    packed = _wire_float16s(text)
    assert packed is not None
    assert packed == values and packed.packed == base64.b64decode(text) and packed.dtype == "<f2"
    assert len(packed) == len(values)
    assert _floats(text, "<f2").packed == general_path(text).packed


@pytest.mark.parametrize("text", [
    "AHw=",      # 0x7C00 +inf
    "APw=",      # 0xFC00 -inf
    "AH4=",      # 0x7E00 NaN
    "/38=",      # 0x7FFF NaN
    "ADz8/w==",  # 1.0 then 0xFFFC, a NaN
])
def test_nan_and_infinity_are_declined_and_rejected_with_the_general_message(text: str) -> None:
    assert _wire_float16s(text) is None
    with pytest.raises(ValueError, match=r"^NaN or infinite values are not allowed$"):
        _floats(text, "<f2")


def test_every_float16_bit_pattern_is_decided_as_numpy_decides_it() -> None:
    patterns = np.arange(2**16, dtype="<u2")
    finite = np.isfinite(patterns.view("<f2"))
    assert int(finite.sum()) == 2**16 - 2 * 1024  # 31 * 2048 finite patterns: all but exponent 0x1F, both signs
    for pattern, expected in zip(patterns.tolist(), finite.tolist(), strict=True):
        text = base64.b64encode(pattern.to_bytes(2, "little")).decode()
        assert (_wire_float16s(text) is not None) == expected, hex(pattern)


@pytest.mark.parametrize(("text", "message"), [
    ("AA==", "1 bytes is not a whole number of <f2 items"),
    ("!!!!", "not valid base64: Only base64 data is allowed"),
    ("AAA", "not valid base64: Incorrect padding"),
    ("ADw=ADw=", "not valid base64: Excess data after padding"),
    ("éé", "not valid base64: string argument should contain only ASCII characters"),
])
def test_bad_base64_keeps_its_exact_message(text: str, message: str) -> None:
    assert _wire_float16s(text) is None
    with pytest.raises(ValueError, match=r".") as caught:
        _floats(text, "<f2")
    assert str(caught.value) == message


def test_a_bad_vector_in_an_op_is_still_an_invalid_event_naming_the_field() -> None:
    op = synthetic_op_log(1, seed=0)[0]
    payload = json.loads(encode(op))
    payload["key"]["data"], payload["key"]["dim"] = "AHw=", 1
    with pytest.raises(InvalidEventError) as caught:
        decode(EXPERIENCE_OPS_TOPIC, json.dumps(payload).encode())
    assert str(caught.value) == ("ExperienceAdded: ExperienceAdded.key.data: Value error, NaN or infinite values are"
                                 " not allowed")


def test_decoded_ops_equal_the_ops_encoded_field_by_field() -> None:
    ops = synthetic_op_log(400, seed=3)
    kinds = set()
    for op in ops:
        decoded = decode(EXPERIENCE_OPS_TOPIC, encode(op))
        kinds.add(decoded.kind)
        assert type(decoded) is type(op)
        assert decoded == op
        assert decoded.model_fields_set == set(type(op).model_fields)  # encode writes every field
        assert encode(decoded) == encode(op)  # the wire is unchanged
        key = getattr(op, "key", None)
        if key is not None:
            assert decoded.key.data.packed == key.data.packed
            assert decoded.key.float16().tolist() == key.float16().tolist()
    assert kinds == {"ExperienceAdded", "ExperienceRefined", "ExperienceMerged", "ExperienceRetired"}


def test_a_vector_built_in_python_takes_the_general_path() -> None:
    vector = EmbeddingVector.from_array("m", [1.0, -2.0, 65504.0])
    assert vector.data == (1.0, -2.0, 65504.0) and len(vector.data) == 3
    with pytest.raises(ValueError, match="overflow"):
        EmbeddingVector.from_array("m", [1e6])
