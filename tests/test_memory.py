"""Memory per rank (pilab.engine.memory): what the cuts keep identical, and the prediction against a real rank."""
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pilab import data
from pilab import engine
from pilab.engine import optim
from pilab.engine import virtual as engine_virtual
from pilab.engine import memory
from pilab.models import mobilenet
from pilab.models import zoo as models
from conftest import MPIEXEC, mpi_env
from pilab.config import Config, ConfigError


def _three_steps(relu6_forward=None):
    """Losses and final weights of 3 SGD steps of a small MobileNetV2-CIFAR on fixed random batches."""
    saved = mobilenet.ReLU6.forward
    if relu6_forward is not None:
        mobilenet.ReLU6.forward = relu6_forward
    try:
        torch.manual_seed(0)
        m = models.build_model("mobilenetv2_cifar", num_classes=10, width=0.25)
        m = m.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x = (3 * torch.randn(8, 3, 32, 32, generator=g)).to(memory_format=torch.channels_last)
            y = torch.randint(0, 10, (8,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in m.parameters()]
    finally:
        mobilenet.ReLU6.forward = saved


def test_relu6_that_saves_no_copy_gives_bitwise_the_same_training():
    ours = _three_steps()
    torchs = _three_steps(lambda self, x: nn.ReLU6.forward(self, x))  # autograd's in-place hardtanh_
    assert ours[0] == torchs[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], torchs[1]))


def test_relu6_saves_one_tensor_less_per_layer():
    m = models.build_model("mobilenetv2_cifar", num_classes=10, width=0.25)
    x = torch.randn(4, 3, 32, 32)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x).sum()
    elements = models.activation_elements("mobilenetv2_cifar", 0.25) * 4
    # conv inputs + BN inputs: ~2/3 of every leaf output (nn.ReLU6(inplace=True) kept ~3/3)
    assert sum(seen.values()) < 0.75 * 4 * elements


def _sgd_steps(opt_class, **kw):
    """Parameters and optimizer state after 3 steps of ``opt_class`` on a fixed small model."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    opt = opt_class([{"params": list(m[0].parameters()) + list(m[3].parameters()), "weight_decay": 5e-4},
                     {"params": list(m[1].parameters()), "weight_decay": 0.0}], lr=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(m(torch.randn(4, 3, 8, 8, generator=g)), torch.randint(0, 10, (4,), generator=g)).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()], opt


@pytest.mark.parametrize("kw", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True), dict(momentum=0.0)])
def test_pilab_sgd_is_torchs_sgd_bitwise(kw):
    ours, ours_opt = _sgd_steps(optim.SGD, **kw)
    torchs, torch_opt = _sgd_steps(torch.optim.SGD, **kw)
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))
    a, b = ours_opt.state_dict(), torch_opt.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for k, ours_state in a["state"].items():
        assert all(torch.equal(v, b["state"][k][n]) for n, v in ours_state.items() if v is not None)
    ours_opt.load_state_dict(b)  # checkpoints written with torch's SGD load as they are
    torch_opt.load_state_dict(a)


def test_training_never_imports_torch_dynamo(tmp_path):
    """torch's optimizer guards import torch._dynamo (and sympy, torch._inductor: ~70 MB per rank); a run
    that trains, checkpoints, resumes and evaluates with either optimizer, or simulates, imports neither;
    nor does the memory prediction `train --np`'s launcher makes, nor the performance model's layout
    (a meta-device model would: its initialisation and BatchNorm run through torch._refs)."""
    code = f"""
import sys
import time
from dataclasses import replace
from pathlib import Path
from pilab import engine
from pilab.config import Config
for opt in ("sgd", "lars"):
    out = {str(tmp_path)!r} + "/" + opt
    cfg = Config(width=0.25, batch_size=16, threads=1, epochs=2, max_steps=4, train_subset=128, test_subset=32,
                 out=out, optimizer=opt, checkpoint_every_steps=2)
    engine.fit(cfg, engine.MPIRanks(None))
    engine.fit(replace(cfg, max_steps=0, resume=out + "/checkpoint.pt"), engine.MPIRanks(None))
    engine.fit(replace(cfg, out=""), engine.VirtualRanks(2))
