// The live panel: polls GET /v1/metrics about once a second, shows the engine's state and
// draws its recent history. Tokens/s is the change in generated tokens between two polls.

import { api } from "./api.js";
import { barChart, lineChart } from "./charts.js";

const POLL_MS = 1000;
const WINDOW = 300; // samples kept: five minutes at one a second

const history = { tps: [], running: [], waiting: [], kv: [] };
let previous = null; // {time, generated} of the last poll
let latest = null; // the last summary, for the chat's per-answer speculative figures

export function latestSummary() {
  return latest;
}

function push(values, value) {
  values.push(value);
  if (values.length > WINDOW) values.shift();
}

function percent(ratio) {
  return ratio === null || ratio === undefined ? "–" : `${(100 * ratio).toFixed(1)}%`;
}

function show(id, text) {
  document.getElementById(id).textContent = text;
}

function record(summary, now) {
  let tps = null;
  if (previous !== null && now > previous.time) {
    const tokens = summary.total_generated_tokens - previous.generated;
    tps = Math.max(0, tokens) / ((now - previous.time) / 1000);
  }
  previous = { time: now, generated: summary.total_generated_tokens };
  push(history.tps, tps);
  push(history.running, summary.num_requests_running);
  push(history.waiting, summary.num_requests_waiting);
  push(history.kv, 100 * summary.kv_cache_usage);
  return tps;
}

function render(summary, tps) {
  show("m-running", summary.num_requests_running);
  show("m-waiting", summary.num_requests_waiting);
  show("m-kv", percent(summary.kv_cache_usage));
  show("m-prefix", percent(summary.prefix_cache_hit_rate));
  show("m-tps", tps === null ? "–" : tps.toFixed(1));
  const spec = summary.spec_decode_acceptance_rate;
  document.getElementById("m-spec-box").hidden = spec === null || spec === undefined;
  show("m-spec", percent(spec));
  draw(summary);
}

export function draw(summary = latest) {
  if (summary === null) return;
  lineChart(document.getElementById("chart-tps"), [{ values: history.tps, color: "--accent" }], WINDOW);
  lineChart(
    document.getElementById("chart-load"),
    [
      { values: history.running, color: "--accent", label: "running" },
      { values: history.waiting, color: "--warn", label: "waiting" },
    ],
    WINDOW,
  );
  lineChart(document.getElementById("chart-kv"), [{ values: history.kv, color: "--accent" }], WINDOW, 100);
  for (const [id, series] of [
    ["chart-ttft", summary.ttft_ms],
    ["chart-tpot", summary.tpot_ms],
  ]) {
    barChart(
      document.getElementById(id),
      ["p50", "p90", "p99"].map((p) => ({ label: p, value: series[p] })),
    );
  }
}

async function poll() {
  const panel = document.getElementById("dashboard");
  try {
    const response = await api("/v1/metrics");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const summary = await response.json();
    latest = summary;
    render(summary, record(summary, performance.now()));
    panel.dataset.polls = String(Number(panel.dataset.polls) + 1);
    show("dashboard-status", `updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    previous = null; // a gap in the samples: the next rate starts afresh
    show("dashboard-status", `unreachable (${error.message})`);
  }
  setTimeout(poll, POLL_MS);
}

export function startDashboard() {
  poll();
  window.addEventListener("resize", () => draw());
}
