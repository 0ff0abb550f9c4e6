# SPDX-License-Identifier: GPL-3.0-or-later
"""The Parallelism node's cluster section in a real ComfyUI server (``--cpu``): a bad cluster is named on
the node and starts nothing; a no_ssh cluster starts node 0 and the Train node shows the other node's command."""
from __future__ import annotations

import shlex

from server_fixtures import comfy_server, kill_runs, queued_text  # noqa: F401  (fixture)
from test_server_pipetrain import fake_sdxl_files, graph, node_error, raw

from pipetrain.backend.process.command_lines import free_port


def cluster_graph(info: dict, run_name="cluster", **cluster):
    g = graph(stages=2, run_name=run_name)
    g["3"]["inputs"].update(cluster)
    for node in g.values():  # widgets the shared graph does not set yet: their defaults
        for name, spec in info[node["class_type"]]["input"].get("required", {}).items():
            if name not in node["inputs"] and len(spec) > 1 and "default" in spec[1]:
                node["inputs"][name] = spec[1]["default"]
    return g


def test_cluster_section_errors_and_a_no_ssh_start(comfy_server):  # noqa: F811
    server = comfy_server
    fake_sdxl_files(server.base)
    (server.base / "input" / "bad_hostfile").write_text("node-a slots=1\nnode-b\n")

    info = server.get("/object_info")[1]
    no_ssh = {"cluster": "no_ssh", "hosts": "node-a:1, node-b:1", "master_addr": "127.0.0.1",
              "master_port": free_port(), "env": "NCCL_PIPETRAIN_TEST_ENV=forwarded"}
    for change, message in [
        ({"master_addr": ""}, "launcher = 'no_ssh' needs master_addr"),
        ({"hosts": "node-a:2, node-b:1"}, "pipeline_stages=2 does not divide the 3 slots of the hosts"),
        ({"hosts": "", "hostfile": "no_such_hostfile"}, "no_such_hostfile: not found"),
        ({"hosts": "", "hostfile": "bad_hostfile"}, "bad_hostfile: line 2 is not '<host> slots=<n>'"),
    ]:
        code, body = server.queue(cluster_graph(info, **{**no_ssh, **change}))
        assert code == 400, body
        assert message in node_error(body, "3"), body
    runs_root = server.runs_root
    assert not runs_root.exists() or not [p for p in runs_root.iterdir() if (p / "launcher.json").exists()]

    text = queued_text(server, cluster_graph(info, **no_ssh), "4")
    run_id = text.split()[2]
    try:
        assert text.startswith("started run cluster-") and "on 2 nodes (no_ssh: node-a:1, node-b:1)" in text, text
        code, run = server.get(f"/pipetrain/runs/{run_id}")
        assert code == 200 and run["gpus"] == [0] and run["cluster"]["launcher"] == "no_ssh"
        [node1] = run["node_commands"]
        assert node1["command"] in text and shlex.split(node1["command"])[-2:] == ["--node-rank", "1"]
        assert (runs_root / run_id / "hostfile").read_text() == "node-a slots=1\nnode-b slots=1\n"
        code, run = server.post(f"/pipetrain/runs/{run_id}/stop", {"kill": True})   # node 0 waits for node 1
        assert code in (200, 409) and not server.get(f"/pipetrain/runs/{run_id}")[1]["alive"], run
    finally:
        kill_runs(runs_root)
    status, js = raw(server, "GET", "/extensions/pipetrain/pipetrain.js")   # the panel shows the commands
    assert status == 200 and "node_commands" in js
