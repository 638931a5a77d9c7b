"""Issue 37's table: models pilab does not define, on data pilab did not make, through ``pilab scale``.

Each row is one ``python -m pilab scale`` (np=1 a real run, np=8 simulated exactly, times predicted for the
24-node Raspberry Pi 4B cluster) on a (model, data) pair; the FLOP columns compare torch's FlopCounterMode
count (how pilab prices a model it has never seen) with a count by hooks on every convolution and linear
layer (the built-in models' analytic rule); the memory columns compare the predicted peak of one rank
(``pilab.engine.memory``, with the model's own step measured by ``pilab.engine.memory``) with the peak
the np=1 run measured::

    python experiments/your-model/run.py --out runs/your-model        # ~10 min on 2 idle cores
    python experiments/your-model/run.py --out runs/your-model --table  # the table again, from the runs

The models are ``tests/own_models.py``'s (written for the tests, not pilab's) and the notebook's
``notebooks/mynet.py``; the data sets: scikit-learn's digits (1,797 grey 8x8 images, shipped inside its
package) and five CIFAR-10 classes upscaled to 64x64 from ``../shared/data/cifar10-jpeg.tar.gz``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ARCHIVE = os.path.join(REPO, "..", "shared", "data", "cifar10-jpeg.tar.gz")
PATHS = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "notebooks")]
sys.path[:0] = PATHS

# name -> (model, width, data key, the study's settings); lr per the run's own batch, not scaled with np
ROWS = {
    "digits": ("own_models:small_resnet_grey", 1.0, "digits",
               ["--batch-size", "16", "--lr", "0.1", "--lr-ref-batch", "16", "--epochs", "4", "--no-augment"]),
    "five64": ("own_models:small_resnet", 0.5, "five64",
               ["--batch-size", "16", "--lr", "0.05", "--lr-ref-batch", "16", "--epochs", "4"]),
    "bn1d": ("own_models:bn1d_head", 1.0, "cifar2000",
             ["--batch-size", "32", "--lr", "0.05", "--lr-ref-batch", "32", "--epochs", "4"]),
    "resnet8": ("mynet:resnet8", 0.5, "cifar2000",
                ["--batch-size", "32", "--lr", "0.05", "--lr-ref-batch", "32", "--epochs", "4"]),
}


def make_data(out: str) -> dict:
    """The data sets as .npz files pilab reads (``data.save``): made once, reused."""
    import numpy as np
    import torch

    from pilab import data
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f"{k}.npz") for k in ("digits", "five64")}
    if not os.path.exists(paths["digits"]):
        from sklearn.datasets import load_digits
        d = load_digits()
        x = np.clip(d.images * 16, 0, 255).astype(np.uint8)  # 0..16 grey levels -> 0..255
        data.save(data.from_arrays(x[:1500], d.target[:1500], x[1500:], d.target[1500:]), paths["digits"])
    if not os.path.exists(paths["five64"]):
        ds = data.load(ARCHIVE)
        def pick(x, y, n):  # n images of each of the first five classes (the archive is sorted by class)
            i = np.concatenate([np.flatnonzero(y == c)[:n] for c in range(5)])
            return x[i], y[i]

        def up(x):  # NHWC uint8 -> 64x64, bicubic, as a user's larger photos would be
            t = torch.from_numpy(x).permute(0, 3, 1, 2).float()
            t = torch.nn.functional.interpolate(t, size=64, mode="bicubic", align_corners=False)
            return t.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        xtr, ytr = pick(ds.x_train, ds.y_train, 400)
        xte, yte = pick(ds.x_test, ds.y_test, 100)
        data.save(data.from_arrays(up(xtr), ytr, up(xte), yte, classes=ds.classes[:5]), paths["five64"])
    paths["cifar2000"] = ARCHIVE
    return paths


def run_row(name: str, out: str, paths: dict) -> str:
    model, width, key, extra = ROWS[name]
    n = ("2000", "500") if key == "cifar2000" else ("0", "0")  # the archive: a subset; the npz files: all
    sub = ["--train-subset", n[0], "--test-subset", n[1]]
    cmd = [sys.executable, "-m", "pilab", "scale", "--model", model, "--width", str(width), "--data", paths[key],
           "--nps", "1", "--simulate-nps", "8", "--baseline", "1", "--target", "pi4b_cluster", "--threads", "1",
           "--out", os.path.join(out, name), *sub, *extra]
    if os.path.exists(os.path.join(out, name, "study.json")):
        cmd.append("--resume")
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(PATHS)))
    return os.path.join(out, name)


def row(name: str, study_dir: str) -> dict:
    from pilab import Config
    from pilab.engine import memory
    from pilab.models import counted_train_flops, forward_macs, probe_model

    from pilab import data, resultfile

    study = json.load(open(os.path.join(study_dir, "study.json")))
    r1 = resultfile.load(os.path.join(study_dir, "np1", "result.json"))
    pts = {int(p["np"]): p for p in study["rows"]}
    cfg = Config.from_dict(r1["config"])
    ds = data.load(cfg.data, train_subset=cfg.train_subset, test_subset=cfg.test_subset)  # cached: no decode
    shape = tuple(ds.image_shape)
    model = probe_model(cfg.model, num_classes=len(ds.classes), width=cfg.width, timesteps=None)
    counted = counted_train_flops(model, shape[-1])
    hooked = 6.0 * forward_macs(model, shape[-1])
    return {"row": name, "model": cfg.model, "width": cfg.width, "data": cfg.data,
            "shape": "x".join(map(str, shape)), "classes": len(ds.classes),
            "acc1": pts[1]["final_test_acc"], "acc8": pts[8]["final_test_acc"], "verdict8": pts[8].get("verdict"),
            "speedup8": pts[8].get("speedup"), "flops_counted": counted, "flops_hooks": hooked,
            "mem_pred_mb": memory.predict_peak_bytes(cfg, np_=1) / 2**20,
            "mem_meas_mb": max(r1["peak_mem_mb"])}


def table(rows: list[dict]) -> str:
    f = lambda v, p=3: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["| model | data | np=1 acc | np=8 acc (simulated) | Pi speedup np=8 (vs np=1) | GFLOPs/image counted "
             "/ by hooks | peak MB predicted / measured (np=1) |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} {r['width']:g} | {os.path.basename(str(r['data']))} ({r['shape']}, "
                     f"{r['classes']} classes) | {f(r['acc1'])} | {f(r['acc8'])} {r['verdict8'] or ''} | "
                     f"{f(r['speedup8'], 2)} | {r['flops_counted'] / 1e9:.4f} / {r['flops_hooks'] / 1e9:.4f} | "
                     f"{r['mem_pred_mb']:.0f} / {r['mem_meas_mb']:.0f} "
                     f"({100 * (r['mem_pred_mb'] / r['mem_meas_mb'] - 1):+.1f}%) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--table", action="store_true", help="only write the table from the finished runs")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.rows.split(",") if n.strip()]
    bad = [n for n in names if n not in ROWS]
    if bad:
        print(f"run.py: unknown row(s) {bad}; choose from {', '.join(ROWS)}", file=sys.stderr)
        return 2
    if not a.table:
        paths = make_data(os.path.join(a.out, "data"))
        for n in names:
            run_row(n, a.out, paths)
    rows = [row(n, os.path.join(a.out, n)) for n in names if os.path.exists(os.path.join(a.out, n, "study.json"))]
    text = table(rows)
    with open(os.path.join(a.out, "summary.md"), "w") as fh:
        fh.write(text)
    json.dump(rows, open(os.path.join(a.out, "rows.json"), "w"), indent=1)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
