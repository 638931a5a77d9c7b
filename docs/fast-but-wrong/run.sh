#!/usr/bin/env bash
# The committed fast-but-wrong study: real CIFAR-10 (a 10,000-image class-stratified subset of the
# shared archive, 1,000 test images), MobileNetV2 (torchvision layout) width 0.5, 10 epochs, 32 images
# per rank, static sharding, per-rank BatchNorm. np = 1, 8 and 48 are exact virtual-rank simulations
# (bit-identical to real MPI ranks on CPU), one thread each, the three rules in parallel.
# Rules: naive (lr 0.05 at every np), linear (0.05 x global batch / 32), linear + 2-epoch warmup.
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${PILAB_CIFAR_ARCHIVE:-../shared/data/cifar10-jpeg.tar.gz}
python -m pilab data info --data "$data" >/dev/null   # decode + cache once, before the parallel runs
common=(--data "$data" --train-subset 10000 --test-subset 1000 --model mobilenetv2 --width 0.5
        --epochs 10 --batch-size 32 --lr 0.05 --lr-ref-batch 32 --threads 1 --nps "" --simulate-nps 1,8,48)
python -m pilab scale "${common[@]}" --lr-scaling none --out docs/fast-but-wrong/naive &
python -m pilab scale "${common[@]}" --lr-scaling linear --out docs/fast-but-wrong/linear &
python -m pilab scale "${common[@]}" --lr-scaling linear --warmup-epochs 2 --out docs/fast-but-wrong/linear-warmup &
wait
python -m pilab compare docs/fast-but-wrong/naive docs/fast-but-wrong/linear docs/fast-but-wrong/linear-warmup \
    --labels naive,linear,linear+warmup --out docs/fast-but-wrong
