"""The single-process benchmarks: one rank's step vs a bare PyTorch loop, images/s per model and memory
layout, the data path vs a per-sample Dataset + DataLoader, loading the data set (decode vs the cached
reload), the simulator (exact vs fast), the cost of one mid-epoch checkpoint, and how fast the command
line answers ``--help``.

Each function returns a plain dict of raw per-round numbers and their summaries (``stats.summary``)."""
from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from .. import data as data_mod, engine
from ..config import Config
from ..engine import build_optimizer, predict_peak_bytes
from ..models import build_model
from .stats import alternate, alternate_clocks, ratios, summary


def _sgd(model, cfg: Config):
    return build_optimizer(model, cfg, cfg.peak_lr(1))


def one_rank(cfg: Config, rounds: int, repeat: int) -> dict:
    """pilab's one-rank training step (``engine.Session`` on ``MPIRanks(None)``) vs a bare loop on the
    same model, optimizer, data and threads: zero_grad, forward, loss, backward, step, loss.item()."""
    session = engine.Session(cfg, engine.MPIRanks(None))
    loader, spe = session.ranks.loader, session.steps_per_epoch
    model = engine.base_model(cfg, torch.device("cpu"))
    opt = _sgd(model, cfg)
    model.train()
    session.model.train()
    k = {"pilab": 0, "bare": 0}

    def pilab():
        session.step(*divmod(k["pilab"] % (spe * cfg.epochs), spe))
        k["pilab"] += 1

    def bare():
        x, y = loader.batch(*divmod(k["bare"] % spe, spe))
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        k["bare"] += 1

    s = alternate({"bare": bare, "pilab": pilab}, rounds, repeat)
    session.ranks.close()
    return {"model": cfg.model, "width": cfg.width, "batch": cfg.batch_size, "threads": cfg.threads,
            "step_s": {n: summary(v) for n, v in s.items()}, "raw": s,
            "ratio_bare_over_pilab": summary(ratios(s, "bare", "pilab"))}


MODELS = [("mobilenetv2_cifar", 1.0), ("mobilenetv2_cifar", 0.5), ("mobilenetv2_cifar", 0.25),
          ("mobilenetv2", 1.0), ("mobilenetv2", 0.5), ("mobilenetv2", 0.25), ("squeezenet1_1", 1.0)]


def models(batch: int, rounds: int, repeat: int, models=MODELS) -> dict:
    """Training images/s (forward + backward + SGD step) per model, channels_last on and off."""
    ds = data_mod.load("embedded")
    x = data_mod.augment(torch.from_numpy(ds.x_train[:batch].copy()), seed=0, epoch=0, step=0, rank=0)
    y = torch.from_numpy(ds.y_train[:batch].copy())
    contenders, rows = {}, []
    for name, width in models:
        for cl in (True, False):
            torch.manual_seed(0)
            m = build_model(name, num_classes=10, width=width)
            fmt = torch.channels_last if cl else torch.contiguous_format
            m = m.to(memory_format=fmt).train()
            xin = x.contiguous(memory_format=fmt)
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)

            def step(m=m, opt=opt, xin=xin):
                opt.zero_grad(set_to_none=False)
                F.cross_entropy(m(xin), y).backward()
                opt.step()
            key = f"{name}@{width}:{'cl' if cl else 'nchw'}"
            contenders[key] = step
            rows.append((key, name, width, cl))
    s = alternate(contenders, rounds, repeat)
    out = []
    for key, name, width, cl in rows:
        ips = [batch / t for t in s[key]]
        row = {"model": name, "width": width, "channels_last": cl, "images_per_s": summary(ips)}
        if cl:
            row["cl_speedup"] = summary(ratios(s, key.replace(":cl", ":nchw"), key))
        out.append(row)
    base = "mobilenetv2_cifar@1.0:cl" if "mobilenetv2_cifar@1.0:cl" in s else rows[0][0]
    for row, (key, *_rest) in zip(out, rows):
        row["vs_base"] = summary(ratios(s, base, key))  # images/s relative to the base row's
    return {"batch": batch, "base": base, "rows": out, "raw": s}


