"""Emulated hosts on one machine: network namespaces on a bridge, with rate-limited links (needs root).

For benchmarks and tests of multi-host runs without a cluster. Host ``i`` is the namespace ``<prefix>h<i>`` with
interface ``<prefix>v<i>`` and address ``10.77.0.<i+1>/24``, joined by a veth pair to a port of a bridge in the
namespace ``<prefix>sw``. With a ``rate``, both ends of every link get a ``tbf`` qdisc: the host side limits what it
uploads, the switch port what it downloads, so many senders into one host (incast) are limited as on a real switch.
The kernel here has no ``netem``, so there is no delay or loss.

Only namespaces this module creates are touched, and all of them are deleted on exit (with their veths and the
bridge). Run a command on host ``i`` with ``ip netns exec <namespace> env GLOO_SOCKET_IFNAME=<interface> ...``; keep
traffic to these addresses. Nothing here knows of Lightning.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


@dataclass(frozen=True)
class EmulatedHost:
    """One emulated host: its namespace, its interface (for ``GLOO_SOCKET_IFNAME``) and its address."""

    namespace: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class InterfaceCounters:
    """The bytes a network interface transmitted and received between :meth:`start` and :meth:`stop`.

    Reads the kernel's counters in ``/sys/class/net/<interface>/statistics/``: every frame that crossed the
    interface, headers included (Ethernet, IP, TCP; a TSO/GSO segment counts once, at its full length). Read from
    inside a host's namespace (``ip netns exec`` mounts that namespace's sysfs), they count that host's traffic on
    the emulated link only; loopback traffic inside the namespace is not on them.

    Args:
        interface: the interface name, e.g. the host's ``GLOO_SOCKET_IFNAME``.
    """

    def __init__(self, interface: str) -> None:
        self.interface = interface
        self._base = Path("/sys/class/net", interface, "statistics")
        self._at_start: tuple[int, int] | None = None
        self.tx_bytes: int | None = None
        self.rx_bytes: int | None = None

    def read(self) -> tuple[int, int]:
        """``(tx_bytes, rx_bytes)`` now. Raises ``OSError`` naming the file when the interface is not here."""
        return tuple(int((self._base / name).read_text()) for name in ("tx_bytes", "rx_bytes"))  # type: ignore[return-value]

    def start(self) -> None:
        self._at_start = self.read()

    def stop(self) -> None:
        if self._at_start is None:
            return
        tx, rx = self.read()
        self.tx_bytes, self.rx_bytes = tx - self._at_start[0], rx - self._at_start[1]


def burst_bytes(rate: str) -> int:
    """The tbf burst for ``rate`` (e.g. ``"1gbit"``): at least 32 KiB and 2 ms of traffic, which reached 96% of the
    nominal rate here. Raises ``ValueError`` naming the rate when it is not a number with kbit, mbit or gbit."""
    for suffix, scale in _UNITS.items():
        if rate.endswith(suffix):
            try:
                bits_per_s = float(rate[: -len(suffix)]) * scale
            except ValueError:
                break
            if bits_per_s > 0:
                return max(32 * 1024, int(bits_per_s / 8 * 0.002))
    raise ValueError(f"rate={rate!r} is not a positive tc rate such as 100mbit or 1gbit")


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@contextmanager
def emulated_hosts(count: int, rate: str | None = None, prefix: str = "ls") -> Iterator[list[EmulatedHost]]:
    """Makes ``count`` hosts on one bridge (links limited to ``rate`` if given) and removes everything on exit.

    Args:
        count: how many hosts (at most 254).
        rate: a tc rate for every link (``None``: unlimited veths).
        prefix: namespace and interface name prefix; keep it short (interface names have at most 15 characters)
            and unique to the caller.
    """
    if not 1 <= count <= 254:
        raise ValueError(f"count={count} is not in 1..254")
    burst = str(burst_bytes(rate)) if rate is not None else None
    switch = f"{prefix}sw"
    hosts = [EmulatedHost(f"{prefix}h{i}", f"{prefix}v{i}", f"10.77.0.{i + 1}") for i in range(count)]
    made: list[str] = []
    try:
        for namespace in [switch, *(h.namespace for h in hosts)]:
            _run(["ip", "netns", "add", namespace])
            made.append(namespace)
        _run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", "br0", "up"])
        for i, host in enumerate(hosts):
            port = f"{prefix}p{i}"
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    host.interface,
                    "netns",
                    host.namespace,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    switch,
                ]
            )
            _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface])
            for link in (host.interface, "lo"):
                _run(["ip", "-n", host.namespace, "link", "set", link, "up"])
            _run(["ip", "-n", switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", switch, "link", "set", port, "up"])
            if burst is not None:
                for namespace, link in ((host.namespace, host.interface), (switch, port)):
                    _run(
                        [
                            "tc",
                            "-n",
                            namespace,
                            "qdisc",
                            "add",
                            "dev",
                            link,
                            "root",
                            "tbf",
                            "rate",
                            str(rate),
                            "burst",
                            burst,
                            "latency",
                            "50ms",
                        ]
                    )
        yield hosts
    finally:
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        if made and not listing.strip():  # the first `ip netns add` mounted /run/netns: restore the machine
            subprocess.run(["umount", "/run/netns"], capture_output=True, timeout=30)
            subprocess.run(["rmdir", "/run/netns"], capture_output=True, timeout=30)
