"""The store: bit-exact round trips, commits, garbage collection, other zarr stores, input checks."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import GzipCodec
from zarr.storage import MemoryStore

from octree.bounds import extent_box, tight_box
from storage import (
    BlockDataError,
    BlockInfo,
    BlockNotFoundError,
    CodecConfig,
    CommitProtocolError,
    CommitStateError,
    Store,
    StoreError,
    StoreExistsError,
    StoreFormatError,
    StoreKeyError,
)
from storage.packing import pack
from storage.schema import PARAM_NAMES
from tests.helpers.store_data import block_digest, garden_blocks, random_block

CELL = (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)
CODECS = [
    CodecConfig(),  # lz4 where it pays: a mix of raw and compressed arrays
    CodecConfig(min_saving=0),
    CodecConfig(cname="zstd", clevel=3, shuffle="bitshuffle", min_saving=0),
    CodecConfig(cname="none", checksum=False),
    # Several chunks per array, the last one padded: the multi-chunk read path.
    CodecConfig(chunk_mb=0.05, min_saving=0),
]


@pytest.fixture(scope="module")
def garden(shared_data: Path) -> dict:
    return garden_blocks(shared_data / "test_garden.npz", sh_degree=3)


def on_disk_versions(root: Path) -> set[tuple[str, int]]:
    return {
        (k.name, int(v.name))
        for k in (root / "blocks").iterdir()
        if k.is_dir()
        for v in k.iterdir()
        if v.is_dir()
    }


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.cname}-{c.checksum}-{c.chunk_mb}-{c.min_saving}")
def test_round_trip_real_scene_bit_for_bit(tmp_path: Path, garden: dict, codec: CodecConfig) -> None:
    if codec != CodecConfig():  # the whole scene once; the first 5000 rows of each block for the rest
        garden = {k: ({n: a[:5000] for n, a in arrays.items()}, cell) for k, (arrays, cell) in garden.items()}
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 3}, codec=codec)
    infos = {key: store.write_block(key, arrays, cell) for key, (arrays, cell) in garden.items()}
    store.commit(infos, state={"step": 7})
    reopened = Store.open(tmp_path / "s.zarr", verify="data")
    assert reopened.state == {"step": 7} and set(reopened.table) == set(garden)
    for key, (arrays, cell) in garden.items():
        got = reopened.read_block(key)
        for name, a in arrays.items():
            assert got[name].dtype == a.dtype and got[name].shape == a.shape
            # Bit patterns, not values: -0.0 and NaN payloads would slip through ==.
            assert np.array_equal(got[name].view(np.uint8), a.view(np.uint8)), (key, name)
            assert got[name].flags.writeable
        info = reopened.table[key]
        assert info.count == len(arrays["means"]) and info.cell == cell
        assert info.tight == tight_box(arrays["means"])
        assert info.extent == extent_box(arrays["means"], arrays["scales"])
        params = reopened.read_params(key)
        assert set(params) == set(PARAM_NAMES)
        assert np.array_equal(params["shN"], arrays["shN"])


def test_compression_only_where_it_pays(tmp_path: Path, garden: dict) -> None:
    key, (arrays, cell) = next(iter(garden.items()))
    # A freshly tiled block: zero optimizer state and statistics beside real parameters.
    fresh = {**arrays, **{n: np.zeros_like(a) for n, a in arrays.items() if n not in PARAM_NAMES}}
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 3})
    store.commit({key: store.write_block(key, fresh, cell)})
    version = zarr.open_group(tmp_path / "s.zarr", mode="r")[f"blocks/{key}/0"]
    names = {name: [type(c).__name__ for c in version[name].compressors] for name in ("params", "state", "counters")}
    assert names == {"params": ["Crc32cCodec"], "state": ["BloscCodec", "Crc32cCodec"], "counters": ["BloscCodec", "Crc32cCodec"]}
    assert block_digest(store.read_block(key), 3) == block_digest(fresh, 3)


def test_a_codec_chain_it_did_not_write_reads_through_zarrs_pipeline(tmp_path: Path) -> None:
    """Arrays rewritten by plain zarr with gzip (not a chain the direct decoder knows) still read."""
    root = tmp_path / "s.zarr"
    rng = np.random.default_rng(8)
    store = Store.create(root, {"sh_degree": 1}, codec=CodecConfig(chunk_mb=0.01))
    arrays = random_block(rng, 300, 1)
    store.commit({"1-0": store.write_block("1-0", arrays, CELL)})
    group = zarr.open_group(root / "blocks" / "1-0" / "0", mode="r+")
    members = {}
    for name, a in pack(arrays, store.layout, 300).items():
        group.create_array(name, data=a, chunks=(128, *a.shape[1:]), compressors=[GzipCodec()], overwrite=True)
        members[name] = json.loads((root / "blocks" / "1-0" / "0" / name / "zarr.json").read_text())
    doc = json.loads((root / "blocks" / "1-0" / "0" / "zarr.json").read_text())
    doc["consolidated_metadata"]["metadata"] = members
    (root / "blocks" / "1-0" / "0" / "zarr.json").write_text(json.dumps(doc))
    got = Store.open(root, verify="data").read_block("1-0")
    assert block_digest(got, 1) == block_digest(arrays, 1)


def test_plain_zarr_reads_the_store(tmp_path: Path, garden: dict) -> None:
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 3, "octree": {"max_per_block": 1000}})
    key = next(iter(garden))
    info = store.write_block(key, *garden[key])
    g = store.commit({key: info}, state={"rng": "abc"})
    root = zarr.open_group(tmp_path / "s.zarr", mode="r")
    assert root.attrs["head"] == g and root.attrs["sh_degree"] == 3 and root.attrs["octree"] == {"max_per_block": 1000}
    table = root[f"commits/{g}"].attrs["blocks"]
    assert [BlockInfo.from_json(e) for e in table] == [info]
    # The row map in the root attributes is all a plain zarr user needs to find an array.
    layout = root.attrs["layout"]
    lo, hi = layout["params"]["rows"]["means"]
    means = root[f"blocks/{key}/{info.version}/params"][lo:hi].reshape(-1, 3)
    assert np.array_equal(means, garden[key][0]["means"])
    lo, hi = layout["state"]["rows"]["exp_avg_sq_shN"]
    state = root[f"blocks/{key}/{info.version}/state"]
    assert np.array_equal(state[lo:hi].reshape(-1, 15, 3), garden[key][0]["exp_avg_sq_shN"])
    assert state.compressors  # compressed, as configured
    assert "blocks" in dict(root.groups()) and "commits" in dict(root.groups())


def test_commit_applies_updates_and_removals_and_keeps_state(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 0}, durable=False)
    blocks = {f"2-{i:x}": random_block(rng, 10 + i, 0) for i in range(4)}
    assert store.commit({k: store.write_block(k, a, CELL) for k, a in blocks.items()}, state={"step": 1}) == 0
    new = random_block(rng, 5, 0)
    g = store.commit({"2-1": store.write_block("2-1", new, CELL)}, removed=["2-3"])
    assert g == 1 and store.state == {"step": 1}  # state carried over when not given
    blocks["2-1"] = new
    del blocks["2-3"]
    reopened = Store.open(tmp_path / "s.zarr")
    assert reopened.head == 1 and set(reopened.table) == set(blocks)
    assert reopened.table["2-0"].version == 0 and reopened.table["2-1"].version == 1
    for k, a in blocks.items():
        assert block_digest(reopened.read_block(k), 0) == block_digest(a, 0)
    with pytest.raises(BlockNotFoundError, match="2-3"):
        reopened.read_block("2-3")
    with pytest.raises(BlockNotFoundError, match="2-7"):
        reopened.commit({}, removed=["2-7"])
    with pytest.raises(CommitStateError):
        reopened.commit({}, state={"x": float("nan")})


def test_gc_removes_exactly_the_dead_versions(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    root = tmp_path / "s.zarr"
    store = Store.create(root, {"sh_degree": 0}, keep_commits=2, durable=False)
    keys = [f"3-{i:x}" for i in range(6)]
    history = []  # the table (key -> version) of every generation, kept independently of the store
    digests = {}  # (key, version) -> digest of what was written
    table: dict[str, int] = {}
    for step in range(6):
        updated = {}
        for k in rng.choice(keys, size=3, replace=False):
            arrays = random_block(rng, 4, 0)
            updated[k] = store.write_block(k, arrays, CELL)
            digests[k, updated[k].version] = block_digest(arrays, 0)
        # A version written and then abandoned (e.g. a block evicted, then emptied): never committed.
        store.write_block("4-0", random_block(rng, 3, 0), CELL)
        removed = [k for k in table if k not in updated][:1] if step % 2 else []
        store.commit(updated, removed)
        table = {k: v for k, v in table.items() if k not in removed} | {k: i.version for k, i in updated.items()}
        history.append(dict(table))
        live = {(k, v) for t in history[-2:] for k, v in t.items()}
        assert on_disk_versions(root) == live, step
        assert sorted(int(p.name) for p in (root / "commits").iterdir() if p.is_dir()) == list(
            range(max(0, step - 1), step + 1)
        )
    reopened = Store.open(root, verify="data")
    assert {k: i.version for k, i in reopened.table.items()} == history[-1]
    for k, info in reopened.table.items():
        assert block_digest(reopened.read_block(k), 0) == digests[k, info.version]
    # The previous commit's versions are still whole: a rank that has not refreshed yet reads them.
    for k, v in history[-2].items():
        old = BlockInfo(k, v, 4, CELL, CELL, CELL)
        assert block_digest(reopened.read_block(k, old), 0) == digests[k, v]


def test_open_after_crash_removes_what_no_commit_names(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    root = tmp_path / "s.zarr"
    store = Store.create(root, {"sh_degree": 0})
    store.commit({"1-0": store.write_block("1-0", random_block(rng, 5, 0), CELL)})
    # What a crash mid-step leaves: a written version no commit names, a commit document written
    # but never made HEAD, and a temp file of an interrupted atomic write.
    store.write_block("1-1", random_block(rng, 5, 0), CELL)
    store.write_block("1-0", random_block(rng, 5, 0), CELL)
    (root / "commits" / "1").mkdir()
    (root / "commits" / "1" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    (root / f"zarr.{uuid.uuid4().hex}.partial").write_text("half")
    (root / "blocks" / "not-a-key").mkdir()  # not ours: left alone
    assert Store.open(root, mode="r").head == 0
    assert on_disk_versions(root) == {("1-0", 0), ("1-0", 1), ("1-1", 1)}  # a reader deletes nothing
    reopened = Store.open(root)
    assert reopened.head == 0
    assert on_disk_versions(root) == {("1-0", 0)}
    assert not (root / "blocks" / "1-1").exists() and not (root / "commits" / "1").exists()
    assert not list(root.glob("*.partial")) and (root / "blocks" / "not-a-key").is_dir()
    # A rank that must not collect (another rank may be writing) leaves uncommitted versions be.
    reopened.write_block("1-2", random_block(rng, 5, 0), CELL)
    Store.open(root, gc=False)
    assert ("1-2", 1) in on_disk_versions(root)


@pytest.mark.parametrize("make", [MemoryStore, lambda: f"memory://octosplat-{uuid.uuid4().hex}"], ids=["memory", "fsspec"])
def test_other_zarr_stores_take_the_same_path(make) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(4)
    target = make()
    store = Store.create(target, {"sh_degree": 1}, keep_commits=1)
    a, b = random_block(rng, 50, 1), random_block(rng, 70, 1)
    store.commit({"1-0": store.write_block("1-0", a, CELL), "1-1": store.write_block("1-1", a, CELL)})
    store.write_block("1-2", b, CELL)  # uncommitted, removed by the next writable open
    store.commit({"1-1": store.write_block("1-1", b, CELL)})
    reopened = Store.open(target, verify="data")
    assert reopened.head == 1 and set(reopened.table) == {"1-0", "1-1"}
    assert block_digest(reopened.read_block("1-0"), 1) == block_digest(a, 1)
    assert block_digest(reopened.read_block("1-1"), 1) == block_digest(b, 1)
    names = set(reopened._backend.list_dir("blocks"))
    assert "1-2" not in names
    assert reopened._backend.list_dir("blocks/1-1") and set(reopened._backend.list_dir("blocks/1-1")) == {"zarr.json", "1"}


def test_write_block_refuses_bad_input(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 1})
    good = random_block(rng, 8, 1)
    for key in ("../etc", "1-9", "22-0", "1-0/x", ""):
        with pytest.raises(StoreKeyError, match="block key|outside"):
            store.write_block(key, good, CELL)
    cases = {
        "NaN": {**good, "means": np.where(np.eye(8, 3, dtype=bool), np.nan, good["means"]).astype(np.float32)},
        "inf": {**good, "exp_avg_sq_quats": np.full((8, 4), np.inf, np.float32)},
        "dtype": {**good, "opacities": good["opacities"].astype(np.float64)},
        "shape": {**good, "shN": np.zeros((8, 15, 3), np.float32)},
        "missing": {k: v for k, v in good.items() if k != "grad2d"},
        "row count": {**good, "count": good["count"][:5]},
        "empty": {k: v[:0] for k, v in good.items()},
    }
    for arrays in cases.values():
        with pytest.raises(BlockDataError, match="block 1-0"):
            store.write_block("1-0", arrays, CELL)
    with pytest.raises(BlockDataError, match="cell box"):
        store.write_block("1-0", good, (0, 0, 0, 1, 1))
    assert not (tmp_path / "s.zarr" / "blocks" / "1-0").exists()  # nothing half-written


def test_create_and_open_refuse_what_they_must(tmp_path: Path) -> None:
    root = tmp_path / "s.zarr"
    Store.create(root, {"sh_degree": 0})
    with pytest.raises(StoreExistsError):
        Store.create(root, {"sh_degree": 0})
    assert Store.create(root, {"sh_degree": 2}, overwrite=True).sh_degree == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    with pytest.raises(StoreExistsError, match="not an OctoSplat store"):
        Store.create(tmp_path / "other", {"sh_degree": 0}, overwrite=True)
    assert (tmp_path / "other" / "precious.txt").exists()
    with pytest.raises(StoreFormatError, match="sh_degree"):
        Store.create(tmp_path / "x", {})
    with pytest.raises(StoreFormatError, match="reserved"):
        Store.create(tmp_path / "y", {"sh_degree": 0, "head": 3})
    with pytest.raises(StoreFormatError, match="no store"):
        Store.open(tmp_path / "missing")
    ro = Store.open(root, mode="r")
    with pytest.raises(StoreError, match="read-only"):
        ro.write_block("1-0", random_block(np.random.default_rng(0), 2, 2), CELL)


def test_a_stale_view_cannot_overwrite_a_committed_version(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    root = tmp_path / "s.zarr"
    Store.create(root, {"sh_degree": 0})
    rank0, rank1 = Store.open(root), Store.open(root, gc=False)
    rank0.commit({"1-0": rank0.write_block("1-0", random_block(rng, 4, 0), CELL)})
    with pytest.raises(CommitProtocolError, match="refresh"):
        rank1.write_block("1-1", random_block(rng, 4, 0), CELL)
    rank1.refresh()
    assert rank1.head == 0 and rank1.next_version == 1
    info = rank1.write_block("1-1", random_block(rng, 4, 0), CELL)
    with pytest.raises(CommitProtocolError, match="neither new"):
        rank0.commit({"1-1": BlockInfo(**{**info.__dict__, "version": 0})})
    assert rank0.commit({"1-1": info}) == 1


def test_durable_local_writes_leave_no_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "s.zarr"
    store = Store.create(root, {"sh_degree": 0}, durable=True)
    store.commit({"1-0": store.write_block("1-0", random_block(np.random.default_rng(7), 4, 0), CELL)})
    leftovers = [p for p in root.rglob("*") if p.name.endswith(".partial")]
    assert leftovers == [] and sorted(os.listdir(root / "commits")) == ["0", "zarr.json"]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.cname}-{c.checksum}-{c.chunk_mb}-{c.min_saving}")
@pytest.mark.parametrize("sh_degree", [0, 3])
def test_block_files_are_what_zarr_itself_writes(codec, sh_degree, tmp_path):
    """The block writer encodes chunks and documents itself (zarr's writer is slow); every file it
    makes must be byte for byte what zarr's `create_array` makes of the same array."""
    import math

    from zarr.core.sync import sync

    store = Store.create(tmp_path / "s.zarr", {"sh_degree": sh_degree}, codec=codec)
    arrays = random_block(np.random.default_rng(3), 700, sh_degree)
    for name in arrays:
        if name not in PARAM_NAMES:
            arrays[name][:] = 0  # the state pack compresses, the parameters do not: both codec branches
    info = store.write_block("0-0", arrays, CELL)
    version = tmp_path / "s.zarr" / "blocks" / "0-0" / str(info.version)
    for name, a in pack(arrays, store.layout, 700).items():
        ref = MemoryStore()
        rows = min(len(a), codec.chunk_rows(a.dtype.itemsize * math.prod(a.shape[1:])))
        sync(zarr.api.asynchronous.create_array(
            ref, name=name, data=a, chunks=(rows, *a.shape[1:]), filters=None, compressors=codec.compressors(a),
            fill_value=0, chunk_key_encoding={"name": "default", "separator": "."},
            config={"write_empty_chunks": True}))
        expected = {k: v.to_bytes() for k, v in ref._store_dict.items() if k.startswith(f"{name}/")}
        ours = {f"{name}/{f.name}": f.read_bytes() for f in (version / name).iterdir()}
        assert ours.keys() == expected.keys(), name
        for key in ours:
            if key.endswith("zarr.json"):
                assert json.loads(ours[key]) == json.loads(expected[key]), key
            else:
                assert ours[key] == expected[key], key
        np.testing.assert_array_equal(zarr.open_array(version / name, mode="r")[...], a)


def test_a_version_is_three_packed_arrays(tmp_path: Path) -> None:
    """The point of the packed format: few files per block write. Each logical array is a run of
    columns of its pack, as the root's column map says."""
    rng = np.random.default_rng(11)
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 2}, durable=False)
    arrays = random_block(rng, 50, 2)
    info = store.write_block("1-3", arrays, CELL)
    version = tmp_path / "s.zarr" / "blocks" / "1-3" / str(info.version)
    files = sorted(str(p.relative_to(version)) for p in version.rglob("*") if p.is_file())
    assert files == sorted(["zarr.json"] + [f"{a}/{f}" for a in ("params", "state", "counters") for f in ("zarr.json", "c.0.0")])
    rows = {n: r for doc in store.attrs["layout"].values() for n, r in doc["rows"].items()}
    assert set(rows) == set(arrays)
    group = zarr.open_group(version, mode="r")
    for name, a in arrays.items():
        pack_name = next(p for p, doc in store.attrs["layout"].items() if name in doc["rows"])
        lo, hi = rows[name]
        np.testing.assert_array_equal(group[pack_name][lo:hi].reshape(a.shape), a)


