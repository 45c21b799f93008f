"""Property-based tests over every parser (issue 19): a valid file, mutated (bytes flipped, the
file truncated, bytes inserted or deleted, header numbers made huge, JSON values made odd), gives
either a valid result or the package's own error type: never another exception, never a hang
(hypothesis's per-example deadline), never an allocation larger than the file justifies.

Derandomized and without an example database, so every run tries the same examples.
"""
from __future__ import annotations

import io
import itertools
import json
import resource
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from storage import Store, StoreError
from storage.table import Commit, encode_columns
from tests.helpers.mutations import byte_mutations, json_mutations
from tests.helpers.store_data import random_block
from tests.test_reliability import _c2w
from tools.ply import PlyError, open_ply, write_ply
from tools.scenes import random_splats
from tools.tile.config import TileConfig, TileError
from tools.tile.sources import open_source
from train.data import (
    ColmapModel,
    ColmapPoints,
    DatasetError,
    read_colmap,
    write_colmap_binary,
    write_colmap_text,
)
from train.data.transforms import read_transforms_scene

# What a parse may allocate (tracemalloc's peak, numpy's arrays included): a fixed allowance
# for the interpreter's bookkeeping plus a generous multiple of the file's own size. A header
# value believed without a check allocates gigabytes; every defect of issue 19 did.
ALLOC_FIXED = 32 << 20
ALLOC_PER_BYTE = 64
# Besides the measurement, an address-space cap a little above what the process holds, so a
# defect fails one example with a MemoryError instead of swapping the machine.
HEADROOM = 4 << 30
PROPERTY = settings(max_examples=120, deadline=5000, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
pytestmark = pytest.mark.timeout(300)  # an example that never returns: the deadline only judges those that do
TRIED: dict[str, list[int]] = {}  # parser -> [mutations tried, refused with the package's error, largest peak]


@pytest.fixture(scope="module", autouse=True)
def address_space_cap():
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    cap = used + HEADROOM if hard == resource.RLIM_INFINITY else min(hard, used + HEADROOM)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    for name, (tried, refused, peak) in sorted(TRIED.items()):
        print(f"\n{name}: {tried} mutations, {refused} refused with the package's error, {tried - refused} "
              f"valid; largest allocation peak {peak / 2**20:.1f} MiB")


def check_parse(name: str, parse: Callable[[], object], errors: tuple[type[Exception], ...], size: int) -> None:
    """Run `parse`: it may succeed or raise one of `errors`; anything else propagates and fails the
    test. Its allocations may not exceed the budget of a file of `size` bytes."""
    counts = TRIED.setdefault(name, [0, 0, 0])
    counts[0] += 1
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a file read in part warns; that is allowed
            parse()
    except errors:
        counts[1] += 1
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        counts[2] = max(counts[2], peak)
    limit = ALLOC_FIXED + ALLOC_PER_BYTE * size
    assert peak <= limit, f"{name}: a {size}-byte file made the parser allocate {peak:,} bytes (limit {limit:,})"


def fuzz_file(folder: Path, name: str, raw: bytes, suffix: str, read: Callable[[Path], object],
              error: type[Exception], text_end: int | None = None) -> None:
    """The property for a one-file format: each mutation of `raw`, in a file of its own in `folder`
    (a memory-mapped one of the example before may still be open), reads or raises `error`."""
    names = itertools.count()

    @PROPERTY
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        mutated = data.draw(byte_mutations(raw, text_end))
        path = folder / f"{next(names)}{suffix}"
        path.write_bytes(mutated)
        check_parse(name, lambda: read(path), (error,), len(mutated))
        path.unlink()

    prop()


# ---------------------------------------------------------------- COLMAP


@pytest.fixture(scope="module")
def colmap_model(shared_data: Path) -> ColmapModel:
    """Three images of lund_door with their camera and 40 of the points they see (tracks cut to
    those images, observations left out: models written from known poses have none)."""
    from train.data.colmap import ColmapImage

    model = read_colmap(shared_data / "lund_door")
    images = {i: model.images[i] for i in sorted(model.images)[:3]}
    images = {i: ColmapImage(im.image_id, im.qvec, im.tvec, im.camera_id, im.name, np.zeros((0, 2)),
                             np.zeros(0, np.int64)) for i, im in images.items()}
    cameras = {im.camera_id: model.cameras[im.camera_id] for im in images.values()}
    pts = model.points
    keep = np.arange(40)
    image_ids, idx, offsets = [], [], [0]
    for i in keep:
        ids, ix = pts.track(i)
        mine = np.isin(ids, list(images))
        image_ids.append(ids[mine])
        idx.append(ix[mine])
        offsets.append(offsets[-1] + int(mine.sum()))
    points = ColmapPoints(pts.ids[keep], pts.xyz[keep], pts.rgb[keep], pts.error[keep], np.array(offsets, np.int64),
                          np.concatenate(image_ids).astype(np.int32), np.concatenate(idx).astype(np.int32))
    return ColmapModel(cameras, images, points)


def _colmap_files(tmp_path_factory, model: ColmapModel, write, ext: str) -> tuple[Path, dict[str, bytes]]:
    folder = tmp_path_factory.mktemp(f"colmap{ext}")
    write(model, folder)
    read_colmap(folder)  # the unmutated model is valid
    return folder, {stem: (folder / f"{stem}{ext}").read_bytes() for stem in ("cameras", "images", "points3D")}


@pytest.mark.parametrize("ext", [".txt", ".bin"])
def test_mutated_colmap_models_parse_or_raise_a_colmap_error(colmap_model, tmp_path_factory, ext: str) -> None:
    write = write_colmap_text if ext == ".txt" else write_colmap_binary
    folder, files = _colmap_files(tmp_path_factory, colmap_model, write, ext)

    @PROPERTY
    @given(stem=st.sampled_from(sorted(files)), data=st.data())
    def prop(stem: str, data: st.DataObject) -> None:
        mutated = data.draw(byte_mutations(files[stem]))
        (folder / f"{stem}{ext}").write_bytes(mutated)
        try:
            check_parse(f"COLMAP {ext[1:]}", lambda: read_colmap(folder), (DatasetError,),
                        sum(len(b) for b in files.values()) + len(mutated))
        finally:
            (folder / f"{stem}{ext}").write_bytes(files[stem])

    prop()


# ---------------------------------------------------------------- transforms.json


@pytest.fixture(scope="module")
def transforms_folder(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("transforms")
    (folder / "images").mkdir()
    for i in range(3):
        Image.new("RGB", (16, 12), (i * 90, 60, 30)).save(folder / "images" / f"f{i}.png")
    write_ply(folder / "points.ply", random_splats(20, 0, seed=1))
    doc = {"camera_angle_x": 0.9, "w": 16, "h": 12, "k1": 0.01, "aabb_scale": 4, "ply_file_path": "points.ply",
           "frames": [{"file_path": f"images/f{i}.png", "transform_matrix": _c2w(i * 0.3), "fl_y": 21.0}
                      for i in range(3)]}
    (folder / "transforms.json").write_text(json.dumps(doc))
    read_transforms_scene(folder)  # the unmutated dataset is valid
    return folder, doc


@pytest.mark.parametrize("kind", ["bytes", "values"])
def test_mutated_transforms_parse_or_raise_a_dataset_error(transforms_folder, kind: str) -> None:
    folder, doc = transforms_folder
    text = json.dumps(doc, indent=1).encode()

    @PROPERTY
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        mutated = data.draw(byte_mutations(text) if kind == "bytes" else json_mutations(doc))
        (folder / "transforms.json").write_bytes(mutated)
        check_parse("transforms.json", lambda: read_transforms_scene(folder), (DatasetError,), len(mutated))

    prop()


# ---------------------------------------------------------------- PLY


def _ascii_points(points: np.ndarray, colors: np.ndarray) -> bytes:
    header = ["ply", "format ascii 1.0", "comment lund_door points", f"element vertex {len(points)}",
              "property float x", "property float y", "property float z",
              "property uchar red", "property uchar green", "property uchar blue", "end_header"]
    rows = [f"{x!r} {y!r} {z!r} {r} {g} {b}" for (x, y, z), (r, g, b) in zip(points.tolist(), colors.tolist())]
    return ("\n".join(header + rows) + "\n").encode()


def _big_endian(little: bytes) -> bytes:
    """A little-endian float32 PLY as the same file in big-endian."""
    end = little.index(b"end_header\n") + len(b"end_header\n")
    header = little[:end].replace(b"binary_little_endian", b"binary_big_endian")
    return header + np.frombuffer(little[end:], "<f4").astype(">f4").tobytes()


def _ascii_gaussians(little: bytes) -> bytes:
    end = little.index(b"end_header\n") + len(b"end_header\n")
    header = little[:end].replace(b"binary_little_endian", b"ascii")
    width = header.count(b"property float")
    rows = np.frombuffer(little[end:], "<f4").reshape(-1, width)
    return header + "".join(" ".join(repr(v) for v in row) + "\n" for row in rows.tolist()).encode()


@pytest.fixture(scope="module")
def ply_files(colmap_model, tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("ply")
    splats = random_splats(300, 1, seed=3)
    write_ply(folder / "g.ply", splats)
    write_ply(folder / "c.ply", splats, compressed=True)
    little = (folder / "g.ply").read_bytes()
    pts = colmap_model.points
    files = {"ascii points": _ascii_points(pts.xyz, pts.rgb), "binary little endian": little,
             "binary big endian": _big_endian(little), "ascii 3DGS": _ascii_gaussians(little),
             "compressed": (folder / "c.ply").read_bytes()}
    for name, raw in files.items():  # every one is valid as written
        path = folder / f"{name.replace(' ', '_')}.ply"
        path.write_bytes(raw)
        reader = open_ply(path)
        assert reader.count == (len(pts) if name == "ascii points" else 300), name
        reader.read(0, reader.count)
    return files


def _read_all(path: Path) -> None:
    reader = open_ply(path)
    reader.read(0, reader.count)


@pytest.mark.parametrize("name", ["ascii points", "binary little endian", "binary big endian", "ascii 3DGS",
                                  "compressed"])
def test_mutated_ply_files_read_or_raise_a_ply_error(ply_files, tmp_path: Path, name: str) -> None:
    raw = ply_files[name]
    header_end = raw.index(b"end_header") + len(b"end_header\n")
    fuzz_file(tmp_path, f"PLY {name}", raw, ".ply", _read_all, PlyError, text_end=header_end)


# ---------------------------------------------------------------- npz


@pytest.fixture(scope="module")
def npz_files(shared_data: Path) -> dict[str, bytes]:
    """500 points of test_garden.npz, stored and deflated."""
    with np.load(shared_data / "test_garden.npz") as garden:
        arrays = {"means3d": garden["means3d"][:500], "colors": garden["colors"][:500]}
    out = {}
    for name, compression in (("stored", zipfile.ZIP_STORED), ("deflated", zipfile.ZIP_DEFLATED)):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression) as archive:
            for key, a in arrays.items():
                member = io.BytesIO()
                np.save(member, a)
                archive.writestr(f"{key}.npy", member.getvalue())
        out[name] = buf.getvalue()
    return out


def _read_npz(path: Path) -> None:
    source = open_source(path, TileConfig())
    source.read(0, source.count)


@pytest.mark.parametrize("name", ["stored", "deflated"])
def test_mutated_npz_files_read_or_raise_a_tile_error(npz_files, tmp_path: Path, name: str) -> None:
    raw = npz_files[name]
    (tmp_path / "valid.npz").write_bytes(raw)
    _read_npz(tmp_path / "valid.npz")
    fuzz_file(tmp_path, f"npz {name}", raw, ".npz", _read_npz, TileError)


# ---------------------------------------------------------------- store documents


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    """A real store with two commits of three blocks."""
    path = tmp_path_factory.mktemp("store") / "s.zarr"
    store = Store.create(path, {"sh_degree": 1, "world_transform": np.eye(4).tolist()}, durable=False)
    rng = np.random.default_rng(0)
    for step in (1, 2):
        infos = {key: store.write_block(key, random_block(rng, 20, 1), cell)
                 for key, cell in (("1-0", (0, 0, 0, 1, 1, 1)), ("1-1", (1, 0, 0, 2, 1, 1)), ("1-7", (1, 1, 1, 2, 2, 2)))}
        store.commit(infos, state={"step": step, "steps": 10, "refine_pending": []})
    store.close()
    return path


@pytest.mark.parametrize("document,kind", [("zarr.json", "bytes"), ("zarr.json", "values"),
                                           ("commits/1/zarr.json", "bytes"), ("commits/1/zarr.json", "values")])
def test_mutated_store_documents_open_or_raise_a_store_error(store_path: Path, document: str, kind: str) -> None:
    """The root document (attributes and HEAD) and the commit document (table and state)."""
    path = store_path / document
    raw = path.read_bytes()

    @PROPERTY
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        mutated = data.draw(byte_mutations(raw) if kind == "bytes" else json_mutations(json.loads(raw)))
        path.write_bytes(mutated)
        try:
            check_parse(f"store {document}", lambda: Store.open(store_path, mode="r", verify="blocks").close(),
                        (StoreError,), len(mutated))
        finally:
            path.write_bytes(raw)

    prop()


def test_mutated_compact_tables_decode_or_raise_a_store_error() -> None:
    """The column encoding of tables above `COMPACT_ABOVE` blocks, decoded straight from the document."""
    from storage.table import BlockInfo

    table = {f"3-{c:x}": BlockInfo(f"3-{c:x}", c % 2, 10 + c, (0, 0, 0, 1, 1, 1), (0, 0, 0, 1, 1, 1),
                                   (-1, -1, -1, 2, 2, 2)) for c in range(40)}
    doc = {"zarr_format": 3, "node_type": "group",
           "attributes": {"generation": 1, "columns": encode_columns(table), "state": {"step": 3}}}
    assert Commit.from_doc(doc, 1, "s").table == table

    @PROPERTY
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(["bytes", "values"]))
        raw = json.dumps(doc).encode()
        mutated = data.draw(byte_mutations(raw) if kind == "bytes" else json_mutations(doc))

        def parse() -> None:
            from storage.backend import decode_json

            Commit.from_doc(decode_json(mutated, "s: commits/1/zarr.json"), 1, "s")

        check_parse("compact commit table", parse, (StoreError,), len(mutated))

    prop()


# ---------------------------------------------------------------- what the properties found (regressions)


def test_a_compressed_ply_whose_sh_properties_are_misnamed_is_a_ply_error(ply_files, tmp_path: Path) -> None:
    path = tmp_path / "c.ply"  # found by the compressed-PLY property: a ValueError from numpy before
    path.write_bytes(ply_files["compressed"].replace(b"property uchar f_rest_0\n", b"property uchar f_rest_-1\n"))
    with pytest.raises(PlyError, match=r"'sh' element's properties are not f_rest_0 \.\. f_rest_8"):
        _read_all(path)


def test_an_npz_with_a_corrupt_deflate_stream_is_a_tile_error(npz_files, tmp_path: Path) -> None:
    raw = bytearray(npz_files["deflated"])  # found by the npz property: a zlib.error before
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        info = archive.getinfo("means3d.npy")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start] = 0b111  # the final block, of the reserved type 3
    (tmp_path / "p.npz").write_bytes(bytes(raw))
    with pytest.raises(TileError, match=r"p\.npz: unreadable npz \(Error -3 while decompressing data: invalid block type"):
        _read_npz(tmp_path / "p.npz")


