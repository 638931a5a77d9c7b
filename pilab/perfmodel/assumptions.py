"""The performance model's stated assumptions, in one place (docs/perfmodel.md explains each).

    from pilab.perfmodel.assumptions import THREAD_EXPONENT
    compute_s * (ref_threads / threads) ** THREAD_EXPONENT     # compute time at another thread count
"""
from __future__ import annotations

BACKWARD_FRACTION = 2 / 3  # backward ~ 2x the forward FLOPs: 2/3 of a step's compute
THREAD_EXPONENT = 0.8  # compute time ~ threads^-0.8 (intra-op scaling of small 32x32 convs)
ELEMENT_BYTES = 4  # fp32 gradients
METRIC_BYTES = 24  # pilab's per-step Allreduce of [loss sum, correct, stop vote] (float64)

# A CPU training step of these 32x32 networks is bound by memory traffic as much as by FLOPs: one
# activation element written by a layer costs about as much time as this many training FLOPs.
# Measured once on an x86 core with PyTorch's CPU build (`python -m pilab bench --sections perfmodel`
# prints the fit); it sets how compute time moves with width, not its level, which the np=1 run calibrates.
FLOPS_PER_ACTIVATION_CPU = 230.0
# Each step also pays a cost that does not grow with the batch (operator dispatch, autograd
# bookkeeping, the optimizer's per-tensor loops): ~20 ms per step for MobileNetV2 here at one thread,
# at every width. In the same work units, per parameter tensor of the model; it matters when the
# per-rank batch is small (a fixed global batch at large np). Measured like the constant above (fits
# over batches 4..64 and widths 0.25..1 gave 170-360 for the one above and 3-7e6 for this one).
STEP_WORK_PER_TENSOR_CPU = 5.0e6