from pilab.engine import memory
from pilab import perfmodel
for model, width in (("mobilenetv2_cifar", 1.0), ("mobilenetv2", 0.5), ("squeezenet1_1", 1.0)):
    assert memory.predict_peak_bytes(Config(model=model, width=width), np_=2) > 0
    assert perfmodel.gradient_layout(model, width) and perfmodel.bn_bytes(model, width) >= 0
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_data_set_with_test_rows_holds_only_those_rows():
    n = 8_000  # 24.6 MB of test images
    g = np.random.default_rng(0)
    ds = data.CIFAR10.from_arrays(np.zeros((10, 32, 32, 3), np.uint8), np.zeros(10, np.int64),
                                  g.integers(1, 256, (n, 32, 32, 3), dtype=np.uint8), np.zeros(n, np.int64),
                                  source="random")
    rows = data.test_shard(n, 4, 1)
    before = _rss_bytes()
    share = ds.with_test_rows(rows)
    grown = _rss_bytes() - before
    quarter = ds.x_test[rows].nbytes
    assert grown < quarter + 8 * 2 ** 20, (grown, quarter)  # its rows (and a page or two around them)
    assert share.test_rows == rows and share.checksum == ds.checksum and len(share.y_test) == n
    assert np.array_equal(share.x_test[rows], ds.x_test[rows]) and not share.x_test[rows.stop:].any()


def test_evaluation_refuses_rows_a_data_set_does_not_hold():
    ds = data.load("embedded", train_subset=64, test_subset=40)
    model = models.build_model("mobilenetv2_cifar", num_classes=10, width=0.25)
    whole = engine.evaluate(model, ds, None, torch.device("cpu"), batch=20)
    held = ds.with_test_rows(slice(0, 40))
    assert engine.evaluate(model, held, None, torch.device("cpu"), batch=20) == whole
    with pytest.raises(data.DataError, match="holds test images 0..19 only"):
        engine.evaluate(model, ds.with_test_rows(slice(0, 20)), None, torch.device("cpu"), batch=20)


@pytest.mark.parametrize("name", ["mobilenetv2_cifar", "mobilenetv2", "squeezenet1_1", "spiking_cnn"])
@pytest.mark.parametrize("threads", [1, 2])
def test_evaluation_in_pieces_gives_bitwise_the_same_result(name, threads):
    # engine.evaluate runs an evaluation batch in pieces of at most EVAL_CHUNK images, so that its memory
    # does not grow with eval_batch: allowed only because the loss and accuracy stay bitwise those of one
    # forward per batch -- here on every model, with BatchNorm statistics that are not the initial ones,
    # for batches of 157 (4 pieces of 39-40), 1,000 (20 x 50) and a last batch of 7 (one piece).
    from pilab.config import EVAL_CHUNK
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = models.build_model(name, width=1.0 if name == "squeezenet1_1" else 0.25, timesteps=2)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
        model = model.to(memory_format=torch.channels_last)
        ds = data.load("embedded", train_subset=10, test_subset=1000)
        cpu = torch.device("cpu")
        for batch in (157, 1000):
            got = engine.evaluate(model, ds, None, cpu, batch=batch)
            # the reference: one forward per evaluation batch, as engine.evaluate did before the pieces
            model.eval()
            loss = correct = 0.0
            with torch.no_grad():
                for i in range(0, len(ds.y_test), batch):
                    x = data.to_input(torch.from_numpy(ds.x_test[i:i + batch]))
                    y = torch.from_numpy(ds.y_test[i:i + batch])
                    out = model(x)
                    loss += F.cross_entropy(out, y, reduction="sum").item()
                    correct += (out.argmax(1) == y).sum().item()
            model.train()
            assert got == (loss / len(ds.y_test), correct / len(ds.y_test)), (batch, got)
            assert batch > EVAL_CHUNK  # what is being tested: a batch the evaluation cuts into pieces
    finally:
        torch.set_num_threads(old)