@pytest.mark.parametrize("edit,problem", [
    (lambda t: t.replace(b'"w": 16', b'"w": ' + b"1" * 5000), "not JSON that can be read: Exceeds the limit"),
    (lambda t: t.replace(b'"frames": [', b'"frames": [' + b"[" * 5000), "not JSON that can be read: maximum recursion"),
    (lambda t: t.replace(b'"camera_angle_x": 0.9', b'"camera_angle_x": 1' + b"0" * 400),
     "camera_angle_x must be a finite number, got 1000000000"),
    (lambda t: t.replace(b"-0.0", b"1" + b"0" * 400, 1), "transform_matrix is not a matrix of numbers"),
    (lambda t: t.replace(b"images/f1.png", b"images/f" + b"1" * 300 + b".png"), "File name too long"),
])
def test_json_a_transforms_reader_cannot_take_is_a_dataset_error(transforms_folder, edit, problem: str) -> None:
    """Found by the transforms.json properties: a ValueError (a 5000-digit number), a RecursionError,
    OverflowErrors (an integer too large for a float) and an OSError (a file_path too long) before."""
    folder, doc = transforms_folder
    (folder / "transforms.json").write_bytes(edit(json.dumps(doc).encode()))
    try:
        with pytest.raises(DatasetError, match=problem):
            read_transforms_scene(folder)
    finally:
        (folder / "transforms.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("document,edit,problem", [
    ("zarr.json", lambda t: t.replace(b'"head": 1', b'"head": ' + b"1" * 5000), "is not valid JSON: Exceeds the limit"),
    ("zarr.json", lambda t: t.replace(b'"head": 1', b'"head": ' + b"[" * 5000), "is not valid JSON: maximum recursion"),
    ("zarr.json", lambda t: t.replace(b'"head": 1', b'"head": 1' + b"0" * 400), "HEAD 1000000000"),
    ("commits/1/zarr.json", lambda t: t.replace(b"1.0", b"1" + b"0" * 400, 1), "holds a non-finite or non-numeric"),
])
def test_store_documents_with_huge_numbers_or_deep_nesting_are_store_errors(store_path: Path, document: str, edit,
                                                                            problem: str) -> None:
    """Also found by giving the mutations such numbers: a ValueError, a RecursionError, an
    OSError (HEAD naming a file too long) and an OverflowError (a box value) before."""
    path = store_path / document
    raw = path.read_bytes()
    assert edit(raw) != raw
    path.write_bytes(edit(raw))
    try:
        with pytest.raises(StoreError, match=problem):
            Store.open(store_path, mode="r")
    finally:
        path.write_bytes(raw)


