"""The instruction set numba compiles our kernels for: this CPU's, with 256-bit vectors preferred.

The tile kernels are written for rows of 8 float32 lanes (`kernels._HALF_W`, one AVX2 register).
Where LLVM's tuning for an AVX-512 CPU lets the vectorizer use 512-bit registers (AMD Zen 4,
`znver4`), it vectorizes their pixel loops 16 lanes wide: two rows of a half tile a vector, and
an odd row left to an epilogue. With 256-bit vectors preferred, the tile kernels took 0.82x
(forward) and 0.87x (backward) of the time on a Zen 4 (docs/benchmarks.md, ## opensplat).
LLVM's tuning for Intel's AVX-512 server cores already prefers 256 bits, and CPUs without
AVX-512 have no wider vectors: there this changes nothing.

numba reads its target from NUMBA_CPU_FEATURES when it makes its CPU code generator, at the
first compile or cache load of a process, and keys its cached kernels by it; so every process
that imports `train` sets it first (`train/__init__.py`), the child that fills the kernels'
cache (`compiled`) as well as the trainer and its MPI ranks, and all of them agree. A run that
sets NUMBA_CPU_NAME, NUMBA_CPU_FEATURES or NUMBA_ENABLE_AVX itself keeps its own choice.
Importing this module loads neither numba nor torch.
"""
from __future__ import annotations

import os
import platform
import sys

PREFER_256 = "+prefer-256-bit"
_OURS = "OCTOSPLAT_NUMBA_FEATURES"  # marks NUMBA_CPU_FEATURES as set here, not by the user
_USER_CHOICES = ("NUMBA_CPU_NAME", "NUMBA_ENABLE_AVX")  # never set here


def configure_codegen() -> None:
    """Set NUMBA_CPU_FEATURES to this CPU's features and `PREFER_256`, unless the run chose its
    own target. Recomputed in every process, never inherited: an MPI rank may run on another
    host, whose CPU may lack the launcher's features."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return  # prefer-256-bit is an x86 feature; LLVM warns about it elsewhere
    if any(name in os.environ for name in _USER_CHOICES):
        return
    if "NUMBA_CPU_FEATURES" in os.environ and os.environ.get(_OURS) != "1":
        return
    from llvmlite import binding

    os.environ["NUMBA_CPU_FEATURES"] = f"{binding.get_host_cpu_features().flatten()},{PREFER_256}"
    os.environ[_OURS] = "1"
    if "numba" in sys.modules:  # numba read its environment when it was imported: have it read again
        from numba.core import config

        config.reload_config()
