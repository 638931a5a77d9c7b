"""Energy: the power model by hand, RAPL counters from a fake powercap tree (the kernel's file format),
an external meter's CSV logs joined to a real run's timeline, energy to target, and the neuromorphic
estimate. Plain pytest, one process.

    python -m pytest -q tests/test_energy.py
"""
import json

import pytest
import torch

from pilab.study import energy
from pilab.config import Config
from pilab.study.energy import PowerModel
from pilab import engine

torch.set_num_threads(1)
PI = energy.POWER_MODELS["pi4b"]


def _result(np_=4, times=(10.0, 10.0), comm_exposed=(0.0, 0.0), accs=(0.2, 0.4), eval_time=2.0, t0=1000.0):
    epochs, t = [], t0
    for time_, comm, acc in zip(times, comm_exposed, accs):
        epochs.append({"time": time_, "comm_exposed": comm, "test_acc": acc, "eval_time": eval_time,
                       "started_at": t})
        t += time_ + eval_time
    return {"np": np_, "threads": 1, "epochs": epochs, "started_at": t0, "ended_at": t}


# --- the power model ---------------------------------------------------------------------------
def test_pi_preset_is_the_documented_board_figures():
    assert PI.idle_w == pytest.approx(0.6 * 5.1) and PI.load_w == pytest.approx(1.2 * 5.1)
    assert (PI.nodes, PI.ranks_per_node, PI.cores_per_node) == (24, 2, 4)
    assert PI.node_power(0) == PI.idle_w and PI.node_power(4) == PI.load_w == PI.node_power(9)
    assert PI.node_power(2) == pytest.approx((PI.idle_w + PI.load_w) / 2)


def test_power_model_round_trips_and_refuses_bad_input(tmp_path):
    custom = PowerModel(name="box", idle_w=40, load_w=120, cores_per_node=8, nodes=1, switch_w=0)
    assert PowerModel.from_dict(json.loads(json.dumps(custom.to_dict()))) == custom
    path = tmp_path / "power.json"
    path.write_text(json.dumps(custom.to_dict()))
    assert energy.resolve_power(str(path)) == custom
    assert energy.resolve_power("pi4b") is PI and energy.resolve_power(None) is PI
    assert energy.resolve_power({"switch_w": 5.0}).switch_w == 5.0
    with pytest.raises(ValueError, match="unknown PowerModel field"):
        PowerModel.from_dict({"idle": 3})
    with pytest.raises(ValueError, match="idle_w <= load_w"):
        PowerModel(idle_w=7, load_w=6)
    with pytest.raises(ValueError, match="unknown power model 'nope'"):
        energy.resolve_power("nope")


def test_modelled_energy_by_hand():
    # np=4: 2 boards x 2 ranks x 2 threads = every core busy; both boards at load, plus the switch
    e = energy.energy_of_run(_result(4))
    per_epoch = (2 * PI.load_w + PI.switch_w) * 10.0
    assert e["energy_per_epoch_j"] == pytest.approx([per_epoch, per_epoch])
    assert e["energy_j"] == pytest.approx(2 * per_epoch)
    assert e["mean_power_w"] == pytest.approx(2 * PI.load_w + PI.switch_w)
    assert e["source"] == "model:pi4b"
    a = e["assumptions"]
    assert (a["nodes_used"], a["ranks_on_nodes"], a["threads_per_rank"], a["switch"]) == (2, [2, 2], 2, True)
    # the whole cluster powered: the 22 unused boards idle
    c = energy.energy_of_run(_result(4), count="cluster")
    assert c["energy_per_epoch_j"][0] == pytest.approx(per_epoch + 22 * PI.idle_w * 10.0)
    assert c["assumptions"]["nodes_counted"] == 24


