// sinkscope's attention explorer: picks what plotly draws. The data: the inline index
// (#explorer-index, sinkscope.analysis.explorer) and one data/*.js file per surveyed layer and
// per closed-loop run, loaded by a <script> element the first time it is shown (fetch does not
// work from the file system). Maps are float16 (base64); statistics are the CSV's numbers.
"use strict";

const INDEX = JSON.parse(document.getElementById("explorer-index").textContent);
const S = INDEX.settings;
const state = { run: 0, step: 0, layer: 0, head: 0, block: -1, cell: null, loop: 0, frame: 0 };
const chunks = {};
const waiting = {};
const PLOT = { displayModeBar: false, responsive: false };
const KIND_COLOURS = { own: "#333333", recent: "#2171b5", sink: "#cb181d", chosen: "#6a51a3",
  replayed: "#41ab5d", anchor: "#ff7f00" };
const SERIES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];

window.sinkscopeExplorer = {
  state,
  loaded(name, payload) {
    chunks[name] = payload;
    (waiting[name] || []).forEach((resolve) => resolve(payload));
    delete waiting[name];
  },
};

function load(name) {
  if (chunks[name]) return Promise.resolve(chunks[name]);
  return new Promise((resolve, reject) => {
    if (!waiting[name]) {
      waiting[name] = [];
      const script = document.createElement("script");
      script.src = "data/" + name + ".js";
      script.onerror = () => reject(new Error("cannot load data/" + name + ".js"));
      document.head.appendChild(script);
    }
    waiting[name].push(resolve);
  });
}

// ---- decoding -----------------------------------------------------------------------------

function bytes(b64) {
  const text = atob(b64);
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
  return out;
}

function half(b64) {
  const raw = bytes(b64);
  const words = new Uint16Array(raw.buffer, raw.byteOffset, raw.length / 2);
  const out = new Float32Array(words.length);
  for (let i = 0; i < words.length; i++) {
    const h = words[i];
    const sign = h & 0x8000 ? -1 : 1;
    const exp = (h >> 10) & 0x1f;
    const frac = h & 0x3ff;
    if (exp === 0) out[i] = sign * frac * Math.pow(2, -24);
    else if (exp === 31) out[i] = frac ? NaN : sign * Infinity;
    else out[i] = sign * (1 + frac / 1024) * Math.pow(2, exp - 15);
  }
  return out;
}

function decodeLayer(chunk, run) {
  if (chunk.decoded) return chunk.decoded;
  const F = run.frames, steps = run.steps.length, heads = chunk.heads.length;
  const seen = bytes(chunk.seen);
  const values = half(chunk.prob_mass);
  const maps = []; // [step][head] -> F x F rows (NaN unseen)
  let offset = 0;
  for (let s = 0; s < steps; s++) {
    const mask = seen.subarray(s * F * F, (s + 1) * F * F);
    let count = 0;
    for (let i = 0; i < mask.length; i++) count += mask[i];
    maps.push([]);
    for (let h = 0; h < heads; h++) {
      const rows = [];
      let j = offset + h * count;
      for (let q = 0; q < F; q++) {
        const row = new Array(F).fill(NaN);
        for (let k = 0; k < F; k++) if (mask[q * F + k]) row[k] = values[j++];
        rows.push(row);
      }
      maps[s].push(rows);
    }
    offset += heads * count;
  }
  const entropy = half(chunk.entropy);
  const spatial = chunk.spatial ? half(chunk.spatial) : null;
  const versions = chunk.key_version ? new Int8Array(bytes(chunk.key_version).buffer) : null;
  chunk.decoded = { maps, entropy, spatial, versions };
  return chunk.decoded;
}

// ---- formatting, scales -------------------------------------------------------------------

function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const [mantissa, exponent] = Number(value).toPrecision(digits).split("e");
  const short = mantissa.includes(".") ? mantissa.replace(/\.?0+$/, "") : mantissa;
  return exponent === undefined ? short : `${short}e${exponent}`;
}

function csvNumber(value) {
  // the CSV's text of a 6-significant-digit number (shortest form, as pandas writes it)
  if (value === null || value === undefined) return "";
  return String(value);
}

