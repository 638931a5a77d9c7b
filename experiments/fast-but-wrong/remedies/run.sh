#!/usr/bin/env bash
# Remedies at np=48 on the committed study's protocol (../run.sh), times predicted for the 24-node Pi
# cluster: which settings are both fast (predicted Pi speedup over one node = 2 ranks) and right (test
# accuracy near np=1's). Every candidate is an exact 48-rank simulation, one job each, two at a time
# (JOBS=1 for one), kept in <candidate>/result.json as it finishes; candidates that are a study point
# (baseline = naive np=48, linear lr, linear/sqrt lr + warmup) are taken from the study (--reuse). Then
# one `pilab remedies --resume` puts them together: remedies.json, report.html, report.png.
# Pass candidate labels to run only those (e.g. for a partial front): run.sh "sqrt lr" "lars + warmup"
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=experiments/fast-but-wrong/remedies
study=experiments/fast-but-wrong
data=${PILAB_CIFAR_ARCHIVE:-../shared/data/cifar10-jpeg.tar.gz}
proto=(--data "$data" --model mobilenetv2_cifar --width 0.25 --train-subset 15000 --test-subset 2000
       --epochs 10 --batch-size 32 --lr 0.05 --lr-ref-batch 32 --threads 1)
ref=$(python -c "import json; print(json.load(open('$study/naive/np1/result.json'))['epochs'][-1]['test_acc'])")
args=(--np 48 "${proto[@]}" --reference-acc "$ref" --target pi4b_cluster --out "$here" --resume
      --reuse "$study/naive,$study/linear,$study/linear-warmup,$study/sqrt-warmup")

if [[ ${1:-} == --one ]]; then python -m pilab remedies "${args[@]}" --only "$2" >/dev/null; exit; fi

if (( $# )); then labels=("$@"); else labels=(
    # most promising first: a fixed global batch (more steps per epoch), longer runs, then one change each
    "fixed global batch 384 + sqrt lr + warmup" "fixed global batch 384 + sqrt lr + warmup + 20 epochs"
    "sqrt lr + warmup + 20 epochs" "lars + warmup" "ghost BN 8" "sqrt lr" "warmup 2 ep" "lars"
    "BN buffers averaged" "20 epochs" "fixed global batch 96" "fixed global batch + sqrt lr"
    "baseline" "linear lr" "linear lr + warmup" "sqrt lr + warmup"); fi
printf '%s\n' "${labels[@]}" | xargs -P "${JOBS:-2}" -I{} "$0" --one {}
only=$(IFS=,; echo "${labels[*]}")
python -m pilab remedies "${args[@]}" --only "$only"
