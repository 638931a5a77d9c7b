"""A Pi cluster on one Linux machine: N network namespaces ("nodes") on a bridge, real TCP between them.

Each node is a network namespace with one veth link to a bridge in the root namespace, an address from
one private range the testbed owns, rate shaping on its link in both directions (default 1 GbE, as on
the Raspberry Pi 4B), and -- for every process started on it -- its own hostname (UTS namespace), its
own ``/dev/shm`` (mount namespace) and its own pid namespace, as on a separate board. The pid namespace
is what makes the shim as tidy as ssh: when mpiexec ends (normally, after a failed launch, or killed)
the proxy it started dies, and with the proxy every process of that job on the node (see ``SHIM``).
Hydra reaches the nodes the way it reaches real hosts: ``mpiexec -launcher ssh -launcher-exec SHIM``
calls ``SHIM -x HOST command…``, and the shim runs the command in that host's namespaces instead of
over ssh::

    sudo python -m pilab testbed up --nodes 4 --slots 2 --rate 1gbit
    eval "$(sudo python -m pilab testbed env)"          # HYDRA_* and UCX_* for mpiexec
    python -m pilab scale --nps 2,4,8 --hostfile /run/pilab-testbed/hosts
    sudo python -m pilab testbed down                    # also after a crash

    from pilab import testbed
    tb = testbed.up(testbed.Testbed(nodes=2, slots=2))   # idempotent; needs root, ip and tc
    cmd = launch.pilab_command(4, ["train"], hostfile=tb.hostfile, extra=tb.mpiexec_args())
    subprocess.run(cmd, env=tb.env())
    testbed.down(tb.name)

Where the bytes go (verified with the veths' byte counters, see ``traffic`` and docs/perfmodel.md):
MPICH's ch4 device moves messages between ranks of one node through its own POSIX shared memory
(ranks are on one node when one Hydra proxy, i.e. one host of the hostfile, started them), and
between nodes through its network module. pip's MPICH uses UCX there, and UCX would itself pick a
shared-memory transport (``posix``/``cma``: one kernel, one pid namespace) between namespaces of one
machine, so nothing would cross the shaped link. ``env()`` therefore sets ``UCX_TLS=tcp,self`` and
``UCX_NET_DEVICES=eth0``: shared memory inside a node (MPICH's), TCP over the node's link between nodes.

Everything the testbed makes carries its name as a prefix (namespaces ``<name>-node01…``, links
``<name>-br`` and ``<name>-n01…``, the state directory ``/run/<name>-testbed``), so ``down`` finds and
removes all of it even when the process that made it crashed. Traffic never leaves this machine: the
namespaces have no default route and no NAT, and ``up`` refuses a range that overlaps any route or
address already configured here.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from .files import save_json

__all__ = ["Testbed", "TestbedError", "up", "down", "load", "status", "available", "parse_rate",
           "link", "shape", "throttle", "limit_memory", "overlay", "clear_overlays",
           "DEFAULT_SUBNET", "DEFAULT_RATE", "DEFAULT_NAME"]

DEFAULT_NAME = "pilab"
DEFAULT_SUBNET = "10.77.0.0/24"  # not routed here; `up` checks it against this machine's routes
DEFAULT_RATE = "1gbit"  # the Pi 4B's Ethernet
NODE_IFACE = "eth0"  # the node's end of its veth, named as on a board
FIRST_HOST = 11  # node01 is .11, node02 .12, ...; the bridge (the "head node") is .1
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # link names are at most 15 characters: "<name>-n01"


class TestbedError(RuntimeError):
    """The testbed cannot be made or used here (not root, ip/tc missing, range in use…). The message
    names the fix."""


def parse_rate(text: str) -> float:
    """tc rate text -> bits per second: ``"1gbit"`` -> 1e9, ``"100mbit"`` -> 1e8, ``""`` -> 0 (unshaped)."""
    text = (text or "").strip().lower()
    if text in ("", "0", "none", "off"):
        return 0.0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?", text)
    if not m:
        raise TestbedError(f"rate {text!r}: give a tc rate such as 1gbit, 100mbit, 500kbit (or 'none')")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)


@dataclass(frozen=True)
class Testbed:
    """What a testbed is: its nodes, slots per node, link rate, address range and name."""
    nodes: int = 4  # namespaces node01..nodeNN
    slots: int = 2  # MPI slots per node in the hostfile (the Pi: 2 ranks per board)
    rate: str = DEFAULT_RATE  # per link and direction, a tc rate ("none": unshaped veths)
    subnet: str = DEFAULT_SUBNET  # the range the testbed owns; the bridge takes .1, nodes .11, .12, ...
    name: str = DEFAULT_NAME  # prefix of every namespace, link and the state directory
    rates: dict = field(default_factory=dict)  # per-host overrides set by `shape` (host -> rate)

    def __post_init__(self):
        if not _NAME_RE.match(self.name):
            raise TestbedError(f"name={self.name!r}: 1-8 lower-case letters/digits, starting with a letter")
        if not 1 <= self.nodes <= 99:
            raise TestbedError(f"nodes={self.nodes} must be between 1 and 99")
        if self.slots < 1:
            raise TestbedError(f"slots={self.slots} must be >= 1")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as e:
            raise TestbedError(f"subnet {self.subnet!r}: {e}") from None
        if net.version != 4 or not net.is_private or net.num_addresses < FIRST_HOST + self.nodes + 1:
            raise TestbedError(f"subnet {self.subnet}: give a private IPv4 range with room for "
                               f"{self.nodes} nodes (e.g. {DEFAULT_SUBNET})")
        parse_rate(self.rate)

    # -- names -----------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[str]:
        """Host names, in hostfile order (rank 0 on the first)."""
        return [f"node{i:02d}" for i in range(1, self.nodes + 1)]

    def netns(self, host: str) -> str:
        return f"{self.name}-{host}"

    def veth(self, host: str) -> str:
        """The root-namespace end of ``host``'s link (the node's end is ``eth0``)."""
        return f"{self.name}-n{self.index(host):02d}"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    def index(self, host: str) -> int:
        if host not in self.hosts:
            raise TestbedError(f"no host {host!r} on testbed {self.name} (hosts: {', '.join(self.hosts)})")
        return self.hosts.index(host) + 1

    def address(self, host: str) -> str:
        net = ipaddress.ip_network(self.subnet)
        return str(net.network_address + FIRST_HOST + self.index(host) - 1)

    @property
    def bridge_address(self) -> str:
        """The head node's address: mpiexec, the ipyparallel controller and Jupyter live here."""
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    # -- files -----------------------------------------------------------------------------------
    @property
    def state_dir(self) -> str:
        return state_dir(self.name)

    @property
    def hostfile(self) -> str:
        return os.path.join(self.state_dir, "hosts")

    @property
    def shim(self) -> str:
        return os.path.join(self.state_dir, "shim")

    def rate_of(self, host: str) -> str:
        return self.rates.get(host, self.rate)

    # -- using it --------------------------------------------------------------------------------
    def mpiexec_args(self) -> list[str]:
        """Hydra flags that start the proxies through the shim and call back on the bridge."""
        return ["-launcher", "ssh", "-launcher-exec", self.shim, "-iface", self.bridge]

    def env(self, base: dict | None = None) -> dict:
        """Environment for mpiexec (and what it passes on to the ranks): the launcher, the interface
        and the transports that keep shared memory inside a node and TCP between nodes."""
        env = dict(os.environ if base is None else base)
        env.update(self.env_vars())
        return env

    def env_vars(self) -> dict:
        return {
            # Hydra reads these as it reads -f/-launcher/-launcher-exec/-iface: `pilab scale
            # --hostfile …` and ipyparallel's MPI launcher need no extra flags.
            "HYDRA_HOST_FILE": self.hostfile, "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": self.shim, "HYDRA_IFACE": self.bridge,
            # UCX between nodes: TCP only (its posix/cma shared memory would cross namespaces), over
            # the node's link. Inside a node MPICH's own shared memory carries the messages.
            "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": NODE_IFACE,
            # the Pi profile's controller (profiles/profile_pi) on the head node's bridge address
            "PILAB_HOSTFILE": self.hostfile, "PILAB_CONTROLLER_IP": self.bridge_address,
            "PILAB_TESTBED": self.name,
            # Slurm's client commands, when `up --slurm` started it (pilab.slurm)
            **_slurm_env(self.name),
        }

    def run_on(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` (in its namespace, with its hostname), as ssh would."""
        return subprocess.run([self.shim, "-x", host, *map(shlex.quote, argv)], **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


def _slurm_env(name: str) -> dict:
    from . import slurm  # imports this module: loaded only when asked
    return slurm.env_vars(name)


def state_dir(name: str = DEFAULT_NAME) -> str:
    """``/run/<name>-testbed`` ($PILAB_TESTBED_DIR overrides the parent directory)."""
    root = os.environ.get("PILAB_TESTBED_DIR") or ("/run" if os.path.isdir("/run") else "/tmp")
    return os.path.join(root, f"{name}-testbed")


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------
def available() -> str | None:
    """None when a testbed can be made here, else why not (one line, naming the fix)."""
    if sys.platform != "linux":
        return "the testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, veths, tc): run it with sudo"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2 ({tool} = ip/tc) and util-linux (unshare)"
    return None


def _require() -> None:
    why = available()
    if why:
        raise TestbedError(why)


def _run(*argv: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip()}")
    return p


def _routes_and_addresses() -> list[tuple[ipaddress.IPv4Network, str]]:
    """Every IPv4 prefix this machine routes or has an address in (all tables), with its device."""
    out = []
    p = _run("ip", "-j", "-4", "route", "show", "table", "all", check=False)
    for r in json.loads(p.stdout or "[]"):
        dst = r.get("dst", "")
        if dst in ("default", "") or r.get("type") in ("broadcast",):
            continue
        try:
            out.append((ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False),
                        r.get("dev", "")))
        except ValueError:
            continue
    p = _run("ip", "-j", "-4", "addr", check=False)
    for link in json.loads(p.stdout or "[]"):
        for a in link.get("addr_info", []):
            out.append((ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False),
                        link.get("ifname", "")))
    return out


def check_range(tb: Testbed) -> None:
    """Refuse a range that overlaps any route or address of this machine (other than our bridge's)."""
    mine = ipaddress.ip_network(tb.subnet)
    for net, dev in _routes_and_addresses():
        if dev == tb.bridge or net.is_loopback:
            continue
        if net.overlaps(mine):
            raise TestbedError(f"subnet {tb.subnet} overlaps {net} (on {dev or '?'}) already in use on "
                               f"this machine; choose another private range with --subnet")


# ----------------------------------------------------------------------------------------------
# up / down
# ----------------------------------------------------------------------------------------------
def _netns_list() -> list[str]:
    p = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    p = _run("ip", "-j", "link", check=False)
    return [link["ifname"] for link in json.loads(p.stdout or "[]")]


def burst_bytes(rate: str) -> int:
    """The token bucket of a link shaped to ``rate``: bytes it lets through at once after an idle
    spell (0 for an unshaped link). It must hold at least one GSO super-packet (64 KiB on veths) and
    a few ms at the rate, or TCP never reaches it. A wire has no such bucket: after each compute
    phase the first ``burst_bytes / rate`` seconds of a step's transfer are free on the testbed
    (the ``network`` section of ``python -m pilab bench`` shows the effect)."""
    bps = parse_rate(rate)
    return max(128 * 1024, int(bps / 8 * 0.002)) if bps else 0


def _shape(dev: str, rate: str, ns: str | None = None) -> None:
    """Token-bucket rate on ``dev``'s egress (replace: idempotent); no qdisc for an unshaped link."""
    bps = parse_rate(rate)
    if not bps:
        _run("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
        return
    burst = burst_bytes(rate)
    limit = burst + int(bps / 8 * 0.020)  # the queue holds 20 ms of traffic beyond the bucket
    _run("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(bps)}bit",
         "burst", str(burst), "limit", str(limit), ns=ns)


SHIM = """#!/bin/sh
# pilab testbed {name}: Hydra's ssh launcher calls `shim -x HOST command...`. Run the command on HOST
# as ssh would (one shell command line), inside HOST's network namespace, with HOST's hostname (UTS
# namespace), a /dev/shm of its own (mount namespace) and a pid namespace of its own: a separate board
# on one machine.
#
# Nothing it starts outlives mpiexec, as nothing a command run by ssh starts outlives its session:
# - this process (every step below execs, so it keeps the pid mpiexec started) gets SIGKILL when
#   mpiexec ends (setpriv --pdeathsig). A launch failing on another host ends mpiexec within
#   milliseconds, possibly before that is set or even before this shim runs: then the parent is
#   init (pid 1) or no longer the one this shim started with, and it starts nothing (under a
#   subreaper other than pid 1 the first case can slip through; `testbed down` still clears it);
# - unshare --fork --kill-child: its child, the first process of the node's pid namespace, gets
#   SIGKILL when unshare dies;
# - when that first process (the Hydra proxy) ends, the kernel kills every process left in the pid
#   namespace: ranks the proxy forked, and anything they started, even if detached (setsid).
while [ $# -gt 0 ]; do
    case "$1" in
        -x|-q|-T|-n) shift ;;
        -o|-p|-l) shift 2 ;;
        *) break ;;
    esac
done
host=$1
shift
case "$host" in
{cases}
    *) echo "ssh: Could not resolve hostname $host: not a host of pilab testbed {name} ({hosts})" >&2
       sleep 1  # let mpiexec forward this line before it sees the launch fail and exits
       exit 255 ;;
esac
# a node slowed by `testbed.throttle` (a CPU-quota cgroup of its own) or made smaller by
# `testbed.limit_memory` (a memory cgroup): everything started on it joins
for cg in /sys/fs/cgroup/cpu/{name}-"$name" /sys/fs/cgroup/unified/{name}-"$name"; do
    [ -d "$cg" ] && echo $$ > "$cg/cgroup.procs" 2>/dev/null && break
done
for cg in /sys/fs/cgroup/memory/{name}-"$name" /sys/fs/cgroup/{name}-"$name"; do
    [ -f "$cg/memory.limit_in_bytes" ] || [ -f "$cg/memory.max" ] || continue
    echo $$ > "$cg/cgroup.procs" 2>/dev/null && break
done
[ "$PPID" != 1 ] || {{ echo "pilab testbed: the launcher is gone; not starting on $name" >&2; exit 255; }}
exec setpriv --pdeathsig KILL sh -c '
    [ "$PPID" = "$1" ] || {{ echo "pilab testbed: the launcher (pid $1) is gone; not starting on $3" >&2; exit 255; }}
    ns=$2; name=$3; shift 3
    exec ip netns exec "$ns" unshare --uts --mount --propagation private --pid --fork --kill-child \\
        --mount-proc sh -c "hostname \\"\\$1\\" && mount -t tmpfs -o mode=1777,size=50% tmpfs /dev/shm && . {mounts} && shift && exec sh -c \\"\\$*\\"" sh "$name" "$@"
' sh "$PPID" "$ns" "$name" "$@"
"""


def _write_files(tb: Testbed) -> None:
    os.makedirs(tb.state_dir, exist_ok=True)
    cases = "\n".join(f"    {h}|{tb.address(h)}) ns={tb.netns(h)}; name={h} ;;" for h in tb.hosts)
    shim = SHIM.format(name=tb.name, cases=cases, hosts=" ".join(tb.hosts), mounts=_mounts_file(tb))
    if not os.path.exists(_mounts_file(tb)):
        _write_mounts(tb, [])
    tmp = tb.shim + ".tmp"
    with open(tmp, "w") as f:
        f.write(shim)
    os.chmod(tmp, 0o755)
    os.replace(tmp, tb.shim)
    # Addresses, not names: no name lookup of node01 can leave this machine (there is no DNS entry).
    # Hydra takes whole-line comments only.
    lines = [f"# pilab testbed {tb.name}: MPICH hostfile (host:slots); rank 0 on the first host",
             "# " + "  ".join(f"{tb.address(h)}={h}" for h in tb.hosts),
             *(f"{tb.address(h)}:{tb.slots}" for h in tb.hosts)]
    with open(tb.hostfile + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tb.hostfile + ".tmp", tb.hostfile)
    with open(os.path.join(tb.state_dir, "env.sh"), "w") as f:
        f.write("# eval this (or `eval \"$(python -m pilab testbed env)\"`) before mpiexec / ipcluster\n")
        for k, v in tb.env_vars().items():
            f.write(f"export {k}={shlex.quote(v)}\n")
    save_json(tb.to_dict(), os.path.join(tb.state_dir, "testbed.json"))


