"""The scene store: blocks as copy-on-write versions, made current by atomic commits.

Layout (every node is a zarr v3 group or array, so plain `zarr.open_group` reads all of it):

    zarr.json                 root attributes: format_version, sh_degree, codec, head (last commit), user attrs
    commits/<G>/zarr.json     commit G: its block table and training state (one document, one atomic write)
    blocks/<key>/<v>/<pack>   block <key> as written while generation v-1 was current: its arrays
                              packed into params, state and counters (storage/packing.py)

Commit protocol (see docs/storage.md): between commits, writers (any number of processes, each on
its own blocks) write versions head+1 of the blocks they changed. Then, after a barrier, one
process commits: it writes commits/<head+1>, then rewrites the root document to name it (the
commit point), then deletes the versions that none of the last `keep_commits` commits names
(among the blocks it wrote or removed and those the commits leaving the window name: a version
another process wrote and nobody committed waits for the next writable open).
The others call `refresh()` before writing again. A crash at any moment leaves the root naming
an intact commit; what no commit names is garbage that a writable `open` removes.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np
from zarr.abc.store import Store as ZarrStore
from zarr.core.sync import sync

from octree.bounds import Box, extent_box, tight_box
from octree.keys import BlockKeyError, parse_key
from octree.semantics import MAX_SH_DEGREE
from storage.backend import PARTIAL_SUFFIX, Backend, group_doc, open_backend
from storage.blockio import Schema, check_arrays, check_version, read_version, write_version
from storage.codec import CodecConfig
from storage.errors import (
    BlockDataError,
    BlockNotFoundError,
    CommitProtocolError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
    StoreFormatError,
    StoreWriteError,
)
from storage.packing import layout_json, pack, pack_layout, pack_shapes, packs_for, unpack
from storage.schema import PARAM_NAMES, block_schema
from storage.table import MAX_COUNT, BlockInfo, Commit, check_key, check_state, parse_box

FORMAT_VERSION = 2  # 2: a block version is 3 packed arrays (1: one array per logical array)
RESERVED_ATTRS = ("format_version", "codec", "head", "layout")
Verify = Literal["table", "blocks", "data"]

PathOrStore = str | os.PathLike[str] | ZarrStore


class Store:
    """An open scene store. Use `Store.create` or `Store.open`.

    `table`, `state` and `head` describe the last commit this object has seen; they are replaced
    (never mutated) by `commit` and `refresh`, so reader threads may keep using an old table.
    """

    def __init__(self, backend: Backend, attrs: dict[str, Any], commit: Commit | None, keep_commits: int) -> None:
        if keep_commits < 1:
            raise ValueError(f"keep_commits must be >= 1, got {keep_commits}")
        self._backend = backend
        self.attrs = attrs  # root attributes: format_version, sh_degree, codec, and the creator's own
        self.codec = CodecConfig.from_json(attrs["codec"], backend.label)
        self.sh_degree: int = attrs["sh_degree"]
        self.schema: Schema = block_schema(self.sh_degree)  # the logical arrays callers read and write
        self.layout = pack_layout(self.sh_degree)
        self.keep_commits = keep_commits
        self._tables: dict[int, dict[str, BlockInfo]] = {}  # generation -> table, for GC
        self._unsynced: set[str] = set()  # version prefixes written by this view and not yet fsynced
        self._written: set[str] = set()  # keys this view wrote versions of since its last commit
        self._root_stamp: tuple[Any, int | None] = (None, None)  # (root file stamp, head it names)
        self._set_commit(commit)

    # ------------------------------------------------------------------ opening

    @classmethod
    def create(
        cls,
        path_or_store: PathOrStore,
        attrs: Mapping[str, Any],
        codec: CodecConfig | None = None,
        overwrite: bool = False,
        keep_commits: int = 2,
        durable: bool = True,
    ) -> "Store":
        """Create an empty store (no commit yet). attrs must hold `sh_degree`; overwrite only
        replaces an existing OctoSplat store, never a directory holding anything else."""
        backend = open_backend(path_or_store, read_only=False, durable=durable)
        root_attrs = _new_root_attrs(attrs, codec or CodecConfig(), backend.label)
        existing = backend.get_json("zarr.json")
        is_ours = isinstance(existing, dict) and "format_version" in existing.get("attributes", {})
        if existing is not None or backend.list_dir(""):
            if not overwrite:
                raise StoreExistsError(f"{backend.label}: already exists (pass overwrite=True to replace a store)")
            if not is_ours:
                raise StoreExistsError(f"{backend.label}: exists and is not an OctoSplat store; refusing to overwrite it")
            backend.delete_dir("")
        backend.put_json("blocks/zarr.json", group_doc({}))
        backend.put_json("commits/zarr.json", group_doc({}))
        # The root document last: an interrupted create leaves no half store that opens.
        backend.put_json("zarr.json", group_doc({**root_attrs, "head": None}))
        return cls(backend, root_attrs, None, keep_commits)

    @classmethod
    def open(
        cls,
        path_or_store: PathOrStore,
        mode: Literal["r", "r+"] = "r+",
        keep_commits: int = 2,
        gc: bool = True,
        verify: Verify = "blocks",
        durable: bool = True,
    ) -> "Store":
        """Open and validate a store.

        verify: "table" checks the format, HEAD and the committed table; "blocks" also checks every
        committed block's arrays (shapes, dtypes, counts) without reading data; "data" also decodes
        every chunk. gc (writable only): remove what no kept commit names, e.g. the leftovers of a
        crash. Only one process may do that, before the others start writing (MPI rank 0).
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        if isinstance(path_or_store, (str, os.PathLike)) and "://" not in os.fspath(path_or_store):
            if not os.path.isdir(path_or_store):
                raise StoreFormatError(f"{os.fspath(path_or_store)}: no store here (not a directory)")
        backend = open_backend(path_or_store, read_only=mode == "r", durable=durable)
        attrs, head = _read_root(backend)
        store = cls(backend, attrs, _read_commit(backend, head), keep_commits)
        store.verify(verify)
        if gc and mode == "r+":
            store.collect_garbage()
        return store

    def refresh(self) -> None:
        """Re-read HEAD and the committed table (after another process committed)."""
        _, head = _read_root(self._backend)
        if head != self.head:
            self._set_commit(_read_commit(self._backend, head))

    def _set_commit(self, commit: Commit | None) -> None:
        self.head: int | None = None if commit is None else commit.generation
        self.table: dict[str, BlockInfo] = {} if commit is None else commit.table
        self.state: dict[str, Any] = {} if commit is None else commit.state
        if commit is not None:
            self._tables[commit.generation] = commit.table

    @property
    def name(self) -> str:
        return self._backend.name

    @property
    def next_version(self) -> int:
        """The version a block written now gets: one past the last commit."""
        return 0 if self.head is None else self.head + 1

    # ------------------------------------------------------------------ blocks

    def write_block(self, key: str, arrays: Mapping[str, np.ndarray], cell: Box) -> BlockInfo:
        """Write a new, uncommitted version of a block; returns its table entry for `commit`.

        Safe from several processes at once as long as each writes its own keys.
        """
        self._check_writable()
        where = f"store {self.name}, block {key}"
        check_key(key, where)
        cell = parse_box(cell, f"{where}: cell box", BlockDataError)
        count = check_arrays(arrays, self.schema, where, finite=False)
        if count == 0:
            raise BlockDataError(f"{where}: empty block (a block that becomes empty is removed, not stored)")
        packed = pack(arrays, self.layout, count)
        if not all(np.isfinite(a).all() for a in packed.values() if a.dtype.kind == "f"):
            check_arrays(arrays, self.schema, where)  # names the array that holds NaN or inf
        head = self._stored_head()
        if head != self.head:
            raise CommitProtocolError(
                f"{where}: the store was committed to generation {head} by another process since this view "
                f"(generation {self.head}); call refresh() before writing"
            )
        version = self.next_version
        self._backend.put_json(f"blocks/{key}/zarr.json", group_doc({}), if_absent=True)
        prefix = f"blocks/{key}/{version}"
        write_version(self._backend.zstore, prefix, packed, count, self.codec)
        self._unsynced.add(prefix)
        self._written.add(key)
        means, scales = arrays["means"], arrays["scales"]
        return BlockInfo(key, version, count, cell, tight_box(means), extent_box(means, scales))

    def _stored_head(self) -> int | None:
        """The head the root document names now. Every block write asks (to refuse a stale view);
        on a local disk the parsed answer is reused while the document's file is the same one
        (commits replace it by a rename, so a new commit is a new inode)."""
        stamp = self._backend.stamp("zarr.json")
        if stamp is None or stamp != self._root_stamp[0]:
            _, head = _read_root(self._backend)
            self._root_stamp = (stamp, head)
        return self._root_stamp[1]

    def sync_written(self) -> None:
        """Make every version this view wrote durable; `commit` calls it, and so must each process
        that wrote blocks another process commits (`BlockCache.flush` does). Writes defer their
        fsyncs to here: a block evicted and rewritten between commits is synced once, and the
        fsyncs of many blocks overlap."""
        prefixes = sorted(self._unsynced)
        try:
            self._backend.sync_trees(prefixes)
        except OSError as e:  # a file system may report a full disk only when it must allocate, at fsync
            raise StoreWriteError(self.name, f"the blocks of commit {self.next_version}", e, self.head,
                                  self.state.get("step")) from e
        self._unsynced.difference_update(prefixes)

    def read_block(self, key: str, info: BlockInfo | None = None) -> dict[str, np.ndarray]:
        """Every array of a block: the committed version, or the one `info` names."""
        return self._read(key, info, self.schema)

    def read_params(self, key: str, info: BlockInfo | None = None) -> dict[str, np.ndarray]:
        """Only the Gaussian parameters (means, scales, quats, opacities, sh0, shN) of a block."""
        return self._read(key, info, PARAM_NAMES)

    def _read(self, key: str, info: BlockInfo | None, names: Iterable[str]) -> dict[str, np.ndarray]:
        info = info or self.info(key)
        where = f"store {self.name}, block {key} version {info.version}"
        names = list(names)
        packed = read_version(self._backend.zstore, _prefix(info), packs_for(self.layout, names), info.count,
                              pack_shapes(self.layout, info.count), where, self._backend.pool)
        return unpack(packed, self.layout, names, self.schema)

    def info(self, key: str) -> BlockInfo:
        """The committed table entry of a block."""
        try:
            return self.table[key]
        except KeyError:
            raise BlockNotFoundError(f"store {self.name}: no block {key} in commit {self.head}") from None

    # ------------------------------------------------------------------ commits

    def commit(
        self, updated: Mapping[str, BlockInfo], removed: Iterable[str] = (), state: Mapping[str, Any] | None = None
    ) -> int:
        """Make written versions current at once: the next generation is this table with `updated`
        applied and `removed` dropped, and `state` (default: the previous state) saved with it.
        Returns the new generation. Then removes versions that no kept commit names."""
        self._check_writable()
        removed = set(removed)
        generation = self.next_version
        where = f"store {self.name}, commit {generation}"
        table = dict(self.table)
        for key in sorted(removed):
            if key not in table:
                raise BlockNotFoundError(f"{where}: cannot remove block {key}, commit {self.head} does not hold it")
            if key in updated:
                raise CommitProtocolError(f"{where}: block {key} is both updated and removed")
            del table[key]
        for key, info in updated.items():
            if not isinstance(info, BlockInfo) or info.key != key:
                raise CommitProtocolError(f"{where}: updated[{key!r}] is not the BlockInfo of block {key}")
            if info.version != generation and table.get(key) != info:
                raise CommitProtocolError(
                    f"{where}: block {key} version {info.version} is neither new (version {generation}) nor current"
                )
            table[key] = info
        self._check_versions([info for info in updated.values() if info.version == generation], where)
        self.sync_written()
        commit = Commit(generation, table, check_state(self.state if state is None else state))
        try:
            self._backend.put_json(f"commits/{generation}/zarr.json", commit.to_doc())
            # The commit point: one atomic replace of the root document.
            self._backend.put_json("zarr.json", group_doc({**self.attrs, "head": generation}))
        except OSError as e:
            raise StoreWriteError(self.name, f"commit {generation}", e, self.head, self.state.get("step")) from e
        self._set_commit(commit)
        self.collect_garbage(upto=generation, keys=self._written | removed)
        self._written = set()
        return generation

    def collect_garbage(self, upto: int | None = None, keys: Iterable[str] | None = None) -> int:
        """Delete the block versions and commit documents that none of the last `keep_commits`
        commits names, and temp files of interrupted writes. upto: only versions <= upto (after a
        commit; see the protocol above); None also removes uncommitted versions, so call it only
        while no other process writes. keys: look only at these blocks and at those the commits
        leaving the kept window name (what a commit can have made dead; listing every block's
        folder took seconds at 35k blocks), None: at every block. Returns the number of block
        versions deleted."""
        previous = self._tables
        kept = self._kept_tables()
        named = {(info.key, info.version) for table in kept.values() for info in table.values()}
        oldest = min(kept, default=None)
        commits = [int(n) for n in self._sweep(["commits"])[0] if _is_generation(n)]
        doomed = [g for g in commits if g not in kept and (upto is None or (oldest is not None and g < oldest))]
        removed = 0
        if keys is None:
            _, listed = self._sweep(["", "blocks"])  # the root only for its temp files
            keys = [k for k in listed if _is_key(k)]
        else:
            self._sweep([""])
            candidates = set(keys)
            for g in set(doomed) | (set(previous) - set(kept)):
                table = previous.get(g) or getattr(_read_commit(self._backend, g, required=False), "table", {})
                candidates.update(k for k, info in table.items() if (k, info.version) not in named)
            keys = sorted(candidates)
        for key, names in zip(keys, self._sweep([f"blocks/{k}" for k in keys])):
            if not names:
                continue  # nothing there (a removed block's folder, gone already)
            versions = [int(v) for v in names if _is_generation(v)]
            dead = [v for v in versions if (key, v) not in named and (upto is None or v <= upto)]
            # A key with no live version goes entirely, its group document included.
            for prefix in [f"blocks/{key}"] if len(dead) == len(versions) else [f"blocks/{key}/{v}" for v in dead]:
                self._backend.delete_dir(prefix)
            removed += len(dead)
        for g in doomed:
            self._backend.delete_dir(f"commits/{g}")
        return removed

    def _kept_tables(self) -> dict[int, dict[str, BlockInfo]]:
        """generation -> table of the commits GC keeps (a commit document GC already deleted is skipped)."""
        if self.head is None:
            return {}
        kept = {}
        for g in range(max(0, self.head - self.keep_commits + 1), self.head + 1):
            if g not in self._tables:
                commit = _read_commit(self._backend, g, required=False)
                if commit is None:
                    continue
                self._tables[g] = commit.table
            kept[g] = self._tables[g]
        self._tables = dict(kept)
        return kept

    def _sweep(self, prefixes: list[str]) -> list[list[str]]:
        """List several prefixes at once, deleting the temp files of interrupted atomic writes."""

        async def one(prefix: str) -> list[str]:
            names = [name async for name in self._backend.zstore.list_dir(prefix)]
            for name in names:
                if name.endswith(PARTIAL_SUFFIX):
                    await self._backend.zstore.delete(f"{prefix}/{name}".lstrip("/"))
            return [name for name in names if not name.endswith(PARTIAL_SUFFIX)]

        async def gather() -> list[list[str]]:
            return list(await asyncio.gather(*(one(p) for p in prefixes)))

        return sync(gather())

    # ------------------------------------------------------------------ validation

    def verify(self, level: Verify = "blocks") -> None:
        """Check the committed blocks against the table: "table" (done on open), "blocks"
        (array metadata of every block) or "data" (also decode every chunk and its checksum)."""
        if level not in ("table", "blocks", "data"):
            raise ValueError(f"verify must be 'table', 'blocks' or 'data', got {level!r}")
        if level == "table":
            return
        where = f"store {self.name}, commit {self.head}"
        self._check_versions(list(self.table.values()), where)
        if level == "data":
            for key in self.table:
                self.read_block(key)

    def _check_versions(self, infos: list[BlockInfo], where: str) -> None:
        async def gather() -> None:
            await asyncio.gather(
                *(
                    check_version(self._backend.zstore, _prefix(i), i.count, pack_shapes(self.layout, i.count), f"{where}, block {i.key} version {i.version}")
                    for i in infos
                )
            )

        sync(gather())

    def close(self) -> None:
        """Stop the store's I/O threads (they also stop at exit); the object is unusable after."""
        self._backend.pool.shutdown(wait=True)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_writable(self) -> None:
        if self._backend.read_only:
            raise StoreError(f"store {self.name} is open read-only")

    def __repr__(self) -> str:
        return f"Store({self.name!r}, head={self.head}, blocks={len(self.table)})"


