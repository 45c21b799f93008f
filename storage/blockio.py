"""Writing and reading one block version: a zarr group of row-chunked arrays.

Writes: the chunks and array documents are encoded here, byte for byte what zarr's writer makes,
then written as local files (overwriting an uncommitted version in place) or PUT in one
concurrent burst; the version's group document goes last, with the row count and the arrays'
metadata consolidated into it. (The store packs a block's logical arrays into these arrays, see
storage/packing.py; this module only knows named arrays of rows.)

Reads: one GET for the version document (all array metadata), then every chunk is fetched and
decoded as its own task in a thread pool; with stores that read synchronously (local files,
memory) fetch and decode are one task, otherwise all chunks are fetched concurrently through the
async store API first. zarr's indexing layer is skipped: it reads a missing chunk as the fill
value and copies each decoded chunk once more. Here a missing chunk is an error, and the codec
chains `write_version` writes (little-endian bytes, blosc, crc32c) decode straight into the
output array (blosc and crc32c release the GIL); any other chain goes through zarr's pipeline.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import mmap
import os
import shutil
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from numcodecs import blosc
from zarr.abc.store import Store as ZarrStore
from zarr.abc.store import SupportsGetSync
from zarr.codecs import BytesCodec
from zarr.codecs.bytes import Endian
from zarr.core.array import create_codec_pipeline
from zarr.core.array_spec import ArrayConfig
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.core.sync import sync
from zarr.storage import LocalStore

from storage.backend import decode_json, get_bytes, group_doc
from storage.codec import CodecConfig
from storage.errors import BlockDataError, StoreCorruptError

Schema = Mapping[str, tuple[tuple[int, ...], np.dtype]]  # name -> (trailing shape, dtype) of [N, ...] arrays
Shapes = Mapping[str, tuple[tuple[int, ...], np.dtype]]  # name -> (full shape, dtype) of stored arrays

Parts = tuple[Any, ...]  # a file's bytes as buffers written back to back (no joining copy)

MAX_CHUNKS = 4096  # per array; a hostile store must not make one read issue billions of requests


def check_arrays(
    arrays: Mapping[str, Any], schema: Schema, where: str, array_type: type = np.ndarray, finite: bool = True
) -> int:
    """Validate a block's arrays against the schema; returns the row count N (may be 0).

    array_type: numpy arrays for the store; the cache checks torch tensors with the same rules
    (dtypes compare by name). Only numpy arrays are checked for NaN/inf (unless finite=False, for
    a caller that checks the packed copy in three calls instead of nineteen): that is where data
    is about to be written.
    """
    missing = sorted(set(schema) - set(arrays))
    extra = sorted(set(arrays) - set(schema))
    if missing or extra:
        raise BlockDataError(f"{where}: arrays missing {missing}, unknown {extra}")
    counts = set()
    for name, (trailing, dtype) in schema.items():
        a = arrays[name]
        if not isinstance(a, array_type):
            raise BlockDataError(f"{where}: array {name} is a {type(a).__name__}, expected {array_type.__name__}")
        if tuple(a.shape[1:]) != trailing or a.ndim != 1 + len(trailing):
            raise BlockDataError(f"{where}: array {name} has shape {tuple(a.shape)}, expected (N, {', '.join(map(str, trailing))})")
        # numpy dtypes compare directly; torch's by name (str() of a numpy dtype costs ~10 us).
        if (a.dtype != dtype) if isinstance(a, np.ndarray) else (str(a.dtype).removeprefix("torch.") != dtype.name):
            raise BlockDataError(f"{where}: array {name} has dtype {a.dtype}, expected {dtype}")
        if finite and isinstance(a, np.ndarray) and dtype.kind == "f" and not np.isfinite(a).all():
            raise BlockDataError(f"{where}: array {name} holds NaN or inf")
        counts.add(a.shape[0])
    if len(counts) != 1:
        raise BlockDataError(f"{where}: arrays disagree on the row count: {sorted(counts)}")
    return counts.pop()


def write_version(
    zstore: ZarrStore, prefix: str, arrays: Mapping[str, np.ndarray], count: int, codec: CodecConfig
) -> None:
    """Write all arrays under prefix, replacing whatever an interrupted earlier write left there.

    The chunks and documents are what zarr's own writer makes (byte for byte; plain zarr reads
    them, see the tests), encoded here directly: zarr's `create_array` costs ~4 ms an array in
    Python, and its local store ~0.7 ms a file, which made a 22-array block write take ~100 ms
    however small the block. Local directories get plain file writes; other stores one concurrent
    burst of PUTs. A version whose group document carries the right count is complete: that
    document is written last.
    """
    files: dict[str, Parts] = {}
    members: dict[str, dict[str, Any]] = {}
    for name, a in arrays.items():
        files.update(_encode_array(name, np.asarray(a), codec, members))
    doc = group_doc({"count": count})
    doc["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": members}
    group = json.dumps(doc).encode()
    if isinstance(zstore, LocalStore):
        _write_files(Path(zstore.root) / prefix, files, group)
    else:
        sync(_put_files(zstore, prefix, files, group))


def _write_files(top: Path, files: dict[str, Parts], group: bytes) -> None:
    """A version rewritten before the next commit (a block evicted again) is overwritten in place
    when it has the same files: creating a file or folder costs ~0.4 ms on ext4, overwriting the
    bytes of an existing one ~0.1 ms a MB, and the cache rewrites blocks on every eviction. The
    version is uncommitted, so a crash in between leaves garbage that GC removes, never a torn commit."""
    names = set(files) | {"zarr.json"}
    if _files_under(top) != names:
        shutil.rmtree(top, ignore_errors=True)
        for folder in {top / key.rpartition("/")[0] for key in files}:
            folder.mkdir(parents=True, exist_ok=True)
    for key, data in files.items():
        _overwrite(top / key, data)
    _overwrite(top / "zarr.json", (group,))  # last: the count in it says the version is complete


def _files_under(top: Path) -> set[str]:
    """Relative paths of the files of a version folder (two levels: arrays and their chunks)."""
    found: set[str] = set()
    try:
        entries = list(os.scandir(top))
    except FileNotFoundError:
        return found
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            found.update(f"{e.name}/{c.name}" for c in os.scandir(e.path))
        else:
            found.add(e.name)
    return found


def _overwrite(path: Path, parts: Parts) -> None:
    """Write the parts over the file's old bytes (no truncate-and-reallocate when the size is unchanged)."""
    size = sum(len(p) for p in parts)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        if os.writev(fd, parts) != size:  # short only on a full disk, which then raises on the rest
            os.lseek(fd, 0, os.SEEK_SET)
            for p in parts:
                view = memoryview(p)
                while view:
                    view = view[os.write(fd, view):]
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


