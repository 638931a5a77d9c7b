"""The testbed's nodes: what a testbed is (:class:`Testbed`), the checks before it is made, and making and
removing its namespaces, veths and bridge (``up``, ``down``, ``status``). See :mod:`pilab.testbed`."""
from __future__ import annotations

import ipaddress
import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass, field



DEFAULT_NAME = "pilab"


DEFAULT_SUBNET = "10.77.0.0/24"  # not routed here; `up` checks it against this machine's routes


DEFAULT_RATE = "1gbit"  # the Pi 4B's Ethernet


NODE_IFACE = "eth0"  # the node's end of its veth, named as on a board


FIRST_HOST = 11  # node01 is .11, node02 .12, ...; the bridge (the "head node") is .1


NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # link names are at most 15 characters: "<name>-n01"


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
    # the account every job, engine and shell started on the nodes runs as ("": root); `testbed up`
    # records the user who ran it with sudo ($SUDO_USER), so user code never runs as root
    user: str = ""

    def __post_init__(self):
        if self.user:
            job_ids(self.user)  # an account that exists, and not root's
        if not NAME_RE.match(self.name):
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
            # Slurm's client commands, when `up --slurm` started it (pilab.launch.slurm)
            **_slurm_env(self.name),
        }

    def run_on(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` (in its namespace, with its hostname), as ssh would."""
        return subprocess.run([self.shim, "-x", host, *map(shlex.quote, argv)], **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


def slurm_conf(name: str = DEFAULT_NAME) -> str:
    """Where ``up --slurm`` writes slurm.conf (pilab.testbed.slurmd)."""
    return os.path.join(state_dir(name), "slurm", "slurm.conf")


def _slurm_env(name: str) -> dict:
    return {"SLURM_CONF": slurm_conf(name)} if os.path.isfile(slurm_conf(name)) else {}


def job_ids(user: str) -> tuple[int, int]:
    """(uid, gid) of the account ``user`` the testbed's jobs run as; TestbedError for an account that does
    not exist or is root's (then leave ``user`` empty)."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise TestbedError(f"user {user!r} does not exist here; give the account the testbed's jobs run "
                           "as (--user NAME; `sudo pilab testbed up` takes yours)") from None
    if pw.pw_uid == 0:
        raise TestbedError(f"user {user!r} is root; jobs run as root when no user is given")
    return pw.pw_uid, pw.pw_gid


def state_dir(name: str = DEFAULT_NAME) -> str:
    """``/run/<name>-testbed`` ($PILAB_TESTBED_DIR overrides the parent directory). Root runs the shim and
    sources files from it: :func:`check_state_dir` is what makes it safe to use."""
    root = os.environ.get("PILAB_TESTBED_DIR") or "/run"
    return os.path.join(root, f"{name}-testbed")


def _unsafe(path: str, st: os.stat_result, *, parent: bool) -> str | None:
    """Why a directory another account could change (or replace) is no place for files root runs."""
    if st.st_uid != 0:
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = f"uid {st.st_uid}"
        return f"{path} belongs to {owner}, not root"
    if st.st_mode & 0o022 and not (parent and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def state_problem(name: str = DEFAULT_NAME) -> str | None:
    """None when testbed ``name``'s state directory is fit for root to use (or absent, in a fit parent),
    else why not: it must be a real directory of root's that no one else can write, and so must every
    directory above it (a world-writable one only with the sticky bit, as /tmp: no one else can then
    rename or remove what root made there)."""
    d = state_dir(name)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory (a {'link' if stat.S_ISLNK(st.st_mode) else 'file'})"
        why = _unsafe(d, st, parent=False)
        if why:
            return why
    up_ = os.path.dirname(os.path.abspath(d))
    while True:
        try:
            why = _unsafe(up_, os.stat(up_), parent=True)
        except FileNotFoundError:
            return f"{up_} does not exist; give PILAB_TESTBED_DIR a directory of root's (default /run)"
        if why:
            return why
        if up_ == os.path.dirname(up_):
            return None
        up_ = os.path.dirname(up_)


def check_state_dir(name: str = DEFAULT_NAME, *, create: bool = False) -> str:
    """The state directory of testbed ``name``, checked (:func:`state_problem`) and, with ``create``, made
    (root's, 0755); TestbedError naming the fix otherwise. Never falls back to another place."""
    d = state_dir(name)
    why = state_problem(name)
    if why:
        raise TestbedError(f"testbed state directory: {why}; remove it (or set PILAB_TESTBED_DIR to a "
                           "directory of root's that only root can write), then run the command again")
    if create and not os.path.isdir(d):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:  # made meanwhile: whoever made it, check it again
            return check_state_dir(name)
        os.chmod(d, 0o755)
    return d


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


def require_root() -> None:
    why = available()
    if why:
        raise TestbedError(why)


def run_cmd(*argv: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip()}")
    return p


def routes_and_addresses() -> list[tuple[ipaddress.IPv4Network, str]]:
    """Every IPv4 prefix this machine routes or has an address in (all tables), with its device."""
    out = []
    p = run_cmd("ip", "-j", "-4", "route", "show", "table", "all", check=False)
    for r in json.loads(p.stdout or "[]"):
        dst = r.get("dst", "")
        if dst in ("default", "") or r.get("type") in ("broadcast",):
            continue
        try:
            out.append((ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False),
                        r.get("dev", "")))
        except ValueError:
            continue
    p = run_cmd("ip", "-j", "-4", "addr", check=False)
    for link in json.loads(p.stdout or "[]"):
        for a in link.get("addr_info", []):
            out.append((ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False),
                        link.get("ifname", "")))
    return out


def check_range(tb: Testbed) -> None:
    """Refuse a range that overlaps any route or address of this machine (other than our bridge's)."""
    mine = ipaddress.ip_network(tb.subnet)
    for net, dev in routes_and_addresses():
        if dev == tb.bridge or net.is_loopback:
            continue
        if net.overlaps(mine):
            raise TestbedError(f"subnet {tb.subnet} overlaps {net} (on {dev or '?'}) already in use on "
                               f"this machine; choose another private range with --subnet")


# ----------------------------------------------------------------------------------------------
# up / down
# ----------------------------------------------------------------------------------------------
def netns_list() -> list[str]:
    p = run_cmd("ip", "netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def link_names() -> list[str]:
    p = run_cmd("ip", "-j", "link", check=False)
    return [link["ifname"] for link in json.loads(p.stdout or "[]")]


def burst_bytes(rate: str) -> int:
    """The token bucket of a link shaped to ``rate``: bytes it lets through at once after an idle
    spell (0 for an unshaped link). It must hold at least one GSO super-packet (64 KiB on veths) and
    a few ms at the rate, or TCP never reaches it. A wire has no such bucket: after each compute
    phase the first ``burst_bytes / rate`` seconds of a step's transfer are free on the testbed
    (the ``network`` section of ``python -m pilab bench`` shows the effect)."""
    bps = parse_rate(rate)
    return max(128 * 1024, int(bps / 8 * 0.002)) if bps else 0


def tc_shape(dev: str, rate: str, ns: str | None = None) -> None:
    """Token-bucket rate on ``dev``'s egress (replace: idempotent); no qdisc for an unshaped link."""
    bps = parse_rate(rate)
    if not bps:
        run_cmd("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
        return
    burst = burst_bytes(rate)
    limit = burst + int(bps / 8 * 0.020)  # the queue holds 20 ms of traffic beyond the bucket
    run_cmd("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(bps)}bit",
         "burst", str(burst), "limit", str(limit), ns=ns)


def load(name: str = DEFAULT_NAME, *, missing_ok: bool = False) -> Testbed | None:
    """The testbed ``up`` made (from its state directory)."""
    path = os.path.join(check_state_dir(name), "testbed.json")
    if not os.path.isfile(path):
        if missing_ok:
            return None
        raise TestbedError(f"testbed {name} is not up (no {path}); `python -m pilab testbed up` first")
    with open(path) as f:
        return Testbed(**json.load(f))
