#!/usr/bin/env bash
# The committed fast-but-wrong study (issue 11). Real CIFAR-10: a 15,000-image class-stratified subset of
# the shared archive, 2,000 test images. MobileNetV2, CIFAR layout (keeps 32x32), width 0.25, 10 epochs,
# 32 images per rank, SGD momentum 0.9, cosine schedule, lr 0.05 per 32 images (tuned at np=1 first:
# sweep/README.md), static shards, per-rank BatchNorm, one thread per rank.
#
#   np=1            measured (a real run of `pilab train` on this machine)
#   np=2,8,16,48    exact virtual-rank simulations (bit-identical to real MPI ranks on CPU)
#   rules           naive (lr 0.05 at every np), linear (0.05 x global batch / 32), linear + 2-epoch
#                   warmup, sqrt + 2-epoch warmup; np = 2 and 16 with the best rule at np 8 and 48
#
# Every point is its own job (two at a time: JOBS=1 for one), written to <rule>/np<N>/result.json as it
# finishes; a point already finished is skipped, so an interrupted run continues where it stopped. Rules
# whose np=1 is another rule's (at np=1 the global batch is the reference batch: every rule gives lr
# 0.05) take it from that rule (`pilab scale --reuse`). Then `pilab scale --resume` puts each rule's
# points into a study (study.json, report.html, times predicted for the 24-node Pi cluster) and
# `pilab compare` draws the rules side by side. ~13 minutes per point here; ~75 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=experiments/fast-but-wrong
data=${PILAB_CIFAR_ARCHIVE:-../shared/data/cifar10-jpeg.tar.gz}
proto=(--data "$data" --model mobilenetv2_cifar --width 0.25 --train-subset 15000 --test-subset 2000
       --epochs 10 --batch-size 32 --lr 0.05 --lr-ref-batch 32 --threads 1)
best=sqrt-warmup  # the most accurate rule at np=8 (README.md): also run at np 2 and 16

rule() {
    case $1 in
        naive) echo --lr-scaling none ;;
        linear) echo --lr-scaling linear ;;
        linear-warmup) echo --lr-scaling linear --warmup-epochs 2 ;;
        sqrt-warmup) echo --lr-scaling sqrt --warmup-epochs 2 ;;
        *) echo "run.sh: unknown rule $1" >&2; exit 2 ;;
    esac
}

point() {  # one (rule, np) point, unless it already finished
    local r=$1 n=$2 out=$here/$1/np$2
    if [[ -f $out/result.json ]] && python - "$out/result.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
sys.exit(0 if not r.get("stopped_early") and r.get("steps_done") == r.get("total_steps") else 1)
EOF
    then echo "run.sh: $out finished earlier, kept" >&2; return; fi
    # shellcheck disable=SC2046  # the rule's flags are words
    if [[ $n == 1 ]]; then
        python -m pilab train "${proto[@]}" $(rule "$r") --quiet --out "$out" --overwrite
    else
        python -m pilab simulate --np "$n" "${proto[@]}" $(rule "$r") --quiet --out "$out" --overwrite
    fi
}

if [[ ${1:-} == --point ]]; then point "$2" "$3"; exit; fi

python -m pilab data info --data "$data" >/dev/null  # decode + cache once, before the parallel jobs
# Most telling first: np=1 references, then np=48, np=8, then the best rule's np 2 and 16.
printf '%s\n' "naive 1" "linear-warmup 1" "naive 48" "linear-warmup 48" "linear 48" "sqrt-warmup 48" \
    "naive 8" "linear-warmup 8" "linear 8" "sqrt-warmup 8" "$best 2" "$best 16" |
    xargs -P "${JOBS:-2}" -L 1 "$0" --point

for r in naive linear linear-warmup sqrt-warmup; do
    sims=8,48; [[ $r == "$best" ]] && sims=2,8,16,48
    reuse=(); [[ $r == linear ]] && reuse=(--reuse "$here/naive")
    [[ $r == sqrt-warmup ]] && reuse=(--reuse "$here/linear-warmup")
    # shellcheck disable=SC2046
    python -m pilab scale "${proto[@]}" $(rule "$r") --nps 1 --simulate-nps "$sims" "${reuse[@]}" \
        --resume --out "$here/$r"
done
python -m pilab compare "$here/naive" "$here/linear" "$here/linear-warmup" "$here/sqrt-warmup" \
    --labels naive,linear,linear+warmup,sqrt+warmup --out "$here"
