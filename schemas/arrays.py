"""Compact arrays inside events.

Token ids, log-probs and embedding vectors are the bulk of a trajectory. In Python they are immutable, comparable and
hashable (so frozen events stay frozen): token ids are plain tuples, floats are `PackedFloats`, which equal the tuple
of their values but keep the packed bytes and make Python floats only when asked. On the wire they are base64 strings
of little-endian machine arrays, which is 3-6x smaller than a JSON list and decodes with one `numpy.frombuffer`:

| type           | Python value                                   | wire format                          |
|----------------|------------------------------------------------|--------------------------------------|
| `TokenIds`     | `tuple[int, ...]`                              | base64 of int32 (`<i4`)              |
| `LogProbs`     | `PackedFloats` (== `tuple[float, ...]`)        | base64 of float32 (`<f4`)            |
| `Float16s`     | `PackedFloats` (== `tuple[float, ...]`)        | base64 of float16 (`<f2`)            |

Values are quantised to the wire dtype when an event is built, so `decode(encode(event)) == event` holds exactly.
NaN and infinity are rejected everywhere: a NaN log-prob poisons a whole training step.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema, model_validator

_BASE64_STRING = {"type": "string", "contentEncoding": "base64"}


def _from_base64(text: str, dtype: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not valid base64: {exc}") from exc
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise ValueError(f"{len(raw)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(raw, dtype=dtype)


def _to_base64(values: Sequence[float], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        array = _from_base64(value, "<i4")
    else:
        array = np.asarray(value)
        if array.size == 0:
            return ()
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError("token ids must be a flat sequence of integers")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must lie in [0, 2**31)")
    return tuple(array.tolist())


class PackedFloats(Sequence[float]):
    """Immutable floats kept as the wire dtype's packed bytes: what `LogProbs` and `Float16s` validate to.

    It equals, and hashes like, the tuple of its values (`vector.data == (0.5, 1.0)`), but decoding makes no Python
    float until one is asked for: the tuple is built on first use, while `as_array()` is a view of the bytes. Making
    384 Python floats per embedding was a fifth of the cost of decoding an op log, and nothing in a replay reads them.
    """

    __slots__ = ("_values", "dtype", "packed")

    def __init__(self, packed: bytes, dtype: str) -> None:
        self.packed = packed
        self.dtype = dtype
        self._values: tuple[float, ...] | None = None

    def values(self) -> tuple[float, ...]:
        """The values as a plain tuple (made once)."""
        if self._values is None:
            self._values = tuple(self.as_array().tolist())
        return self._values

    def as_array(self) -> np.ndarray:
        """The values as a read-only array of the wire dtype, without copying."""
        return np.frombuffer(self.packed, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.array(self.as_array(), dtype=dtype)  # always a writable copy

    def __len__(self) -> int:
        itemsize = _ITEMSIZE.get(self.dtype) or np.dtype(self.dtype).itemsize
        return len(self.packed) // itemsize

    def __getitem__(self, index: Any) -> Any:
        return self.values()[index]

    def __iter__(self) -> Iterator[float]:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedFloats):
            same_bytes = self.dtype == other.dtype and self.packed == other.packed
            return same_bytes or self.values() == other.values()  # -0.0 == 0.0, as for tuples
        if isinstance(other, tuple):
            return self.values() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.values())

    def __repr__(self) -> str:
        return repr(self.values())

    def __reduce__(self) -> tuple[Any, ...]:
        return PackedFloats, (self.packed, self.dtype)


_ITEMSIZE = {"<f2": 2, "<f4": 4}
"""Bytes per item of the packed dtypes (`np.dtype(...)` costs more than a dictionary look-up, per call)."""

_FINITE_F16_HIGH_BYTES = bytes(b for b in range(256) if b & 0x7C != 0x7C)
"""The high bytes of the finite float16 values: a float16 is NaN or infinite exactly when its five exponent bits (0x7C
of its high, little-endian second, byte) are all ones."""


def _wire_float16s(text: str) -> PackedFloats | None:
    """Float16 components straight off the wire, when they are valid: strict base64 of a whole number of finite
    float16s. None for anything else, which `_floats` then rejects with its exact message.

    The same decision as the general path (`_from_base64` and `np.isfinite`) with no numpy call: `a2b_base64` in strict
    mode is what `base64.b64decode(validate=True)` runs, and the finiteness check reads the exponent bits of the high
    bytes. The decoded bytes are kept as they are (no copy): they are the packed values.
    """
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        return None
    return PackedFloats(raw, "<f2") if finite_float16s(raw) else None


def finite_float16s(raw: bytes) -> bool:
    """Whether `raw` is a whole number of little-endian float16s, none of them NaN or infinite (no numpy call)."""
    return not (len(raw) & 1 or raw[1::2].translate(None, _FINITE_F16_HIGH_BYTES))


def _floats(value: Any, dtype: str) -> PackedFloats:
    if type(value) is str and dtype == "<f2":  # the hot path of decoding: an embedding off the wire
        packed = _wire_float16s(value)
        if packed is not None:
            return packed
    if isinstance(value, PackedFloats) and value.dtype == dtype:
        return value
    if isinstance(value, str):
        # Off the wire the values are already in `dtype`: no quantisation, only the finiteness check.
        wire = _from_base64(value, dtype)
        if not np.isfinite(wire).all():
            raise ValueError("NaN or infinite values are not allowed")
        return PackedFloats(wire.tobytes(), dtype)
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError("expected a flat sequence of numbers") from exc
    if array.ndim != 1:
        raise ValueError("expected a flat sequence of numbers")
    if not np.isfinite(array).all():
        raise ValueError("NaN or infinite values are not allowed")
    with np.errstate(over="ignore"):  # overflow is reported below as a validation error
        quantised = array.astype(dtype)
    if not np.isfinite(quantised).all():
        raise ValueError(f"values overflow {dtype}")
    return PackedFloats(quantised.tobytes(), dtype)


def _packed_base64(values: Sequence[float], dtype: str) -> str:
    if isinstance(values, PackedFloats) and values.dtype == dtype:
        return base64.b64encode(values.packed).decode("ascii")
    return _to_base64(values, dtype)


TokenIds = Annotated[
    tuple[int, ...],
    PlainValidator(_token_ids),
    PlainSerializer(lambda v: _to_base64(v, "<i4"), return_type=str, when_used="json"),
    WithJsonSchema(_BASE64_STRING),
]
"""Token ids (int32 on the wire)."""

LogProbs = Annotated[
    tuple[float, ...],
    PlainValidator(lambda v: _floats(v, "<f4")),
    PlainSerializer(lambda v: _packed_base64(v, "<f4"), return_type=str, when_used="json"),
    WithJsonSchema(_BASE64_STRING),
]
"""Per-token log-probabilities (float32 on the wire, finite)."""

Float16s = Annotated[
    tuple[float, ...],
    PlainValidator(lambda v: _floats(v, "<f2")),
    PlainSerializer(lambda v: _packed_base64(v, "<f2"), return_type=str, when_used="json"),
    WithJsonSchema(_BASE64_STRING),
]
"""A vector's components (float16 on the wire, finite)."""


