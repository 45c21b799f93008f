"""`train.heap.retain_freed_memory`: a step's arrays, freed and allocated again, reuse resident
memory instead of faulting in fresh pages (counted by the kernel, not timed)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Three 1.6 MB arrays written and freed, as a step's buffers are, five times; prints the minor
# page faults of each round after the first.
_ROUNDS = """
import json, resource, sys
import numpy as np
from train.heap import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for r in range(5):
    before = faults()
    arrays = [np.empty((3, 280, 490), np.float32) for _ in range(3)]
    for a in arrays:
        a[:] = 1.0
    del arrays, a
    counts.append(faults() - before)
print(json.dumps(counts[1:]))
"""


def _faults(mode: str) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", _ROUNDS, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_arrays_are_reused_without_page_faults():
    pages = 3 * 3 * 280 * 490 * 4 // 4096  # ~1,200 pages a round
    default, retained = _faults("default"), _faults("retain")
    assert min(default) > pages // 2, default  # the reference: glibc gives the memory back and faults it in again
    assert max(retained) < 50, retained  # kept: the next round writes resident pages
