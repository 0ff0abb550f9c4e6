# SPDX-License-Identifier: GPL-3.0-or-later
"""Hostile input against a real ComfyUI server (``--cpu``, one for the module), as anyone who can reach it
could send it: prompts for the real nodes through ``/prompt`` (files uploaded through ComfyUI's own
``/upload/image`` first), and the ``/pipetrain`` routes fuzzed. Each refusal names the field; no marker file
appears, no run folder is written, no process starts, no file's content comes back, no request gets a 500.

The payloads that would only run once DeepSpeed spawns ssh or pdsh are also checked a layer below, on the
files and command we produce, in ``test_security_inputs.py``.
"""
from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from server_fixtures import comfy_server, kill_runs  # noqa: F401  (fixture)
from test_nodes_cluster_server import cluster_graph
from test_server_pipetrain import fabricate_run, fake_sdxl_files, graph, node_error

# in the server's environment (it starts after this module is imported): /proc/self/environ must not show it
SECRET = f"never-shown-{uuid.uuid4().hex}"
os.environ["PIPETRAIN_TEST_SECRET"] = SECRET


@pytest.fixture(scope="module")
def server(comfy_server):  # noqa: F811
    fake_sdxl_files(comfy_server.base)
    yield comfy_server
    kill_runs(comfy_server.runs_root)     # nothing should be there; if a payload got through, end it


@pytest.fixture(scope="module")
def marker(server):
    return server.base / f"MARKER-{uuid.uuid4().hex[:8]}"


def upload(server, subfolder: str, name: str, content: bytes, kind: str = "input",
           route: str = "/upload/image") -> tuple[int, str]:
    """ComfyUI's own upload route (no login, any content, any name): where an attacker's files land."""
    boundary = uuid.uuid4().hex
    parts = [(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
              "Content-Type: application/octet-stream\r\n\r\n").encode() + content + b"\r\n"]
    for key, value in (("subfolder", subfolder), ("type", kind), ("overwrite", "true")):
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode())
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return send(server, "POST", route, body, f"multipart/form-data; boundary={boundary}")


def uploaded(server, subfolder: str, name: str, content: bytes) -> dict:
    status, text = upload(server, subfolder, name, content)
    assert status == 200, text
    return json.loads(text)


