"""The doctor's rank side: what one host says about itself, and the one job across all hosts.

``pilab.doctor`` launches it through the same ``mpiexec`` (launcher, hostfile, interface settings) a
run will use, and reads one JSON line from its stdout (no shared file system needed)::

    mpiexec -f one-host -n 1 python -m pilab.doctor.probe host --data PATH --head 10.0.0.1:5555
    mpiexec -f one-per-host -n 3 python -m pilab.doctor.probe net

``host``: versions, the MPI library mpi4py loads, the interface toward the head, the data file's
SHA-256, memory (``/proc/meminfo`` and the cgroup limit), CPU, and a few timestamped round trips to the
head's listener (the address the Pi profile's controller advertises: reachable, and the clock offset).
``net``: an Allreduce across every rank (one per host), the link between rank 0 and each other rank
(latency, bandwidth both ways), ``perfmodel.comm_bench`` (the format ``perfmodel calibrate
--inter-bench`` reads) and each host's speed on the run's own training step (``step_speed``: every host
at once, hosts that are one machine one after the other). Each section that fails says why in its own field; the probe still answers.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

from ..files import sha256_tree
from .checks import HELLO, MARK  # the head reads the lines that start with these from the job's stdout


def say(kind: str, obj) -> None:
    print(f"{kind} {json.dumps(obj)}", flush=True)


# ----------------------------------------------------------------------------------------------
# host
# ----------------------------------------------------------------------------------------------
def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pilab_identity() -> dict:
    """pilab's version, its git commit (when run from a clone) and a hash of its source files: two
    nodes with the same commit but one edited file differ in the hash."""
    import pilab
    root = os.path.dirname(os.path.abspath(pilab.__file__))
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(os.path.relpath(os.path.join(d, f), root).encode() + b"\0" + fh.read())
    commit = None
    if shutil.which("git"):
        p = subprocess.run(["git", "-C", os.path.dirname(root), "rev-parse", "--short=12", "HEAD"],
                           capture_output=True, text=True)
        commit = p.stdout.strip() or None if p.returncode == 0 else None
    return {"version": pilab.__version__, "commit": commit, "source_sha256": h.hexdigest()[:16]}


def versions(snn: bool) -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(),
           "executable": sys.executable}
    try:
        import torch  # the real import: a broken or other torch on a node shows here
        out["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001 - reported, not raised: the probe still answers
        out["torch"] = f"cannot import: {e}"
    out["numpy"] = _dist_version("numpy")
    out["mpi4py"] = _dist_version("mpi4py")
    if snn:
        out["snntorch"] = _dist_version("snntorch")
    out["pilab"] = pilab_identity()
    return out


def mpi_library() -> dict:
    """The MPI library mpi4py loaded, and the world it sees (under ``mpiexec -n 1``: 1)."""
    from ..launch import launcher_size, mpi
    from ..launch import mpi_library as library_name
    try:
        MPI = mpi()
    except Exception as e:  # noqa: BLE001  (a broken MPI library may raise anything: report it)
        return {"error": str(e)}
    return {"library": " ".join(library_name(MPI).split()),
            "size": MPI.COMM_WORLD.Get_size(), "launcher_size": launcher_size(),
            "processor": MPI.Get_processor_name()}


def interface_toward(address: str) -> dict:
    """The network interface (and local address) this host sends from to reach ``address``."""
    import psutil
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP connect: picks the route, sends nothing
            local = s.getsockname()[0]
    except OSError as e:
        return {"error": f"no route to {address}: {e}"}
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return {"name": name, "address": local}
    return {"name": None, "address": local}


def fingerprint(path: str) -> dict:
    """SHA-256 of a file, or of a directory's files (relative names and contents, sorted)."""
    if not path:
        return {}
    if not os.path.exists(path):
        return {"path": path, "missing": True}
    try:
        digest, size = sha256_tree(path)
    except OSError as e:
        return {"path": path, "error": str(e)}
    return {"path": path, "sha256": digest, "bytes": size}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dirs(controller: str) -> list[tuple[str, bool]]:
    """This process's cgroup directory for ``controller`` and its ancestors (v1 or v2), innermost first."""
    text = _read("/proc/self/cgroup") or ""
    out = []
    for line in text.splitlines():
        _, ctrls, rel = line.split(":", 2)
        v2 = ctrls == ""
        if not v2 and controller not in ctrls.split(","):
            continue
        base = "/sys/fs/cgroup" if v2 else f"/sys/fs/cgroup/{ctrls}"
        if v2 and not os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
            base = "/sys/fs/cgroup/unified"
        parts = [p for p in rel.split("/") if p]
        for k in range(len(parts), -1, -1):
            out.append((os.path.join(base, *parts[:k]), v2))
        if not v2:
            break
    return out


