#!/usr/bin/env bash
# The main job on a small scene, from a fresh machine: install, tile, train, evaluate, export.
# Usage: bash tools/demo.sh [OUT_DIR]    (default: runs/demo)
# Uses the real lund_door photos when ../shared/data (or $OCTOSPLAT_DATA) is there, else a
# generated scene (python -m tools.make_scene wall).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
PY=.venv/bin/python
OUT=${1:-runs/demo}
DATA_ROOT=${OCTOSPLAT_DATA:-../shared/data}
rm -rf "$OUT"
mkdir -p "$OUT"

if [ -d "$DATA_ROOT/lund_door" ]; then
    DATA="$DATA_ROOT/lund_door"
    FACTOR=8
else
    DATA="$OUT/wall"
    FACTOR=1
    "$PY" -m tools.make_scene wall "$DATA"
fi

"$PY" -m tools.tile "$DATA" --out "$OUT/scene.zarr" --max-per-block 2000
# Densification (gsplat's DefaultStrategy) from step 50 every 50 steps: 300 steps are too few for
# its defaults (refinements from step 500), and the scene grows about fivefold.
"$PY" -m train --data "$DATA" --store "$OUT/scene.zarr" --out "$OUT/run" \
    --steps 300 --data-factor "$FACTOR" --eval-every 100 --commit-every 100 --cache-mb 64 \
    --refine-start-iter 50 --refine-every 50
"$PY" -m tools.export "$OUT/scene.zarr" --out "$OUT/scene.ply"

echo
echo "trained store:   $OUT/scene.zarr"
echo "splat PLY:       $OUT/scene.ply   (opens in any 3DGS viewer)"
echo "renders:         $OUT/run/renders/  (left: ours, right: held-out photo)"
echo "metrics:         $OUT/run/metrics.jsonl, $OUT/run/metrics.png, $OUT/run/summary.json"