def test_a_ply_declaring_more_rows_than_an_index_holds_is_a_ply_error(ply_files, tmp_path: Path) -> None:
    path = tmp_path / "a.ply"  # found by the ASCII PLY property: itertools.islice's ValueError before
    path.write_bytes(ply_files["ascii points"].replace(b"element vertex 40", b"element vertex " + b"9" * 30))
    with pytest.raises(PlyError, match=r"truncated: element 'vertex' has 40 of 9{30} rows"):
        _read_all(path)


@pytest.mark.parametrize("ext", [".txt", ".bin"])
def test_colmap_ids_beyond_int64_are_colmap_errors(colmap_model, tmp_path_factory, ext: str) -> None:
    """Found by the COLMAP properties: OverflowErrors from numpy before (a binary point id of 2^64 - 1,
    a text id of 31 digits)."""
    folder, files = _colmap_files(tmp_path_factory, colmap_model, write_colmap_text if ext == ".txt"
                                  else write_colmap_binary, ext)
    pid = int(colmap_model.points.ids[0])
    if ext == ".txt":
        text = files["points3D"].decode().replace(f"\n{pid} ", "\n1" + "0" * 30 + " ", 1)
        (folder / "points3D.txt").write_text(text)
        problem = r"points3D\.txt: line 2: cannot parse point id from '1000000000000000000000000000000'"
    else:
        raw = files["points3D"]
        (folder / "points3D.bin").write_bytes(raw[:8] + b"\xff" * 8 + raw[16:])
        problem = r"points3D\.bin: record 0: point id 18446744073709551615 is beyond the int64"
    with pytest.raises(DatasetError, match=problem):
        read_colmap(folder)
