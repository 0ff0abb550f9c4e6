// SPDX-License-Identifier: GPL-3.0-or-later
// PipeTrain panel: runs with progress and ETA, a live loss chart, epoch LoRAs (one click adds a
// "PipeTrain Load Epoch LoRA" node), stop/resume, and while a run trains: save now, sample now, stop after this
// epoch, a new learning rate from the next step (POST /pipetrain/runs/{id}/{save,sample,stop_after_epoch,lr}).
// Fed by GET /pipetrain/runs[/{id}] and the "pipetrain.event" websocket messages that the launcher's relay sends.
// A run on several machines shows its nodes and, while a no_ssh run is alive, the command each other node must run
// (events come from global rank 0).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// loaded: the runs whose loss curve was read from their files (the websocket alone brings only the steps since the
// page opened)
const state = { runs: new Map(), selected: null, losses: new Map(), best: new Map(), root: null, lrInputs: new Map(),
  loaded: new Set() };
const ACTIVE = new Set(["launched", "resuming", "starting", "caching", "loading", "training", "stopping"]);

const css = `
.pipetrain-panel{font:12px sans-serif;color:var(--fg-color,#ddd);padding:8px;display:flex;flex-direction:column;gap:8px;height:100%;overflow:auto;box-sizing:border-box}
.pipetrain-panel h3{margin:0;font-size:14px}
.pipetrain-run{border:1px solid #555;border-radius:6px;padding:6px;cursor:pointer}
.pipetrain-run.sel{border-color:#4a9eff}
.pipetrain-bar{height:8px;background:#333;border-radius:4px;overflow:hidden;margin:4px 0}
.pipetrain-bar>div{height:100%;background:#4a9eff;width:0}
.pipetrain-row{display:flex;justify-content:space-between;gap:6px;align-items:center}
.pipetrain-panel button{font-size:11px;padding:2px 6px;cursor:pointer}
.pipetrain-chart{width:100%;height:160px;background:#1b1b1b;border-radius:4px}
.pipetrain-nodes{margin-top:4px;cursor:auto}
.pipetrain-cmd{white-space:pre-wrap;word-break:break-all;background:#1b1b1b;padding:4px;border-radius:4px;font:11px monospace;margin:2px 0 4px;user-select:text}
.pipetrain-samples{display:flex;flex-wrap:wrap;gap:4px;margin:2px 0 6px}
.pipetrain-samples img{width:72px;height:72px;object-fit:cover;border-radius:3px;cursor:zoom-in}
.pipetrain-samples audio{width:220px;height:32px}
.pipetrain-control{flex-wrap:wrap;justify-content:flex-start;margin-top:4px}
.pipetrain-control input{width:72px;font-size:11px}
.pipetrain-strength{min-width:40px;font-size:11px}
.pipetrain-best{color:#7c7;margin:2px 0}
.pipetrain-float{position:fixed;right:12px;top:60px;width:340px;max-height:80vh;z-index:1000;background:#222;border:1px solid #555;border-radius:8px}
`;

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick") e.onclick = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

const fmtEta = (s) => (s == null ? "" : s >= 3600 ? `${(s / 3600).toFixed(1)} h` : s >= 60 ? `${Math.round(s / 60)} min` : `${Math.round(s)} s`);

async function refreshRuns() {
  const r = await api.fetchApi("/pipetrain/runs");
  if (!r.ok) return;
  const { runs } = await r.json();
  state.runs = new Map(runs.map((x) => [x.id, x]));
  if (!state.selected && runs.length) await select(runs[0].id);
  else if (state.selected && !state.loaded.has(state.selected)) await loadRun(state.selected);
  render();
}

async function select(id) {
  state.selected = id;
  await loadRun(id);
  render();
}

