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
# Defaults fit control traffic (Hello, Heartbeat, Control, Metrics, Acks): a channel that carries more
# (trajectories, batches, weights) says so with its own limits. Every Channel also sets ZeroMQ's MAXMSGSIZE
# from these, so a frame over them is dropped by libzmq before it is ever buffered whole.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024**2
DEFAULT_MAX_HEADER_BYTES = 16 * 1024**2
DEFAULT_MAX_FRAMES = 65_536
# An error path names the offending field by walking the Struct types (no untyped decode of the body); the
# text msgspec gives may quote a value, so it is cut to this many characters.
MAX_ERROR_TEXT = 300

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
                peer=peer, reason="not_tidal",
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
                except Exception:  # any kind (RecursionError from a nested body, ...): named below
                    pass
        if n == 0:
            raise ProtocolError("empty message: no frames", peer=peer, reason="frames")
        if n > self.max_frames:
            raise ProtocolError(f"message has {n} frames; limit is {self.max_frames}", peer=peer, reason="frames")
        header = frames[0]
        if type(header) is not bytes:
            header = memoryview(header.buffer if hasattr(header, "buffer") else header)
        body = self.check_preamble(header, peer)
        size = len(body)
        if size > self.max_header_bytes:
            raise ProtocolError(
                f"message header is {size} bytes; limit is {self.max_header_bytes} "
                "(raise max_header_bytes on the receiving channel's codec if this is intended)",
                peer=peer, reason="too_large",
            )
        if n == 1:  # the common case: no data frames, no decode context to set up
            return self._decode_body(body, peer)
        data_frames = frames[1:]
        size += sum(len(f) for f in data_frames)
        if size > self.max_message_bytes:
            raise ProtocolError(
                f"message is {size} bytes; limit is {self.max_message_bytes} "
                "(raise max_message_bytes on the receiving channel if this is intended)",
                peer=peer, reason="too_large",
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
            raise ProtocolError(f"frames {unused} are not referenced by the {type(msg).__name__} header", peer=peer,
                                reason="frames")
        return msg

    def _decode_body(self, body: memoryview, peer: bytes | None) -> Message:
        """Decode the msgpack body. Every failure, of whatever exception type (msgspec's, a RecursionError
        from a deeply nested body, a MemoryError, an Array hook's), is a ProtocolError naming it."""
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as e:
            other = _tag_of(body)
            if other in _TAGS and other not in self._expects:
                raise ProtocolError(f"this endpoint takes {' or '.join(self._expects)} messages, not {other}",
                                    field="message type", peer=peer, reason="wrong_type") from None
            error = str(e)
            field = _field_of(error, other)
            text = f"invalid {field or 'message'}: {_cut(_strip_path(error))}"
            raise ProtocolError(text, field=field, peer=peer, reason="invalid") from None
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed message header: {_cut(str(e))}", peer=peer, reason="malformed") from None
        except ProtocolError:
            raise
        except RecursionError:
            raise ProtocolError(
                f"message header of {len(body)} bytes nests too deeply to decode (a Tidal message nests a few "
                "levels; is the peer sending hostile or corrupt data?)", peer=peer, reason="undecodable",
            ) from None
        except Exception as e:  # MemoryError, OverflowError, ...: the message is refused, the receiver lives
            raise ProtocolError(
                f"message header of {len(body)} bytes could not be decoded: {type(e).__name__}: {_cut(str(e))}",
                peer=peer, reason="undecodable",
            ) from None


# ---------------------------------------------------------------------- error paths -> field names

_MAX_TAG = 64  # bytes: a message tag is a class name


def _tag_of(body: memoryview | bytes) -> str | None:
    """The message-type tag a header names, when it names one (a hostile one may put anything there).
    Reads only the msgpack array header and its first element (a str of at most 64 bytes), so a body of
    any size costs nothing here."""
    b = bytes(body[:1 + 4 + 1 + 4 + _MAX_TAG])
    if not b:
        return None
    lead, i = b[0], 1
    if 0x90 <= lead <= 0x9F:  # fixarray
        count = lead & 0x0F
    elif lead == 0xDC:  # array 16
        count, i = int.from_bytes(b[1:3], "big"), 3
    elif lead == 0xDD:  # array 32
        count, i = int.from_bytes(b[1:5], "big"), 5
    else:
        return None
    if count == 0 or i >= len(b):
        return None
    lead = b[i]
    if 0xA0 <= lead <= 0xBF:  # fixstr
        n, i = lead & 0x1F, i + 1
    elif lead == 0xD9:  # str 8
        n, i = b[i + 1] if i + 1 < len(b) else -1, i + 2
    elif lead == 0xDA:  # str 16
        n, i = int.from_bytes(b[i + 1:i + 3], "big"), i + 3
    elif lead == 0xDB:  # str 32
        n, i = int.from_bytes(b[i + 1:i + 5], "big"), i + 5
    else:
        return None
    if n < 0 or n > _MAX_TAG or i + n > len(b):
        return None
    try:
        return b[i:i + n].decode("utf-8")
    except UnicodeDecodeError:
        return None


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT] + f"... ({len(text)} characters)"


def _strip_path(text: str) -> str:
    return _PATH_RE.sub("", text)


def _field_of(error: str, tag: str | None) -> str | None:
    """Turn msgspec's positional path (`$[5][0][2]`) into `Batch.trajectories[0].logprobs`, walking the
    types of the message `tag` names (nothing of the body is decoded again)."""
    m = _PATH_RE.search(error)
    if not m:
        return None
    steps = re.findall(r"\[(\d+)\]|\.(\w+)|\[('[^']*'|\"[^\"]*\")\]", m.group("path")[:MAX_ERROR_TEXT])
    typ: Any = _TAGS.get(tag) if tag is not None else None
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


__all__ = ["DEFAULT_INLINE_THRESHOLD", "DEFAULT_MAX_HEADER_BYTES", "DEFAULT_MAX_MESSAGE_BYTES", "MAGIC", "Codec"]