def test_partly_used_boards_waiting_ranks_and_single_node():
    # np=3: a full board and a board with one rank of 2 threads (half its cores)
    e = energy.energy_of_run(_result(3, times=(1.0,), comm_exposed=(0.0,), accs=(0.3,)))
    assert e["energy_j"] == pytest.approx(PI.load_w + PI.node_power(2) + PI.switch_w)
    # half the epoch waiting: a rank keeps 1 of its 2 threads busy -> 1.5 busy threads per rank
    w = energy.energy_of_run(_result(2, times=(4.0,), comm_exposed=(2.0,), accs=(0.3,)))
    assert w["energy_j"] == pytest.approx(PI.node_power(3.0) * 4.0)  # one board: no switch
    assert w["assumptions"]["node_utilisation"] == [0.75]
    # np=1 on a Pi: one rank with the board's 4 threads; the run's own threads on request
    one = energy.energy_of_run(_result(1, times=(2.0,), comm_exposed=(0.0,), accs=(0.3,)))
    assert one["energy_j"] == pytest.approx(PI.load_w * 2.0)
    own = energy.energy_of_run(_result(1, times=(2.0,), comm_exposed=(0.0,), accs=(0.3,)), threads=1)
    assert own["energy_j"] == pytest.approx(PI.node_power(1) * 2.0)
    with pytest.raises(ValueError, match="does not fit 24 nodes"):
        energy.energy_of_run(_result(49))
    with pytest.raises(ValueError, match="count='all'"):
        energy.energy_of_run(_result(2), count="all")


def test_predicted_times_evaluation_and_energy_to_target():
    r = _result(8, times=(1.0, 1.0, 1.0), comm_exposed=(0, 0, 0), accs=(0.1, None, 0.5))
    p = energy.energy_of_run(r, epoch_times=[5.0, 5.0, 5.0], comm_exposed_share=0.0)
    watts = 4 * PI.load_w + PI.switch_w
    assert p["energy_per_epoch_j"] == pytest.approx([5 * watts] * 3)
    assert p["assumptions"]["times"].startswith("given")
    ev = energy.energy_of_run(r, include_eval=True)
    assert ev["energy_per_epoch_j"][0] == pytest.approx(watts * (1.0 + 2.0))
    assert energy.energy_to_target(r, 0.5, p["energy_per_epoch_j"]) == pytest.approx(15 * watts)
    assert energy.energy_to_target(r, 0.1, p["energy_per_epoch_j"]) == pytest.approx(5 * watts)
    assert energy.energy_to_target(r, 0.6, p["energy_per_epoch_j"]) is None  # not reached: no number
    assert energy.energy_to_target(r, 0.5, epoch_times=[5.0] * 3) == pytest.approx(15 * watts)
    with pytest.raises(ValueError, match="2 epoch_times for 3 epochs"):
        energy.energy_of_run(r, epoch_times=[1.0, 1.0])