def memory() -> dict:
    """Available memory: /proc/meminfo's MemAvailable, and the tightest cgroup limit above this
    process (a container, a systemd slice, a testbed node), whichever is smaller."""
    info = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        k, _, v = line.partition(":")
        if v.strip().endswith("kB"):
            info[k] = int(v.split()[0]) * 1024
    out = {"total": info.get("MemTotal"), "available": info.get("MemAvailable", info.get("MemFree"))}
    limit = None
    for d, v2 in _cgroup_dirs("memory"):
        lim = _read(os.path.join(d, "memory.max" if v2 else "memory.limit_in_bytes"))
        use = _read(os.path.join(d, "memory.current" if v2 else "memory.usage_in_bytes"))
        if not lim or not lim.isdigit() or int(lim) >= (1 << 60):
            continue
        # page cache the kernel drops before it kills anything is not in use (as in MemAvailable)
        stat = dict(ln.split() for ln in (_read(os.path.join(d, "memory.stat")) or "").splitlines()
                    if len(ln.split()) == 2)
        cache = int(stat.get("inactive_file" if v2 else "total_inactive_file", 0))
        free = int(lim) - max(0, int(use or 0) - cache)
        if limit is None or free < limit["free"]:
            limit = {"cgroup": d, "limit": int(lim), "usage": int(use or 0), "free": free}
    out["cgroup"] = limit
    out["free"] = min(x for x in (out["available"], limit and limit["free"]) if x is not None) \
        if out["available"] is not None else (limit and limit["free"])
    return out


