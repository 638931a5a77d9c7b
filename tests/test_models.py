"""Model layouts, shapes, width checks, a tiny overfit, and FLOP counts. Plain pytest, one thread.

    python -m pytest -q tests/test_models.py
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pilab.config import Config, ConfigError
from pilab.models import (MODEL_NAMES, activation_elements, build_model, check_width, count_parameters, forward_macs,
                          train_flops_per_image)

torch.set_num_threads(1)

# Known entries of torchvision.models.mobilenet_v2(num_classes=1000).state_dict().
TORCHVISION_MOBILENETV2_KEYS = {
    "features.0.0.weight": (32, 3, 3, 3),
    "features.0.1.running_var": (32,),
    "features.1.conv.0.0.weight": (32, 1, 3, 3),
    "features.1.conv.1.weight": (16, 32, 1, 1),
    "features.1.conv.2.weight": (16,),
    "features.2.conv.0.0.weight": (96, 16, 1, 1),
    "features.2.conv.1.0.weight": (96, 1, 3, 3),
    "features.2.conv.2.weight": (24, 96, 1, 1),
    "features.2.conv.3.num_batches_tracked": (),
    "features.17.conv.2.weight": (320, 960, 1, 1),
    "features.18.0.weight": (1280, 320, 1, 1),
    "features.18.1.bias": (1280,),
    "classifier.1.weight": (1000, 1280),
    "classifier.1.bias": (1000,),
}
# stem 6 + features.1 (t=1) 12 + 16 blocks x 18 + last conv 6 + classifier 2
TORCHVISION_MOBILENETV2_NKEYS = 314


def _shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _x(n=2, size=32):
    return torch.randn(n, 3, size, size).to(memory_format=torch.channels_last)


# --- layout and parameter counts ------------------------------------------------------------
def test_names():
    assert MODEL_NAMES == ("mobilenetv2_cifar", "mobilenetv2", "squeezenet1_1", "spiking_cnn")


@pytest.mark.parametrize("name,classes,expected", [
    ("mobilenetv2", 1000, 3_504_872),
    ("mobilenetv2", 10, 2_236_682),
    ("mobilenetv2_cifar", 10, 2_236_682),
    ("squeezenet1_1", 1000, 1_235_496),  # torchvision's published count: shapes are unchanged
])
def test_parameter_counts(name, classes, expected):
    assert count_parameters(build_model(name, num_classes=classes)) == expected


def test_torchvision_keys():
    shapes = _shapes(build_model("mobilenetv2", num_classes=1000))
    assert len(shapes) == TORCHVISION_MOBILENETV2_NKEYS
    for key, shape in TORCHVISION_MOBILENETV2_KEYS.items():
        assert shapes[key] == shape, key
    model = build_model("mobilenetv2", num_classes=1000)
    assert isinstance(model.classifier[0], nn.Dropout)
    assert [k for k in shapes if k.startswith("features.")][-1].startswith("features.18.")


@pytest.mark.parametrize("width", [0.5, 1.0, 1.4])
def test_cifar_variant_has_same_keys(width):
    assert _shapes(build_model("mobilenetv2_cifar", width=width)) == \
        _shapes(build_model("mobilenetv2", width=width))


def test_width_rounding_like_torchvision():
    # _make_divisible: 32*1.4=44.8 -> 48, 16*0.25=4 -> 8 (min one divisor), last 1280*1.4 -> 1792
    shapes = _shapes(build_model("mobilenetv2", width=1.4))
    assert shapes["features.0.0.weight"] == (48, 3, 3, 3)
    assert shapes["features.18.0.weight"][0] == 1792
    shapes = _shapes(build_model("mobilenetv2", width=0.25))
    assert shapes["features.1.conv.1.weight"] == (8, 8, 1, 1)
    assert shapes["features.18.0.weight"][0] == 1280  # last channel never shrinks


def test_init_like_torchvision():
    torch.manual_seed(0)
    m = build_model("mobilenetv2")
    assert torch.all(m.features[0][1].weight == 1) and torch.all(m.features[0][1].bias == 0)
    assert torch.all(m.classifier[1].bias == 0)
    assert m.classifier[1].weight.std().item() == pytest.approx(0.01, rel=0.05)
    conv = m.features[18][0]  # kaiming fan_out: std = sqrt(2 / (out * k * k))
    assert conv.weight.std().item() == pytest.approx((2 / 1280) ** 0.5, rel=0.05)


def test_same_seed_same_weights():
    torch.manual_seed(3)
    a = build_model("mobilenetv2_cifar", width=0.25).state_dict()
    torch.manual_seed(3)
    b = build_model("mobilenetv2_cifar", width=0.25).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- shapes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,width", [
    (n, w) for n in ("mobilenetv2_cifar", "mobilenetv2") for w in (0.25, 0.5, 1.0, 1.4)
] + [("squeezenet1_1", 1.0)])
def test_output_shape_channels_last(name, width):
    model = build_model(name, num_classes=10, width=width).eval()
    with torch.no_grad():
        assert model(_x()).shape == (2, 10)
        cl = model.to(memory_format=torch.channels_last)(_x())
    assert cl.shape == (2, 10) and torch.isfinite(cl).all()


@pytest.mark.parametrize("name,side", [("mobilenetv2_cifar", 4), ("mobilenetv2", 1),
                                       ("squeezenet1_1", 4)])
def test_feature_map_before_pooling(name, side):
    model = build_model(name).eval()
    with torch.no_grad():
        assert model.features(_x()).shape[-2:] == (side, side)


def test_num_classes_and_train_mode():
    model = build_model("squeezenet1_1", num_classes=7)
    assert model.training
    with torch.no_grad():
        assert model.eval()(_x(3)).shape == (3, 7)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mobilenetv2", num_classes=0)


# --- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,width,match", [
    ("mobilenetv2", 2.0, r"width=2.0 is out of range; MobileNetV2 takes 0.25..1.4"),
    ("mobilenetv2_cifar", 0.2, r"out of range; MobileNetV2 takes 0.25..1.4"),
    ("mobilenetv2", float("nan"), r"out of range"),
    ("squeezenet1_1", 0.5, r"squeezenet1_1 has no width multiplier; use width=1.0"),
    ("nope", 1.0, r"'nope' is unknown; choose one of mobilenetv2_cifar, mobilenetv2, squeezenet1_1"),
])
def test_check_width_refuses(name, width, match):
    with pytest.raises(ValueError, match=match):
        check_width(name, width)
    with pytest.raises(ValueError, match=match):
        build_model(name, width=width)


@pytest.mark.parametrize("name,width", [("mobilenetv2", 0.25), ("mobilenetv2_cifar", 1.4),
                                        ("squeezenet1_1", 1.0), ("squeezenet1_1", 1)])
def test_check_width_accepts(name, width):
    check_width(name, width)


def test_config_refuses():
    with pytest.raises(ConfigError, match="nope"):
        Config(model="nope")
    with pytest.raises(ConfigError, match="out of range"):
        Config(width=3.0)
    with pytest.raises(ConfigError, match="no width multiplier"):
        Config(model="squeezenet1_1", width=0.5)
    Config(model="mobilenetv2", width=0.25)


# --- learning --------------------------------------------------------------------------------
# SqueezeNet has no BatchNorm and ReLUs its logits (as torchvision): on noise it starts slowly and
# diverges at MobileNet's lr, so it gets a small lr and a weaker bar.
@pytest.mark.parametrize("name,width,lr,steps,ratio", [("mobilenetv2_cifar", 0.25, 0.01, 20, 0.5),
                                                       ("mobilenetv2", 0.5, 0.01, 20, 0.5),
                                                       ("squeezenet1_1", 1.0, 0.001, 40, 0.95)])
def test_overfits_fixed_batch(name, width, lr, steps, ratio):
    # TODO(lead): a real-image version once pilab.data lands.
    torch.manual_seed(0)
    x = _x(8)
    y = torch.arange(8) % 10
    model = build_model(name, num_classes=10, width=width).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < ratio * losses[0], losses


# --- FLOPs -----------------------------------------------------------------------------------
def test_flops_mobilenetv2_imagenet():
    # torchvision lists mobilenet_v2 at 0.30 GMACs for 224x224, i.e. 0.60 GFLOPs forward
    fwd = train_flops_per_image("mobilenetv2", 1.0, 1000, 224) / 3
    assert fwd == pytest.approx(0.6e9, rel=0.1)


def test_flops_plausible_at_32():
    f = {n: train_flops_per_image(n) for n in MODEL_NAMES}
    # stride 8 vs 32 on the same weights: ~16x the spatial work
    assert 10 < f["mobilenetv2_cifar"] / f["mobilenetv2"] < 20
    assert 1e8 < f["squeezenet1_1"] < 1e9
    assert train_flops_per_image("mobilenetv2_cifar", 0.5) < 0.5 * f["mobilenetv2_cifar"]
    assert train_flops_per_image("mobilenetv2_cifar") is f["mobilenetv2_cifar"]  # cached


@pytest.mark.parametrize("name,width,size", [(n, 1.0, 32) for n in MODEL_NAMES]
                         + [("mobilenetv2_cifar", 0.25, 32), ("squeezenet1_1", 1.0, 64)])
def test_flops_counted_for_any_model_agree_with_the_built_in_analytic_count(name, width, size):
    """Your own model's FLOPs are torch's FlopCounterMode count (issue 37); on the built-in models it must
    agree with their analytic count (hooks on every conv/linear) within 2%: the perfmodel prices both alike."""
    from pilab.models import counted_train_flops, probe_model

    analytic = train_flops_per_image(name, width, 10, size)
    counted = counted_train_flops(probe_model(name, num_classes=10, width=width, timesteps=None), size)
    assert counted == pytest.approx(analytic, rel=0.02)


def test_flops_leave_rng_alone():
    state = torch.get_rng_state()
    train_flops_per_image("mobilenetv2", 0.75, 10, 64)
    assert torch.equal(state, torch.get_rng_state())


def test_forward_macs_by_hand():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    assert forward_macs(model, 4) == 16 * 8 * 27 + 16 * 8 * 9 + 8 * 5
    assert model.training


def test_activation_elements_by_hand():
    # the CIFAR stem alone at width 0.25: a 3x3 conv to 8 channels, its BN and ReLU6, each writing
    # 8 x 32 x 32 elements; the whole network writes more, and width grows it less than FLOPs
    a = {w: activation_elements("mobilenetv2_cifar", w) for w in (0.25, 0.5, 1.0)}
    assert a[0.25] > 3 * 8 * 32 * 32
    assert 1.5 < a[0.5] / a[0.25] < 2.0
    flops = train_flops_per_image("mobilenetv2_cifar", 0.5) / train_flops_per_image("mobilenetv2_cifar", 0.25)
    assert flops > 2.5
    state = torch.get_rng_state()
    assert activation_elements("squeezenet1_1") > 0
    assert torch.equal(state, torch.get_rng_state())


def test_batch_renormalization_moves_a_small_group_to_the_running_statistics():
    # Ioffe 2017: with r = sigma_B / sigma and d = (mu_B - mu) / sigma inside their limits, a group's output
    # is what the running statistics give (as in evaluation) while its gradient still flows through the
    # group's own mean and variance; with limits (1, 0) it is plain BatchNorm on the group
    from pilab.engine.layers import use_batch_renorm, use_ghost_batchnorm
    torch.manual_seed(0)
    net = use_batch_renorm(use_ghost_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), ranks=1), start=2, full=4)
    bn = net[0]
    bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
    bn.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
    bn.weight.data.copy_(torch.tensor([1.5, 0.7, -0.3]))
    x = torch.randn(4, 3, 5, 5) * 1.2 + 0.4  # the group's statistics are near enough for the limits
    assert [bn.renorm_limits(t) for t in (0, 2, 3, 4, 9)] == [(1, 0), (1, 0), (2, 2.5), (3, 5), (3, 5)]
    expect = F.batch_norm(x, bn.running_mean.clone(), bn.running_var.clone(), bn.weight, bn.bias, False, 0.0, bn.eps)
    bn.num_batches_tracked.fill_(4)
    xg = x.clone().requires_grad_()
    y = net(xg)
    assert torch.allclose(y, expect, atol=1e-5)
    y.square().sum().backward()  # the group's statistics are in the graph: not evaluation's constant affine map
    direct = (2 * expect * bn.weight[None, :, None, None] / bn.running_var.add(bn.eps).sqrt()[None, :, None, None])
    assert not torch.allclose(xg.grad, direct, atol=1e-3)
    bn.num_batches_tracked.fill_(0)
    plain = F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    assert torch.allclose(net(x), plain, atol=1e-5)
    assert int(bn.num_batches_tracked) == 1
