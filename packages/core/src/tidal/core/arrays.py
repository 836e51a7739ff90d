"""`Array`: a dtype and shape over a contiguous little-endian byte buffer.

Arrays are how token ids, logprobs and weights cross the wire. An Array is itself a msgspec Struct,
``[dtype, shape, data]`` on the wire, so decoding one is done by msgspec in C: the dtype is checked
against the known names and the shape against non-negative ints there, and `__post_init__` checks the
byte count. A small array's bytes ride inline in the msgpack header; a large one (at least
`OUT_OF_LINE_BYTES`, or when asked) leaves the header and travels as its own ZeroMQ frame, zero-copy,
with the frame's index in ``data``, so a 64 MiB tensor is never copied by the protocol layer.

Routing a message needs neither numpy nor torch: only `.numpy()` imports numpy; torch users build
tensors with ``torch.frombuffer(array.buffer, dtype=...)``.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

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

# Upper bound on dimensions, so a hostile header cannot make us build a giant shape tuple.
MAX_NDIM = 32
# Arrays at least this large travel as their own frame; ZeroMQ copies smaller frames anyway.
OUT_OF_LINE_BYTES = 64 * 1024

DType = Literal[
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
]
Shape = Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_NDIM)]


class OutOfLine:
    """A buffer that travels as its own frame (not inside the msgpack header)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutOfLine) and self.view == other.view

    __hash__ = None  # type: ignore[assignment]  # mypy types __hash__ as a method; None marks the class unhashable


class _DecodeContext(threading.local):
    frames: Any = ()
    used: list[bool] | None = None


# Set by the codec around one decode call: the data frames that `Array.data` indices refer to.
decode_context = _DecodeContext()


