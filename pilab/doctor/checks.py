"""The checks: one ✔/✗ per host and check, each with a one-line fix (``CHECKS``).

What the doctor's parts share: its error, the probe's output markers, the checks and their limits.
"""
from __future__ import annotations

import os
import shlex
import sys

from ..launch import same_family


MARK = "PILAB-DOCTOR"  # the probe's result lines on the job's stdout start with this


HELLO = MARK + "-HELLO"  # its first line, printed before any import: the host answered


CHECKS = ("answers", "software", "mpi", "allreduce", "link", "iface", "data", "memory", "cpu", "speed",
          "clock", "controller", "placement")


CLOCK_LIMIT_S = 0.5  # event timestamps of different hosts are compared; NTP keeps boards within ms


HOT_C = 80.0  # the Pi 4B's firmware starts throttling at 80-85 °C


DETAILS = ("answers", "iface", "link", "memory", "cpu", "speed", "clock")  # the figures printed per host


SLOW_HOST = 0.85  # a host under 85% of the typical host's training speed: every step waits for it


SLOW_LINK = 0.5  # a link under half the median host's bandwidth (a 100 Mbit/s port, a bad cable)


class DoctorError(ValueError):
    """Bad input to the doctor (no hosts, a data path missing on the head…); the message names the fix."""


def _ok(detail: str) -> dict:
    return {"ok": True, "detail": detail, "fix": ""}


def _bad(detail: str, fix: str) -> dict:
    return {"ok": False, "detail": detail, "fix": fix}


def skipped(detail: str = "not checked: the host did not answer") -> dict:
    return {"ok": None, "detail": detail, "fix": ""}


def _gb(n) -> str:
    return f"{n / 1e9:.2f} GB"


def _software(p: dict, head: dict) -> dict:
    mine, ref = p.get("versions", {}), head.get("versions", {})
    diff = []
    for k in ("python", "torch", "numpy", "mpi4py", "snntorch"):
        if k in ref and mine.get(k) != ref.get(k):
            diff.append(f"{k} {mine.get(k)} (head: {ref.get(k)})")
    pm, pr = mine.get("pilab", {}), ref.get("pilab", {})
    for k in ("version", "commit", "source_sha256"):
        if pm.get(k) != pr.get(k):
            diff.append(f"pilab {k} {pm.get(k)} (head: {pr.get(k)})")
    if mine.get("executable") != ref.get("executable"):
        diff.append(f"python at {mine.get('executable')} (head: {ref.get('executable')})")
    if diff:
        return _bad("; ".join(diff), f"install the head's versions on this host: the same commit at the "
                                     f"same path, then ./lab.sh setup (pip install {_pins(ref)})")
    commit = pr.get("commit") or pr.get("source_sha256")
    return _ok(f"python {ref.get('python')}, torch {ref.get('torch')}, mpi4py {ref.get('mpi4py')}, "
               f"pilab {pr.get('version')}@{commit}")


def _pins(ref: dict) -> str:
    return " ".join(f"{k}=={ref[k]}" for k in ("torch", "numpy", "mpi4py", "snntorch")
                    if ref.get(k) and "cannot" not in str(ref[k]))


def host_checks(host, job, why, p, report, answered, peak, ranks=None) -> dict:
    """Every check of ``CHECKS`` but ``placement`` for one host, from its probe ``p`` (None: it did not answer);
    ``ranks``: the ranks its machine gets (``launch.ranks_on``; default ``ranks_per_node``)."""
    ranks = report["ranks_per_node"] if ranks is None else ranks
    if p is None:
        return _unanswered(host, job, why, report["launcher"])
    net = report.get("net") or {}
    c = {"answers": _ok(f"{p.get('hostname')} in {job.hello_s:.1f} s"),
         "software": _software(p, report["head"]), "mpi": _mpi(p, report, net)}
    c["allreduce"], c["link"] = _across(host, p, net, answered)
    c["iface"] = _iface(p, report, answered)
    c["data"] = _data(host, p.get("data", {}), report["head"].get("data", {}), report["data_path"])
    c["memory"] = _memory(p.get("memory", {}), ranks, peak)
    c["cpu"] = _cpu(p.get("cpu", {}), ranks, report["config"].get("threads", 0))
    c["speed"] = _speed(host, p, net, answered)
    c["controller"], c["clock"] = _talk(host, p, report)
    return c