def up(tb: Testbed = Testbed()) -> Testbed:
    """Make (or complete, or re-shape) the testbed; idempotent. Returns ``tb``.

    Refuses to start without root/ip/tc, with a range that overlaps this machine's routes, or when a
    testbed of the same name but another shape (nodes, range) exists: ``down`` it first."""
    _require()
    old = load(tb.name, missing_ok=True)
    if old is not None and (old.nodes != tb.nodes or old.subnet != tb.subnet):
        raise TestbedError(f"testbed {tb.name} is up with {old.nodes} nodes on {old.subnet}; "
                           f"`python -m pilab testbed down --name {tb.name}` first")
    check_range(tb)
    links, spaces = set(_links()), set(_netns_list())
    br = tb.bridge
    if br not in links:
        _run("ip", "link", "add", br, "type", "bridge")
    _run("ip", "addr", "replace", f"{tb.bridge_address}/{tb.prefixlen}", "dev", br)
    _run("ip", "link", "set", br, "up")
    for h in tb.hosts:
        ns, veth, addr = tb.netns(h), tb.veth(h), tb.address(h)
        if ns not in spaces:
            _run("ip", "netns", "add", ns)
        if veth not in links:
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
        _run("ip", "link", "set", veth, "master", br)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "addr", "replace", f"{addr}/{tb.prefixlen}", "dev", NODE_IFACE, ns=ns)
        _run("ip", "link", "set", NODE_IFACE, "up", ns=ns)
        _run("ip", "link", "set", "lo", "up", ns=ns)
        # Both directions: the bridge side's egress is what the node receives, eth0's what it sends.
        _shape(veth, tb.rate_of(h))
        _shape(NODE_IFACE, tb.rate_of(h), ns=ns)
    _write_files(tb)
    return tb


