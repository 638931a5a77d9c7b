"""Training over real MPI ranks: each case launches `mpiexec -n K python tests/mpi_worker.py ...`
(one thread per rank) and asserts on the measurements rank 0 wrote."""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import MPIEXEC, mpi_env

HERE = Path(__file__).parent
pytestmark = pytest.mark.mpi


def launch(np_, case, out, timeout=420, **env):
    cmd = [MPIEXEC, "-n", str(np_), sys.executable, str(HERE / "mpi_worker.py"), case, str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(**env))


def _processes_of_job(tag: str, out: str) -> list:
    """Live processes of one job (its ranks, hydra proxies): those whose environment carries ``tag``
    (mpiexec passes it on to the ranks) or whose command line names the job's output file."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            if out in " ".join(proc.info["cmdline"] or ()) or proc.environ().get("PILAB_TEST_JOB") == tag:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def case_at(np_: int, case: str, tmp_path_factory) -> tuple[int, dict]:
    """(np, what rank 0 wrote) of one mpi_worker case at np ranks; its exit status checked."""
    out = tmp_path_factory.mktemp(f"{case}{np_}") / "res.json"
    p = launch(np_, case, out)
    assert p.returncode == 0, p.stderr[-3000:]
    return np_, json.loads(out.read_text())


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def measured(request, tmp_path_factory):
    return case_at(request.param, "train", tmp_path_factory)


def test_matches_single_process_average_of_rank_gradients(measured):
    np_, r = measured
    assert r["steps_run"] == 20
    assert r["param_diff_vs_reference"] <= 1e-5
    assert r["per_rank_state_diff_vs_reference"] <= 1e-5  # parameters and every rank's own buffers
    assert r["buffer_diff_vs_reference_rank0"] <= 1e-5


def test_a_rank_holds_only_its_shard_of_the_training_images(measured):
    np_, r = measured
    held = r["held_images"]
    assert len(held) == np_
    n = held[0]["train_labels"]
    for h in held:
        assert h["session_train_images"] == 0  # the whole set was dropped once the shard was copied
        assert h["loader_images"] == h["shard_size"] and h["shard_size"] <= -(-n // np_)
    assert sum(h["shard_size"] for h in held) == n


def test_a_rank_holds_only_its_share_of_the_test_images(measured):
    np_, r = measured
    held = r["held_images"]
    n = held[0]["test_labels"]
    # the ranks' rows tile the test set in rank order, each the rows its evaluation reads
    starts = [h["test_rows"][0] for h in held]
    stops = [h["test_rows"][1] for h in held]
    assert starts[0] == 0 and stops[-1] == n and starts[1:] == stops[:-1]
    assert max(b - a for a, b in zip(starts, stops)) <= -(-n // np_)
    for h in held:
        assert h["test_rows_equal"] and h["test_rest_zero"]  # its own rows as loaded; the rest never written
        assert h["eval_equal"]  # the same loss and accuracy as evaluating the whole loaded set


def test_buffers_identical_after_sync(measured):
    _, r = measured
    assert r["ranks_differ_before_sync"], "per-rank BN statistics should differ before the sync"
    assert r["ranks_identical_after_sync"]


def test_sample_accounting_on_real_ranks(measured):
    np_, r = measured
    for policy in ("static", "reshuffle"):
        a = r[f"accounting_{policy}"]
        assert len(set(a["steps"])) == 1, "every rank must take the same number of steps"
        for ep in a["per_epoch"]:
            assert ep["unique"] == ep["used"], "a sample was used twice in an epoch"
            assert ep["used"] == a["steps"][0] * a["batch"] * np_
            assert ep["leftover"] == a["reported"]["leftover"] == a["n"] - ep["used"]
        if policy == "reshuffle":
            assert a["reported"]["leftover"] < np_ * a["batch"]
    assert r["accounting"]["sharding"] == "static"


def test_first_bucket_posted_before_backward_ends(measured):
    _, r = measured
    assert r["buckets"] > 1
    assert r["first_post_before_backward_end"]
    assert 0 < r["comm_exposed"] <= r["comm_total"]


def test_fp16_compression_halves_bytes_and_keeps_loss(measured):
    _, r = measured
    assert r["bytes_fp16"] * 2 == r["bytes_fp32"]
    # 20 steps from the same start: fp16 gradients move the loss by well under 5%.
    assert abs(r["final_loss_fp16"] - r["final_loss_fp32"]) <= 0.05 * r["final_loss_fp32"]


def test_sync_batchnorm_equals_batchnorm_on_concatenated_batch(measured):
    _, r = measured
    for k, v in r["syncbn"].items():
        assert v <= 1e-5, (k, v)
    assert r["syncbn_train_loss_finite"]


def test_the_simulator_runs_sync_batchnorm_as_mpi_does_to_float_rounding(measured):
    """bn=sync in the simulator: every virtual rank in one forward, BatchNorm over the global batch. Not
    bitwise (MPI sums the statistics per rank in float64), and this small model's first gradient is
    chaotic at initialisation (a 1e-6 change of the input images moves it by ~4%, float32 against float64
    by ~7%: docs/simulator.md), so the first update is compared as a relative distance: within that
    noise of MPI's, while the simulator's bn=local -- another rule -- is as far from it as a new vector."""
    np_, r = measured
    s = r["syncbn_simulator"]
    assert s["sync_chunk"] == np_  # one forward over all ranks (bn=local: one rank per forward)
    assert s["sync_loss"] == pytest.approx(s["loss"], rel=1e-5)
    assert s["sync"] <= 0.15, s
    assert s["local"] >= 0.5, s


@pytest.mark.parametrize("mode", ["exact", "fast", "auto"])
def test_every_simulate_mode_takes_mpis_first_step(measured, mode):
    """bn=local, one step from the same start: the exact mode's update is MPI's bit for bit; the fast mode
    (every rank's images in one forward, per-rank BatchNorm vectorised) the same mathematics to float
    rounding: the same loss to 1e-5 and the update within the first-gradient noise of this small model
    (docs/simulator.md: ~4% for a 1e-6 change of the images); auto runs fast here."""
    np_, r = measured
    m = r["modes_first_step"]
    used = "fast" if mode == "auto" else mode
    assert m[mode]["used"] == used
    assert m[mode]["chunk"] == (1 if used == "exact" else np_)
    if used == "exact":
        assert m[mode]["update"] == 0.0 and m[mode]["loss"] == m["loss"]
    else:
        assert m[mode]["loss"] == pytest.approx(m["loss"], rel=1e-5)
        assert m[mode]["update"] <= 0.15, m


def test_simulator_matches_mpi_run(measured):
    _, r = measured
    assert max(r["simulator_diff_per_rank"]) <= 1e-5, r["simulator_diff_per_rank"]


def test_bn_buffer_policy_average_matches_the_mean_of_rank_statistics(measured):
    _, r = measured
    assert r["average_differs_from_rank0"]
    assert r["average_buffers_diff_vs_reference_mean"] <= 1e-5
    assert r["average_params_diff_vs_reference"] <= 1e-5
    assert max(r["simulator_average_diff_per_rank"]) <= 1e-5, r["simulator_average_diff_per_rank"]


def test_failing_rank_aborts_the_job(tmp_path):
    """Rank 1 raises; the job must end by itself (not hang until the timeout), fail, and leave no rank
    behind. How fast it ends is not asserted: this machine is shared."""
    import psutil

    out, tag = str(tmp_path / "x.json"), uuid.uuid4().hex
    try:
        # TimeoutExpired here means the surviving ranks were left waiting: the abort did not happen
        p = launch(3, "fault", out, timeout=300, PILAB_TEST_JOB=tag)
        assert p.returncode != 0
        assert "injected failure on rank 1" in p.stderr
        assert "aborting all 3 ranks" in p.stderr
        # mpiexec has returned: none of its ranks or proxies may still run (a short grace for the
        # kernel to finish tearing them down, which is not a timing claim)
        _, alive = psutil.wait_procs(_processes_of_job(tag, out), timeout=10)
        assert not alive, [(q.pid, q.info["cmdline"]) for q in alive]
    finally:
        for q in _processes_of_job(tag, out):  # whatever a failure above left behind
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass


def test_stop_on_one_rank_stops_all_after_the_same_step(tmp_path):
    out = tmp_path / "stop.json"
    p = launch(2, "stop", out, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["steps_per_rank"] == [4, 4]
    assert r["stopped"]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def local_run(request, tmp_path_factory):
    return case_at(request.param, "local", tmp_path_factory)


def test_local_sgd_ranks_hold_their_own_weights_until_an_average(local_run):
    _, r = local_run
    assert r["apart_max_diff"] > 1e-3  # a local step is each rank's own
    assert r["together_max_diff"] == 0.0  # an average leaves one model on every rank
    assert r["average_step"] > r["first_local_step"]


def test_simulator_matches_mpi_run_with_local_sgd_and_the_few_step_recipe(local_run):
    _, r = local_run
    assert max(r["simulator_diff_per_rank"]) <= 1e-5, r["simulator_diff_per_rank"]
    assert r["train_loss_diff"] <= 1e-5
    assert r["test_loss_diff"] <= 1e-5
    assert r["test_acc"] == r["simulator_test_acc"]


def test_local_sgd_resumes_between_two_averages_as_if_never_stopped(local_run):
    _, r = local_run
    assert r["resumed_from_step"] == r["first_local_step"] + 1
    assert max(r["resume_diff_per_rank"]) == 0.0, r["resume_diff_per_rank"]


@pytest.mark.parametrize("np_", [2, 3])
def test_a_noise_driven_ramp_chooses_the_same_batches_on_every_rank_and_in_the_simulator(np_, tmp_path_factory):
    _, r = case_at(np_, "gns", tmp_path_factory)
    first = r["ranks"][0]
    assert all(x == first for x in r["ranks"])  # every rank measured the same noise, chose the same batches
    assert first["chosen"], first  # ... and the ramp did grow the batch (the noise scale allows it here)
    assert first["plan"] == r["simulator"]["plan"] and first["chosen"] == r["simulator"]["chosen"]
    assert first["noise"][:-1] == pytest.approx(r["simulator"]["noise"][:-1], rel=1e-4)
    assert max(r["simulator_diff_per_rank"]) <= 1e-5, r["simulator_diff_per_rank"]
    assert r["test_acc"] == r["simulator_test_acc"]
    assert r["lr"] == pytest.approx(r["simulator_lr"], rel=1e-9)


@pytest.mark.parametrize("np_", [2, 3])
def test_batch_renormalization_is_exact_in_the_simulator(np_, tmp_path_factory):
    _, r = case_at(np_, "renorm", tmp_path_factory)
    spe = r["steps_per_epoch"]
    assert r["renorm"] == [spe, 2 * spe]  # plain BatchNorm for the first epoch (warmup < 1), then widened
    assert r["limits"] == [[1.0, 0.0], [1.0, 0.0], [3.0, 5.0], [3.0, 5.0]]
    assert max(r["simulator_diff_per_rank"]) == 0.0, r["simulator_diff_per_rank"]
    assert r["test_acc"] == r["simulator_test_acc"]
    # the corrections did act: the same run with plain BatchNorm ends elsewhere
    assert r["test_loss"][-1] != r["plain_test_loss"][-1]


@pytest.mark.mpi
def test_gradients_backward_put_elsewhere_are_averaged_all_the_same(tmp_path_factory):
    """GradSync's quick check that every gradient is already its slot of the buffer, and the slow path
    behind it: new gradient tensors after zero_grad(set_to_none=True), one replaced by hand, a parameter
    with no gradient at all -- each step's p.grad is the mean of the ranks' own, and its slot again."""
    _, r = case_at(2, "grads", tmp_path_factory)
    assert r["buckets"] > 1
    assert [x["how"] for x in r["rows"]] == ["usual", "set_to_none", "replaced", "usual"]
    for x in r["rows"]:
        assert x["max_diff"] <= 1e-6, x
        assert x["grads_in_buffer"], x


@pytest.mark.mpi
def test_sync_batchnorm_in_groups_of_ranks_runs_the_same_in_the_simulator(tmp_path_factory):
    """bn_group=2 at np=4: each pair of ranks normalises over its 8 images (BatchNorm on the pair's batch,
    forward, backward and running statistics); the simulator's one forward with BatchNorm per pair of virtual
    ranks takes the same first step to float rounding (see the bn=sync test above for why a relative
    distance), while SyncBatchNorm over all 4 ranks and per-rank BatchNorm are other rules, as far from it as
    a new vector; every rank's running statistics as MPI's, the pairs' differing before they are settled."""
    _, r = case_at(4, "syncgroups", tmp_path_factory)
    assert r["syncbn"].pop("group_size") == 2
    for k, v in r["syncbn"].items():
        assert v <= 1e-5, (k, v)
    s = r["simulator"]
    assert s["groups_loss"] == pytest.approx(s["loss"], rel=1e-5)
    assert s["groups"] <= 0.15, s
    assert s["all"] >= 0.5 and s["local"] >= 0.5, s
    assert s["buffers"] <= 1e-4, s
    assert r["broadcast_vs_average"] > 1e-3  # the two pairs' statistics did differ
