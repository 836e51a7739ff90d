"""What `WeightSender` and `WeightReceiver` ask of a transport, declared once, with the defaults of the
optional parts. Every transport subclasses one of these; the sender and receiver call the methods and read
the attributes directly (no probing with ``hasattr``). A transport from another distribution subclasses
them too.

Sender side (`SenderTransport`):
- ``stage(version, buckets, anchor) -> location`` (required): make the packed buckets of `version`
  fetchable; the location goes into the announcement;
- ``streams``: True when ``stage_bucket(version, bucket)`` starts on each bucket as soon as it is packed;
- ``allocator()``: the memory to pack into (shared memory, GPU buffers), or None for the sender's own;
- ``checksum`` and ``pack_device``: the checksum algorithm and where buckets are packed (None: CPU);
- ``abort(version)``: a send given up part way; ``write_manifest(ann)``: the announcement, for transports
  whose receivers read it from the medium (fs); ``reports``: what receivers reported per version.

Receiver side (`ReceiverTransport`): ``fetch`` and ``report`` (required); ``zero_copy`` (fetched bytes
stay unchanged until ``release(ann)``, so they are verified and applied in place); ``device`` (where
received buckets go; None: where they arrive).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import CHECKSUM, Bucket


class SenderTransport:
    name = ""
    streams = False  # stage_bucket is called for each bucket as it is packed
    checksum = CHECKSUM
    pack_device: Any = None  # torch.device to pack on; None = CPU memory

    # version -> (ok, detail) per receiver report; transports with a back channel assign their own dict
    # (this shared one is only ever read)
    reports: dict[int, list[tuple[bool, str]]] = {}

    def allocator(self) -> Callable[[int, int], Any] | None:
        """(bucket index, bytes) -> the buffer to pack that bucket into; None: the sender's own pool."""
        return None

    def stage_bucket(self, version: int, bucket: Bucket) -> None:
        """A bucket of `version` is packed (only called when `streams`)."""

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement stage()")

    def abort(self, version: int) -> None:
        """The send of `version` failed part way: drop what was staged of it."""

    def write_manifest(self, ann: WeightsAvailable) -> None:
        """The announcement of a staged version (for receivers that read it from the medium)."""

    def close(self) -> None:
        pass


class ReceiverTransport:
    name = ""
    zero_copy = False  # fetched payloads stay unchanged until release(): verify and apply in place
    device: Any = None  # where received buckets go; None = where they arrive

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must implement fetch()")

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        """Tell the sender whether `ann` was applied (transports with a back channel)."""

    def release(self, ann: WeightsAvailable) -> None:
        """Zero-copy transports: the payloads of `ann` may be reused."""

    def cancel(self) -> None:
        """Give up the fetch in progress, if any, soon (from another thread): it raises
        `WeightFetchCancelled`. Transports whose fetch cannot wait on a dead sender need not."""

    def close(self) -> None:
        pass


__all__ = ["ReceiverTransport", "SenderTransport"]