function multipleTicks(V) {
  const ticks = new Set([1 / V, V, 1, S.sink_threshold]);
  for (let k = Math.ceil(Math.log10(1 / V)); k <= Math.floor(Math.log10(V)); k++) ticks.add(10 ** k);
  const sorted = [...ticks].filter((t) => t >= 1 / V && t <= V).sort((a, b) => a - b);
  return { tickvals: sorted.map(Math.log10), ticktext: sorted.map((t) => fmt(t, 2)) };
}

function probabilityScale(values) {
  // the figures' rule (plots.common.color_scale): linear from 0, or log where the positive
  // values span more than map_log_decades decades
  let low = Infinity, high = 0;
  for (const v of values) if (v > 0) { low = Math.min(low, v); high = Math.max(high, v); }
  if (!(high > 0)) return { log: false, zmin: 0, zmax: 1 };
  if (Math.log10(high / low) > S.scales.map_log_decades) {
    return { log: true, low, zmin: Math.log10(low), zmax: Math.log10(high) };
  }
  return { log: false, zmin: 0, zmax: high };
}

function logTicks(scale) {
  const vals = [], text = [];
  for (let k = Math.ceil(scale.zmin); k <= Math.floor(scale.zmax); k++) {
    vals.push(k); text.push(fmt(10 ** k, 2));
  }
  return { tickvals: vals, ticktext: text };
}

// ---- the survey ---------------------------------------------------------------------------

const run = () => INDEX.runs[state.run];
const stepLabel = () => run().steps[state.step].label;
const blockOf = (q) => run().blocks[q];
const lastBlock = () => Math.max(...run().blocks);
const blockFrames = (b) => run().blocks.map((x, i) => (x === b ? i : -1)).filter((i) => i >= 0);

function statRow(r, layer, head, step) {
  const t = r.statistics;
  for (let i = 0; i < t.layer.length; i++) {
    if (t.layer[i] === layer && t.head[i] === head && t.step[i] === step) return i;
  }
  return -1;
}

function fillSelect(id, items, value) {
  const select = document.getElementById(id);
  select.innerHTML = "";
  for (const [v, text] of items) {
    const option = document.createElement("option");
    option.value = v; option.textContent = text;
    select.appendChild(option);
  }
  select.value = String(value);
}

function runIndex(checkpoint, prompt) {
  return INDEX.runs.findIndex((r) => r.checkpoint === checkpoint && r.prompt === prompt);
}

function fillControls() {
  const r = run();
  const checkpoints = [...new Set(INDEX.runs.map((x) => x.checkpoint))];
  const prompts = [...new Set(INDEX.runs.filter((x) => x.checkpoint === r.checkpoint)
    .map((x) => x.prompt))];
  fillSelect("checkpoint", checkpoints.map((c) => [c, c]), r.checkpoint);
  fillSelect("prompt", prompts.map((p) => [p, p]), r.prompt);
  fillSelect("step", r.steps.map((s, i) => [i, s.label]), state.step);
  fillSelect("layer", r.layers.map((l) => [l, "layer " + l]), state.layer);
  fillSelect("head", r.heads.map((h) => [h, "head " + h]), state.head);
  const blocks = [...new Set(r.blocks)];
  fillSelect("block", blocks.map((b) => {
    const frames = blockFrames(b);
    return [b, `block ${b} (frames ${frames[0]}–${frames[frames.length - 1]})`];
  }), state.block);
  document.getElementById("prompt-text").textContent = r.prompt_text ? `“${r.prompt_text}”` : "";
}

