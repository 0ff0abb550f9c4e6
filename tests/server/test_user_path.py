# SPDX-License-Identifier: GPL-3.0-or-later
"""PipeTrain as the README installs it, used as a ComfyUI user uses it, on the pinned ComfyUI and on each newer
one the machine's ComfyUI cache holds (``comfyui_copies.NEWER_VERSIONS``; one server and one Chromium each, a
version not there is skipped naming it), each through its own frontend.

The repository is *copied* into a fresh ComfyUI base folder's ``custom_nodes/`` under another folder name;
the server runs in a Python environment where ``import pipetrain`` fails (a fresh venv that sees the test
environment's installed packages through a ``.pth`` line, which does not process their ``.pth`` files, so
the editable PipeTrain install is not there) and into which ``pip install -r requirements.txt`` must find
everything already satisfied. Then, in headless Chromium through the real frontend: each template is
opened as the template browser opens it (fetched from ComfyUI's template route, ``app.loadGraphData``), its
widgets checked against the file (no shifted values), queued with the frontend's own queue (the training template
with a few values changed as a user would; its Samples node deleted but on today's ComfyUI), and what was queued
checked; the run trains, the Train and Run Status nodes show it on the canvas, each epoch's samples are rendered
(today's ComfyUI), and its epoch LoRA renders an image through the test template. Also: one message per
validation error, the internal Epoch Samples node hidden, the optimizer's small numbers as entered in the new node renderer. Screenshots of each template as loaded,
of the finished run and of the new renderer go to ``test-artifacts/``.

The tiny Flux's text encoders need the test-only stand-in for ``DualCLIPLoader`` (``server_fixtures.SHIM_NODE``),
swapped in on the page; the model files are linked under the names the templates expect.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from comfyui_copies import NEWER_VERSIONS, NOT_COPIED, extra_packages, python_without_pipetrain
from server_fixtures import (REPO, SHIM_NODE, comfy_page, comfyui_of, fetch_image, install_test_shims, kill_runs,
                             link_model_files, load_example, needs_chromium, node_box, overlapping, start_server,
                             workflow_to_prompt)

from pipetrain.backend.host.runtime import PINNED_VERSION

pytestmark = [pytest.mark.slow, needs_chromium]

FOLDER = "ComfyUI-PipeTrain"      # not "pipetrain": ComfyUI imports the node under a name made of its path
ARTIFACTS = REPO / "test-artifacts"
IMAGES = 1         # one step an epoch: the asserts count steps and epochs, and the LoRA's effect on a render is
EPOCHS = 2         # many times what they ask after two steps


class User:
    def __init__(self, base: Path, version: str):
        self.base = base
        self.version = version
        self.server = None
        self.run_id: str | None = None
        self.pip_output = ""


@pytest.fixture(scope="module", params=[PINNED_VERSION, *NEWER_VERSIONS])
def user(request, tmp_path_factory):
    from pipetrain.backend.commands.demo import make_dataset
    from pipetrain.backend.models.tiny import cached_model_files

    comfyui = comfyui_of(request.param)
    u = User(tmp_path_factory.mktemp(f"comfy-user-{request.param}"), request.param)
    clone = u.base / "custom_nodes" / FOLDER
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(*NOT_COPIED))
    python = python_without_pipetrain(u.base / "venv", extra_packages(comfyui))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COMFYUI_PATH")}   # as the server's
    probe = subprocess.run([str(python), "-c", "import pipetrain"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0 and "No module named 'pipetrain'" in probe.stderr, probe
    # the README's step: pip install -r requirements.txt in the clone, with ComfyUI's Python (no index: all
    # must be there already, as ComfyUI's environment plus the test environment provide them)
    pip = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
                          "-r", "requirements.txt"], cwd=clone, capture_output=True, text=True, env=env)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    u.pip_output = pip.stdout

    files = cached_model_files("flux", "tiny")
    link_model_files(u.base, files, names={files.diffusion_model: "flux1-dev.safetensors", files.vae: "ae.safetensors",
                                           files.text_encoders[0]: "clip_l.safetensors",
                                           files.text_encoders[1]: "t5xxl_fp16.safetensors"})
    make_dataset(u.base / "input" / "my_dataset", IMAGES)      # the template's folder name
    install_test_shims(u.base)
    u.server = start_server(u.base, python=str(python), link_repo=False, comfyui=comfyui)
    try:
        yield u
    finally:
        u.server.stop()
        kill_runs(u.base / "output" / "pipetrain")


# --- the page ------------------------------------------------------------------------------------------------
API = "(window.comfyAPI?.api?.api ?? window.app.api)"
# frontend 1.49 (ComfyUI 0.33) keeps a loaded workflow's node ids as strings: compared as the file's numbers
# visible: the widgets the canvas draws (folded advanced ones are not)
NODES_JS = ("app.graph.nodes.map((n) => ({id: Number(n.id), type: n.type, pos: [...n.pos], size: [...n.size], "
            "title: n.title, widgets: (n.widgets ?? []).filter((w) => w.serialize !== false)"
            ".map((w) => ({name: w.name, value: w.value})), "
            "visible: (n.widgets ?? []).filter((w) => n.isWidgetVisible(w)).map((w) => w.name)}))")
# the training template's nodes open with their essential widgets only (nodes/*.py SHOWN; the seed's "control after
# generate" and the Model node's status box besides)
MOST_VISIBLE = 10


def open_template_js(name: str) -> str:
    """JS: what the template browser does with a custom node's template: fetch it from ComfyUI's route, load it."""
    return f"""(async () => {{
        const r = await fetch({API}.apiURL('/workflow_templates/{FOLDER}/{name}.json'));
        if (!r.ok) return null;
        await app.loadGraphData(await r.json(), true, true, '{name}', {{openSource: 'template'}});
        await new Promise((done) => setTimeout(done, 500));
        return {NODES_JS};
    }})()"""


def set_widgets_js(values: dict) -> str:
    return f"""(() => {{
        for (const [id, widgets] of Object.entries({json.dumps(values)})) {{
            const node = app.graph.getNodeById(Number(id));
            for (const [name, value] of Object.entries(widgets)) {{
                const w = node.widgets.find((w) => w.name === name);
                w.value = value;
                w.callback?.(value);
            }}
        }}
        return true;
    }})()"""


SWAP_CLIP_LOADER_JS = f"""(() => {{
    const old = app.graph.getNodeById(2);
    const links = app.graph.links;
    const link = (id) => (links.get ? links.get(id) : links[id]);
    const targets = (old.outputs[0].links ?? []).map(link).map((l) => [l.target_id, l.target_slot]);
    const values = Object.fromEntries(old.widgets.map((w) => [w.name, w.value]));
    const pos = [...old.pos];
    app.graph.remove(old);
    const node = LiteGraph.createNode('{SHIM_NODE}');
    node.id = 2;
    app.graph.add(node);
    node.pos = pos;
    for (const w of node.widgets) if (w.name in values) w.value = values[w.name];
    for (const [target, slot] of targets) node.connect(0, app.graph.getNodeById(target), slot);
    return node.id;
}})()"""

def canvas_js(node_id: int, needle: str, *more: int) -> str:
    """JS: the status texts shown on the canvas by nodes ``node_id`` and ``more`` once all include ``needle``."""
    ids = json.dumps([node_id, *more])
    return (f"(() => {{ const texts = {ids}.map((id) => document.querySelector("
            f"`.pipetrain-node-status[data-node='${{id}}']`)?.textContent ?? ''); "
            f"return texts.every((t) => t.includes({json.dumps(needle)})) ? texts : null; }})()")


# an input's widget name: its aria-label (frontend 1.3x) or its row's label (1.49)
VUE_NUMBERS_JS = ("(() => { const name = (i) => i.getAttribute('aria-label')"
                  " ?? i.closest('[data-testid=\"node-widget\"]')"
                  "?.querySelector('[data-testid=\"widget-layout-field-label\"]')?.textContent?.trim();"
                  " const found = Object.fromEntries([...document.querySelectorAll('input')]"
                  ".map((i) => [name(i), i.value]).filter(([n]) => ['lr', 'eps'].includes(n)));"
                  " return Object.keys(found).length === 2 ? found : null; })()")
# the optimizer's lr 2e-4 and eps 1e-8 as Nodes 2.0 shows them: frontend 1.32 with the fraction digits PipeTrain
# gives it, 1.35 and 1.49 with exactly the widget's precision (its digits of ``step``), no other option read
VUE_NUMBERS = {v: {"lr": "0.00020", "eps": "0.000000010"} for v in ("0.8.0", "0.33.0")}
VUE_NUMBERS_PINNED = {"lr": "0.0002", "eps": "0.00000001"}
QUEUE_JS = "(async () => { await app.queuePrompt(0, 1); return true; })()"


def template_values(name: str) -> dict[int, list]:
    return {n["id"]: list(n.get("widgets_values") or []) for n in load_example(name)["nodes"]}


def queued_since(server, seen: set[str], timeout: float = 30) -> str:
    """The id of the one prompt queued since ``seen`` (from /queue or /history)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        _, queue = server.get("/queue")
        _, history = server.get("/history")
        ids = {item[1] for key in ("queue_running", "queue_pending") for item in queue.get(key, [])} | set(history)
        new = ids - seen
        if new:
            (prompt_id,) = new
            return prompt_id
        time.sleep(0.2)
    raise AssertionError("the page queued nothing")