@pytest.mark.parametrize("codec", [CodecConfig(), CodecConfig(min_saving=0)], ids=["raw-where-noise", "lz4"])
def test_rewriting_an_uncommitted_version_in_place(tmp_path: Path, codec: CodecConfig) -> None:
    """An evicted block is rewritten over its uncommitted version: data of another size (a chunk
    that compresses less or more, another row count) must read back exactly, with no stale bytes."""
    rng = np.random.default_rng(12)
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 1}, codec=codec, durable=False)
    noisy = random_block(rng, 300, 1)
    zeros = {**noisy, **{n: np.zeros_like(a) for n, a in noisy.items() if n not in PARAM_NAMES}}
    fewer = random_block(rng, 120, 1)
    for arrays in (zeros, noisy, zeros, fewer, noisy):
        info = store.write_block("1-0", arrays, CELL)
        assert info.version == 0
        assert block_digest(store.read_block("1-0", info), 1) == block_digest(arrays, 1)
    store.commit({"1-0": info})
    reopened = Store.open(tmp_path / "s.zarr", verify="data")
    assert block_digest(reopened.read_block("1-0"), 1) == block_digest(noisy, 1)


@pytest.mark.parametrize("sh_degree", [0, 3])
def test_packs_hold_the_arrays_back_to_back_and_unpack_without_copies(sh_degree: int) -> None:
    from storage.packing import pack_layout, pack_shapes, unpack
    from storage.schema import block_schema

    rng = np.random.default_rng(13)
    schema, layout = block_schema(sh_degree), pack_layout(sh_degree)
    arrays = random_block(rng, 37, sh_degree)
    packed = pack(arrays, layout, 37)
    assert {k: (v.shape, v.dtype) for k, v in packed.items()} == pack_shapes(layout, 37)
    # every pack is its arrays' bytes one after another, in the layout's order
    for name, (dtype, rows) in layout.items():
        flat = np.concatenate([arrays[n].reshape(-1) for n in rows])
        assert packed[name].dtype == dtype and np.array_equal(packed[name].reshape(-1), flat)
    out = unpack(packed, layout, list(schema), schema)
    assert block_digest(out, sh_degree) == block_digest(arrays, sh_degree)
    for name, a in out.items():
        # views: contiguous, writable, and writing one changes the pack (the cache steps them in place)
        home = packed[next(p for p, (_, r) in layout.items() if name in r)]
        assert a.flags.c_contiguous and a.flags.writeable and (a.size == 0 or np.shares_memory(a, home))
    out["opacities"][5] = 123.0
    lo, _ = layout["params"][1]["opacities"]
    assert packed["params"].reshape(-1)[lo * 37 + 5] == 123.0
