"""Run outputs: resolved config, JSON-lines metrics, a progress bar, and a plot of the curves."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm


class RunLog:
    """Metrics of one rank as JSON lines (`metrics.jsonl`, or `metrics.rank<r>.jsonl` under MPI)."""

    def __init__(self, out: Path, rank: int = 0, size: int = 1) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        name = "metrics.jsonl" if size == 1 else f"metrics.rank{rank}.jsonl"
        self._file = open(out / name, "a", buffering=1)
        self._t0 = time.time()

    def write(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time() - self._t0, 4), **values}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def write_config(out: Path, cfg: Any, extra: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**asdict(cfg), **extra}, indent=2, default=str))


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not enabled, file=sys.stderr, dynamic_ncols=True, unit="step")


def plot_metrics(metrics: Path, png: Path) -> None:
    """Loss, PSNR (training curve plus held-out points) and the Gaussian count over steps, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = [], []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train":
            train.append(r)
        elif r["kind"] == "eval":
            evals.append(r)
    fig, (ax_loss, ax_psnr, ax_count) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train])
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (0.8 L1 + 0.2 D-SSIM)")
    ax_psnr.plot([r["step"] for r in train], [r["psnr"] for r in train], label="train")
    if evals:
        ax_psnr.plot([r["step"] for r in evals], [r["psnr"] for r in evals], "o-", label="held-out")
    ax_psnr.set_xlabel("step")
    ax_psnr.set_ylabel("PSNR (dB)")
    ax_psnr.legend()
    counts = [r for r in train if "gaussians" in r]
    ax_count.plot([r["step"] for r in counts], [r["gaussians"] for r in counts])
    ax_count.set_xlabel("step")
    ax_count.set_ylabel("Gaussians")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