def test_prediction_grows_with_batch_width_and_data():
    small = Config(width=0.25, batch_size=32, eval_batch=16)
    assert memory.predict_peak_bytes(small) < memory.predict_peak_bytes(replace(small, batch_size=128))
    assert memory.predict_peak_bytes(small) < memory.predict_peak_bytes(replace(small, width=1.0))
    # an evaluation batch runs in pieces of at most EVAL_CHUNK images: up to it the evaluation holds
    # more (with training's batch small enough not to be the peak), beyond it no more
    from pilab.config import EVAL_CHUNK
    tiny = replace(small, batch_size=2)
    assert memory.predict_peak_bytes(tiny) < memory.predict_peak_bytes(replace(tiny, eval_batch=EVAL_CHUNK))
    assert memory.predict_peak_bytes(replace(tiny, eval_batch=EVAL_CHUNK)) == \
        memory.predict_peak_bytes(replace(tiny, eval_batch=500))
    whole = Config(data="cifar10", eval_batch=16)
    assert memory.predict_peak_bytes(whole, np_=8) < memory.predict_peak_bytes(whole)
    parts = memory.breakdown(whole, np_=2)
    assert parts["peak"] == memory.predict_peak_bytes(whole, np_=2)


def test_node_memory_specs():
    assert memory.node_bytes("pi4b_4gb") == memory.NODE_MEMORY["pi4b_4gb"]
    assert memory.node_bytes("3500MB") == 3_500_000_000
    assert memory.node_bytes("4GiB") == 4 * 2 ** 30
    with pytest.raises(ConfigError, match="node memory"):
        memory.node_bytes("lots")
    cfg = Config(width=1.0, batch_size=32)
    assert memory.fit_warning(cfg, np_=2, ranks_per_node=2, node_bytes=memory.NODE_MEMORY["pi4b_8gb"]) is None
    line = memory.fit_warning(cfg, np_=2, ranks_per_node=2, node_bytes=memory.node_bytes("1GB"))
    assert line.startswith("pilab: warning: 2 rank(s) per node") and "\n" not in line


def test_eval_batch_is_validated():
    with pytest.raises(ConfigError, match="eval_batch"):
        Config(eval_batch=0)


