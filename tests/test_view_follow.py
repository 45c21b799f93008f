"""Live stores: --follow shows each new commit, and a frame rendered while another process keeps
committing (and collecting old versions) comes from one commit, never a mix of two."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from storage import Store
from tests.conftest import REPO
from tests.test_view import free_port, running_viewer
from tools.view.cameras import orbit
from tools.view.config import ViewConfig
from tools.view.render import FrustumRenderer

# Rewrites every block of STORE each generation, all red on even generations and all green on odd
# ones, and commits with keep_commits=1, so the versions of the last commit vanish at once.
WRITER = """
import sys
import numpy as np
from octree.semantics import SH_C0
from storage import Store
store = Store.open(sys.argv[1], keep_commits=1)
print("ready", flush=True)
while True:
    g = store.next_version
    rgb = np.array([1.0, 0.0, 0.0] if g % 2 == 0 else [0.0, 1.0, 0.0], np.float32)
    updated = {}
    for key, info in store.table.items():
        arrays = store.read_block(key)
        arrays["sh0"][:] = (rgb - 0.5) / SH_C0
        arrays["shN"][:] = 0.0
        arrays["opacities"][:] = 4.0
        updated[key] = store.write_block(key, arrays, info.cell)
    store.commit(updated, state={"step": g})
"""


def commit_step(path: Path, step: int) -> str:
    """Commit a copy of one block as a new version, with training step `step`; returns its key."""
    with Store.open(path, mode="r+") as store:
        key = sorted(store.table)[0]
        info = store.table[key]
        store.commit({key: store.write_block(key, store.read_block(key), info.cell)}, state={"step": step})
    return key


def test_follow_shows_the_newest_commit(lund_store: Path, tmp_path: Path) -> None:
    path = tmp_path / "store"
    shutil.copytree(lund_store, path)
    with running_viewer(ViewConfig(store=str(path), port=free_port(), follow=True, follow_seconds=0.2)) as viewer:
        assert viewer.scene.head == 0
        key = commit_step(path, 7)
        deadline = time.monotonic() + 20
        # The panel's commit line is the last thing a refresh updates.
        while "commit 1, step 7" not in viewer.commit_md.content and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "commit 1, step 7" in viewer.commit_md.content
        assert viewer.scene.head == 1 and viewer.scene.step == 7
        row = viewer.scene.row(key)
        assert row.info.version == 1 and row.step == 7
        viewer.block.value = key
        assert "version: 1 (written at step 7)" in viewer.block_md.content
        # Frames come from the new commit too.
        cam = orbit(viewer.scene.bounds(), 1, 32, 24)[0]
        with viewer.lock:
            viewer.renderer.render(cam)
        assert viewer.renderer.cache.store.head == 1 and viewer.renderer._head == 1


def test_frames_come_from_one_commit_while_another_process_commits(lund_store: Path, tmp_path: Path) -> None:
    path = tmp_path / "store"
    shutil.copytree(lund_store, path)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        with Store.open(path, mode="r", verify="table") as store:
            cam = orbit(_bounds(store), 1, 96, 72)[0]
            # A cache of a fifth of the parameters re-reads blocks every frame, so frames overlap commits.
            renderer = FrustumRenderer(store, 512 << 10)
            heads, colours, restarts = set(), [], 0
            try:
                deadline = time.monotonic() + 25
                while time.monotonic() < deadline and len(heads) < 4:
                    rgb, stats = renderer.render(cam)
                    lit = rgb.numpy()[rgb.numpy().max(axis=2) > 0.2]
                    if store.head == 0 or len(lit) < 50:
                        continue  # the tiled commit, before the writer's first
                    red, green = (lit[:, 0] > lit[:, 1]).mean(), (lit[:, 1] > lit[:, 0]).mean()
                    assert min(red, green) == 0.0, f"commit {store.head}: a frame mixing two commits ({red}, {green})"
                    heads.add(store.head)
                    restarts += stats.restarts
                    colours.append("red" if red else "green")
            finally:
                renderer.close()
        assert len(heads) >= 2 and {"red", "green"} <= set(colours), (heads, colours)
        print(f"{len(colours)} frames of {len(heads)} commits, {restarts} restarted")
    finally:
        writer.kill()
        writer.wait()


def _bounds(store: Store) -> np.ndarray:  # [6]
    cells = np.array([i.cell for i in store.table.values()])
    return np.concatenate([cells[:, :3].min(0), cells[:, 3:].max(0)])


def test_frames_of_a_store_being_trained_each_equal_one_commit(lund_store: Path, shared_data: Path,
                                                               tmp_path: Path) -> None:
    from storage.table import Commit
    from tests.test_view import lund_cameras, reference_splats
    from train.render import render

    path = tmp_path / "store"
    shutil.copytree(lund_store, path)
    cam = lund_cameras(shared_data, path)[1].scaled(8)
    trainer = subprocess.Popen([sys.executable, "-m", "train", "--data", str(shared_data / "lund_door"), "--store",
                                str(path), "--out", str(tmp_path / "run"), "--steps", "8", "--commit-every", "1",
                                "--data-factor", "8", "--keep-commits", "100", "--no-progress"], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    frames: list[tuple[int, np.ndarray]] = []
    try:
        with Store.open(path, mode="r", verify="table") as store:
            renderer = FrustumRenderer(store, 512 << 10)
            try:
                while trainer.poll() is None or not frames:
                    store.refresh()  # what --follow does
                    rgb, _ = renderer.render(cam)
                    frames.append((renderer._head, (rgb.numpy() * 255.0 + 0.5).astype(np.uint8)))
            finally:
                renderer.close()
    finally:
        _, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, err
    heads = sorted({h for h, _ in frames})
    assert len(heads) >= 3, heads  # frames of several commits while it trained
    with Store.open(path, mode="r") as store:
        for head in heads:
            doc = json.loads((path / "commits" / str(head) / "zarr.json").read_text())
            table = Commit.from_doc(doc, head, store.name).table
            rgb, _, _ = render(reference_splats(store, table), cam, store.sh_degree, None, "cpu")
            expected = (rgb.clamp(0, 1).numpy() * 255.0 + 0.5).astype(np.uint8)
            for image in (image for h, image in frames if h == head):
                np.testing.assert_array_equal(image, expected, err_msg=f"a frame that is not commit {head}")
