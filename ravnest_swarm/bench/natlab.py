"""A NAT lab on one machine: a public segment and home hosts behind masquerading routers, in namespaces.

Topology (root, iproute2 and iptables needed; every address inside 198.18.0.0/15)::

    public host i (netns)  eth0 198.18.0.(10+i)/24 ─┐
                                                    ├─ br0 in the "wan" netns (a switch, no address)
    router j (netns)       wan0 198.18.0.(100+j)/24 ─┘
                           lan0 198.19.(j+1).1/24 ──veth── home host j (netns) eth0 198.19.(j+1).2/24

* Public hosts (backbone, observer, public volunteers) have only their /24: like the internet, they
  have no route to a home LAN, so a home host's private address is not dialable from outside.
* Each router forwards its LAN to the public segment with ``MASQUERADE`` (the home host appears with
  the router's public address) and, like a home router, lets in only what conntrack says belongs to a
  connection opened from inside (``ESTABLISHED,RELATED``): unsolicited inbound packets are dropped,
  both forwarded ones and ones addressed to the router itself. No port forwarding, no UPnP.
* ``mbps`` shapes every access link with ``tc tbf`` in both directions (home links at the router's LAN
  side, public links at the switch); the default is unshaped.

Namespaces are named ``rvlab{pid}-...`` like :class:`~ravnest_swarm.bench.netlab.NetLab`'s, so the stale-lab
cleanup of either removes what a killed earlier run left. Everything is removed on exit, even after a
failure.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import List, Optional

from ravnest_swarm.bench.netlab import LAB_PREFIX, _run, remove_stale_labs, tbf_args
from ravnest_swarm.launcher import LabHost

LISTEN_PORT = 40000


def nat_lab_available() -> Optional[str]:
    """None if this machine can build the lab, else the reason it cannot (for a test's skip message)."""
    if os.geteuid() != 0:
        return "the NAT lab needs root to create network namespaces"
    missing = [tool for tool in ("ip", "tc", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"the NAT lab needs {', '.join(missing)} (apt-get install iproute2 iptables)"
    probe = f"{LAB_PREFIX}{os.getpid()}-probe{random.randrange(16**4):04x}"
    created = _run("ip", "netns", "add", probe, check=False)
    if created.returncode != 0:
        return f"this machine cannot create network namespaces: {created.stderr.strip()}"
    try:
        rule = _run("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE",
                    check=False)
        if rule.returncode != 0:
            return f"iptables NAT does not work in a namespace here: {rule.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


class NatLab:
    """Public hosts on one switch and home hosts each behind its own NAT router; a context manager.

    :param public: number of public hosts (backbone, observer, public volunteers)
    :param homes: number of home hosts, each behind a separate router
    :param mbps: access-link rate of every host in Mbit/s, each direction (None: unshaped)
    """

    def __init__(self, public: int, homes: int, mbps: Optional[float] = None):
        if not (1 <= public <= 80 and 0 <= homes <= 100):
            raise ValueError("a NAT lab has 1-80 public hosts and 0-100 home hosts")
        reason = nat_lab_available()
        if reason:
            raise RuntimeError(reason)
        self.public_count, self.home_count, self.mbps = public, homes, mbps
        self.tag = f"{LAB_PREFIX}{os.getpid()}-{random.randrange(16**4):04x}"
        self._namespaces: List[str] = []

    # names and addresses ------------------------------------------------------------------------
    @property
    def wan(self) -> str:
        return f"{self.tag}-wan"

    def public(self, host: int) -> str:
        return f"{self.tag}-p{host}"

    def router(self, home: int) -> str:
        return f"{self.tag}-r{home}"

    def home(self, home: int) -> str:
        return f"{self.tag}-n{home}"

    @staticmethod
    def public_ip(host: int) -> str:
        return f"198.18.0.{10 + host}"

    @staticmethod
    def router_ip(home: int) -> str:
        """The public address a home host's connections appear to come from."""
        return f"198.18.0.{100 + home}"

    @staticmethod
    def home_ip(home: int) -> str:
        return f"198.19.{home + 1}.2"

    def public_maddr(self, host: int, port: int = LISTEN_PORT) -> str:
        return f"/ip4/{self.public_ip(host)}/tcp/{port}"

    def home_maddr(self, home: int, port: int = LISTEN_PORT) -> str:
        return f"/ip4/{self.home_ip(home)}/tcp/{port}"

    def public_host(self, host: int) -> LabHost:
        """Where a process on public host ``host`` runs (``ProcessGroup.start(lab_host=...)``; ``.prefix()`` for
        a command)."""
        return LabHost(netns=self.public(host))

    def home_host(self, home: int) -> LabHost:
        return LabHost(netns=self.home(home))

    def describe(self) -> dict:
        return {"mode": "netns+nat", "public": self.public_count, "homes": self.home_count, "mbps": self.mbps,
                "nat": "iptables MASQUERADE, inbound only ESTABLISHED,RELATED"}

    # lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> "NatLab":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, device: str) -> None:
        if self.mbps:
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", *tbf_args(self.mbps))

    def _attach_to_wan(self, namespace: str, port: str, device: str, address: str) -> None:
        _run("ip", "-n", self.wan, "link", "add", port, "type", "veth", "peer", "name", device, "netns", namespace)
        _run("ip", "-n", self.wan, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.wan, "link", "set", port, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
        _run("ip", "-n", namespace, "link", "set", device, "up")

    def _build(self) -> None:
        remove_stale_labs()
        self._add_namespace(self.wan)
        _run("ip", "-n", self.wan, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.wan, "link", "set", "br0", "up")
        for host in range(self.public_count):
            namespace = self.public(host)
            self._add_namespace(namespace)
            self._attach_to_wan(namespace, f"p{host}", "eth0", self.public_ip(host))
            self._shape(namespace, "eth0")
            self._shape(self.wan, f"p{host}")
        for home in range(self.home_count):
            router, namespace = self.router(home), self.home(home)
            self._add_namespace(router)
            self._add_namespace(namespace)
            self._attach_to_wan(router, f"r{home}", "wan0", self.router_ip(home))
            _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _run("ip", "-n", router, "addr", "add", f"198.19.{home + 1}.1/24", "dev", "lan0")
            _run("ip", "-n", router, "link", "set", "lan0", "up")
            _run("ip", "-n", namespace, "addr", "add", f"{self.home_ip(home)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "route", "add", "default", "via", f"198.19.{home + 1}.1")
            self._shape(namespace, "eth0")
            self._shape(router, "lan0")
            self._make_nat(router)

    @staticmethod
    def _make_nat(router: str) -> None:
        def iptables(*args: str) -> None:
            _run("ip", "netns", "exec", router, "iptables", *args)

        _run("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        iptables("-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
        for chain in ("FORWARD", "INPUT"):
            iptables("-P", chain, "DROP")
            iptables("-A", chain, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        iptables("-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        iptables("-A", "INPUT", "-i", "lan0", "-j", "ACCEPT")
        iptables("-A", "INPUT", "-i", "lo", "-j", "ACCEPT")

    def close(self) -> None:
        # deleting a namespace destroys its veth ends, its conntrack table and its rules with it
        for namespace in reversed(self._namespaces):
            _run("ip", "netns", "del", namespace, check=False)
        self._namespaces.clear()

    def namespaces(self) -> List[str]:
        return list(self._namespaces)
