"""Issue 54's few-step settings on a real model and real images, each against its own arithmetic: Muon
(``optimizer="muon"``, pilab/engine/optim.py), the warmup-stable-decay schedule and its extension from a
stable-phase checkpoint (``schedule="wsd"``), BatchNorm scales fixed at 1 (``freeze_bn_scale``), identity
convolutions (``dirac_init``), flip + translate test-time augmentation (``tta_translate``), batch
augmentation (``batch_aug``), and the weights' EMA whose decay follows the batch (``ema_epochs``).
All of them together train over real MPI ranks exactly as in the simulator, at np 2 and 3.

The MPI part launches ``mpiexec -n K python tests/test_fewstep.py OUT.json`` (this file is its own worker)."""
import math
import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpi_vs_sim import assert_same, launch, worker
from pilab import engine

# every new setting at once, on real CIFAR-10 images (the embedded subset): 15 steps an epoch at np=2
CFG = dict(width=0.25, train_subset=240, test_subset=100, batch_size=8, epochs=2, lr=0.02, lr_ref_batch=8,
           threads=1, seed=3, simulate_mode="exact", optimizer="muon", muon_lr=0.01, muon_on="conv+depthwise+head",
           freeze_bn_scale=True, bn_lr_scale=16.0, dirac_init=True, tta=True, tta_translate=True, schedule="wsd",
           decay_epochs=1.0, batch_aug=2, ema_epochs=0.5, label_smoothing=0.2, nesterov=True, bn_momentum=0.4)


def _real_grads(model, n=16):
    from pilab import data
    ds = data.load("embedded", train_subset=n, test_subset=10)
    x = data.to_input(torch.from_numpy(ds.x_train[:n]), ds.mean, ds.std)
    F.cross_entropy(model(x), torch.from_numpy(ds.y_train[:n]).long()).backward()


def test_muon_orthogonalises_nesterov_momentum_and_sgd_steps_the_rest_as_torch_does():
    from pilab.config import Config
    from pilab.engine.optim import NS_STEPS, orthogonalise
    from pilab.models.counts import muon_weights
    from pilab.perfmodel.layout import MUON_NS_STEPS
    from pilab.engine.optim import SGD, build_optimizer, param_groups, set_lr
    from pilab.models.zoo import build_model
    assert NS_STEPS == MUON_NS_STEPS == 3  # the performance model counts airbench's iterations
    s = torch.linalg.svdvals(orthogonalise(torch.randn(16, 96, generator=torch.Generator().manual_seed(0)) * 1e-3))
    assert 0.6 < s.min() and s.max() < 1.25  # ~U V^T whatever the scale: airbench's 3 quintic steps
    torch.manual_seed(0)
    model = build_model("mobilenetv2_cifar", width=0.25)
    ref = build_model("mobilenetv2_cifar", width=0.25)
    ref.load_state_dict(model.state_dict())
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    depthwise = [m for m in convs if m.groups > 1]
    assert len(muon_weights(model, "conv")) == len(convs) - len(depthwise) and depthwise
    assert len(muon_weights(model, "conv+depthwise+head")) == len(convs) + 1
    cfg = Config(width=0.25, optimizer="muon", muon_lr=0.2, lr=0.1, muon_momentum=0.6, momentum=0.85, nesterov=True,
                 bn_lr_scale=4.0)
    opt = build_optimizer(model, cfg, peak_lr=0.1 * 2)  # the rule doubled both
    sgd = SGD(param_groups(ref, cfg.weight_decay, bn_lr_scale=4.0), lr=0.2, momentum=0.85, nesterov=True,
              weight_decay=cfg.weight_decay)
    set_lr(sgd, 0.2)  # BatchNorm and biases at 4x
    chosen = {id(p) for p in muon_weights(model, "conv")}
    for step in range(2):  # the second step uses the momentum buffers
        model.zero_grad()
        _real_grads(model)
        for p, q in zip(model.parameters(), ref.parameters()):  # the same gradients for both
            q.grad = p.grad.clone()
        before = {id(p): p.detach().clone() for p in model.parameters()}
        grads = {id(p): p.grad.clone() for p in model.parameters()}
        opt.step()
        sgd.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            if id(p) not in chosen:  # BatchNorm, head: torch's SGD, bit for bit
                assert torch.equal(p, q)
    # the last step of one Muon weight, by hand: buf = 0.6 buf + g twice, Nesterov, rescaled to sqrt(rows)
    w = next(p for p in model.parameters() if id(p) in chosen and p.dim() == 4 and p.shape[1] > 1)
    buf = opt.state[w]["momentum_buffer"]
    u = grads[id(w)] + 0.6 * buf
    w0 = before[id(w)] * math.sqrt(w.shape[0]) / torch.linalg.vector_norm(before[id(w)])
    want = w0 - 0.4 * orthogonalise(u.reshape(w.shape[0], -1)).view_as(w)
    torch.testing.assert_close(w.detach(), want, rtol=1e-5, atol=1e-6)
    assert torch.linalg.vector_norm(w.detach() - w0) > 0.1  # it moved by lr x ~sqrt(min side), not by lr x |g|