class PerSampleCIFAR(torch.utils.data.Dataset):
    """What a user would write instead: one image per ``__getitem__``, the same augmentations (4-pixel
    reflect pad, random crop, horizontal flip, normalisation) with per-sample torch ops."""

    def __init__(self, x: np.ndarray, y: np.ndarray, seed: int = 0):
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.rng = np.random.default_rng(seed)
        self.mean = torch.tensor(data_mod.MEAN).view(3, 1, 1)
        self.std = torch.tensor(data_mod.STD).view(3, 1, 1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = self.x[i].permute(2, 0, 1).float().div_(255)
        img = F.pad(img[None], (4, 4, 4, 4), mode="reflect")[0]
        dy, dx = self.rng.integers(0, 9, 2)
        img = img[:, dy:dy + 32, dx:dx + 32]
        if self.rng.integers(0, 2):
            img = img.flip(-1)
        return (img - self.mean) / self.std, self.y[i]


def data_path(batch: int, rounds: int, batches: int) -> dict:
    """Images/s of pilab's ShardLoader (batched crop + flip + normalise) vs a per-sample Dataset +
    DataLoader (num_workers=0: on this machine's cores a worker would compete with the ranks)."""
    ds = data_mod.load("embedded")
    loader = data_mod.ShardLoader(ds, 1, 0, batch, seed=0)
    dl = torch.utils.data.DataLoader(PerSampleCIFAR(ds.x_train, ds.y_train), batch_size=batch,
                                     shuffle=True, num_workers=0, drop_last=True)
    spe = loader.steps_per_epoch
    k = {"n": 0}

    def pilab():
        for _ in range(batches):
            loader.batch(0, k["n"] % spe)
            k["n"] += 1

    it = {"it": iter(dl)}

    def dataloader():
        for _ in range(batches):
            try:
                next(it["it"])
            except StopIteration:
                it["it"] = iter(dl)
                next(it["it"])

    s = alternate({"dataloader": dataloader, "pilab": pilab}, rounds)
    return {"batch": batch, "batches_per_call": batches,
            "images_per_s": {n: summary([batch * batches / t for t in v]) for n, v in s.items()},
            "speedup_pilab_over_dataloader": summary(ratios(s, "dataloader", "pilab")), "raw": s}


SIM_GOALS = {"fast": 1.10, "exact": 1.30}  # each mode's step against one process on the global batch


def stepper(session):
    """A function that runs ``session``'s next training step each call, round its epoch again and again
    (a contender of the alternated rounds)::

        alternate_clocks({"global": stepper(engine.Session(cfg, engine.MPIRanks(None)))}, rounds=3)
    """
    done = [0]

    def step():
        session.step(*divmod(done[0] % session.steps_per_epoch, session.steps_per_epoch))
        done[0] += 1
    return step


def simulator(cases, rounds: int, threads: int = 2, progress=None) -> dict:
    """The simulator against its physical bound: for each (model, width, per-rank batch b, np) in ``cases``,
    one step of one process training the global batch (``MPIRanks(None)``, batch np*b: the same images
    and arithmetic, grouped once) and of ``VirtualRanks(np)`` in each simulate_mode, alternated; the
    ratio of each mode's step to the global one per round (median and spread), by wall time and by the
    process's own CPU time (which other jobs on the machine swing far less); ``progress(result)`` is
    called after each row::

        simulator([("mobilenetv2_cifar", 0.25, 4, 48)], rounds=3)["rows"][0]["ratio_cpu"]["fast"]["median"]
    """
    rows = []
    ds = data_mod.load("embedded")
    out = {"threads": threads, "rounds": rounds, "goals": SIM_GOALS, "rows": rows}
    for model, width, b, np_ in cases:
        cfg = Config(model=model, width=width, batch_size=b, threads=threads, epochs=100, test_subset=10)
        need, room = predict_peak_bytes(replace(cfg, batch_size=np_ * b)), _available_bytes()
        if room and need > room / 2:  # a shared machine: leave the other jobs half of what is free
            rows.append({"model": model, "width": width, "per_rank_batch": b, "np": np_,
                         "skipped": f"predicted peak {need / 2 ** 30:.1f} GiB > half of the "
                                    f"{room / 2 ** 30:.1f} GiB available"})
            if progress:
                progress(out)
            continue
        sessions = {"global": engine.Session(replace(cfg, batch_size=np_ * b), engine.MPIRanks(None), data=ds)}
        for m in SIM_GOALS:
            sessions[m] = engine.Session(replace(cfg, simulate_mode=m), engine.VirtualRanks(np_), data=ds)
        load0, t0 = os.getloadavg()[0], time.time()
        t = alternate_clocks({m: stepper(s) for m, s in sessions.items()}, rounds)
        wall, cpu = t["wall"], t["cpu"]
        ratio = {m: summary(ratios(wall, m, "global")) for m in SIM_GOALS}
        ratio_cpu = {m: summary(ratios(cpu, m, "global")) for m in SIM_GOALS}
        rows.append({"model": model, "width": width, "per_rank_batch": b, "np": np_,
                     "step_s": {m: summary(v) for m, v in wall.items()},
                     "cpu_s": {m: summary(v) for m, v in cpu.items()},
                     "ratio": ratio, "ratio_cpu": ratio_cpu,
                     "met": {m: _le(ratio[m], g) for m, g in SIM_GOALS.items()},
                     "met_cpu": {m: _le(ratio_cpu[m], g) for m, g in SIM_GOALS.items()},
                     # load average (1 min) over the row and its length: how much other jobs were running
                     "loadavg": [load0, os.getloadavg()[0]], "row_s": time.time() - t0,
                     "raw": wall, "raw_cpu": cpu})
        del sessions
        if progress:
            progress(out)
    return out


def _available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


def _le(s: dict, goal: float) -> bool:
    return s["median"] is not None and s["median"] <= goal


def fast_deviation(cfg: Config, np_: int, steps: int) -> dict:
    """Train ``steps`` steps at ``np_`` virtual ranks in both modes from the same start; how far apart
    the weights end, relative to how far they moved, and the last losses."""
    finals, losses, wall = {}, {}, {}
    init = None
    for mode in ("exact", "fast"):
        s = engine.Session(replace(cfg, simulate_mode=mode, max_steps=steps), engine.VirtualRanks(np_))
        if init is None:
            init = torch.cat([p.detach().reshape(-1).clone() for p in s.model.parameters()])
        t, lo = time.perf_counter(), []
        for g in range(steps):
            st, _ = s.step(*divmod(g, s.steps_per_epoch))
            lo.append(st.loss_sum / (np_ * s.batch))
        wall[mode] = time.perf_counter() - t
        finals[mode] = torch.cat([p.detach().reshape(-1).clone() for p in s.model.parameters()])
        losses[mode] = lo
    diff = (finals["fast"] - finals["exact"])
    moved = (finals["exact"] - init).norm()
    return {"np": np_, "steps": steps, "model": cfg.model, "width": cfg.width, "per_rank_batch": cfg.batch_size,
            "max_abs_param_diff": float(diff.abs().max()),
            "rel_param_diff": float(diff.norm() / moved),  # |fast - exact| / |exact - init|
            "loss_last10_exact": float(np.mean(losses["exact"][-10:])),
            "loss_last10_fast": float(np.mean(losses["fast"][-10:])),
            "max_step_loss_diff": float(np.max(np.abs(np.subtract(losses["fast"], losses["exact"])))),
            "wall_s": wall}


def checkpoint_cost(cfg: Config, saves: int, interval_min: float = 10.0) -> dict:
    """The cost of one mid-epoch checkpoint (``pilab.engine.checkpoint.write_position``: gather the rank states, checksum,
    serialise, write, fsync, rename) for ``cfg``'s model, against the multi-node default interval::

        checkpoint_cost(Config(width=0.25), saves=5)   # {'save_s': {...}, 'bytes': ..., 'share_of_interval': ...}
    """
    import os
    import tempfile

    from ..engine import checkpoint, records
    with tempfile.TemporaryDirectory() as out:
        session = engine.Session(replace(cfg, out=out, checkpoint_every_steps=1), engine.MPIRanks(None))
        session.model.train()
        times, size = [], 0
        for k in range(saves):
            session.step(0, k % session.steps_per_epoch)
            acc = records.EpochSums()
            t = time.perf_counter()
            failed = checkpoint.write_position(session, 0, k + 1, [], step_in_epoch=k + 1, acc=acc)
            times.append(time.perf_counter() - t)
            assert failed is None, failed
            size = os.path.getsize(os.path.join(out, "checkpoint.pt"))
        session.ranks.close()
    med = float(np.median(times))
    return {"model": cfg.model, "width": cfg.width, "saves": saves, "save_s": summary(times), "raw": times,
            "bytes": size, "interval_min": interval_min, "share_of_interval": med / (interval_min * 60)}


def cache(source: str, rounds: int) -> dict:
    """Loading the data set: decoding ``source`` into an empty cache vs reloading it from that cache
    (the checksum verified), ``rounds`` times, each round in a fresh cache directory::

        cache("embedded", 3)     # {'decode_s': {...}, 'reload_s': {...}, 'reload_speedup': {...}, ...}
    """
    import tempfile
    decode, reload = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as cache_dir:
            t = time.perf_counter()
            ds = data_mod.load(source, cache_dir=cache_dir)
            decode.append(time.perf_counter() - t)
            t = time.perf_counter()
            again = data_mod.load(source, cache_dir=cache_dir)
            reload.append(time.perf_counter() - t)
            assert again.checksum == ds.checksum
    images = len(ds.y_train) + len(ds.y_test)
    return {"source": source, "images": images, "decode_s": summary(decode), "reload_s": summary(reload),
            "decode_images_per_s": summary([images / t for t in decode]),
            "reload_speedup": summary([d / r for d, r in zip(decode, reload)]),
            "raw": {"decode": decode, "reload": reload}}


def cli_startup(rounds: int, repeat: int = 2) -> dict:
    """How long ``python -m pilab --help`` takes against starting Python at all (``python -c pass``),
    each a fresh process, alternated round by round (the CLI builds its parser from torch-free modules:
    tests/test_architecture.py checks that nothing heavy is imported)::

        cli_startup(5)      # {'seconds': {'python': {...}, 'help': {...}}, 'help_over_python': {...}, ...}
    """
    import subprocess
    import sys

    def start(*argv):
        return lambda: subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL, check=True)
    s = alternate({"python": start("-c", "pass"), "help": start("-m", "pilab", "--help")}, rounds, repeat)
    return {"seconds": {n: summary(v) for n, v in s.items()}, "help_over_python": summary(ratios(s, "help", "python")),
            "raw": s}


