// Calls to the tokenmill server: the API key (asked for on a 401, kept in this tab's
// sessionStorage only) and the reading of server-sent event streams.

const KEY_ITEM = "tokenmill.apiKey";
let apiKey = sessionStorage.getItem(KEY_ITEM);
let keyWanted = null; // one pending prompt for the key, shared by every call that got a 401

export function hasKey() {
  return apiKey !== null;
}

function setKey(key) {
  apiKey = key;
  sessionStorage.setItem(KEY_ITEM, key);
}

// The page's key form calls askForKey(message) through this hook (set by main.js): it shows
// the form and resolves with what the user enters.
export const keyPrompt = { ask: null };

// Asks the user for a key (once, however many calls are waiting for it) and keeps it.
export function askForKey(message) {
  if (keyWanted === null) {
    keyWanted = keyPrompt.ask(message).then((key) => {
      setKey(key);
      keyWanted = null;
    });
  }
  return keyWanted;
}

function abortable(promise, signal) {
  if (!signal) return promise;
  return new Promise((resolve, reject) => {
    const onAbort = () => reject(new DOMException("stopped", "AbortError"));
    if (signal.aborted) return onAbort();
    signal.addEventListener("abort", onAbort, { once: true });
    promise.then(resolve, reject);
  });
}

// fetch() with the key; on a 401, waits for the user to give a key and tries again.
// `onSend`, if given, is called as each attempt starts (a timer then leaves out the wait).
export async function api(path, { onSend, ...options } = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}) };
    if (options.body) headers["Content-Type"] = "application/json";
    if (apiKey !== null) headers.Authorization = `Bearer ${apiKey}`;
    onSend?.();
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const message = apiKey === null ? "This server needs an API key." : "That API key was refused.";
    await abortable(askForKey(message), options.signal);
  }
}

export async function errorOf(response) {
  try {
    const body = await response.json();
    const { message, param } = body.error;
    return new Error(param ? `${message} (field: ${param})` : message);
  } catch {
    return new Error(`HTTP ${response.status}`);
  }
}

// Calls onEvent with each parsed `data:` payload of a server-sent event stream until [DONE];
// an event carrying an error (the server failed mid-stream) is thrown.
export async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new Error(payload.error.message);
        onEvent(payload);
      }
    }
  }
}