async def _put_files(zstore: ZarrStore, prefix: str, files: dict[str, Parts], group: bytes) -> None:
    prototype = default_buffer_prototype()
    await zstore.delete_dir(prefix)

    async def put(key: str, parts: Parts) -> None:
        await zstore.set(f"{prefix}/{key}", prototype.buffer.from_bytes(b"".join(parts)))

    await asyncio.gather(*(put(key, data) for key, data in files.items()))
    await zstore.set(f"{prefix}/zarr.json", prototype.buffer.from_bytes(group))


def _encode_array(
    name: str, a: np.ndarray, codec: CodecConfig, members: dict[str, dict[str, Any]]
) -> dict[str, Parts]:
    """The files of one array (its zarr.json and chunks, keyed relative to the version), and its
    metadata document added to members. Chunks split rows only; the last one is padded with the
    fill value to the full chunk shape, as zarr stores it."""
    count, trailing = a.shape[0], tuple(a.shape[1:])
    rows = min(count, codec.chunk_rows(a.dtype.itemsize * math.prod(trailing)))
    compress = codec.compresses(a)
    doc = {
        "shape": [count, *trailing],
        "data_type": a.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [rows, *trailing]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": False if a.dtype.kind == "b" else (0.0 if a.dtype.kind == "f" else 0),
        "codecs": codec.codec_docs(a, compress),
        "attributes": {},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }
    members[name] = doc
    files: dict[str, Parts] = {f"{name}/zarr.json": (json.dumps(doc).encode(),)}
    if a.size == 0:  # no data, no chunks (zarr writes none either)
        return files
    blosc_codec = codec.blosc() if compress else None
    little = a.astype(a.dtype.newbyteorder("<"), copy=False)
    suffix = ".0" * len(trailing)
    for i, lo in enumerate(range(0, count, rows)):
        chunk = np.ascontiguousarray(little[lo : lo + rows])
        if len(chunk) < rows:
            chunk = np.concatenate([chunk, np.zeros((rows - len(chunk), *trailing), chunk.dtype)])
        # Raw chunks go out as views of the array: a 1 MB copy costs ~1 ms in page faults.
        data = np.frombuffer(blosc_codec.encode(chunk), np.uint8) if blosc_codec is not None else chunk.reshape(-1).view(np.uint8)
        parts: Parts = (data,)
        if codec.checksum:
            parts = (data, google_crc32c.value(data).to_bytes(4, "little"))
        files[f"{name}/c.{i}{suffix}"] = parts
    return files


