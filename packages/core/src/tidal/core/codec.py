"""Messages <-> ZeroMQ frames, with typed decoding and errors that name the field.

Frame layout of one message::

    frame 0      b"\\xd7T" + major + minor (4 bytes) + msgpack header (the Struct, array_like)
    frame 1..n   raw little-endian bytes of each out-of-line `Array`, in the order the header refers to them

A small `Array` rides inside the header as msgpack bin; ZeroMQ copies small frames anyway, and one frame
is cheaper than five. Arrays marked out of line (64 KiB or more by default) become their own frames and
are sent with ``copy=False``, so their bytes are never copied by Tidal. The header refers to a frame by
index. A codec with a huge `inline_threshold` puts even those inline (one self-contained frame).

The 4-byte preamble lets any receiver refuse a peer of another major protocol version with an error that
names both versions, on every socket pattern, before it tries to parse anything.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

from tidal.core.arrays import OutOfLine, decode_context
from tidal.core.errors import ProtocolError, ProtocolVersionError
from tidal.core.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Message

MAGIC = b"\xd7T"
PREAMBLE_BYTES = 4

DEFAULT_INLINE_THRESHOLD = 0  # out-of-line arrays smaller than this go inline anyway
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024**3
DEFAULT_MAX_HEADER_BYTES = 256 * 1024**2
DEFAULT_MAX_FRAMES = 65_536

_TAGS: dict[str, type[msgspec.Struct]] = {t.__name__: t for t in MESSAGE_TYPES}
_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")


class Codec:
    """Encodes and decodes protocol messages. One per channel: it is not thread-safe."""

    def __init__(
        self,
        *,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_frames: int = DEFAULT_MAX_FRAMES,
        protocol: tuple[int, int] = PROTOCOL_VERSION,
        message_type: Any = Message,
    ) -> None:
        self.inline_threshold = inline_threshold
        self.max_message_bytes = max_message_bytes
        self.max_header_bytes = max_header_bytes
        self.max_frames = max_frames
        self.protocol = protocol
        self._preamble = MAGIC + bytes(protocol)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(message_type)
        # A narrower decoder (one message type) is faster; a message of another type then gets an error
        # that names both.
        args = typing.get_args(message_type)
        self._expects = [t.__name__ for t in args] if args else [getattr(message_type, "__name__", str(message_type))]
        # Per-call state for the encode hook (msgspec hooks take no context argument).
        self._out_frames: list[memoryview] = []

    # ------------------------------------------------------------------ encode

    def _enc_hook(self, obj: Any) -> Any:
        if type(obj) is OutOfLine:
            view = obj.view
            if view.nbytes >= self.inline_threshold:
                self._out_frames.append(view)
                return len(self._out_frames) - 1
            return view
        raise NotImplementedError(f"{type(obj).__name__} cannot travel on the Tidal wire; use tidal.core.Array")

    def encode(self, msg: Message) -> list[Any]:
        """Frames for `msg`: the header, then one buffer per out-of-line array (not copied)."""
        self._out_frames = []
        header = bytearray(self._preamble)
        try:
            self._encoder.encode_into(msg, header, PREAMBLE_BYTES)
        finally:
            frames, self._out_frames = self._out_frames, []
        return [header, *frames]

    # ------------------------------------------------------------------ decode

    def check_preamble(self, header: Any, peer: bytes | None = None) -> memoryview:
        """The msgpack body of a header frame, after checking magic and major version."""
        if len(header) < PREAMBLE_BYTES or header[:2] != MAGIC:
            raise ProtocolError(
                "not a Tidal message: the first frame lacks the Tidal preamble "
                "(is another program sending to this endpoint?)",
                peer=peer,
            )
        if header[2] != self.protocol[0]:
            raise ProtocolVersionError(ours=self.protocol, theirs=(header[2], header[3]), peer=peer)
        return memoryview(header)[PREAMBLE_BYTES:]

    def decode(self, frames: Sequence[Any], peer: bytes | None = None) -> Message:
        """Decode one message. Raises ProtocolError for anything that is not a valid message."""
        n = len(frames)
        if n == 1:  # the hot path (one self-contained frame, bytes or a read-only byte view), checked inline
            header = frames[0]
            if ((type(header) is bytes or (type(header) is memoryview and header.readonly and header.ndim == 1
                                           and header.format == "B"))
                    and PREAMBLE_BYTES < len(header) <= self.max_header_bytes + PREAMBLE_BYTES
                    and header[:2] == MAGIC and header[2] == self.protocol[0]):
                try:
                    return self._decoder.decode(memoryview(header)[PREAMBLE_BYTES:])
                except msgspec.MsgspecError:
                    pass
        if n == 0:
            raise ProtocolError("empty message: no frames", peer=peer)
        if n > self.max_frames:
            raise ProtocolError(f"message has {n} frames; limit is {self.max_frames}", peer=peer)
        header = frames[0]
        if type(header) is not bytes:
            header = memoryview(header.buffer if hasattr(header, "buffer") else header)
        body = self.check_preamble(header, peer)
        size = len(body)
        if size > self.max_header_bytes:
            raise ProtocolError(f"message header is {size} bytes; limit is {self.max_header_bytes}", peer=peer)
        if n == 1:  # the common case: no data frames, no decode context to set up
            return self._decode_body(body, peer)
        data_frames = frames[1:]
        size += sum(len(f) for f in data_frames)
        if size > self.max_message_bytes:
            raise ProtocolError(
                f"message is {size} bytes; limit is {self.max_message_bytes} "
                "(raise max_message_bytes on the receiving channel if this is intended)",
                peer=peer,
            )
        used = [False] * (n - 1)
        ctx = decode_context
        ctx.frames, ctx.used = data_frames, used
        try:
            msg = self._decode_body(body, peer)
        finally:
            ctx.frames, ctx.used = (), None
        if not all(used):
            unused = [i + 1 for i, u in enumerate(used) if not u]
            raise ProtocolError(f"frames {unused} are not referenced by the {type(msg).__name__} header", peer=peer)
        return msg

    def _decode_body(self, body: memoryview, peer: bytes | None) -> Message:
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as e:
            other = _tag_of(body)
            if other in _TAGS and other not in self._expects:
                raise ProtocolError(f"this endpoint takes {' or '.join(self._expects)} messages, not {other}",
                                    field="message type", peer=peer) from None
            field = _field_of(str(e), body)
            text = f"invalid {field or 'message'}: {_strip_path(str(e))}"
            raise ProtocolError(text, field=field, peer=peer) from None
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed message header: {e}", peer=peer) from None


# ---------------------------------------------------------------------- error paths -> field names


def _tag_of(body: memoryview) -> str | None:
    """The message-type tag a header names, when it names one (a hostile one may put anything there)."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None
    return raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], str) else None