def load(name: str = DEFAULT_NAME, *, missing_ok: bool = False) -> Testbed | None:
    """The testbed ``up`` made (from its state directory)."""
    path = os.path.join(state_dir(name), "testbed.json")
    if not os.path.isfile(path):
        if missing_ok:
            return None
        raise TestbedError(f"testbed {name} is not up (no {path}); `python -m pilab testbed up` first")
    with open(path) as f:
        return Testbed(**json.load(f))


def down(name: str = DEFAULT_NAME) -> list[str]:
    """Remove everything testbed ``name`` made, found by its prefix (works after a crash too): the
    processes still running in its namespaces, the namespaces, links and the state directory.
    Returns what it removed."""
    _require()
    if not _NAME_RE.match(name):
        raise TestbedError(f"name={name!r} is not a testbed name")
    from . import slurm
    removed = slurm.stop(name)  # its daemons first: munged runs outside the namespaces
    for ns in _netns_list():
        if not re.fullmatch(rf"{re.escape(name)}-node\d\d", ns):
            continue
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for sig in ("TERM", "KILL"):
            for pid in pids:
                subprocess.run(["kill", f"-{sig}", pid], capture_output=True)
            if pids and sig == "TERM":
                time.sleep(0.5)
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
        _run("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    for link in _links():
        # veths die with their namespace; the bridge (and a veth left by a half-made `up`) here
        if link.split("@")[0] == f"{name}-br" or re.fullmatch(rf"{re.escape(name)}-n\d\d", link.split("@")[0]):
            _run("ip", "link", "del", link.split("@")[0], check=False)
            removed.append(f"link {link.split('@')[0]}")
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.isdir(root):
            for entry in os.listdir(root):
                if re.fullmatch(rf"{re.escape(name)}-node\d\d", entry):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(root, entry))
                        removed.append(f"cgroup {os.path.join(root, entry)}")
    d = state_dir(name)
    if os.path.isdir(d):
        shutil.rmtree(d, ignore_errors=True)
        removed.append(f"dir {d}")
    return removed


