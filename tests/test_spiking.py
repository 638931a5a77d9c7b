"""The spiking CNN (``spiking_cnn``, snntorch's LIF neurons): layout and counts, BPTT, state reset per
batch, BatchNorm through time kept per rank, measured firing rates and synaptic operations, the optional
import, and exactness of the virtual-rank simulator against real ``mpiexec -n 2`` ranks.

    python -m pytest -q tests/test_spiking.py
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import MPIEXEC, mpi_env
from pilab import engine
from pilab.engine import layers
from pilab.config import Config, ConfigError
from pilab.models import (activation_elements, build_model, count_parameters, forward_macs, synaptic_ops,
                          train_flops_per_image)
from pilab.models.spiking import DEFAULT_TIMESTEPS, LIFLayer, SpikingConv, import_snntorch

torch.set_num_threads(1)
HERE = Path(__file__).parent


def _x(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 32, 32, generator=g) * 2 - 1).to(memory_format=torch.channels_last)


def _model(width=0.25, timesteps=DEFAULT_TIMESTEPS, seed=0):
    torch.manual_seed(seed)
    return build_model("spiking_cnn", width=width, timesteps=timesteps).to(memory_format=torch.channels_last)


# --- layout and counts -----------------------------------------------------------------------
def test_parameter_count_by_hand():
    # c = 32: convs 3->c, c->2c, 2c->4c, 4c->4c (3x3, no bias), 4 BNs (weight + bias), linear 4c->10
    c = 32
    convs = 9 * (3 * c + c * 2 * c + 2 * c * 4 * c + 4 * c * 4 * c)
    bns = 2 * (c + 2 * c + 4 * c + 4 * c)
    assert count_parameters(build_model("spiking_cnn")) == convs + bns + 4 * c * 10 + 10 == 242_474
    # LIF neurons have no parameters: beta and the threshold are fixed buffers
    assert not [n for n, _ in build_model("spiking_cnn").named_parameters() if "lif" in n]


def test_dense_work_grows_with_time_steps_except_the_encoder():
    m = {t: forward_macs(build_model("spiking_cnn", timesteps=t)) for t in (1, 2, 4)}
    # once per image: the encoder (the image is static: direct encoding) and the readout on rates
    once = 32 * 32 * 32 * 27 + 128 * 10
    per_step = m[1] - once
    assert m[2] == once + 2 * per_step and m[4] == once + 4 * per_step
    assert per_step == 9 * (16 * 16 * 32 * 64 + 8 * 8 * 64 * 128 + 8 * 8 * 128 * 128)
    # the performance model's per-image work: default T, and T passed through (measured on probe_model)
    assert train_flops_per_image("spiking_cnn") == 6.0 * m[DEFAULT_TIMESTEPS]
    assert train_flops_per_image("spiking_cnn", 1.0, timesteps=2) == 6.0 * m[2]
    assert activation_elements("spiking_cnn", 1.0, timesteps=8) > activation_elements("spiking_cnn", 1.0)


def test_performance_model_predicts_it_by_name():
    from pilab import perfmodel

    cfg = Config(model="spiking_cnn", width=0.5)
    fast = perfmodel.predict(Config(model="spiking_cnn", width=0.25), 4, "pi4b_cluster")
    slow = perfmodel.predict(cfg, 4, "pi4b_cluster")
    assert 0 < fast["time"] < slow["time"]


def test_width_and_timesteps_are_checked():
    with pytest.raises(ValueError, match=r"width=3.0 is out of range; spiking_cnn takes 0.25..2.0"):
        build_model("spiking_cnn", width=3.0)
    with pytest.raises(ValueError, match="timesteps=0 must be an int >= 1"):
        build_model("spiking_cnn", timesteps=0)
    with pytest.raises(ConfigError, match="timesteps=0 must be >= 1"):
        Config(model="spiking_cnn", timesteps=0)
    assert Config(model="spiking_cnn", width=2.0, timesteps=1).timesteps == 1
    assert Config().timesteps == DEFAULT_TIMESTEPS  # config.py cannot import models at load time
    # the engine builds it with the Config's time steps
    assert engine.base_model(Config(model="spiking_cnn", width=0.25, timesteps=3),
                             torch.device("cpu")).timesteps == 3


# --- training through time -------------------------------------------------------------------
def test_forward_backward_reaches_the_encoder_through_every_neuron_layer():
    model = _model()
    out = model(_x())
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    F.cross_entropy(out, torch.arange(4)).backward()
    # the surrogate gradient carries the loss back through four LIF layers and T steps
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_learns_a_fixed_batch():
    model = _model(width=0.5)
    x, y = _x(8), torch.arange(8) % 10
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0], losses


def test_membrane_state_resets_every_batch():
    model = _model()
    a, b = _x(4, seed=1), _x(4, seed=2)
    for mode in ("train", "eval"):
        getattr(model, mode)()
        with torch.no_grad():
            first = model(a)
            model(b)  # a different batch in between must leave nothing behind
            again = model(a)
        assert torch.equal(first, again), mode
    # no state is kept on the neurons after a forward (so the model deep-copies, and holds no graph)
    model.train()
    model(a).sum().backward()
    for m in model.modules():
        if isinstance(m, LIFLayer):
            assert m.neuron.mem.numel() == 0
    copy.deepcopy(model)


def test_batchnorm_through_time_sees_one_row_per_image():
    """tdBN: the BatchNorm2d input is (B, C, T*H, W), so its statistics span batch, time and space."""
    model, shapes = _model(timesteps=3), []
    hooks = [m.register_forward_pre_hook(lambda m, inp: shapes.append(tuple(inp[0].shape)))
             for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    model(_x(4))
    for h in hooks:
        h.remove()
    assert shapes[0] == (4, 8, 32, 32)  # the encoder: the static image once
    assert shapes[1:] == [(4, 16, 3 * 16, 16), (4, 32, 3 * 8, 8), (4, 32, 3 * 8, 8)]


def test_ghost_batchnorm_keeps_each_virtual_rank_to_its_own_images():
    # Two virtual ranks of 3 images in one forward: rank 0's outputs must not depend on rank 1's images
    # (a time-major (T*B) fold would put other ranks' images into rank 0's sub-batch).
    model = _model(timesteps=2)
    ctx = layers.RankContext(seed=0)
    layers.use_ghost_batchnorm(model, ranks=2, context=ctx)
    ctx.ranks = (0, 2)
    a, b1, b2 = _x(3, seed=1), _x(3, seed=2), _x(3, seed=3)
    with torch.no_grad():
        out1 = model(torch.cat([a, b1]))
        out2 = model(torch.cat([a, b2]))
    assert torch.equal(out1[:3], out2[:3])
    assert not torch.equal(out1[3:], out2[3:])
    # and rank 0's half equals a plain model (one rank) on rank 0's images alone
    plain = _model(timesteps=2)
    with torch.no_grad():
        assert torch.allclose(plain(a), out1[:3], atol=1e-6)


# --- firing rates and synaptic operations ----------------------------------------------------
def test_synaptic_ops_are_sane_and_exact():
    model, x = _model(width=0.5), _x(8)
    seen = {}
    hook = model.blocks[1].conv.register_forward_pre_hook(lambda m, inp: seen.setdefault("in", inp[0]))
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    ops = synaptic_ops(model, x, train=True)
    hook.remove()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in buffers.items())  # train=True: a copy
    assert ops["images"] == 8 and ops["timesteps"] == DEFAULT_TIMESTEPS
    assert ops["parameters"] == count_parameters(model)
    assert set(ops["firing_rates"]) == {"encoder.lif", "blocks.1.lif", "blocks.3.lif", "blocks.4.lif"}
    assert all(0.01 < r < 0.6 for r in ops["firing_rates"].values()), ops["firing_rates"]
    kinds = {layer["name"]: layer["kind"] for layer in ops["layers"]}
    assert kinds == {"encoder.conv": "macs", "blocks.1.conv": "synops", "blocks.3.conv": "synops",
                     "blocks.4.conv": "synops", "classifier": "macs"}
    assert ops["dense_macs_per_image"] == forward_macs(model)
    assert 0 < ops["synops_per_image"] < ops["dense_macs_per_image"]
    for layer in ops["layers"]:
        if layer["kind"] == "synops":  # ~ input firing rate x dense work (borders: a little less)
            assert 0.8 < layer["ops_per_image"] / (layer["input_rate"] * layer["dense_macs_per_image"]) <= 1.0
    # exact: each input spike reaches out_channels x (3x3 positions inside the map); count by unfold
    spikes = seen["in"]
    assert set(spikes.unique().tolist()) <= {0.0, 1.0}
    reach = F.unfold(spikes.contiguous(), 3, padding=1).ne(0).sum().item() * model.blocks[1].conv.out_channels
    assert ops["layers"][1]["ops_per_image"] == reach / 8


def test_synaptic_ops_eval_mode_and_refusals():
    model = _model()
    model.train()
    ops = synaptic_ops(model, _x())
    assert model.training  # mode restored
    assert ops["macs_per_image"] > 0 and ops["synops_per_image"] >= 0
    with pytest.raises(ValueError, match="no spiking neurons"):
        synaptic_ops(build_model("squeezenet1_1"), _x())


def test_snntorch_is_imported_only_for_the_spiking_model():
    code = ("import sys\n"
            "from pilab import engine\n"
            "from pilab.study import scaling\n"
            "from pilab.config import Config\n"
            "from pilab.models import build_model, train_flops_per_image\n"
            "build_model('mobilenetv2_cifar', width=0.25); Config(model='spiking_cnn')\n"
            "assert 'snntorch' not in sys.modules, 'imported early'\n"
            "build_model('spiking_cnn')\n"
            "assert 'snntorch' in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_missing_snntorch_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "snntorch", None)  # what `import snntorch` sees when absent
    with pytest.raises(ConfigError, match=r"needs snntorch, which is not installed: pip install 'pilab\[snn\]'"):
        Config(model="spiking_cnn")
    with pytest.raises(ValueError, match=r"pip install 'pilab\[snn\]'"):
        build_model("spiking_cnn")
    with pytest.raises(ImportError, match=r"pip install 'pilab\[snn\]'"):
        import_snntorch()
    Config(model="mobilenetv2_cifar")  # the other models do not care


def test_the_spiking_block_is_what_the_counts_treat_as_spike_driven():
    model = build_model("spiking_cnn")
    blocks = [m for m in model.modules() if type(m) is SpikingConv]
    assert len(blocks) == 3 and model.encoder not in blocks


# --- data parallel: the simulator equals real MPI ranks ----------------------------------------
@pytest.mark.mpi
def test_simulator_matches_mpi_ranks_for_the_spiking_model(tmp_path):
    out = tmp_path / "spiking.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(HERE / "mpi_worker.py"), "spiking", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["timesteps"] == 3
    assert r["ranks_bn_differ_before_sync"], "each rank's BN statistics come from its own images"
    assert max(r["per_rank_diff_before_sync"]) <= 1e-6, r["per_rank_diff_before_sync"]
    assert max(r["diff_after_run"]) <= 1e-6, r["diff_after_run"]
    assert r["params_moved_from_init"] > 1e-4  # it trained: equality is not two untouched models
    assert r["mpi_loss"] == pytest.approx(r["sim_loss"], abs=1e-6) and len(r["mpi_loss"]) == 4
    assert r["mpi_test_acc"] == r["sim_test_acc"]
