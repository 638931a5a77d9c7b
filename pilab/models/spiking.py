"""A small spiking CNN (``spiking_cnn`` in ``pilab.models.zoo``): leaky integrate-and-fire neurons from
snntorch (the optional extra ``pip install 'pilab[snn]'``, imported only when it is built), surrogate
gradient, direct input encoding, ``timesteps`` steps per image, BatchNorm through time; and
``synaptic_ops``, its measured firing rates and spike-driven operations.

    from pilab.models.spiking import SpikingCNN, synaptic_ops
    ops = synaptic_ops(build_model("spiking_cnn", width=0.5), images)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .counts import count_parameters
from .mobilenet import make_divisible
from .names import SNN_INSTALL_HINT

DEFAULT_TIMESTEPS = 4  # time steps a spiking model runs per image unless told otherwise


def import_snntorch():
    """snntorch and its surrogate module, imported only when a spiking model is built."""
    try:
        import snntorch
        from snntorch import surrogate
    except ImportError:
        raise ImportError(f"spiking_cnn needs snntorch, which is not installed: {SNN_INSTALL_HINT}") from None
    return snntorch, surrogate


def fold_time_into_height(x: torch.Tensor, t: int) -> torch.Tensor:
    """(B*T, C, H, W), image-major -> (B, C, T*H, W): a BatchNorm2d on it normalises each channel over
    batch, time and space (tdBN) while dim 0 stays one row per image, so a rank's images stay its own.
    A view when ``x`` is channels_last (what the engine feeds), a copy otherwise."""
    bt, c, h, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(bt // t, t * h, w, c).permute(0, 3, 1, 2)


def unfold_time(x: torch.Tensor, t: int) -> torch.Tensor:
    """(B, C, T*H, W) -> (B, T, C, H, W), the inverse of ``fold_time_into_height``."""
    b, c, th, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(b, t, th // t, w, c).permute(0, 1, 4, 2, 3)


class LIFLayer(nn.Module):
    """One snntorch ``Leaky`` neuron layer run over ``T`` steps of input current (B, T, C, H, W).

    U[t] = beta * U[t-1] + I[t] - theta * S[t-1];  S[t] = H(U[t] - theta), with theta = 1 and an
    arctan surrogate gradient (snntorch's default, Fang et al. 2021) standing in for dH/dU in
    backprop through time. The membrane starts at zero on every call: state never carries from one
    batch to the next.
    """

    def __init__(self, beta: float):
        super().__init__()
        snn, surrogate = import_snntorch()
        device = torch.empty(0).device  # where the model is being built (the default device's context)
        with torch.device("cpu"):  # Leaky's constructor reads a buffer back (.item()): not on meta
            self.neuron = snn.Leaky(beta=beta, threshold=1.0, spike_grad=surrogate.atan(),
                                    reset_mechanism="subtract")
        self.neuron.to(device)
        # snntorch lists every neuron ever built (for its init_hidden=True helpers, unused here: the
        # state is passed explicitly); leaving ours there would keep discarded models alive.
        instances = getattr(snn.SpikingNeuron, "instances", [])
        if self.neuron in instances:
            instances.remove(self.neuron)

    def forward(self, current: torch.Tensor) -> torch.Tensor:
        mem = torch.zeros_like(current[:, 0])  # reset per batch
        spikes = []
        for t in range(current.shape[1]):
            spk, mem = self.neuron(current[:, t], mem)
            spikes.append(spk)
        # Drop the state snntorch keeps on the module: it is not ours to carry, and a tensor with a
        # graph there would make the model impossible to deepcopy.
        self.neuron.mem = self.neuron.reset = current.new_zeros(0)
        # Stacked as (B, T, H, W, C) in memory, so the (B*T, C, H, W) the next conv sees is a
        # channels_last view: elementwise ops and convs on mixed layouts are 10-30x slower on a CPU.
        return torch.stack([s.permute(0, 2, 3, 1) for s in spikes], 1).permute(0, 1, 4, 2, 3)


class SpikingConv(nn.Module):
    """Conv 3x3 (no bias) -> BatchNorm through time (tdBN) -> LIF, on image-major (B*T, C, H, W)."""

    def __init__(self, inp: int, oup: int, timesteps: int, beta: float):
        super().__init__()
        self.timesteps = timesteps
        self.conv = nn.Conv2d(inp, oup, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(oup)
        self.lif = LIFLayer(beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.timesteps
        cur = unfold_time(self.bn(fold_time_into_height(self.conv(x), t)), t)
        return self.lif(cur).flatten(0, 1)  # spikes, (B*T, C, H, W)


class SpikingEncoder(SpikingConv):
    """Direct (analog) input encoding: the first conv + BN see the image once, and its current drives
    the first LIF layer at every step (the input is static, so T copies would normalise the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cur = self.bn(self.conv(x))
        return self.lif(cur.unsqueeze(1).expand(-1, self.timesteps, -1, -1, -1)).flatten(0, 1)


class SpikingCNN(nn.Module):
    """A small VGG-style spiking CNN for 32x32 images, trained with backprop through time.

    encoder conv(3->c) @32 -> maxpool -> conv(c->2c) @16 -> maxpool -> conv(2c->4c) @8 ->
    conv(4c->4c) @8 -> maxpool -> global average of the spikes over space and time -> linear.
    c = 32 x width (rounded to a multiple of 8). Every conv but the encoder sees binary spikes
    (max-pooling spikes keeps them binary), so its work is spike-driven accumulates (``synaptic_ops``).
    The logits are the time-averaged readout of the last layer's firing rates.

    BatchNorm is tdBN (Zheng et al., AAAI 2021): statistics per channel over batch, T and space,
    shared by all steps, one running-statistics update per batch. The time axis is folded into the
    height of a BatchNorm2d's input, so dim 0 is still one image per row: ghost/virtual-rank BN
    (``layers.GhostBatchNorm2d`` splits dim 0 by rank) and ``SyncBatchNorm`` work unchanged.
    """

    def __init__(self, num_classes: int = 10, width: float = 1.0, timesteps: int = DEFAULT_TIMESTEPS,
                 beta: float = 0.5, in_channels: int = 3):
        super().__init__()
        c = make_divisible(32 * width)
        self.timesteps = timesteps
        self.encoder = SpikingEncoder(in_channels, c, timesteps, beta)
        self.blocks = nn.Sequential(
            nn.MaxPool2d(2),
            SpikingConv(c, 2 * c, timesteps, beta),
            nn.MaxPool2d(2),
            SpikingConv(2 * c, 4 * c, timesteps, beta),
            SpikingConv(4 * c, 4 * c, timesteps, beta),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(4 * c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # channels_last throughout (the engine's layout): the time folds below are then views
        spikes = self.blocks(self.encoder(x.contiguous(memory_format=torch.channels_last)))
        rates = spikes.mean((2, 3)).unflatten(0, (x.shape[0], self.timesteps)).mean(1)
        return self.classifier(rates)


def synaptic_ops(model: nn.Module, x: torch.Tensor, *, train: bool = False) -> dict:
    """Spike activity of a spiking model on a real batch ``x``, measured with hooks: firing rates
    per neuron layer and the synaptic operations (SynOps) the spikes drive, per image.

        model = build_model("spiking_cnn", width=0.5)            # or the trained model of a run
        ops = synaptic_ops(model, images)                         # images: (N, 3, 32, 32)
        ops["synops_per_image"], ops["firing_rates"]["blocks.1.lif"]
        energy.neuromorphic_energy(ops)                           # joules per image, cited figures

    A conv fed by spikes (every conv of a ``SpikingConv`` block; checked to be 0/1) does one
    accumulate per (input spike, synapse it reaches):
    counted exactly, borders included, as a convolution of the spike map with a kernel of ones, times
    the output channels. A layer with analog input (the encoder, which sees the image, and the
    readout on firing rates) does dense multiply-accumulates, counted as in ``forward_macs``.
    ``dense_macs_per_image`` is what the same network costs evaluated densely, every step.

    Runs without gradients in eval mode (BN running statistics), or with ``train=True`` on a copy in
    train mode (batch statistics; the model's buffers are left as they were).
    """
    was_training = model.training
    net = model
    if train:
        import copy

        net = copy.deepcopy(model).train()
    else:
        model.eval()
    meter = _SpikeMeter(net)
    handles = [m.register_forward_hook(meter.weights) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    handles += [m.register_forward_hook(meter.neurons) for m in net.modules() if isinstance(m, LIFLayer)]
    try:
        with torch.no_grad():
            net(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not meter.fired:
        raise ValueError(f"{type(model).__name__} has no spiking neurons (LIFLayer); "
                         "synaptic_ops is for spiking models such as spiking_cnn")
    return meter.summary(model, x.shape[0])


class _SpikeMeter:
    """What ``synaptic_ops``' hooks record: per weight layer its operations (SynOps where its input is
    spikes, dense MACs otherwise), per neuron layer the spikes it fired."""

    def __init__(self, net: nn.Module):
        self.names = {m: n for n, m in net.named_modules()}
        # the convs behind a neuron layer (not the encoder's, which sees the image)
        self.spike_driven = {blk.conv for blk in net.modules() if type(blk) is SpikingConv}
        self.layers, self.fired = [], {}

    def weights(self, m, inp, out):
        a = inp[0]
        binary = m in self.spike_driven
        if binary and not bool(((a == 0) | (a == 1)).all()):
            raise ValueError(f"{self.names[m]} should see spikes (0/1) but its input is analog")
        if isinstance(m, nn.Conv2d):
            dense = out.numel() * m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
            if binary:
                g = m.groups
                ones = a.new_ones(g, m.in_channels // g, *m.kernel_size)
                # per output position and group: the input spikes in its receptive field
                reach = F.conv2d((a != 0).to(a.dtype), ones, None, m.stride, m.padding, m.dilation, g)
                ops = float(reach.sum()) * (m.out_channels // g)
        else:
            dense = out.numel() * m.in_features
            if binary:
                ops = float((a != 0).sum()) * m.out_features
        self.layers.append({"name": self.names[m], "kind": "synops" if binary else "macs",
                            "ops": ops if binary else float(dense), "dense_macs": float(dense),
                            "input_rate": float((a != 0).float().mean()) if binary else None})

    def neurons(self, m, inp, out):
        spikes, n = self.fired.get(self.names[m], (0.0, 0))
        self.fired[self.names[m]] = (spikes + float(out.sum()), n + out.numel())

    def summary(self, model: nn.Module, b: int) -> dict:
        layers, fired = self.layers, self.fired
        for layer in layers:
            layer["ops_per_image"] = layer.pop("ops") / b
            layer["dense_macs_per_image"] = layer.pop("dense_macs") / b
        return {
            "images": b, "timesteps": getattr(model, "timesteps", None), "parameters": count_parameters(model),
            "synops_per_image": sum(layer["ops_per_image"] for layer in layers if layer["kind"] == "synops"),
            "macs_per_image": sum(layer["ops_per_image"] for layer in layers if layer["kind"] == "macs"),
            "dense_macs_per_image": sum(layer["dense_macs_per_image"] for layer in layers),
            "firing_rates": {name: s / n for name, (s, n) in fired.items()},
            "mean_firing_rate": sum(s for s, _ in fired.values()) / sum(n for _, n in fired.values()),
            "layers": layers,
        }
