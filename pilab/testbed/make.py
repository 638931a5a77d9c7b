"""Making and removing a testbed: ``up`` (namespaces, veths, the bridge, the files), ``down`` (all of it,
Slurm's daemons included, found by the name's prefix: also after a crash) and ``status``."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time

from .cgroups import processes, quota
from .nodes import (DEFAULT_NAME, NAME_RE, NODE_IFACE, Testbed, TestbedError, check_range, link_names, load, netns_list,
                    require_root, run_cmd, state_dir, state_problem, tc_shape)
from .shim import sudoers_rule, write_files
from .slurmd import stop as _stop_slurm


def up(tb: Testbed = Testbed()) -> Testbed:
    """Make (or complete, or re-shape) the testbed; idempotent. Returns ``tb``.

    Refuses to start without root/ip/tc, with a range that overlaps this machine's routes, a state
    directory another account could change (``state_problem``), or when a testbed of the same name but
    another shape (nodes, range, user) exists: ``down`` it first."""
    require_root()
    old = load(tb.name, missing_ok=True)
    if old is not None and (old.nodes != tb.nodes or old.subnet != tb.subnet or old.user != tb.user):
        raise TestbedError(f"testbed {tb.name} is up with {old.nodes} nodes on {old.subnet}"
                           f"{f' for {old.user}' if old.user else ''}; "
                           f"`sudo python -m pilab testbed down --name {tb.name}` first")
    check_range(tb)
    links, spaces = set(link_names()), set(netns_list())
    br = tb.bridge
    if br not in links:
        run_cmd("ip", "link", "add", br, "type", "bridge")
    run_cmd("ip", "addr", "replace", f"{tb.bridge_address}/{tb.prefixlen}", "dev", br)
    run_cmd("ip", "link", "set", br, "up")
    for h in tb.hosts:
        ns, veth, addr = tb.netns(h), tb.veth(h), tb.address(h)
        if ns not in spaces:
            run_cmd("ip", "netns", "add", ns)
        if veth not in links:
            run_cmd("ip", "link", "add", veth, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
        run_cmd("ip", "link", "set", veth, "master", br)
        run_cmd("ip", "link", "set", veth, "up")
        run_cmd("ip", "addr", "replace", f"{addr}/{tb.prefixlen}", "dev", NODE_IFACE, ns=ns)
        run_cmd("ip", "link", "set", NODE_IFACE, "up", ns=ns)
        run_cmd("ip", "link", "set", "lo", "up", ns=ns)
        # Both directions: the bridge side's egress is what the node receives, eth0's what it sends.
        tc_shape(veth, tb.rate_of(h))
        tc_shape(NODE_IFACE, tb.rate_of(h), ns=ns)
    write_files(tb)
    return tb


def down(name: str = DEFAULT_NAME) -> list[str]:
    """Remove everything testbed ``name`` made, found by its prefix (works after a crash too): the
    processes still running in its namespaces, the namespaces, links and the state directory.
    Returns what it removed."""
    require_root()
    if not NAME_RE.match(name):
        raise TestbedError(f"name={name!r} is not a testbed name")
    removed = _stop_slurm(name)  # its daemons first: munged runs outside the namespaces
    for ns in netns_list():
        if not re.fullmatch(rf"{re.escape(name)}-node\d\d", ns):
            continue
        pids = run_cmd("ip", "netns", "pids", ns, check=False).stdout.split()
        for sig in ("TERM", "KILL"):
            for pid in pids:
                subprocess.run(["kill", f"-{sig}", pid], capture_output=True)
            if pids and sig == "TERM":
                time.sleep(0.5)
            pids = run_cmd("ip", "netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
        run_cmd("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    for link in link_names():
        # veths die with their namespace; the bridge (and a veth left by a half-made `up`) here
        if link.split("@")[0] == f"{name}-br" or re.fullmatch(rf"{re.escape(name)}-n\d\d", link.split("@")[0]):
            run_cmd("ip", "link", "del", link.split("@")[0], check=False)
            removed.append(f"link {link.split('@')[0]}")
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.isdir(root):
            for entry in os.listdir(root):
                if re.fullmatch(rf"{re.escape(name)}-node\d\d", entry):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(root, entry))
                        removed.append(f"cgroup {os.path.join(root, entry)}")
    if os.path.exists(sudoers_rule(name)):
        os.remove(sudoers_rule(name))
        removed.append(f"sudo rule {sudoers_rule(name)}")
    d = state_dir(name)
    why = state_problem(name)
    if why and os.path.lexists(d):
        removed.append(f"NOT removed: {why} (not the testbed's own: look at it, then remove it by hand)")
    elif os.path.isdir(d):
        shutil.rmtree(d, ignore_errors=True)
        removed.append(f"dir {d}")
    return removed


def status(name: str = DEFAULT_NAME) -> dict:
    """What is up: the saved description, the namespaces and links that exist, processes per node."""
    require_root()
    tb = load(name, missing_ok=True)
    spaces = sorted(ns for ns in netns_list() if ns.startswith(f"{name}-node"))
    links = [link_.split("@")[0] for link_ in link_names() if link_.startswith(f"{name}-")]
    out = {"name": name, "up": tb is not None, "namespaces": spaces, "links": links}
    if tb is not None:
        out.update(testbed=tb.to_dict(), hostfile=tb.hostfile, shim=tb.shim,
                   bridge_address=tb.bridge_address,
                   nodes={h: {"address": tb.address(h), "rate": tb.rate_of(h),
                              "link": _link_state(tb.veth(h)), "cpus": quota(tb, h)} for h in tb.hosts},
                   processes=processes(tb) if spaces else {})
    return out


def _link_state(dev: str) -> str:
    p = run_cmd("ip", "-j", "link", "show", dev, check=False)
    try:
        return json.loads(p.stdout)[0].get("operstate", "?").lower()
    except (ValueError, IndexError):
        return "missing"