def send(server, method: str, path: str, body: bytes = b"", content_type: str = "application/json",
         timeout: float = 30) -> tuple[int, str]:
    """A request exactly as written: the path unnormalised, the body as bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        conn.putheader("Content-Type", content_type)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        if body:
            try:
                conn.send(body)
            except (BrokenPipeError, ConnectionResetError):   # the server answered before reading it all
                pass
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def nothing_ran(server, marker) -> None:
    assert not marker.exists(), "a payload ran"
    root = server.runs_root
    assert not root.exists() or not [p for p in root.iterdir() if (p / "launcher.json").exists()
                                     and not p.name.startswith("fab-")]
    for p in psutil.process_iter(["cmdline"]):
        assert marker.name not in " ".join(p.info["cmdline"] or []), p


def test_cluster_payloads_through_prompt_are_refused_by_field(server, marker):
    info = server.get("/object_info")[1]
    evil = uploaded(server, "evil", "hostfile", f"-oProxyCommand=touch${{IFS}}{marker} slots=1\n".encode())
    hostfile = f"{evil['subfolder']}/{evil['name']}"
    uploaded(server, "evil", "sitecustomize.py", f"open({str(marker)!r}, 'w').close()\n".encode())
    evil_dir = server.base / "input" / "evil"
    assert (evil_dir / "sitecustomize.py").is_file()
    pdsh = {"cluster": "pdsh", "hosts": "node-a:1, node-b:1", "master_addr": "10.0.0.1"}
    touch = f"touch {marker}"
    cases = [
        ({"hosts": f"-oProxyCommand=touch${{IFS}}{marker}:1"}, "cluster.hosts", "starts with '-'"),
        ({"hosts": f"node-a:1, $(touch${{IFS}}{marker}):1"}, "cluster.hosts", "not a host name"),
        ({"hosts": "", "hostfile": hostfile}, "cluster.hostfile", "the host on line 1 starts with '-'"),
        ({"master_addr": f"10.0.0.1;{touch};#"}, "cluster.master_addr", "not a host name or IPv4"),
        ({"master_addr": f"`{touch}`"}, "cluster.master_addr", "not a host name or IPv4"),
        ({"env": f"PYTHONPATH={evil_dir}"}, "cluster.env", "'PYTHONPATH' would change the Python"),
        ({"env": f"LD_PRELOAD={evil_dir}/x.so"}, "cluster.env", "'LD_PRELOAD' would change the dynamic linker"),
        ({"env": f"BASH_ENV={evil_dir}/sitecustomize.py"}, "cluster.env", "'BASH_ENV'"),
        ({"env": f"PDSH_SSH_ARGS_APPEND=-oProxyCommand={touch}"}, "cluster.env", "'PDSH_SSH_ARGS_APPEND'"),
        ({"env": f"HOME={evil_dir}"}, "cluster.env", "'HOME'"),
        ({"env": f"NCCL_NET_PLUGIN={evil_dir}/x.so"}, "cluster.env", "loads code or names a file"),
        ({"env": f"NCCL_DEBUG=$({touch})"}, "cluster.env.NCCL_DEBUG", "holds '$'"),
        ({"env": f"NCCL_DEBUG=`{touch}`"}, "cluster.env.NCCL_DEBUG", "holds '`'"),
        ({"env": f'NCCL_DEBUG=x"; {touch}; "'}, "cluster.env.NCCL_DEBUG", "holds '\"'"),
        ({"env": "NCCL_DEBUG=INFO,LD_PRELOAD=/x.so", "cluster": "slurm"}, "cluster.env.NCCL_DEBUG", "srun"),
        ({"nccl_socket_ifname": f"eth0\nLD_PRELOAD={evil_dir}/x.so"}, "cluster.nccl_socket_ifname", "U+000A"),
        ({"nccl_socket_ifname": f"eth0;{touch}"}, "cluster.nccl_socket_ifname", "not a list of network interface"),
        ({"hosts": "", "hostfile": "/etc/passwd"}, "cluster.hostfile", "line 1 is not '<host> slots=<n>'"),
        ({"hosts": "", "hostfile": "/proc/self/environ"}, "cluster.hostfile", "line 1 is not '<host> slots=<n>'"),
        ({"hosts": "", "hostfile": "/dev/zero"}, "cluster.hostfile", "not a regular file"),
    ]
    passwd = open("/etc/passwd").readline().strip()
    secrets = [passwd, passwd.split(":")[0] + ":x", SECRET]
    for change, key, problem in cases:
        code, body = server.queue(cluster_graph(info, run_name="evil", **{**pdsh, **change}))
        text = json.dumps(body)
        message = node_error(body, "3")
        assert code == 400 and f"key '{key}" in message and problem in message, (change, body)
        for secret in secrets:
            assert secret not in text, (change, secret)
    nothing_ran(server, marker)


def test_a_caption_extension_cannot_reach_outside_the_dataset(server, marker):
    g = graph(run_name="evil")
    g["1"]["inputs"]["caption_extension"] = "/../../../../../../../../etc/passwd"
    # Checked when the Dataset node runs, before any node that reads a caption (at queue time ComfyUI would repeat
    # a failed check once per input the check names)
    code, body = server.queue(g)
    assert code == 200, body
    history = server.wait_history(body["prompt_id"], timeout=60)
    errors = [m[1] for m in history["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_id"] == "1", history["status"]
    message = errors[0]["exception_message"]
    assert "key 'caption_extension'" in message and "a file extension such as .txt" in message, message
    assert "root:" not in json.dumps(history)
    nothing_ran(server, marker)


def test_comfyuis_file_routes_neither_write_nor_serve_the_runs_folder(server, marker):
    """ComfyUI's upload route writes anywhere under output/ and /view reads anything there; a run folder's config,
    checkpoints and working folder are what a Resume runs, its cache decodes back into the dataset."""
    checkpointed(server, "fab-target", "stopped")
    run_toml = server.runs_root / "fab-target" / "run.toml"
    payload = f"open({str(marker)!r}, 'w').close()\n".encode()
    for route in ("/upload/image", "/api/upload/image", "/upload/mask", "/api/upload/mask"):
        for subfolder, name in (("pipetrain/fab-target", "run.toml"), ("pipetrain/fab-target/deepspeed", "__init__.py"),
                                ("pipetrain/fab-target/checkpoints/step5", "mp_rank_00_model_states.pt"),
                                ("pipetrain", "sitecustomize.py"), ("x/../pipetrain/fab-target", "pipetrain.py"),
                                ("./pipetrain//new-run", "run.toml")):
            status, text = upload(server, subfolder, name, payload, kind="output", route=route)
            assert status == 403 and "runs folder" in text, (route, subfolder, name, status, text)
    assert run_toml.read_text() == "" and not (server.runs_root / "fab-target" / "deepspeed").exists()
    assert not (server.runs_root / "sitecustomize.py").exists() and not (server.runs_root / "new-run").exists()
    status, text = upload(server, "elsewhere", "note.png", b"fine", kind="output")    # the rest of output/: as before
    assert status == 200 and (server.base / "output" / "elsewhere" / "note.png").read_bytes() == b"fine", text
    status, text = upload(server, "pipetrain", "note.png", b"fine")                   # input/pipetrain is not ours
    assert status == 200, text
    for query in ("filename=run.toml&subfolder=pipetrain/fab-target&type=output",
                  "filename=run.toml&subfolder=pipetrain/fab-target",                  # output is /view's default
                  "filename=run.toml%20[output]&subfolder=pipetrain/fab-target&type=input",
                  "filename=x/latest&subfolder=pipetrain/fab-target/checkpoints&type=output",
                  "filename=run.toml&subfolder=elsewhere/../pipetrain/fab-target&type=output"):
        for route in ("/view", "/api/view"):
            status, text = send(server, "GET", f"{route}?{query}")
            assert status == 403 and "runs folder" in text, (route, query, status, text)
    assert send(server, "GET", "/view?filename=note.png&subfolder=elsewhere&type=output") == (200, "fine")
    nothing_ran(server, marker)


# --- the routes -----------------------------------------------------------------------------------------------

def checkpointed(server, run_id: str, state: str) -> None:
    fabricate_run(server, run_id, state)
    ckpt = server.runs_root / run_id / "checkpoints"
    (ckpt / "step5").mkdir(parents=True)
    (ckpt / "step5" / "pipetrain.json").write_text("{}")   # what marks a checkpoint complete
    (ckpt / "latest").write_text("step5")


def test_a_finished_run_cannot_be_resumed(server, marker):
    checkpointed(server, "fab-done", "finished")
    code, run = server.get("/pipetrain/runs/fab-done")
    assert code == 200 and run["state"] == "finished" and not run["resumable"], run
    code, body = server.post("/pipetrain/runs/fab-done/resume")
    assert code == 409 and "has finished" in body["error"], body
    assert not (server.runs_root / "fab-done" / "launcher.json").exists()
    checkpointed(server, "fab-paused", "stopped")       # a stopped run with a checkpoint stays resumable
    assert server.get("/pipetrain/runs/fab-paused")[1]["resumable"]
    nothing_ran(server, marker)


BAD_IDS = ["..", "..%2F..%2Fetc", "%2E%2E", "..%2F", "a%00b", "a%0D%0ASet-Cookie:x", "%C3%A9t%C3%A9", "cache",
           "a" * 81, "-lead", "a%20b", "a%2Fb", "%00", "fab-done%0A", "fab-done%00", "%D9%A1", "fab%E2%80%A8done"]
BODIES = [b"[" * 100_000 + b"]" * 100_000, b'{"kill":' * 50_000, b"not json", b"[1, 2]", b'"kill"', b"null",
          b"\x00\x01\x02", b"\xff\xfe{}", b'{"kill": true}' + b" " * 20_000, b"{" + b'"a":1,' * 200_000 + b"}"]


CONTROLS = ("save", "sample", "stop_after_epoch", "lr")


def test_routes_fuzzed_answer_4xx_never_500(server, marker):
    if not (server.runs_root / "fab-done").exists():    # run alone (-k): the finished run of the test above
        checkpointed(server, "fab-done", "finished")
    outside = server.base / "outside.txt"
    outside.write_text("untouched")
    before = sorted(p.name for p in server.runs_root.iterdir())
    for run_id in BAD_IDS:
        for method, path in (("GET", f"/pipetrain/runs/{run_id}"), ("POST", f"/pipetrain/runs/{run_id}/stop"),
                             ("POST", f"/pipetrain/runs/{run_id}/resume"),
                             *(("POST", f"/pipetrain/runs/{run_id}/{a}") for a in CONTROLS),
                             ("GET", f"/pipetrain/runs/{run_id}/samples/..%2F..%2Foutside.txt")):
            status, text = send(server, method, path, b"{}" if method == "POST" else b"")
            assert status in (400, 404, 405), (method, path, status, text)
            assert "Traceback" not in text and "untouched" not in text
    for body in BODIES:
        for action in ("stop", "resume", *CONTROLS):
            status, text = send(server, "POST", f"/pipetrain/runs/fab-done/{action}", body)
            assert status in (400, 413), (action, body[:40], status, text)
            assert "Traceback" not in text and "error" in json.loads(text)
    status, text = send(server, "POST", "/pipetrain/runs/fab-done/stop", b'{"kill": true}')
    assert status == 409 and "not running" in text       # a good body reaches the launcher's own answer
    assert outside.read_text() == "untouched" and sorted(p.name for p in server.runs_root.iterdir()) == before
    assert server.alive() and server.get("/system_stats")[0] == 200
    nothing_ran(server, marker)


def test_concurrent_stop_and_resume_on_runs_that_cannot_change(server, marker):
    checkpointed(server, "fab-race-done", "finished")
    fabricate_run(server, "fab-race-nockpt", "stopped")
    answers, lock = [], threading.Lock()

    def hit(run_id, action):
        status, text = send(server, "POST", f"/pipetrain/runs/{run_id}/{action}", b"{}")
        with lock:
            answers.append((status, json.loads(text).get("error", "")))

    threads = [threading.Thread(target=hit, args=(run_id, action))
               for _ in range(6) for run_id in ("fab-race-done", "fab-race-nockpt") for action in ("stop", "resume")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == len(threads) and {s for s, _ in answers} == {409}, answers
    assert all("not running" in e or "finished" in e or "no checkpoint" in e for _, e in answers), answers
    for run_id in ("fab-race-done", "fab-race-nockpt"):
        assert not (server.runs_root / run_id / "launcher.json").exists()
    nothing_ran(server, marker)


BAD_LRS = [b'{"lr": NaN}', b'{"lr": Infinity}', b'{"lr": -Infinity}', b'{"lr": 0}', b'{"lr": -1e-4}', b'{"lr": 1e9}',
           b'{"lr": 1e999}', b'{"lr": 1e-400}', b'{"lr": true}', b'{"lr": "1e-4; touch x"}', b'{"lr": [1e-4]}',
           b'{"lr": {"$gt": 0}}', b'{"lr": null}', b"{}", b'{"lr": 1' + b"0" * 5000 + b"}", b'{"lr": "0x10"}']


def live_run(server, run_id: str):
    """A fabricated run whose recorded process is alive (a sleeper), so a request reaches the run's files."""
    from pipetrain.backend.run.folder import RunDir
    from pipetrain.launcher.procs import spawn

    fabricate_run(server, run_id, "training")
    d = server.runs_root / run_id
    ref = spawn([sys.executable, "-c", "import time; time.sleep(300)"], cwd=d, log_path=d / "log.txt", env=None)
    RunDir(d).write_launcher({"id": run_id, "gpus": [], "process": ref.as_dict(), "created": time.time()})
    return ref


