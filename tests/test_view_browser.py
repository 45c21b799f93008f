"""The browser viewer in real headless Chromium (Debian's package, driven by Playwright): the page
loads, the block boxes and the server-side render show in a screenshot's pixels, selecting a
block shows its statistics, the level of detail's slider reaches the renderer, and the store is
byte for byte unchanged afterwards."""
from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.test_view import free_port, running_viewer, tree_digest
from tools.view.config import ViewConfig

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                                         "(tools/install.sh installs it with apt-get)")
VIEWPORT = {"width": 800, "height": 600}


def canvas_pixels(png: bytes) -> np.ndarray:  # [H, W, 3] int, the 3D canvas left of viser's panel
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int64)
    # Left of the panel (x > 460 at this width), below the software-WebGL notice, above the axes gizmo.
    return image[160:540, 60:450]


def box_and_scene_pixels(shown: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [H, W] bool each
    spread = shown.max(axis=2) - shown.min(axis=2)
    boxes = spread > 60  # box edges are the only saturated pixels: the door is grey
    scene = (~boxes) & (shown.mean(axis=2) > 40) & (shown.mean(axis=2) < 200)  # grey splats on the render's black
    return boxes, scene


def settled(page, ok, seconds: float) -> np.ndarray:
    """The canvas once `ok(pixels)` holds (the browser composites frames at its own pace; a
    software-rendered WebGL under load takes seconds), or as it is when time runs out."""
    end = time.monotonic() + seconds
    while True:
        shown = canvas_pixels(page.screenshot())
        if ok(shown) or time.monotonic() > end:
            return shown
        time.sleep(0.5)


def wait_for(condition, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.1)


def test_browser_shows_blocks_render_and_block_stats(lund_store: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    from tools.view.gui import browser_camera

    before = tree_digest(lund_store)
    with running_viewer(ViewConfig(store=str(lund_store), ranks=2, port=free_port())) as viewer:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page(viewport=VIEWPORT)
                page.goto(viewer.url)
                page.get_by_text("OctoSplat").first.wait_for(timeout=60_000)
                # The refined frame is the browser's canvas size (the low-resolution ones are smaller).
                wait_for(lambda: viewer.last_frame.width == VIEWPORT["width"], 90, "a full-resolution frame")
                page.get_by_text("ms:").wait_for(timeout=30_000)
                shown = settled(page, lambda px: all(m.mean() > 0.02 for m in box_and_scene_pixels(px)), 60)
                boxes, scene = box_and_scene_pixels(shown)
                assert boxes.mean() > 0.01, f"only {boxes.mean():.4f} of the canvas is box edges"
                blue = boxes & (shown[..., 2] > shown[..., 0] + 40)  # rank 0's palette colour
                orange = boxes & (shown[..., 0] > shown[..., 2] + 60)  # rank 1's
                assert blue.sum() > 200 and orange.sum() > 200, (blue.sum(), orange.sum())
                assert scene.mean() > 0.02, f"only {scene.mean():.4f} of the canvas shows the rendered door"

                # Without the server-side render the canvas is the viewer's own background.
                page.get_by_label("render the scene").uncheck()

                def gone(px: np.ndarray) -> bool:
                    return (np.abs(px - shown).max(axis=2) > 30)[scene].mean() > 0.5

                assert gone(settled(page, gone, 30)), "the rendered door stayed with the render off"

                # Selecting a block in the dropdown shows its statistics.
                key = viewer.scene.rows[-1].key
                row = viewer.scene.row(key)
                page.get_by_role("combobox").last.click()
                page.get_by_role("option", name=key, exact=True).click()
                page.get_by_text(f"block {key}").first.wait_for(timeout=20_000)
                body = page.inner_text("body")
                assert f"Gaussians: {row.info.count:,}" in body
                assert f"bytes on disk: {row.disk_bytes:,}" in body
                assert f"owner: rank {row.owner} of 2" in body

                # Clicking inside the boxes selects the block the click's ray enters first.
                page.mouse.click(330, 420)
                wait_for(lambda: viewer.block.value != key, 20, "a block selected by a click")
                clicked = viewer.block.value
                page.get_by_text(f"block {clicked} (depth").first.wait_for(timeout=20_000)

                # The visible blocks' Gaussians go to the browser as splat nodes, and leave again.
                (client,) = viewer._clients.values()
                page.get_by_label("splats in the browser").check()
                wait_for(lambda: len(client.splats) > 0, 30, "splat nodes sent to the browser")
                assert set(client.splats) <= set(viewer.renderer.visible(browser_camera(client.handle.camera, 64)))
                time.sleep(1.0)
                assert "render failed" not in page.inner_text("body")
                page.get_by_label("splats in the browser").uncheck()
                wait_for(lambda: not client.splats, 10, "splat nodes removed")

                # The level of detail's slider (1 px by default in the browser) reaches the renderer,
                # and the panel names the merged blocks of the next frames.
                assert "merge below (px)" in page.inner_text("body") and viewer.renderer.lod_pixels == 1.0
                page.get_by_label("render the scene").check()
                viewer.detail.value = 8.0  # as the browser's slider sets it: on_update runs
                assert viewer.renderer.lod_pixels == 8.0
                wait_for(lambda: viewer.last_frame.lod.blocks > 0 and viewer.last_frame.width == VIEWPORT["width"], 60,
                         "a full-resolution frame with merged blocks")
                page.get_by_text("merged:").first.wait_for(timeout=20_000)
            finally:
                browser.close()
    assert tree_digest(lund_store) == before