// the run's whole loss curve from its files: what the websocket never delivered (ComfyUI restarting, the
// page asleep) comes back this way
async function loadRun(id) {
  const r = await api.fetchApi(`/pipetrain/runs/${encodeURIComponent(id)}`);
  if (!r.ok) return;
  const run = await r.json();
  // steps that came over the websocket while the files were read stay
  const newer = (state.losses.get(id) || []).filter(([step]) => !(run.losses || []).some(([s]) => s >= step));
  state.losses.set(id, [...(run.losses || []), ...newer]);
  state.best.set(id, run.best_epoch || null);
  state.runs.set(id, run);
  state.loaded.add(id);
}

let backfilling = null;
function backfill(id) {
  if (backfilling) return;
  backfilling = loadRun(id).finally(() => { backfilling = null; render(); });
}

async function post(id, action, body = {}) {
  const r = await api.fetchApi(`/pipetrain/runs/${encodeURIComponent(id)}/${action}`, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!r.ok) {
    const msg = (await r.json().catch(() => ({}))).error || r.statusText;
    app.extensionManager?.toast?.add?.({ severity: "error", summary: "PipeTrain", detail: msg, life: 5000 });
  }
  await refreshRuns();
}

function addLoader(runId, epoch, strength = 1.0) {
  const node = LiteGraph.createNode("PipeTrainLoadEpochLoRA");
  if (!node) return;
  const set = (name, value) => { const w = node.widgets?.find((w) => w.name === name); if (w) w.value = value; };
  set("run", runId);
  set("epoch", epoch);
  set("strength", strength);
  const c = app.canvas;
  node.pos = c?.graph_mouse ? [c.graph_mouse[0], c.graph_mouse[1]] : [100, 100];
  app.graph.add(node);
  app.graph.setDirtyCanvas(true, true);
}

function drawChart(canvas, points) {
  canvas.dataset.points = String(points.length);  // what the chart shows, readable by tests and tools
  canvas.dataset.lastStep = points.length ? String(points[points.length - 1][0]) : "";
  const ctx = canvas.getContext("2d");
  const w = (canvas.width = canvas.clientWidth || 300), h = (canvas.height = canvas.clientHeight || 160);
  ctx.clearRect(0, 0, w, h);
  ctx.fillStyle = "#888"; ctx.font = "10px sans-serif";
  if (points.length < 2) { ctx.fillText("loss: waiting for steps…", 8, 14); return; }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const px = (x) => 30 + ((x - x0) / (x1 - x0 || 1)) * (w - 38), py = (y) => h - 14 - ((y - y0) / (y1 - y0 || 1)) * (h - 26);
  ctx.strokeStyle = "#4a9eff"; ctx.lineWidth = 1.5; ctx.beginPath();
  points.forEach(([x, y], i) => (i ? ctx.lineTo(px(x), py(y)) : ctx.moveTo(px(x), py(y))));
  ctx.stroke();
  ctx.fillText(y1.toPrecision(3), 2, 12); ctx.fillText(y0.toPrecision(3), 2, h - 14);
  ctx.fillText(`step ${x0}`, 30, h - 2); ctx.fillText(`${x1}`, w - 30, h - 2);
}

function nodeCommands(run) {
  // no_ssh: node 0 runs here; every other node joins with its own command (sent again on resume)
  const box = el("div", { class: "pipetrain-nodes", onclick: (e) => e.stopPropagation() },
    el("div", {}, "Start the other nodes (same paths, shared run folder):"));
  for (const c of run.node_commands) {
    box.append(el("div", { class: "pipetrain-row" }, `node ${c.node_rank} (${c.host})`,
      el("button", { onclick: () => navigator.clipboard?.writeText(c.command) }, "Copy")),
    el("pre", { class: "pipetrain-cmd", "data-node": c.node_rank }, c.command));
  }
  return box;
}

const started = (run) => (run.created ? `started ${new Date(run.created * 1000).toLocaleString()}` : "");
function devices(run) {
  if (run.cluster) return "";
  const n = (run.gpus || []).length;
  return run.cpu ? `CPU, ${n} rank${n === 1 ? "" : "s"}` : n ? `GPU ${run.gpus.join(", ")}` : "";
}