function drawOverview() {
  const r = run();
  const step = r.steps[state.step].step;
  const V = Math.max(r.visible_frames, 2);
  const z = [], custom = [], sinks = { x: [], y: [] }, recents = { x: [], y: [] };
  for (const layer of r.layers) {
    const row = [], info = [];
    for (const head of r.heads) {
      const i = statRow(r, layer, head, step);
      const m = i < 0 ? null : r.statistics.uniform_multiple[i];
      row.push(m === null ? null : Math.log10(Math.min(Math.max(m, 1 / V), V)));
      const cls = i < 0 ? "" : r.statistics.head_class[i];
      info.push([m === null ? "–" : fmt(m, 4), cls]);
      if (cls === "sink") { sinks.x.push(head); sinks.y.push(layer); }
      if (cls === "recent") { recents.x.push(head); recents.y.push(layer); }
    }
    z.push(row); custom.push(info);
  }
  const ticks = multipleTicks(V);
  const marker = (symbol) => ({ symbol, size: 9, color: "white", line: { color: "black", width: 1 } });
  const traces = [
    { type: "heatmap", x: r.heads, y: r.layers, z, customdata: custom, zmin: -Math.log10(V),
      zmax: Math.log10(V), colorscale: S.scales.multiple, xgap: 1, ygap: 1,
      colorbar: { title: { text: S.labels.multiple, side: "right" }, ...ticks },
      hovertemplate: "L%{y}H%{x}<br>×%{customdata[0]} uniform<br>%{customdata[1]}<extra></extra>" },
    { type: "scatter", mode: "markers", x: sinks.x, y: sinks.y, name: "sink: " + S.sink_definition,
      marker: marker("circle"), hoverinfo: "skip" },
    { type: "scatter", mode: "markers", x: recents.x, y: recents.y,
      name: `recent: own-block mass ≥ ${S.recent_threshold}`, marker: marker("triangle-up"),
      hoverinfo: "skip" },
    { type: "scatter", mode: "markers", x: [state.head], y: [state.layer], name: "shown",
      marker: { symbol: "square-open", size: 16, color: "black", line: { width: 2 } },
      hoverinfo: "skip", showlegend: false },
  ];
  const layout = {
    title: { text: `Last block's first-frame mass ÷ uniform share · ${stepLabel()}`, font: { size: 13 } },
    xaxis: { title: { text: S.labels.head }, dtick: 1, constrain: "domain" },
    yaxis: { title: { text: S.labels.layer }, autorange: "reversed", dtick: 1 },
    plot_bgcolor: S.scales.unseen, margin: { l: 60, r: 10, t: 40, b: 80 },
    legend: { orientation: "h", y: -0.2, font: { size: 11 } },
  };
  Plotly.react("overview", traces, layout, PLOT);
}

function showReadout() {
  const r = run();
  const step = r.steps[state.step].step;
  const i = statRow(r, state.layer, state.head, step);
  const t = r.statistics;
  const get = (column) => (i < 0 ? "" : csvNumber(t[column][i]));
  document.getElementById("head-title").textContent =
    `L${state.layer}H${state.head} · ${r.checkpoint} / ${r.prompt} · ${stepLabel()}`;
  document.getElementById("readout-class").textContent = i < 0 ? "" : t.head_class[i] || "–";
  document.getElementById("readout-first").textContent = get("first");
  document.getElementById("readout-multiple").textContent = get("uniform_multiple");
  document.getElementById("readout-own").textContent = get("recent_mass");
  document.getElementById("readout-entropy").textContent = get("entropy");
  document.getElementById("readout-first-label").textContent = S.labels.first_frame;
  document.getElementById("readout-multiple-label").textContent = S.labels.multiple;
  document.getElementById("readout-entropy-label").textContent = S.labels.entropy;
  document.getElementById("readout-note").textContent =
    `The last block's numbers, as in results/stats/${r.checkpoint}/${r.prompt}/layer${state.layer}.csv ` +
    "(prob_mass, last_block).";
  document.getElementById("sink-definition").textContent = "sink: " + S.sink_definition;
  const others = document.getElementById("other-checkpoints");
  others.innerHTML = "";
  const peers = INDEX.runs.filter((x) => x.prompt === r.prompt && x.checkpoint !== r.checkpoint
    && x.layers.includes(state.layer));
  if (!peers.length) others.textContent = "no other checkpoint";
  for (const peer of peers) {
    const button = document.createElement("button");
    button.className = "link"; button.textContent = peer.checkpoint;
    button.id = "peer-" + peer.checkpoint;
    button.onclick = () => {
      state.run = INDEX.runs.indexOf(peer);
      state.step = Math.min(state.step, peer.steps.length - 1);
      if (!peer.heads.includes(state.head)) state.head = peer.heads[0];
      update();
    };
    others.appendChild(button);
  }
}

function blockShapes(F) {
  const r = run(), shapes = [];
  for (let f = 1; f < F; f++) {
    if (r.blocks[f] !== r.blocks[f - 1]) {
      const line = { color: "white", width: 1 };
      shapes.push({ type: "line", x0: f - 0.5, x1: f - 0.5, y0: -0.5, y1: F - 0.5, line });
      shapes.push({ type: "line", y0: f - 0.5, y1: f - 0.5, x0: -0.5, x1: F - 0.5, line });
    }
  }
  const frames = blockFrames(state.block);
  shapes.push({ type: "rect", x0: -0.5, x1: F - 0.5, y0: frames[0] - 0.5,
    y1: frames[frames.length - 1] + 0.5, line: { color: "#d62728", width: 2 } });
  return shapes;
}