# ----------------------------------------------------------------------------------------------
# faults and measurements
# ----------------------------------------------------------------------------------------------
def link(tb: Testbed, host: str, state: str) -> None:
    """Take ``host``'s link down or up (``state`` = "down" | "up"): its cable pulled or put back."""
    if state not in ("up", "down"):
        raise TestbedError(f"link state {state!r}: up or down")
    _run("ip", "link", "set", tb.veth(host), state)


def shape(tb: Testbed, host: str, rate: str) -> Testbed:
    """Set ``host``'s link rate (both directions), e.g. 10x slower for a straggler; returns the new
    Testbed (also saved, so ``status`` shows it)."""
    parse_rate(rate)
    _shape(tb.veth(host), rate)
    _shape(NODE_IFACE, rate, ns=tb.netns(host))
    new = Testbed(**{**tb.to_dict(), "rates": {**tb.rates, host: rate}})
    save_json(new.to_dict(), os.path.join(tb.state_dir, "testbed.json"))
    return new


def traffic(tb: Testbed) -> dict:
    """Bytes each node has sent and received on its link, and on its own loopback::

        before = testbed.traffic(tb); ...; after = testbed.traffic(tb)
    """
    out = {}
    for h in tb.hosts:
        stats = {}
        for dev, key in ((NODE_IFACE, "link"), ("lo", "lo")):
            p = _run("cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
                     f"/sys/class/net/{dev}/statistics/rx_bytes", ns=tb.netns(h), check=False)
            vals = [int(v) for v in p.stdout.split()] or [0, 0]
            stats[f"{key}_tx"], stats[f"{key}_rx"] = vals[0], vals[-1]
        out[h] = stats
    return out


