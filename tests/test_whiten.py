"""Config.whiten_stem: the first convolution starts as a whitening of the training images' patches."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from pilab import data
from pilab.config import Config, ConfigError
from pilab.engine.backend import base_model
from pilab.models.init import stem


def _patch_cov(conv, ds, x_uint8):
    """The covariance of the stem's filters' outputs over every patch of these images (no padding)."""
    x = data.to_input(torch.from_numpy(x_uint8), ds.mean, ds.std).contiguous()
    p = F.unfold(x, conv.kernel_size, stride=conv.stride).transpose(1, 2).reshape(-1, 27).double()
    out = p @ conv.weight.detach().reshape(conv.out_channels, -1).double().T
    return torch.cov(out.T)


def test_the_stem_whitens_images_it_never_saw_and_nothing_else_changes(cifar_archive):
    ds = data.load(str(cifar_archive), train_subset=2000, test_subset=500)
    cfg = Config(width=0.25, whiten_stem=True, seed=3)
    model = base_model(cfg, torch.device("cpu"), data=ds)
    plain = base_model(replace(cfg, whiten_stem=False), torch.device("cpu"), data=ds)
    conv, conv0 = stem(model), stem(plain)
    assert conv.out_channels == 8 and tuple(conv.kernel_size) == (3, 3)
    w = conv.weight.detach().reshape(8, -1)
    assert torch.equal(w[1::2], -w[0::2])  # +/- pairs, for the ReLU after it
    # on the test images (not the sample the filters came from), the + filters' outputs are decorrelated and
    # of unit variance: the largest principal directions, scaled -- a wrong layout (unfold's order against
    # the weight's) or a missing scale fails here; the default initialisation is nowhere near it
    cov = _patch_cov(conv, ds, ds.x_test)[0::2, 0::2]
    assert torch.all((cov.diagonal() > 0.75) & (cov.diagonal() < 1.33)), cov.diagonal()
    assert (cov - torch.diag(cov.diagonal())).abs().max() < 0.1, cov
    cov0 = _patch_cov(conv0, ds, ds.x_test)[0::2, 0::2]
    assert not torch.all((cov0.diagonal() > 0.75) & (cov0.diagonal() < 1.33))
    # only the stem's weights differ from the plain build; the same seed makes the same filters
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q) == (p is not conv.weight), name
    assert torch.equal(stem(base_model(cfg, torch.device("cpu"), data=ds)).weight, conv.weight)
    with pytest.raises(ConfigError, match="whiten_stem: the first convolution is made from the training images"):
        base_model(cfg, torch.device("cpu"))