def test_wsd_holds_the_peak_then_decays_and_a_longer_run_goes_on_from_the_stable_phase_bitwise(tmp_path):
    from pilab.config import Config, ConfigError
    from pilab.engine.checkpoint import CheckpointError
    from pilab.engine.optim import lr_at
    lrs = [lr_at(s, peak_lr=1.0, total_steps=10, warmup_steps=2, schedule="wsd", decay_steps=4) for s in range(10)]
    assert lrs == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25]
    cfg = Config(width=0.25, train_subset=160, test_subset=50, batch_size=16, epochs=3, threads=1, seed=1,
                 schedule="wsd", decay_epochs=1.0, warmup_epochs=0.5, ema_epochs=0.5, simulate_mode="exact")
    whole, whole_model = engine.fit(cfg, engine.VirtualRanks(2))  # 5 steps an epoch
    trunk = str(tmp_path / "trunk")  # a 2-epoch run, its epoch-1 checkpoint in the stable phase of both
    engine.fit(replace(cfg, epochs=2, out=trunk, checkpoint_every=1, keep=5), engine.VirtualRanks(2))
    longer, longer_model = engine.fit(replace(cfg, out=str(tmp_path / "b"),
                                              resume=os.path.join(trunk, "checkpoint-e0001.pt")), engine.VirtualRanks(2))
    assert longer["steps"]["lr"] == whole["steps"]["lr"][5:]
    assert longer["steps"]["loss"] == whole["steps"]["loss"][5:]
    assert [e["test_acc"] for e in longer["epochs"]] == [e["test_acc"] for e in whole["epochs"]]
    assert all(torch.equal(a, b) for a, b in zip(longer_model.state_dict().values(), whole_model.state_dict().values()))
    with pytest.raises(CheckpointError, match="different epochs"):  # epoch 2 is inside the 2-epoch run's decay
        engine.fit(replace(cfg, resume=os.path.join(trunk, "checkpoint-e0002.pt")), engine.VirtualRanks(2))
    with pytest.raises(CheckpointError, match="different epochs, schedule"):  # another schedule never
        engine.fit(replace(cfg, schedule="cosine", resume=os.path.join(trunk, "checkpoint-e0001.pt")),
                   engine.VirtualRanks(2))
    with pytest.raises(ConfigError, match="decay_epochs=3.0 exceed epochs=4"):
        Config(schedule="wsd", warmup_epochs=2, decay_epochs=3, epochs=4)


def test_frozen_scales_stay_1_dirac_convolutions_pass_their_input_and_the_shifts_take_their_lr():
    from pilab.config import Config, ConfigError
    from pilab.engine.backend import base_model
    cfg = Config(width=0.25, train_subset=160, test_subset=50, batch_size=16, epochs=1, threads=1,
                 freeze_bn_scale=True, bn_lr_scale=64.0, dirac_init=True, simulate_mode="exact")
    model = base_model(cfg, torch.device("cpu"))
    plain = base_model(replace(cfg, freeze_bn_scale=False, dirac_init=False), torch.device("cpu"))
    grown = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups == 1 and m.out_channels >= m.in_channels]
    assert len(grown) >= 10
    for m in grown:  # the first in-channels filters pass their input channel through; the others as built
        x = torch.randn(2, m.in_channels, 6, 6)
        y = F.conv2d(x, m.weight, None, 1, m.padding)
        torch.testing.assert_close(y[:, :m.in_channels], x)
    _, trained = engine.fit(cfg, engine.VirtualRanks(3))
    bns = [m for m in trained.modules() if hasattr(m, "running_mean") and getattr(m, "weight", None) is not None]
    assert len(bns) == 52 and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in bns)
    fast = base_model(replace(cfg, bn_momentum=0.4), torch.device("cpu"), ranks=3)  # the per-rank layers too
    assert {m.momentum for m in fast.modules() if hasattr(m, "running_mean")} == {0.4}
    assert all(not m.weight.requires_grad for m in bns)
    moved = [float((a.detach() - b.detach()).abs().max()) for a, b in zip((m.bias for m in bns), (
        m.bias for m in plain.modules() if hasattr(m, "running_mean")))]
    assert max(moved) > 0.05  # the shifts did train, at 64x the lr
    with pytest.raises(ConfigError, match="use one or the other"):
        Config(freeze_bn_scale=True, zero_init_residual=True)


