// SPDX-License-Identifier: GPL-3.0-or-later
// Status on the canvas: the Model, Cache, Train, Run Status and Load Epoch LoRA nodes show what they returned (ComfyUI's bundled
// frontend shows a node's text output nowhere), and the Train and Run Status nodes follow their run live:
// run id, state, step and newest epoch LoRA, from the "pipetrain.event" messages the launcher's relay sends.
// The text sits in a widget that is neither saved in the workflow nor queued (serialize false), after the
// node's own widgets, so templates' widget values keep their places.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const TEXT_NODES = new Set(["PipeTrainModel", "PipeTrainCache", "PipeTrainTrain", "PipeTrainRunStatus",
                            "PipeTrainLoadEpochLoRA"]);
const RUN_NODES = new Set(["PipeTrainTrain", "PipeTrainRunStatus"]);
const WIDGET = "pipetrain_status";
const NEWEST = "newest";
const runs = new Map();   // run id -> newest summary from the relay

const css = `.pipetrain-node-status{font:11px monospace;white-space:pre-wrap;word-break:break-all;
color:var(--input-text,#ddd);background:var(--comfy-input-bg,#222);border-radius:4px;padding:3px 5px;
box-sizing:border-box;overflow:auto;height:100%}`;

function statusBox(node) {
  const found = node.widgets?.find((w) => w.name === WIDGET);
  if (found) return found.element;
  const box = document.createElement("div");
  box.className = "pipetrain-node-status";
  box.dataset.node = String(node.id);
  box.textContent = "";
  const widget = node.addDOMWidget(WIDGET, "pipetrain-status", box, {
    serialize: false, hideOnZoom: false, getValue: () => "", setValue: () => {},
  });
  widget.serialize = false;
  widget.computeLayoutSize = () => ({ minHeight: 64, maxHeight: 120, minWidth: 0 });
  return box;
}

// The new node renderer (Vue) formats a number with at most 3 fraction digits unless the widget says otherwise:
// lr = 2e-4 and eps = 1e-8 showed as 0. Each float widget's precision (from its step) is its digit budget.
function showDigits(node) {
  for (const w of node.widgets ?? []) {
    const digits = w.options?.precision;
    if (w.type === "number" && digits > 3 && w.options.maxFractionDigits === undefined) {
      w.options.minFractionDigits = 0;
      w.options.maxFractionDigits = Math.min(digits, 20);
    }
  }
}

// A node's advanced inputs (``nodes/declared.py``: all but its essential widgets) stay folded until the node's
// "Show Advanced" menu entry. Frontends before 1.49 do not mark a widget advanced from its input's options, and
// their canvas lays out a folded widget's row all the same: a folded widget is marked here and measures nothing
// until the node shows its advanced widgets. A node opened folded is only as tall as what it shows.
function foldAdvanced(node) {
  let folded = false;
  for (const w of node.widgets ?? []) {
    if (!w.options?.advanced) continue;
    folded = true;
    if (w.pipetrainFolds) continue;
    w.advanced = w.pipetrainFolds = true;
    if (w.computeLayoutSize) {
      const layout = w.computeLayoutSize;
      w.computeLayoutSize = function (n) {
        return node.showAdvanced ? layout.call(this, n) : { minHeight: 0, maxHeight: 0, minWidth: 0 };
      };
    } else {
      const size = w.computeSize;
      w.computeSize = function (width) {
        if (!node.showAdvanced) return [0, -4];   // the canvas adds 4 to a widget's height
        return size ? size.call(this, width) : [width, globalThis.LiteGraph?.NODE_WIDGET_HEIGHT ?? 20];
      };
    }
  }
  if (folded && !node.showAdvanced && node.computeSize) {
    node.setSize([node.size[0], node.computeSize()[1]]);
  }
}

function show(node, text) {
  const box = statusBox(node);
  box.dataset.node = String(node.id);
  if (box.textContent !== text) {
    box.textContent = text;
    node.setDirtyCanvas?.(true, true);
  }
}

function runText(run) {
  const lines = [`run ${run.id}`];
  const progress = run.total_steps ? ` · step ${run.step || 0}/${run.total_steps}` : "";
  lines.push(`${run.state}${progress}`);
  const newest = (run.loras || []).reduce((a, b) => ((b.epoch || 0) > (a?.epoch || 0) ? b : a), null);
  lines.push(newest ? `newest epoch LoRA: ${newest.epoch}` : "no epoch LoRA yet");
  if (run.error) lines.push(`error: ${run.error}`);
  return lines.join("\n");
}

// The run a node follows: the one its last output named (the Train node's started run, the run a Run Status
// node reported); before that, a Run Status node's chosen run, or the newest run
function followedRun(node) {
  if (node.pipetrainRun) return runs.get(node.pipetrainRun);
  if (node.comfyClass !== "PipeTrainRunStatus") return undefined;
  const chosen = node.widgets?.find((w) => w.name === "run")?.value;
  if (chosen && chosen !== NEWEST) return runs.get(chosen);
  return [...runs.values()].sort((a, b) => (b.created || 0) - (a.created || 0))[0];
}

function refresh() {
  for (const node of app.graph?.nodes ?? []) {
    if (!RUN_NODES.has(node.comfyClass)) continue;
    const run = followedRun(node);
    // the Train node's own line (where it started the run) stays; a Run Status node's output is the older news
    const own = node.comfyClass === "PipeTrainTrain" ? node.pipetrainOutput : "";
    if (run) show(node, [runText(run), own].filter(Boolean).join("\n"));
  }
}

function onExecuted({ detail }) {
  const node = app.graph?.getNodeById(Number(detail?.node));
  if (!node || !TEXT_NODES.has(node.comfyClass)) return;
  const text = (detail.output?.text ?? []).join("\n");
  node.pipetrainOutput = text;
  if (node.comfyClass === "PipeTrainTrain") node.pipetrainRun = text.match(/^started run (\S+)/)?.[1];
  if (node.comfyClass === "PipeTrainRunStatus") node.pipetrainRun = text.match(/^([^:\s]+):/)?.[1];
  const run = RUN_NODES.has(node.comfyClass) ? followedRun(node) : undefined;
  show(node, [run && runText(run), text].filter(Boolean).join("\n"));
}

function onRunEvent({ detail }) {
  if (!detail?.run_id || !detail.run) return;
  runs.set(detail.run_id, { ...(runs.get(detail.run_id) || {}), ...detail.run });
  refresh();
}

app.registerExtension({
  name: "pipetrain.nodeStatus",
  async setup() {
    const style = document.createElement("style");
    style.textContent = css;
    document.head.append(style);
    api.addEventListener("executed", onExecuted);
    api.addEventListener("pipetrain.event", onRunEvent);
    try {  // the runs known before this page opened
      const r = await api.fetchApi("/pipetrain/runs");
      if (r.ok) for (const run of (await r.json()).runs || []) runs.set(run.id, { ...run, ...(runs.get(run.id) || {}) });
    } catch {
      // the panel reports an unreachable server; the nodes fill in with the next event
    }
  },
  nodeCreated(node) {
    if (TEXT_NODES.has(node.comfyClass)) statusBox(node);
    if (node.comfyClass?.startsWith("PipeTrain")) {
      showDigits(node);
      foldAdvanced(node);
    }
  },
  loadedGraphNode(node) {   // a saved workflow's node: its saved size was made for every widget shown
    if (node.comfyClass?.startsWith("PipeTrain")) foldAdvanced(node);
  },
});