def test_run_control_refuses_bad_learning_rates_and_runs_not_training(server, marker):
    ref = live_run(server, "fab-live")
    control = server.runs_root / "fab-live" / "control"
    try:
        for body in BAD_LRS:
            status, text = send(server, "POST", "/pipetrain/runs/fab-live/lr", body)
            error = json.loads(text)["error"]
            assert status == 400 and ("learning rate" in error or "JSON" in error), (body[:40], status, text)
            assert not (control / "lr.json").exists(), body[:40]
        for query in ("nan", "inf", "-1", "abc", "1e9"):
            status, text = send(server, "POST", f"/pipetrain/runs/fab-live/lr?lr={query}")
            assert status == 400 and "learning rate" in text, (query, status, text)
        status, text = send(server, "POST", "/pipetrain/runs/fab-live/lr", b'{"lr": 2.5e-5}')
        assert status == 200 and json.loads(text)["requested"]["lr"] == 2.5e-5, text
        assert json.loads((control / "lr.json").read_text())["lr"] == 2.5e-5
        for action in ("save", "stop_after_epoch"):
            status, text = send(server, "POST", f"/pipetrain/runs/fab-live/{action}", b"{}")
            assert status == 200 and (control / f"{action}.json").is_file(), (action, text)
        status, text = send(server, "POST", "/pipetrain/runs/fab-live/sample", b"{}")   # its run.toml has no [samples]
        assert status == 409 and "no sample prompts" in text and not (control / "sample.json").exists(), text
        assert send(server, "POST", "/pipetrain/runs/fab-live/delete", b"{}")[0] in (404, 405)
        # the Run Control node asks the same way; its widget bounds refuse a learning rate out of range at queue time
        node = {"1": {"class_type": "PipeTrainRunControl", "inputs": {"run": "fab-live", "action": "lr", "lr": 4e-5}}}
        code, body = server.queue(node)
        assert code == 200, body
        server.wait_history(body["prompt_id"], timeout=60)
        assert json.loads((control / "lr.json").read_text())["lr"] == 4e-5
        node["1"]["inputs"]["lr"] = 1e6
        code, body = server.queue(node)
        assert code == 400 and node_error(body, "1"), body
    finally:
        ref.signal_group(9)
    if not (server.runs_root / "fab-done").exists():
        checkpointed(server, "fab-done", "finished")
    for action in CONTROLS:
        status, text = send(server, "POST", f"/pipetrain/runs/fab-done/{action}", b'{"lr": 1e-4}')
        assert status == 409 and "not running" in text, (action, status, text)
        status, text = send(server, "POST", f"/pipetrain/runs/fab-nope/{action}", b'{"lr": 1e-4}')
        assert status == 404, (action, status, text)
    assert not (server.runs_root / "fab-done" / "control").exists()
    nothing_ran(server, marker)