function runCard(run) {
  const pct = run.total_steps ? Math.min(100, (100 * (run.step || 0)) / run.total_steps) : 0;
  const card = el("div", { class: `pipetrain-run${run.id === state.selected ? " sel" : ""}`, "data-run": run.id, onclick: () => select(run.id) },
    el("div", { class: "pipetrain-row" }, el("b", {}, run.name || run.id), el("span", { class: "pipetrain-state" }, run.state)),
    // same-named runs told apart: the id (unique) and when it started; and where it trains
    el("div", { class: "pipetrain-row pipetrain-ident" }, el("span", {}, run.id),
      el("span", {}, [started(run), devices(run)].filter(Boolean).join(" · "))),
    el("div", { class: "pipetrain-bar" }, el("div", { style: `width:${pct}%` })),
    el("div", { class: "pipetrain-row" },
      el("span", { class: "pipetrain-progress" }, run.total_steps ? `step ${run.step || 0}/${run.total_steps}` : run.state),
      el("span", {}, run.loss != null ? `loss ${Number(run.loss).toFixed(4)}` : ""),
      // a stopped, failed or finished run has no time left to estimate
      el("span", { class: "pipetrain-eta" }, run.eta_s && run.alive && ACTIVE.has(run.state) ? `ETA ${fmtEta(run.eta_s)}` : "")));
  const buttons = el("div", { class: "pipetrain-row" });
  if (run.alive && ACTIVE.has(run.state)) {
    buttons.append(el("button", { onclick: (e) => { e.stopPropagation(); post(run.id, "stop"); } }, "Stop"));
    buttons.append(el("button", { onclick: (e) => {
      e.stopPropagation();
      // Kill loses the steps since the last checkpoint (Stop saves one first)
      if (window.confirm(`Kill run ${run.name || run.id} now? Steps since its last checkpoint are lost; Stop saves one first.`)) {
        post(run.id, "stop", { kill: true });
      }
    } }, "Kill"));
  } else if (run.resumable && run.state !== "finished") {   // a finished run has nothing left to train
    buttons.append(el("button", { onclick: (e) => { e.stopPropagation(); post(run.id, "resume"); } }, "Resume"));
  }
  if (run.cluster) {
    const hosts = run.cluster.hosts || [];
    card.append(el("div", { class: "pipetrain-cluster" }, `${hosts.length} nodes (${run.cluster.launcher}): ${hosts.join(", ")}`));
  }
  if (run.alive && (run.node_commands || []).length) card.append(nodeCommands(run));
  if (run.error) card.append(el("div", { style: "color:#f77" }, run.error));
  // what the run says is wrong while it goes on (a changed dataset, a rank that does not answer)
  for (const message of Object.values(run.warnings || {})) card.append(el("div", { style: "color:#fb5" }, String(message)));
  if (run.alive && run.stop_after_epoch != null) card.append(el("div", { class: "pipetrain-pending" }, `stops after epoch ${run.stop_after_epoch}`));
  card.append(buttons);
  if (run.alive && ACTIVE.has(run.state) && run.state !== "stopping") card.append(controls(run));
  return card;
}

