"""Hosts on one machine, for faults a loopback proxy cannot make: each host its own network namespace with its own
address (10.77.0.1, .2, ...), its veth plugged into a bridge in a "switch" namespace of its own, so that nothing
is added to the root namespace. Processes run on a host through `ip netns exec`; faults are made where a real
network makes them and undone exactly by heal():

- cut(host): the host's switch port down, as a pulled cable: its peers' packets vanish and nothing answers.
- partition(a, b): the switch drops what a and b send each other (both ways), silently; each still reaches the
  rest. (A blackhole route would fail the hosts' own sends and connects at once, a kinder fault than a network's
  silence, which only timeouts reveal.)
- drop(host, dport): the host's own packets to that port vanish (to any host, itself included over lo).
- slow(host, rate_kbit, dport): the host's packets to that port pass at that rate (a tbf behind an htb class).

Drops are an htb class whose leaf is a pfifo of limit 0: this kernel has neither netem nor tc's drop action
(act_gact), and no iptables or nft binary. Needs root; unavailable() says why where namespaces cannot be made."""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"
"""Hosts' addresses are SUBNET.1 .. SUBNET.n/24; the range lives only inside the namespaces made here."""
PREFIX = "smnet"
"""Every namespace made here is named PREFIX<pid>-..., so that those of a killed test run can be found and removed."""
CLONE_NEWNET = 0x40000000
FAST = "10gbit"
"""The htb rate of the classes that pass traffic unshaped (far above anything a test sends)."""
QUANTUM = "60000"
"""Bytes an htb class sends per round: set, since the rate-derived default is absurdly large at FAST."""
_made = itertools.count()


def _tc(netns: str, *args: str) -> None:
    subprocess.run(["tc", "-n", netns, *args], check=True, capture_output=True, text=True, timeout=30)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, or `ip netns add` fails), or None where they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"`ip netns add` fails here: {detail}"
    _ip("netns", "del", probe)
    return None


def remove_stale() -> None:
    """Removes the namespaces of earlier runs whose process is gone (a run killed before its cleanup)."""
    for name in Path("/run/netns").iterdir() if Path("/run/netns").is_dir() else []:
        if (m := re.fullmatch(rf"{PREFIX}(\d+)-.*", name.name)) and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name.name], capture_output=True, timeout=30)


@dataclass(frozen=True)
class Host:
    name: str
    """h1, h2, ...: what logs and messages call it."""
    netns: str
    address: str
    port: str
    """Its veth's end in the switch namespace."""

    @property
    def command(self) -> list[str]:
        """The prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """argv started on this host. `ip netns exec` execs argv: the Popen's pid is argv's own (signals reach it)."""
        return subprocess.Popen([*self.command, *argv], **kwargs)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a thread that lives in this host's namespace (a socket it opens is on this host), for
        plain socket clients such as urllib; not for gRPC, whose sockets are opened on threads of its own."""
        outcome: dict[str, Any] = {}

        def inside() -> None:
            try:
                with open(f"/run/netns/{self.netns}") as f:
                    if ctypes.CDLL(None, use_errno=True).setns(f.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
                outcome["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller's thread
                outcome["error"] = exc

        thread = threading.Thread(target=inside, name=f"in-{self.name}")
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]


class Hosts:
    """n hosts on one switch; a context manager that removes every namespace (and so every veth) it made."""

    def __init__(self, n: int):
        if not 1 <= n <= 250:
            raise ValueError(f"{n} hosts: must be 1..250")
        tag = f"{PREFIX}{os.getpid()}-{next(_made)}"
        self.switch = f"{tag}-sw"
        self.hosts = [Host(f"h{i}", f"{tag}-h{i}", f"{SUBNET}.{i}", f"p{i}") for i in range(1, n + 1)]
        self._shaped: dict[tuple[str, str], int] = {}  # (netns, device) with an htb root -> classes made on it
        self._down: list[Host] = []

    def __enter__(self) -> Hosts:
        remove_stale()
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                _ip("netns", "add", host.netns)
                _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
                    "netns", host.netns)
                _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        """Deletes the namespaces (their veths and qdiscs go with them). Processes still running on a host keep
        its namespace alive until they exit: stop them first."""
        for netns in [h.netns for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)

    # Faults

    def cut(self, host: Host) -> None:
        """The host off the network whole: its switch port down."""
        _ip("-n", self.switch, "link", "set", host.port, "down")
        self._down.append(host)

    def partition(self, a: Host, b: Host) -> None:
        """a and b no longer reach each other (the switch drops their packets both ways); each reaches the rest."""
        self._drop(self.switch, b.port, ["match", "ip", "src", f"{a.address}/32"])
        self._drop(self.switch, a.port, ["match", "ip", "src", f"{b.address}/32"])

    def drop(self, host: Host, dport: int) -> None:
        """What the host sends to this TCP port vanishes, to other hosts (eth0) and to itself (lo)."""
        for device in ("eth0", "lo"):
            self._drop(host.netns, device, ["match", "ip", "dport", str(dport), "0xffff"])

    def slow(self, host: Host, rate_kbit: int, dport: int) -> None:
        """What the host sends to this TCP port passes at rate_kbit (its queue holds up to ~2 s of it)."""
        for device in ("eth0", "lo"):
            leaf = ["tbf", "rate", f"{rate_kbit}kbit", "burst", "1600", "latency", "2s"]
            self._classify(host.netns, device, ["match", "ip", "dport", str(dport), "0xffff"], leaf)

    def heal(self) -> None:
        """Undoes every fault: ports up, and each shaped device back to the qdisc it had (its htb root deleted,
        classes and filters with it)."""
        for host in self._down:
            _ip("-n", self.switch, "link", "set", host.port, "up")
        self._down.clear()
        for netns, device in self._shaped:
            _tc(netns, "qdisc", "del", "dev", device, "root")
        self._shaped.clear()

    def _drop(self, netns: str, device: str, match: list[str]) -> None:
        self._classify(netns, device, match, ["pfifo", "limit", "0"])

    def _classify(self, netns: str, device: str, match: list[str], leaf: list[str]) -> None:
        """Packets leaving `device` that `match` go to a class of their own whose leaf qdisc is `leaf`."""
        key = (netns, device)
        if key not in self._shaped:
            _tc(netns, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1")
            _tc(netns, "class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb", "rate", FAST,
                "quantum", QUANTUM)
            self._shaped[key] = 1
        self._shaped[key] += 1
        n = self._shaped[key]
        _tc(netns, "class", "add", "dev", device, "parent", "1:", "classid", f"1:{n}", "htb", "rate", FAST,
            "quantum", QUANTUM)
        _tc(netns, "qdisc", "add", "dev", device, "parent", f"1:{n}", "handle", f"{n}:", *leaf)
        _tc(netns, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", str(n), "u32", *match,
            "flowid", f"1:{n}")
