"""The trainer's configuration: dataclasses whose fields are the command-line flags, one each."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from octree.semantics import MAX_SH_DEGREE
from train.cli import HelpFormatter
from train.densify.config import ConfigError, DensifyConfig
from train.losses import SSIM_LAMBDA
from train.occlusion import OCCLUSION_MODES
from train.optim import ADAM_MODES, AdamConfig

__all__ = ["ConfigError", "OptimConfig", "RUN_FACTS", "TrainConfig", "build_parser", "parse_config"]

# gsplat simple_trainer's mcmc preset: opacity_reg and scale_reg.
MCMC_REG = 0.01

# What config.json records of a run beside its settings; `--config` reads past them.
RUN_FACTS = ("ranks", "device", "scene_scale", "train_images", "test_images")


@dataclass
class OptimConfig:
    """Learning rates and loss weights (gsplat's simple_trainer names and defaults)"""

    means_lr: float = 1.6e-4  # means (times the scene scale, decaying exponentially to 1% of it over --steps)
    scales_lr: float = 5e-3  # log scales
    opacities_lr: float = 5e-2  # opacity logits
    quats_lr: float = 1e-3  # rotations
    sh0_lr: float = 2.5e-3  # SH degree 0 (the base colour)
    shN_lr: float | None = None  # SH degrees 1 and up (default: sh0_lr / 20)
    ssim_lambda: float = SSIM_LAMBDA  # loss = (1 - ssim_lambda) L1 + ssim_lambda (1 - SSIM)
    opacity_reg: float | None = None  # loss += opacity_reg x the mean opacity of every Gaussian (default: 0.01 with --strategy mcmc, as gsplat's mcmc preset; else 0)
    scale_reg: float | None = None  # loss += scale_reg x the mean scale of every Gaussian (default: 0.01 with --strategy mcmc, as gsplat's mcmc preset; else 0)

    def __post_init__(self) -> None:
        if self.shN_lr is None:
            self.shN_lr = self.sh0_lr / 20
        for name in ("means_lr", "scales_lr", "opacities_lr", "quats_lr", "sh0_lr", "shN_lr", "opacity_reg",
                     "scale_reg"):
            value = getattr(self, name)
            if value is None and name.endswith("_reg"):  # resolved by TrainConfig, which knows the strategy
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a finite number >= 0")
        if not (isinstance(self.ssim_lambda, (int, float)) and 0.0 <= self.ssim_lambda <= 1.0):
            raise ConfigError(f"--ssim-lambda {self.ssim_lambda}: must be in [0, 1]")

    def adam(self) -> AdamConfig:
        """Adam's settings for a batch of one camera (`AdamConfig.for_batch` scales them)."""
        return AdamConfig(lr={"means": self.means_lr, "scales": self.scales_lr, "quats": self.quats_lr,
                              "opacities": self.opacities_lr, "sh0": self.sh0_lr, "shN": self.shN_lr})


@dataclass
class TrainConfig:
    data: str = ""  # dataset: COLMAP folder (sparse/ + images/) or a folder with transforms.json
    store: str = ""  # scene store written by `python -m tools.tile`
    out: str = "runs/latest"  # logs, metrics, renders and the resolved config
    steps: int = 30_000  # global steps (each trains on batch_size cameras per rank)
    batch_size: int = 1  # cameras per rank per step; the global batch is ranks x batch_size
    sh_degree: int | None = None  # highest SH degree to train (default: the store's)
    sh_degree_interval: int = 1000  # the SH degree used grows by one every this many steps
    cache_mb: float | None = None  # each rank's memory budget in MiB: its cached blocks and the step's working memory (gathered rows, gradients, projections, 2D splats); a view larger than it is paged in waves (default: a quarter of available memory)
    memory_mb: float | None = None  # each rank's ceiling on its resident memory in MiB (Linux): the process's memory beyond --cache-mb (libraries, heap fragmentation, the rasterizer's lists), measured by the kernel each step, lowers the cache's budget so that the peak stays under it; never below half of --cache-mb (default: no ceiling)
    device: str = "auto"  # cpu | cuda | auto (cuda when available)
    data_factor: int = 1  # image downscale factor
    image_memory_mb: float = 256.0  # decoded training images kept in memory (MiB, least recently used dropped first; not part of --cache-mb), so each is decoded once and not every epoch; 0 keeps none
    test_every: int = 8  # every N-th image is held out for evaluation
    locality_window: int = 100  # reorder each window of this many steps (at most an epoch) into a nearest-neighbour chain of where the cameras look, so consecutive steps see the same blocks and an out-of-core cache pages less; 0 keeps gsplat's random order
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    commit_every: int = 500  # commit the store every N steps (and at the end)
    log_every: int = 10  # write a metrics line every N steps
    max_skipped: int = 20  # stop with an error once this many steps in a row were skipped for a non-finite loss or gradient (a corrupt photo set, an exploding learning rate); 0: never stop
    keep_commits: int = 2  # committed generations kept by garbage collection
    seed: int = 0  # seeds the camera order, the random initialisation and densification's sampling
    deterministic: bool = False  # deterministic torch kernels: identical results run to run
    resume: bool = False  # continue from the store's last commit
    stop_at: int = 0  # commit and exit after this step, e.g. one wall-time slice of a cluster job; --resume continues (0: run to --steps); the schedule still spans --steps
    background: tuple[float, float, float] = (0.0, 0.0, 0.0)  # RGB in [0, 1] behind the Gaussians (and behind RGBA photos)
    max_eval_images: int = 0  # evaluate at most this many held-out views (0: all)
    progress: bool = True  # show a progress bar on rank 0
    tensorboard: bool = False  # also write TensorBoard events (losses, PSNR, counts, cache and exchange figures, held-out renders) under OUT/tensorboard; needs the tensorboard package
    allow_external_images: bool = False  # follow image paths that lead out of the dataset (transforms.json file_path, COLMAP image names): absolute, or climbing out with '..'
    adam: str = "visible"  # which Gaussians Adam steps: visible (every one a camera of the step projected, bias-corrected by the training step: gsplat's visible_adam), contributed (those that reached a pixel, bias-corrected by their own step count; hidden ones stay untouched: what --occlusion on needs), dense (every one, every step, as torch's Adam in gsplat's default; the steps of unseen ones are taken when they are next used)
    occlusion: str = "off"  # exact occlusion culling (on any number of ranks): on drops, per camera, the blocks wholly behind what its nearest blocks already saturate, so they are not paged, projected or rasterized; the image and every gradient are the same, but the densification statistics no longer count the dropped Gaussians for that camera (needs --adam contributed, and refuses --strategy mcmc: the others would step them)
    optim: OptimConfig = field(default_factory=OptimConfig)
    densify: DensifyConfig = field(default_factory=DensifyConfig)

    def __post_init__(self) -> None:
        at_least = {"steps": 0, "batch_size": 1, "sh_degree_interval": 1, "data_factor": 1, "test_every": 1,
                    "locality_window": 0, "eval_every": 0, "max_skipped": 0, "commit_every": 1, "log_every": 1,
                    "keep_commits": 1, "stop_at": 0, "max_eval_images": 0}
        for name, lo in at_least.items():
            if getattr(self, name) < lo:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least {lo}")
        if self.sh_degree is not None and not 0 <= self.sh_degree <= MAX_SH_DEGREE:
            raise ConfigError(f"--sh-degree {self.sh_degree}: must be in [0, {MAX_SH_DEGREE}]")
        if self.cache_mb is not None and not (math.isfinite(self.cache_mb) and self.cache_mb > 0):
            raise ConfigError(f"--cache-mb {self.cache_mb}: must be a positive number")
        if self.memory_mb is not None and not (math.isfinite(self.memory_mb) and self.memory_mb > 0):
            raise ConfigError(f"--memory-mb {self.memory_mb}: must be a positive number")
        if not (math.isfinite(self.image_memory_mb) and self.image_memory_mb >= 0):
            raise ConfigError(f"--image-memory-mb {self.image_memory_mb}: must be a finite number >= 0")
        if self.adam not in ADAM_MODES:
            raise ConfigError(f"--adam {self.adam!r}: choose from {', '.join(ADAM_MODES)}")
        if not all(math.isfinite(v) for v in self.background):
            raise ConfigError(f"--background {self.background}: must be finite")
        if isinstance(self.densify, dict):  # from a config.json
            self.densify = DensifyConfig(**self.densify)
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        for name in ("opacity_reg", "scale_reg"):
            if getattr(self.optim, name) is None:
                setattr(self.optim, name, MCMC_REG if self.densify.strategy == "mcmc" else 0.0)
        if self.adam == "dense" and (self.optim.opacity_reg > 0 or self.optim.scale_reg > 0):
            raise ConfigError(f"--adam dense with --opacity-reg {self.optim.opacity_reg} --scale-reg "
                              f"{self.optim.scale_reg}: dense Adam takes the steps of unseen Gaussians later, as if "
                              "their gradient were zero, which the regularisers make false; use --adam visible, or "
                              "--opacity-reg 0 --scale-reg 0")
        if self.occlusion not in OCCLUSION_MODES:
            raise ConfigError(f"--occlusion {self.occlusion!r}: choose from {', '.join(OCCLUSION_MODES)}")
        if self.occlusion == "on" and self.adam != "contributed":
            raise ConfigError(f"--occlusion on with --adam {self.adam}: {self.adam} Adam steps Gaussians that did "
                              "not reach a pixel, so hidden blocks would change while culling decides on their "
                              "old extents; add --adam contributed, or use --occlusion off")
        if self.occlusion == "on" and self.densify.strategy == "mcmc":
            raise ConfigError("--occlusion on with --strategy mcmc: MCMC adds noise to every mean a step projects, "
                              "hidden ones included, which occlusion culling skips; use --strategy default or none, "
                              "or --occlusion off")


def _field_help(cls: type) -> dict[str, str]:
    """Each field's trailing comment in the class's source, so flags and fields never drift apart."""
    helps: dict[str, str] = {}
    for line in inspect.getsource(cls).splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            helps[line.split(":", 1)[0].strip()] = line.split("#", 1)[1].strip()
    return helps


def _optional_type(hint: typing.Any) -> type | None:
    """int for `int | None`, float for `float | None`; None for anything else."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(hint) else None


def _add_fields(parser: argparse.ArgumentParser, cls: type, group: str | None = None) -> None:
    helps = _field_help(cls)
    hints = typing.get_type_hints(cls)
    target = parser.add_argument_group(group) if group else parser
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            _add_fields(parser, type(default), (inspect.getdoc(type(default)) or "").splitlines()[0] or None)
            continue
        flag = "--" + f.name.replace("_", "-")
        h = helps.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if isinstance(default, bool):
            target.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=h)
        elif isinstance(default, tuple):
            target.add_argument(flag, type=float, nargs=len(default), default=default, metavar=("R", "G", "B"), help=h)
        elif (optional := _optional_type(hints[f.name])) is not None:
            target.add_argument(flag, type=optional, default=None, help=h)
        elif f.name == "strategy":
            target.add_argument(flag, default=default, help=h)  # validated with the others: one error style
        else:
            target.add_argument(flag, type=type(default), default=default, help=h,
                                required=f.name in ("data", "store"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a 3DGS scene store out of core (one process, or one MPI rank per GPU).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--config", metavar="CONFIG_JSON",
                        help="re-run from a run's config.json: its settings become the defaults and the flags "
                             "given override them (default: none)")
    _add_fields(parser, TrainConfig)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The flags (over the settings of `--config`, if given) as a TrainConfig; raises ConfigError
    for a value out of range or a config file that does not hold a TrainConfig."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    saved_path = pre.parse_known_args(argv)[0].config
    if saved_path:
        saved = read_saved_config(Path(saved_path))
        parser.set_defaults(**saved)
        for action in parser._actions:
            if action.dest in saved:
                action.required = False
    values = vars(parser.parse_args(argv))
    values.pop("config")
    groups = {}
    for f in dataclasses.fields(TrainConfig):
        if (cls := _group(f)) is not None:
            names = {g.name for g in dataclasses.fields(cls)}
            groups[f.name] = cls(**{k: values.pop(k) for k in list(values) if k in names})
    values["background"] = tuple(values["background"])
    return TrainConfig(**values, **groups)


def read_saved_config(path: Path) -> dict[str, typing.Any]:
    """A config.json's settings as flag destinations -> values, every key and type checked."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--config {path}: not a readable JSON file ({e})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--config {path}: holds {type(saved).__name__}, not a JSON object of settings")
    flat: dict[str, typing.Any] = {}
    _check_saved(path, TrainConfig, {k: v for k, v in saved.items() if k not in RUN_FACTS}, "", flat)
    return flat


def _check_saved(path: Path, cls: type, saved: dict, prefix: str, flat: dict[str, typing.Any]) -> None:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in saved.items():
        where = f"--config {path}: {prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{where}: unknown setting{hint}")
        if (group := _group(fields[key])) is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: must be a JSON object of settings")
            _check_saved(path, group, value, f"{prefix}{key}.", flat)
            continue
        if not _fits(hints[key], value):
            raise ConfigError(f"{where}: {value!r} is not a valid {_type_name(hints[key])}")
        flat[key] = tuple(value) if isinstance(value, list) else value


def _group(f: dataclasses.Field) -> type | None:
    """The settings class of a field that holds a group of flags (optim, densify); else None."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


def _fits(hint: typing.Any, value: typing.Any) -> bool:
    """Whether a JSON value can stand for a field of type `hint` (JSON has no tuples, and an int
    is a float's value too)."""
    if (optional := _optional_type(hint)) is not None:
        return value is None or _fits(optional, value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        return isinstance(value, list) and len(value) == len(args) and all(_fits(a, v) for a, v in zip(args, value))
    return False


def _type_name(hint: typing.Any) -> str:
    if (optional := _optional_type(hint)) is not None:
        return f"{_type_name(optional)} or null"
    if typing.get_origin(hint) is tuple:
        return f"list of {len(typing.get_args(hint))} numbers"
    return {bool: "true or false", int: "integer", float: "number", str: "string"}.get(hint, str(hint))