def _strip_path(text: str) -> str:
    return _PATH_RE.sub("", text)


def _field_of(error: str, body: memoryview) -> str | None:
    """Turn msgspec's positional path (`$[5][0][2]`) into `Batch.trajectories[0].logprobs`."""
    m = _PATH_RE.search(error)
    if not m:
        return None
    steps = re.findall(r"\[(\d+)\]|\.(\w+)|\[('[^']*'|\"[^\"]*\")\]", m.group("path"))
    try:
        raw = msgspec.msgpack.decode(body)
        tag = raw[0] if isinstance(raw, list) and raw else None
    except Exception:
        tag = None
    typ: Any = _TAGS.get(tag) if isinstance(tag, str) else None
    if typ is None:
        return "message type" if steps[:1] == [("0", "", "")] else None
    out = typ.__name__
    for idx, attr, key in steps:
        if typ is None:
            out += f"[{idx}]" if idx else (f".{attr}" if attr else f"[{key}]")
            continue
        if key or attr:
            out += f"[{key}]" if key else f".{attr}"
            typ = _value_type(typ)
            continue
        i = int(idx)
        struct = _struct_in(typ)
        if struct is not None:
            tagged = struct.__struct_config__.tag is not None
            pos = i - 1 if tagged else i
            fields = msgspec.structs.fields(struct)
            if pos < 0:
                out += ".<type tag>"
                typ = None
            elif pos < len(fields):
                out += f".{fields[pos].name}"
                typ = fields[pos].type
            else:
                out += f"[{i}] (beyond the last field)"
                typ = None
        else:
            out += f"[{i}]"
            typ = _value_type(typ)
    return out


def _struct_in(typ: Any) -> type[msgspec.Struct] | None:
    """The Struct type of `typ`, looking through `X | None` but not into containers."""
    if typing.get_origin(typ) in (list, tuple, dict, Sequence):
        return None
    for t in (typ, *typing.get_args(typ)):
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            return t
    return None


def _value_type(typ: Any) -> Any:
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    origin = typing.get_origin(typ)
    if origin in (list, tuple, Sequence) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    if len(args) == 1:
        return _value_type(args[0])
    return None


__all__ = ["DEFAULT_INLINE_THRESHOLD", "MAGIC", "Codec"]
