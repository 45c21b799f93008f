"""Renderer benchmark: `python -m tools.bench render [--repeats N] [--data DIR] [--skip ...]`.

1. reference: the cpu backend and the dense torch reference side by side, ms per image for forward
   and forward+backward, on a garden crop the reference can hold in memory.
2. garden: the cpu backend alone on the full garden (648x420, all points in [-2, 2]^3, SH degree 3),
   averaged over its 3 cameras, with the stages split out and the peak memory of one
   forward+backward (max RSS growth, measured in a fresh process).
3. train: ms per training iteration (render, 0.8 L1 + 0.2 (1 - SSIM) against the real photo,
   backward, Adam) on lund_door photos cropped to 270x480 with 10k and 50k Gaussians spread
   through the scene's volume: the workload on which OpenSplat's CPU trainer takes 1.35 s and
   2.18 s here. An iteration's time is the mean over one pass of all 12 photos (views differ in
   cost by 30%), best of the passes.
"""
from __future__ import annotations

import os

from train.pools import configure_pools

# numba's and torch's OpenMP runtimes are separate thread pools, and by default each one's idle
# threads spin for milliseconds, taking the two cores from the other one (iterations here ran
# 2-3x slower); `train.pools` has them spin briefly. Set before either library loads.
configure_pools()

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from scipy.spatial import cKDTree  # noqa: E402

from tools.bench import data_dir  # noqa: E402
from tools.bench.timing import format_ms, timed  # noqa: E402
from train.camera import Camera  # noqa: E402
from train.cli import HelpFormatter  # noqa: E402
from train.losses import photometric_loss  # noqa: E402
from train.render import project, rasterize, render  # noqa: E402
from train.render.reference import rasterize_dense  # noqa: E402
from train.render.scenes import SH_C0, load_garden  # noqa: E402
from train.render.semantics import num_sh_bases  # noqa: E402

OPENSPLAT_SECONDS = {10_000: 1.35, 50_000: 2.18}  # per iteration at 270x480 on this machine (issue text)
SECTIONS = ("reference", "garden", "train")


def leaves(splats: dict) -> dict:
    return {k: v.detach().clone().requires_grad_(True) for k, v in splats.items()}


def forward_backward(splats: dict, cam: Camera) -> None:
    rgb, alpha, _ = render(leaves(splats), cam, 3)
    (rgb.sum() + alpha.sum()).backward()


def bench_reference(data: Path, repeats: int) -> None:
    splats, cameras = load_garden(data / "test_garden.npz")
    cam = cameras[0].scaled(5.0)
    with torch.no_grad():
        projected = project(splats, cam, 3)
    rows = torch.randperm(len(projected), generator=torch.Generator().manual_seed(0))[:1500]
    s2d = projected.select(rows)
    bg = torch.zeros(3)

    def run(dense: bool, backward: bool) -> float:
        def once():
            s = s2d.select(torch.arange(len(s2d)))
            for t in s.differentiable():
                t.requires_grad_(True)
            out = rasterize_dense(s, cam.width, cam.height, bg) if dense else rasterize(s, cam, bg)
            if backward:
                (out.rgb.sum() + out.alpha.sum()).backward()
        return timed(once, repeats)

    print(f"\n[reference] rasterize {len(s2d)} garden splats at {cam.width}x{cam.height} "
          f"({cam.width * cam.height * len(s2d) / 1e6:.0f}M pixel-splat pairs for the dense reference)")
    print(f"ms per image: best of {repeats} (median) cpu-time of the best")
    print(f"{'':>18} {'cpu backend':>16} {'dense torch':>20} {'ratio':>8}")
    for label, backward in (("forward", False), ("forward+backward", True)):
        a, b = run(False, backward), run(True, backward)
        print(f"{label:>18} {a:>16} {b:>20} {b / a:>7.0f}x")


def bench_garden(data: Path, repeats: int) -> None:
    splats, cameras = load_garden(data / "test_garden.npz")
    print(f"\n[garden] cpu backend, {len(splats['means'])} Gaussians, {cameras[0].width}x{cameras[0].height}, "
          f"SH 3, mean over {len(cameras)} cameras")
    stages: dict[str, list[float]] = {}
    for cam in cameras:
        projected = project(leaves(splats), cam, 3)
        out = rasterize(projected, cam)
        results = {
            "project": timed(lambda: project(splats, cam, 3), repeats),
            "project+rasterize (forward)": timed(lambda: render(splats, cam, 3), repeats),
            "forward+backward": timed(lambda: forward_backward(splats, cam), repeats),
        }
        stats = {"projected": len(projected), "contributed": int(out.contributed.sum())}
        for key, value in {**results, **stats}.items():
            stages.setdefault(key, []).append(value)
    print(f"ms: best of {repeats} (median) cpu-time of the best, mean over the cameras:")
    for key, values in stages.items():
        if key in results:
            print(f"{key:>30}: {format_ms(np.mean(values)):>5} ({format_ms(np.mean([v.median for v in values]))}) "
                  f"{format_ms(np.mean([v.cpu for v in values]))}")
        else:
            print(f"{key:>30}: {np.mean(values):>5.0f}")
    probe = subprocess.run([sys.executable, "-m", "tools.bench", "render", "--memory-probe", "--data", str(data)],
                           capture_output=True, text=True, check=True)
    print(f"{'peak memory, forward+backward':>30}: {float(probe.stdout.split()[-1]):>9.0f}MB "
          f"(peak RSS growth of a warmed-up process)")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_probe(data: Path) -> None:
    """Print the peak RSS growth (MB) of one full-size garden forward+backward (Linux only)."""
    splats, cameras = load_garden(data / "test_garden.npz")
    forward_backward(splats, cameras[0].scaled(8.0))  # load the kernels first
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _status_mb("VmRSS")
    forward_backward(splats, cameras[0])
    print(_status_mb("VmHWM") - before)


