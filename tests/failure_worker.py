"""Run under ``mpiexec -n K python tests/failure_worker.py CASE OUT`` (or plain python for the simulator):
the real training loop, instrumented to record which training samples and test images each rank used.

integrity: for both sharding policies, train 2 epochs with ``engine.train`` and gather, per epoch, the
global training indices every rank's loader was asked for, and a digest of every image the model saw in
evaluation; rank 0 writes them to OUT (JSON) for tests/test_failures.py to check.
simulate48: the same through ``engine.VirtualRanks(48)`` in one process.
raise_in_train: ``python -m pilab train ARGS...`` as the CLI runs it on every rank, where rank 1's loader
raises at its 6th batch (a real exception inside the training loop, not a flag the code checks).
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace

import numpy as np
import torch

from pilab import data as data_mod
from pilab import engine
from pilab.engine import mpi as ranks, virtual
from pilab.config import Config
from served import served_batches

CFG = Config(width=0.25, train_subset=256, test_subset=100, batch_size=16, epochs=2, threads=1,
             augment=False, seed=3)


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha1(x.detach().contiguous().numpy().tobytes()).hexdigest()


def instrument():
    """Record (epoch, rank, indices) of every batch and a digest of every evaluated image."""
    used, seen = [], []
    orig_eval = engine.evaluate

    def record(loader, epoch, step, y):  # every rank's batch, one rank's or the fast simulator's global one
        used.append((epoch, loader.rank, [int(i) for i in loader.global_indices(epoch)[step]], [int(v) for v in y]))

    def evaluate(model, ds, comm, device, *batch, **options):  # batch: the evaluation batch size; options: tta
        hook = model.register_forward_pre_hook(
            lambda m, args: seen.extend(_digest(row) for row in args[0].to(memory_format=torch.contiguous_format)))
        try:
            return orig_eval(model, ds, comm, device, *batch, **options)
        finally:
            hook.remove()

    served_batches(record).__enter__()  # for the rest of this worker process
    ranks.evaluate = virtual.evaluate = evaluate  # where the rank backends look it up (MPIRanks, VirtualRanks)
    return used, seen


def expected_test_digests(ds) -> list[str]:
    out = []
    for i in range(0, len(ds.y_test), engine.EVAL_BATCH):
        x = data_mod.to_input(torch.from_numpy(ds.x_test[i:i + engine.EVAL_BATCH]))
        out += [_digest(row) for row in x.contiguous()]
    return out


def case_integrity(out: str) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    used, seen = instrument()
    res = {"np": comm.Get_size(), "policies": {}}
    for policy in ("static", "reshuffle"):
        del used[:], seen[:]
        cfg = replace(CFG, sharding=policy)
        result, _ = engine.fit(cfg, engine.MPIRanks(comm))
        rows = comm.gather(list(used), root=0)
        digests = comm.gather(list(seen), root=0)
        if comm.Get_rank() == 0:
            ds = engine.load_data(cfg)
            res["policies"][policy] = summarise(rows, digests, ds, result)
    if comm.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


def case_simulate48(out: str) -> None:
    used, seen = instrument()
    # 48 ranks of 2 images, one epoch: every virtual rank is a forward of its own, so keep it small
    cfg = replace(CFG, train_subset=200, batch_size=2, epochs=1)
    res = {"np": 48, "policies": {}}
    for policy in ("static", "reshuffle"):
        del used[:], seen[:]
        result, _ = engine.fit(replace(cfg, sharding=policy), engine.VirtualRanks(48))
        ds = engine.load_data(cfg)
        res["policies"][policy] = summarise([list(used)], [list(seen)], ds, result)
    with open(out, "w") as f:
        json.dump(res, f)


def summarise(rows_per_rank, digests_per_rank, ds, result) -> dict:
    """Per epoch: images used, distinct images used, steps per rank, labels right; test digests."""
    epochs = {}
    for rows in rows_per_rank:
        for epoch, rank, idx, y in rows:
            e = epochs.setdefault(epoch, {"idx": [], "steps": {}, "labels_ok": True})
            e["idx"] += idx
            e["steps"][rank] = e["steps"].get(rank, 0) + 1
            e["labels_ok"] &= bool(np.array_equal(ds.y_train[idx], np.asarray(y)))
    per_epoch = [{"used": len(e["idx"]), "unique": len(set(e["idx"])),
                  "steps_per_rank": [e["steps"].get(r, 0) for r in range(result["np"])],
                  "labels_ok": e["labels_ok"]} for _, e in sorted(epochs.items())]
    seen = [d for ds_ in digests_per_rank for d in ds_]
    expected = expected_test_digests(ds)
    evaluations = sum(1 for e in result["epochs"] if e["test_acc"] is not None)
    return {"n_train": int(len(ds.y_train)), "n_test": int(len(ds.y_test)), "per_epoch": per_epoch,
            "steps_per_epoch": result["steps_per_epoch"], "global_batch": result["global_batch"],
            "reported_leftover": result["data"]["leftover"],
            "images_per_epoch": [e["images"] for e in result["epochs"]],
            "evaluations": evaluations,
            # every test image seen exactly `evaluations` times over all ranks, nothing else seen
            "test_exactly_once": sorted(seen) == sorted(expected * evaluations),
            "test_seen": len(seen), "test_distinct_expected": len(set(expected))}


def case_raise_in_train(out: str) -> None:
    from mpi4py import MPI

    from pilab.cli import main
    if MPI.COMM_WORLD.Get_rank() == 1:
        orig, calls = data_mod.ShardLoader.batch, []

        def batch(self, epoch, step, share=None):
            calls.append(step)
            if len(calls) == 6:
                raise RuntimeError("injected failure on rank 1 at its 6th batch")
            return orig(self, epoch, step, share=share)
        data_mod.ShardLoader.batch = batch
    sys.exit(main(["train", "--out", out, *sys.argv[3:]]))


if __name__ == "__main__":
    {"integrity": case_integrity, "simulate48": case_simulate48,
     "raise_in_train": case_raise_in_train}[sys.argv[1]](sys.argv[2])