def _unanswered(host, job, why, launcher) -> dict:
    rc = job.proc.returncode
    msg = job.last_error() or why or f"the probe exited {rc} without a result" + \
        (" (killed: out of memory?)" if rc in (-9, 137) else "")
    if why and job.hello_s is None and not job.last_error():
        msg = f"{why} through the launcher ({launcher})"
    fix = f"check that {host} is on and on the network, and that `ssh {host} true` works without " \
          "a password from the head (as mpiexec will run it)"
    if job.hello_s is not None:  # it started, then failed: its own output says why
        fix = f"run `{sys.executable} -m pilab.doctor.probe host` on {host} and read its error"
    return {"answers": _bad(msg, fix), **{k: skipped() for k in CHECKS[1:]}}


def _mpi(p, report, net) -> dict:
    """The MPI library mpi4py loads on this host vs the mpiexec the run uses."""
    lib, mpx = p.get("mpi", {}).get("library") or p.get("mpi", {}).get("error", "?"), \
        report["mpiexec_library"]
    mine = [r for r in net.get("ranks", []) if r.get("host") == p.get("hostname")]
    zero_of_one = any(r.get("size") == 1 and r.get("launcher_size", 0) > 1 for r in mine)
    if not same_family(lib, mpx) or zero_of_one:
        return _bad(f"mpi4py uses {lib}, but mpiexec {report['mpiexec']} is {mpx}"
                    + (": every rank is 0 of 1" if zero_of_one else ""),
                    "use the mpiexec of mpi4py's MPI (--mpiexec / PILAB_MPIEXEC), or reinstall mpi4py "
                    "against this one (pip install --no-binary mpi4py --force-reinstall mpi4py)")
    return _ok(f"{lib.split(',')[0]} = {mpx}")


def _across(host, p, net, answered) -> tuple[dict, dict]:
    """The job across all hosts: (allreduce, link)."""
    if not net.get("allreduce_ok"):
        return (_bad(f"the {net.get('np')}-rank job over {len(answered)} host(s) failed: "
                     f"{net.get('stopped') or net.get('error') or 'no sum'}",
                     "run `mpiexec -f HOSTFILE -n N hostname`; open the hosts' TCP ports "
                     "to each other (firewall) and give every host the same interface name"),
                skipped("not measured: no job across the hosts"))
    return _ok(f"{net['np']} ranks, one per host, sum correct"), _link(host, p, net, answered)


def _iface(p, report, answered) -> dict:
    iface = p.get("iface", {})  # toward the head's address on the hosts' network
    names = {(report["probes"][h] or {}).get("iface", {}).get("name") for h in answered}
    ucx = report["ucx_net_devices"]
    name = iface.get("name")
    if not name:
        return _bad(iface.get("error", "no interface toward the head"),
                    "give this host an address on the head's network")
    if ucx and ucx != "all" and name not in [d.split(":")[0] for d in ucx.split(",")]:
        return _bad(f"{name} ({iface.get('address')}), not in UCX_NET_DEVICES={ucx}",
                    f"export UCX_NET_DEVICES={','.join(sorted(n for n in names if n))}")
    if len(names) > 1:
        return _bad(f"{name} here; the hosts use {', '.join(sorted(map(str, names)))}",
                    f"give all hosts one interface name, or export UCX_NET_DEVICES="
                    f"{','.join(sorted(n for n in names if n))} (Hydra: -iface on the head)")
    return _ok(f"{name} ({iface.get('address')})")


def _memory(mem, rpn, peak) -> dict:
    free = mem.get("free")
    if free is None:
        return _bad("cannot read /proc/meminfo", "check the host's /proc")
    need = rpn * peak
    where = f" (cgroup limit {_gb(mem['cgroup']['limit'])})" if mem.get("cgroup") and \
        mem["cgroup"]["free"] <= (mem.get("available") or 1 << 62) else ""
    text = f"free {_gb(free)}{where}, {rpn} ranks x {_gb(peak)} predicted peak = {_gb(need)}"
    return _ok(text) if free >= need else _bad(
        text + " will not fit",
        f"fewer ranks per node (--ranks-per-node {max(1, int(free // peak))}), a smaller "
        "--batch-size or --width, or stop what else runs there")


