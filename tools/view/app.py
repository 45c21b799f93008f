"""The two ways to run the viewer: headless (render and map, then exit) and the browser server."""
from __future__ import annotations

import signal
import sys
import threading

from tools.view.cameras import DatasetCameras, dataset_cameras
from tools.view.config import ViewConfig
from tools.view.headless import peak_rss_mib, render_cameras, write_map
from tools.view.scene import load_blocks, open_store


def run_headless(cfg: ViewConfig) -> None:
    store = open_store(cfg.store)
    try:
        data = dataset_cameras(cfg.data, cfg.store, store) if cfg.data else None
        scene = load_blocks(store, cfg.store, cfg.ranks, data.train if data else [])
        if cfg.map:
            write_map(cfg, scene)
        if cfg.render:
            render_cameras(cfg, store, scene, data)
    finally:
        store.close()
    print(f"peak RSS: {peak_rss_mib():.0f} MiB", flush=True)


def serve(cfg: ViewConfig) -> None:
    """Serve until Ctrl-C or SIGTERM."""
    from tools.view.gui import Viewer  # viser starts its own threads: only the server imports it

    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: --host {cfg.host}: the scene is now reachable from the network, by anyone who can "
              f"reach port {cfg.port} of this machine", file=sys.stderr, flush=True)
    store = open_store(cfg.store)
    stop = threading.Event()
    # Both signals end the viewer cleanly (one started in the background inherits an ignored
    # SIGINT), from before its banner: a Ctrl-C just after "serving" used to raise outside the
    # viewer's close, and viser's threads then kept the process alive.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    viewer = None
    try:
        data: DatasetCameras | None = dataset_cameras(cfg.data, cfg.store, store) if cfg.data else None
        viewer = Viewer(cfg, store, data)
        viewer.run(stop)
    finally:
        if viewer is not None:
            viewer.close()
        store.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