# --- issue #34 --------------------------------------------------------------------------------------------------

def schedule_node(**inputs) -> dict:
    return {"class_type": "PipeTrainSchedule", "inputs": {
        "epochs": 1, "lr_scheduler": "constant", "warmup_steps": 0, "save_every_n_epochs": 1,
        "checkpoint_every_n_epochs": 0, "checkpoint_every_n_minutes": 0.0, "seed": 0, "save_every_n_steps": 0,
        "eval_every_n_epochs": 0, "eval_every_n_steps": 0, **inputs}}


def execution_error(server, prompt: dict) -> dict:
    code, body = server.queue(prompt)
    assert code == 200, body
    history = server.wait_history(body["prompt_id"], timeout=60)
    errors = [m[1] for m in history["status"]["messages"] if m[0] == "execution_error"]
    assert errors, history["status"]
    return errors[0]


def run_folders(server) -> list[str]:
    root = server.runs_root
    return sorted(p.name for p in root.iterdir() if not p.name.startswith((".", "fab-"))) if root.exists() else []


@pytest.mark.parametrize("name, link", [
    ("monitoring.wandb_api_key", {"class_type": "PrimitiveString", "inputs": {"value": "attackerKey0123456789"}}),
    ("model.vae", {"class_type": "PrimitiveString", "inputs": {"value": "/tmp/evil-vae.safetensors"}}),
    ("epochs", {"class_type": "PrimitiveInt", "inputs": {"value": 1_000_000_000}}),     # widget max 100000
])
def test_a_linked_undeclared_or_out_of_range_input_sets_no_run_key(server, marker, name, link):
    """ComfyUI hands a node every linked input, declared or not, and checks no range on a linked value: a
    Primitive node linked to the Schedule node stops the prompt at that node, naming the input; no run starts."""
    before = run_folders(server)
    g = graph(run_name="evil")
    g["5"] = schedule_node(**{name: ["6", 0]})
    g["6"] = link
    g["4"]["inputs"]["schedule"] = ["5", 0]
    error = execution_error(server, g)
    assert error["node_id"] == "5" and f"'{name}'" in error["exception_message"], error
    assert "attackerKey" not in error["exception_message"]
    assert run_folders(server) == before
    nothing_ran(server, marker)