async function drawHead() {
  const r = run();
  const name = r.files[String(state.layer)];
  const chunk = await load(name);
  if (run() !== r || r.files[String(state.layer)] !== name) return;
  const data = decodeLayer(chunk, r);
  const h = chunk.heads.indexOf(state.head);
  const F = r.frames;
  const map = data.maps[state.step][h];
  const flat = map.flat();
  const scale = probabilityScale(flat);
  const shown = map.map((row) => row.map((v) => (Number.isNaN(v) ? null
    : scale.log ? Math.log10(Math.max(v, scale.low)) : v)));
  const text = map.map((row, q) => row.map((v, k) => {
    let label = Number.isNaN(v) ? "not seen" : fmt(v, 3);
    if (data.versions && !Number.isNaN(v)) {
      const code = data.versions[(state.step * F + q) * F + k];
      if (r.versions[String(code)]) label += " · " + r.versions[String(code)];
    }
    return label;
  }));
  const frames = [...Array(F).keys()];
  const colorbar = { title: { text: S.labels.prob_mass, side: "right" }, tickformat: "~g",
    ...(scale.log ? logTicks(scale) : {}) };
  Plotly.react("frame-map", [{
    type: "heatmap", x: frames, y: frames, z: shown, text, zmin: scale.zmin, zmax: scale.zmax,
    colorscale: S.scales.probability, colorbar,
    hovertemplate: "query frame %{y} → key frame %{x}<br>%{text}<extra></extra>",
  }], {
    title: { text: `L${state.layer}H${state.head} frame map · ${stepLabel()}`, font: { size: 13 } },
    xaxis: { title: { text: S.labels.key_frame }, constrain: "domain", range: [-0.5, F - 0.5] },
    yaxis: { title: { text: S.labels.query_frame }, autorange: "reversed", scaleanchor: "x" },
    plot_bgcolor: S.scales.unseen, shapes: blockShapes(F), margin: { l: 60, r: 10, t: 40, b: 50 },
  }, PLOT);

  // Fig. 4's profile: the chosen query block's frames averaged per key frame (a key frame
  // counts where every frame of the block sees it: stats.query_profile)
  const rows = blockFrames(state.block);
  const profile = frames.map((k) => {
    let sum = 0;
    for (const q of rows) { const v = map[q][k]; if (Number.isNaN(v)) return null; sum += v; }
    return sum / rows.length;
  });
  Plotly.react("profile", [{
    type: "scatter", mode: "lines+markers", x: frames, y: profile, line: { color: "#1f77b4" },
    hovertemplate: "key frame %{x}: %{y:.4g}<extra></extra>", name: "profile",
  }], {
    title: { text: `Query block ${state.block}: mass per key frame (Fig. 4's profile)`, font: { size: 13 } },
    xaxis: { title: { text: S.labels.key_frame }, range: [-0.5, F - 0.5] },
    yaxis: { title: { text: S.labels.profile }, rangemode: "tozero", tickformat: "~g" },
    shapes: [{ type: "rect", xref: "x", yref: "paper", x0: rows[0] - 0.5,
      x1: rows[rows.length - 1] + 0.5, y0: 0, y1: 1, fillcolor: "#d62728", opacity: 0.08,
      line: { width: 0 } }],
    annotations: [{ x: (rows[0] + rows[rows.length - 1]) / 2, y: 1, yref: "paper", text: "own block",
      showarrow: false, font: { size: 11, color: "#d62728" } }],
    margin: { l: 60, r: 10, t: 40, b: 50 }, showlegend: false,
  }, PLOT);

  const heads = chunk.heads.length;
  const entropy = frames.map((q) => {
    const v = data.entropy[(state.step * heads + h) * F + q];
    return Number.isNaN(v) ? null : v;
  });
  Plotly.react("entropy", [{
    type: "scatter", mode: "lines+markers", x: frames, y: entropy, line: { color: "#444" },
    hovertemplate: "query frame %{x}: %{y:.4g} nats<extra></extra>",
  }], {
    title: { text: `L${state.layer}H${state.head} entropy per query frame`, font: { size: 13 } },
    xaxis: { title: { text: S.labels.query_frame }, range: [-0.5, F - 0.5] },
    yaxis: { title: { text: S.labels.entropy }, rangemode: "tozero" },
    shapes: [{ type: "rect", xref: "x", yref: "paper", x0: rows[0] - 0.5,
      x1: rows[rows.length - 1] + 0.5, y0: 0, y1: 1, fillcolor: "#d62728", opacity: 0.08,
      line: { width: 0 } }],
    margin: { l: 60, r: 10, t: 40, b: 50 }, showlegend: false,
  }, PLOT);

  if (data.spatial) {
    const [rowsN, colsN] = chunk.spatial_shape;
    const base = (state.step * heads + h) * rowsN * colsN;
    const image = [];
    for (let y = 0; y < rowsN; y++) {
      const line = [];
      for (let x = 0; x < colsN; x++) {
        const v = data.spatial[base + y * colsN + x];
        line.push(Number.isNaN(v) ? null : v);
      }
      image.push(line);
    }
    const pool = chunk.spatial_pool > 1 ? ` (cells of ${chunk.spatial_pool}×${chunk.spatial_pool} tokens)` : "";
    Plotly.react("spatial", [{
      // as survey_spatial: linear from 0 to the largest value, at least 1 (the uniform share)
      type: "heatmap", z: image, colorscale: S.scales.probability, zauto: false, zmin: 0,
      zmax: Math.max(...image.flat().filter((v) => v !== null), 1),
      colorbar: { title: { text: S.labels.token_multiple, side: "right" }, tickformat: "~g" },
      hovertemplate: "row %{y}, column %{x}: ×%{z:.3g}<extra></extra>",
    }], {
      title: { text: `Where the last block's mass lands in frame 0${pool}`, font: { size: 13 } },
      xaxis: { visible: false, range: [-0.5, colsN - 0.5], constrain: "domain" },
      yaxis: { visible: false, range: [rowsN - 0.5, -0.5], scaleanchor: "x", constrain: "domain" },
      plot_bgcolor: S.scales.unseen, margin: { l: 20, r: 10, t: 40, b: 20 },
    }, PLOT);
  } else {
    Plotly.purge("spatial");
    document.getElementById("spatial").textContent = "No attention store: no spatial map.";
  }
  showCell(data, h);
}