def read_version(
    zstore: ZarrStore, prefix: str, names: Iterable[str], count: int, shapes: Shapes, where: str, pool: Executor
) -> dict[str, np.ndarray]:
    """Read the named arrays of a version whose table entry says it holds count rows; every chunk
    is fetched and decoded as its own task in pool."""
    names = list(names)
    key = f"{prefix}/zarr.json"
    metas = _parse_version(get_bytes(zstore, key), key, count, {n: shapes[n] for n in names}, where)
    arrays = {n: _ArrayRead(f"{prefix}/{n}", metas[n], *shapes[n], f"{where}, array {n}") for n in names}
    chunks = [(a, i) for a in arrays.values() for i in range(len(a.keys))]
    prototype = default_buffer_prototype()
    if isinstance(zstore, LocalStore):
        tasks = [pool.submit(a.read_file, i, zstore.root / a.keys[i]) for a, i in chunks]
    elif isinstance(zstore, SupportsGetSync):
        # Memory (and other synchronous stores): fetch and decode in the same task.
        tasks = [pool.submit(lambda a=a, i=i: a.decode(i, zstore.get_sync(a.keys[i], prototype=prototype))) for a, i in chunks]
    else:

        async def fetch_all() -> list[Buffer | None]:
            return list(await asyncio.gather(*(zstore.get(a.keys[i], prototype=prototype) for a, i in chunks)))

        tasks = [pool.submit(a.decode, i, buf) for (a, i), buf in zip(chunks, sync(fetch_all()))]
    for task in tasks:
        task.result()
    return {n: a.out for n, a in arrays.items()}


async def check_version(zstore: ZarrStore, prefix: str, count: int, shapes: Shapes, where: str) -> None:
    """Check that a version is complete, holds count rows, and that the metadata of every array
    agrees with the table and the schema (no chunk is read)."""
    await _version_metadata(zstore, prefix, count, shapes, where)


async def _version_metadata(
    zstore: ZarrStore, prefix: str, count: int, shapes: Shapes, where: str
) -> dict[str, ArrayV3Metadata]:
    """The metadata of the schema's arrays, from the version group's consolidated copy (one GET
    per block instead of one per array), each checked against the table and the schema."""
    key = f"{prefix}/zarr.json"
    buf = await zstore.get(key, prototype=default_buffer_prototype())
    return _parse_version(None if buf is None else buf.to_bytes(), key, count, shapes, where)


def _parse_version(raw: bytes | None, key: str, count: int, shapes: Shapes, where: str) -> dict[str, ArrayV3Metadata]:
    """The checked array metadata in a version group document's bytes (None: the document is missing)."""
    if raw is None:
        raise StoreCorruptError(f"{where}: version group is missing (no {key})")
    doc = decode_json(raw, f"{where}: version group ({key})")
    stored = doc.get("attributes", {}).get("count") if isinstance(doc, dict) else None
    if stored != count:
        raise StoreCorruptError(f"{where}: version group says {stored!r:.40} rows, the block table says {count}")
    members = doc.get("consolidated_metadata", {}).get("metadata") if isinstance(doc, dict) else None
    if not isinstance(members, dict):
        raise StoreCorruptError(f"{where}: version group has no consolidated array metadata")
    return {n: _array_metadata(members.get(n), *shapes[n], f"{where}, array {n}") for n in shapes}