# --- RAPL: a fake /sys/class/powercap in the kernel's layout ----------------------------------------
def _zone(root, zone, name, energy_uj, max_uj=262143328850):
    d = root / zone
    d.mkdir(parents=True, exist_ok=True)
    (d / "name").write_text(name + "\n")
    (d / "energy_uj").write_text(f"{energy_uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    (d / "enabled").write_text("1\n")
    return d


@pytest.fixture
def powercap(tmp_path):
    root = tmp_path / "powercap"
    (root / "intel-rapl").mkdir(parents=True)  # the control type: not a zone
    _zone(root, "intel-rapl:0", "package-0", 5_000_000)
    _zone(root, "intel-rapl:0:0", "core", 3_000_000)  # inside package-0
    _zone(root, "intel-rapl:0:1", "dram", 1_000_000)  # outside the package
    _zone(root, "intel-rapl:1", "package-1", 262_143_000_000)  # about to wrap
    _zone(root, "intel-rapl:2", "psys", 9_000_000)  # the platform, contains the packages
    _zone(root, "intel-rapl-mmio:0", "package-0", 5_000_000)  # the same package through MMIO
    return root


def test_rapl_reads_package_zones_only(powercap):
    r = energy.read_rapl(str(powercap))
    assert sorted(r["zones"]) == ["intel-rapl:0", "intel-rapl:1"]
    assert r["zones"]["intel-rapl:0"] == {"name": "package-0", "energy_uj": 5_000_000,
                                          "max_energy_range_uj": 262143328850}
    with_dram = energy.read_rapl(str(powercap), include_dram=True)
    assert sorted(with_dram["zones"]) == ["intel-rapl:0", "intel-rapl:0:1", "intel-rapl:1"]


def test_rapl_window_and_wrap_around(powercap):
    with energy.RaplWindow(str(powercap)) as w:
        (powercap / "intel-rapl:0" / "energy_uj").write_text("7500000\n")  # +2.5 J
        (powercap / "intel-rapl:1" / "energy_uj").write_text("671149\n")  # wrapped: +1.0 J
    assert w.available
    wrapped = 262143328850 + 1 - 262_143_000_000 + 671149
    assert wrapped == 1_000_000
    assert w.energy_j == pytest.approx(2.5 + 1.0)
    d = w.to_dict()
    assert d["source"] == "rapl" and d["zones"] == ["intel-rapl:0", "intel-rapl:1"]
    result = _result(2, times=(3.0, 1.0), comm_exposed=(0, 0), accs=(0.2, 0.3))
    d["started_at"], d["ended_at"] = 0.0, 5.0  # a 5 s window -> 0.7 W mean
    e = energy.energy_of_run(result, rapl=d)
    assert e["source"] == "rapl" and e["energy_j"] == pytest.approx(3.5)
    assert e["energy_per_epoch_j"] == pytest.approx([0.7 * 3.0, 0.7 * 1.0])


def test_rapl_absent_or_unreadable_falls_back_to_the_model(tmp_path, powercap):
    with energy.RaplWindow(str(tmp_path / "no-such-dir")) as w:
        pass
    assert not w.available and w.energy_j is None
    assert energy.energy_of_run(_result(2), rapl=w)["source"] == "model:pi4b"
    # energy_uj readable by root only (Linux >= 5.10): here, a zone whose counter cannot be opened
    for zone in ("intel-rapl:0", "intel-rapl:1"):
        (powercap / zone / "energy_uj").unlink()
        (powercap / zone / "energy_uj").mkdir()
    assert energy.read_rapl(str(powercap)) is None
    energy.read_rapl()  # this machine: a reading or None, never an error


# --- an external meter's log ---------------------------------------------------------------------
INA219_LOG = """\
# ina219-logger v1, 1 Hz per board; bus voltage, current, power as the INA219 reports them
timestamp,node,bus_voltage_v,current_ma,power_mw
2026-03-02T10:00:00.000,pi01,5.08,600,3048
2026-03-02T10:00:00.000,pi02,5.08,590,2997
2026-03-02T10:00:01.000,pi01,5.06,1200,6072
2026-03-02T10:00:01.000,pi02,5.07,1180,5983
2026-03-02T10:00:02.000,pi01,5.06,1200,6072
2026-03-02T10:00:02.000,pi02,5.07,1180,5983
2026-03-02T10:00:03.000,pi01,5.08,600,3048
2026-03-02T10:00:03.000,pi02,5.08,590,2997
"""


def test_meter_csv_long_format_ina219(tmp_path):
    path = tmp_path / "power.csv"
    path.write_text(INA219_LOG)
    s = energy.read_meter_csv(str(path))
    assert sorted(s) == ["pi01", "pi02"]
    from datetime import datetime
    t0 = datetime.fromisoformat("2026-03-02T10:00:00").timestamp()  # naive: local time
    assert s["pi01"][0] == (t0, pytest.approx(3.048)) and len(s["pi01"]) == 4
    # trapezoids: pi01 (3.048+6.072)/2 + 6.072 + (6.072+3.048)/2 = 15.192 J over 3 s
    assert energy.meter_energy(s, t0, t0 + 3, nodes=["pi01"]) == pytest.approx(15.192)
    # half-way points are interpolated: [0.5, 1.5] s of pi01
    mid = (3.048 + 6.072) / 2
    assert energy.meter_energy(s, t0 + 0.5, t0 + 1.5, nodes=["pi01"]) == pytest.approx(
        0.5 * (mid + 6.072) / 2 + 0.5 * 6.072)
    both = energy.meter_energy(s, t0, t0 + 3)
    assert both == pytest.approx(15.192 + (2.997 + 5.983) / 2 + 5.983 + (5.983 + 2.997) / 2)


def test_meter_csv_wide_format_unix_seconds_and_smart_plug_milliseconds(tmp_path):
    wide = tmp_path / "wide.csv"
    wide.write_text("timestamp,pi01,pi02,switch_mw\n100.0,3.0,3.0,9000\n110.0,6.0,5.0,9000\n")
    s = energy.read_meter_csv(str(wide))
    assert sorted(s) == ["pi01", "pi02", "switch_mw"]
    assert energy.meter_energy(s, 100.0, 110.0) == pytest.approx(45.0 + 40.0 + 90.0)
    plug = tmp_path / "plug.csv"  # one device, times in ms since the epoch, apower in W
    plug.write_text("ts,apower\n1772445600000,4.0\n1772445602000,8.0\n")
    p = energy.read_meter_csv(str(plug))
    assert list(p) == ["plug"] and p["plug"][0] == (1772445600.0, 4.0)
    assert energy.meter_energy(p, 1772445600.0, 1772445602.0) == pytest.approx(12.0)


def test_meter_refuses_logs_that_do_not_cover_the_run(tmp_path):
    path = tmp_path / "power.csv"
    path.write_text("timestamp,node,watts\n0,a,1\n5,a,1\n40,a,1\n41,a,1\n")
    s = energy.read_meter_csv(str(path))
    assert energy.meter_energy(s, 0, 5) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="covers 0.0..41.0, not the window 100.0..110.0"):
        energy.meter_energy(s, 100, 110)
    with pytest.raises(ValueError, match="35.0 s gap"):
        energy.meter_energy(s, 2, 41)
    bad = tmp_path / "bad.csv"
    bad.write_text("when,watts\n1,2\n")
    with pytest.raises(ValueError, match="no time column"):
        energy.read_meter_csv(str(bad))


