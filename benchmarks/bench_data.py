"""Data-path benchmark: archive decode vs cached reload, batched vs per-image augmentation.

    python benchmarks/bench_data.py                     # archive: $PILAB_CIFAR_ARCHIVE or ../shared/data/...
    python benchmarks/bench_data.py --archive PATH --batch 128 --threads 1

One torch thread by default: a training rank on a Raspberry Pi node gets about one core. The cache goes to
a temporary directory, so the first load is a real decode.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pilab import data  # noqa: E402


def timed(fn, repeat=1):
    """(best seconds over ``repeat`` runs, last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def naive_augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The per-image baseline: pad, crop, flip and normalise one image at a time in Python."""
    mean = torch.tensor(data.MEAN).view(3, 1, 1)
    std = torch.tensor(data.STD).view(3, 1, 1)
    out = []
    for img in x:
        t = img.permute(2, 0, 1).float().div(255)
        t = F.pad(t[None], (4, 4, 4, 4), mode="reflect")[0]
        dy, dx = (int(v) for v in torch.randint(0, 9, (2,), generator=g))
        t = t[:, dy:dy + 32, dx:dx + 32]
        if torch.randint(0, 2, (1,), generator=g).item():
            t = t.flip(-1)
        out.append((t - mean) / std)
    return torch.stack(out).contiguous(memory_format=torch.channels_last)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archive", default=os.environ.get("PILAB_CIFAR_ARCHIVE")
                   or os.path.join(REPO, "..", "shared", "data", "cifar10-jpeg.tar.gz"))
    p.add_argument("--batch", type=int, default=128, help="images per augmentation call")
    p.add_argument("--steps", type=int, default=40, help="augmentation calls timed per variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} cpus, torch threads {a.threads}")

    with tempfile.TemporaryDirectory() as cache:
        sources = [("embedded", "embedded")]
        if os.path.isfile(a.archive):
            sources.append(("archive", os.path.abspath(a.archive)))
        else:
            print(f"archive {a.archive} not found: timing the embedded subset only")
        for label, src in sources:
            t_decode, ds = timed(lambda: data.load(src, cache_dir=cache))
            t_cached, again = timed(lambda: data.load(src, cache_dir=cache), repeat=3)
            assert again.checksum == ds.checksum
            n = len(ds.y_train) + len(ds.y_test)
            print(f"{label:9s} {n:6d} images: decode {t_decode:7.2f} s ({n / t_decode:6.0f} img/s), "
                  f"cached reload {t_cached:6.3f} s (checksum verified) -> "
                  f"{t_decode / t_cached:6.1f}x faster")

    x = torch.from_numpy(ds.x_train[: a.batch].copy())
    data.augment(x, seed=0, epoch=0, step=0, rank=0)  # warm-up
    # Best of 3: the machine may be shared; the minimum is the least disturbed measurement.
    t_fast, _ = timed(lambda: [data.augment(x, seed=0, epoch=0, step=s, rank=0) for s in range(a.steps)], 3)
    g = torch.Generator().manual_seed(0)
    naive_steps = max(1, a.steps // 8)
    t_naive, _ = timed(lambda: [naive_augment(x, g) for _ in range(naive_steps)], 3)
    fast = a.batch * a.steps / t_fast
    naive = a.batch * naive_steps / t_naive
    print(f"augment   batch {a.batch}: batched {fast:9.0f} img/s, per-image loop {naive:7.0f} img/s "
          f"-> {fast / naive:5.1f}x")
    t_plain, _ = timed(lambda: [data.to_input(x) for _ in range(a.steps)], 3)
    print(f"to_input  batch {a.batch}: {a.batch * a.steps / t_plain:9.0f} img/s (no augmentation)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