def _array_metadata(doc: Any, shape: tuple[int, ...], dtype: np.dtype, where: str) -> ArrayV3Metadata:
    """An array's zarr metadata document, checked against the shape and dtype the table and schema expect."""
    if doc is None:
        raise StoreCorruptError(f"{where}: missing from the version group")
    if not isinstance(doc, dict) or doc.get("node_type") != "array" or doc.get("zarr_format") != 3:
        raise StoreCorruptError(f"{where}: not a zarr v3 array")
    expected = list(shape)
    if doc.get("shape") != expected:
        raise StoreCorruptError(f"{where}: shape {doc.get('shape')!r:.60} but the block table says {expected}")
    if doc.get("data_type") != dtype.name:
        raise StoreCorruptError(f"{where}: dtype {doc.get('data_type')!r:.40}, expected {dtype.name}")
    try:
        meta = _parse_metadata(json.dumps(doc, sort_keys=True))
        chunks = tuple(meta.chunk_grid.chunk_shape)  # type: ignore[attr-defined]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise StoreCorruptError(f"{where}: unreadable zarr metadata: {e}") from e
    # Chunks split rows only, and not into absurdly many pieces.
    if chunks[1:] != tuple(shape[1:]) or not 1 <= chunks[0] or math.ceil(shape[0] / chunks[0]) > MAX_CHUNKS:
        raise StoreCorruptError(f"{where}: chunk shape {chunks} does not split rows into at most {MAX_CHUNKS} chunks")
    return meta


@functools.lru_cache(maxsize=4096)
def _parse_metadata(text: str) -> ArrayV3Metadata:
    """Parsing is slow (~0.4 ms, zarr validates every codec) and a paged block is read again and
    again with the same metadata; the parsed object is immutable, so it can be shared."""
    return ArrayV3Metadata.from_dict(json.loads(text))


# Arrays of at least this many bytes get their own anonymous mapping (`mapped_empty`).
MAPPED_BYTES = 128 * 1024