def traffic_delta(before: dict, after: dict) -> dict:
    return {h: {k: after[h][k] - before[h].get(k, 0) for k in after[h]} for h in after}


def processes(tb: Testbed) -> dict:
    """Pids still running on each node (for 'no orphan processes' checks)."""
    return {h: [int(p) for p in _run("ip", "netns", "pids", tb.netns(h), check=False).stdout.split()]
            for h in tb.hosts}


def ps(tb: Testbed) -> str:
    """What runs on each node, one line a process: pid, state, what it waits in (wchan), CPU seconds,
    its cgroups' limits, the command. For a job that does not end: which process holds it up, where::

        print(testbed.ps(tb))     # node02 12345 S futex_wait_queue 3.1s cpu=15000/100000 python -m pilab...
    """
    lines = []
    tick = os.sysconf("SC_CLK_TCK")
    for host, pids in processes(tb).items():
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/wchan") as f:
                    wchan = f.read().strip() or "-"
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
                threads = len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue  # ended meanwhile
            cpu_s = (int(stat[11]) + int(stat[12])) / tick
            limit = ""
            quota = os.path.join(_cgroup(tb.name, host) or "/nonexistent", "cpu.cfs_quota_us")
            with contextlib.suppress(OSError), open(quota) as f:
                limit = f" cpu_quota_us={f.read().strip()}"
            lines.append(f"{host} {pid} {stat[0]} {wchan} {cpu_s:.1f}s threads={threads}{limit} {cmd}")
    return "\n".join(lines) or "(no process on any node)"


