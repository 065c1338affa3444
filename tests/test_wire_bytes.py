"""Bytes measured on the wire against the meter's bytes, between two emulated hosts (root with iproute2 only).

Each run reads both hosts' interface counters over its training phase; the bytes sent on the link must match what
the meter books as crossing it, within TCP/IP framing, for a dense mode, a compressed one and the parameter server;
and the emulated link's rate bounds the bus bandwidth of an all-reduce.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading

import pytest

from lightning_sync.apps.bench.cli import main
from lightning_sync.apps.bench.launch import wire_totals
from lightning_sync.apps.netns import InterfaceCounters

NETNS = os.name == "posix" and os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


@pytest.mark.unit
def test_interface_counters_count_what_crosses_the_interface():
    """64 KiB sent over loopback TCP in this process: the counters of ``lo`` see at least those bytes each way
    (other traffic on ``lo`` only adds to them)."""
    payload = b"x" * (64 * 1024)
    received = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as server:
        counters = InterfaceCounters("lo")
        counters.start()
        with socket.create_connection(server.getsockname(), timeout=10) as client:
            peer, _ = server.accept()
            with peer:
                reader = threading.Thread(target=lambda: received.extend(_read_all(peer, len(payload))))
                reader.start()
                client.sendall(payload)
                reader.join(10)
        counters.stop()
    assert bytes(received) == payload
    assert counters.tx_bytes is not None and counters.tx_bytes >= len(payload), counters.tx_bytes
    assert counters.rx_bytes is not None and counters.rx_bytes >= len(payload), counters.rx_bytes
    with pytest.raises(OSError, match="nosuchif0"):
        InterfaceCounters("nosuchif0").read()


def _read_all(sock: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(size - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


@pytest.mark.unit
def test_wire_totals_add_the_ranks_and_divide_by_what_crosses(tmp_path):
    parts = [
        {"tx_bytes": 1_100, "rx_bytes": 2_090, "steps": 10, "meter_sent": 500.0, "meter_recv": 500.0,
         "meter_cross_host": 0.0},
        {"tx_bytes": 1_000, "rx_bytes": 1_100, "steps": 10, "meter_sent": 1000.0, "meter_recv": 1000.0,
         "meter_cross_host": 2000.0},
    ]  # fmt: skip
    paths = [tmp_path / f"result.json.rank{r}" for r in range(2)]
    for path, part in zip(paths, parts):
        path.write_text(json.dumps(part))
    totals = wire_totals(paths)
    assert totals["wire_bytes_per_step"] == pytest.approx(105.0)
    assert totals["wire_over_meter"] == pytest.approx(2_100 / 2_000)
    paths[1].unlink()  # a rank that wrote nothing: no ratio rather than a wrong one
    assert wire_totals(paths)["wire_over_meter"] is None


@pytest.mark.netns
@pytest.mark.e2e
@pytest.mark.skipif(not NETNS, reason="needs root with iproute2 (ip netns, tc) to emulate hosts")
@pytest.mark.timeout(900)
def test_wire_bytes_agree_with_the_meter_and_the_link_bounds_the_bus_bandwidth(tmp_path):
    """Between two hosts joined by a 1 Gbit/s link: a dense mode, a compressed one and the parameter server send on
    the wire what the meter books, and an all-reduce of a 4 MiB payload (ours and gloo's) runs at most at the link's
    rate."""
    out = tmp_path / "bench"
    prefix = f"tw{os.getpid() % 10000:04d}"
    main(
        [
            "--out",
            str(out),
            "workloads=char_lm,payload",
            "cases=allreduce,topk,ps_async,gloo_allreduce",  # each workload runs those it has
            "window=1",  # step times, no target loss: no lightning_ddp run needed
            "budget_steps=16",
            "payload_mb=4",
            "payload_iters=2",
            "repeats=1",
            "network.rate=1gbit",
            f"network.prefix={prefix}",
            "plots=false",
            "timeout_s=300",
        ]
    )
    results = json.loads((out / "results.json").read_text())
    records = {(r["workload"], r["case"]): r for r in results["records"]}
    trained, payloads = ("allreduce", "topk", "ps_async"), ("allreduce", "gloo_allreduce")
    assert set(records) == {("char_lm", c) for c in trained} | {("payload", c) for c in payloads}
    assert all(record["ok"] for record in records.values()), records
    for case in trained:
        record = records["char_lm", case]
        ratio = record["wire_over_meter"]
        # headers of TCP/IP/Ethernet (66 bytes per segment, fewer with TSO), the ACKs of what the host receives,
        # gloo's and the store's messages: a few percent over the payload, never under it
        assert ratio is not None and 1.0 <= ratio <= 1.10, (case, ratio, record["wire"])
        assert record["wire_bytes_per_step"] > 0
    # the compressed payload is what crosses: topk's wire bytes are a small share of allreduce's
    dense, sparse = (records["char_lm", c]["wire_bytes_per_step"] for c in ("allreduce", "topk"))
    assert sparse < 0.2 * dense, (sparse, dense)
    for case in payloads:
        payload = records["payload", case]
        assert payload["payload_bytes"] == 4 * 1024 * 1024
        assert 300 < payload["busbw_mbit"] < 1050, payload  # the 1 Gbit/s link bounds it (loopback: ~4,000)
    table = " ".join((out / "results.md").read_text().split())
    assert "network 1gbit" in table and "busbw Mbit/s" in table and "of link" in table
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
