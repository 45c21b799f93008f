"""Run outputs: resolved config, JSON-lines metrics, a progress bar, and a plot of the curves."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

TENSORBOARD_IMAGES = 8  # held-out render pairs an evaluation sends to TensorBoard, at most


class RunLog:
    """Metrics of one rank as JSON lines (`metrics.jsonl`, or `metrics.rank<r>.jsonl` under MPI),
    and on rank 0, with `tensorboard`, the same numbers and the held-out renders as TensorBoard
    events under `out/tensorboard/`."""

    def __init__(self, out: Path, rank: int = 0, size: int = 1, tensorboard: bool = False) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        name = "metrics.jsonl" if size == 1 else f"metrics.rank{rank}.jsonl"
        self._file = open(out / name, "a", buffering=1)
        self._t0 = time.time()
        self._board = _tensorboard_writer(out / "tensorboard") if tensorboard and rank == 0 else None
        self._images: dict[int, int] = {}  # step -> images sent

    def write(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time() - self._t0, 4), **values}
        self._file.write(json.dumps(record) + "\n")
        if self._board is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._board.add_scalar(f"{kind}/{key}", value, step)

    def image(self, tag: str, step: int, image: np.ndarray) -> None:  # [H, W, 3] uint8
        """A picture for TensorBoard (the first `TENSORBOARD_IMAGES` of a step); nothing without it."""
        if self._board is None or self._images.get(step, 0) >= TENSORBOARD_IMAGES:
            return
        self._images[step] = self._images.get(step, 0) + 1
        self._board.add_image(tag, image, step, dataformats="HWC")

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


def tensorboard_missing() -> str | None:
    """Why `--tensorboard` cannot work here, or None when it can."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (torch's writer needs the tensorboard package)
    except ImportError as e:
        return (f"--tensorboard needs the tensorboard package, which is not installed ({e}): "
                "pip install 'tensorboard>=2.14', or install octosplat[tensorboard]")
    return None


def _tensorboard_writer(folder: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(folder))


def write_config(out: Path, cfg: Any, extra: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**asdict(cfg), **extra}, indent=2, default=str))


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not enabled, file=sys.stderr, dynamic_ncols=True, unit="step")


PLOT_DATA_KEY = "octosplat:plotted"  # the PNG text chunk that carries the plotted values as JSON


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plotted_series(logs: list[list[dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """What `plot_metrics` draws, from each rank's metrics lines (rank 0 first): name -> x, y."""
    def series(records: list[dict[str, Any]], kind: str, key: str) -> dict[str, list[float]]:
        rows = [r for r in records if r["kind"] == kind and key in r]
        return {"x": [r["step"] for r in rows], "y": [r[key] for r in rows]}

    first = logs[0]
    out = {"loss": series(first, "train", "loss"), "psnr": series(first, "train", "psnr"),
           "held-out psnr": series(first, "eval", "psnr"), "gaussians": series(first, "train", "gaussians")}
    if len(logs) > 1:
        out["imbalance (work)"] = series(first, "train", "imbalance")
        out["imbalance (wall)"] = series(first, "train", "imbalance_seconds")
        for r, records in enumerate(logs):
            out[f"rank {r} bytes sent"] = series(records, "train", "bytes_sent")
    return out


def plot_metrics(out: Path, size: int = 1) -> Path:
    """`out/metrics.png` from the run's metrics lines: loss, PSNR (training curve and held-out
    points) and the Gaussian count; under MPI also the ranks' imbalance and the bytes each rank
    sent. The values drawn travel in the PNG as JSON (`PLOT_DATA_KEY`), so the figure can be checked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    files = [out / "metrics.jsonl"] if size == 1 else [out / f"metrics.rank{r}.jsonl" for r in range(size)]
    series = plotted_series([read_metrics(f) for f in files])
    panels = [("loss", ["loss"]), ("PSNR (dB)", ["psnr", "held-out psnr"]), ("Gaussians", ["gaussians"])]
    if size > 1:
        panels += [("max / mean over ranks", ["imbalance (work)", "imbalance (wall)"]),
                   ("bytes sent per log interval", [f"rank {r} bytes sent" for r in range(size)])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (label, names) in zip(axes, panels):
        for name in names:
            s = series[name]
            ax.plot(s["x"], s["y"], "o-" if name == "held-out psnr" else "-", label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if len(names) > 1:
            ax.legend()
    fig.tight_layout()
    fig.canvas.draw()
    pixels = Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy())
    plt.close(fig)
    info = PngInfo()
    info.add_text(PLOT_DATA_KEY, json.dumps(series), zip=True)
    png = out / "metrics.png"
    pixels.save(png, pnginfo=info)
    return png