def _prefix(info: BlockInfo) -> str:
    return f"blocks/{info.key}/{info.version}"


def _is_key(name: str) -> bool:
    """Whether a name listed under blocks/ is a block key; anything else is not ours to delete."""
    try:
        parse_key(name)
    except BlockKeyError:
        return False
    return True


def _is_generation(name: str) -> bool:
    return name.isdigit() and str(int(name)) == name


def _new_root_attrs(attrs: Mapping[str, Any], codec: CodecConfig, name: str) -> dict[str, Any]:
    attrs = dict(attrs)
    if attrs.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise StoreFormatError(f"{name}: attrs ask for format_version {attrs['format_version']}, this code writes {FORMAT_VERSION}")
    clash = [k for k in RESERVED_ATTRS if k in attrs and k != "format_version"]
    if clash:
        raise StoreFormatError(f"{name}: attrs may not set the reserved names {clash}")
    root = {**attrs, "format_version": FORMAT_VERSION, "codec": codec.to_json()}
    _check_sh_degree(root.get("sh_degree"), name)
    root["layout"] = layout_json(pack_layout(root["sh_degree"]))
    try:
        return check_state(root)
    except ValueError as e:
        raise StoreFormatError(f"{name}: attrs are not plain JSON: {e}") from e


def _check_sh_degree(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SH_DEGREE:
        raise StoreFormatError(f"{name}: sh_degree {value!r:.40} is not an integer in [0, {MAX_SH_DEGREE}]")


def _read_root(backend: Backend) -> tuple[dict[str, Any], int | None]:
    """Root attributes (without head) and the head generation, validated."""
    doc = backend.get_json("zarr.json")
    if doc is None:
        raise StoreFormatError(f"{backend.label}: no OctoSplat store here (no zarr.json)")
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    if not isinstance(attrs, dict) or "format_version" not in attrs:
        raise StoreFormatError(f"{backend.label}: a zarr node but not an OctoSplat store (no format_version)")
    if attrs["format_version"] != FORMAT_VERSION:
        raise StoreFormatError(
            f"{backend.label}: format version {attrs['format_version']!r:.40}, this code reads {FORMAT_VERSION} "
            "(export the old store with the OctoSplat that wrote it, then tile the PLY again)"
        )
    _check_sh_degree(attrs.get("sh_degree"), backend.label)
    if attrs.get("layout") != layout_json(pack_layout(attrs["sh_degree"])):
        raise StoreFormatError(f"{backend.label}: the root's block layout (attribute 'layout') is not the one format "
                               f"{FORMAT_VERSION} defines for sh_degree {attrs['sh_degree']}")
    if "codec" not in attrs:
        raise StoreFormatError(f"{backend.label}: root attributes lack 'codec'")
    CodecConfig.from_json(attrs["codec"], backend.label)
    head = attrs.pop("head", None)
    # (bounded as block versions are: a huge one would name a file too long for the file system)
    if head is not None and (not isinstance(head, int) or isinstance(head, bool) or not 0 <= head <= MAX_COUNT):
        raise StoreCorruptError(f"{backend.label}: HEAD {head!r:.40} is not a generation number")
    return attrs, head


def _read_commit(backend: Backend, generation: int | None, required: bool = True) -> Commit | None:
    if generation is None:
        return None
    doc = backend.get_json(f"commits/{generation}/zarr.json")
    if doc is None:
        if required:
            raise StoreCorruptError(f"{backend.label}: HEAD names commit {generation}, but commits/{generation} is missing")
        return None
    return Commit.from_doc(doc, generation, backend.label)