def _byte_view(data: Any) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("Array data must be C-contiguous; call .copy() / .contiguous() first")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class Array(msgspec.Struct, array_like=True, gc=False):
    """A typed view of raw little-endian bytes. Build with `Array.from_numpy` / `Array.from_buffer`.

    ``data`` holds the bytes as received or given (``bytes``, a ``memoryview``, or `OutOfLine` for a
    frame-backed buffer); use `buffer` for a flat ``memoryview`` in every case.
    """

    dtype: DType  # element type name (ITEMSIZE keys)
    shape: Shape  # dimensions, each >= 0, at most MAX_NDIM of them
    data: bytes | int  # on the wire: inline bytes, or the index (from 0) of the data frame holding them

    def __post_init__(self) -> None:
        data = self.data
        size = ITEMSIZE.get(self.dtype)
        shape = self.shape
        # the hot path, checked first: a 1-D array decoded inline (bytes of the right length)
        if type(data) is bytes and type(shape) is tuple and len(shape) == 1 and size is not None:
            if len(data) == size * shape[0]:
                return
        if size is None:  # only reachable by direct construction: decoding validates the name in C
            raise ValueError(f"unknown dtype {self.dtype!r}; supported: {', '.join(ITEMSIZE)}")
        if type(self.shape) is not tuple:
            self.shape = tuple(self.shape)
        for d in self.shape:
            size *= d
        if type(data) is bytes:  # decoded inline (the hot path) or given as bytes
            n = len(data)
        elif type(data) is int:  # decoded: the bytes are in a data frame
            ctx = decode_context
            frames, used = ctx.frames, ctx.used
            if used is None or not 0 <= data < len(frames):
                raise ValueError(f"array refers to frame {data} but the message has {len(frames)} data frames")
            if used[data]:
                raise ValueError(f"data frame {data} is referenced twice")
            used[data] = True
            frame = frames[data]
            view = _byte_view(frame.buffer if hasattr(frame, "buffer") else frame)
            # `data` is declared as its wire type (what msgspec decodes); from here on it holds the frame's bytes
            self.data = OutOfLine(view)  # type: ignore[assignment]  # the wire type, not the held type
            n = view.nbytes
        elif type(data) is OutOfLine:
            n = data.view.nbytes
        else:  # a user's buffer: numpy array, bytearray, memoryview, ...
            view = _byte_view(data)
            self.data = OutOfLine(view) if view.nbytes >= OUT_OF_LINE_BYTES else view  # type: ignore[assignment]  # the wire type, not the held type
            n = view.nbytes
        if n != size:
            raise ValueError(f"{n} bytes of data do not fit dtype {self.dtype} and shape {self.shape} (expected {size})")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_buffer(cls, data: Any, dtype: str, shape: tuple[int, ...] | list[int], *, out_of_line: bool | None = None) -> Array:
        """Wrap any C-contiguous buffer (not copied). `out_of_line` forces (True) or forbids (False) a
        frame of its own; by default arrays of at least OUT_OF_LINE_BYTES get one."""
        if dtype not in ITEMSIZE:
            raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(ITEMSIZE)}")
        shape = tuple(int(d) for d in shape)
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise ValueError(f"bad shape {shape}: at most {MAX_NDIM} non-negative dimensions")
        view = _byte_view(data)
        held: memoryview | OutOfLine = view
        if out_of_line is not None:
            held = OutOfLine(view) if out_of_line else view
        return cls(dtype, shape, held)  # type: ignore[arg-type]  # `data` is declared as its wire type (see __post_init__)

    @classmethod
    def from_numpy(cls, arr: np.ndarray, *, out_of_line: bool | None = None) -> Array:
        """Wrap a numpy array without copying when it is already C-contiguous and little-endian."""
        import numpy as np  # heavy: routing a message must not import numpy (module docstring)

        if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        name = arr.dtype.name
        if name not in ITEMSIZE:
            raise ValueError(f"numpy dtype {arr.dtype} cannot travel; supported: {', '.join(ITEMSIZE)}")
        # reshape(-1) keeps 0-d arrays viewable as bytes; memoryview of a 0-d array cannot cast.
        return cls.from_buffer(arr.reshape(-1).view(np.uint8), name, arr.shape, out_of_line=out_of_line)

    @classmethod
    def from_list(cls, values: list[int] | list[float], dtype: str) -> Array:
        """Build from a Python list (convenience for tests and small payloads)."""
        import numpy as np  # heavy: routing a message must not import numpy (module docstring)

        return cls.from_numpy(np.asarray(values, dtype=dtype))

    # ------------------------------------------------------------------ access

    @property
    def buffer(self) -> memoryview:
        """The bytes as a flat memoryview (zero-copy)."""
        data = self.data
        if type(data) is OutOfLine:
            return data.view
        return memoryview(data)  # type: ignore[arg-type]  # after __post_init__ never a frame index (int)

    @property
    def out_of_line(self) -> bool:
        return type(self.data) is OutOfLine

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view (read-only when the bytes came off the wire)."""
        import numpy as np  # heavy: routing a message must not import numpy (module docstring)

        if self.dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            raise TypeError(
                f"numpy has no {self.dtype}; use torch.frombuffer(array.buffer, dtype=torch.{self.dtype})"
            )
        return np.frombuffer(self.buffer, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def tolist(self) -> list[Any]:
        return self.numpy().tolist()

    def tobytes(self) -> bytes:
        return self.buffer.tobytes()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Array):
            return NotImplemented
        return self.dtype == other.dtype and self.shape == other.shape and self.buffer == other.buffer

    __hash__ = None  # type: ignore[assignment]  # mypy types __hash__ as a method; None marks the class unhashable

    def __repr__(self) -> str:
        where = ", out_of_line" if self.out_of_line else ""
        return f"Array(dtype={self.dtype}, shape={self.shape}, nbytes={self.nbytes}{where})"


__all__ = ["ITEMSIZE", "MAX_NDIM", "OUT_OF_LINE_BYTES", "Array", "OutOfLine", "decode_context"]