def queued_prompt(server, prompt_id: str) -> dict:
    hist = server.wait_history(prompt_id, timeout=300)
    assert hist["status"]["status_str"] == "success", hist["status"]
    return hist


def as_queued(prompt: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


# activation checkpointing off: no block's forward computed twice in the steps (nothing here is about memory)
TRAIN_CHANGES = {"1": {"resolutions": "64"}, "2": {"compute_dtype": "float32"}, "4": {"lr": 2e-3},
                 "5": {"epochs": EPOCHS}, "7": {"activation_checkpointing": False},
                 "12": {"width": 64, "height": 64, "steps": 1}}
# Epoch samples, as the template renders them (rank 0 of the run, a child process per epoch that imports ComfyUI
# and loads the model), on today's ComfyUI; on the others the page deletes the Samples node, as a user may: they
# were a third of this test's CPU time, and tests/ranks/test_samples.py and tests/server/test_server_samples.py
# assert on them on the pinned copy
SAMPLES_ON = NEWER_VERSIONS[-1]
SAMPLES_NODE = 12
DELETE_SAMPLES_JS = f"(() => {{ app.graph.remove(app.graph.getNodeById({SAMPLES_NODE})); return true; }})()"


def train_changes(version: str) -> dict:
    return TRAIN_CHANGES if version == SAMPLES_ON else {k: v for k, v in TRAIN_CHANGES.items()
                                                         if k != str(SAMPLES_NODE)}


def expected_train_prompt(version: str, object_info: dict) -> dict:
    """The train template's prompt with the page's changes (without its Samples node where the page deletes it)."""
    prompt = workflow_to_prompt(load_example("train_a_lora"), object_info, widgets=train_changes(version))
    if version != SAMPLES_ON:
        del prompt[str(SAMPLES_NODE)], prompt["9"]["inputs"]["samples"]
    return prompt


TEST_CHANGES = {"7": {"width": 64, "height": 64}, "8": {"steps": 1}}   # one step: the LoRA's effect shows already


async def drive(u: User) -> dict:
    server, out = u.server, {}
    _, object_info = server.get("/object_info")
    async with comfy_page(server, u.base / "chromium-profile") as page:
        out["templates"] = await page.js(f"{API}.getWorkflowTemplates()")
        for name in ("train_a_lora", "test_an_epoch_lora"):
            out[name] = await page.js(open_template_js(name))
            await page.screenshot(shot(u, name))

        # train: the template as loaded, a few values changed as a user would, queued with the Queue button's call
        await page.js(open_template_js("train_a_lora"))
        await page.js(set_widgets_js(train_changes(u.version)))
        if u.version != SAMPLES_ON:
            await page.js(DELETE_SAMPLES_JS)
        seen = set(server.get("/history")[1])
        await page.js(QUEUE_JS)
        async with page.behind():     # caching and training: the page only follows the run's messages
            prompt_id = queued_since(server, seen)
            hist = queued_prompt(server, prompt_id)
            out["train_queued"] = as_queued(hist["prompt"][2])
            out["train_expected"] = expected_train_prompt(u.version, object_info)
            out["train_outputs"] = hist["outputs"]
            train_text = hist["outputs"]["9"]["text"][0]
            assert train_text.startswith("started run my_lora-"), train_text
            assert "memory plan: " in train_text and " per stage at " in train_text, train_text  # planned when queued
            u.run_id = train_text.split()[2]
            # the run on the canvas: the Train and Run Status nodes follow it live
            out["canvas_live"] = await page.wait_for(canvas_js(9, "training · step"), 240,
                                                     "showing the training run on the Train node")
            out["run"] = wait_finished(server, u.run_id, timeout=400)
        out["canvas"] = await page.wait_for(canvas_js(9, "finished", 10), 30,
                                            "showing the finished run on the Train and Run Status nodes")
        await page.screenshot(shot(u, "finished-run"))

        # the epoch LoRA through the test template (the newest run's newest epoch), then at strength 0
        await page.js(open_template_js("test_an_epoch_lora"))
        await page.js(SWAP_CLIP_LOADER_JS)
        await page.js(set_widgets_js(TEST_CHANGES))
        images = []
        for strength in (1.0, 0.0):
            await page.js(set_widgets_js({"4": {"strength": strength}}))
            seen = set(server.get("/history")[1])
            await page.js(QUEUE_JS)
            async with page.behind():     # the render
                hist = queued_prompt(server, queued_since(server, seen))
            if strength == 1.0:
                out["test_queued"] = as_queued(hist["prompt"][2])
                await asyncio.sleep(1.0)
                await page.screenshot(shot(u, "epoch-lora-render"))
            (image,) = hist["outputs"]["10"]["images"]
            images.append(fetch_image(server, image))
        out["test_expected"] = workflow_to_prompt(load_example("test_an_epoch_lora"), object_info, widgets=TEST_CHANGES,
                                                  replace_types={"DualCLIPLoader": SHIM_NODE})
        out["images"] = images

        # the new node renderer ("Nodes 2.0"): the optimizer's small numbers as entered, not rounded to 0
        await page.js("(async () => { await app.extensionManager.setting.set('Comfy.VueNodes.Enabled', true); "
                      "return true; })()")
        await page.js(open_template_js("train_a_lora"))
        out["vue_numbers"] = await page.wait_for(VUE_NUMBERS_JS, 30, "showing the Optimizer's numbers in Nodes 2.0")
        await page.screenshot(shot(u, "train_a_lora-nodes2"))
        out["exceptions"] = page.exceptions
    return out


def shot(u: User, name: str) -> Path:
    """The screenshot ``name`` of ``u``'s ComfyUI version."""
    return ARTIFACTS / f"user-path-{u.version}-{name}.png"


def wait_finished(server, run_id: str, timeout: float) -> dict:
    end = time.monotonic() + timeout
    run = {}
    while time.monotonic() < end:
        _, run = server.get(f"/pipetrain/runs/{run_id}")
        if run.get("state") in ("finished", "failed", "killed", "stopped") and not run.get("alive"):
            break
        time.sleep(1)
    log = server.runs_root / run_id / "log.txt"
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    assert run.get("state") == "finished", f"run {run_id}: {run}\n--- log ---\n{tail}"
    return run


def test_readme_install_trains_and_renders_from_the_page(user):
    assert "Successfully installed" not in user.pip_output and "already satisfied" in user.pip_output
    _, object_info = user.server.get("/object_info")
    # the internal Epoch Samples node: registered (PipeTrain queues it) but hidden from the node library
    assert object_info["PipeTrainEpochSamples"]["deprecated"] is True
    assert not any(object_info[n].get("deprecated") for n in object_info if n.startswith("PipeTrain")
                   and n != "PipeTrainEpochSamples")
    # the template browser's cards: the thumbnail URL frontends 1.32 to 1.49 build for a custom node's template
    for name in ("train_a_lora", "test_an_epoch_lora"):
        with urllib.request.urlopen(f"{user.server.url}/api/workflow_templates/{FOLDER}/{name}.jpg", timeout=10) as r:
            assert r.headers["Content-Type"] == "image/jpeg" and len(r.read()) > 10_000, name
    # one message per validation error (ComfyUI repeats a failed check once per input the check names)
    code, body = user.server.queue(workflow_to_prompt(load_example("train_a_lora"), object_info,
                                                      widgets={"1": {"folder": "no_such_folder"}}))
    errors = body.get("node_errors", {}).get("1", {}).get("errors", [])
    assert code == 400 and len(errors) == 1 and "no_such_folder" in errors[0]["details"], body
    t0 = time.monotonic()
    out = asyncio.run(asyncio.wait_for(drive(user), 900))
    print(f"\nuser path: {time.monotonic() - t0:.0f} s; screenshots in {ARTIFACTS}")
    assert sorted(out["templates"].get(FOLDER, [])) == ["test_an_epoch_lora", "train_a_lora"], out["templates"]

    # each template opens with exactly the widget values of its file: none missing, none shifted
    for name in ("train_a_lora", "test_an_epoch_lora"):
        assert out[name], f"{name}: not served by /workflow_templates/{FOLDER}/"
        shown = {n["id"]: [w["value"] for w in n["widgets"]] for n in out[name]}
        assert shown == template_values(name), (name, shown)
        # the rest folded as advanced: every value still there (above), at most MOST_VISIBLE widgets shown
        crowded = {n["title"]: n["visible"] for n in out[name] if len(n["visible"]) > MOST_VISIBLE}
        assert not crowded, (name, crowded)
        if name == "train_a_lora":
            dataset = next(n for n in out[name] if n["type"] == "PipeTrainDataset")
            assert dataset["visible"] == ["folder", "resolutions", "enable_ar_bucket", "num_repeats",
                                          "caption_extension", "frame_buckets", "control_folder"], dataset["visible"]
        # at the sizes the frontend gives the nodes (at least their content's), none covers another
        boxes = {f"{n['id']} {n['title']}": node_box(n["pos"], n["size"]) for n in out[name]}
        assert not overlapping(boxes), (name, overlapping(boxes), boxes)

    # what the page queued is what the template shows, with the changed values
    assert out["train_queued"] == out["train_expected"], (out["train_queued"], out["train_expected"])
    assert out["train_queued"]["5"]["inputs"]["save_every_n_steps"] == 0
    assert out["test_queued"] == out["test_expected"], (out["test_queued"], out["test_expected"])

    live, (train_node, status_node) = out["canvas_live"][0], out["canvas"]
    run_id = user.run_id
    assert live.startswith(f"run {run_id}\ntraining · step "), live
    for text in (train_node, status_node):
        assert text.startswith(f"run {run_id}\nfinished · step {IMAGES * EPOCHS}/{IMAGES * EPOCHS}\n"
                               f"newest epoch LoRA: {EPOCHS}"), text
    assert "started run " + run_id in train_node, train_node
    run = out["run"]
    assert run["step"] == IMAGES * EPOCHS and sorted(x["epoch"] for x in run["loras"]) == [1, 2], run
    if user.version == SAMPLES_ON:   # every epoch's samples, as the template renders them, shown on the panel
        lines = (user.server.runs_root / run_id / "events.jsonl").read_text().splitlines()
        saved = [e for e in map(json.loads, lines) if e["type"] == "sample_saved"]
        assert sorted({e["epoch"] for e in saved}) == [1, 2], saved
        assert all(len(x["samples"]) == len(saved) // EPOCHS > 0 for x in run["loras"]), run["loras"]
    lora, base = out["images"]
    diff = abs(lora.astype(int) - base.astype(int))
    assert lora.shape == (64, 64, 3) and diff.mean() > 0.5, diff.mean()
    assert out["vue_numbers"] == VUE_NUMBERS.get(user.version, VUE_NUMBERS_PINNED), out["vue_numbers"]
    assert not [e for e in out["exceptions"] if "pipetrain" in e.lower()], out["exceptions"]
    for name in ("train_a_lora", "test_an_epoch_lora", "finished-run"):
        assert shot(user, name).stat().st_size > 10_000
