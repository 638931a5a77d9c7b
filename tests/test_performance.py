"""Behaviour of the performance options of issue 12 (never timings): gradients as bucket views, the
metrics riding with the last bucket, the device-resident data path, vectorised ghost BatchNorm, the
simulator's fast mode and deferred metrics, the GPU check's code path on a CPU, the bench command."""
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pilab import data as data_mod
from pilab import engine
from pilab.config import Config, ConfigError
from pilab.dist import GradSync
from pilab.engine.layers import GhostBatchNorm2d, RankContext

ROOT = Path(__file__).resolve().parent.parent


class TwinComm:
    """A two-rank communicator whose other rank holds exactly this rank's values: Iallreduce(SUM)
    doubles the buffer and completes at once (enough to drive GradSync's bookkeeping in one process)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Iallreduce(self, _inplace, buf, op=None):
        from mpi4py import MPI
        arr = buf[0] if isinstance(buf, list) else buf
        arr *= 2
        return MPI.Request()  # a null request: Testall/Waitall see it complete


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10)).to(memory_format=torch.channels_last)


def _grads_after(sync_kwargs, replace_grad=False):
    pytest.importorskip("mpi4py")
    model = _net()
    sync = GradSync(model, TwinComm(), bucket_mb=0.001, meta=2, **sync_kwargs)
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 1, 2, 3])
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    if replace_grad:
        model[0].weight.grad = None  # someone dropped a gradient: it must be re-pointed at its slot
    sync.begin(0.0)
    sync.meta[:2] = (1.5, 3.0)
    F.cross_entropy(model(x), y).backward()
    stats = sync.finish()
    return model, sync, stats


def test_gradients_are_views_into_the_buckets_and_average_right():
    torch.manual_seed(1)
    ref = _net()
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    F.cross_entropy(ref(x), torch.tensor([0, 1, 2, 3])).backward()
    views, sync, stats = _grads_after({})
    dropped, _, _ = _grads_after({}, replace_grad=True)
    assert stats.buckets > 1
    storages = {b.flat.untyped_storage().data_ptr() for b in sync.buckets}
    for pv, pd in zip(views.parameters(), dropped.parameters()):
        assert pv.grad.untyped_storage().data_ptr() in storages  # the gradient lives in a bucket
        assert pv.grad.stride() == pv.stride()  # with the parameter's own layout (channels_last)
        assert torch.equal(pv.grad, pd.grad)
    # both twins hold the same gradient, so the average is this rank's own gradient
    for pv, pr in zip(views.parameters(), ref.parameters()):
        torch.testing.assert_close(pv.grad, pr.grad)


def test_metrics_ride_with_the_last_bucket():
    _, sync, stats = _grads_after({})
    assert sync.meta[0] == 3.0 and sync.meta[1] == 6.0  # summed over the two (identical) ranks
    assert sync.meta[2] > 0 and sync.meta[3] == 0.0  # rank 0's ready time in its own slot
    assert stats.ready >= stats.posts[-1]


def test_one_process_step_metrics_come_from_meta():
    cfg = Config(width=0.25, batch_size=8, train_subset=64, test_subset=20, threads=1, epochs=1)
    s = engine.Session(cfg, engine.MPIRanks(None))
    st, _ = s.step(0, 0)
    assert np.isfinite(st.loss_sum) and 0 <= st.correct <= 8 and st.stop_votes == 0
    assert st.comm_wait == 0.0 and st.compute > 0
    stopped, _ = s.step(0, 1, stop=lambda: True)
    assert stopped.stop_votes == 1


@pytest.mark.parametrize("policy", ["static", "reshuffle"])
@pytest.mark.parametrize("augment", [True, False])
def test_device_resident_loader_gives_the_same_batches(policy, augment):
    ds = data_mod.load("embedded")
    a = data_mod.ShardLoader(ds, 3, 1, 16, seed=2, policy=policy, augment=augment)
    b = data_mod.ShardLoader(ds, 3, 1, 16, seed=2, policy=policy, augment=augment, device="cpu")
    for epoch in (0, 1):
        for step in (0, 7, a.steps_per_epoch - 1):
            xa, ya = a.batch(epoch, step)
            xb, yb = b.batch(epoch, step)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            assert xb.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("ghost", [0, 4])
def test_vectorised_ghost_batchnorm_matches_per_group_batchnorm(ghost, layout):
    """Both vectorised paths: the simulator's channels-last batch (GroupedBN, its own backward) and any
    other layout (var_mean and autograd)."""
    torch.manual_seed(0)
    ctx = RankContext()
    ctx.ranks = (0, 6)
    bn = nn.BatchNorm2d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    exact, fast = GhostBatchNorm2d(bn, 6, ghost, ctx), GhostBatchNorm2d(bn, 6, ghost, ctx)
    x = (torch.randn(48, 5, 7, 7) * 3 + 1).contiguous(memory_format=layout)
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye = exact(xe)
    ctx.vectorised = True
    yf = fast(xf)
    g = torch.randn_like(ye)
    (ye * g).sum().backward()
    (yf * g).sum().backward()
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(yf, ye, **tol)
    torch.testing.assert_close(xf.grad, xe.grad, **tol)
    torch.testing.assert_close(fast.weight.grad, exact.weight.grad, **tol)
    torch.testing.assert_close(fast.running_mean, exact.running_mean, **tol)
    torch.testing.assert_close(fast.running_var, exact.running_var, **tol)
    assert yf.is_contiguous(memory_format=layout)
    assert int(fast.num_batches_tracked) == int(exact.num_batches_tracked) == 1


def test_simulate_mode_is_validated_and_auto_picks_what_the_run_allows():
    from pilab.engine import mode_used
    assert Config().simulate_mode == "auto"
    assert mode_used(Config()) == "fast"  # the same mathematics at one process's cost
    # a component that needs each rank's own weights (local SGD) or gradient (the noise-driven batch ramp)
    # says so (per_rank); the simulator built for such a run takes the exact mode
    assert mode_used(Config(), per_rank=True) == "exact"
    small = dict(width=0.25, train_subset=256, test_subset=20, threads=1, epochs=1)
    for cfg in (Config(local_steps=4, **small), Config(batch_ramp="gns:64", **{**small, "batch_size": 8})):
        assert engine.Session(cfg, engine.VirtualRanks(4)).ranks.mode == "exact", cfg
    assert mode_used(Config(simulate_mode="exact")) == "exact"
    assert Config(simulate_mode="fast").simulate_mode == "fast"
    with pytest.raises(ConfigError, match="simulate_mode"):
        Config(simulate_mode="quick")


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("compile_bn", ["off", "on"])
def test_fast_mode_stays_close_to_exact_at_np48(compile_bn):
    """The documented deviation (docs/simulator.md): from the same start at np=48 the fast mode computes
    the same first loss, its first update is within a few percent of the exact one (float summation
    order only; BatchNorm over 2 images per rank amplifies it, as it does for several ranks per forward
    in exact mode), and the loss trajectory stays close -- with its BatchNorm eager, and compiled
    (compile_bn=on: the layers of 1M+ activations, here those at 32 x 32 pixels, run torch.compile's kernels)."""
    from pilab.engine import compilebn
    cfg = Config(width=0.25, batch_size=2, train_subset=480, test_subset=20, threads=1, epochs=1, lr=0.05,
                 lr_ref_batch=64, compile_bn=compile_bn)
    runs = {}
    for mode in ("exact", "fast"):
        s = engine.Session(replace(cfg, simulate_mode=mode), engine.VirtualRanks(48))
        if mode == "fast":
            assert s.ranks.context.compiled_from == (compilebn.MIN_ELEMENTS if compile_bn == "on" else None)
            assert 96 * 16 * 32 * 32 >= compilebn.MIN_ELEMENTS  # the first layers' activations: compiled
        w0 = _params(s.model).clone()
        first = s.step(0, 0)[0].loss_sum
        w1 = _params(s.model).clone()
        losses = [first] + [s.step(0, k)[0].loss_sum for k in range(1, 4)]
        runs[mode] = (w1, losses, s.ranks.chunk)
    assert runs["exact"][2] == 1 and runs["fast"][2] == 48  # one forward for all 48 ranks
    assert runs["fast"][1][0] == pytest.approx(runs["exact"][1][0], rel=1e-5)
    moved = (runs["exact"][0] - w0).norm()
    assert (runs["fast"][0] - runs["exact"][0]).norm() <= 0.05 * moved
    np.testing.assert_allclose(runs["fast"][1], runs["exact"][1], rtol=2e-2)


def test_deferred_metrics_stay_tensors_and_equal_the_plain_ones():
    cfg = Config(width=0.25, batch_size=4, train_subset=64, test_subset=20, threads=1, epochs=1)
    plain = engine.Session(cfg, engine.VirtualRanks(2))
    deferred = engine.Session(cfg, engine.VirtualRanks(2, defer_metrics=True))
    a, _ = plain.step(0, 0)
    b, _ = deferred.step(0, 0)
    assert isinstance(b.loss_sum, torch.Tensor) and isinstance(b.correct, torch.Tensor)
    assert float(b.loss_sum) == pytest.approx(a.loss_sum, rel=1e-6)
    assert float(b.correct) == a.correct


def test_gpu_check_runs_its_code_path_on_a_cpu(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    out = gpu_check.main(["--device", "cpu", "--data", "embedded", "--epochs", "1", "--train-subset", "128",
                          "--test-subset", "40", "--nps", "1,2", "--batch", "8", "--width", "0.25",
                          "--out", str(tmp_path / "g.json")])
    assert [r["np"] for r in out["runs"]] == [1, 2]
    for r in out["runs"]:
        assert 0 <= r["final_test_acc"] <= 1 and r["train_s"] > 0
    assert (tmp_path / "g.json").exists()


def test_bench_pieces_on_tiny_settings(tmp_path):
    from pilab.bench import local, stats
    from pilab.bench.report import markdown_report
    s = stats.alternate({"a": lambda: None, "b": lambda: None}, rounds=5)
    assert [len(v) for v in s.values()] == [5, 5]
    assert stats.summary([1.0, 2.0, 3.0])["median"] == 2.0 and stats.summary([])["n"] == 0
    d = local.data_path(8, rounds=2, batches=1)
    assert d["speedup_pilab_over_dataloader"]["n"] == 2
    res = {"quick": True, "command": "x", "machine": {"cpu": "c", "cpu_count": 2, "usable_cores": 2, "platform": "p",
           "python": "3", "torch": torch.__version__, "date": "d", "loadavg_start": [0, 0, 0]}, "data": d}
    text = markdown_report(res)
    assert "DataLoader" in text and "GPU" in text
    c = local.cache("embedded", rounds=2)
    assert c["reload_speedup"]["n"] == 2 and c["images"] > 0
    assert "cached reload" in markdown_report({**res, "cache": c})
    cli = local.cli_startup(rounds=2, repeat=1)  # `python -m pilab --help` against `python -c pass`
    assert cli["help_over_python"]["n"] == 2 and cli["seconds"]["help"]["median"] > 0
    assert "| ratio `--help` / `python -c pass` |" in markdown_report({**res, "cli": cli})
    sim = local.simulator([("mobilenetv2_cifar", 0.25, 2, 3)], rounds=2, threads=1)  # each mode vs the global batch
    row = sim["rows"][0]
    assert row["ratio"]["fast"]["n"] == row["ratio"]["exact"]["n"] == 2 and set(row["met"]) == {"fast", "exact"}
    # the CPU clock beside the wall one, the same rounds: a step's CPU time is real work, never zero
    assert row["ratio_cpu"]["fast"]["n"] == 2 and min(row["raw_cpu"]["global"]) > 0
    assert set(row["met_cpu"]) == {"fast", "exact"}
    assert "| mobilenetv2_cifar 0.25 | 2 × 3 |" in markdown_report({**res, "simulator": sim})


@pytest.mark.mpi
def test_the_sync_section_runs_its_two_jobs(tmp_path):
    # bench_comm's strategies, now one section: each job keeps its own baseline (a) to divide by.
    from pilab.bench import suite as bench
    from pilab.bench.report import markdown_report
    res = bench.run(quick=True, sections=("sync",), out=str(tmp_path), markdown=str(tmp_path / "B.md"), log=lambda s: None)
    default, asynchronous = res["sync"]["default"], res["sync"]["async_progress"]
    assert [r["variant"] for r in default["rows"]] == ["a", "b", "c", "fp16"]
    assert [r["variant"] for r in asynchronous["rows"]] == ["a", "e"] and asynchronous["async_progress"]
    assert default["rows"][0]["step_vs_a"]["median"] == 1.0
    fp16 = next(r for r in default["rows"] if r["variant"] == "fp16")
    assert fp16["bytes_per_step"] * 2 == default["rows"][0]["bytes_per_step"]  # half the bytes
    assert "e: GradSync async progress" in markdown_report(res)


def test_the_network_section_without_a_testbed_is_skipped_with_one_line(tmp_path, monkeypatch):
    from pilab.bench import suite as bench
    from pilab.bench import network
    monkeypatch.setattr(network, "unavailable", lambda: "the testbed needs root (…): run it with sudo")
    said = []
    res = bench.run(sections=("network",), out="", markdown=None, log=said.append)
    assert said == ["bench: network skipped: the testbed needs root (…): run it with sudo"]
    assert "network" not in res and res["sections"] == []


def test_bench_writes_into_out_and_leaves_the_trees_report_alone(tmp_path):
    """`pilab bench` run in a tree with a BENCHMARKS.md (as pilab's own) writes its report into --out only;
    --from puts a report together from saved runs without running anything."""
    (tmp_path / "BENCHMARKS.md").write_text("the tree's report\n")
    p = subprocess.run([sys.executable, "-m", "pilab", "bench", "--quick", "--sections", "cli", "--out", "runs/b"],
                       capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "BENCHMARKS.md").read_text() == "the tree's report\n"
    assert sorted(os.listdir(tmp_path / "runs" / "b")) == ["BENCHMARKS.md", "bench.json"]
    assert "## Command line" in (tmp_path / "runs" / "b" / "BENCHMARKS.md").read_text()
    p = subprocess.run([sys.executable, "-m", "pilab", "bench", "--from", "runs", "--out", "report"],
                       capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = (tmp_path / "report" / "BENCHMARKS.md").read_text()
    assert "From `runs/b/bench.json`" in text and "## Command line" in text
    assert "`python -m pilab bench --sections one_rank,malloc,models,data,cache,simulator,checkpoint,ranks,sync," \
           "trace,memory --out DIR` measures them" in text  # what no saved run has is named, not left out silently
    assert sorted(os.listdir(tmp_path / "runs" / "b")) == ["BENCHMARKS.md", "bench.json"]  # nothing ran
    p = subprocess.run([sys.executable, "-m", "pilab", "bench", "--from", "runs", "--sections", "cli"],
                       capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 2 and "--sections go with a run" in p.stderr


def test_bench_command_refuses_unknown_sections():
    p = subprocess.run([sys.executable, "-m", "pilab", "bench", "--sections", "nope"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 2 and "nope" in p.stderr


@pytest.mark.mpi
def test_the_wire_job_times_every_contender_against_the_ceiling_and_its_bound():
    # issue 23: the contenders of one step on the wire, run here on loopback (the network section runs
    # the same job on its testbed's nodes); the bound is computed from a link fitted as the section does
    from pilab.perfmodel import check as network_model
    from pilab.launch import run_job
    res = run_job(2, "pilab.bench.wire", {"master": "127.0.0.1", "quick": True}, timeout=600,
                  env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"))
    assert set(res["step_s"]) == {"ceiling", "pilab", "pilab_fp16", "pilab_one_bucket", "ddp_gloo", "ddp_gloo_1mb"}
    assert all(v["n"] == 2 and v["median"] > 0 for v in res["step_s"].values())
    assert res["over_ceiling"]["ceiling"]["median"] == 1.0
    assert 0 < res["forward_s"] < res["step_s"]["ceiling"]["median"]
    # the probe: one Allreduce of the gradient's bytes alone and posted as backward starts, per round
    probe = res["probe"]
    assert len(res["probe_rounds"]) == 2 and 0 <= probe["saturated"] <= 2
    assert 0 <= probe["overlap_rate"] <= 1 and probe["alone_s"] > 0 and probe["backward_s"] > 0
    assert probe["alone16_s"] > 0 and probe["gamma_fp16"] >= 0  # MPICH has a half-precision type
    # a 10 MB/s link (alpha 1 ms): 2 nodes send the whole gradient each way, 4 nodes 1.5x it
    link = {"sizes_bytes": [2 ** 14, 2 ** 20, 2 ** 22], "seconds": [1e-3 + s / 1e7 for s in (2 ** 14, 2 ** 20, 2 ** 22)],
            "np": 2, "nodes": 2, "rate": "10mbit"}
    rows = network_model.wire_rows({"bench": [link], "wire": [{**res, "rate": "10mbit", "nodes": 2},
                                                              {**res, "rate": "10mbit", "nodes": 4, "np": 8}]})
    two, four = rows
    assert two["link_MBps"] == pytest.approx(10, rel=1e-3)
    assert two["link_s"] == pytest.approx(res["gradient_bytes"] / 1e7, abs=2e-3)  # + the fitted latency
    assert four["link_s"] - two["link_s"] == pytest.approx(0.5 * res["gradient_bytes"] / 1e7, rel=1e-3)
    assert two["bound_s"] == max(res["step_s"]["ceiling"]["median"], res["forward_s"] + two["link_s"])
    assert "pilab / DDP" in network_model.wire_table(rows)