function showCell(data, h) {
  const out = document.getElementById("cell-readout");
  if (!state.cell) { out.textContent = "Click a cell of the frame map."; return; }
  const [q, k] = state.cell;
  const v = data.maps[state.step][h][q][k];
  out.dataset.query = q; out.dataset.key = k; out.dataset.value = Number.isNaN(v) ? "" : v;
  out.textContent = `query frame ${q} → key frame ${k}: ` +
    (Number.isNaN(v) ? "not seen" : fmt(v, 4) + " (float16)");
}

function update() {
  const r = run();
  if (!r.layers.includes(state.layer)) state.layer = r.layers[0];
  if (!r.heads.includes(state.head)) state.head = r.heads[0];
  if (!r.blocks.includes(state.block)) state.block = lastBlock();
  fillControls();
  drawOverview();
  showReadout();
  return drawHead().catch((err) => {
    document.getElementById("status").textContent = String(err);
  });
}

function bindSurvey() {
  const on = (id, fn) => document.getElementById(id).addEventListener("change", (e) => {
    fn(e.target.value); update();
  });
  on("checkpoint", (c) => {
    const r = run();
    let i = runIndex(c, r.prompt);
    if (i < 0) i = INDEX.runs.findIndex((x) => x.checkpoint === c);
    state.run = i;
  });
  on("prompt", (p) => { state.run = runIndex(run().checkpoint, p); });
  on("step", (s) => { state.step = Number(s); });
  on("layer", (l) => { state.layer = Number(l); });
  on("head", (h) => { state.head = Number(h); });
  on("block", (b) => { state.block = Number(b); });
  document.getElementById("overview").on("plotly_click", (event) => {
    const point = event.points.find((p) => p.curveNumber === 0) || event.points[0];
    state.layer = Number(point.y); state.head = Number(point.x);
    update();
  });
  document.getElementById("frame-map").on("plotly_click", (event) => {
    const point = event.points[0];
    state.cell = [Number(point.y), Number(point.x)];
    state.block = blockOf(Number(point.y));
    update();
  });
}

