"""Data parallel over several machines: `torchrun --nnodes 2 --node-rank K ...` started once
per node, here two "nodes" on this machine, each with a folder of its own (its working
folder and TMPDIR) and one rank, meeting at rank 0's address.

The run is the one a single process trains on the global batches (fp32, within 1e-5); rank
0 (node 0) alone writes the metrics, and each node's rank logs into its own folder.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from rank_launch import FLAGS, ROOT, TOL, losses_in, one_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_rank_each_train_the_global_batches(tmp_path):
    expected, _ = one_process(STEPS)
    port = free_port()
    nodes = []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "tuitrain", "run", "tiny", *FLAGS, "--steps", str(STEPS),
                   "--metrics", str(folder / "metrics.jsonl")]
        env = {**os.environ, "TMPDIR": str(folder), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        nodes.append(subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    assert "2 ranks (gloo)" in outputs[0]
    got, _ = losses_in(tmp_path / "node0" / "metrics.jsonl")
    assert [got[s] for s in sorted(got)] == pytest.approx(expected[:STEPS], rel=TOL)
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()  # rank 0 alone writes
    # Each rank logged to a file named after its rank (rank 0's start block names its own),
    # and a clean run leaves none behind.
    assert f"log {tmp_path / 'node0' / 'tuitrain'}/rank0-" in outputs[0], outputs[0][-3000:]
    for node in (0, 1):
        assert list((tmp_path / f"node{node}" / "tuitrain").glob("rank*.log")) == []
