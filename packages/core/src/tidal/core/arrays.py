"""`Array`: a dtype and shape over a contiguous little-endian byte buffer.

Arrays are how token ids, logprobs and weights cross the wire. A small array rides inline in the
msgpack header; a large one leaves the header and travels as its own ZeroMQ frame, zero-copy, so a
64 MiB tensor is never copied by the protocol layer. Routing a message needs neither numpy nor torch:
only `.numpy()` imports numpy, and torch users build tensors with ``torch.frombuffer(a.data, ...)``.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from tidal.core.errors import ProtocolError

if TYPE_CHECKING:
    import numpy as np

# dtype name -> bytes per element. Names follow numpy/torch spelling; bfloat16 and float8 have no
# numpy dtype, so `.numpy()` refuses them and torch callers reinterpret the raw bytes.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# Upper bound on dimensions, so a hostile header cannot make us allocate a giant shape tuple.
MAX_NDIM = 32


class Array:
    """A typed view of raw little-endian bytes. ``data`` is a flat ``memoryview`` of unsigned bytes."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: Any, dtype: str, shape: tuple[int, ...] | list[int]) -> None:
        if dtype not in ITEMSIZE:
            raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(ITEMSIZE)}")
        view = memoryview(data)
        if not view.c_contiguous:
            raise ValueError("Array data must be C-contiguous; call .copy() / .contiguous() first")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        shape = tuple(int(d) for d in shape)
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise ValueError(f"bad shape {shape}: at most {MAX_NDIM} non-negative dimensions")
        expected = math.prod(shape) * ITEMSIZE[dtype]
        if view.nbytes != expected:
            raise ValueError(
                f"{view.nbytes} bytes of data do not fit dtype {dtype} and shape {shape} "
                f"(expected {expected} bytes)"
            )
        self.data = view
        self.dtype = dtype
        self.shape = shape

    @classmethod
    def _trusted(cls, data: memoryview, dtype: str, shape: tuple[int, ...]) -> Array:
        """Construct without validation: for the decoder, which has already checked everything."""
        self = object.__new__(cls)
        self.data = data
        self.dtype = dtype
        self.shape = shape
        return self

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> Array:
        """Wrap a numpy array without copying when it is already C-contiguous and little-endian."""
        import numpy as np

        if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        name = arr.dtype.name
        if name not in ITEMSIZE:
            raise ValueError(f"numpy dtype {arr.dtype} cannot travel; supported: {', '.join(ITEMSIZE)}")
        # reshape(-1) keeps 0-d arrays viewable as bytes; memoryview of a 0-d array cannot cast.
        return cls(arr.reshape(-1).view(np.uint8), name, arr.shape)

    @classmethod
    def from_list(cls, values: list[int] | list[float], dtype: str) -> Array:
        """Build from a Python list (convenience for tests and small payloads)."""
        import numpy as np

        return cls.from_numpy(np.asarray(values, dtype=dtype))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view (read-only when the bytes came off the wire)."""
        import numpy as np

        if self.dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            raise TypeError(
                f"numpy has no {self.dtype}; use torch.frombuffer(array.data, dtype=torch.{self.dtype})"
            )
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def tolist(self) -> list[Any]:
        return self.numpy().tolist()

    def tobytes(self) -> bytes:
        return self.data.tobytes()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Array):
            return NotImplemented
        return self.dtype == other.dtype and self.shape == other.shape and self.data == other.data

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Array(dtype={self.dtype}, shape={self.shape}, nbytes={self.nbytes})"


_new = object.__new__


def check_wire_array(obj: Any, frames: Any, used: list[bool]) -> Array:
    """Build an Array from the `[dtype, shape, data_or_frame_index]` triple of a decoded header.

    This runs once per array per received message, so it is written for speed; it still checks
    everything. Raises ValueError/TypeError, which msgspec turns into a ValidationError naming the field.
    """
    if type(obj) is not list or len(obj) != 3:
        raise TypeError("expected an array header [dtype, shape, data]")
    dtype, shape, data = obj
    size = ITEMSIZE.get(dtype) if type(dtype) is str else None
    if size is None:
        raise ValueError(f"unknown array dtype {dtype!r}")
    if type(shape) is not list:
        raise TypeError(f"array shape must be a list of at most {MAX_NDIM} ints")
    if len(shape) == 1:  # the common case, token ids and logprobs
        d = shape[0]
        if type(d) is not int or d < 0:
            raise ValueError(f"array shape {shape!r} has a dimension that is not a non-negative int")
        size *= d
        shape_t: tuple[int, ...] = (d,)
    else:
        if len(shape) > MAX_NDIM:
            raise TypeError(f"array shape must be a list of at most {MAX_NDIM} ints")
        for d in shape:
            if type(d) is not int or d < 0:
                raise ValueError(f"array shape {shape!r} has a dimension that is not a non-negative int")
            size *= d
        shape_t = tuple(shape)
    if type(data) is bytes:
        view = memoryview(data)
    elif type(data) is int:
        if not 0 <= data < len(frames):
            raise ValueError(f"array refers to frame {data} but the message has {len(frames)} data frames")
        if used[data]:
            raise ValueError(f"data frame {data} is referenced twice")
        used[data] = True
        frame = frames[data]
        view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    else:
        raise TypeError("array data must be bytes or a frame index")
    if view.nbytes != size:
        raise ValueError(f"{view.nbytes} bytes of data do not fit dtype {dtype} and shape {shape_t}")
    arr = _new(Array)
    arr.data = view
    arr.dtype = dtype
    arr.shape = shape_t
    return arr


__all__ = ["ITEMSIZE", "Array", "ProtocolError", "check_wire_array"]