// ---- closed loops -------------------------------------------------------------------------

const loop = () => INDEX.closed_loops[state.loop];

async function drawLoop() {
  const l = loop();
  const data = await load(l.file);
  const slider = document.getElementById("loop-frame");
  slider.max = l.frames - 1;
  state.frame = Math.min(state.frame, l.frames - 1);
  slider.value = state.frame;
  const panels = [
    ["rel_l2", "latent rel. L2 to full", (d) => d.rel_l2],
    ["sink_distance", "latent sink distance", (d) => d.sink_distance],
    ["pixel_sink", "pixel sink distance", (d) => d.pixel && d.pixel.sink_distance],
    ["flicker", "flicker (0-255)", (d) => d.pixel && d.pixel.flicker],
    ["ssim", S.labels.ssim, (d) => d.pixel && d.pixel.ssim],
    ["sink_share", "sink-head share", (d) => d.sink_share],
  ].filter(([, , get]) => l.rollouts.some((r) => { const v = get(data[r.rollout]); return v && v.some((x) => x !== null); }));
  const traces = [];
  l.rollouts.forEach((r, i) => {
    panels.forEach(([, , get], p) => {
      const y = get(data[r.rollout]);
      if (!y) return;
      traces.push({ type: "scatter", mode: "lines", x: data[r.rollout].frame, y, name: r.label,
        legendgroup: r.rollout, showlegend: p === 0 || (p > 0 && !traces.some((t) => t.legendgroup === r.rollout)),
        xaxis: "x", yaxis: p === 0 ? "y" : "y" + (p + 1), line: { color: SERIES[i % SERIES.length], width: 1.5 },
        hovertemplate: `${r.label}<br>frame %{x}: %{y:.4g}<extra></extra>` });
    });
  });
  document.getElementById("loop-series").style.height = `${110 + 120 * panels.length}px`;
  const layout = { grid: { rows: panels.length, columns: 1, pattern: "coupled", ygap: 0.25 },
    margin: { l: 70, r: 10, t: 40, b: 50 }, legend: { orientation: "h", y: -0.6 / panels.length },
    title: { text: `${l.checkpoint} / ${l.prompt}: every rollout on one latent-frame axis`, font: { size: 13 } },
    shapes: [], annotations: [] };
  panels.forEach(([, label], p) => {
    layout[p === 0 ? "yaxis" : "yaxis" + (p + 1)] = { title: { text: label, font: { size: 11 } },
      nticks: 4, tickformat: "~g" };
  });
  layout["xaxis"] = { title: { text: "latent frame" } };
  l.rollouts.forEach((r, i) => {
    if (r.evicting_from !== null && r.evicting_from !== undefined) {
      layout.shapes.push({ type: "line", xref: "x", yref: "paper", x0: r.evicting_from - 0.5,
        x1: r.evicting_from - 0.5, y0: 0, y1: 1, line: { color: SERIES[i % SERIES.length], dash: "dot", width: 1 } });
    }
  });
  layout.shapes.push({ type: "line", xref: "x", yref: "paper", x0: state.frame, x1: state.frame,
    y0: 0, y1: 1, line: { color: "black", width: 1.5 }, name: "cursor" });
  await Plotly.react("loop-series", traces, layout, PLOT);
  drawRollouts(l, data);
}

function drawRollouts(l, data) {
  const box = document.getElementById("loop-rollouts");
  box.style.setProperty("--evicted", S.evicted_color);
  if (box.dataset.loop !== String(state.loop)) {
    box.innerHTML = "";
    box.dataset.loop = String(state.loop);
    l.rollouts.forEach((r) => {
      const tile = document.createElement("div");
      tile.className = "rollout"; tile.id = "rollout-" + r.rollout;
      const label = document.createElement("div");
      label.className = "label"; label.textContent = r.label;
      tile.appendChild(label);
      if (r.video) {
        const video = document.createElement("video");
        video.src = r.video; video.muted = true; video.preload = "auto";
        video.playsInline = true;
        video.title = "the frame under the cursor (move the slider or click the plot)";
        tile.appendChild(video);
      } else {
        const note = document.createElement("p");
        note.className = "note"; note.textContent = "no video (videos: none)";
        tile.appendChild(note);
      }
      const evict = document.createElement("div");
      evict.className = "note";
      evict.textContent = r.evicting_from === null || r.evicting_from === undefined
        ? "never evicts" : `first eviction at latent frame ${r.evicting_from}`;
      tile.appendChild(evict);
      const chips = document.createElement("div");
      chips.className = "chips";
      tile.appendChild(chips);
      box.appendChild(tile);
    });
  }
  showFrame(l, data);
}

