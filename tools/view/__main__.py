"""python -m tools.view STORE [--data DATA] [--ranks R] [--host 127.0.0.1] [--port 8080] [--device cpu|cuda]
[--cache-mb MB] [--follow] [--lod PIXELS] [--occlusion on|off] | --render OUT_DIR --cameras SPEC [--width W --height H] [--outline] | --map OUT.png"""
from __future__ import annotations

import argparse
import sys

from train.pools import configure_pools

configure_pools()  # before numba and torch load

from tools.view.config import ViewConfig, ViewError  # noqa: E402
from train.cli import HelpFormatter  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.view",
        description="Browse a block store in the browser (only the blocks in view are paged in), "
                    "or render PNGs and a block map headless.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("store", help="store written by `python -m tools.tile` or `python -m train` (opened read-only)")
    p.add_argument("--data", default=None, help="dataset whose training and held-out cameras to show and render from (default: none: no cameras)")
    p.add_argument("--ranks", type=int, default=1, help="colour blocks by owner among R ranks (the trainer's partition)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0 exposes the scene to the network)")
    p.add_argument("--port", type=int, default=8080, help="port to serve on")
    p.add_argument("--device", default="cpu", help="cpu (numba renderer) or cuda (gsplat)")
    p.add_argument("--cache-mb", type=float, default=512.0, help="block cache budget for rendering, MiB")
    p.add_argument("--follow", action="store_true", help="re-read HEAD every few seconds and show the newest commit")
    p.add_argument("--lod", type=float, default=None, metavar="PIXELS",
                   help="level of detail: blocks seen at sub-pixel size are drawn merged per cube of about this many "
                        "pixels; 0 draws every Gaussian (default: 1 in the browser, 0 for --render)")
    p.add_argument("--occlusion", default="off",
                   help="on: blocks hidden behind nearer ones are never paged (train/occlusion.py; the same image, at "
                        "the cost of a rasterization a wave); off: every block in the frustum is drawn")
    headless = p.add_argument_group("headless (no server)")
    headless.add_argument("--render", metavar="OUT_DIR", default=None, help="write a PNG per camera of --cameras here (default: none: serve the browser viewer)")
    headless.add_argument("--cameras", default="all",
                          help="all | train | test | i,j,... (indices into training then held-out) | orbit:N")
    headless.add_argument("--width", type=int, default=None, help="image width (default: the camera's own; orbit 640; map 1024)")
    headless.add_argument("--height", type=int, default=None, help="image height (default: the camera's own; orbit 480)")
    headless.add_argument("--outline", action="store_true", help="draw the block boxes over the renders")
    headless.add_argument("--map", metavar="OUT.png", default=None, help="write a top-down map of the blocks coloured by owner (default: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    try:
        cfg = ViewConfig(**args)
        if cfg.headless:
            from tools.view.app import run_headless

            run_headless(cfg)
        else:
            from tools.view.app import serve

            serve(cfg)
    except ViewError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