def _cgroup(tb_name: str, host: str) -> str | None:
    """The node's CPU-quota cgroup directory (cgroup v1 cpu controller, else v2), None if neither."""
    for root, v2 in (("/sys/fs/cgroup/cpu", False), ("/sys/fs/cgroup/unified", True),
                     ("/sys/fs/cgroup", True)):
        if os.path.isfile(os.path.join(root, "cpu.max" if v2 else "cpu.cfs_quota_us")) or \
                (not v2 and os.path.isdir(root) and os.path.isfile(os.path.join(root, "cpu.cfs_period_us"))):
            return os.path.join(root, f"{tb_name}-{host}")
    return None


def _remove_cgroup(path: str, unlimited: list[tuple[str, str]], wait_s: float = 5.0) -> None:
    """Lift a node's limit: first write ``unlimited`` into its knobs (so that whatever is still in the
    group runs free from now on), then move what is left to the parent group and remove the group.

    Why not just rmdir: right after a job was killed its processes may still be exiting, and rmdir of
    a group that holds any fails (EBUSY) -- the limit would silently stay on the node for every later
    job (a test that timed out would slow down all the tests after it)."""
    if not os.path.isdir(path):
        return
    for knob, value in unlimited:  # in order; a knob the group does not have is skipped
        with contextlib.suppress(OSError), open(os.path.join(path, knob), "w") as f:
            f.write(value)
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
            for pid in f.read().split():
                with contextlib.suppress(OSError), \
                        open(os.path.join(os.path.dirname(path), "cgroup.procs"), "w") as parent:
                    parent.write(pid)
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # unlimited already: the group is harmless; `testbed down` removes it
            time.sleep(0.2)