def test_a_refused_run_leaves_no_run_folder(server, marker):
    """A Train node refused once its files are written (here: W&B asked for and not installed, which the loaded
    run file's check finds) leaves nothing under the runs root, so nothing is listed as a run."""
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: the refusal this test provokes does not happen")
    before = run_folders(server)
    g = graph(run_name="refused")
    g["5"] = schedule_node(enable_wandb=True)
    g["4"]["inputs"]["schedule"] = ["5", 0]
    error = execution_error(server, g)
    assert error["node_id"] == "4" and "pip install wandb" in error["exception_message"], error
    assert run_folders(server) == before, error["exception_message"]
    nothing_ran(server, marker)


def save_image(prefix: str) -> dict:
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
            "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}}}


def test_folders_saveimage_makes_in_the_runs_root_never_break_the_runs_list(server, marker):
    """SaveImage may write anywhere under output/: folders named like a run's files (run.toml, status.json,
    checkpoints/latest) make no run and never a 500."""
    import shutil

    fabricate_run(server, "fab-listed", "finished")
    prefixes = ["pipetrain/zzfake/run.toml/x", "pipetrain/zzfake/checkpoints/latest/x",
                "pipetrain/zzfake2/status.json/x", "pipetrain/zzfake3/launcher.json/x",
                "pipetrain/fab-listed/checkpoints/latest/x"]
    try:
        for prefix in prefixes:
            code, body = server.queue(save_image(prefix))
            assert code == 200, body
            assert server.wait_history(body["prompt_id"])["status"]["status_str"] == "success"
        assert (server.runs_root / "zzfake" / "run.toml").is_dir()
        code, body = server.get("/pipetrain/runs")
        assert code == 200, body
        ids = [r["id"] for r in body["runs"]]
        assert "fab-listed" in ids and not {"zzfake", "zzfake2", "zzfake3"} & set(ids), ids
        assert not {r["id"]: r for r in body["runs"]}["fab-listed"]["resumable"]
        assert server.get("/pipetrain/runs/fab-listed")[0] == 200
        assert server.get("/pipetrain/runs/zzfake")[0] == 404
        assert server.get("/object_info/PipeTrainRunStatus")[0] == 200
    finally:
        for name in ("zzfake", "zzfake2", "zzfake3", "fab-listed"):
            shutil.rmtree(server.runs_root / name, ignore_errors=True)
    nothing_ran(server, marker)


