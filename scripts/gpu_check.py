"""The full-size GPU check: 10 epochs of mobilenetv2_cifar on the 50,000 CIFAR-10 images, np=1 (batch 64)
and simulated np=48 (64 per rank, one forward per 512 images, vectorised ghost BatchNorm), bf16 autocast,
channels_last, data and augmentation on the device, no host synchronisation inside an epoch::

    python scripts/gpu_check.py                                  # data: $PILAB_CIFAR_ARCHIVE, or
                                                                 #   ../shared/data/cifar10-jpeg.tar.gz, or cifar10
    python scripts/gpu_check.py --data cifar10 --out runs/gpu_check.json
    python scripts/gpu_check.py --device cpu --data embedded --epochs 1 --train-subset 256 \\
        --test-subset 100 --nps 1,4 --batch 8 --width 0.25      # the same code path, tiny, on a CPU (tests)

Target on an H200: < 60 s (np=1) and < 20 s (np=48) of training per run; the whole script <= 5 minutes
once the data set is cached. Prints per run the wall time, training time, images/s and accuracies, and
writes them as JSON with ``--out``. It drives ``engine.Session`` one step at a time with
``VirtualRanks(defer_metrics=True)`` (loss and accuracy stay on the device until the epoch ends), so it
does not go through ``engine.train``'s per-step log.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pilab import engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def default_data() -> str:
    env = os.environ.get("PILAB_CIFAR_ARCHIVE")
    if env:
        return env
    archive = os.path.join(REPO, "..", "shared", "data", "cifar10-jpeg.tar.gz")
    for path in (archive, os.path.join(REPO, "shared", "data", "cifar10-jpeg.tar.gz")):
        if os.path.isfile(path):
            return os.path.abspath(path)
    return "cifar10"


def run_one(cfg, np_: int, ds, log=print) -> dict:
    import torch

    t_wall = time.perf_counter()
    s = engine.Session(cfg, engine.VirtualRanks(np_, defer_metrics=True), data=ds)
    dev = s.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t_setup = time.perf_counter() - t_wall
    epochs, t_train = [], 0.0
    for epoch in range(cfg.epochs):
        t = time.perf_counter()
        loss = correct = 0
        for step in range(s.steps_per_epoch):
            st, _ = s.step(epoch, step)
            loss, correct = loss + st.loss_sum, correct + st.correct
        images = s.steps_per_epoch * s.batch * np_
        loss, correct = float(loss) / images, float(correct) / images  # the epoch's one host sync
        sync()
        dt = time.perf_counter() - t
        t_train += dt
        s.ranks.settle(s.model, cfg.bn_buffers)  # evaluation is outside the training time
        test_loss, test_acc = s.ranks.evaluate(s.model, s.ds)
        epochs.append({"epoch": epoch + 1, "train_loss": loss, "train_acc": correct, "test_acc": test_acc,
                       "time": dt, "images_per_s": images / dt})
        log(f"np={np_:>2} epoch {epoch + 1:>2}: train loss {loss:.3f} acc {correct:.3f}  test acc {test_acc:.3f}  "
            f"{dt:6.2f} s  {images / dt:8.0f} img/s")
    return {"np": np_, "per_rank_batch": s.batch, "global_batch": s.batch * np_, "device": str(dev),
            "ranks_per_forward": s.ranks.chunk, "steps_per_epoch": s.steps_per_epoch,
            "setup_s": t_setup, "train_s": t_train, "wall_s": time.perf_counter() - t_wall,
            "final_test_acc": epochs[-1]["test_acc"] if epochs else None, "epochs": epochs}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="data source (default: the CIFAR-10 archive, see above)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--nps", default="1,48", help="virtual rank counts to run (default 1,48)")
    p.add_argument("--batch", type=int, default=64, help="images per rank (default 64)")
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--train-subset", type=int, default=0)
    p.add_argument("--test-subset", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)

    import torch

    from pilab import data as data_mod
    from pilab.config import Config
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device here; use --device cpu for the small CPU run")
        torch.backends.cudnn.benchmark = True
    source = a.data or default_data()
    t = time.perf_counter()
    ds = data_mod.load(source, train_subset=a.train_subset, test_subset=a.test_subset)
    t_data = time.perf_counter() - t
    print(f"data: {ds.source}, {len(ds.y_train)} train / {len(ds.y_test)} test images, loaded in {t_data:.1f} s")
    runs = []
    for np_ in (int(n) for n in a.nps.split(",")):
        # 64 per rank at np=48 is a global batch of 3,072: linear lr scaling with a 2-epoch warmup
        big = np_ * a.batch > 512
        cfg = Config(model="mobilenetv2_cifar", width=a.width, data=source, train_subset=a.train_subset,
                     test_subset=a.test_subset, batch_size=a.batch, epochs=a.epochs, device=a.device,
                     simulate_mode="fast", lr_scaling="linear" if big else "none",
                     warmup_epochs=min(2.0, float(a.epochs)) if big else 0.0, threads=0)
        r = run_one(cfg, np_, ds)
        runs.append(r)
        print(f"np={np_}: wall {r['wall_s']:.1f} s (training {r['train_s']:.1f} s, setup {r['setup_s']:.1f} s), "
              f"final test acc {r['final_test_acc']:.4f}")
    out = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "data_load_s": t_data, "runs": runs,
           "command": "python scripts/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
