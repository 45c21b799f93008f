"""Hostile inputs and faults (issue 19): each is refused with one `error:` line and exit 1 (no
traceback, no allocation the file does not justify, no hang, nothing left behind), or survived."""
from __future__ import annotations

import errno
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from storage import Store, StoreError
from storage.cache import BlockCache
from tests.helpers.store_data import random_block

REPO = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 6 << 30  # address space of a tool run: an unchecked header allocates far more


def run_tool(module: str, *args: str | Path, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` with its memory capped, so a defect fails the test, not the machine."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap, env={**os.environ, **(env or {})})


def assert_refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1 and exactly one stderr line, `error: ...` holding every fragment; returns it."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def assert_nothing_left(out: Path) -> None:
    assert not os.path.lexists(out), f"{out} was created"
    assert not list(out.parent.glob(f"{out.name}.*")), list(out.parent.glob(f"{out.name}.*"))


def _c2w(angle: float) -> list[list[float]]:  # a camera on a ring looking at the origin (OpenGL axes)
    c, s = np.cos(angle), np.sin(angle)
    return [[-s, 0.0, c, 4 * c], [c, 0.0, s, 4 * s], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]


def transforms_dataset(folder: Path, frames: list[dict] | None = None, **meta) -> Path:
    """A valid two-frame transforms.json dataset with small images; `meta` overrides its keys."""
    (folder / "images").mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (16, 12), (i * 90, 60, 30)).save(folder / "images" / f"f{i}.png")
    doc = {"fl_x": 20.0, "w": 16, "h": 12,
           "frames": frames or [{"file_path": f"images/f{i}.png", "transform_matrix": _c2w(i * 0.3)} for i in range(2)]}
    doc.update(meta)
    (folder / "transforms.json").write_text(json.dumps(doc))
    return folder


# ---------------------------------------------------------------- 1. absurd image sizes


@pytest.mark.parametrize("kind", ["transforms", "colmap"])
def test_image_sizes_beyond_the_maximum_are_refused_before_anything_is_allocated(tmp_path: Path, kind: str) -> None:
    if kind == "transforms":
        data = transforms_dataset(tmp_path / "d", w=1e9, h=1e9, k1=0.1)
        where = "transforms.json"
    else:
        data = tmp_path / "d"
        (data / "sparse" / "0").mkdir(parents=True)
        (data / "images").mkdir()
        Image.new("RGB", (16, 12)).save(data / "images" / "a.png")
        (data / "sparse" / "0" / "cameras.txt").write_text("1 OPENCV 1000000000 1000000000 20 20 8 6 0.1 0 0 0\n")
        (data / "sparse" / "0" / "images.txt").write_text("1 1 0 0 0 0 0 4 1 a.png\n\n")
        where = "cameras.txt"
    out = tmp_path / "s.zarr"
    proc = run_tool("tools.tile", data, "--out", out, "--init-random", "100", timeout=120)
    assert_refused(proc, where, "image size 1000000000x1000000000 exceeds the maximum of 65,536 pixels a side")
    assert_nothing_left(out)


# ---------------------------------------------------------------- 2. PLY headers that lie, 4. malformed values


def ascii_ply(path: Path, declared: int, rows: list[str], properties: tuple[str, ...] = ("x", "y", "z")) -> Path:
    header = ["ply", "format ascii 1.0", f"element vertex {declared}", *(f"property float {p}" for p in properties),
              "end_header"]
    path.write_text("\n".join(header + rows) + "\n")
    return path


def test_an_ascii_ply_declaring_more_rows_than_it_holds_stops_at_the_end_of_the_file(tmp_path: Path) -> None:
    src = ascii_ply(tmp_path / "a.ply", 10**12, ["0 0 0"])
    start = time.perf_counter()
    proc = run_tool("tools.tile", src, "--out", tmp_path / "s.zarr", timeout=60)
    assert_refused(proc, "a.ply", "truncated: element 'vertex' has 1 of 1000000000000 rows")
    assert time.perf_counter() - start < 30
    assert_nothing_left(tmp_path / "s.zarr")


def test_a_ply_header_count_below_the_rows_tiles_with_a_warning(tmp_path: Path) -> None:
    rows = [f"{i} {i % 7} {i % 3}" for i in range(50)]
    src = ascii_ply(tmp_path / "a.ply", 40, rows)
    proc = run_tool("tools.tile", src, "--out", tmp_path / "s.zarr", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"warning: {src}: the file holds 10 more rows after the 40 its header declares; they are ignored "
        "(is the header's element count too small?)"]
    assert sum(info.count for info in Store.open(tmp_path / "s.zarr").table.values()) == 40
    binary = tmp_path / "b.ply"  # the same in a binary file: bytes after the declared rows
    header = b"ply\nformat binary_little_endian 1.0\nelement vertex 3\nproperty float x\nproperty float y\n" \
             b"property float z\nend_header\n"
    binary.write_bytes(header + np.arange(15, dtype="<f4").tobytes())
    proc = run_tool("tools.tile", binary, "--out", tmp_path / "b.zarr", timeout=120)
    assert proc.returncode == 0 and "warning: " in proc.stderr and "24 bytes after the rows" in proc.stderr, proc.stderr


def test_a_ply_property_declared_twice_is_a_header_error(tmp_path: Path) -> None:
    src = ascii_ply(tmp_path / "a.ply", 1, ["0 0 0 0"], ("x", "y", "z", "x"))
    proc = run_tool("tools.tile", src, "--out", tmp_path / "s.zarr", timeout=60)
    assert_refused(proc, "a.ply", "header line 7", "property 'x' is declared twice in element 'vertex'")
    assert_nothing_left(tmp_path / "s.zarr")


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_an_npz_whose_array_header_declares_more_than_the_file_holds_is_refused(tmp_path: Path, compression: int) -> None:
    header = {"descr": "<f4", "fortran_order": False, "shape": (2**36, 3)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    src = tmp_path / "p.npz"
    with zipfile.ZipFile(src, "w", compression) as archive:  # a valid zip (CRCs right), a lying .npy header
        archive.writestr("means3d.npy", buf.getvalue() + np.zeros(12, "<f4").tobytes())
    proc = run_tool("tools.tile", src, "--out", tmp_path / "s.zarr", timeout=60)
    assert_refused(proc, "p.npz", "array 'means3d' declares shape (68719476736, 3) (824,633,720,832 bytes)")
    assert_nothing_left(tmp_path / "s.zarr")


@pytest.mark.parametrize("meta", [{"camera_angle_x": 0}, {"camera_angle_x": 3.5}, {"camera_angle_y": 0.0}])
def test_a_field_of_view_outside_zero_to_pi_is_an_error(tmp_path: Path, meta: dict) -> None:
    data = transforms_dataset(tmp_path / "d", **({"fl_x": None} if "camera_angle_x" in meta else {}), **meta)
    doc = json.loads((data / "transforms.json").read_text())
    doc = {k: v for k, v in doc.items() if v is not None}
    (data / "transforms.json").write_text(json.dumps(doc))
    key = next(iter(meta))
    proc = run_tool("tools.tile", data, "--out", tmp_path / "s.zarr", "--init-random", "100", timeout=120)
    assert_refused(proc, "transforms.json", f"{key} must be a field of view in (0, pi) radians")


@pytest.mark.parametrize("flag", ["--log-every", "--commit-every"])
def test_zero_log_and_commit_intervals_are_refused(tmp_path: Path, flag: str) -> None:
    proc = run_tool("train", "--data", tmp_path, "--store", tmp_path / "s.zarr", flag, "0", timeout=120)
    assert_refused(proc, f"{flag} 0: must be at least 1")


# ---------------------------------------------------------------- 6. silent acceptance


@pytest.mark.parametrize("aabb_scale", [0, -2])
def test_a_non_positive_aabb_scale_is_refused(tmp_path: Path, aabb_scale: float) -> None:
    data = transforms_dataset(tmp_path / "d", aabb_scale=aabb_scale)
    proc = run_tool("tools.tile", data, "--out", tmp_path / "s.zarr", "--init-random", "100", timeout=120)
    assert_refused(proc, "transforms.json", f"aabb_scale {float(aabb_scale)!r}", "must be positive")
    assert_nothing_left(tmp_path / "s.zarr")


def test_nan_float_colours_in_an_npz_are_dropped_and_counted(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    colors = rng.random((200, 3)).astype(np.float32)
    colors[[3, 50, 51], 1] = np.nan
    np.savez(tmp_path / "p.npz", means3d=rng.random((200, 3)).astype(np.float32), colors=colors)
    proc = run_tool("tools.tile", tmp_path / "p.npz", "--out", tmp_path / "s.zarr", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Gaussians     197  (3 rows with NaN/inf values dropped)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("file_path", ["../outside.png", "/etc/passwd", "images/../../outside.png"])
def test_image_paths_outside_the_dataset_are_refused_unless_allowed(tmp_path: Path, file_path: str) -> None:
    Image.new("RGB", (16, 12)).save(tmp_path / "outside.png")
    frames = [{"file_path": "images/f0.png", "transform_matrix": _c2w(0.0)},
              {"file_path": file_path, "transform_matrix": _c2w(0.3)}]
    data = transforms_dataset(tmp_path / "d", frames=frames)
    proc = run_tool("tools.tile", data, "--out", tmp_path / "s.zarr", "--init-random", "100", timeout=120)
    assert_refused(proc, "frames[1]", f"file_path {file_path!r} lies outside the dataset folder",
                   "--allow-external-images")
    assert_nothing_left(tmp_path / "s.zarr")
    if file_path != "/etc/passwd":  # an image there: allowed, it is followed
        proc = run_tool("tools.tile", data, "--out", tmp_path / "s.zarr", "--init-random", "100",
                        "--allow-external-images", timeout=120)
        assert proc.returncode == 0 and "2 cameras" in proc.stdout, proc.stderr


def test_colmap_image_names_outside_the_image_folder_are_refused(tmp_path: Path) -> None:
    data = tmp_path / "d"
    (data / "sparse" / "0").mkdir(parents=True)
    (data / "images").mkdir()
    Image.new("RGB", (16, 12)).save(tmp_path / "outside.png")
    (data / "sparse" / "0" / "cameras.txt").write_text("1 PINHOLE 16 12 20 20 8 6\n")
    (data / "sparse" / "0" / "images.txt").write_text("1 1 0 0 0 0 0 4 1 ../../outside.png\n\n")
    proc = run_tool("tools.tile", data, "--out", tmp_path / "s.zarr", "--init-random", "100", timeout=120)
    assert_refused(proc, "images.txt: line 1 (image 1)", "image name '../../outside.png' lies outside the image folder",
                   "--allow-external-images")
    assert_nothing_left(tmp_path / "s.zarr")


# ---------------------------------------------------------------- 7. leftovers and exit codes


def test_a_killed_tile_run_leaves_a_temp_store_the_next_run_removes_and_names(tmp_path: Path) -> None:
    np.savez(tmp_path / "p.npz", means3d=np.random.default_rng(0).random((300, 3)).astype(np.float32))
    out = tmp_path / "s.zarr"
    victim = subprocess.Popen(["sleep", "0"])
    victim.wait()  # a pid that no longer runs
    stale = tmp_path / f"s.zarr.tmp-{victim.pid}"
    (stale / "blocks").mkdir(parents=True)
    (stale / "zarr.json").write_text("{}")
    scratch = tmp_path / f"s.zarr.sort-{victim.pid}-x1y2z3"  # an external sort's runs
    scratch.mkdir()
    other = tmp_path / "t.zarr.tmp-1"  # another output's: not ours to touch
    other.mkdir()
    proc = run_tool("tools.tile", tmp_path / "p.npz", "--out", out, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"warning: removed {stale}, the unfinished store of an earlier run (process {victim.pid})" in proc.stderr
    assert f"warning: removed {scratch}, the sort scratch of an earlier run (process {victim.pid})" in proc.stderr
    assert not stale.exists() and not scratch.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "s.zarr", "t.zarr.tmp-1"]
    stale = tmp_path / f"n.zarr.tmp-{victim.pid}"  # a run that fails still says what it removed
    stale.mkdir()
    np.savez(tmp_path / "nan.npz", means3d=np.full((5, 3), np.nan, np.float32))
    proc = run_tool("tools.tile", tmp_path / "nan.npz", "--out", tmp_path / "n.zarr", timeout=120)
    assert proc.returncode == 1 and not stale.exists()
    assert proc.stderr.splitlines() == [
        f"warning: removed {stale}, the unfinished store of an earlier run (process {victim.pid}) that was stopped",
        f"error: {tmp_path / 'nan.npz'}: all 5 rows have NaN or infinite values"]


def test_a_run_killed_while_replacing_a_store_gets_the_old_store_put_back(tmp_path: Path) -> None:
    """Killed between `finish`'s two renames: no store at OUT, the old one at OUT.old-<pid>."""
    np.savez(tmp_path / "p.npz", means3d=np.random.default_rng(0).random((300, 3)).astype(np.float32))
    out = tmp_path / "s.zarr"
    assert run_tool("tools.tile", tmp_path / "p.npz", "--out", out, timeout=120).returncode == 0
    victim = subprocess.Popen(["sleep", "0"])
    victim.wait()
    old = tmp_path / f"s.zarr.old-{victim.pid}"
    out.rename(old)
    proc = run_tool("tools.tile", tmp_path / "p.npz", "--out", out, timeout=120)  # no --overwrite: OUT is back
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"warning: put back {out} from {old}, where a run replacing it (process {victim.pid}) was stopped",
        f"error: {out}: already exists (pass --overwrite to replace a store)"]
    assert Store.open(out, verify="data").head == 0 and not old.exists()
    shutil.copytree(out, old)  # killed after the second rename: the old store is garbage
    proc = run_tool("tools.tile", tmp_path / "p.npz", "--out", out, "--overwrite", timeout=120)
    assert proc.returncode == 0 and f"warning: removed {old}, the replaced store" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "s.zarr"]


def test_an_export_into_a_missing_folder_names_the_folder(tmp_path: Path) -> None:
    np.savez(tmp_path / "p.npz", means3d=np.random.default_rng(0).random((300, 3)).astype(np.float32))
    assert run_tool("tools.tile", tmp_path / "p.npz", "--out", tmp_path / "s.zarr", timeout=120).returncode == 0
    out = tmp_path / "missing" / "scene.ply"
    proc = run_tool("tools.export", tmp_path / "s.zarr", "--out", out, timeout=120)
    line = assert_refused(proc, f"cannot write: folder {out.parent} does not exist")
    assert ".tmp-" not in line
    assert not (tmp_path / "missing").exists()


def _train(data: Path, store: Path, out: Path, *flags: str) -> list[str]:
    return ["--data", str(data), "--store", str(store), "--out", str(out), "--no-progress", "--deterministic", *flags]


def _copy_store(store: Path, tmp_path: Path) -> Path:
    shutil.copytree(store, tmp_path / "s.zarr")
    return tmp_path / "s.zarr"


def test_a_single_ctrl_c_commits_then_exits_130(wall, tmp_path: Path) -> None:
    data, tiled = wall
    store, out = _copy_store(tiled, tmp_path), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *_train(data, store, out, "--steps", "1000",
                                                                     "--commit-every", "1000", "--log-every", "1")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count('"train"') >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    step = Store.open(store, mode="r").state["step"]
    assert proc.returncode == 130, stderr
    assert 2 <= step < 1000 and json.loads(stdout)["steps"] == step
    assert stderr.strip().splitlines()[-1] == f"interrupted: stopped at step {step} after a clean commit (--resume continues)"
    assert "Traceback" not in stderr


# ---------------------------------------------------------------- 3. a full disk during a commit

_FULL_AFTER_STEP_2 = """
import errno, sys
from storage.store import Store
real = Store.write_block
def full(self, key, arrays, cell):  # the disk fills up once the commit of step 2 is on it
    if self.state.get("step", 0) >= 2:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, key, arrays, cell)
Store.write_block = full
from train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_during_a_commit_names_the_store_the_block_and_the_intact_commit(wall, tmp_path: Path) -> None:
    data, tiled = wall
    store = _copy_store(tiled, tmp_path)
    proc = subprocess.run([sys.executable, "-c", _FULL_AFTER_STEP_2,
                           *_train(data, store, tmp_path / "run", "--steps", "6", "--commit-every", "2")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    line = assert_refused(proc, f"error: store {store}: no space left on device while writing block ",
                          "(the last commit, step 2, is intact)")
    assert Store.open(store, mode="r").state["step"] == 2
    reopened = Store.open(store)  # writable: removes the versions the failed commit left
    assert reopened.state["step"] == 2 and line
    versions = {int(v.name) for v in (store / "blocks").glob("*/*") if v.name.isdigit()}
    assert max(versions) <= reopened.head, sorted(versions)


def test_a_really_full_disk_leaves_the_last_commit_intact(wall, tmp_path: Path) -> None:
    """The same on a real file system that fills up: a tmpfs 256 KiB larger than the store."""
    data, tiled = wall
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        store = disk / "s.zarr"
        shutil.copytree(tiled, store)
        used = os.statvfs(disk)
        used_kib = (used.f_blocks - used.f_bfree) * used.f_frsize // 1024
        subprocess.run(["mount", "-o", f"remount,size={used_kib + 256}k", str(disk)], check=True)
        proc = run_tool("train", *_train(data, store, tmp_path / "run", "--steps", "200", "--commit-every", "2"),
                        timeout=600)
        assert_refused(proc, f"error: store {store}: no space left on device while writing ", "is intact)")
        before = Store.open(store, mode="r")
        after = Store.open(store, verify="data")  # writable: the failed commit's versions go
        assert (after.head, after.state) == (before.head, before.state)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_on_a_write_back_is_a_store_error_and_the_store_keeps_its_commit(tmp_path: Path) -> None:
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 1}, durable=False)
    block = random_block(np.random.default_rng(0), 50, 1)
    store.commit({"2-0": store.write_block("2-0", block, (0, 0, 0, 1, 1, 1))}, state={"step": 7})

    def full(key, arrays, cell):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    store.write_block = full  # type: ignore[method-assign]
    cache = BlockCache(store, 1 << 30)
    cache.get("2-0").tensors["means"] += 1
    cache.mark_dirty("2-0")
    with pytest.raises(StoreError, match=rf"^store {store.name}: no space left on device while writing block 2-0 "
                                         r"\(the last commit, step 7, is intact\)$"):
        cache.flush()
    with pytest.warns(UserWarning, match="unflushed changes"):
        cache.close()
    assert Store.open(tmp_path / "s.zarr").state == {"step": 7}


# ---------------------------------------------------------------- 5. one definition of the splat semantics


def test_the_splat_semantics_and_the_sh_limit_have_one_definition() -> None:
    from octree import bounds, cull, semantics
    from storage import store as store_module
    from tools.ply import compressed
    from tools.tile import config as tile_config
    from train.render import scenes
    from train.render import semantics as render_semantics

    assert (semantics.EPS2D, semantics.NEAR_PLANE, semantics.FAR_PLANE, semantics.RADIUS_SIGMAS) == (0.3, 0.01, 1e10, 3.33)
    assert (semantics.ALPHA_MIN, semantics.ALPHA_MAX, semantics.T_MIN) == (1.0 / 255.0, 0.999, 1e-4)
    assert semantics.SH_C0 == 0.5 / np.sqrt(np.pi) and semantics.MAX_SH_DEGREE == 3
    for module in (render_semantics, store_module, tile_config):
        assert module.MAX_SH_DEGREE is semantics.MAX_SH_DEGREE, module
    for name in ("EPS2D", "NEAR_PLANE", "FAR_PLANE", "RADIUS_SIGMAS", "ALPHA_MIN", "ALPHA_MAX", "T_MIN"):
        assert getattr(render_semantics, name) is getattr(semantics, name), name
    assert cull.RADIUS_SIGMAS is bounds.EXTENT_SIGMA is semantics.RADIUS_SIGMAS
    assert compressed.SH_C0 is scenes.SH_C0 is semantics.SH_C0
    defaults = cull.frustum_cull.__defaults__
    assert defaults == (semantics.NEAR_PLANE, semantics.FAR_PLANE, semantics.EPS2D)


def test_an_sh_degree_the_renderer_cannot_draw_is_refused_by_the_tiler_and_the_store(tmp_path: Path) -> None:
    from storage import StoreFormatError
    from tools.ply import write_ply
    from tools.scenes import random_splats

    np.savez(tmp_path / "p.npz", means3d=np.random.default_rng(0).random((100, 3)).astype(np.float32))
    proc = run_tool("tools.tile", tmp_path / "p.npz", "--out", tmp_path / "s.zarr", "--sh-degree", "4", timeout=60)
    assert_refused(proc, "--sh-degree must be in [0, 3], got 4")
    write_ply(tmp_path / "d4.ply", random_splats(50, 4, seed=0))  # gsplat exports degree 4; we cannot render it
    proc = run_tool("tools.tile", tmp_path / "d4.ply", "--out", tmp_path / "s.zarr", timeout=60)
    assert_refused(proc, "d4.ply: the trained Gaussians have SH degree 4; the renderer supports at most 3")
    assert_nothing_left(tmp_path / "s.zarr")
    with pytest.raises(StoreFormatError, match=r"sh_degree 4 is not an integer in \[0, 3\]"):
        Store.create(tmp_path / "s.zarr", {"sh_degree": 4}, durable=False)


def test_a_render_error_in_training_is_one_error_line(monkeypatch, tmp_path: Path, capsys) -> None:
    from train import __main__ as train_main
    from train.render import RenderError

    def fails(cfg):  # type: ignore[no-untyped-def]
        raise RenderError("sh_degree 4: must be in 0..3")

    monkeypatch.setattr(train_main, "run", fails)
    assert train_main.main(["--data", str(tmp_path), "--store", str(tmp_path / "s.zarr")]) == 1
    assert capsys.readouterr().err == "error: sh_degree 4: must be in 0..3\n"


# ---------------------------------------------------------------- kills at random moments


def _kill_at_random(argv: list[str], rng: np.random.Generator, kills: int) -> None:
    """One whole run, timed, then `kills` runs SIGKILLed at random moments of the second half of
    that time (the first is mostly the interpreter starting)."""
    start = time.perf_counter()
    assert run_tool(*argv, timeout=300).returncode == 0
    seconds = time.perf_counter() - start
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 1.0) * seconds)
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("tool", ["tile", "export"])
def test_runs_killed_at_random_moments_leave_the_output_whole_and_the_next_run_clears_up(tmp_path: Path,
                                                                                          tool: str) -> None:
    """SIGKILL at random moments: the output is never half written, and the next run into it
    removes (and names) whatever the killed runs left."""
    from tools.ply import open_ply

    rng = np.random.default_rng(19)
    n = 300_000
    np.savez(tmp_path / "p.npz", means3d=rng.random((n, 3)).astype(np.float32))
    store = tmp_path / "s.zarr"
    if tool == "tile":
        argv, out = ["tools.tile", str(tmp_path / "p.npz"), "--out", str(store), "--overwrite"], store
    else:
        assert run_tool("tools.tile", tmp_path / "p.npz", "--out", store, timeout=300).returncode == 0
        argv, out = ["tools.export", str(store), "--out", str(tmp_path / "scene.ply")], tmp_path / "scene.ply"
    _kill_at_random(argv, rng, kills=6)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"{out.name}."))
    # (at most one: each run clears what the one before it left)
    if os.path.lexists(out):  # the whole run's, or a killed run's that got that far: whole either way
        assert (Store.open(out, verify="data").head == 0) if tool == "tile" else open_ply(out).count == n
    proc = run_tool(*argv, timeout=300)
    assert proc.returncode == 0, proc.stderr
    named = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(named) == len(left) and all(any(name in line for line in named) for name in left), (left, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"p.npz", "s.zarr", out.name})