def test_the_samples_route_serves_only_samples_pipetrain_wrote_for_the_run(server, marker):
    """``sample_saved`` events are lines of a file in the run folder: one naming a file elsewhere (another run's,
    outside output/, a link out of the run) gets a 404, whatever its name."""
    fabricate_run(server, "fab-samples", "finished")
    fabricate_run(server, "fab-other", "finished")
    d = server.runs_root / "fab-samples"
    own = d / "x-sample00.png"
    own.write_bytes(b"own sample")
    outside = server.base / "secret-sample01.png"
    outside.write_text("outside content")
    other = server.runs_root / "fab-other" / "x-sample02.png"
    other.write_text("other run content")
    (d / "x-sample03.png").symlink_to(outside)
    paths = [own, outside, other, d / "x-sample03.png", Path("/etc/passwd")]
    with open(d / "events.jsonl", "a") as f:
        f.write(json.dumps({"type": "lora_saved", "epoch": 1, "step": 5, "path": str(d / "x.safetensors")}) + "\n")
        for i, path in enumerate(paths):
            f.write(json.dumps({"type": "sample_saved", "epoch": 1, "step": 5, "path": str(path), "prompt": "p",
                                "prompt_index": i}) + "\n")
    status, text = send(server, "GET", "/pipetrain/runs/fab-samples/samples/x-sample00.png")
    assert (status, text) == (200, "own sample")
    for name in ("secret-sample01.png", "x-sample02.png", "x-sample03.png", "passwd"):
        status, text = send(server, "GET", f"/pipetrain/runs/fab-samples/samples/{name}")
        assert status == 404 and "content" not in text and "root:" not in text, (name, status, text)
    nothing_ran(server, marker)


