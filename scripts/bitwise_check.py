"""Record what a few small runs compute, and compare two recordings byte for byte (the safety net of
a refactor that must not change a single bit: issue #36).

    python scripts/bitwise_check.py record .bitwise/before     # with the old code checked out
    # (another checkout: PYTHONPATH=/path/to/it, so that it is the pilab imported here and by the ranks)
    python scripts/bitwise_check.py record .bitwise/after      # with the new code
    python scripts/bitwise_check.py compare .bitwise/before .bitwise/after

Each run trains a slice of the real CIFAR-10 archive ($PILAB_CIFAR_ARCHIVE, else
../shared/data/cifar10-jpeg.tar.gz) and keeps, as text, every step's loss and learning rate
(``float.hex``), every epoch's train/test loss and accuracy, and a SHA-256 of the final weights:

* ``mpi2``  -- a real ``mpiexec -n 2`` run (MPIRanks, GradSync, its metrics riding with the last bucket);
* ``sim48`` -- the simulator at np=48 (VirtualRanks, simulate_mode auto: fast);
* ``sim48x`` -- the same with simulate_mode=exact (each virtual rank's own forward, MPI's sums);
* ``remedies`` -- the simulator at np=4 with the weights' EMA, local SGD and a fixed batch ramp;
* ``gns2``  -- ``mpiexec -n 2`` with a noise-driven batch ramp, the EMA and mid-epoch checkpoints;
* ``resume`` -- the simulator at np=4 stopped after 5 steps (a mid-epoch checkpoint), resumed at np=2.

``record`` runs the library of the checkout it is started from (``python -m pilab`` ranks start in it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from pilab import engine

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE = os.environ.get("PILAB_CIFAR_ARCHIVE") or str(ROOT.parent / "shared" / "data" / "cifar10-jpeg.tar.gz")
BASE = dict(model="mobilenetv2_cifar", width=0.25, train_subset=2048, test_subset=500, seed=3,
            batch_size=16, epochs=2, lr=0.1, warmup_epochs=0.5, threads=1)
RUNS = {
    "mpi2": ("mpi", 2, {}),
    "sim48": ("sim", 48, dict(batch_size=4, train_subset=3072, epochs=1)),
    "sim48x": ("sim", 48, dict(batch_size=4, train_subset=3072, epochs=1, simulate_mode="exact")),
    "remedies": ("sim", 4, dict(ema_epochs=0.5, local_steps=2, batch_ramp="1:32")),
    "gns2": ("mpi", 2, dict(batch_size=8, batch_ramp="gns:32", ema_epochs=0.5, checkpoint_every_steps=7,
                            checkpoint_every=1)),
    "resume": ("resume", 4, dict(checkpoint_every_steps=5, batch_mode="global", batch_size=64)),
}


def _config(over: dict, **more):
    from pilab.config import Config
    return Config(data=ARCHIVE, **{**BASE, **over, **more})


def _weights_sha(model) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _summary(result: dict, sha: str) -> dict:
    keep = ("epoch", "steps", "train_loss", "train_acc", "test_loss", "test_acc")
    return {"loss": [float(x).hex() for x in result["steps"]["loss"]],
            "lr": [float(x).hex() for x in result["steps"]["lr"]],
            "epochs": [{k: (float(e[k]).hex() if isinstance(e[k], float) else e[k]) for k in keep}
                       for e in result["epochs"]], "weights_sha256": sha}


def _rank_main(over: dict, out: str) -> None:
    """One rank of an ``mpiexec`` run: train, and rank 0 writes the summary."""
    from mpi4py import MPI
    with tempfile.TemporaryDirectory() as d:
        cfg = _config(over, out=d if over.get("checkpoint_every_steps") else "")
        result, model = engine.fit(cfg, engine.MPIRanks(MPI.COMM_WORLD))
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(out).write_text(json.dumps(_summary(result, _weights_sha(model)), indent=1))


def _simulate(np_: int, over: dict) -> dict:
    result, model = engine.fit(_config(over), engine.VirtualRanks(np_))
    return _summary(result, _weights_sha(model))


def _resume(np_: int, over: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        first, _ = engine.fit(_config(over, out=d, max_steps=5), engine.VirtualRanks(np_))
        second, model = engine.fit(_config(over, out=d, resume=os.path.join(d, "checkpoint.pt")),
                                   engine.VirtualRanks(np_ // 2))
    a, b = _summary(first, ""), _summary(second, _weights_sha(model))
    return {"first": a, "resumed": b}


def record(out: Path, only: list[str]) -> None:
    import pilab
    print(f"recording with {pilab.__file__}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    for name, (kind, np_, over) in RUNS.items():
        if only and name not in only:
            continue
        dest = out / f"{name}.json"
        if kind == "mpi":
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run([mpiexec, "-n", str(np_), sys.executable, __file__, "_rank", json.dumps(over), str(dest)],
                           check=True, env=env, cwd=os.getcwd())
        else:
            summary = _simulate(np_, over) if kind == "sim" else _resume(np_, over)
            dest.write_text(json.dumps(summary, indent=1))
        print(f"{name}: {dest}")


def compare(a: Path, b: Path) -> int:
    bad = 0
    for name in RUNS:
        fa, fb = a / f"{name}.json", b / f"{name}.json"
        if not fa.exists() or not fb.exists():
            print(f"{name}: missing in {a if not fa.exists() else b}")
            bad += 1
            continue
        same = fa.read_bytes() == fb.read_bytes()
        print(f"{name}: {'identical' if same else 'DIFFERENT'}")
        bad += not same
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--only", nargs="*", default=[])
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    k = sub.add_parser("_rank")
    k.add_argument("over")
    k.add_argument("out")
    args = p.parse_args(argv)
    if args.cmd == "record":
        record(args.out, args.only)
        return 0
    if args.cmd == "compare":
        return compare(args.a, args.b)
    _rank_main(json.loads(args.over), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
