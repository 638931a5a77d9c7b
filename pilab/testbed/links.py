"""A node's link: pulled or put back (``link``), slowed (``shape``), and the bytes it carried (``traffic``)."""
from __future__ import annotations

import os

from ..files import save_json
from .nodes import NODE_IFACE, Testbed, TestbedError, _run, _shape, parse_rate


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