def mapped_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """np.empty, but a large array is its own anonymous mapping, unmapped when the last view of
    it goes. A block read lives as long as a cache keeps it: from the C heap, freed blocks left
    holes between the short-lived buffers of the steps, which glibc kept resident (1.4 GiB
    beyond a 1.5 GiB cache in the scale runs, docs/benchmarks.md)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < MAPPED_BYTES:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


class _ArrayRead:
    """One array being read: its chunk keys and the output its chunks decode into."""

    def __init__(self, path: str, meta: ArrayV3Metadata, shape: tuple[int, ...], dtype: np.dtype, where: str) -> None:
        self.meta, self.where = meta, where
        self.out = mapped_empty(shape, dtype)
        self.rows = meta.chunk_grid.chunk_shape[0]  # type: ignore[attr-defined]
        # No data, no chunks: zarr stores none for e.g. shN at sh_degree 0.
        n_chunks = math.ceil(shape[0] / self.rows) if self.out.size else 0
        self.keys = [f"{path}/{meta.encode_chunk_key((i,) + (0,) * (len(shape) - 1))}" for i in range(n_chunks)]
        self.direct = _direct_codecs(meta)

    def decode(self, i: int, buf: Buffer | None) -> None:
        """Decode chunk i, fetched from the store, into its rows of the output."""
        with self._chunk(i) as dest:
            if buf is None:
                raise StoreCorruptError("is missing")
            if self.direct is not None:
                _decode_direct(buf.as_numpy_array(), self.direct, dest)
            else:
                prototype = default_buffer_prototype()
                spec = self.meta.get_chunk_spec((0,) * dest.ndim, ArrayConfig.from_dict({}), prototype)
                (nd,) = sync(create_codec_pipeline(self.meta).decode([(buf, spec)]))
                dest[...] = nd.as_numpy_array().reshape(dest.shape)  # type: ignore[union-attr]

    def read_file(self, i: int, path: Path) -> None:
        """Local directories: an uncompressed chunk is read straight into the output, one copy as
        np.load makes (going through the store API costs a second copy and a second round of
        page faults on a fresh buffer, which is most of the time of a block read from the page cache)."""
        if self.direct not in ((), ("Crc32cCodec",)):
            try:
                raw: Buffer | None = default_buffer_prototype().buffer.from_bytes(path.read_bytes())
            except FileNotFoundError:
                raw = None
            self.decode(i, raw)
            return
        with self._chunk(i) as dest:
            try:
                f = open(path, "rb", buffering=0)
            except FileNotFoundError:
                raise StoreCorruptError("is missing") from None
            with f:
                target = dest.reshape(-1).view(np.uint8)
                checksum = bool(self.direct)
                size = os.fstat(f.fileno()).st_size
                if size != target.size + 4 * checksum:
                    raise StoreCorruptError(f"has {size} bytes, expected {target.size + 4 * checksum}")
                if f.readinto(memoryview(target)) != target.size:
                    raise StoreCorruptError("is shorter than its size (changed while read)")
                if checksum:
                    _check_crc32c(target, f.read(4))

    @contextlib.contextmanager
    def _chunk(self, i: int) -> Iterator[np.ndarray]:
        """The array chunk i decodes into; names the chunk in any error (this runs in a worker thread)."""
        lo, hi = i * self.rows, min(len(self.out), (i + 1) * self.rows)
        padded = hi - lo != self.rows  # the last chunk is stored padded to the full chunk shape
        dest = np.empty((self.rows, *self.out.shape[1:]), self.out.dtype) if padded else self.out[lo:hi]
        try:
            yield dest
        except StoreCorruptError as e:
            raise StoreCorruptError(f"{self.where}: chunk {self.keys[i]} {e}") from e
        except Exception as e:  # decoding untrusted bytes can fail in any codec, in any way
            raise StoreCorruptError(f"{self.where}: chunk {self.keys[i]} fails to decode (truncated or corrupt): {e}") from e
        if padded:
            self.out[lo:hi] = dest[: hi - lo]


_BLOSC_HEADER = struct.Struct("<III")  # nbytes, blocksize, cbytes at offset 4 of a Blosc1 chunk


def _direct_codecs(meta: ArrayV3Metadata) -> tuple[str, ...] | None:
    """The bytes-to-bytes codecs by name when the chain is one this module decodes in place (what
    `write_version` writes: little-endian bytes, then optionally blosc, then optionally crc32c);
    None otherwise."""
    codecs = list(meta.codecs)
    first = codecs.pop(0) if codecs else None
    if not isinstance(first, BytesCodec) or first.endian not in (None, Endian.little) or sys.byteorder != "little":
        return None
    names = tuple(type(c).__name__ for c in codecs)
    return names if names in ((), ("BloscCodec",), ("Crc32cCodec",), ("BloscCodec", "Crc32cCodec")) else None


def _check_crc32c(data: np.ndarray, stored: bytes) -> None:
    if google_crc32c.value(data) != int.from_bytes(stored, "little"):
        raise StoreCorruptError("fails its crc32c checksum (truncated or corrupt)")


def _decode_direct(raw: np.ndarray, codecs: tuple[str, ...], dest: np.ndarray) -> None:
    """Decode one chunk straight into dest (a C-contiguous array of the chunk's shape).

    Runs in a worker thread: crc32c and blosc release the GIL. codecs () means raw bytes.
    """
    if "Crc32cCodec" in codecs:
        if raw.size < 4:
            raise StoreCorruptError(f"has {raw.size} bytes, too short for its checksum")
        _check_crc32c(raw[:-4], raw[-4:].tobytes())
        raw = raw[:-4]
    target = dest.reshape(-1).view(np.uint8)
    if "BloscCodec" in codecs:
        # Blosc trusts its header, so check it against the real sizes before decompressing.
        if raw.size < 16:
            raise StoreCorruptError(f"has {raw.size} bytes, too short for a blosc header")
        nbytes, _, cbytes = _BLOSC_HEADER.unpack_from(raw, 4)
        if cbytes != raw.size or nbytes != target.size:
            raise StoreCorruptError(
                f"has {raw.size} bytes and should decode to {target.size}, but its blosc header says {cbytes} -> {nbytes}"
            )
        blosc.decompress(raw, target)
    elif raw.size != target.size:
        raise StoreCorruptError(f"has {raw.size} bytes, expected {target.size}")
    else:
        target[...] = raw
