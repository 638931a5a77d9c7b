"""Your own model over real MPI ranks against the simulator. Launched by tests/test_custom.py as

    mpiexec -n K python tests/custom_worker.py OUT.json

Two models pilab does not define (tests/own_models.py): a small ResNet with BatchNorm2d, and convs with a
BatchNorm1d + dropout classifier head. Rank 0 writes, per model, the largest difference of every rank's
parameters and buffers against the simulator's virtual rank after the same steps; and, with SyncBatchNorm,
the first losses. Nothing here asserts: the pytest side does, with the numbers.
"""
import json
import sys
from dataclasses import replace

import torch
from mpi4py import MPI

from pilab.config import Config
from pilab import engine

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
BASE = Config(train_subset=240, test_subset=120, batch_size=8, epochs=2, max_steps=14, augment=True, lr=0.05,
              lr_ref_batch=16, threads=1, seed=5, bucket_mb=0.25,
              simulate_mode="exact")  # compared with mpiexec bit for bit: the exact mode
MODELS = {"resnet": replace(BASE, model="own_models:small_resnet", width=0.5), "head": replace(BASE, model="own_models:bn1d_head")}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def main(out):
    res = {}
    ds = engine.load_data(BASE, COMM)
    for name, cfg in MODELS.items():
        result, model = engine.fit(cfg, engine.MPIRanks(COMM), data=ds)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        states = COMM.gather(state, root=0)
        if RANK == 0:
            sim, sim_model = engine.fit(cfg, engine.VirtualRanks(SIZE), data=ds)
            res[name] = {"diff_per_rank": [max_diff(engine.virtual_state(sim_model, r), states[r])
                                           for r in range(SIZE)],
                         "steps": result["total_steps"], "keys": len(state),
                         "loss": result["steps"]["loss"], "sim_loss": sim["steps"]["loss"]}
        # SyncBatchNorm of any BatchNorm: over all ranks, and (the ResNet) over groups of ranks where np allows
        sync = replace(cfg, bn="sync", max_steps=3, eval_every=100, bn_group=2 if SIZE % 2 == 0 and SIZE > 2 else 0)
        r_sync, _ = engine.fit(sync, engine.MPIRanks(COMM), data=ds)
        if RANK == 0:
            s_sync = engine.simulate(sync, SIZE, data=ds)
            res[name]["sync_loss"], res[name]["sim_sync_loss"] = r_sync["steps"]["loss"], s_sync["steps"]["loss"]
    if RANK == 0:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        COMM.Abort(1)