class EmbeddingVector(BaseModel):
    """An embedding as it travels in events: float16 components plus the model that made them.

    Replay never calls the embedding model, so the vector and the name of its model go into the log together.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="Embedding model name, e.g. 'all-MiniLM-L6-v2'.")
    dim: int = Field(gt=0, le=65536, description="Number of components; must equal len(data).")
    data: Float16s = Field(description="Components, float16 on the wire.")

    @model_validator(mode="after")
    def _dimension_matches(self) -> EmbeddingVector:
        if len(self.data) != self.dim:
            raise ValueError(f"vector has {len(self.data)} components but dim says {self.dim}")
        return self

    @classmethod
    def from_array(cls, model: str, vector: npt.ArrayLike) -> EmbeddingVector:
        flat = np.asarray(vector, dtype=np.float64).reshape(-1)  # one rounding only: to float16 in the validator
        return cls(model=model, dim=int(flat.size), data=tuple(flat.tolist()))

    def float16(self) -> np.ndarray:
        """The vector as float16, shape (dim,): a read-only view of the validated components (no copy)."""
        if isinstance(self.data, PackedFloats) and self.data.dtype == "<f2":
            return self.data.as_array()
        return np.asarray(self.data, dtype="<f2")  # built without validation (`model_construct`)

    def to_numpy(self) -> np.ndarray:
        """The vector as float32, shape (dim,)."""
        return self.float16().astype(np.float32)