def test_meter_joined_to_a_real_runs_timeline(tmp_path):
    """A real (simulated, 2-rank) run records wall-clock epoch starts; a meter log spanning it gives
    each epoch its own energy."""

    cfg = Config(width=0.25, train_subset=64, test_subset=32, batch_size=8, epochs=2, threads=1)
    result = engine.simulate(cfg, 2)
    assert result["started_at"] <= result["epochs"][0]["started_at"] < result["epochs"][1]["started_at"]
    assert result["epochs"][1]["started_at"] <= result["ended_at"]
    path = tmp_path / "power.csv"
    t0, t1 = result["started_at"] - 1, result["ended_at"] + 1
    n = 50
    rows = [f"{t0 + (t1 - t0) * i / n:.6f},{node},{w}" for i in range(n + 1)
            for node, w in (("pi01", 5.0), ("pi02", 4.0))]
    path.write_text("timestamp,node,watts\n" + "\n".join(rows) + "\n")
    e = energy.energy_of_run(result, meter=str(path))
    assert e["source"] == "meter:power.csv"
    assert e["energy_per_epoch_j"] == pytest.approx([9.0 * ep["time"] for ep in result["epochs"]], rel=1e-6)
    assert energy.energy_of_run(result)["source"] == "model:pi4b"
    with pytest.raises(ValueError, match="no epoch start times"):
        energy.energy_of_run({**result, "epochs": [{"time": 1.0}]}, meter=str(path))


# --- a spiking net on neuromorphic hardware ----------------------------------------------------
def test_neuromorphic_energy_figures():
    ops = {"synops_per_image": 1e6, "macs_per_image": 1e5, "dense_macs_per_image": 2e7}
    h = energy.neuromorphic_energy(ops)
    assert h["energy_per_image_j"] == pytest.approx(1e6 * 0.9e-12 + 1e5 * 4.6e-12)
    assert h["dense_energy_per_image_j"] == pytest.approx(2e7 * 4.6e-12)
    assert h["source"] == "estimate:horowitz45nm" and "Horowitz" in h["citation"]
    loihi = energy.neuromorphic_energy(ops, "loihi", images=1000)
    assert loihi["energy_j"] == pytest.approx(1000 * (1e6 * 23.6e-12 + 1e5 * 4.6e-12))
    custom = energy.neuromorphic_energy(ops, synop_j=1e-12)
    assert custom["source"].endswith("+custom") and custom["synop_j"] == 1e-12
    with pytest.raises(ValueError, match="hardware='tpu'"):
        energy.neuromorphic_energy(ops, "tpu")


def test_neuromorphic_energy_of_a_measured_spiking_net():
    from pilab.models import build_model, synaptic_ops

    torch.manual_seed(0)
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    ops = synaptic_ops(build_model("spiking_cnn", width=0.25), x, train=True)
    e = energy.neuromorphic_energy(ops)
    assert 0 < e["energy_per_image_j"] < e["dense_energy_per_image_j"]
    assert e["synops_per_image"] == ops["synops_per_image"] > 0