def cpu() -> dict:
    """Cores this process may use (affinity and a CFS quota), frequency and throttling."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = None
    for d, v2 in _cgroup_dirs("cpu"):
        if v2:
            q = (_read(os.path.join(d, "cpu.max")) or "max").split()
            if q and q[0] != "max":
                quota = int(q[0]) / int(q[1])
        else:
            q, per = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
            if q and per and int(q) > 0:
                quota = int(q) / int(per)
        if quota:
            break
    out = {"cores": cores, "quota_cores": quota, "freq_mhz": None, "max_mhz": None, "cap_mhz": None,
           "throttled": None, "temp_c": None, "source": None}
    cur = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    top = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    cap = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_max_freq")  # the policy's ceiling (thermal, user)
    if cur and cur.isdigit():
        out["freq_mhz"], out["source"] = int(cur) / 1000, "cpufreq"
    if top and top.isdigit():
        out["max_mhz"] = int(top) / 1000
    out["cap_mhz"] = int(cap) / 1000 if cap and cap.isdigit() else None
    temp = _read("/sys/class/thermal/thermal_zone0/temp")
    if temp and temp.lstrip("-").isdigit():
        out["temp_c"] = int(temp) / 1000
    if shutil.which("vcgencmd"):  # the Raspberry Pi's firmware: under-voltage and throttling bits
        p = subprocess.run(["vcgencmd", "get_throttled"], capture_output=True, text=True, timeout=10)
        if p.returncode == 0 and "=" in p.stdout:
            out["throttled"] = int(p.stdout.strip().split("=")[1], 16)
            out["source"] = "vcgencmd"
    return out


def _quota_throttled_s() -> float | None:
    """Seconds the CFS quota of this process's innermost cpu cgroup with a quota has held it back so far
    (cpu.stat: v1's throttled_time in ns, v2's throttled_usec); None without such a group."""
    for d, v2 in _cgroup_dirs("cpu"):
        stat = dict(ln.split() for ln in (_read(os.path.join(d, "cpu.stat")) or "").splitlines()
                    if len(ln.split()) == 2)
        if v2 and "throttled_usec" in stat and (_read(os.path.join(d, "cpu.max")) or "max").split()[0] != "max":
            return int(stat["throttled_usec"]) / 1e6
        if not v2 and "throttled_time" in stat and int(_read(os.path.join(d, "cpu.cfs_quota_us")) or -1) > 0:
            return int(stat["throttled_time"]) / 1e9
    return None


def step_speed(spec: dict, min_s: float = 1.0) -> dict:
    """Training steps of the run's own model on random images, timed: the images per second one rank of
    this host can train.

    ``spec``: model, width, timesteps, num_classes, image_size, batch (the run's per-rank batch) and
    threads (0: the cores this process may use / ranks_per_node, as a run sets them). One step warms up
    (kernels, allocations), then steps are timed until ``min_s`` has passed (at least 4). The speed is
    judged from the CPU time a step takes, spread over the cores the rank may use (its threads, fewer
    where a CPU quota allows less): what the host can give a rank, which other work on a shared machine
    barely changes but a slower or hotter CPU (more CPU time a step) or a quota does. The wall-clock rate
    (``wall_images_per_s``) is beside it, with the CPU frequency right after the timed steps (under
    load) and the seconds the quota held the process back meanwhile::

        step_speed({"model": "mobilenetv2_cifar", "width": 0.25, "batch": 16, "threads": 1})["images_per_s"]
    """
    import torch
    import torch.nn.functional as F

    from ..models import build_model
    here = cpu()
    threads = int(spec.get("threads") or 0) or max(1, int(here["cores"] // max(1, spec.get("ranks_per_node", 1))))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    classes, size, batch = int(spec.get("num_classes", 10)), int(spec.get("image_size") or 32), int(spec["batch"])
    net = build_model(spec["model"], num_classes=classes, width=float(spec.get("width", 1.0)),
                      timesteps=spec.get("timesteps")).train().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, size, size).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,))

    def step():
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    step()
    held0, wall, used = _quota_throttled_s(), [], []
    t_end = time.perf_counter() + min_s
    while len(wall) < 4 or time.perf_counter() < t_end:
        t, c = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t)
        used.append(time.process_time() - c)
    held1, load = _quota_throttled_s(), cpu()
    cores = min(x for x in (threads, here["cores"], here["quota_cores"]) if x)  # what the rank may use at once
    # the least CPU time a step took: other work on the machine only adds to it (caches, memory bandwidth),
    # a slower clock does not leave it; the wall clock's median beside it, as the rank saw it
    step_s = min(used) / cores
    wall_s = sorted(wall)[len(wall) // 2]
    return {"images_per_s": batch / step_s, "step_s": step_s, "wall_images_per_s": batch / wall_s,
            "steps": len(wall), "batch": batch, "threads": threads, "cores": cores,
            "freq_mhz": load["freq_mhz"], "max_mhz": load["max_mhz"], "quota_cores": here["quota_cores"],
            "quota_held_s": None if held0 is None or held1 is None else held1 - held0}


def talk_to_head(head: str, rounds: int = 5) -> dict:
    """Round trips to the head's listener: reachable at all (the controller's address), and this
    host's clock offset from the head's (the sample with the shortest round trip; error <= rtt/2)."""
    if not head:
        return {}
    host, _, port = head.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            f = s.makefile("rw")
            # the doctor run's secret first: its listener answers nothing else (pilab.doctor.preflight)
            f.write(os.environ.get("PILAB_DOCTOR_SECRET", "") + "\n")
            best = None
            for _ in range(rounds):
                t0 = time.time()
                f.write(f"{t0!r}\n")
                f.flush()
                th = float(f.readline())
                t1 = time.time()
                if best is None or t1 - t0 < best[1]:
                    best = ((t0 + t1) / 2 - th, t1 - t0)
    except (OSError, ValueError) as e:
        return {"address": head, "reachable": False, "error": f"{type(e).__name__}: {e}"}
    return {"address": head, "reachable": True, "offset_s": best[0], "rtt_s": best[1]}


def host_probe(args) -> dict:
    out = {"hostname": socket.gethostname(), "pid": os.getpid()}
    sections = (("versions", lambda: versions(args.snn)), ("mpi", mpi_library),
                ("iface", lambda: interface_toward(args.toward) if args.toward else {}),
                ("data", lambda: fingerprint(args.data)), ("memory", memory), ("cpu", cpu),
                ("head", lambda: talk_to_head(args.head)))
    for name, fn in sections:
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ----------------------------------------------------------------------------------------------
# net: one job, one rank per host
# ----------------------------------------------------------------------------------------------
def _pair(comm, peer: int, nbytes: int, reps: int) -> dict:
    """Rank 0 with ``peer``: latency (half the round trip of 8 bytes) and bandwidth both ways."""
    import numpy as np
    rank = comm.Get_rank()
    small, big, ack = np.zeros(1), np.zeros(nbytes // 8), np.zeros(1)
    other = peer if rank == 0 else 0
    lat = []
    for i in range(30):
        t = time.perf_counter()
        if rank == 0:
            comm.Send(small, dest=other)
            comm.Recv(small, source=other)
        else:
            comm.Recv(small, source=other)
            comm.Send(small, dest=other)
        if i >= 5:  # after the connection is up
            lat.append((time.perf_counter() - t) / 2)
    lat_s = sorted(lat)[len(lat) // 2]
    out_s, in_s = [], []
    for _ in range(reps):
        t = time.perf_counter()
        if rank == 0:  # rank 0 -> peer, acknowledged
            comm.Send(big, dest=other)
            comm.Recv(ack, source=other)
        else:
            comm.Recv(big, source=other)
            comm.Send(ack, dest=other)
        out_s.append(time.perf_counter() - t - lat_s)
        t = time.perf_counter()
        if rank == 0:  # peer -> rank 0, asked for
            comm.Send(ack, dest=other)
            comm.Recv(big, source=other)
        else:
            comm.Recv(ack, source=other)
            comm.Send(big, dest=other)
        in_s.append(time.perf_counter() - t - lat_s)
    return {"latency_s": lat_s, "bytes": int(big.nbytes),
            "to_peer_Bps": big.nbytes / max(min(out_s), 1e-9),
            "from_peer_Bps": big.nbytes / max(min(in_s), 1e-9)}


def net_probe(args) -> dict | None:
    import numpy as np

    from ..launch import launcher_size, mpi
    from ..launch import mpi_library as library_name
    from ..perfmodel import comm_bench
    MPI = mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    me = {"rank": rank, "size": size, "launcher_size": launcher_size(), "host": socket.gethostname(),
          "library": " ".join(library_name(MPI).split())}
    if size < 2:  # "0 of 1": this process does not see the others; say so from every one of them
        return {"ranks": [me], "allreduce_ok": False}
    ranks = comm.gather(me, root=0)
    v = np.array([rank + 1.0])
    comm.Allreduce(MPI.IN_PLACE, v, op=MPI.SUM)
    ok = bool(v[0] == size * (size + 1) / 2)
    links = {}
    if args.links:
        for peer in range(1, size):
            if rank in (0, peer):
                res = _pair(comm, peer, args.link_bytes, 5)  # the fastest of 5: load only adds time
                if rank == 0:
                    links[peer] = res
            comm.Barrier()
    bench = comm_bench(comm, sizes=tuple(args.sizes), trials=3, min_time=0.01, max_reps=200) \
        if args.links else None
    speeds = comm.gather(_timed_in_turn(comm, args.speed), root=0) if args.speed else None
    if rank != 0:
        return None
    return {"ranks": ranks, "allreduce_ok": ok, "links": links, "bench": bench, "speeds": speeds}


def _timed_in_turn(comm, encoded: str) -> dict:
    """This rank's ``step_speed``: every host at once, as on a real cluster, except hosts that are one
    machine (one kernel: a testbed's namespaces, containers): at once they would share its cores, so those
    go one after the other."""
    boot = _read("/proc/sys/kernel/random/boot_id") or socket.gethostname()
    boots = comm.allgather(boot)
    turn = boots[:comm.Get_rank()].count(boot)  # my place among the ranks on my machine
    mine = {}
    for k in range(max(boots.count(b) for b in boots)):
        _idle_barrier(comm)
        if k == turn:
            mine = _speed_or_error(encoded)
    _idle_barrier(comm)
    return mine


def _idle_barrier(comm) -> None:
    """A barrier that sleeps while it waits: MPI's own spins on a core, which a host being timed on the
    same machine would share."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.02)


def _speed_or_error(encoded: str) -> dict:
    """``step_speed`` of the spec the head sent (base64 JSON: one shell word through any launcher), on
    every rank at once, as the run's ranks train. In a child process: a step that does not fit a small
    node's memory (killed) or does not build costs this host its speed, not the job across the hosts."""
    p = subprocess.run([sys.executable, "-m", "pilab.doctor.probe", "speed", "--speed", encoded],
                       capture_output=True, text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith(MARK + " "):
            return json.loads(line[len(MARK) + 1:])
    last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200]
    return {"error": last + (" (killed: out of memory?)" if p.returncode in (-9, 137) else "")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pilab.doctor.probe")
    p.add_argument("mode", choices=("host", "net", "speed"))
    p.add_argument("--data", default="")
    p.add_argument("--head", default="", help="ADDR:PORT of the head's listener")
    p.add_argument("--toward", default="", help="the head's address on the hosts' network (interface)")
    p.add_argument("--snn", action="store_true", help="also report snntorch")
    p.add_argument("--links", action="store_true", help="net: measure the links and run comm_bench")
    p.add_argument("--link-bytes", type=int, default=4 << 20)
    p.add_argument("--speed", default="", help="net: time the run's training step (base64 JSON of step_speed's spec)")
    p.add_argument("--sizes", type=int, nargs="*", default=[4, 1024, 16384, 262144, 1 << 20, 4 << 20])
    args = p.parse_args(argv)
    if args.mode == "speed":  # a child of a net rank (no launcher, no MPI): one JSON line
        import base64
        say(MARK, step_speed(json.loads(base64.b64decode(args.speed))))
        return 0
    from ..launch import launcher_rank
    if launcher_rank() == 0:  # one per job: the job has started on its (first) host
        say(HELLO, {"hostname": socket.gethostname(), "time": time.time()})
    res = host_probe(args) if args.mode == "host" else net_probe(args)
    if res is not None:
        say(MARK, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