@pytest.mark.alone
def test_the_server_answers_while_hostile_prompts_and_run_listings_are_served(server, marker):
    """Queue-time checks run on ComfyUI's event loop, which serves every route and the websocket: 8 chained Dataset
    nodes on a folder of 100,000 entries, posted again and again beside runs listings of hundreds of folders,
    leave ``/system_stats`` answering within a second."""
    import shutil

    big = server.base / "input" / "big"
    big.mkdir(exist_ok=True)
    for i in range(100_000):          # no picture among them: a check that lists them all sees every one
        os.close(os.open(os.path.join(big, f"f{i:06d}.bin"), os.O_CREAT | os.O_WRONLY, 0o644))
    many = [server.runs_root / f"fab-many-{i:04d}" for i in range(400)]
    for d in many:
        d.mkdir(parents=True, exist_ok=True)
        (d / "run.toml").write_text("")
    prompt = graph(run_name="evil")
    for i in range(8):
        prompt[f"d{i}"] = {"class_type": "PipeTrainDataset", "inputs": {
            **prompt["1"]["inputs"], "folder": "big", **({"previous": [f"d{i - 1}", 0]} if i else {})}}
    prompt["4"]["inputs"]["dataset"] = ["d7", 0]

    def hostile():
        for _ in range(3):
            yield server.queue(prompt)[0]
            yield send(server, "GET", "/pipetrain/runs")[0]
            yield send(server, "GET", "/object_info/PipeTrainRunStatus")[0]

    try:
        # a wall-time bound on a shared 2-core VM, whose host stalls it at times (the same commit passed and missed it
        # by 0.03-1.7 s within the hour): a check that blocks the loop misses it every time, a stall once
        for _ in range(2):
            answers, latencies = latencies_while(server, hostile)
            if max(latencies) < 1.0:
                break
    finally:
        for d in many:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(big, ignore_errors=True)
    assert answers and set(answers) <= {200, 400}, answers
    assert len(latencies) > 5 and max(latencies) < 1.0, (max(latencies), len(latencies))
    nothing_ran(server, marker)


def latencies_while(server, requests) -> tuple[list[int], list[float]]:
    """The answers of ``requests()`` (a generator of status codes, sent from another thread) and how long each
    ``/system_stats`` asked meanwhile took to answer."""
    done = threading.Event()
    answers: list[int] = []

    def hostile():
        try:
            answers.extend(requests())
        finally:
            done.set()

    worker = threading.Thread(target=hostile)
    latencies = []
    worker.start()
    while not done.is_set():
        start = time.monotonic()
        status, _ = send(server, "GET", "/system_stats", timeout=120)
        latencies.append(time.monotonic() - start)
        assert status == 200
        time.sleep(0.02)
    worker.join(300)
    return answers, latencies


