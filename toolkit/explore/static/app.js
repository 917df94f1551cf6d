// dmt explore: the form comes from the CLI parsers (/api/form); every number shown comes from /api/estimate,
// /api/plan and /api/generate. This file only lays out fields, sends requests and draws what comes back.
"use strict";

const GiB = 2 ** 30;
const COMPONENTS = ["weights", "gradients", "optimizer", "activations", "overhead"];  // memory_bytes of the record
const COLORS = {weights: "#4e79a7", gradients: "#f28e2b", optimizer: "#59a14f", activations: "#e15759",
                overhead: "#9c9c9c", capacity: "#1f2a44", step: "#b07aa1"};
const PAGE_SET = {explain: true};  // options the page sets itself rather than showing as fields
// a checkbox that asks the same verb another question (its answer is shown beside the usual one): `dmt estimate
// --max-seq-len` and `dmt plan --max-seq-len` search the sequence length, so they are sent without --seq-len
const SEPARATE_ANSWER = "max_seq_len";
// what a plan does to fit a longer sequence, as the sweep names it: option -> its text in a plan, or null when off
const LONG_CONTEXT = {
  recompute: (p) => (p.recompute === "none" ? null : `recompute=${p.recompute}`),
  tiled_mlp: (p) => (p.tiled_mlp ? "tiled_mlp" : null),
  tiled_loss: (p) => (p.tiled_loss ? "tiled_loss" : null),
  offload_activations: (p) => (p.offload_activations === "none" ? null : `offload_activations=${p.offload_activations}`),
  sp: (p) => (p.sp > 1 ? `sp=${p.sp}` : null),
  cp: (p) => (p.cp > 1 ? `cp=${p.cp}` : null),
};
const FIRST_VALUES = {gpus: "8"};  // a starting value for required options without a default
const SWEEPS = {
  gpus: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
  seq_len: [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
};
const FILE_ORDER = ["deepspeed.json", "megatron.yaml", "accelerate.yaml", "slurm.sbatch"];

const state = {setup: null, fields: {estimate: [], plan: []}, planOnly: new Set(), report: null, plans: [],
               seq: {estimate: 0, plan: 0, sweep: 0, longest: 0}, charts: {}, file: null,
               uploads: {}};  // key of a "file" field -> the text of the file chosen (the server never takes a path)
// what the tests wait on: a change is scheduled, or requests are in flight
window.explorer = {pending: 0, scheduled: 0, busy() { return this.pending > 0 || this.scheduled > 0; }};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}
const $ = (selector) => document.querySelector(selector);
const gib = (bytes) => (bytes / GiB).toFixed(2);
const fmt = (n, digits = 3) => Number(n).toPrecision(digits);
const billions = (n) => `${(n / 1e9).toFixed(n < 1e10 ? 2 : 0)}B`;

