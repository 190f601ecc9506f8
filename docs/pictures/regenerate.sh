#!/bin/sh
# Redraw the pictures shown in docs/cli.md. Run from the repository root, with matplotlib
# installed (pip install -e '.[viz]'); PYTHON picks the interpreter (default: python).
set -eu
PYTHON=${PYTHON:-python}

# Dense: 128 ranks, tp 8, pp 4 (dp 4 is what is left), 8 GPUs per node; rank 37's groups outlined.
"$PYTHON" -m hypergrid plan --world-size 128 --tp 8 --pp 4 --gpus-per-node 8 --rank 37 \
    --png docs/pictures/dense-128.png >/dev/null

# MoE: 4,096 ranks, tp 2, cp 2, pp 4, ep 8, etp 1 (dp 256, expert dp 128), 8 GPUs per node and
# NVLink domains of 72 GPUs (9 nodes; 72 does not divide 4,096, so the last domain is partial).
"$PYTHON" -m hypergrid plan --world-size 4096 --tp 2 --cp 2 --pp 4 --ep 8 --etp 1 --gpus-per-node 8 \
    --nvlink-domain 72 --rank 1000 --png docs/pictures/moe-4096.png >/dev/null
