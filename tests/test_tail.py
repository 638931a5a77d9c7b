"""The end of a step's exchange (issue 39 item 4): the last bucket cut small (``Config.bucket_tail_mb``) and
each bucket's parameters stepped as its average lands (``Config.step_as_landed``, ``optim.SubsetStep``).
Neither may change a number: the same losses bit for bit with and without them, on real ranks."""
import subprocess
import sys

import pytest
import torch

from conftest import MPIEXEC, mpi_env
from pilab import resultfile
from pilab.config import Config
from pilab.dist.buckets import bucket_assignment
from pilab.engine.optim import SubsetStep, build_optimizer
from pilab.models.zoo import build_model


def test_the_last_bucket_is_cut_into_tail_buckets():
    mib = 2 ** 20 // 4  # floats in a MiB
    numels = [mib // 2, mib // 2, mib // 4, mib // 8, mib // 8, mib // 8]
    assert bucket_assignment(numels, 1.0) == [[0, 1], [2, 3, 4, 5]]
    assert bucket_assignment(numels, 1.0, tail_mb=0.25) == [[0, 1], [2], [3, 4], [5]]
    assert bucket_assignment(numels, 1.0, tail_mb=1.0) == [[0, 1], [2, 3, 4, 5]]  # not smaller: not cut
    assert bucket_assignment(numels, 64.0, tail_mb=0.25) == [[0, 1, 2, 3, 4, 5]]  # one bucket stays one


@pytest.mark.parametrize("optimizer", ["sgd", "lars"])
def test_stepping_buckets_one_by_one_is_bitwise_one_step(optimizer):
    """SubsetStep over the parameters in any split and order, then rest(): the same parameters and
    momentum as optimizer.step(), to the bit, over several steps (the buffers are made on the first)."""
    cfg = Config(model="mobilenetv2", width=0.25, optimizer=optimizer, momentum=0.9, nesterov=True,
                 weight_decay=5e-4)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model("mobilenetv2", width=0.25))
    whole, parts = (build_optimizer(m, cfg, 0.1) for m in models)
    stepper = SubsetStep.of(parts)
    assert stepper is not None
    x = torch.randn(4, 3, 32, 32)
    for step in range(3):
        for m in models:
            m.zero_grad(set_to_none=False)
            torch.manual_seed(step)
            m(x).logsumexp(1).mean().backward()
        whole.step()
        params = [p for p in models[1].parameters()]
        for chunk in (params[50:90], params[::-7][:10], params[-3:]):  # overlapping: each stepped once
            stepper([p for p in chunk if id(p) not in stepper.done])
        stepper.rest()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)
            assert torch.equal(whole.state[a]["momentum_buffer"], parts.state[b]["momentum_buffer"])


def _losses(np_, out, *flags):
    cmd = [MPIEXEC, "-n", str(np_), sys.executable, "-m", "pilab", "train", "--width", "0.25",
           "--train-subset", "192", "--test-subset", "100", "--batch-size", "16", "--threads", "1", "--quiet",
           "--epochs", "2", "--bucket-mb", "0.2", "--momentum", "0.9", "--weight-decay", "5e-4", "--out", str(out),
           *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = resultfile.load(str(out / "result.json"))
    return r["steps"]["loss"], [e["test_loss"] for e in r["epochs"]]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_tail_buckets_and_early_steps_change_no_number(np_, tmp_path):
    """Under mpiexec: both on (traced too, whose wait notes each message's flight) against
    both off, the same per-step losses and test losses bit for bit."""
    off = _losses(np_, tmp_path / "off", "--bucket-tail-mb", "0", "--no-step-as-landed")
    on = _losses(np_, tmp_path / "on", "--bucket-tail-mb", "0.02", "--step-as-landed")
    traced = _losses(np_, tmp_path / "traced", "--bucket-tail-mb", "0.02", "--step-as-landed", "--trace")
    assert len(off[0]) == 2 * (192 // (16 * np_)) and on == off and traced == off