def test_translate_tta_is_airbenchs_six_views_and_costs_three_times_flip_tta():
    from pilab import data
    from pilab.config import Config
    from pilab.engine.backend import tta_logits
    from pilab.models.zoo import build_model
    from pilab.perfmodel import predict
    torch.manual_seed(0)
    model = build_model("mobilenetv2_cifar", width=0.25).eval()
    ds = data.load("embedded", train_subset=10, test_subset=20)
    x = data.to_input(torch.from_numpy(ds.x_test[:8]), ds.mean, ds.std)
    with torch.no_grad():
        got = tta_logits(model, x, flip=True, translate=True)
        pad = F.pad(x, (1, 1, 1, 1), mode="reflect")
        views = [x, pad[:, :, :32, :32], pad[:, :, 2:, 2:]]
        pairs = [(model(v) + model(v.flip(3))) / 2 for v in views]
        torch.testing.assert_close(got, 0.5 * pairs[0] + 0.25 * pairs[1] + 0.25 * pairs[2])
        assert torch.equal(tta_logits(model, x, flip=True), pairs[0])  # flip TTA as before
        assert torch.equal(pad[:, :, 1:33, 1:33], x) and not torch.equal(pairs[1], pairs[0])
    flip, both = (predict(Config(width=0.25, tta=True, tta_translate=t), 4, "pi4b_cluster")["eval_time"]
                  for t in (False, True))
    assert both > 2.5 * flip


def test_batch_augmentation_trains_each_image_in_copies_and_counts_their_compute():
    from pilab import data
    from pilab.config import Config
    from pilab.engine.backend import forward_loss
    from pilab.models.zoo import build_model
    from pilab.perfmodel import predict
    ds = data.load("embedded", train_subset=64, test_subset=20)
    one = data.ShardLoader(ds, 2, 1, 8, seed=5)
    three = data.ShardLoader(ds, 2, 1, 8, seed=5, copies=3)
    x1, y1 = one.batch(0, 2)
    x3, y3 = three.batch(0, 2)
    assert x3.shape[0] == 24 and torch.equal(y3, y1)  # one label per image, three copies of it
    for i in range(8):  # each copy: the same image (its pixels' histogram) in its own crop and flip
        copies = x3[3 * i:3 * i + 3]
        assert len({c.sum().item() for c in copies}) > 1
        assert abs(float(copies[:, :, 8:24, 8:24].mean() - x1[i, :, 8:24, 8:24].mean())) < 0.5
    torch.manual_seed(0)
    model = build_model("mobilenetv2_cifar", width=0.25)
    cfg = Config(width=0.25, label_smoothing=0.1)
    torch.manual_seed(1)  # the classifier's dropout draws alike in both forwards
    out, loss = forward_loss(model, x3, y3, cfg, torch.device("cpu"))
    torch.manual_seed(1)
    full = model(x3)
    assert out.shape == (8, 10)
    torch.testing.assert_close(loss, F.cross_entropy(full, y3.repeat_interleave(3), label_smoothing=0.1))
    torch.testing.assert_close(out, full.view(8, 3, 10).mean(1))
    small = Config(width=0.25, train_subset=96, test_subset=40, batch_size=8, epochs=1, threads=1, batch_aug=2)
    exact, _ = engine.fit(replace(small, simulate_mode="exact"), engine.VirtualRanks(3))
    fast, _ = engine.fit(replace(small, simulate_mode="fast"), engine.VirtualRanks(3))  # several ranks per forward
    assert exact["steps"]["loss"][0] == pytest.approx(fast["steps"]["loss"][0], rel=1e-5)
    assert exact["epochs"][0]["train_acc"] <= 1.0
    plain, doubled = (predict(Config(width=0.25, batch_aug=k), 48, "pi4b_cluster")["time"] for k in (1, 2))
    assert doubled > 1.8 * plain  # the speed counts the copies' compute


def test_the_emas_decay_follows_the_batch_as_rho_to_the_kappa():
    """ema_epochs keeps the average's time constant in epochs, so a batch kappa times as large (kappa times
    fewer steps an epoch) gets the decay rho ** kappa: the same horizon in images at every np."""
    from pilab.config import Config
    from pilab.engine import Session, VirtualRanks
    cfg = Config(width=0.25, train_subset=480, test_subset=40, batch_size=8, epochs=1, threads=1, ema_epochs=0.5,
                 simulate_mode="fast")
    decay = {}
    for np_ in (1, 4):
        s = Session(cfg, VirtualRanks(np_))
        decay[np_] = next(c for c in s.components if c.name == "ema").avg.decay
    assert decay[4] == pytest.approx(decay[1] ** 4, rel=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_every_new_setting_over_mpi_ranks_equals_the_simulator(np_, tmp_path):
    r = launch(__file__, tmp_path / "fewstep.json", np_=np_)
    assert_same(r)
    assert r["mpi_loss"] != r["plain_loss"]  # ... and the settings acted


def _plain(cfg, comm, ds):
    """The same run with none of the new settings, on rank 0's simulator: it must differ."""
    if comm.Get_rank():
        return {}
    base = replace(cfg, optimizer="sgd", freeze_bn_scale=False, dirac_init=False, tta_translate=False,
                   schedule="cosine", batch_aug=1, bn_lr_scale=1.0, bn_momentum=0.1)
    return {"plain_loss": engine.fit(base, engine.VirtualRanks(comm.Get_size()), data=ds)[0]["steps"]["loss"]}


if __name__ == "__main__":
    from pilab.config import Config
    worker(Config(**CFG), sys.argv[1], extra=_plain)