def throttle(tb: Testbed, host: str, cpus: float) -> None:
    """Give every process started on ``host`` from now on at most ``cpus`` cores in total (a CPU quota:
    a slower board); ``cpus=0`` lifts it. The shim puts what it starts into the node's cgroup."""
    tb.index(host)
    path = _cgroup(tb.name, host)
    if path is None:
        raise TestbedError("no cgroup cpu controller at /sys/fs/cgroup: cannot throttle a node here")
    if cpus <= 0:
        _remove_cgroup(path, [("cpu.max", "max"), ("cpu.cfs_quota_us", "-1")])
        return
    os.makedirs(path, exist_ok=True)
    period = 100_000
    if os.path.exists(os.path.join(path, "cpu.max")):
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{int(cpus * period)} {period}")
    else:
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(cpus * period)))


def _memory_cgroup(tb_name: str, host: str) -> tuple[str, bool] | None:
    """The node's memory cgroup directory and whether it is cgroup v2; None without a memory controller."""
    if os.path.isfile("/sys/fs/cgroup/memory/memory.limit_in_bytes") or \
            os.path.isdir("/sys/fs/cgroup/memory") and os.path.isfile("/sys/fs/cgroup/memory/cgroup.procs"):
        return os.path.join("/sys/fs/cgroup/memory", f"{tb_name}-{host}"), False
    if os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            if "memory" in f.read().split():
                return os.path.join("/sys/fs/cgroup", f"{tb_name}-{host}"), True
    return None


def limit_memory(tb: Testbed, host: str, nbytes: int) -> None:
    """Give every process started on ``host`` from now on at most ``nbytes`` of memory in total (a
    memory cgroup: a board with less RAM); ``nbytes=0`` lifts it. cgroup v1 (``memory.limit_in_bytes``)
    or v2 (``memory.max``). The shim puts what it starts into the node's cgroup::

        testbed.limit_memory(tb, "node02", 800 * 2**20)   # node02 is now an 800 MiB board
    """
    tb.index(host)
    found = _memory_cgroup(tb.name, host)
    if found is None:
        raise TestbedError("no cgroup memory controller at /sys/fs/cgroup: cannot limit a node's memory here")
    path, v2 = found
    if nbytes <= 0:
        # v1 wants memsw >= the limit at every moment: memsw is raised first
        _remove_cgroup(path, [("memory.max", "max"), ("memory.swap.max", "max"),
                              ("memory.memsw.limit_in_bytes", "-1"), ("memory.limit_in_bytes", "-1")])
        return
    if v2:  # the controller must be enabled for the children of the root
        with contextlib.suppress(OSError), open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
            f.write("+memory")
    os.makedirs(path, exist_ok=True)
    if v2:
        for knob, value in (("memory.max", str(int(nbytes))), ("memory.swap.max", "0")):
            with contextlib.suppress(OSError), open(os.path.join(path, knob), "w") as f:
                f.write(value)
    else:
        # a board has no swap to fall back on (where the kernel accounts swap at all); memsw must stay
        # >= the limit, so it is written on both sides of it (raising and lowering both work)
        memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
        for knob in (memsw, os.path.join(path, "memory.limit_in_bytes"), memsw):
            with contextlib.suppress(OSError), open(knob, "w") as f:
                f.write(str(int(nbytes)))
        with open(os.path.join(path, "memory.limit_in_bytes")) as f:
            if int(f.read()) > nbytes:
                raise TestbedError(f"cannot set {path}/memory.limit_in_bytes to {nbytes}")


def _mounts_file(tb: Testbed) -> str:
    return os.path.join(tb.state_dir, "mounts.sh")


