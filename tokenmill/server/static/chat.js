// The chat: the conversation so far, one streamed answer at a time from
// POST /v1/chat/completions, a Stop that aborts the request (the server then aborts the
// engine request and frees its KV), and each answer's figures under it.

import { api, errorOf, readEvents } from "./api.js";
import { latestSummary } from "./dashboard.js";

const $ = (id) => document.getElementById(id);
let conversation = []; // {role, content} of the finished turns, system prompt excluded
let running = null; // the AbortController of the answer being streamed

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function numberField(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

// The request body from the settings; throws (with a message for the user) on a bad schema.
function requestBody(messages) {
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature", Number),
    top_p: numberField("top-p", Number),
    max_tokens: numberField("max-tokens", (v) => Number.parseInt(v, 10)),
    seed: numberField("seed", (v) => Number.parseInt(v, 10)),
  };
  const model = $("model").value;
  if (model) body.model = model;
  const stop = $("stop-strings").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  const schemaText = $("schema").value.trim();
  if (schemaText) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (error) {
      throw new Error(`the JSON schema is not valid JSON: ${error.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  }
  return body;
}

// The figures under an answer. Times are measured here, in the browser, from the moment the
// request left (after any wait for an API key); token counts come from the server's usage
// chunk when it sent one. Speculative acceptance is the server's over the answer's time.
function figures(t) {
  const parts = [];
  if (t.first !== null) parts.push(`TTFT ${(t.first - t.start).toFixed(0)} ms`);
  const tokens = t.usage ? t.usage.completion_tokens : t.chunks;
  if (t.first !== null && tokens > 1 && t.end > t.first) {
    parts.push(`${((tokens - 1) / ((t.end - t.first) / 1000)).toFixed(1)} tok/s`);
  }
  parts.push(t.usage ? `${tokens} tokens` : `≈${tokens} tokens`);
  if (t.usage) {
    const cached = t.usage.prompt_tokens_details?.cached_tokens;
    const prompt = t.usage.prompt_tokens;
    parts.push(cached === undefined || cached === null ? `prompt ${prompt}` : `cached ${cached}/${prompt} prompt`);
  }
  if (t.spec) parts.push(`spec accepted ${t.spec}`);
  if (t.stopped) parts.push("stopped");
  return parts.join(" · ");
}

// Drafts accepted over drafts verified between two metric summaries, if any were drafted.
function specAcceptance(before, after) {
  if (!before || !after) return null;
  const drafted = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens;
  const accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens;
  return drafted > 0 ? `${((100 * accepted) / drafted).toFixed(0)}%` : null;
}

async function metricsNow() {
  try {
    const response = await api("/v1/metrics");
    return response.ok ? await response.json() : null;
  } catch {
    return null;
  }
}

function setRunning(controller) {
  running = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

async function send() {
  const text = $("prompt").value;
  if (running !== null || text.trim() === "") return;
  const system = $("system").value.trim();
  const turn = { role: "user", content: text };
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation, turn];
  let body;
  try {
    body = requestBody(messages);
  } catch (error) {
    addMessage("error", error.message);
    return;
  }
  $("prompt").value = "";
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const content = answer.querySelector(".content");
  answer.classList.add("streaming");
  const controller = new AbortController();
  setRunning(controller);
  const before = latestSummary();
  const t = { start: performance.now(), first: null, end: null, chunks: 0, usage: null };
  let reply = "";
  let failed = false;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(body),
      signal: controller.signal,
      onSend: () => {
        t.start = performance.now();
      },
    });
    if (!response.ok) throw await errorOf(response);
    await readEvents(response, (chunk) => {
      if (chunk.usage) t.usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (!delta) return;
      if (t.first === null) t.first = performance.now();
      t.chunks += 1;
      reply += delta;
      content.textContent = reply;
      answer.scrollIntoView({ block: "end" });
    });
  } catch (error) {
    if (error.name === "AbortError") t.stopped = true;
    else {
      failed = true;
      answer.classList.add("error");
      content.textContent = reply ? `${reply}\n[${error.message}]` : error.message;
    }
  }
  t.end = performance.now();
  setRunning(null);
  answer.classList.remove("streaming");
  // A refused turn stays on screen but out of the history, so the next message is not refused
  // for it again; a stopped answer is kept as far as it got.
  if (!failed) {
    conversation.push(turn);
    if (reply) conversation.push({ role: "assistant", content: reply });
  }
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = figures(t);
  answer.append(stats);
  answer.scrollIntoView({ block: "end" });
  t.spec = specAcceptance(before, await metricsNow());
  stats.textContent = figures(t);
}

function stop() {
  if (running !== null) running.abort();
}

function clear() {
  stop();
  conversation = [];
  $("messages").replaceChildren();
  $("prompt").focus();
}

export function startChat() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clear);
  $("prompt").focus();
}