// requests the run takes at its next step (backend/run/control.py); its events say when it acted
function controls(run) {
  const act = (action, body) => (e) => { e.stopPropagation(); post(run.id, action, body); };
  // one input per run, kept across renders (every step event re-renders): what is typed stays
  let lr = state.lrInputs.get(run.id);
  if (!lr) {
    lr = el("input", { type: "number", step: "any", min: "0", placeholder: "new LR", title: "learning rate from the next step",
      class: "pipetrain-lr", value: run.base_lr ?? run.lr ?? "" });
    lr.onclick = (e) => e.stopPropagation();
    state.lrInputs.set(run.id, lr);
  }
  const setLr = (e) => {
    e.stopPropagation();
    const value = Number(lr.value);
    if (!(value > 0) || !Number.isFinite(value)) {
      app.extensionManager?.toast?.add?.({ severity: "error", summary: "PipeTrain", detail: "the learning rate must be a number above 0", life: 5000 });
      return;
    }
    post(run.id, "lr", { lr: value });
  };
  return el("div", { class: "pipetrain-row pipetrain-control" },
    el("button", { onclick: act("save"), title: "write a LoRA and a checkpoint at the next step" }, "Save now"),
    el("button", { onclick: act("sample"), title: "save a LoRA and render the sample prompts with it" }, "Sample now"),
    el("button", { onclick: act("stop_after_epoch"), title: "finish this epoch (its LoRA and samples), then stop with a checkpoint" }, "Stop after epoch"),
    lr, el("button", { onclick: setLr }, "Set LR"));
}

// the epoch's sample images (sample_saved events), served by GET /pipetrain/runs/{id}/samples/{name}: one row
// per LoRA strength, one column per prompt; a click on a row's strength adds a loader at that epoch and strength
const AUDIO = /\.(flac|wav|mp3|ogg|opus)$/i;   // backend/sampling/audio.py's AUDIO_TYPES
function sampleGrid(runId, epoch, samples, loaders = true) {
  const strengths = [...new Set(samples.map((s) => s.strength ?? 1))].sort((a, b) => a - b);
  const grid = el("div", { class: "pipetrain-grid", "data-epoch": String(epoch) });
  for (const w of strengths) {
    const row = el("div", { class: "pipetrain-samples", "data-strength": String(w) });
    if (loaders && strengths.length > 1) {
      row.append(el("button", { class: "pipetrain-strength", title: `Add a loader for epoch ${epoch} at ${w}`,
        onclick: () => addLoader(runId, epoch, w) }, `×${w}`));
    }
    const cells = samples.filter((s) => (s.strength ?? 1) === w)
      .sort((a, b) => (a.prompt_index ?? 0) - (b.prompt_index ?? 0));
    for (const s of cells) {
      const url = api.apiURL(`/pipetrain/runs/${encodeURIComponent(runId)}/samples/${encodeURIComponent(s.name)}`);
      const label = `${s.prompt || s.name} (strength ${w})`;
      if (AUDIO.test(s.name)) {   // an audio model's song (FLAC): a player, no thumbnail
        row.append(el("audio", { src: url, title: label, controls: "", preload: "none" }));
        continue;
      }
      const img = el("img", { src: url, title: label, alt: label, loading: "lazy" });
      img.onclick = () => window.open(url, "_blank");
      row.append(img);
    }
    grid.append(row);
  }
  return grid;
}

