"""train.codegen: every process that imports `train` has numba compile for this CPU with 256-bit
vectors preferred, unless the run chose its own target. Each case runs a fresh interpreter, as
numba takes its target once a process."""
from __future__ import annotations

import ast
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from llvmlite import binding

from train.codegen import PREFER_256

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="prefer-256-bit is an x86 feature; elsewhere the target is left alone")

# Compiles a loop LLVM vectorizes as wide as it is allowed to, after importing `first` and a
# kernel module; prints the code generator's features and whether the loop used 512-bit registers.
_PROBE = """
import {first}
import train.render.cpu.kernels
import numpy as np
from numba import njit
from numba.core.registry import cpu_target

@njit(fastmath=True)
def axpy(a, x, y):
    for i in range(x.size):
        y[i] += a * x[i]

x = np.ones(1000, np.float32)
axpy(np.float32(2.0), x, x.copy())
print(repr(cpu_target.target_context.codegen().magic_tuple()[2]))
print(repr("zmm" in next(iter(axpy.inspect_asm().values()))))
"""


def _probe(env: dict[str, str], first: str = "os") -> tuple[str, bool]:
    """(the features numba compiled for, whether the loop used zmm registers)"""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_ENABLE_AVX", "OCTOSPLAT_NUMBA_FEATURES")}
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(first=first)], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    features, zmm = proc.stdout.strip().splitlines()[-2:]
    return ast.literal_eval(features), ast.literal_eval(zmm)


def _host() -> str:
    return binding.get_host_cpu_features().flatten()


@pytest.mark.parametrize("first", ["os", "numba"])  # numba already imported: it reads its environment again
def test_this_cpu_with_256_bit_vectors(first):
    features, zmm = _probe({}, first)
    assert features == f"{_host()},{PREFER_256}"
    assert not zmm  # on an AVX-512 CPU whose tuning allows 512-bit vectors (Zen 4), it used them without


def test_a_runs_own_target_is_kept():
    assert _probe({"NUMBA_CPU_FEATURES": "+sse2,+sse4.1"})[0] == "+sse2,+sse4.1"
    assert PREFER_256 not in _probe({"NUMBA_CPU_NAME": "generic"})[0]


def test_features_set_by_another_process_are_recomputed():
    """An MPI rank inherits the launcher's environment, maybe from another host's CPU."""
    features, _ = _probe({"NUMBA_CPU_FEATURES": "+sse2", "OCTOSPLAT_NUMBA_FEATURES": "1"})
    assert features == f"{_host()},{PREFER_256}"
