#!/usr/bin/env bash
# Three models on one strong-scaling protocol (issue 14): MobileNetV2-CIFAR width 0.25, SqueezeNet 1.1 and
# the spiking CNN (width 1, T=4), each at its own learning rate from the short sweep (docs/spiking.md),
# on the embedded CIFAR-10 subset: 2,000 train / 500 test images, 4 epochs, 32 images per rank.
# np = 1, 2 are real MPI jobs here; np = 8, 48 are exact virtual-rank simulations; speedup, time and
# energy to target are predicted for the 24-node Raspberry Pi 4B cluster (speed baseline np=2).
set -euo pipefail
cd "$(dirname "$0")/../.."
common=(--train-subset 2000 --test-subset 500 --epochs 4 --batch-size 32 --lr-ref-batch 32
        --nps 1,2 --simulate-nps 8,48 --target pi4b_cluster --overwrite)
python -m pilab scale "${common[@]}" --model mobilenetv2_cifar --width 0.25 --lr 0.05 --out experiments/three-models/mobilenet
python -m pilab scale "${common[@]}" --model squeezenet1_1 --width 1.0 --lr 0.01 --out experiments/three-models/squeezenet
python -m pilab scale "${common[@]}" --model spiking_cnn --width 1.0 --lr 0.2 --out experiments/three-models/spiking
python - <<'PY'
from pilab.study import compare, tables
from pilab.files import atomic_write_text, load_json
names = {"MobileNetV2-CIFAR 0.25": "mobilenet", "SqueezeNet 1.1": "squeezenet", "spiking CNN": "spiking"}
rows = compare.models_summary({k: load_json(f"experiments/three-models/{v}/study.json") for k, v in names.items()})
atomic_write_text("experiments/three-models/summary.md", tables.models_summary_markdown(rows) + "\n")
print(tables.models_summary_markdown(rows))
PY