async function api(path, body) {
  window.explorer.pending++;
  try {
    const response = await fetch(path, body === undefined ? {} : {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
    let payload;
    try { payload = await response.json(); } catch (e) { payload = {error: `${path}: HTTP ${response.status}`}; }
    return {ok: response.ok, payload};
  } catch (e) {
    return {ok: false, payload: {error: `${path}: the dmt explore server did not answer (${e.message})`}};
  } finally {
    window.explorer.pending--;
  }
}

// ---- the form, built from the parsers' fields ----
function suggestions(key) {
  if (key === "gpu") return state.setup.gpus.map((g) => g.name);
  return null;
}

function fieldElement(field, prefix) {
  const id = `${prefix}-${field.key}`;
  const wrap = el("div", {class: "field", "data-key": field.key, title: field.help});
  const label = el("label", {for: id}, field.key.replace(/_/g, " ") + " ", el("span", {class: "flag"}, field.flag));
  let control;
  const choices = field.kind === "select" ? field.choices : suggestions(field.key);
  if (field.kind === "checkbox") {
    control = el("input", {type: "checkbox", id});
    control.checked = Boolean(field.default);
    wrap.classList.add("checkbox");
    wrap.append(control, label);
  } else if (field.kind === "file") {
    control = el("input", {type: "file", id, accept: ".yaml,.yml"});
    control.addEventListener("change", () => upload(field.key, control));
    wrap.classList.add("wide");
    wrap.append(label, control);
  } else {
    if (choices) {
      control = el("select", {id});
      if (field.default === null) control.append(el("option", {value: ""}, "default"));
      for (const choice of choices) control.append(el("option", {value: String(choice)}, String(choice)));
    } else {
      control = el("input", {type: field.kind === "number" ? "number" : "text", id, step: field.step,
                             placeholder: field.metavar || (field.default === null ? "default" : "")});
    }
    control.value = field.default === null ? (FIRST_VALUES[field.key] || "") : String(field.default);
    if (!choices && field.kind === "text") wrap.classList.add("wide");
    wrap.append(label, control);
  }
  control.dataset.control = field.key;
  wrap.append(el("div", {class: "field-error", "data-error-for": field.key}));
  return wrap;
}

// a chosen file is sent as its text: read here, then the estimate and plans are asked again
async function upload(key, control) {
  window.explorer.pending++;
  try {
    const file = control.files[0];
    if (file) state.uploads[key] = await file.text();
    else delete state.uploads[key];
  } finally {
    window.explorer.pending--;
  }
  schedule();
}

function fieldValue(form, key) {
  const control = form.querySelector(`[data-control="${key}"]`);
  if (!control) return null;
  if (control.type === "checkbox") return control.checked;
  if (control.type === "file") return key in state.uploads ? state.uploads[key] : null;
  return control.value.trim() === "" ? null : control.value.trim();
}

function modelValue() {
  const choice = $("#model-select").value;
  return choice === "" ? $("#model-config").value : choice;
}

function estimateRequest() {
  const request = {model: modelValue()};
  for (const field of state.fields.estimate) {
    if (field.key === "model") continue;
    if (field.key === SEPARATE_ANSWER) continue;
    const value = field.key in PAGE_SET ? PAGE_SET[field.key] : fieldValue($("#estimate-form"), field.key);
    if (value !== null && value !== false) request[field.key] = value;
  }
  return request;
}

function planRequest() {
  const request = {model: modelValue()};
  for (const field of state.fields.plan) {
    if (field.key === "model" || field.key === SEPARATE_ANSWER) continue;
    const form = state.planOnly.has(field.key) ? $("#plan-form") : $("#estimate-form");
    let value = fieldValue(form, field.key);
    if (value === null && field.required && state.report && field.key in state.report.plan) {
      value = state.report.plan[field.key];  // e.g. the global batch the estimate resolved (micro-batch x dp)
    }
    if (value !== null && value !== false) request[field.key] = value;
  }
  return request;
}

function buildForms(setup) {
  state.fields = setup.fields;
  const estimate = $("#estimate-form");
  for (const field of setup.fields.estimate) {
    if (field.key !== "model" && !(field.key in PAGE_SET)) estimate.append(fieldElement(field, "estimate"));
  }
  // options of dmt plan that differ from (or are missing in) dmt estimate get their own fields
  const byKey = Object.fromEntries(setup.fields.estimate.map((f) => [f.key, f]));
  for (const field of setup.fields.plan) {
    const same = byKey[field.key] && byKey[field.key].kind === field.kind
      && JSON.stringify(byKey[field.key].choices) === JSON.stringify(field.choices);
    if (field.key !== "model" && !same) {
      state.planOnly.add(field.key);
      $("#plan-form").append(fieldElement(field, "plan"));
    }
  }
  const select = $("#model-select");
  for (const preset of setup.presets) {
    select.append(el("option", {value: preset.name}, `${preset.name} (${billions(preset.params)})`));
  }
  select.append(el("option", {value: ""}, "paste an HF config.json…"));
  const initial = setup.initial.model;
  if (initial && typeof initial === "object") {
    select.value = "";
    $("#model-config").value = JSON.stringify(initial, null, 2);
  } else {
    select.value = initial || (setup.presets.some((p) => p.name === "llama-3.1-8b") ? "llama-3.1-8b"
                                                                                     : setup.presets[0].name);
  }
  $("#model-config").hidden = select.value !== "";
}

// ---- errors: the CLI's one line, next to the field it names ----
function clearErrors(root) {
  root.querySelectorAll(".field-error").forEach((node) => { node.textContent = ""; });
  root.querySelectorAll(".invalid").forEach((node) => node.classList.remove("invalid"));
}

function showError(root, payload, fallback) {
  const target = payload.key && root.querySelector(`.field[data-key="${payload.key}"]`);
  if (target) {
    target.classList.add("invalid");
    target.querySelector(".field-error").textContent = payload.error;
  } else {
    fallback.textContent = payload.error;
  }
}

// ---- charts ----
const capacityLine = {  // draws the GPU's capacity across a bar chart: options.plugins.capacity {value, axis}
  id: "capacity",
  afterDatasetsDraw(chart, args, options) {
    if (!options || options.value === undefined || options.value === null) return;
    const scale = chart.scales[options.axis];
    const at = scale.getPixelForValue(options.value);
    const {ctx, chartArea: area} = chart;
    ctx.save();
    ctx.strokeStyle = COLORS.capacity;
    ctx.setLineDash([6, 4]);
    ctx.lineWidth = 2;
    ctx.beginPath();
    if (options.axis === "x") { ctx.moveTo(at, area.top); ctx.lineTo(at, area.bottom); }
    else { ctx.moveTo(area.left, at); ctx.lineTo(area.right, at); }
    ctx.stroke();
    ctx.fillStyle = COLORS.capacity;
    ctx.font = "12px system-ui";
    const width = ctx.measureText(options.label).width;
    const x = options.axis === "x" ? (at + 4 + width > area.right ? at - 4 - width : at + 4) : area.left + 4;
    ctx.fillText(options.label, x, options.axis === "x" ? area.top + 12 : at - 4);
    ctx.restore();
  },
};

function memoryDatasets(reports) {
  return COMPONENTS.map((key) => ({
    label: key, backgroundColor: COLORS[key], stack: "memory", yAxisID: "y",
    data: reports.map((r) => (r ? r.memory_bytes[key] / GiB : null)),
    bytes: reports.map((r) => (r ? r.memory_bytes[key] : null)),
  }));
}

function drawMemoryChart(report) {
  const capacity = report.gpu_memory_bytes / GiB;
  const config = {
    type: "bar",
    data: {labels: [`stage ${report.most_loaded_stage}`], datasets: memoryDatasets([report])},
    options: {
      indexAxis: "y", maintainAspectRatio: false, animation: false,
      scales: {x: {stacked: true, title: {display: true, text: "GiB per GPU"},
                   suggestedMax: Math.max(capacity, report.memory_bytes.total / GiB) * 1.05},
               y: {stacked: true}},
      plugins: {capacity: {value: capacity, axis: "x", label: `${report.gpu} ${capacity.toFixed(1)} GiB`},
                legend: {position: "bottom"}},
    },
    plugins: [capacityLine],
  };
  if (state.charts.memory) state.charts.memory.destroy();
  state.charts.memory = new Chart($("#memory-chart"), config);
}

// ---- the estimate ----
function renderVerdict(report) {
  const verdict = $("#verdict");
  const total = report.memory_bytes.total;
  const capacity = report.gpu_memory_bytes;
  verdict.className = `verdict ${report.fits ? "fits" : "does-not-fit"}`;
  if (report.fits) {
    verdict.textContent = `fits: ${gib(total)} GiB of ${gib(capacity)} GiB per GPU (${report.gpu})`;
  } else {
    const largest = COMPONENTS.reduce((a, b) => (report.memory_bytes[a] >= report.memory_bytes[b] ? a : b));
    verdict.textContent = `does not fit: needs ${gib(total)} GiB per GPU, ${report.gpu} has ${gib(capacity)} GiB; `
      + `largest: ${largest} ${gib(report.memory_bytes[largest])} GiB`;
  }
  verdict.dataset.fits = String(report.fits);
}

function renderHeadline(report) {
  $("#step-time").textContent = `${fmt(report.step_time_s)} s`;
  $("#tokens-per-s").textContent = Math.round(report.tokens_per_s).toLocaleString("en-US");
  $("#mfu").textContent = `${(report.mfu * 100).toFixed(1)}%`;
  const t = report.training_time;
  const days = (d) => d.toLocaleString("en-US", {maximumFractionDigits: 1});
  $("#training-time").textContent = t
    ? `${days(t.days)} days, ${Math.round(t.gpu_hours).toLocaleString("en-US")} GPU-hours for ${fmt(t.tokens)} tokens `
      + `with failures (${days(t.days_compute)} days without)`
    : "set train tokens";
  // goodput, interruptions and Daly's checkpoint interval, beside the training days (estimate/training_time.py)
  $("#goodput").textContent = t
    ? `goodput ${(t.goodput * 100).toFixed(1)}%, ${t.interruptions.toLocaleString("en-US", {maximumFractionDigits: 1})} `
      + `interruptions, a checkpoint every ${t.checkpoint.interval_steps.toLocaleString("en-US")} steps `
      + `(${fmt(t.checkpoint.interval_s / 60)} min; blocks ${fmt(t.checkpoint.blocking_s)} s)`
    : "";
}

function renderBreakdown(report) {
  const body = $("#breakdown tbody");
  body.replaceChildren();
  const perParam = Object.fromEntries((report.explain || []).map((e) => [e.component, e.bytes_per_param]));
  for (const key of [...COMPONENTS, "total"]) {
    const bytes = report.memory_bytes[key];
    const name = key === "total" ? el("strong", {}, "total") : el("span", {}, el("span", {class: "swatch",
      style: `background:${COLORS[key]}`}), key);
    const extra = key === "overhead"
      ? Object.entries(report.overhead_bytes).map(([k, v]) => `${k} ${gib(v)}`).join(", ")
      : perParam[key] !== undefined ? `${fmt(perParam[key])} B/param on this GPU` : "";
    body.append(el("tr", {"data-component": key}, el("td", {}, name),
                   el("td", {class: "num", "data-bytes": String(bytes)}, `${gib(bytes)} GiB`),
                   el("td", {class: "note"}, extra)));
  }
}

function renderExplain(entries) {
  const body = $("#explain-table tbody");
  body.replaceChildren();
  for (const e of entries || []) {
    body.append(el("tr", {"data-component": e.component}, el("td", {}, e.component.replace(/_/g, " ")),
                   el("td", {}, e.rule), el("td", {}, e.rule_of_thumb), el("td", {}, e.difference),
                   el("td", {}, e.source)));
  }
}

// The answer to the newest request of a part (estimate, plan), or null: an error shown in `root`, or a newer request
// sent meanwhile. A failed answer greys out what the last good one drew.
async function latestAnswer(part, path, request, root, drawn, fallback) {
  const seq = ++state.seq[part];
  const {ok, payload} = await api(path, request);
  if (seq !== state.seq[part]) return null;
  clearErrors(root);
  drawn.classList.toggle("stale", !ok);
  if (!ok) showError(root, payload, fallback);
  return ok ? payload : null;
}

async function refreshEstimate() {
  const payload = await latestAnswer("estimate", "/api/estimate", estimateRequest(), $("#inputs"), $("#results"),
                                     $("#form-error"));
  if (payload === null) return;
  state.report = payload;
  renderVerdict(payload);
  renderHeadline(payload);
  drawMemoryChart(payload);
  renderBreakdown(payload);
  renderExplain(payload.explain);
}

// ---- the longest sequence (--max-seq-len): the same request without --seq-len ----
const asksLongest = () => fieldValue($("#estimate-form"), SEPARATE_ANSWER) === true;

function longestRequest(request) {
  const {seq_len, explain, train_tokens, ...rest} = request;
  return {...rest, [SEPARATE_ANSWER]: true};
}

function limitText(limit) {
  if (limit.seq_len === null) return "the search stops there";
  const where = limit.where === "host" ? "per node in host RAM" : "per GPU";
  return `at ${limit.seq_len.toLocaleString("en-US")}: ${gib(limit.total_bytes)} GiB ${where} > `
    + `${gib(limit.capacity_bytes)} GiB, largest ${limit.component} ${gib(limit.bytes)} GiB`;
}

async function refreshLongest() {
  const box = $("#max-seq-len");
  const seq = ++state.seq.longest;
  if (!asksLongest()) { box.hidden = true; box.dataset.maxSeqLen = ""; return; }
  const {ok, payload} = await api("/api/estimate", longestRequest(estimateRequest()));
  if (seq !== state.seq.longest) return;
  box.hidden = false;
  box.dataset.maxSeqLen = ok ? String(payload.max_seq_len) : "";
  box.textContent = !ok ? payload.error : payload.max_seq_len === 0 ? `longest sequence: none fits; ${limitText(payload.limit)}`
    : `longest sequence of this plan: ${payload.max_seq_len.toLocaleString("en-US")} tokens; stops ${limitText(payload.limit)}`;
}

// ---- the sweep ----
function clip(reports) {
  const capacity = reports[0].gpu_memory_bytes / GiB;
  const largest = Math.max(...reports.map((r) => r.memory_bytes.total / GiB));
  return largest > 3 * capacity ? Math.ceil(3 * capacity / 10) * 10 : undefined;
}

function sweepPoints(axis) {
  if (axis === "model") return state.setup.presets.map((p) => ({value: p.name, label: `${p.name} ${billions(p.params)}`}));
  return SWEEPS[axis].map((v) => ({value: v, label: String(v)}));
}

async function refreshSweep() {
  const seq = ++state.seq.sweep;
  const axis = $("#sweep-axis").value;
  const base = estimateRequest();
  delete base.explain;
  const points = sweepPoints(axis);
  const answers = [];
  for (const point of points) {  // one after another: the server runs one estimate at a time anyway
    answers.push(await api("/api/estimate", {...base, [axis]: point.value}));
    if (seq !== state.seq.sweep) return;
  }
  const kept = points.map((p, i) => ({...p, answer: answers[i]})).filter((p) => p.answer.ok);
  const reports = kept.map((p) => p.answer.payload);
  const skipped = points.filter((p, i) => !answers[i].ok).map((p) => p.label);
  const firstMiss = reports.findIndex((r, i) => !r.fits && (i === 0 || reports[i - 1].fits));
  let note = firstMiss > 0 ? `stops fitting at ${kept[firstMiss].label}: ${gib(reports[firstMiss].memory_bytes.total)} GiB `
    + `> ${gib(reports[firstMiss].gpu_memory_bytes)} GiB per GPU.` : reports.every((r) => r.fits)
    ? "fits at every point." : reports.every((r) => !r.fits) ? "fits at no point." : "";
  if (skipped.length) note += ` Not valid for this plan (see the CLI's message with that value): ${skipped.join(", ")}.`;
  $("#sweep-note").textContent = note;
  $("#sweep-note").dataset.firstMiss = firstMiss >= 0 ? String(kept[firstMiss].value) : "";
  const datasets = memoryDatasets(reports);
  datasets.push({type: "line", label: "step time (s)", yAxisID: "time", borderColor: COLORS.step,
                 backgroundColor: COLORS.step, data: reports.map((r) => r.step_time_s), tension: 0.2});
  const config = {
    type: "bar",
    data: {labels: kept.map((p) => (p.answer.payload.fits ? p.label : `${p.label} ✗`)), datasets},
    options: {
      maintainAspectRatio: false, animation: false,
      // bars far past the capacity are cut at 3x it, so the region where the plan stops fitting stays readable
      scales: {x: {stacked: true}, y: {stacked: true, title: {display: true, text: "GiB per GPU"},
                                       max: reports.length ? clip(reports) : undefined},
               time: {position: "right", type: "logarithmic", grid: {drawOnChartArea: false},
                      title: {display: true, text: "step time (s)"}}},
      plugins: {capacity: {value: reports.length ? reports[0].gpu_memory_bytes / GiB : null, axis: "y",
                           label: reports.length ? `${reports[0].gpu} capacity` : ""},
                legend: {position: "bottom"}},
    },
    plugins: [capacityLine],
  };
  if (state.charts.sweep) state.charts.sweep.destroy();
  state.charts.sweep = new Chart($("#sweep-chart"), config);
  await renderSweepOptions(axis, kept, seq);
}

// Over sequence lengths: what the fastest plan that fits (`dmt plan`, the options set above pinned) uses at each
// length, and from which length each option appears in it.
async function renderSweepOptions(axis, kept, seq) {
  const box = $("#sweep-options");
  box.replaceChildren();
  box.hidden = axis !== "seq_len";
  if (axis !== "seq_len") return;
  const base = {...planRequest(), top: 1};
  delete base.train_tokens;
  const rows = [];
  for (const point of kept) {
    const {ok, payload} = await api("/api/plan", {...base, seq_len: point.value});
    if (seq !== state.seq.sweep) return;
    const best = ok && payload.plans.length ? payload.plans[0].plan : null;
    rows.push({point, best, used: best ? Object.keys(LONG_CONTEXT).filter((k) => LONG_CONTEXT[k](best)) : []});
  }
  const from = Object.keys(LONG_CONTEXT).map((key) => [key, rows.find((r) => r.used.includes(key))]).filter(([, r]) => r);
  box.append(el("div", {class: "note"}, from.length
    ? "the fastest plan that fits uses " + from.map(([key, r]) => `${key} from ${r.point.label}`).join(", ") + "."
    : "the fastest plan that fits needs no recompute, tiling, offload, sp or cp at these lengths."));
  const list = el("ul", {class: "needed"});
  for (const [key, r] of from) list.append(el("li", {"data-option": key, "data-from": String(r.point.value)},
                                              `${key}: from ${r.point.label}`));
  box.append(list);
  const table = el("table", {class: "numbers"}, el("thead", {}, el("tr", {}, el("th", {}, "seq_len"),
    el("th", {}, "this plan"), el("th", {}, "fastest plan that fits: long-context options"), el("th", {}, "plan"))));
  const body = el("tbody");
  for (const {point, best, used} of rows) {
    const fits = point.answer.payload.fits;
    body.append(el("tr", {"data-seq-len": String(point.value), "data-options": used.join(",")},
      el("td", {class: "num"}, point.label), el("td", {}, fits ? "fits" : "does not fit"),
      el("td", {}, best ? used.map((k) => LONG_CONTEXT[k](best)).join(", ") || "none" : "no plan fits"),
      el("td", {class: "note"}, best ? `${best.backend} dp${best.dp} tp${best.tp} pp${best.pp} mb${best.micro_batch}` : "")));
  }
  table.append(body);
  box.append(table);
}

// ---- ranked plans and their launch files ----
const PLAN_COLUMNS = ["backend", "dp", "tp", "pp", "vpp", "cp", "ep", "zero", "micro_batch", "recompute"];

function planCell(record, key) {
  const plan = record.plan;
  if (key === "recompute" && plan.recompute === "selective") return `selective:${plan.recompute_modules.join("+")}`;
  if (key === "recompute" && plan.recompute_num_layers) return `full:block${plan.recompute_num_layers}`;
  if (key === "backend" && plan.backend === "megatron") {
    return ["megatron", plan.sequence_parallel ? "+sp" : "", plan.distributed_optimizer ? "+dopt" : ""].join(" ").trim();
  }
  return String(plan[key]);
}

async function refreshPlans() {
  const longest = asksLongest();
  const request = longest ? longestRequest(planRequest()) : planRequest();
  const payload = await latestAnswer("plan", "/api/plan", request, $("#plans"), $("#plan-table"), $("#plan-error"));
  if (payload === null) return;
  if (longest) { renderLongestPlans(payload); return; }
  const plans = payload.plans;  // `dmt plan --json`: {plans, rejected, considered, calibration}
  state.plans = plans;
  const timed = plans.some((r) => r.training_time);
  const head = [...PLAN_COLUMNS, "GiB/GPU", "step s", "tokens/s", "MFU",
    ...(timed ? ["days", "GPU-h", "goodput", "ckpt every"] : []), ""];
  $("#plan-table thead").replaceChildren(el("tr", {}, el("th", {}, "#"), ...head.map((h) => el("th", {class: "num"}, h))));
  const body = $("#plan-table tbody");
  body.replaceChildren();
  plans.forEach((record, i) => {
    const cells = [...PLAN_COLUMNS.map((k) => planCell(record, k)), `${gib(record.memory_bytes.total)}`,
      fmt(record.step_time_s), Math.round(record.tokens_per_s).toLocaleString("en-US"), `${(record.mfu * 100).toFixed(1)}%`];
    const t = record.training_time;
    if (timed) cells.push(t.days.toFixed(1), Math.round(t.gpu_hours).toLocaleString("en-US"),
                          `${(t.goodput * 100).toFixed(1)}%`, t.checkpoint.interval_steps.toLocaleString("en-US"));
    const files = el("button", {type: "button", class: "files", "data-rank": String(i + 1)}, "files");
    files.addEventListener("click", () => openFiles(record, i + 1));
    const use = el("button", {type: "button", class: "use"}, "use");
    use.addEventListener("click", () => usePlan(record));
    body.append(el("tr", {class: i === 0 ? "best" : null, "data-rank": String(i + 1)}, el("td", {}, String(i + 1)),
                   ...cells.map((c) => el("td", {class: "num"}, c)), el("td", {}, files, " ", use)));
  });
  const rejected = Object.entries(payload.rejected).map(([why, n]) => `${n.toLocaleString("en-US")} ${why}`).join(", ");
  $("#plan-summary").textContent = plans.length
    ? `${plans.length} fastest plans that fit, fastest first (predicted step time).`
    : `no plan fits: more GPUs, a shorter sequence or a smaller global batch (rejected: ${rejected || "none"}).`;
}

// `dmt plan --max-seq-len --json`: {plans: [{label, plan, step_time_s, max_seq_len, limit}], considered, fitting}
function renderLongestPlans(payload) {
  state.plans = [];
  $("#plan-table thead").replaceChildren(el("tr", {}, ...["#", "max seq_len", "step s", "plan", "what stops the next"]
    .map((h) => el("th", {class: "num"}, h))));
  const body = $("#plan-table tbody");
  body.replaceChildren();
  payload.plans.forEach((record, i) => {
    body.append(el("tr", {class: i === 0 ? "best" : null, "data-rank": String(i + 1),
                          "data-max-seq-len": String(record.max_seq_len)},
                   el("td", {}, String(i + 1)), el("td", {class: "num"}, record.max_seq_len.toLocaleString("en-US")),
                   el("td", {class: "num"}, fmt(record.step_time_s)), el("td", {}, record.label),
                   el("td", {class: "note"}, limitText(record.limit))));
  });
  $("#plan-summary").textContent = payload.plans.length
    ? `${payload.plans.length} plans at their longest sequence, longest first, then fastest there `
      + `(${payload.considered.toLocaleString("en-US")} considered, ${payload.fitting.toLocaleString("en-US")} fit).`
    : "no plan fits even 1024 tokens: more GPUs or a smaller model.";
}

function usePlan(record) {
  const form = $("#estimate-form");
  for (const [key, value] of Object.entries(record.plan)) {
    const control = form.querySelector(`[data-control="${key}"]`);
    if (!control) continue;
    if (control.type === "checkbox") control.checked = Boolean(value);
    else control.value = value === null ? "" : Array.isArray(value) ? value.join(",") : String(value);
  }
  schedule();
}

async function openFiles(record, rank) {
  const request = {model: modelValue(), gpu: record.gpu, plan: record.plan};
  for (const key of ["train_tokens", "calibration"]) {  // the estimate's own, which the files use as well
    const value = fieldValue($("#estimate-form"), key);
    if (value !== null) request[key] = value;
  }
  $("#files-title").textContent = `Launch files of plan #${rank}`;
  $("#files-tabs").replaceChildren();
  $("#file-text").textContent = "rendering…";
  $("#files-dialog").hidden = false;
  const {ok, payload} = await api("/api/generate", request);
  if (!ok) { $("#file-text").textContent = payload.error; return; }
  const names = Object.keys(payload.files).sort((a, b) => rankOf(a) - rankOf(b));
  for (const name of names) {
    const tab = el("button", {type: "button", "data-file": name}, name);
    tab.addEventListener("click", () => showFile(name, payload.files[name]));
    $("#files-tabs").append(tab);
  }
  showFile(names[0], payload.files[names[0]]);
}

function rankOf(name) {
  const i = FILE_ORDER.indexOf(name);
  return i < 0 ? FILE_ORDER.length + (name === "recipe.yaml" ? 1 : name === "calibration.yaml" ? 2 : 0) : i;
}

function showFile(name, text) {
  state.file = {name, text};
  $("#file-text").textContent = text;
  $("#file-text").dataset.file = name;
  $("#file-status").textContent = "";
  document.querySelectorAll("#files-tabs button").forEach((b) => b.classList.toggle("active", b.dataset.file === name));
}

async function copyFile() {
  try {
    await navigator.clipboard.writeText(state.file.text);
    $("#file-status").textContent = `${state.file.name} copied`;
  } catch (e) {
    const range = document.createRange();
    range.selectNodeContents($("#file-text"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    $("#file-status").textContent = "selected: press Ctrl-C to copy";
  }
}

function downloadFile() {
  const url = URL.createObjectURL(new Blob([state.file.text], {type: "text/plain"}));
  const link = el("a", {href: url, download: state.file.name});
  document.body.append(link);
  link.click();
  link.remove();
  URL.revokeObjectURL(url);
}

// ---- wiring ----
let timer = null;
const scheduledParts = new Set();
function schedule(parts = ["estimate", "plan", "sweep"], delay = 300) {
  if (timer === null) window.explorer.scheduled++;
  parts.forEach((part) => scheduledParts.add(part));
  clearTimeout(timer);
  timer = setTimeout(async () => {
    timer = null;
    const run = new Set(scheduledParts);
    scheduledParts.clear();
    try {
      if (run.has("estimate")) await refreshEstimate();  // the plans take the global batch the estimate resolved
      await Promise.all([run.has("plan") ? refreshPlans() : null, run.has("sweep") ? refreshSweep() : null,
                         run.has("estimate") ? refreshLongest() : null]);
    } finally {
      window.explorer.scheduled--;
    }
  }, delay);
}

async function start() {
  const {ok, payload} = await api("/api/form");
  if (!ok) { $("#form-error").textContent = payload.error; return; }
  state.setup = payload;
  buildForms(payload);
  $("#estimate-form").addEventListener("input", () => schedule());
  $("#estimate-form").addEventListener("change", () => schedule());
  $("#plan-form").addEventListener("input", () => schedule(["plan"]));
  $("#plan-form").addEventListener("change", () => schedule(["plan"]));
  $("#model-select").addEventListener("change", () => { $("#model-config").hidden = $("#model-select").value !== ""; schedule(); });
  $("#model-config").addEventListener("input", () => schedule());
  $("#sweep-axis").addEventListener("change", () => schedule(["sweep"], 0));
  $("#files-close").addEventListener("click", () => { $("#files-dialog").hidden = true; });
  $("#file-copy").addEventListener("click", copyFile);
  $("#file-download").addEventListener("click", downloadFile);
  schedule(undefined, 0);
}

start();