def _read_overlays(tb: Testbed) -> list[tuple[str, str, str]]:
    path = os.path.join(tb.state_dir, "overlays.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [tuple(x) for x in json.load(f)]


def _cgroup_mounts() -> list[str]:
    """Shell lines that mount this machine's cgroup file systems again inside a node: ``ip netns
    exec`` mounts a sysfs of the namespace over /sys, hiding /sys/fs/cgroup, where a board's
    processes (the doctor's probe) read their memory limit and CPU quota. Same hierarchies, so a
    node's processes see the cgroups `limit_memory` and `throttle` put them in."""
    lines = []
    try:
        with open("/proc/mounts") as f:
            mounts = [ln.split() for ln in f]
    except OSError:
        return lines
    for dev, where, fstype, opts, *_ in mounts:
        if not where.startswith("/sys/fs/cgroup"):
            continue
        if fstype == "tmpfs":
            lines.append(f"mount -t tmpfs -o mode=755 cgroup_root {where} 2>/dev/null")
        elif fstype in ("cgroup", "cgroup2"):
            lines.append(f"{{ mkdir -p {where} && mount -t {fstype} -o {opts} {fstype} {where}; }} "
                         "2>/dev/null")
    return lines


def _write_mounts(tb: Testbed, overlays: list) -> None:
    """The shim sources this inside each job's mount namespace on a node (``$1`` = the host)."""
    lines = [f"# pilab testbed {tb.name}: mounts made inside a node's mount namespace (the cgroup file "
             "systems, testbed.overlay's binds); sourced by the shim with $1 = the node",
             *_cgroup_mounts()]
    for host, src, dst in overlays:
        lines.append(f'[ "$1" != {host} ] || mount --bind {shlex.quote(src)} {shlex.quote(dst)} || '
                     f'{{ echo "pilab testbed: cannot bind {src} over {dst} on {host}" >&2; exit 1; }}')
    lines.append("true")
    save_json([list(o) for o in overlays], os.path.join(tb.state_dir, "overlays.json"))
    tmp = _mounts_file(tb) + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, _mounts_file(tb))


def overlay(tb: Testbed, host: str, src: str, dst: str) -> None:
    """Make ``src`` appear at ``dst`` for every process started on ``host`` from now on, and only
    there: a bind mount inside the node's own mount namespace (another package version, a data file
    changed or missing on one board). ``dst`` must exist and be of the same kind (file or directory)::

        testbed.overlay(tb, "node02", "/tmp/old/version.py", torch.version.__file__)
        testbed.clear_overlays(tb, "node02")
    """
    tb.index(host)
    for p, what in ((src, "src"), (dst, "dst")):
        if not os.path.exists(p):
            raise TestbedError(f"overlay {what} {p} does not exist")
    if os.path.isdir(src) != os.path.isdir(dst):
        raise TestbedError(f"overlay {src} over {dst}: both must be files or both directories")
    _write_mounts(tb, [*_read_overlays(tb), (host, os.path.abspath(src), os.path.abspath(dst))])


def clear_overlays(tb: Testbed, host: str | None = None) -> None:
    """Remove the overlays of ``host`` (all hosts when None); jobs started from now on see the real files."""
    _write_mounts(tb, [o for o in _read_overlays(tb) if host is not None and o[0] != host])


def status(name: str = DEFAULT_NAME) -> dict:
    """What is up: the saved description, the namespaces and links that exist, processes per node."""
    _require()
    tb = load(name, missing_ok=True)
    spaces = sorted(ns for ns in _netns_list() if ns.startswith(f"{name}-node"))
    links = [link_.split("@")[0] for link_ in _links() if link_.startswith(f"{name}-")]
    out = {"name": name, "up": tb is not None, "namespaces": spaces, "links": links}
    if tb is not None:
        out.update(testbed=tb.to_dict(), hostfile=tb.hostfile, shim=tb.shim,
                   bridge_address=tb.bridge_address,
                   nodes={h: {"address": tb.address(h), "rate": tb.rate_of(h),
                              "link": _link_state(tb.veth(h))} for h in tb.hosts},
                   processes=processes(tb) if spaces else {})
    return out


def _link_state(dev: str) -> str:
    p = _run("ip", "-j", "link", "show", dev, check=False)
    try:
        return json.loads(p.stdout)[0].get("operstate", "?").lower()
    except (ValueError, IndexError):
        return "missing"