def lund_door_views(data: Path, height: int, width: int | None = None) -> tuple[list[tuple[Camera, torch.Tensor]], np.ndarray]:
    """Cameras (distortion ignored) and photos of lund_door scaled to `height` pixels (then cropped
    about the centre to `width` columns if given); the SfM points."""
    from train.data.colmap import focal_lengths, read_colmap

    model = read_colmap(data / "lund_door")
    views = []
    for image in sorted(model.images.values(), key=lambda im: im.name):
        colmap_cam = model.cameras[image.camera_id]
        f = focal_lengths(colmap_cam)
        fx, fy = f[0], f[-1]
        cx, cy = colmap_cam.params[len(f)], colmap_cam.params[len(f) + 1]
        K = np.array([[fx, 0, cx], [0, fy, cy], [0, 0, 1.0]])
        cam = Camera(image.viewmat, K, colmap_cam.width, colmap_cam.height, name=image.name)
        cam = cam.scaled(colmap_cam.height / height)
        photo = Image.open(data / "lund_door" / "images" / image.name).convert("RGB")
        photo = photo.resize((cam.width, cam.height), Image.BILINEAR)
        if width is not None and width < cam.width:
            left = (cam.width - width) // 2
            K = cam.K.copy()
            K[0, 2] -= left
            cam = replace(cam, K=K, width=width)
            photo = photo.crop((left, 0, left + width, cam.height))
        views.append((cam, torch.from_numpy(np.asarray(photo, dtype=np.float32) / 255.0)))
    return views, model.points.xyz


def volume_splats(points: np.ndarray, n: int, seed: int = 0) -> dict:
    """n Gaussians uniform in the box of the middle 96% of the SfM points, sized by their 3 nearest
    neighbours (as 3DGS initialises), opacity 0.1, random colours, SH degree 3."""
    rng = np.random.default_rng(seed)
    lo, hi = np.percentile(points, 2, axis=0), np.percentile(points, 98, axis=0)
    means = rng.uniform(lo, hi, size=(n, 3)).astype(np.float32)
    dists, _ = cKDTree(means).query(means, k=4)
    scale = np.log(np.maximum(dists[:, 1:].mean(1), 1e-7)).astype(np.float32)
    return {
        "means": torch.from_numpy(means),
        "scales": torch.from_numpy(np.repeat(scale[:, None], 3, 1)),
        "quats": torch.tensor([[1.0, 0.0, 0.0, 0.0]]).repeat(n, 1),
        "opacities": torch.full((n,), float(np.log(0.1 / 0.9))),
        "sh0": torch.from_numpy(((rng.random((n, 1, 3)) - 0.5) / SH_C0).astype(np.float32)),
        "shN": torch.zeros(n, num_sh_bases(3) - 1, 3),
    }


def bench_train(data: Path, repeats: int) -> None:
    views, points = lund_door_views(data, 480, 270)
    w, h, passes = views[0][0].width, views[0][0].height, max(repeats, 3)
    print(f"\n[train] lund_door cropped to {w}x{h} (OpenSplat's run: 270x480), one iteration = render, "
          f"0.8 L1 + 0.2 (1 - SSIM), backward, Adam (torch, fused)")
    print(f"ms per iteration, mean over the {len(views)} photos, best of {passes} passes (median pass) "
          f"cpu-time; speed-up from the best:")
    print(f"{'Gaussians':>10} {'ours':>16} {'OpenSplat':>10} {'speed-up':>9} {'| render fwd+bwd':>18} "
          f"{'loss fwd+bwd':>16} {'Adam':>14}")
    for n, opensplat in OPENSPLAT_SECONDS.items():
        params = {k: v.requires_grad_(True) for k, v in volume_splats(points, n).items()}
        optimizer = torch.optim.Adam(params.values(), lr=1e-3, fused=True)
        step = iter(range(10 ** 9))

        def iteration(parts: str = "all"):
            cam, photo = views[next(step) % len(views)]
            optimizer.zero_grad(set_to_none=True)
            rgb, _, _ = render(params, cam, 3)
            if parts == "render":
                rgb.sum().backward()
                return
            photometric_loss(rgb, photo).backward()
            optimizer.step()

        rgb = torch.rand(h, w, 3, requires_grad=True)
        ms = timed(iteration, passes, calls=len(views))
        render_ms = timed(lambda: iteration("render"), passes, calls=len(views))
        loss_ms = timed(lambda: photometric_loss(rgb, views[0][1]).backward(), max(repeats, 10))
        adam_ms = timed(optimizer.step, max(repeats, 10))
        print(f"{n:>10} {ms:>16} {1e3 * opensplat:>10.0f} {1e3 * opensplat / ms:>8.1f}x | {render_ms:>16} "
              f"{loss_ms:>16} {adam_ms:>14}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="python -m tools.bench render", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    parser.add_argument("--threads", type=int, default=None, help="torch and numba threads (default: as set)")
    parser.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    if not (args.data / "test_garden.npz").is_file():
        print(f"error: {args.data}: no test_garden.npz (pass --data)", file=sys.stderr)
        return 2
    if args.memory_probe:
        memory_probe(args.data)
        return 0
    print(f"torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"load average {os.getloadavg()[0]:.1f} (other processes share these cores)")
    runs = {"reference": bench_reference, "garden": bench_garden, "train": bench_train}
    for name in SECTIONS:
        if name not in args.skip:
            runs[name](args.data, args.repeats)
    print(f"\nnumba threading layer: {numba.threading_layer()}, load average {os.getloadavg()[0]:.1f}")
    return 0
