"""The large-batch toolbox's optimizer settings (pilab/engine/optim.py, pilab/models/init.py) on a real
model and real images: LAMB's layer-wise step, BatchNorm/bias learning-rate scale, residual blocks started
as the identity. Each checked against its paper's arithmetic, then trained through the loop."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pilab import data
from pilab.config import Config, ConfigError
from pilab import engine
from pilab.engine.backend import base_model
from pilab.engine.optim import LAMB, build_optimizer, param_groups, set_lr
from pilab.models.mobilenet import InvertedResidual
from pilab.models.init import residual_bns
from pilab.models.zoo import build_model


def _grads(model, n=16):
    """One real batch's gradients (the embedded CIFAR-10 subset, normalised as training does)."""
    ds = data.load("embedded", train_subset=n, test_subset=10)
    x = data.to_input(torch.from_numpy(ds.x_train[:n]), ds.mean, ds.std)
    F.cross_entropy(model(x), torch.from_numpy(ds.y_train[:n]).long()).backward()


def _is_weight(m, name):
    return name == "weight" and isinstance(m, (nn.Conv2d, nn.Linear))


def test_lamb_moves_each_weight_by_lr_times_its_norm_and_the_rest_as_adam():
    torch.manual_seed(0)
    model = build_model("mobilenetv2_cifar", width=0.25)
    _grads(model)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    grads = {id(p): p.grad.clone() for p in model.parameters()}
    lr = 1e-3
    LAMB(param_groups(model, 0.01), lr=lr).step()
    n_w = n_bn = 0
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            step = p.detach() - before[id(p)]
            if _is_weight(m, name):  # the trust ratio: ||step|| = lr ||w|| (You et al. 2020, eq. in Alg. 2)
                assert torch.linalg.vector_norm(step).item() == pytest.approx(
                    lr * torch.linalg.vector_norm(before[id(p)]).item(), rel=1e-4)
                n_w += 1
            else:  # BatchNorm, bias: Adam's first step, -lr g / (|g| + eps), no decay
                g = grads[id(p)]
                torch.testing.assert_close(step, -lr * g / (g.abs() + 1e-6), rtol=1e-4, atol=1e-7)  # p + step - p: float32 at |p| ~ 1
                n_bn += 1
    assert n_w > 50 and n_bn > 50


def test_bn_lr_scale_steps_batchnorm_and_biases_at_that_multiple_through_the_schedule():
    torch.manual_seed(0)
    model = build_model("mobilenetv2_cifar", width=0.25)
    _grads(model)
    cfg = Config(width=0.25, momentum=0.0, weight_decay=0.0, bn_lr_scale=4.0)
    opt = build_optimizer(model, cfg, peak_lr=0.1)
    set_lr(opt, 0.05)  # a step of the schedule keeps the ratio
    assert sorted(g["lr"] for g in opt.param_groups) == [0.05, 0.2]
    before = {id(p): p.detach().clone() for p in model.parameters()}
    opt.step()
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            lr = 0.05 if _is_weight(m, name) else 0.2
            torch.testing.assert_close(p.detach(), before[id(p)] - lr * p.grad, rtol=1e-6, atol=1e-7)


def test_zero_init_residual_starts_every_block_with_a_shortcut_as_the_identity():
    cfg = Config(width=0.25, zero_init_residual=True)
    model = base_model(cfg, torch.device("cpu"))
    blocks = [m for m in model.modules() if isinstance(m, InvertedResidual)]
    with_shortcut = [b for b in blocks if b.use_res_connect]
    assert len(residual_bns(model)) == len(with_shortcut) >= 10
    x = torch.randn(4, 3, 32, 32)
    for b in with_shortcut:  # x through the block is x: its last BatchNorm outputs its (zero) shift
        assert b.conv[-1].weight.abs().sum() == 0
        h = torch.randn(4, b.out_channels, 8, 8)
        assert torch.equal(b(h), h)
    plain = base_model(replace(cfg, zero_init_residual=False), torch.device("cpu"))
    assert not torch.equal(plain(x), model(x))
    # everything else as built: only those scales differ
    zeroed = {id(bn.weight) for bn in residual_bns(model)}
    for p, q in zip(model.parameters(), plain.parameters()):
        if id(p) not in zeroed:
            assert torch.equal(p, q)
    with pytest.raises(ConfigError, match="squeezenet1_1 has no residual blocks"):
        Config(model="squeezenet1_1", zero_init_residual=True)


def test_the_toolbox_together_trains_in_the_simulator_and_bad_combinations_are_refused():
    cfg = Config(width=0.25, train_subset=320, test_subset=200, batch_size=16, epochs=2, threads=1,
                 optimizer="lamb", lr=4e-3, lr_scaling="sqrt", warmup_epochs=0.5, weight_decay=0.01,
                 zero_init_residual=True, bn_lr_scale=2.0, lookahead_steps=5, whiten_stem=True,
                 simulate_mode="fast")
    result, _ = engine.fit(cfg, engine.VirtualRanks(4))
    loss = result["steps"]["loss"]
    assert all(map(lambda v: v == v, loss))  # finite
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3  # it learns
    with pytest.raises(ConfigError, match="LAMB has none"):
        Config(optimizer="lamb", nesterov=True)
    with pytest.raises(ConfigError, match=r"bn_lr_scale=0.0 must be > 0"):
        Config(bn_lr_scale=0)