def big_png(megabytes: int) -> bytes:
    """A PNG of a 16 x 16 picture whose one data chunk is ``megabytes`` long: its header is read at once, every
    chunk (Pillow's verify) takes a while."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 16, 16, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", os.urandom(1 << 20) * megabytes)
            + chunk(b"IEND", b""))


@pytest.mark.alone
def test_the_server_answers_while_model_and_samples_nodes_name_slow_files(server, marker):
    """The Model and Samples nodes check their files at queue time, on ComfyUI's event loop: a pickled checkpoint
    in models/checkpoints (its tensors are listed only once it is unpickled whole: seconds for this 10 MB one) named
    by 4 Model nodes, and a 64 MB upload named by 12 Samples nodes' images, posted again and again, leave
    ``/system_stats`` answering within a second. A FIFO or a device in a model folder is refused unopened."""
    import torch

    slow = server.base / "models" / "checkpoints" / "slow.ckpt"
    slow.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"weight": torch.zeros(1), "pad": list(range(2_000_000))}, slow)
    fifo = server.base / "models" / "diffusion_models" / "fifo.safetensors"
    os.mkfifo(fifo)
    zero = server.base / "models" / "diffusion_models" / "zero.safetensors"
    zero.symlink_to("/dev/zero")
    image = uploaded(server, "slow", "big.png", big_png(64))
    name = f"{image['subfolder']}/{image['name']}"
    try:
        for dm in ("fifo.safetensors", "zero.safetensors"):
            code, body = server.queue(graph(dm=dm, run_name="evil"))
            assert code == 400 and dm in node_error(body, "2"), (dm, body)
        prompt = graph(dm="checkpoints/slow.ckpt", run_name="evil")
        for i in range(12):
            prompt[f"s{i}"] = {"class_type": "PipeTrainSamples", "inputs": {
                "prompts": "a photo", "negative_prompt": "", "seed": 0, "width": 64, "height": 64, "steps": 1,
                "cfg": 1.0, "guidance": 1.0, "sampler": "euler", "scheduler": "simple", "start_image": name,
                "end_image": name, "control_video": name}}
            prompt[f"t{i}"] = {"class_type": "PipeTrainTrain", "inputs": {
                **prompt["4"]["inputs"], "model": [f"m{i % 4}", 0], "samples": [f"s{i}", 0]}}
        for i in range(4):
            prompt[f"m{i}"] = {**prompt["2"], "inputs": dict(prompt["2"]["inputs"])}
        answers, latencies = latencies_while(server, lambda: (server.queue(prompt)[0] for _ in range(5)))
        assert answers and set(answers) <= {200, 400}, answers
        assert latencies and max(latencies) < 1.0, (max(latencies), len(latencies))
        # the slow file is still checked: when the Model node runs, on ComfyUI's worker thread
        code, body = server.queue(graph(dm="checkpoints/slow.ckpt", run_name="evil"))
        assert code == 200, body
        history = server.wait_history(body["prompt_id"], timeout=120)
        errors = [m[1] for m in history["status"]["messages"] if m[0] == "execution_error"]
        assert errors and errors[0]["node_id"] == "2" and "slow.ckpt" in errors[0]["exception_message"], errors
    finally:
        slow.unlink()
        fifo.unlink()
        zero.unlink()
    nothing_ran(server, marker)



def test_what_comfyuis_save_nodes_write_into_a_checkpoint_costs_the_run_no_resume(server, marker):
    """SaveImage (and every save node) may write under output/, so into a run's checkpoint: a file no resume reads
    (an image, a latent) leaves the checkpoint resumable; a file a resume would read is still refused by name."""
    from pipetrain.backend.train import checkpoint

    checkpointed(server, "fab-saved-into", "stopped")
    step = server.runs_root / "fab-saved-into" / "checkpoints" / "step5"
    (step / "digests.json").write_text("{}")          # a checkpoint PipeTrain saved lists its files' digests
    assert checkpoint.verify(step) is None
    latent = {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
              "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": ""}}}
    for prompt, prefix in ((save_image(""), "pipetrain/fab-saved-into/checkpoints/step5/x"),
                           (latent, "pipetrain/fab-saved-into/checkpoints/step5/mp_rank_00_model_states")):
        prompt["2"]["inputs"]["filename_prefix"] = prefix
        code, body = server.queue(prompt)
        assert code == 200, body
        assert server.wait_history(body["prompt_id"])["status"]["status_str"] == "success"
    assert len([p for p in step.iterdir() if p.name.startswith(("x_", "mp_rank_00_model_states_"))]) == 2
    assert checkpoint.verify(step) is None
    code, run = server.get("/pipetrain/runs/fab-saved-into")
    assert code == 200 and run["resumable"], run
    (step / "layer_01-model_states.pt").write_bytes(b"planted")     # what DeepSpeed would load: still refused
    assert checkpoint.verify(step) == f"{step / 'layer_01-model_states.pt'} is not among the files the checkpoint " \
                                      "was saved with"
    nothing_ran(server, marker)


@pytest.mark.alone
def test_the_server_answers_while_the_runs_folder_holds_a_flood_of_folders(server, marker):
    """SaveImage makes any number of folders in the runs folder; the Run combos list it each time ComfyUI validates
    a Run Status node (its schema is built on the event loop): 60,000 folders and prompts of 20 Run Status nodes,
    posted again and again, leave ``/system_stats`` answering within a second, and a run made meanwhile is offered."""
    import shutil

    flood = [server.runs_root / f"flood-{i:05d}" for i in range(60_000)]
    for d in flood:
        os.mkdir(d)
    prompt = {f"{i}": {"class_type": "PipeTrainRunStatus", "inputs": {"run": "newest"}} for i in range(20)}
    try:
        answers, latencies = latencies_while(server, lambda: (server.queue(prompt)[0] for _ in range(6)))
        assert answers and set(answers) <= {200, 400}, answers
        assert latencies and max(latencies) < 1.0, (max(latencies), len(latencies))
        fabricate_run(server, "fab-after-flood", "finished")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            code, body = server.queue({"1": {"class_type": "PipeTrainRunStatus", "inputs": {"run": "fab-after-flood"}}})
            if code == 200:
                break
            time.sleep(0.5)
        assert code == 200, body
    finally:
        for d in flood:
            os.rmdir(d)
        shutil.rmtree(server.runs_root / "fab-after-flood", ignore_errors=True)
    nothing_ran(server, marker)
