"""Checks that need real MPI ranks. Launched by tests/test_mpi.py as

    mpiexec -n K python tests/mpi_worker.py CASE OUT.json

Every rank takes part; rank 0 writes a JSON of named measurements that the pytest side asserts on.
Nothing here asserts: a failed check must show up as a failing pytest test with its numbers.
"""
import json
import sys
from dataclasses import replace
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

import pilab
from pilab import data as data_mod
from pilab import dist
from pilab import engine
from pilab.engine import layers
from pilab.config import Config

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

# Small but real: the embedded CIFAR-10 subset, narrow MobileNetV2, augmentation on.
BASE = Config(width=0.25, train_subset=400, test_subset=200, batch_size=8, epochs=3,
              max_steps=20, augment=True, lr=0.05, lr_ref_batch=16, threads=1, seed=3,
              bucket_mb=0.25, simulate_mode="exact")  # compared with mpiexec bit for bit: the exact mode


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


def gathered_states(model):
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return COMM.gather(state, root=0)  # pickled, once, in a test


def reference_state(cfg: Config, ds, np_: int) -> list[dict]:
    """One process averaging the same per-rank gradients: per-rank BN buffers kept apart by hand."""
    from pilab.engine.optim import build_optimizer, lr_at, set_lr
    b = cfg.per_rank_batch(np_)
    loaders = [data_mod.ShardLoader(ds, np_, r, b, seed=cfg.seed, policy=cfg.sharding,
                                    augment=cfg.augment) for r in range(np_)]
    spe = loaders[0].steps_per_epoch
    total = min(cfg.epochs * spe, cfg.max_steps)
    model = engine.base_model(cfg, torch.device("cpu"))
    opt = build_optimizer(model, cfg, cfg.peak_lr(np_))
    bufs = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(np_)]
    params = [p for p in model.parameters()]
    for g in range(total):
        epoch, step = divmod(g, spe)
        set_lr(opt, lr_at(g, peak_lr=cfg.peak_lr(np_), total_steps=cfg.epochs * spe,
                          warmup_steps=round(cfg.warmup_epochs * spe), schedule=cfg.schedule))
        grads = [torch.zeros_like(p) for p in params]
        for r in range(np_):
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(bufs[r][k])
            x, y = loaders[r].batch(epoch, step)
            torch.manual_seed(layers.step_seed(cfg.seed, epoch, step, r))
            model.zero_grad(set_to_none=False)
            # each rank's gradient divided by np as MPI forms it: the loss scaled by 1/np (GradSync.backward)
            loss = F.cross_entropy(model(x), y)
            dist.share_of_mean(loss, np_).backward()
            for acc, p in zip(grads, params):
                acc += p.grad
            bufs[r] = {k: v.clone() for k, v in model.named_buffers()}
        for p, gr in zip(params, grads):
            p.grad.copy_(gr)
        opt.step()
    out = []
    for r in range(np_):
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(bufs[r][k])
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def first_update(w0: dict, state: dict) -> torch.Tensor:
    """The first step's change of every parameter from ``w0`` (running statistics left out), as one vector."""
    return torch.cat([(state[k].double() - w0[k].double()).flatten() for k in w0
                      if w0[k].is_floating_point() and "running" not in k])


def _bn_reference(per_rank):
    """Every rank's images (``per_rank`` each, the same on every rank), an upstream gradient, and a
    BatchNorm with non-trivial affine weights: what a synchronised layer is checked against."""
    torch.manual_seed(0)
    full = torch.randn(per_rank * SIZE, 6, 5, 5, dtype=torch.float32)
    gout = torch.randn_like(full)
    ref_bn = torch.nn.BatchNorm2d(6)
    with torch.no_grad():
        ref_bn.weight.uniform_(0.5, 1.5)
        ref_bn.bias.uniform_(-0.5, 0.5)
    return full, gout, ref_bn