function currentBlock(l) {
  const any = chunks[l.file][l.rollouts[0].rollout];
  return any.block[any.frame.indexOf(state.frame)];
}

function showFrame(l, data) {
  const f = state.frame;
  const pixel = l.shown_pixel[f];
  const block = currentBlock(l);
  document.getElementById("loop-where").textContent =
    `latent frame ${f} · pixel frame ${pixel} · ${(pixel / l.fps).toFixed(2)} s · block ${block}`;
  const cursor = document.getElementById("loop-series").layout.shapes.length - 1;
  Plotly.relayout("loop-series", { [`shapes[${cursor}].x0`]: f, [`shapes[${cursor}].x1`]: f });
  for (const r of l.rollouts) {
    const tile = document.getElementById("rollout-" + r.rollout);
    const evicting = r.evicting_from !== null && r.evicting_from !== undefined && f >= r.evicting_from;
    tile.querySelector(".label").classList.toggle("evicting", evicting);
    const video = tile.querySelector("video");
    if (video) {
      const seek = () => { video.pause(); video.currentTime = (pixel + 0.5) / l.fps; };
      if (video.readyState >= 1) seek(); else video.addEventListener("loadedmetadata", seek, { once: true });
    }
    const chips = tile.querySelector(".chips");
    if (!l.cached.includes(r.rollout)) {
      chips.textContent = r.rollout === "full" ? "every frame" : "";
    }
  }
  showCache(l, block);
}

async function showCache(l, block) {
  // the cache's contents, paged: the file of the blocks around the cursor
  if (!l.cached.length) return;
  const page = await load(`${l.file}/cache${Math.floor(block / l.cache_page_blocks)}`);
  if (loop() !== l || currentBlock(l) !== block) return;
  for (const rollout of l.cached) {
    const chips = document.querySelector(`#rollout-${rollout} .chips`);
    chips.innerHTML = "";
    const held = (page[rollout] || {})[String(block)] || [];
    chips.dataset.frames = held.map(([frame]) => frame).join(",");
    for (const [frame, kind, share] of held) {
      const name = l.slot_kinds[String(kind)] || String(kind);
      const chip = document.createElement("span");
      chip.className = "chip"; chip.style.background = KIND_COLOURS[name] || "#777";
      chip.textContent = share < 0.999 ? `${frame} ${name} ${Math.round(share * 100)}%` : `${frame} ${name}`;
      chip.title = `key frame ${frame}: ${name}, ${fmt(share * 100, 3)} % of its tokens`;
      chips.appendChild(chip);
    }
  }
}

function bindLoops() {
  const section = document.getElementById("closed-loop");
  if (!INDEX.closed_loops.length) { section.style.display = "none"; return; }
  fillSelect("loop-run", INDEX.closed_loops.map((l, i) => [i, `${l.checkpoint} / ${l.prompt}`]), 0);
  document.getElementById("loop-run").addEventListener("change", (e) => {
    state.loop = Number(e.target.value); drawLoop();
  });
  document.getElementById("loop-frame").addEventListener("input", (e) => {
    state.frame = Number(e.target.value);
    load(loop().file).then((data) => showFrame(loop(), data));
  });
  drawLoop().then(() => {
    document.getElementById("loop-series").on("plotly_click", (event) => {
      state.frame = Math.round(Number(event.points[0].x));
      document.getElementById("loop-frame").value = state.frame;
      load(loop().file).then((data) => showFrame(loop(), data));
    });
  });
}

// ---- start --------------------------------------------------------------------------------

function start() {
  document.getElementById("title").textContent = INDEX.title;
  if (!INDEX.runs.length) {
    document.getElementById("survey").style.display = "none";
  } else {
    state.layer = run().layers[0]; state.head = run().heads[0]; state.block = lastBlock();
    Promise.resolve(update()).then(() => bindSurvey());
  }
  bindLoops();
}

window.addEventListener("error", (e) => {
  document.getElementById("status").textContent = "error: " + e.message;
});
start();
