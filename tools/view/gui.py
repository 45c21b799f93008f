"""The browser viewer: viser serves the page; block boxes, dataset cameras and a panel are
scene and GUI nodes; each connected browser gets a thread that renders its camera server-side
(low resolution while it moves, full once it stops) and sends the frame as the background."""
from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import viser
import viser.transforms as vtf

from storage import Store, StoreError
from train.camera import Camera
from tools.view.cameras import DatasetCameras, pinhole
from tools.view.colour import block_colours, legend
from tools.view.config import COLOUR_MODES, ViewConfig, ViewError
from tools.view.draw import BOX_FACES, box_corners, box_segments
from tools.view.headless import to_uint8
from tools.view.render import FrameCancelled, FrameStats, FrustumRenderer
from tools.view.scene import load_blocks
from tools.view.splats import CLIENT_BUDGET, nearest_within, splat_node_arrays

MOVING_PIXELS = 256  # longest side of the frames rendered while the camera moves
STILL_PIXELS = 1280  # longest side once it has stopped (the canvas, if smaller)
SETTLE_S = 0.25  # a camera unchanged this long has stopped


def check_port_free(host: str, port: int) -> None:
    """viser quietly moves to the next free port; the user asked for this one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ViewError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                            f"is another viewer running? pick another --port") from e


def browser_camera(camera: viser.CameraHandle, longest: int) -> Camera:
    """The browser's view as a pinhole camera whose longest side is at most `longest` pixels."""
    w, h = camera.image_width, camera.image_height
    s = min(1.0, longest / max(w, h))
    c2w = np.eye(4)
    c2w[:3, :3] = vtf.SO3(np.asarray(camera.wxyz)).as_matrix()
    c2w[:3, 3] = camera.position
    return pinhole(c2w, camera.fov, max(1, round(w * s)), max(1, round(h * s)), name="browser")


def pick(cells: np.ndarray, origin: np.ndarray, direction: np.ndarray) -> int | None:  # cells [B, 6]
    """The block whose cell a ray enters first (slab test), or None."""
    d = np.where(np.abs(direction) < 1e-12, 1e-12, direction)
    t0, t1 = (cells[:, :3] - origin) / d, (cells[:, 3:] - origin) / d
    near, far = np.minimum(t0, t1).max(1), np.maximum(t0, t1).min(1)
    hit = (far >= np.maximum(near, 0.0))
    if not hit.any():
        return None
    entry = np.where(hit, np.maximum(near, 0.0), np.inf)
    return int(np.argmin(entry))


@dataclass
class _Client:
    """A browser's render state: when its camera last moved, and whether that view is refined."""

    handle: viser.ClientHandle
    moved_at: float = 0.0
    rendered: tuple[float, int] = (-1.0, -1)  # (moved_at, Viewer.changes) of the last frame sent
    refined: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    splats: dict[str, viser.GaussianSplatHandle] = field(default_factory=dict)  # block key -> its node
    splat_head: int | None = None  # the commit the nodes were read from


