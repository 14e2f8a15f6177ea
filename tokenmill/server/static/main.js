// The playground page: the API key form, the model picker, then the chat and the live panel.

import { api, askForKey, hasKey, keyPrompt } from "./api.js";
import { startChat } from "./chat.js";
import { startDashboard } from "./dashboard.js";

const $ = (id) => document.getElementById(id);

// Shows the key form and resolves with the key the user submits.
keyPrompt.ask = (message) =>
  new Promise((resolve) => {
    const form = $("key-form");
    $("key-message").textContent = message;
    form.hidden = false;
    $("api-key").value = "";
    $("api-key").focus();
    form.onsubmit = (event) => {
      event.preventDefault();
      form.hidden = true;
      $("key-button").hidden = false;
      resolve($("api-key").value);
      $("prompt").focus();
    };
  });

// The picker appears only when the server has more than one model.
async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) return;
  const models = (await response.json()).data.map((m) => m.id);
  const select = $("model");
  select.replaceChildren(...models.map((id) => new Option(id, id)));
  $("model-picker").hidden = models.length < 2;
  $("model-name").textContent = models.length === 1 ? models[0] : "";
}

function start() {
  $("key-button").hidden = !hasKey();
  $("key-button").addEventListener("click", () => {
    askForKey("Enter a new API key.");
  });
  startChat();
  startDashboard();
  loadModels();
}

start();