TINY = ["--width", "0.25", "--train-subset", "256", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--max-steps", "2"]


OWN_MODELS = Path(__file__).parent / "own_models.py"  # models pilab does not define (issue 37)


@pytest.mark.mpi
@pytest.mark.parametrize("model,batch", [("mobilenetv2", 32), ("small_resnet", 32), ("bn1d_head", 32),
                                         ("small_resnet", 128)])
def test_prediction_within_15_percent_of_a_real_rank(tmp_path, model, batch):
    """Two real ranks, a few steps and an evaluation; every rank's measured peak RSS (VmHWM) against
    predict_peak_bytes for the same setting: for the registered MobileNetV2 (its constants measured) and two
    models pilab has never seen (their step's memory measured by engine.memory), small_resnet also at
    128 images a rank, where its allocator share is twice MobileNetV2's."""
    out = tmp_path / "mem.json"
    spec = model if model == "mobilenetv2" else f"{OWN_MODELS}:{model}"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "pilab.bench.memory", str(out), "--model", spec,
           "--width", "0.5", "--batch-size", str(batch), "--eval-batch", "50", "--threads", "1", "--steps", "2",
           "--train-subset", str(max(512, 4 * batch)), "--test-subset", "200"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    predicted = r["predicted"]["peak"]
    assert r["malloc"] == "fast"  # two such ranks fit this machine: malloc keeps freed memory
    if model == "mobilenetv2":  # your own model's probe measures afresh in this process: not bitwise the same
        assert predicted == memory.predict_peak_bytes(Config.from_dict(r["config"]), np_=2, allocator="fast")
    for rank in r["ranks"]:
        # The interpreter with torch imported is a property of the machine, not of the setting: CI's
        # runner measured 318 MB where this repository's bench machine measures 250 (RUNTIME_BYTES), so the
        # prediction is checked with the runtime this rank measured in place of the constant.
        here = predicted - memory.RUNTIME_BYTES + rank["runtime"]
        assert abs(here - rank["peak"]) <= 0.15 * rank["peak"], (predicted, here, rank)
        parts = ("runtime", "data", "model", "activations", "allocator")
        assert sum(rank[k] for k in parts) == rank["peak"]
        assert rank["activations"] > 0 and rank["model"] > 0 and rank["data"] > 256 // 2 * 3072


def test_your_own_models_step_memory_is_measured_once_and_only_where_needed():
    resnet, head = (Config(model=f"{OWN_MODELS}:{m}", width=0.5, batch_size=32, threads=1)
                    for m in ("small_resnet", "bn1d_head"))
    misses = memory.step_memory.cache_info().misses
    # a node with room to spare: the quick bound decides, no probe at a rank's start
    assert memory.choose_allocator(resnet, np_=2, ranks_per_node=2, node_bytes=64 * 2 ** 30) == "fast"
    assert memory.fit_warning(resnet, np_=2, ranks_per_node=2, node_bytes=64 * 2 ** 30) is None
    assert memory.step_memory.cache_info().misses == misses
    parts = {c.model: memory.breakdown(c, np_=2) for c in (resnet, head)}
    assert memory.step_memory.cache_info().misses == misses + 2
    memory.breakdown(replace(resnet, batch_size=256), np_=2)  # another batch: the same measurement
    assert memory.step_memory.cache_info().misses == misses + 2
    # per image, full-resolution 3x3 convolutions keep more than a conv stem with a BatchNorm1d head
    per_image = {m: (memory.breakdown(replace(c, batch_size=256), np_=2)["train_activations"]
                     - p["train_activations"]) / 224 for (m, p), c in zip(parts.items(), (resnet, head))}
    assert per_image[resnet.model] > per_image[head.model] > 0
    # registered models keep their measured constants: no probe
    memory.breakdown(Config(model="mobilenetv2", width=0.5), np_=2)
    assert memory.step_memory.cache_info().misses == misses + 2


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["--np", "mpiexec"])
def test_train_warns_before_launch_when_ranks_do_not_fit(tmp_path, how):
    args = [sys.executable, "-m", "pilab", "train", *TINY, "--quiet", "--node-memory", "0.5GB"]
    cmd = args + ["--np", "2"] if how == "--np" else [MPIEXEC, "-n", "2", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]  # a warning: the run still goes
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("pilab: warning: 2 rank(s) per node")]
    assert len(lines) == 1, p.stderr  # once, from rank 0 (or the launcher), not from every rank
    assert "exceeds the node's 0.50 GB" in lines[0]
    if how == "--np":  # before launch: the warning comes before the launch line
        assert p.stderr.index(lines[0]) < p.stderr.index("launching: ")


