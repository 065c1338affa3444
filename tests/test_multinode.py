"""Two emulated hosts, one rank each, launched by torchrun on each "node": the multi-node path a cluster takes.

Each host is a network namespace on a bridge (lightning_sync.apps.netns, 1 Gbit links); torchrun runs the Hydra app in
each with ``--nnodes=2 --node_rank=i``, and Lightning's TorchElastic environment picks up the ranks. Needs root and
iproute2; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sync.apps.netns import burst_bytes, emulated_hosts

pytestmark = pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root with iproute2 (ip netns, tc) to emulate hosts",
)


@pytest.mark.unit
def test_burst_is_at_least_32_kib_and_2_ms_and_rates_are_checked():
    assert burst_bytes("100mbit") == 32 * 1024
    assert burst_bytes("1gbit") == 250_000
    with pytest.raises(ValueError, match="rate='fast'"):
        burst_bytes("fast")


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_two_nodes_through_torchrun(tmp_path):
    """Our own all-reduce (``strategy=allreduce``, no DDP wrapper) across two nodes. ``strategy=ddp`` reads the same
    cluster environment; its parity with Lightning's DDP is ``test_ddp_strategy.py``'s."""
    torchrun = Path(sys.executable).with_name("torchrun")
    prefix = f"lt{os.getpid() % 10000:04d}"
    with emulated_hosts(2, "1gbit", prefix=prefix) as hosts:
        procs = []
        for node, host in enumerate(hosts):
            env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=host.interface)
            argv = [
                str(torchrun),
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                f"--master_addr={hosts[0].address}",
                "--master_port=29731",
                "-m",
                "lightning_sync.train",
                "strategy=allreduce",
                "experiment=smoke",
                "test=false",
                "trainer.devices=1",
                "trainer.num_nodes=2",
                "strategy.check_consistency_every=1",
                "strategy.timeout_s=120",
                f"hydra.run.dir={tmp_path / f'node{node}'}",
            ]
            log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen(host.command(argv), env=env, stdout=log, stderr=subprocess.STDOUT), log))
        codes = []
        for proc, log in procs:
            try:
                codes.append(proc.wait(timeout=240))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait(10))
            log.close()
    logs = {i: (tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2)}
    assert codes == [0, 0], f"exit codes {codes}\nnode 0:\n{logs[0]}\nnode 1:\n{logs[1]}"
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["optimizer_steps"] == 4
    assert summary["bytes_sent_per_step"] == pytest.approx(104_488)  # the digits MLP, ring formula, 2 ranks
