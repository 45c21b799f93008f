"""The zarr store under a scene store, and the few things the commit protocol needs from it.

Every operation goes through the `zarr.abc.store.Store` API, so a local directory, a
`MemoryStore` or an fsspec/obstore object store take the same path. Local directories get one
specialisation: small documents are written to a temp file, fsynced and renamed (zarr's
`LocalStore` renames but never fsyncs), so a commit survives power loss as well as a killed
process. An object store's single PUT is atomic by itself.
"""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zarr.abc.store import Store as ZarrStore
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

from storage.errors import StoreCorruptError, StoreError

IO_THREADS = 4
PARTIAL_SUFFIX = ".partial"  # zarr's LocalStore names its temp files <stem>.<uuid>.partial too


def get_bytes(zstore: ZarrStore, key: str) -> bytes | None:
    """The bytes stored at key, or None when there are none. Local directories get a plain file
    read: zarr's async store costs ~1-2 ms a call in thread hops, and every block write reads the
    root document (to refuse a stale view) and every block read its version document."""
    if isinstance(zstore, LocalStore):
        try:
            return (Path(zstore.root) / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
    buf = sync(zstore.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else buf.to_bytes()


class Backend:
    """A zarr store plus atomic small documents, listing, deletion and (local) fsync."""

    def __init__(self, zstore: ZarrStore, name: str, durable: bool) -> None:
        self.zstore = zstore
        self.name = name  # the path or URL
        self.label = f"store {name}"  # how error messages name the store
        self.durable = durable  # fsync what a commit relies on (local directories only)
        self.local_root: Path | None = zstore.root if isinstance(zstore, LocalStore) else None
        # Threads for the blocking work of one block: fetching and decoding chunks, fsyncs.
        self.pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="store-io")

    @property
    def read_only(self) -> bool:
        return self.zstore.read_only

    def get_json(self, key: str) -> Any | None:
        """The parsed JSON document at key, or None when there is none."""
        raw = get_bytes(self.zstore, key)
        return None if raw is None else decode_json(raw, f"{self.label}: {key}")

    def stamp(self, key: str) -> tuple[int, int, int] | None:
        """Identity of a local document's current file (inode, mtime, size); None elsewhere or
        when it is missing. Documents are replaced by rename, so a changed document changes it."""
        if self.local_root is None:
            return None
        try:
            st = os.stat(self.local_root / key)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def put_json(self, key: str, doc: Any, if_absent: bool = False) -> None:
        """Write the document at key atomically: readers see the old or the new one, never a mix.
        if_absent: leave an existing document alone."""
        raw = json.dumps(doc, indent=1, allow_nan=False).encode()
        if self.local_root is None:
            buf = default_buffer_prototype().buffer.from_bytes(raw)
            sync(self.zstore.set_if_not_exists(key, buf) if if_absent else self.zstore.set(key, buf))
            return
        path = self.local_root / key
        if if_absent and path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
        with open(tmp, "wb") as f:
            f.write(raw)
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.durable:
            self._fsync_parents(path)

    def list_dir(self, prefix: str) -> list[str]:
        """Names directly under prefix (files and sub-prefixes)."""

        async def collect() -> list[str]:
            return [name async for name in self.zstore.list_dir(prefix)]

        return sync(collect())

    def delete_dir(self, prefix: str) -> None:
        sync(self.zstore.delete_dir(prefix))

    def sync_trees(self, prefixes: Iterable[str]) -> None:
        """Make the files under each prefix durable before a commit names them (local + durable
        only). All fsyncs run concurrently, so the filesystem commits them in a few journal
        flushes; then each parent directory up to the root, once. A prefix that is gone (a
        dropped block's version, removed by GC) has nothing left to sync."""
        if self.local_root is None or not self.durable:
            return
        tops = [self.local_root / p for p in prefixes]
        paths = [Path(d) / name for top in tops for d, _, files in os.walk(top) for name in files]
        paths += [Path(d) for top in tops for d, _, _ in os.walk(top)]
        list(self.pool.map(_fsync_if_present, paths))
        parents = {parent for top in tops for parent in self._parents(top)}
        for parent in sorted(parents, key=lambda q: -len(q.parts)):  # deepest first, each once
            _fsync_if_present(parent)

    def _fsync_parents(self, path: Path) -> None:
        """New directory entries live in the parents: fsync them up to the store's root."""
        for parent in self._parents(path):
            _fsync(parent)

    def _parents(self, path: Path) -> list[Path]:  # path's parents up to the store's root, deepest first
        assert self.local_root is not None
        out = []
        for parent in path.parents:
            out.append(parent)
            if parent == self.local_root:
                break
        return out


def group_doc(attributes: dict[str, Any]) -> dict[str, Any]:
    """A zarr v3 group document: what plain zarr needs to see a node and read its attributes."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def decode_json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # also: numbers of over 4300 digits, nesting too deep
        raise StoreCorruptError(f"{what} is not valid JSON: {e}") from e


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_if_present(path: Path) -> None:
    try:
        _fsync(path)
    except FileNotFoundError:
        pass


def open_backend(path_or_store: str | os.PathLike[str] | ZarrStore, read_only: bool, durable: bool) -> Backend:
    """A local path, an fsspec URL ("memory://scene", "s3://bucket/scene") or any zarr Store."""
    if isinstance(path_or_store, ZarrStore):
        zstore = path_or_store
        if read_only and not zstore.read_only:
            zstore = zstore.with_read_only(True)
        elif not read_only and zstore.read_only:
            raise StoreError(f"{zstore} is read-only; open the scene store with mode='r'")
        return Backend(zstore, str(zstore), durable)
    text = os.fspath(path_or_store)
    if "://" in text and not text.startswith("file://"):
        return Backend(FsspecStore.from_url(text, read_only=read_only), text, durable)
    path = Path(text.removeprefix("file://"))
    return Backend(LocalStore(path, read_only=read_only), str(path), durable)
