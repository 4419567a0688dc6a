"""Big cases cross to a kernel worker through a mapped file, not the pipe (docs/long-context.md).

A case with a 4 GiB K pickled through a pipe is copied four times on its way (pickle bytes,
pipe, received bytes, unpickled arrays) and once more by the worker's input-write watch. Here
every array of at least :data:`MAPPED_BYTES` leaves the pickle stream as a persistent
reference: the parent writes the arrays once into a file (under ``/dev/shm`` when it has room,
else the temporary folder) and sends the small rest. The worker maps the file copy-on-write and
reads views onto it, so a kernel writing into its inputs changes only its private pages, and a
second, read-only mapping of the same pages is the input-write check's "before" without a copy
(:meth:`Mapped.load`).
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

MAPPED_BYTES = 1 << 26  # arrays this large (64 MiB) travel out of band
_ALIGN = 64  # byte alignment of each array in the file


class _Pickler(pickle.Pickler):
    """Keeps large C-contiguous arrays out of the stream: each becomes a persistent reference
    (its index, dtype and shape) and its bytes are collected in ``arrays``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []
        self._index: dict[int, int] = {}  # id -> index: an array met twice is written once

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and obj.nbytes >= MAPPED_BYTES and obj.flags.c_contiguous:
            if id(obj) not in self._index:
                self._index[id(obj)] = len(self.arrays)
                self.arrays.append(obj)  # kept alive, so its id stays unique while pickling
            return (self._index[id(obj)], obj.dtype, obj.shape)
        return None


class _Unpickler(pickle.Unpickler):
    """Resolves the persistent references to views onto the mapping ``data``."""

    def __init__(self, stream: bytes, data: np.ndarray, spans: tuple[tuple[int, int], ...]):
        super().__init__(io.BytesIO(stream))
        self.data, self.spans = data, spans

    def persistent_load(self, pid: Any) -> np.ndarray:
        index, dtype, shape = pid
        offset, length = self.spans[index]
        return self.data[offset : offset + length].view(np.ndarray).view(dtype).reshape(shape)


@dataclass(frozen=True)
class Mapped:
    """A payload whose large arrays live in the file ``path`` at ``spans`` (offset, length)."""

    path: str
    stream: bytes
    spans: tuple[tuple[int, int], ...]

    def load(self, writable: bool) -> Any:
        """The payload with views onto the file: copy-on-write (``writable``: the kernel's
        copy) or read-only (the input-write check's "before")."""
        data = np.memmap(self.path, dtype=np.uint8, mode="c" if writable else "r")
        return _Unpickler(self.stream, data, self.spans).load()


def map_out(payload: Any) -> Mapped | None:
    """``payload`` with its large arrays written to a new file, or None when it has none (the
    pipe is then cheaper). The caller owns the file: :func:`remove` it when done."""
    stream = io.BytesIO()
    pickler = _Pickler(stream)
    pickler.dump(payload)
    if not pickler.arrays:
        return None
    spans, offset = [], 0
    for array in pickler.arrays:
        spans.append((offset, array.nbytes))
        offset += -(-array.nbytes // _ALIGN) * _ALIGN
    handle, path = tempfile.mkstemp(
        prefix="attention-crossval-", suffix=".case", dir=_folder(offset)
    )
    with os.fdopen(handle, "wb") as file:
        for (start, _), array in zip(spans, pickler.arrays, strict=True):
            file.seek(start)
            file.write(array.reshape(-1).view(np.uint8).data)
        file.truncate(offset)
    return Mapped(path, stream.getvalue(), tuple(spans))


# The payload last sent and its file (None: it went through the pipe). One file at a time, shared
# by every worker of this process: a case checked by several kernels is written once.
_last: list[tuple[Any, Mapped | None]] = []


def outbound(payload: Any) -> Any:
    """What crosses a worker's pipe for ``payload``: itself, or its :class:`Mapped` file when it
    holds large arrays, written once per payload object (the runs of one case, each kernel's)."""
    if not _last or _last[0][0] is not payload:
        release()
        _last.append((payload, map_out(payload)))
    return _last[0][1] or payload


def release() -> None:
    """Delete the file of the payload last sent (the report calls this after each config; a
    new payload and the end of the process do too)."""
    while _last:
        remove(_last.pop()[1])


atexit.register(release)


def remove(mapped: Mapped | None) -> None:
    """Delete ``mapped``'s file (a worker still mapping it keeps its pages until it unmaps)."""
    if mapped is not None:
        try:
            os.unlink(mapped.path)
        except FileNotFoundError:
            pass


def _folder(nbytes: int) -> str | None:
    """``/dev/shm`` (memory, no disk writes) when it has twice ``nbytes`` free, else None (the
    temporary folder): a container's ``/dev/shm`` is often 64 MiB."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free >= 2 * nbytes:
        return shm
    return None