def test_train_refuses_a_bad_node_memory(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pilab", "train", "--node-memory", "lots"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "node memory 'lots' is not understood" in p.stderr
    assert "Traceback" not in p.stderr


def _memory_run(peak: float, eval_batch: int = 50) -> dict:
    """A pilab.bench.memory JSON in miniature: one rank's itemised peak at the study's setting."""
    items = {"runtime": 250e6, "data": 93e6, "model": 27e6, "activations": 430e6}
    rank = dict(items, allocator=peak - sum(items.values()), peak=peak,
                phases={"load": 400e6, "setup": 500e6, "train": peak, "eval": 600e6})
    cfg = Config(data="x.tar.gz", width=1.0, batch_size=32, threads=2, eval_batch=eval_batch, max_steps=3)
    return {"config": cfg.to_dict(), "np": 2, "steps": 3, "ranks": [rank], "predicted": {"peak": 860e6},
            "command": "mpiexec -n 2 python -m pilab.bench.memory OUT.json ..."}


def test_memory_report_shows_the_before_peak_beside_the_same_setting():
    from pilab.bench.report import memory_per_rank
    res = {"machine": {"date": "d", "cpu": "c"}, "goals": {"memory_peak_mb": ["<=", 900]},  # benchmarks/goals.json's
           "memory": {"data": "x.tar.gz", "rows": [_memory_run(860e6), _memory_run(1380e6, eval_batch=500)],
                      "table": [], "before": [dict(_memory_run(940e6), file="before-eval50.json")]}}
    lines = memory_per_rank(res)
    rows = [ln for ln in lines if ln.startswith("| width")]
    assert rows[0].endswith("| **860** (400 / 500 / 860 / 600) | 860 | met | 250 / 93 / 27 / 430 / 140: **940** |")
    assert rows[1].endswith("| NOT met | — |")  # no earlier run of eval batch 500 given
    assert any("`before-eval50.json`" in ln for ln in lines)
    res["memory"]["before"] = []
    assert all(ln.endswith("| met |") or ln.endswith("| NOT met |") for ln in memory_per_rank(res)
               if ln.startswith("| width"))
    # without goals (pilab has none of its own) the peaks are shown unjudged
    assert all(ln.endswith("| — |") for ln in memory_per_rank({**res, "goals": {}}) if ln.startswith("| width"))


def test_bench_refuses_a_before_file_that_does_not_exist(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pilab", "bench", "--sections", "memory", "--before", "nope.json"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "--before nope.json: no such file" in p.stderr and "Traceback" not in p.stderr


@contextlib.contextmanager
def _memory_cgroup(nbytes: int):
    """A memory cgroup of ``nbytes`` (v1 or v2) and the command prefix that starts a process in it; removed
    after. A real limit: a process that goes over it is killed by the kernel."""
    v1 = "/sys/fs/cgroup/memory"
    base = v1 if os.path.isdir(v1) else "/sys/fs/cgroup"
    path = os.path.join(base, f"pilab-test-{os.getpid()}")
    os.mkdir(path)
    try:
        knobs = ("memory.limit_in_bytes",) if base == v1 else ("memory.max", "memory.swap.max")
        for knob in knobs:
            if os.path.exists(os.path.join(path, knob)):
                with open(os.path.join(path, knob), "w") as f:
                    f.write(str(nbytes) if knob != "memory.swap.max" else "0")
        if base == v1 and os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            with open(os.path.join(path, "memory.memsw.limit_in_bytes"), "w") as f:
                f.write(str(nbytes))  # no swap beyond it either, where the kernel accounts swap
        yield ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"]
    finally:
        for _ in range(50):  # the process has ended; its pages may take a moment to leave the group
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a memory cgroup)")
def test_the_fast_simulator_fits_its_forward_to_the_memory_it_has(tmp_path):
    """np=48 x 32 images in one forward is predicted at ~8 GiB; in a 3 GiB memory cgroup the default mode
    (fast) takes fewer ranks per forward, says why in result.json, and is not killed; told to run all 48
    in one forward (--ranks-per-chunk 48, what the default did before), the kernel kills it there."""
    args = [sys.executable, "-m", "pilab", "simulate", "--np", "48", "--width", "0.25", "--batch-size", "32",
            "--train-subset", "1536", "--test-subset", "100", "--epochs", "1", "--max-steps", "1", "--threads", "2",
            "--quiet"]
    with _memory_cgroup(3 * 2 ** 30) as prefix:
        p = subprocess.run([*prefix, *args, "--out", str(tmp_path / "small")], capture_output=True, text=True,
                           timeout=600, env=mpi_env())
    assert p.returncode == 0, p.stdout + p.stderr  # -9: the kernel killed it (the forward did not fit)
    small = json.loads((tmp_path / "small" / "result.json").read_text())
    assert small["simulate_mode_used"] == "fast"
    assert small["ranks_per_chunk_why"] == "memory" and 1 <= small["ranks_per_chunk"] < 48
    # the limit is real: all 48 ranks in one forward (as before this choice) are killed in it
    with _memory_cgroup(3 * 2 ** 30) as prefix:
        p = subprocess.run([*prefix, *args, "--ranks-per-chunk", "48", "--out", str(tmp_path / "whole")],
                           capture_output=True, text=True, timeout=600, env=mpi_env())
    assert p.returncode in (-9, 137), (p.returncode, p.stderr[-2000:])
    assert engine_virtual.fitting_ranks(Config(width=0.25), 48, 32, free=24 * 2 ** 30) == 48  # a 24 GB machine
    assert engine_virtual.fitting_ranks(Config(width=0.25), 48, 32, free=0) == 48  # unknown: no limit
    assert 1 <= engine_virtual.fitting_ranks(Config(width=1.0), 48, 64, free=24 * 2 ** 30) < 48
