"""What the model needs to know about a network: its gradient tensors in the order backward makes
them ready, the buckets GradSync fuses them into, its work per image and its BatchNorm buffers.

    from pilab.perfmodel import gradient_layout, buckets_for
    layout = gradient_layout("mobilenetv2_cifar", 1.0)   # 158 (numel, ready) pairs
    buckets_for(layout, bucket_mb=1.0)                   # (numel, ready) per GradSync bucket

torch and the model registry are imported inside the functions that use them, so that
``import pilab.perfmodel`` stays free of torch's start-up; nothing here initialises MPI.
"""
from __future__ import annotations

import functools

from ..dist import bucket_assignment


# ----------------------------------------------------------------------------------------------
# what a run recorded: analysis reads it instead of building the model again
# ----------------------------------------------------------------------------------------------
_RECORDED: dict[tuple[str, float], dict] = {}  # (model, width) -> a run's model_profile


def model_profile(model: str, width: float, timesteps: int | None = None) -> dict | None:
    """What the performance model needs to know about ``model`` at ``width``, measured now on it (a run
    records it in result.json and its trace at train time, where its code runs anyway)::

        model_profile("mobilenetv2_cifar", 0.25)   # {"flops_per_image": ..., "activations_per_image": ...,
                                                   #  "gradient_layout": [[numel, ready], ...], "bn_channels": [...]}

    None where it cannot be measured (a model that does not take 32x32 probe images)."""
    from ..models import activation_elements, train_flops_per_image  # torch: see the module docstring
    try:
        return {"model": model, "width": float(width), "timesteps": timesteps,
                "flops_per_image": float(train_flops_per_image(model, width, timesteps=timesteps)),
                "activations_per_image": float(activation_elements(model, width, timesteps=timesteps)),
                "gradient_layout": [list(t) for t in _measured_layout(model, float(width))],
                "bn_channels": list(_measured_bn_channels(model, float(width)))}
    except Exception:  # noqa: BLE001 - a profile is a convenience for analysis, never a reason to fail a run
        return None


def remember(profile: dict | None) -> None:
    """Use ``profile`` (a result's or trace's ``model_profile``) for its model and width from now on, in
    place of building the model: reading a result never runs the code of the builder it names."""
    if isinstance(profile, dict) and profile.get("model") and profile.get("gradient_layout") is not None:
        _RECORDED[(profile["model"], float(profile["width"]))] = profile


def _recorded(model: str, width: float, timesteps=None, key: str = "gradient_layout"):
    rec = _RECORDED.get((model, float(width)))
    if rec is None or rec.get(key) is None or (key.endswith("per_image") and rec.get("timesteps") != timesteps):
        return None
    return rec[key]


def flops_per_image(model: str, width: float, timesteps: int | None = None) -> float:
    """Training FLOPs of one image: recorded (``remember``), else ``models.zoo.train_flops_per_image``."""
    rec = _recorded(model, width, timesteps, "flops_per_image")
    if rec is not None:
        return float(rec)
    from ..models import train_flops_per_image
    return train_flops_per_image(model, width, timesteps=timesteps)


def activations_per_image(model: str, width: float, timesteps: int | None = None) -> float:
    """Activation elements of one image: recorded (``remember``), else ``models.zoo.activation_elements``."""
    rec = _recorded(model, width, timesteps, "activations_per_image")
    if rec is not None:
        return float(rec)
    from ..models import activation_elements
    return activation_elements(model, width, timesteps=timesteps)


def gradient_layout(model: str, width: float) -> tuple[tuple[int, float], ...]:
    """(numel, ready) per parameter tensor, in the reversed definition order GradSync buckets in.

    ``ready`` is the fraction of backward compute done when that tensor's gradient is complete,
    taking each module's backward to cost in proportion to its forward multiply-accumulates.
    What a run recorded (``remember``), else measured on ``models.probe_model`` (one real one-image
    forward).
    """
    rec = _recorded(model, width)
    if rec is not None:
        return tuple((int(n), float(r)) for n, r in rec)
    return _measured_layout(model, float(width))