class Viewer:
    """One store shown to any number of browsers."""

    def __init__(self, cfg: ViewConfig, store: Store, data: DatasetCameras | None) -> None:
        self.cfg, self.store, self.data = cfg, store, data
        check_port_free(cfg.host, cfg.port)
        self.scene = load_blocks(store, cfg.store, cfg.ranks, data.train if data else [])
        self.renderer = FrustumRenderer(store, cfg.cache_bytes, cfg.device, lod_pixels=cfg.lod_pixels,
                               occlusion=cfg.occlusion == "on")
        self.lock = threading.Lock()  # one render or refresh at a time: they share the store view and cache
        self.changes = 0  # bumped by every change of what frames show (`_changed`)
        self.last_frame = FrameStats()
        self.server = viser.ViserServer(host=cfg.host, port=cfg.port, label="OctoSplat", verbose=False)
        if cfg.port and self.server.get_port() != cfg.port:
            self.server.stop()
            raise ViewError(f"--port {cfg.port} was taken while the viewer started; pick another --port")
        self._clients: dict[int, _Client] = {}
        self._build_panel()
        self._draw_blocks()
        self._draw_cameras()
        self._place_initial_camera()
        self.server.on_client_connect(self._connect)
        self.server.on_client_disconnect(self._disconnect)
        print(f"serving {self.url} ({len(self.scene.rows)} blocks, {self.scene.gaussians:,} Gaussians, "
              f"commit {self.scene.head}); Ctrl-C stops", flush=True)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.server.get_port()}"

    # ------------------------------------------------------------------ panel

    def _build_panel(self) -> None:
        gui = self.server.gui
        self.commit_md = gui.add_markdown(self._commit_text())
        self.colour = gui.add_dropdown("colour by", COLOUR_MODES, initial_value=self.cfg.colour)
        self.legend_md = gui.add_markdown("")
        self.show_render = gui.add_checkbox("render the scene", True)
        self.show_splats = gui.add_checkbox("splats in the browser", False,
                                            hint=f"the visible blocks nearest the camera, up to {CLIENT_BUDGET:,} Gaussians")
        self.detail = gui.add_slider("merge below (px)", min=0.0, max=max(8.0, self.cfg.lod_pixels), step=0.5,
                                     initial_value=self.cfg.lod_pixels,
                                     hint="level of detail: blocks seen at sub-pixel size are drawn merged per cube of "
                                          "about this many pixels; 0 draws every Gaussian",
                                     disabled=self.cfg.lod_pixels == 0)
        self.frame_md = gui.add_markdown("frame: waiting for a browser")
        self.block = gui.add_dropdown("block", [r.key for r in self.scene.rows], initial_value=self.scene.rows[0].key)
        self.block_md = gui.add_markdown(self.scene.describe(self.scene.rows[0].key))
        self.colour.on_update(lambda _: self._draw_blocks())
        self.block.on_update(lambda _: self._select(self.block.value))
        self.show_render.on_update(lambda _: self._toggle_render())
        self.show_splats.on_update(lambda _: self._toggle_splats())
        self.detail.on_update(lambda _: self._set_detail())

    def _commit_text(self) -> str:
        s = self.scene
        follow = f" · following HEAD (checked {time.strftime('%H:%M:%S')})" if self.cfg.follow else ""
        return (f"**{s.store_path.name}** commit {s.head}, step {s.step}: {len(s.rows)} blocks, "
                f"{s.gaussians:,} Gaussians, {s.ranks} rank(s){follow}")

    def _changed(self) -> None:
        """Something every frame shows changed: each browser gets a new frame. A counter, not a
        reset of each browser's state, so a frame in flight meanwhile cannot count as the new one."""
        self.changes += 1

    def _toggle_splats(self) -> None:
        for c in list(self._clients.values()):
            if not self.show_splats.value:
                self._drop_splats(c, list(c.splats))
        self._changed()

    def _set_detail(self) -> None:
        with self.lock:
            self.renderer.lod_pixels = float(self.detail.value)
        self._changed()

    def _toggle_render(self) -> None:
        for c in list(self._clients.values()):
            if not self.show_render.value:
                c.handle.scene.set_background_image(None)
        self._changed()

    # ------------------------------------------------------------------ scene nodes

    def _draw_blocks(self) -> None:
        mode = self.colour.value
        colours = block_colours(self.scene, mode)  # [B, 3]
        segs = box_segments(self.scene.cells).reshape(-1, 2, 3)  # [B * 12, 2, 3]
        per_point = np.repeat(colours, 24, axis=0).reshape(-1, 2, 3)
        self.server.scene.add_line_segments("/blocks", segs, per_point, thickness=2.0, thickness_units="screen")
        # Lines cannot be clicked in viser; faces can, even fully transparent ones (faint ones greyed
        # the render behind them), and the click's ray names the block.
        corners = box_corners(self.scene.cells).reshape(-1, 3)  # [B * 8, 3]
        faces = (BOX_FACES[None] + 8 * np.arange(len(self.scene.rows))[:, None, None]).reshape(-1, 3)
        target = self.server.scene.add_mesh_simple("/blocks_pick", corners, faces, color=(200, 200, 200),
                                                   opacity=0.0, side="double", cast_shadow=False,
                                                   receive_shadow=False)
        target.on_click(self._clicked_block)
        self.legend_md.content = "\n".join(f"- <span style='color:rgb{c}'>■</span> {t}" for c, t in legend(self.scene, mode))
        if self.block.value in self.scene.table:
            self._select(self.block.value)

    def _clicked_block(self, event: viser.SceneNodePointerEvent) -> None:
        b = pick(self.scene.cells, np.asarray(event.ray_origin), np.asarray(event.ray_direction))
        if b is not None:
            self.block.value = self.scene.rows[b].key  # its on_update shows it

    def _select(self, key: str) -> None:
        if key not in self.scene.table:
            return
        info = self.scene.table[key]
        self.block_md.content = self.scene.describe(key)
        boxes = np.array([info.cell, info.extent], dtype=np.float64)
        colours = np.repeat(np.array([[255, 255, 255], [255, 215, 0]], dtype=np.uint8), 24, axis=0).reshape(-1, 2, 3)
        self.server.scene.add_line_segments("/selected", box_segments(boxes).reshape(-1, 2, 3), colours,
                                            thickness=4.0, thickness_units="screen")

    def _draw_cameras(self) -> None:
        if self.data is None:
            return
        size = float(np.linalg.norm(self.scene.bounds()[3:] - self.scene.bounds()[:3])) * 0.03
        for kind, cams, colour in (("train", self.data.train, (40, 120, 255)), ("test", self.data.test, (255, 60, 60))):
            for i, cam in enumerate(cams):
                c2w = cam.camtoworld
                frustum = self.server.scene.add_camera_frustum(
                    f"/cameras/{kind}/{i:04d}", fov=2 * math.atan(0.5 * cam.height / cam.K[1, 1]),
                    aspect=cam.width / cam.height, scale=size, color=colour, thickness=1.5, thickness_units="screen",
                    wxyz=vtf.SO3.from_matrix(c2w[:3, :3]).wxyz, position=c2w[:3, 3])
                frustum.on_click(self._jump_to(cam))

    def _jump_to(self, cam: Camera):
        def jump(event: viser.SceneNodePointerEvent) -> None:
            c2w = cam.camtoworld
            with event.client.atomic():
                event.client.camera.wxyz = vtf.SO3.from_matrix(c2w[:3, :3]).wxyz
                event.client.camera.position = c2w[:3, 3]
        return jump

    def _place_initial_camera(self) -> None:
        initial = self.server.initial_camera
        if self.data is not None:
            c2w = self.data.train[0].camtoworld
            initial.position = c2w[:3, 3]
            initial.look_at = c2w[:3, 3] + c2w[:3, 2] * float(np.linalg.norm(self.scene.bounds()[3:] - self.scene.bounds()[:3])) * 0.5
            initial.up = -c2w[:3, 1]
            return
        lo, hi = self.scene.bounds()[:3], self.scene.bounds()[3:]
        centre, radius = (lo + hi) / 2, float(np.linalg.norm(hi - lo)) / 2 or 1.0
        initial.up = (0.0, 0.0, 1.0)
        initial.look_at = centre
        initial.position = centre + radius * 1.6 * np.array([0.6, -0.6, 0.5])

    # ------------------------------------------------------------------ clients

    def _connect(self, handle: viser.ClientHandle) -> None:
        client = _Client(handle)
        self._clients[handle.client_id] = client

        @handle.camera.on_update
        def _(_: viser.CameraHandle) -> None:
            client.moved_at = time.monotonic()
            client.refined = False

        threading.Thread(target=self._render_loop, args=(client,), daemon=True,
                         name=f"view-client-{handle.client_id}").start()

    def _disconnect(self, handle: viser.ClientHandle) -> None:
        client = self._clients.pop(handle.client_id, None)
        if client is not None:
            client.stop.set()

    def _render_loop(self, client: _Client) -> None:
        """Serve one browser: a low-resolution frame for each camera move, a full one (and the
        splat nodes) once the camera has stopped."""
        while not client.stop.wait(0.02):
            moved_at = client.moved_at
            if moved_at == 0.0:  # no camera from the browser yet
                continue
            moving = time.monotonic() - moved_at < SETTLE_S
            wanted = (moved_at, self.changes)
            if client.rendered == wanted and (moving or client.refined):
                continue
            try:
                if self.show_render.value:
                    self._render_for(client, MOVING_PIXELS if moving else STILL_PIXELS, moved_at)
                if not moving and self.show_splats.value:
                    self._send_splats(client)
            except FrameCancelled:
                continue  # the camera moved while the frame rendered: start on the new view
            except Exception as e:  # a server thread must report, not die: the panel says what failed
                self.frame_md.content = f"**render failed:** {type(e).__name__}: {e}"
                client.stop.wait(1.0)
            client.rendered = wanted
            client.refined = not moving

    def _send_splats(self, client: _Client) -> None:
        """Bring the client's splat nodes to the visible blocks nearest its camera: new blocks are
        sent, blocks that left the view or the budget are removed."""
        with self.lock:
            camera = browser_camera(client.handle.camera, STILL_PIXELS)
            if client.splat_head != self.store.head:
                self._drop_splats(client, list(client.splats))
                client.splat_head = self.store.head
            keep = nearest_within(self.renderer.visible(camera), self.store.table, camera.center)
            self._drop_splats(client, [k for k in client.splats if k not in keep])
            arrays = {}
            for k in (k for k in keep if k not in client.splats and k not in self.renderer.bad):
                arrays[k] = splat_node_arrays(self.renderer.cache.get(k).tensors)
        for k, a in arrays.items():
            client.splats[k] = client.handle.scene.add_gaussian_splats(f"/splats/{k}", **a)

    @staticmethod
    def _drop_splats(client: _Client, keys: list[str]) -> None:
        for k in keys:
            client.splats.pop(k).remove()

    def _render_for(self, client: _Client, longest: int, moved_at: float) -> None:
        with self.lock:
            camera = browser_camera(client.handle.camera, longest)
            # As nerfstudio's viewer does: a frame the camera has moved on from is given up, not finished.
            rgb, stats = self.renderer.render(
                camera, cancelled=lambda: client.moved_at != moved_at or client.stop.is_set())
        client.handle.scene.set_background_image(to_uint8(rgb), format="jpeg", jpeg_quality=90)
        self.last_frame = stats
        skipped = "".join(f"\n- skipped {k}: {self.renderer.bad[k]}" for k in stats.skipped)
        self.frame_md.content = f"**frame** {stats.summary()}{skipped}"

    # ------------------------------------------------------------------ follow

    def refresh(self) -> bool:
        """Re-read HEAD; True if a newer commit is now shown."""
        with self.lock:
            try:
                self.store.refresh()  # the renderer may have refreshed already, for a frame
            except StoreError as e:  # e.g. a damaged commit document: keep showing the last good one
                self.commit_md.content = f"{self._commit_text()}\n\n**cannot read HEAD:** {e}"
                return False
            changed = self.store.head != self.scene.head
            if changed:
                self.scene = load_blocks(self.store, self.cfg.store, self.cfg.ranks, self.data.train if self.data else [])
        if changed:
            keys = [r.key for r in self.scene.rows]
            self.block.options = keys
            if self.block.value not in keys:
                self.block.value = keys[0]
            self._draw_blocks()
            self._changed()
        self.commit_md.content = self._commit_text()
        return changed

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.cfg.follow_seconds if self.cfg.follow else 0.5):
            if self.cfg.follow:
                self.refresh()

    def close(self) -> None:
        for c in list(self._clients.values()):
            c.stop.set()
        self.server.stop()
        self.renderer.close()
