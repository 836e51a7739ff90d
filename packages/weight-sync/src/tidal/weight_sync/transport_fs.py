"""Filesystem transport: each version is a folder of safetensors shards (one per bucket) plus
`manifest.json`, written under a temporary name and renamed into place, so a reader never sees half a
version. The folder is also a checkpoint: every shard loads with `safetensors.torch.load_file`."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors.torch import load as st_load

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.errors import WeightSyncError
from tidal.weight_sync.transport_base import ReceiverTransport, SenderTransport

log = logging.getLogger(__name__)

# safetensors dtype names (https://github.com/huggingface/safetensors: format)
_ST_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
              "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}


def _safetensors_header(b: Bucket, metadata: dict[str, str]) -> bytes:
    """u64 length + JSON header (padded with spaces to 8 bytes) for a bucket's tensors, which lie back to
    back from offset 0: the bucket's bytes are the file's data section as they are."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for spec in b.specs:
        header[spec.name] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [spec.offset, spec.offset + spec.nbytes]}
    raw = msgspec.json.encode(header)
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


class FsSenderTransport(SenderTransport):
    streams = True  # stage_bucket starts on each bucket as it is packed
    name = "fs"

    def __init__(self, root: str, *, keep: int = 2, fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.fsync = fsync
        self._writing = -1  # the version whose shards are being written
        self._written: set[int] = set()

    def _tmp(self, version: int) -> Path:
        """The folder version `version` is written into, made on its first bucket."""
        tmp = version_dir(self.root, version).with_name(version_dir(self.root, version).name + ".tmp")
        if self._writing != version:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            self._writing, self._written = version, set()
        return tmp

    def stage_bucket(self, version: int, b: Bucket) -> None:
        """Write one shard now, while the sender packs the next bucket."""
        path = self._tmp(version) / f"bucket-{b.index:05d}.safetensors"
        with open(path, "wb") as f:  # the packed bucket is already a safetensors data section: no copy
            f.write(_safetensors_header(b, {"tidal_version": str(version), "bucket": str(b.index)}))
            f.write(b.host().data)
        if self.fsync:
            _fsync(path)
        self._written.add(b.index)

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        tmp = self._tmp(version)
        for b in buckets:
            if b.index not in self._written:
                self.stage_bucket(version, b)
        self._writing = -1
        final = version_dir(self.root, version)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if self.fsync:
            _fsync(self.root, directory=True)
        self._prune(version)
        return str(final)

    def _prune(self, version: int) -> None:
        """Keep the `keep` newest versions up to `version`. A folder of a newer version is from an earlier
        run, or from a timeline that a resume from checkpoint abandoned: it goes too."""
        found = [(int(p.name[1:]), p) for p in self.root.glob("v*")
                 if p.is_dir() and p.name[1:].isdigit()]
        for v, p in found:
            if v > version:
                log.warning("removing %s: version %d is newer than the version %d just written "
                            "(an earlier run's, or abandoned by a resume)", p, v, version)
                shutil.rmtree(p, ignore_errors=True)
        older = sorted((v, p) for v, p in found if v < version)
        for _, p in older[: max(0, len(older) - (self.keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)

    def abort(self, version: int) -> None:
        if self._writing == version:
            shutil.rmtree(self._tmp(version), ignore_errors=True)
            self._writing = -1

    def write_manifest(self, ann: WeightsAvailable) -> None:
        path = Path(ann.location) / "manifest.json"
        path.write_bytes(msgspec.json.encode(ann))

    def close(self) -> None:
        pass


class FsReceiverTransport(ReceiverTransport):
    name = "fs"

    def __init__(self, **_: Any) -> None:
        pass

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        folder = Path(ann.location)
        if not folder.is_dir():
            raise WeightSyncError(f"weights folder {folder} for version {ann.version} does not exist (already pruned?)")
        by_bucket: dict[int, list] = {}
        for spec in ann.manifest:
            by_bucket.setdefault(spec.bucket, []).append(spec)
        for i, size in enumerate(ann.bucket_sizes):
            path = folder / f"bucket-{i:05d}.safetensors"
            try:
                tensors = st_load(path.read_bytes())
            except Exception as e:  # truncated or garbled file
                raise WeightSyncError(f"{path} is not a readable safetensors shard: {e}") from None
            dense = np.zeros(size, dtype=np.uint8)
            for spec in by_bucket.get(i, []):
                if spec.name not in tensors:
                    raise WeightSyncError(f"{path} lacks tensor {spec.name!r}")
                raw = tensors[spec.name].contiguous().reshape(-1).view(torch.uint8).numpy()
                if raw.size != spec.nbytes:
                    raise WeightSyncError(f"{path}: {spec.name!r} has {raw.size} bytes, manifest says {spec.nbytes}")
                dense[spec.offset : spec.offset + spec.nbytes] = raw
            yield i, "dense", -1, dense

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass  # no back channel: the caller reports (WeightReceiver raises on failure)

    def close(self) -> None:
        pass


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