@functools.lru_cache(maxsize=None)
def _measured_layout(model: str, width: float) -> tuple[tuple[int, float], ...]:
    import torch  # here, not at the top: see the module docstring
    from torch import nn

    from ..models import input_channels
    from ..models import probe_model

    net = probe_model(model, width=width)
    order: list[nn.Module] = []
    macs: dict[int, float] = {}

    def hook(m, inp, out):
        order.append(m)
        o = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
            macs[id(m)] = macs.get(id(m), 0.0) + o[0].numel() * k
        elif isinstance(m, nn.Linear):
            macs[id(m)] = macs.get(id(m), 0.0) + o[0].numel() * m.in_features
    leaves = [m for m in net.modules() if not list(m.children()) and list(m.parameters(recurse=False))]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        net.eval()
        with torch.no_grad():
            net(torch.zeros(1, input_channels(net), 32, 32))  # your own model may take grey images
    finally:
        for h in handles:
            h.remove()
    total = sum(macs.values()) or 1.0
    done_after: dict[int, float] = {}
    acc = 0.0
    for m in reversed(order):  # backward visits modules in reverse forward order
        acc += macs.get(id(m), 0.0)
        done_after.setdefault(id(m), acc / total)
    owner = {}
    for m in leaves:
        for p in m.parameters(recurse=False):
            owner[id(p)] = id(m)
    params = [p for p in net.parameters() if p.requires_grad]
    return tuple((p.numel(), done_after.get(owner.get(id(p)), 1.0)) for p in reversed(params))


def buckets_for(layout, bucket_mb: float, tail_mb: float = 0.0) -> list[tuple[int, float]]:
    """(numel, ready) per bucket, filled by the rule ``dist.GradSync`` uses (``buckets.bucket_assignment``).

        buckets_for(((10, 0.1), (10, 0.2), (300_000, 0.9)), 1.0)   # [(20, 0.2), (300000, 0.9)]
    """
    return [(sum(layout[i][0] for i in idx), max(layout[i][1] for i in idx))
            for idx in bucket_assignment([numel for numel, _ in layout], bucket_mb, tail_mb)]


def work_per_image(model: str, width: float, flops_per_activation: float = 0.0,
                   timesteps: int | None = None) -> float:
    """Training FLOPs of one image plus ``flops_per_activation`` for each activation element
    (``timesteps``: a spiking model's time steps; the others ignore it).

        work_per_image("mobilenetv2_cifar", 0.5, FLOPS_PER_ACTIVATION_CPU) / 1e9   # ~0.78
    """
    work = flops_per_image(model, width, timesteps)
    if flops_per_activation:
        work += flops_per_activation * activations_per_image(model, width, timesteps)
    return work


def bn_channels(model: str, width: float) -> tuple[int, ...]:
    """Channels of each BatchNorm layer, in forward order: ``bn_channels("mobilenetv2_cifar", 0.25)``
    has 52 layers, 5,328 channels. What a run recorded (``remember``), else measured."""
    rec = _recorded(model, width, key="bn_channels")
    return tuple(int(c) for c in rec) if rec is not None else _measured_bn_channels(model, float(width))


@functools.lru_cache(maxsize=None)
def _measured_bn_channels(model: str, width: float) -> tuple[int, ...]:
    # here, not at the top: see the module docstring
    from torch.nn.modules.batchnorm import _BatchNorm  # every BatchNorm: your own model's 1d and 3d too

    from ..models import probe_model

    return tuple(m.num_features for m in probe_model(model, width=width).modules() if isinstance(m, _BatchNorm))


def bn_bytes(model: str, width: float) -> int:
    """Bytes of BatchNorm running mean + var (what sync_buffers_ broadcasts before evaluation)."""
    return sum(2 * c * 4 for c in bn_channels(model, width))


def optimizer_work(cfg) -> float:
    """FLOPs an optimizer step adds beyond the per-image work: Muon's orthogonalisations
    (``Config.optimizer="muon"``: 0.16 GFLOP a step at MobileNetV2-CIFAR 0.25, about three images' training
    FLOPs, which every rank computes on the same averaged gradient), 0 for the element-wise optimizers."""
    return _muon_flops(cfg.model, cfg.width, cfg.muon_on) if cfg.optimizer == "muon" else 0.0


MUON_NS_STEPS = 3  # pilab.engine.optim.NS_STEPS (tests/test_fewstep.py checks they agree)


def ns_flops(shapes: list[tuple[int, int]], steps: int = MUON_NS_STEPS) -> float:
    """Floating-point operations of one Muon step's orthogonalisations for matrices of these (rows, cols):
    per Newton-Schulz iteration on the short side s of an s x l matrix, X X^T (2 s^2 l), the quintic's
    A A (2 s^3) and its product with X (2 s^2 l)."""
    total = 0.0
    for r, c in shapes:
        s, l_ = min(r, c), max(r, c)
        total += steps * (4 * s * s * l_ + 2 * s ** 3)
    return total


@functools.lru_cache(maxsize=None)
def _muon_flops(model: str, width: float, on: str) -> float:
    from ..models import muon_weights  # torch: see the module docstring
    from ..models import probe_model

    return ns_flops([(p.shape[0], p[0].numel()) for p in muon_weights(probe_model(model, width=width), on)])