def case_train(out):
    """Equivalence with a single-process reference, buffer sync, accounting, buckets, fp16."""
    res = {}
    ds = engine.load_data(BASE, COMM)
    # 1) 20 steps, no eval before the end -> compare raw per-rank states with the reference.
    cfg = replace(BASE, eval_every=100)
    steps_seen = []
    post_before_end = []

    # Wrap GradSync.finish to record when the first bucket went out vs when backward ended.
    orig_finish = dist.GradSync.finish

    def finish(self):
        st = orig_finish(self)
        post_before_end.append((st.first_post < st.backward_end, st.buckets, st.bytes_sent))
        return st
    dist.GradSync.finish = finish
    # Capture per-rank states BEFORE the final buffer sync by stopping short of the last epoch's eval:
    # train for exactly 20 steps and compare after the run; the end-of-run sync makes buffers equal
    # to rank 0's, so compare those with reference rank 0 and parameters on every rank.
    result, model = engine.fit(cfg, engine.MPIRanks(COMM), data=ds, callbacks=[lambda e: steps_seen.append(e)])
    dist.GradSync.finish = orig_finish
    states = gathered_states(model)
    flags = COMM.gather(post_before_end, root=0)
    if RANK == 0:
        ref = reference_state(cfg, ds, SIZE)
        res["steps_run"] = sum(1 for e in steps_seen if e["kind"] == "step")
        res["param_diff_vs_reference"] = max(
            max_diff({k: s[k] for k, _ in ref_params(ref[0])}, ref[0]) for s in states)
        # After the end-of-run sync (broadcast policy) every rank holds rank 0's buffers.
        res["buffer_diff_vs_reference_rank0"] = max(
            max_diff({k: s[k] for k in buffer_keys(ref[0])}, {k: ref[0][k] for k in buffer_keys(ref[0])})
            for s in states)
        res["ranks_identical_after_sync"] = all(max_diff(s, states[0]) == 0.0 for s in states)
        res["first_post_before_backward_end"] = all(f[0] for per in flags for f in per)
        res["buckets"] = flags[0][0][1]
        res["bytes_fp32"] = flags[0][0][2]
        res["result_np"] = result["np"]
        res["accounting"] = result["data"]
        res["epoch_images"] = [e["images"] for e in result["epochs"]]
        res["comm_exposed"] = sum(result["steps"]["comm_exposed"])
        res["comm_total"] = sum(result["steps"]["comm"])
        res["final_loss_fp32_unstable_lr"] = float(np.mean(result["steps"]["loss"][-5:]))

    # 2) per-rank buffers BEFORE any sync: compare every rank's own BN statistics with the reference.
    cfg_nosync = replace(cfg, max_steps=20)
    # run the loop by hand for exact per-rank buffers (train.run always settles buffers at the end)
    states_before = _train_no_sync(cfg_nosync, ds)
    all_before = COMM.gather(states_before, root=0)
    if RANK == 0:
        res["per_rank_state_diff_vs_reference"] = max(max_diff(all_before[r], ref[r]) for r in range(SIZE))
        res["ranks_differ_before_sync"] = any(
            max_diff({k: all_before[r][k] for k in buffer_keys(ref[0])},
                     {k: all_before[0][k] for k in buffer_keys(ref[0])}) > 0 for r in range(1, SIZE))

    # 3) fp16 compression: half the bytes, loss close to fp32. Compared at a small lr, where 20 steps
    # follow a smooth trajectory (at lr 0.05 this tiny run is chaotic and any rounding diverges).
    post_before_end.clear()
    dist.GradSync.finish = finish
    r16, _ = engine.fit(replace(cfg, compression="fp16", lr=0.01), engine.MPIRanks(COMM), data=ds)
    dist.GradSync.finish = orig_finish
    r32, _ = engine.fit(replace(cfg, lr=0.01), engine.MPIRanks(COMM), data=ds)
    flags16 = COMM.gather(post_before_end, root=0)
    if RANK == 0:
        res["bytes_fp16"] = flags16[0][0][2]
        res["final_loss_fp16"] = float(np.mean(r16["steps"]["loss"][-5:]))
        res["final_loss_fp32"] = float(np.mean(r32["steps"]["loss"][-5:]))

    # 4) sample accounting over a whole epoch for both policies, gathered from real ranks
    for policy in ("static", "reshuffle"):
        b = 16
        loader = data_mod.ShardLoader(ds, SIZE, RANK, b, seed=1, policy=policy, augment=False)
        idx = [data_mod.epoch_batches(ds.y_train, SIZE, RANK, b, e, seed=1, policy=policy).ravel()
               for e in range(2)]
        steps = COMM.gather(loader.steps_per_epoch, root=0)
        gathered = COMM.gather(idx, root=0)
        if RANK == 0:
            per_epoch = []
            for e in range(2):
                allidx = np.concatenate([g[e] for g in gathered])
                per_epoch.append({"used": int(allidx.size), "unique": int(np.unique(allidx).size),
                                  "leftover": int(len(ds.y_train) - allidx.size)})
            res[f"accounting_{policy}"] = {
                "steps": steps, "per_epoch": per_epoch, "n": int(len(ds.y_train)), "batch": b,
                "reported": data_mod.epoch_accounting(ds.y_train, SIZE, b, policy, seed=1)}

    # 5) SyncBatchNorm == BatchNorm on the concatenated batch (forward and backward)
    full, gout, ref_bn = _bn_reference(4)
    sync_bn = dist.SyncBatchNorm(6, COMM.Dup())
    sync_bn.load_state_dict(ref_bn.state_dict())
    xr = full.clone().requires_grad_(True)
    yr = ref_bn(xr)
    (yr * gout).sum().backward()
    mine = slice(4 * RANK, 4 * RANK + 4)
    xs = full[mine].clone().requires_grad_(True)
    ys = sync_bn(xs)
    (ys * gout[mine]).sum().backward()
    wgrad = sync_bn.weight.grad.clone()
    dist.allreduce_(wgrad, COMM)
    d = {
        "y": float((ys - yr[mine]).detach().abs().max()),
        "dx": float((xs.grad - xr.grad[mine]).abs().max()),
        "dweight_summed": float((wgrad - ref_bn.weight.grad).abs().max()),
        "running_mean": float((sync_bn.running_mean - ref_bn.running_mean).abs().max()),
        "running_var": float((sync_bn.running_var - ref_bn.running_var).abs().max()),
    }
    ds_ = COMM.gather(d, root=0)
    if RANK == 0:
        res["syncbn"] = {k: max(x[k] for x in ds_) for k in d}
        # and a short training run with bn=sync works end to end
    rs, _ = engine.fit(replace(cfg, bn="sync", max_steps=4), engine.MPIRanks(COMM), data=ds)
    if RANK == 0:
        res["syncbn_train_loss_finite"] = bool(np.isfinite(rs["steps"]["loss"]).all())
    # ... and the simulator's one forward over every rank's images is the same SyncBatchNorm: the first
    # step's loss and update against MPI's, and against the simulator's bn=local (another rule)
    one = replace(cfg, bn="sync", max_steps=1)
    r1, m1 = engine.fit(one, engine.MPIRanks(COMM), data=ds)
    if RANK == 0:
        from pilab.engine import base_model
        update = partial(first_update, base_model(one, torch.device("cpu")).state_dict())
        mine = update(m1.state_dict())
        rel = {}
        for name, c in (("sync", one), ("local", replace(one, bn="local"))):
            sim, sim_model = engine.fit(c, engine.VirtualRanks(SIZE), data=ds)
            rel[name] = float((update(engine.virtual_state(sim_model)) - mine).norm() / mine.norm())
            rel[name + "_loss"], rel[name + "_chunk"] = sim["steps"]["loss"][0], sim["ranks_per_chunk"]
        res["syncbn_simulator"] = dict(rel, loss=r1["steps"]["loss"][0])
    # ... and every simulate_mode against MPI's first bn=local step: exact bit for bit, fast (the global
    # batch in one forward, per-rank BatchNorm vectorised) to float rounding
    first = replace(cfg, max_steps=1)
    r1l, m1l = engine.fit(first, engine.MPIRanks(COMM), data=ds)
    if RANK == 0:
        update = partial(first_update, base_model(first, torch.device("cpu")).state_dict())
        mine = update(m1l.state_dict())
        modes = {}
        for mode in ("exact", "fast", "auto"):
            sim, sim_model = engine.fit(replace(first, simulate_mode=mode), engine.VirtualRanks(SIZE), data=ds)
            modes[mode] = {"update": float((update(engine.virtual_state(sim_model)) - mine).norm() / mine.norm()),
                           "loss": sim["steps"]["loss"][0], "used": sim["simulate_mode_used"],
                           "chunk": sim["ranks_per_chunk"]}
        res["modes_first_step"] = dict(modes, loss=r1l["steps"]["loss"][0])

    # 6) the simulator reproduces this MPI run
    sim_cfg = replace(cfg, eval_every=100)
    if RANK == 0:
        _, sim_model = engine.fit(sim_cfg, engine.VirtualRanks(SIZE), data=ds)
        res["simulator_states"] = [engine.virtual_state(sim_model, r) for r in range(SIZE)]
        # Both runs end with the same buffer policy (broadcast), so compare with the synced states.
        res["simulator_diff_per_rank"] = [max_diff(res["simulator_states"][r], states[r])
                                          for r in range(SIZE)]
        del res["simulator_states"]

    # 7) BN buffer policy "average": the same run ends with every rank holding the mean of the
    # per-rank running statistics of the reference, and the simulator applies the same policy
    cfg_avg = replace(cfg, bn_buffers="average")
    _, model_avg = engine.fit(cfg_avg, engine.MPIRanks(COMM), data=ds)
    states_avg = gathered_states(model_avg)
    if RANK == 0:
        keys = [k for k in buffer_keys(ref[0]) if ref[0][k].is_floating_point()]
        mean_ref = {k: sum(ref[r][k].double() for r in range(SIZE)) / SIZE for k in keys}
        # relative to 1 + |value|: running variances reach tens, where float32 rounds at ~4e-6
        res["average_buffers_diff_vs_reference_mean"] = max(
            float(((s[k].double() - mean_ref[k]).abs() / (1 + mean_ref[k].abs())).max())
            for s in states_avg for k in keys)
        res["average_params_diff_vs_reference"] = max(
            max_diff({k: s[k] for k, _ in ref_params(ref[0])}, ref[0]) for s in states_avg)
        # the statistics differ by rank before the sync, so the mean is not any one rank's
        res["average_differs_from_rank0"] = max_diff({k: ref[0][k] for k in keys}, mean_ref) > 1e-6
        _, sim_avg = engine.fit(replace(sim_cfg, bn_buffers="average"), engine.VirtualRanks(SIZE), data=ds)
        res["simulator_average_diff_per_rank"] = [
            max_diff(engine.virtual_state(sim_avg, r), states_avg[r]) for r in range(SIZE)]

    # 8) a rank that loads the data itself keeps only its static shard of the training images, and
    # only its share of the test images; its evaluation is the one on the whole test set
    sess = engine.Session(replace(BASE, max_steps=1), engine.MPIRanks(COMM))
    rows = sess.ds.test_rows
    outside = np.ones(len(ds.y_test), bool)
    outside[rows] = False
    full_eval = engine.evaluate(sess.model, ds, COMM, sess.device, BASE.eval_batch)
    held = COMM.gather({"session_train_images": len(sess.ds.x_train), "loader_images": len(sess.ranks.loader._x),
                        "shard_size": sess.ranks.loader.shard_size, "train_labels": len(sess.ds.y_train),
                        "test_rows": [rows.start, rows.stop], "test_labels": len(sess.ds.y_test),
                        "test_rows_equal": bool(np.array_equal(sess.ds.x_test[rows], ds.x_test[rows])),
                        "test_rest_zero": not sess.ds.x_test[outside].any(),
                        "eval_equal": sess.ranks.evaluate(sess.model, sess.ds) == full_eval}, root=0)
    sess.ranks.close()
    if RANK == 0:
        res["held_images"] = held
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def case_local(out):
    """Local SGD (post-local, H=4) with a batch ramp and the few-step recipe (label smoothing, weight EMA, flip TTA, Nesterov,
    a triangular schedule) over real ranks: weights apart between averages and equal after one; the
    whole run against the simulator; a run stopped between two averages and resumed, against the same
    run uninterrupted."""
    import os
    import tempfile

    from pilab.engine import localsgd
    cfg = replace(BASE, train_subset=240, epochs=2, max_steps=0, eval_every=1, local_steps=4, local_after=0.5,
                  batch_ramp="1:16",
                  label_smoothing=0.1, ema_epochs=0.3, tta=True, schedule="linear", warmup_epochs=0.2, nesterov=True)
    ds = engine.load_data(cfg, COMM)
    res = {}

    def flat_params(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    # 1) the ranks' weights after a local step that is not an average differ; after an average they are equal
    sess = engine.Session(cfg, engine.MPIRanks(COMM), data=ds)
    spe = sess.steps_per_epoch
    first_local = round(cfg.local_after * spe)
    for g in range(first_local + 1):
        sess.step(*divmod(g, spe))
    apart = COMM.gather(flat_params(sess.model), root=0)
    g = first_local + 1
    while not localsgd.phase(cfg, spe, *divmod(g, spe)).average:
        sess.step(*divmod(g, spe))
        g += 1
    sess.step(*divmod(g, spe))
    together = COMM.gather(flat_params(sess.model), root=0)
    sess.ranks.close()
    if RANK == 0:
        res["first_local_step"] = first_local
        res["average_step"] = g
        res["apart_max_diff"] = max(float((apart[r] - apart[0]).abs().max()) for r in range(SIZE))
        res["together_max_diff"] = max(float((together[r] - together[0]).abs().max()) for r in range(SIZE))

    # 2) the whole run, against the simulator
    result, model = engine.fit(cfg, engine.MPIRanks(COMM), data=ds)
    states = gathered_states(model)
    if RANK == 0:
        sim_result, sim_model = engine.fit(cfg, engine.VirtualRanks(SIZE), data=ds)
        res["simulator_diff_per_rank"] = [max_diff(engine.virtual_state(sim_model, r), states[r])
                                          for r in range(SIZE)]
        res["test_acc"] = [e["test_acc"] for e in result["epochs"]]
        res["simulator_test_acc"] = [e["test_acc"] for e in sim_result["epochs"]]
        res["test_loss_diff"] = max(abs(a["test_loss"] - b["test_loss"])
                                    for a, b in zip(result["epochs"], sim_result["epochs"]))
        res["train_loss_diff"] = max(abs(a - b) for a, b in zip(result["steps"]["loss"], sim_result["steps"]["loss"]))
        res["bytes_per_step"] = result["bytes_per_step"]

    # 3) stopped between two averages (a checkpoint there), resumed: the same run as uninterrupted
    d = COMM.bcast(tempfile.mkdtemp(prefix="pilab-local-") if RANK == 0 else None, root=0)
    k = first_local + 1
    engine.fit(replace(cfg, out=d, checkpoint_every_steps=k, max_steps=k), engine.MPIRanks(COMM), data=ds)
    resumed, model_b = engine.fit(replace(cfg, out=d, resume=os.path.join(d, "checkpoint.pt")),
                                  engine.MPIRanks(COMM), data=ds)
    states_b = gathered_states(model_b)
    if RANK == 0:
        res["resume_diff_per_rank"] = [max_diff(states_b[r], states[r]) for r in range(SIZE)]
        res["resume_test_acc"] = resumed["epochs"][-1]["test_acc"]
        res["resumed_from_step"] = resumed["resumed_from_step"]
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def ref_params(state):
    return [(k, v) for k, v in state.items() if "running" not in k and "num_batches" not in k]


def buffer_keys(state):
    return [k for k in state if "running" in k]


def _train_no_sync(cfg, ds):
    """The engine's own steps without the end-of-run buffer sync: per-rank state after N steps."""
    session = engine.Session(cfg, engine.MPIRanks(COMM), data=ds)
    for g in range(session.total_steps):
        session.step(*divmod(g, session.steps_per_epoch))
    session.ranks.close()
    return {k: v.detach().clone() for k, v in session.model.state_dict().items()}


def case_gns(out):
    """A noise-driven batch ramp (batch_ramp="gns:16") over real ranks: every rank measures the same noise
    scale and chooses the same batches, and the whole run matches the simulator's."""
    cfg = replace(BASE, train_subset=240, epochs=3, max_steps=0, batch_size=4, batch_ramp="gns:16")
    ds = engine.load_data(cfg, COMM)
    result, model = engine.fit(cfg, engine.MPIRanks(COMM), data=ds)
    mine = {"noise": [e["noise_scale"] for e in result["epochs"]], "plan": result["batch_plan"],
            "chosen": result["batch_ramp_chosen"]}
    every = COMM.gather(mine, root=0)
    states = gathered_states(model)
    if RANK == 0:
        sim, sim_model = engine.fit(cfg, engine.VirtualRanks(SIZE), data=ds)
        res = {"ranks": every, "simulator": {"noise": [e["noise_scale"] for e in sim["epochs"]],
                                             "plan": sim["batch_plan"], "chosen": sim["batch_ramp_chosen"]},
               "simulator_diff_per_rank": [max_diff(engine.virtual_state(sim_model, r), states[r])
                                           for r in range(SIZE)],
               "test_acc": [e["test_acc"] for e in result["epochs"]],
               "simulator_test_acc": [e["test_acc"] for e in sim["epochs"]],
               "lr": result["steps"]["lr"], "simulator_lr": sim["steps"]["lr"]}
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def case_renorm(out):
    """Batch Renormalization (bn="renorm") at 4 images per rank over real ranks, its limits widened within
    the run: the whole run against the simulator, and against the same run with plain BatchNorm."""
    # 96 images: 12 steps an epoch at np=2, 8 at np=3 -- plain for the first epoch, widened over the
    # second, wide for the third; what is compared (bitwise, the limits at each step) needs no more
    cfg = replace(BASE, train_subset=96, test_subset=100, epochs=3, max_steps=0, batch_size=4, bn="renorm",
                  warmup_epochs=0.5)
    ds = engine.load_data(cfg, COMM)
    result, model = engine.fit(cfg, engine.MPIRanks(COMM), data=ds)
    states = gathered_states(model)
    plain, _ = engine.fit(replace(cfg, bn="local"), engine.MPIRanks(COMM), data=ds)
    if RANK == 0:
        sim, sim_model = engine.fit(cfg, engine.VirtualRanks(SIZE), data=ds)
        bn = next(m for m in model.modules() if isinstance(m, layers.GhostBatchNorm2d))
        res = {"simulator_diff_per_rank": [max_diff(engine.virtual_state(sim_model, r), states[r])
                                           for r in range(SIZE)],
               "test_acc": [e["test_acc"] for e in result["epochs"]],
               "simulator_test_acc": [e["test_acc"] for e in sim["epochs"]],
               "plain_test_loss": [e["test_loss"] for e in plain["epochs"]],
               "test_loss": [e["test_loss"] for e in result["epochs"]],
               "limits": [bn.renorm_limits(t) for t in (0, bn.renorm[0], bn.renorm[1], result["total_steps"])],
               "renorm": list(bn.renorm), "steps_per_epoch": result["steps_per_epoch"]}
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


class _Seesaw(pilab.Component):
    """Uneven shares that change every step (through the seam: ``Phase.shares``), recording the training
    images each rank takes (the loader's own indices of its share)."""
    name, stage, per_rank = "seesaw", pilab.Stage.PLAN, True

    def __init__(self, np_):
        self.used, self.np_ = [], np_

    def before_step(self, session, epoch, step):
        from dataclasses import replace as with_
        total = session.batch * self.np_
        first = 1 + (step % 3) * (total // self.np_ - 1) // 2  # rank 0's share: 1, ..., B/np - 1
        shares = (first, *data_mod.batch_shares(total - first, [1.0] * (self.np_ - 1)))
        session.phase = with_(session.phase, shares=shares)
        ranks = session.ranks
        for r in (range(self.np_) if ranks.simulated else [ranks.rank]):
            loader = ranks.loaders[r] if ranks.simulated else ranks.loader
            idx = loader.share_indices(epoch, step, *session.phase.share_of(r))
            self.used.append([epoch, step, r, idx.tolist()])


def case_balance(out):
    """Uneven per-rank shares (``Config.balance``) over real ranks: given speeds (static:3,1 / 3,2,1) and
    shares changing every step (a component), each against the simulator; every image once an epoch; a
    mid-epoch checkpoint resumed; result.json's shares."""
    import os
    import tempfile
    speeds = {2: "static:3,1", 3: "static:3,2,1"}[SIZE]
    cfg = replace(BASE, train_subset=160, test_subset=100, epochs=2, max_steps=0, sharding="reshuffle", balance=speeds)
    ds = engine.load_data(cfg, COMM)
    work = COMM.bcast(tempfile.mkdtemp(prefix="pilab-balance-") if RANK == 0 else None)
    result, model = engine.fit(replace(cfg, out=os.path.join(work, "run")), engine.MPIRanks(COMM), data=ds)
    states = gathered_states(model)
    seesaw = _Seesaw(SIZE)
    moved, moved_model = engine.fit(replace(cfg, balance="off"), engine.MPIRanks(COMM), data=ds, components=[seesaw])
    moved_states = gathered_states(moved_model)
    used = COMM.gather(seesaw.used, root=0)
    # stopped after 3 steps with a checkpoint there (mid-epoch), then resumed to the end
    half = replace(cfg, out=os.path.join(work, "half"), max_steps=3, checkpoint_every_steps=3)
    engine.fit(half, engine.MPIRanks(COMM), data=ds)
    resumed, resumed_model = engine.fit(replace(half, max_steps=0, resume=os.path.join(work, "half", "checkpoint.pt")),
                                        engine.MPIRanks(COMM), data=ds)
    resumed_states = gathered_states(resumed_model)
    if RANK == 0:
        sim, sim_model = engine.fit(cfg, engine.VirtualRanks(SIZE), data=ds)
        sim_seesaw = _Seesaw(SIZE)
        sim_moved, sim_moved_model = engine.fit(replace(cfg, balance="off"), engine.VirtualRanks(SIZE), data=ds,
                                                components=[sim_seesaw])
        with open(os.path.join(work, "run", "result.json")) as f:
            written = json.load(f)
        res = {"simulator_diff_per_rank": [max_diff(engine.virtual_state(sim_model, r), states[r])
                                           for r in range(SIZE)],
               "loss": result["steps"]["loss"], "simulator_loss": sim["steps"]["loss"],
               "test_acc": [e["test_acc"] for e in result["epochs"]],
               "simulator_test_acc": [e["test_acc"] for e in sim["epochs"]],
               "balance": written.get("balance"), "simulator_balance": sim.get("balance"),
               "global_batch": result["global_batch"], "steps_per_epoch": result["steps_per_epoch"],
               "moved_diff_per_rank": [max_diff(engine.virtual_state(sim_moved_model, r), moved_states[r])
                                       for r in range(SIZE)],
               "moved_loss": moved["steps"]["loss"], "simulator_moved_loss": sim_moved["steps"]["loss"],
               "used": [u for rank_used in used for u in rank_used], "simulator_used": sim_seesaw.used,
               "resumed_from_step": resumed.get("resumed_from_step"),
               "resume_diff_per_rank": [max_diff(resumed_states[r], states[r]) for r in range(SIZE)],
               "resumed_loss": resumed["steps"]["loss"], "n_train": len(ds.y_train)}
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        import shutil
        shutil.rmtree(work, ignore_errors=True)


def case_syncgroups(out):
    """SyncBatchNorm over groups of 2 consecutive ranks (bn_group=2) at np=4: each group's layer equals
    BatchNorm on that group's concatenated batch; one training step against the simulator's, which runs
    every rank in one forward with BatchNorm per group of ranks, and against the other rules."""
    from pilab.engine import base_model
    res = {}
    full, gout, ref_bn = _bn_reference(3)
    mine_bn = dist.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(6)), COMM, group=2)[0]
    mine_bn.load_state_dict(ref_bn.state_dict())
    group = slice(3 * (RANK // 2 * 2), 3 * (RANK // 2 * 2 + 2))  # this rank's group's images
    xr = full[group].clone().requires_grad_(True)
    yr = ref_bn(xr)
    (yr * gout[group]).sum().backward()
    xs = full[3 * RANK:3 * RANK + 3].clone().requires_grad_(True)
    ys = mine_bn(xs)
    (ys * gout[3 * RANK:3 * RANK + 3]).sum().backward()
    own = slice(3 * (RANK % 2), 3 * (RANK % 2) + 3)
    d = {"y": float((ys - yr[own]).detach().abs().max()), "dx": float((xs.grad - xr.grad[own]).abs().max()),
         "running_mean": float((mine_bn.running_mean - ref_bn.running_mean).abs().max()),
         "running_var": float((mine_bn.running_var - ref_bn.running_var).abs().max()),
         "group_size": mine_bn.comm.Get_size()}
    ds_ = COMM.gather(d, root=0)
    cfg = replace(BASE, bn="sync", bn_group=2, max_steps=1, bn_buffers="average")
    ds = engine.load_data(cfg, COMM)
    r1, m1 = engine.fit(cfg, engine.MPIRanks(COMM), data=ds)
    # before the run's end settles them, the two groups' running statistics differ (their images do)
    r2, m2 = engine.fit(replace(cfg, bn_buffers="broadcast"), engine.MPIRanks(COMM), data=ds)
    states = gathered_states(m1)
    if RANK == 0:
        res["syncbn"] = {k: max(x[k] for x in ds_) for k in d}
        update = partial(first_update, base_model(cfg, torch.device("cpu")).state_dict())
        mpi = update(m1.state_dict())
        rel = {}
        for name, c in (("groups", cfg), ("all", replace(cfg, bn_group=0)), ("local", replace(cfg, bn="local", bn_group=0))):
            sim, sim_model = engine.fit(c, engine.VirtualRanks(SIZE), data=ds)
            rel[name] = float((update(engine.virtual_state(sim_model)) - mpi).norm() / mpi.norm())
            rel[name + "_loss"] = sim["steps"]["loss"][0]
            if name == "groups":  # every rank's row after the "average" policy: the mean of the groups'
                rel["buffers"] = max(max_diff({k: v for k, v in engine.virtual_state(sim_model, r).items()
                                               if "running" in k}, {k: v for k, v in states[r].items()
                                                                     if "running" in k}) for r in range(SIZE))
        res["simulator"] = dict(rel, loss=r1["steps"]["loss"][0])
        res["broadcast_vs_average"] = max_diff({k: v for k, v in m2.state_dict().items() if "running" in k},
                                               {k: v for k, v in states[0].items() if "running" in k})
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def case_fault(out):
    """Rank 1 raises at its 3rd step; abort_on_error must take the whole job down."""
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        if RANK == 1 and calls["n"] == 3:
            raise RuntimeError("injected failure on rank 1")
        return False
    cfg = replace(BASE, max_steps=50)
    with dist.abort_on_error(COMM):
        engine.train(cfg, COMM, stop=stop)


def case_stop(out):
    """A stop request on one rank ends the run on all ranks after the same step."""
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return RANK == SIZE - 1 and calls["n"] == 4
    res = engine.train(replace(BASE, max_steps=50), COMM, stop=stop)
    steps = COMM.gather(len(res["steps"]["loss"]), root=0)
    if RANK == 0:
        with open(out, "w") as f:
            json.dump({"steps_per_rank": steps, "stopped": res["stopped_early"]}, f)


def case_spiking(out):
    """The spiking CNN (tests/test_spiking.py): every rank's own state before the buffer sync, and the
    synced state after a full run, against the virtual-rank simulator of the same run."""
    cfg = Config(model="spiking_cnn", width=0.25, timesteps=3, train_subset=128, test_subset=64,
                 batch_size=8, epochs=1, max_steps=4, lr=0.05, lr_ref_batch=16, threads=1, seed=3,
                 simulate_mode="exact")
    ds = engine.load_data(cfg, COMM)
    before = COMM.gather(_train_no_sync(cfg, ds), root=0)
    result, model = engine.fit(cfg, engine.MPIRanks(COMM), data=ds)
    after = gathered_states(model)
    if RANK == 0:
        session = engine.Session(cfg, engine.VirtualRanks(SIZE), data=ds)
        for g in range(session.total_steps):
            session.step(*divmod(g, session.steps_per_epoch))
        sim_result, sim_model = engine.fit(cfg, engine.VirtualRanks(SIZE), data=ds)
        bn = [k for k in before[0] if "running" in k]
        torch.manual_seed(cfg.seed)
        init = engine.base_model(cfg, torch.device("cpu")).state_dict()
        res = {
            "per_rank_diff_before_sync": [max_diff(engine.virtual_state(session.model, r), before[r])
                                          for r in range(SIZE)],
            "ranks_bn_differ_before_sync": max_diff({k: before[1][k] for k in bn},
                                                    {k: before[0][k] for k in bn}) > 0,
            "diff_after_run": [max_diff(engine.virtual_state(sim_model, r), after[r]) for r in range(SIZE)],
            "params_moved_from_init": max_diff({k: after[0][k] for k, _ in ref_params(init)}, init),
            "mpi_loss": result["steps"]["loss"], "sim_loss": sim_result["steps"]["loss"],
            "mpi_test_acc": result["epochs"][-1]["test_acc"], "sim_test_acc": sim_result["epochs"][-1]["test_acc"],
            "timesteps": sim_model.timesteps,
        }
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def case_grads(out):
    """GradSync where a gradient is not where backward usually puts it: the usual step (every gradient
    accumulated into its slot of the buffer), after ``zero_grad(set_to_none=True)`` (backward makes new
    tensors), after a gradient replaced by hand, and a parameter backward never reaches. Each step's
    ``p.grad`` against the mean over the ranks of their own gradients (``torch.autograd.grad``, which
    fires no hook), and whether ``p.grad`` is its slot of the buffer again afterwards."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model.unused = torch.nn.Parameter(torch.ones(4))  # no gradient, ever: averaged as zeros
    sync = dist.GradSync(model, COMM, bucket_mb=1e-4)  # several buckets of a few parameters
    params = [p for p in model.parameters() if p is not model.unused] + [model.unused]
    gen = torch.Generator().manual_seed(100 + RANK)
    rows = []
    for how in ("usual", "set_to_none", "replaced", "usual"):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        own = torch.autograd.grad(loss, params[:-1], retain_graph=True)
        expected = [sum(g) / SIZE for g in zip(*COMM.allgather([g.numpy() for g in own]))] + [np.zeros(4)]
        if how == "set_to_none":
            model.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=False)
            if how == "replaced":
                params[0].grad = torch.zeros_like(params[0])
        sync.begin(0.0)
        sync.backward(loss)
        sync.finish()
        flat = sync._flat
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * 4
        rows.append({"how": how,
                     "max_diff": max(float(np.abs(p.grad.numpy() - e).max()) for p, e in zip(params, expected)),
                     "grads_in_buffer": all(lo <= p.grad.data_ptr() < hi for p in params)})
    if RANK == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "buckets": len(sync.buckets)}, f, indent=1)


if __name__ == "__main__":
    case, out = sys.argv[1], sys.argv[2]
    if case == "fault":  # its own abort_on_error is what that case tests: nothing here may stand in for it
        case_fault(out)
        sys.exit(0)
    try:
        {"train": case_train, "stop": case_stop, "spiking": case_spiking,
         "local": case_local, "grads": case_grads, "gns": case_gns, "renorm": case_renorm,
         "syncgroups": case_syncgroups, "balance": case_balance}[case](out)
    except BaseException:
        # A rank that fails must not leave the others waiting in a collective until the test's timeout
        # (420 s): print why, then end the whole job at once.
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        COMM.Abort(1)
