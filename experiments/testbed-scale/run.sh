#!/usr/bin/env bash
# The measured multi-node points of experiments/testbed-scale: `pilab scale` on a 4-node testbed (one machine,
# 2 cores: np=8 is 8 ranks on 2 cores, oversubscribed). Needs root. Timings only: one epoch of 1024
# images is too short to learn (test accuracy 10% at every np), so the accuracy verdicts mean nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pilab testbed up --nodes 4 --slots 2 --rate 1gbit
eval "$(python -m pilab testbed env)"
python -m pilab scale --nps 2,4,8 --simulate-nps '' --hostfile /run/pilab-testbed/hosts --width 0.25 \
    --train-subset 1024 --test-subset 200 --epochs 1 --batch-size 16 --threads 1 --out experiments/testbed-scale
python -m pilab testbed down