function render() {
  const root = state.root;
  if (!root) return;
  const focused = document.activeElement;   // an LR being typed keeps its focus through the re-render
  root.replaceChildren(el("h3", {}, "PipeTrain runs"));
  if (!state.runs.size) root.append(el("div", {}, "No runs yet: queue a workflow with a PipeTrain Train node."));
  for (const run of state.runs.values()) root.append(runCard(run));
  if (focused?.classList?.contains("pipetrain-lr") && focused.isConnected) focused.focus();
  const run = state.runs.get(state.selected);
  if (!run) return;
  const canvas = el("canvas", { class: "pipetrain-chart" });
  root.append(el("h3", {}, `Loss — ${run.id}`), canvas);
  drawChart(canvas, state.losses.get(run.id) || []);
  const epochs = el("div", { class: "pipetrain-epochs" }, el("h3", {}, "Epoch LoRAs"));
  const best = state.best.get(run.id);   // the lowest held-out loss (eval datasets): GET /pipetrain/runs/{id}
  if (best) {
    epochs.append(el("div", { class: "pipetrain-best" },
      `Lowest held-out loss: epoch ${best.epoch} (${Number(best.loss).toPrecision(4)})`));
  }
  for (const l of [...(run.loras || [])].sort((a, b) => b.epoch - a.epoch)) {
    const use = l.kind === "model"   // a full fine-tune's model: load it with Load Diffusion Model
      ? el("span", { title: l.path }, `full model: ${l.path.split("/").pop()}`)
      : el("button", { onclick: () => addLoader(run.id, l.epoch) }, "Add loader node");
    const mark = best && best.epoch === l.epoch ? " ★ lowest eval loss" : "";
    epochs.append(el("div", { class: "pipetrain-row" }, `epoch ${l.epoch} (step ${l.step})${mark}`, use));
    if ((l.samples || []).length) epochs.append(sampleGrid(run.id, l.epoch, l.samples));
  }
  if (!(run.loras || []).length) epochs.append(el("div", {}, "none saved yet"));
  root.append(epochs);
  if ((run.step_samples || []).length) {   // "Sample now": samples of the step LoRA saved for them
    const now = el("div", { class: "pipetrain-step-samples" }, el("h3", {}, "Sampled now"));
    for (const l of [...run.step_samples].sort((a, b) => b.step - a.step)) {
      now.append(el("div", { class: "pipetrain-row", title: l.path }, `step ${l.step} (epoch ${l.epoch})`),
        sampleGrid(run.id, l.epoch, l.samples, false));   // a step LoRA: no epoch loader
    }
    root.append(now);
  }
}

function onEvent({ detail }) {
  if (!detail?.run_id) return;
  const id = detail.run_id;
  const old = state.runs.get(id);
  state.runs.set(id, { ...(old || {}), ...detail.run });
  const pts = state.losses.get(id) || [];
  const steps = (detail.events || []).filter((e) => e.type === "step" && e.loss != null);
  const last = pts.length ? pts[pts.length - 1][0] : null;
  if (id === state.selected && steps.length && last != null && steps[0].step > last + 1) {
    backfill(id);       // steps were made while no message reached us: read the curve from the run's files
  }
  for (const e of steps) if (last == null || e.step > last) pts.push([e.step, e.loss]);
  if (id === state.selected && (detail.events || []).some((e) => e.type === "eval")) backfill(id);
  state.losses.set(id, pts);
  if (!old) state.runs = new Map([...state.runs.entries()].sort((a, b) => (b[1].created || 0) - (a[1].created || 0)));
  if (!old || !state.selected) {   // a run that just started (queued here or elsewhere): the panel follows it
    select(id);
    return;
  }
  if (id === state.selected && !state.loaded.has(id)) backfill(id);   // a reload mid-run: the curve from the files
  render();
}

// the Train node's "started run <id>": follow the run just queued, even before its first event
function onExecuted({ detail }) {
  const id = (detail?.output?.text ?? []).join("\n").match(/^started run (\S+)/)?.[1];
  if (id && id !== state.selected) refreshRuns().then(() => select(id));
}

function mount(container) {
  state.root = el("div", { class: "pipetrain-panel", id: "pipetrain-panel" });
  container.replaceChildren(state.root);
  render();          // the tab is re-mounted each time it opens: show what is known while the list reloads
  refreshRuns();
}

app.registerExtension({
  name: "pipetrain.panel",
  async setup() {
    document.head.append(el("style", {}, css));
    api.addEventListener("pipetrain.event", onEvent);
    api.addEventListener("executed", onExecuted);
    // ComfyUI restarted (or the socket dropped): the relay does not replay what it sent meanwhile
    api.addEventListener("reconnected", () => { refreshRuns().then(() => state.selected && backfill(state.selected)); });
    const mgr = app.extensionManager;
    if (mgr?.registerSidebarTab) {
      mgr.registerSidebarTab({ id: "pipetrain", icon: "pi pi-chart-line", title: "PipeTrain", tooltip: "PipeTrain runs",
        type: "custom", render: (elem) => mount(elem) });
    } else {
      const box = el("div", { class: "pipetrain-float" });
      document.body.append(box);
      mount(box);
    }
  },
});