def _talk(host, p, report) -> tuple[dict, dict]:
    """The round trips to the head's listener: (controller, clock)."""
    talk = p.get("head", {})
    if not talk.get("reachable"):
        return (_bad(f"{report['controller']} not reachable from {host}: {talk.get('error')}",
                     "set PILAB_CONTROLLER_IP to the head's address on the nodes' network "
                     "(not 127.0.0.1) and open its ports in the head's firewall"),
                skipped("not measured: the head's address is not reachable"))
    off = talk["offset_s"]
    text = f"{1e3 * off:+.2f} ms from the head (± {1e3 * talk['rtt_s'] / 2:.2f} ms)"
    return _ok(f"{report['controller']} reachable"), (_ok(text) if abs(off) <= CLOCK_LIMIT_S else _bad(
        text, "synchronise the clocks: sudo timedatectl set-ntp true (or install chrony) on every host"))


def _link(host, p, net, answered) -> dict:
    links = {int(k): v for k, v in (net.get("links") or {}).items()}
    idx = answered.index(host)
    if not links:
        return _ok("one host: no link to measure")
    if idx == 0:
        return _ok("rank 0's host: the others are measured against it")
    m = links.get(idx)
    if m is None:
        return _bad("not measured", "rerun the doctor")
    bw = [min(v["to_peer_Bps"], v["from_peer_Bps"]) for v in links.values()]
    median = sorted(bw)[len(bw) // 2]
    mine = min(m["to_peer_Bps"], m["from_peer_Bps"])
    text = (f"{1e6 * m['latency_s']:.0f} µs, {m['to_peer_Bps'] / 1e6:.0f} MB/s in, "
            f"{m['from_peer_Bps'] / 1e6:.0f} MB/s out")
    if len(bw) >= 2 and mine < SLOW_LINK * median:
        return _bad(text + f" (hosts' median {median / 1e6:.0f} MB/s)",
                    "check the cable, switch port and `ethtool eth0` speed/duplex on this host")
    return _ok(text)


def _data(host, mine, ref, path) -> dict:
    if not path:
        return _ok("no data file (--data)")
    copy = f"rsync -a {shlex.quote(path)}{'/' if os.path.isdir(path) else ''} " \
           f"{host}:{shlex.quote(path)}{'/' if os.path.isdir(path) else ''}"
    if mine.get("missing"):
        return _bad(f"{path} missing", f"copy it there: {copy}")
    if mine.get("error") or "sha256" not in mine:
        return _bad(f"{path}: {mine.get('error', 'not read')}", f"make it readable, or {copy}")
    if mine["sha256"] != ref.get("sha256"):
        return _bad(f"{path} differs (sha256 {mine['sha256'][:12]}…, head {ref.get('sha256', '?')[:12]}…)",
                    f"copy the head's: {copy}")
    return _ok(f"sha256 {mine['sha256'][:12]}… = head")


def _cpu(cpu: dict, rpn: int, threads: int) -> dict:
    cores = cpu.get("cores") or 0
    quota = cpu.get("quota_cores")
    if quota:
        cores = min(cores, quota)
    per = max(1, int(threads or 0))
    need = rpn * per
    freq = f"{cpu['freq_mhz']:.0f}/{cpu['max_mhz'] or 0:.0f} MHz" if cpu.get("freq_mhz") else "freq n/a"
    if cpu.get("cap_mhz") and cpu.get("max_mhz") and cpu["cap_mhz"] < cpu["max_mhz"]:
        freq += f" (capped at {cpu['cap_mhz']:.0f})"
    temp = f", {cpu['temp_c']:.0f} °C" if cpu.get("temp_c") is not None else ""
    text = f"{cores:g} cores{' (CPU quota)' if quota and quota <= cores else ''} for {rpn} ranks x " \
           f"{per} threads, {freq}{temp}"
    if cores < need:
        fix = f"--threads {int(cores // rpn)}" if cores >= rpn else \
            f"--ranks-per-node {max(1, int(cores))}{', or lift the CPU quota' if quota else ''}"
        return _bad(text, fix)
    thr = cpu.get("throttled")
    if thr:  # vcgencmd bits: 0 under-voltage, 1 arm frequency capped, 2 throttled, 3 soft temp limit (now)
        return _bad(text + f", vcgencmd get_throttled=0x{thr:x}",
                    "a 5.1 V / 3 A power supply (under-voltage) and a heatsink or fan (throttling)")
    if cpu.get("temp_c") is not None and cpu["temp_c"] >= HOT_C:
        return _bad(text, "cool the board (heatsink, fan): it throttles at 80-85 °C")
    return _ok(text)


def _speed(host, p, net, answered) -> dict:
    """This host's speed on the run's training step (the net job's ``step_speed``, every host at once)
    against the typical host's (the median; the faster of the two middle ones): a host under ``SLOW_HOST`` of
    it holds every step of the run back. The median, not the fastest, so that one lucky or faster board does
    not make every other host "slow" (23 Pi 4s beside a Pi 5; a shared machine's noise on a testbed)."""
    speeds = net.get("speeds")
    if not speeds:
        return skipped("not measured" + ("" if net.get("allreduce_ok") else ": no job across the hosts"))
    by_host = dict(zip(answered, speeds)) if len(answered) > 1 else {answered[0]: speeds[0]}
    mine = by_host.get(host) or {"error": "no measurement"}
    if "images_per_s" not in mine:
        return _bad(f"the run's training step did not run here: {mine.get('error')}",
                    f"run `{sys.executable} -m pilab train --epochs 1 --max-steps 2` on {host} and read its error")
    rates = {h: s["images_per_s"] for h, s in by_host.items() if "images_per_s" in s}
    ranked = sorted(rates, key=rates.get)
    typical = ranked[len(ranked) // 2]  # the median host (the faster middle one of an even count)
    rel = rates[host] / rates[typical]
    text = (f"{rates[host]:.1f} images/s a rank ({mine['batch']} a step on {mine['cores']:g} core(s); "
            f"{mine['wall_images_per_s']:.1f} by the wall clock)"
            + ("" if host == typical else f", {100 * rel:.0f}% of {typical}'s (the median host)"))
    if rel >= SLOW_HOST:
        return _ok(text)
    slow = [h for h, r in rates.items() if r < SLOW_HOST * rates[typical]]
    now, without = len(rates) * min(rates.values()), (len(rates) - len(slow)) * min(
        r for h, r in rates.items() if h not in slow)
    why, fix = _slow_why(host, p.get("hostname") or host, mine, p.get("cpu", {}))
    return _bad(f"{text}: {why}; every step waits for it",
                f"{fix}; or give it a share of each step by its speed: `--sharding reshuffle --balance static` "
                f"(docs/guide/mixed-cluster.md); or leave {', '.join(slow)} out of the hostfile: with one rank a host "
                f"the others then "
                f"train {without:.0f} images/s in all, not {now:.0f}")


def _slow_why(host, name, mine: dict, cpu: dict) -> tuple[str, str]:
    """Why a host trains slowly, from what it measured under load and said about its CPU, and the fix
    (``name``: the host's own hostname)."""
    quota = mine.get("quota_cores")
    if quota and quota < mine["threads"]:
        return (f"a CPU quota of {quota:g} cores for {mine['threads']} thread(s) (it held the timed steps back "
                f"{mine.get('quota_held_s') or 0:.1f} s)",
                f"lift the CPU quota of {host}'s cgroup (cpu.max or cpu.cfs_quota_us; a testbed node: "
                f"`testbed throttle {name} none`) or run fewer threads there")
    thr = cpu.get("throttled") or 0
    if thr & 0xE or (cpu.get("temp_c") or 0) >= HOT_C:  # vcgencmd: arm capped, throttled, soft temp limit
        return (f"throttled (vcgencmd get_throttled=0x{thr:x}, {cpu.get('temp_c') or 0:.0f} °C)",
                f"cool {host} (heatsink, fan: a Pi throttles at 80-85 °C)")
    if cpu.get("cap_mhz") and cpu.get("max_mhz") and cpu["cap_mhz"] < 0.9 * cpu["max_mhz"]:
        return (f"its clock is capped at {cpu['cap_mhz']:.0f} of {cpu['max_mhz']:.0f} MHz (cpufreq scaling_max_freq)",
                f"cool {host} or raise its cap (its cpufreq policy's scaling_max_freq)")
    if mine.get("freq_mhz") and mine.get("max_mhz") and mine["freq_mhz"] < 0.9 * mine["max_mhz"]:
        return (f"its CPU ran at {mine['freq_mhz']:.0f} of {mine['max_mhz']:.0f} MHz under load",
                f"cool {host} and check its power supply and cpufreq governor (performance)")
    return ("a slower board (each step takes more CPU time)",
            f"keep {host} as it is")