def _malloc_child(cfg: Config, mode: str, steps: int, queue) -> None:
    """One process (malloc is per process): PILAB_ALLOCATOR=mode, a Session, 2 untimed steps, then
    ``steps`` timed ones; puts (seconds per step, minor page faults per step, kernel share) on ``queue``."""
    import os
    import resource
    os.environ["PILAB_ALLOCATOR"] = mode
    torch.set_num_threads(cfg.threads)
    session = engine.Session(cfg, engine.MPIRanks(None))
    spe = session.steps_per_epoch
    for k in range(2):
        session.step(*divmod(k % spe, spe))
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for k in range(2, 2 + steps):
        session.step(*divmod(k % spe, spe))
    seconds, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    queue.put((seconds / steps, (r1.ru_minflt - r0.ru_minflt) / steps,
               (r1.ru_stime - r0.ru_stime) / cpu if cpu else 0.0, session.allocator))
    session.ranks.close()


def malloc(cfg: Config, rounds: int, steps: int) -> dict:
    """pilab's one-rank step with malloc "fast" (freed memory kept for the next step) vs "lean" (blocks
    from 1 MiB up returned at once; ``pilab.engine.memory``): each contender a fresh process per round,
    the order rotated; seconds per step, minor page faults per step and the share of CPU time spent in
    the kernel."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    modes = ["fast", "lean"]
    raw = {m: {"step": [], "faults": [], "kernel": []} for m in modes}
    for r in range(rounds):
        for mode in modes[r % 2:] + modes[:r % 2]:
            q = ctx.Queue()
            p = ctx.Process(target=_malloc_child, args=(cfg, mode, steps, q))
            p.start()
            step, faults, kernel, used = q.get(timeout=600)
            p.join()
            if used != mode:
                raise RuntimeError(f"malloc bench: the rank ran with {used!r}, not {mode!r}")
            raw[mode]["step"].append(step)
            raw[mode]["faults"].append(faults)
            raw[mode]["kernel"].append(kernel)
    return {"model": cfg.model, "width": cfg.width, "batch": cfg.batch_size, "threads": cfg.threads, "steps": steps,
            **{m: {k: summary(v) for k, v in raw[m].items()} for m in modes}, "raw": raw,
            "ratio_lean_over_fast": summary([a / b for a, b in zip(raw["lean"]["step"], raw["fast"]["step"])])}
