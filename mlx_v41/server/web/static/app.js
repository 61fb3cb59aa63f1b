// The chat page of mlx_v41.server: streams replies from the server's own
// POST v1/chat/completions (server-sent events) and keeps the conversation in localStorage.
// Model text only ever reaches the page as textContent, never as HTML.
"use strict";

const STORE = {conversation: "mlx_v41.conversation", settings: "mlx_v41.settings",
               key: "mlx_v41.api_key"};
const $ = (id) => document.getElementById(id);
const view = {
  messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  attachments: $("attachments"), imageInput: $("image-input"), model: $("model"),
  status: $("status"), thinking: $("thinking"), effort: $("effort"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), stops: $("stop-strings"),
  keyDialog: $("key-dialog"), keyForm: $("key-form"), keyInput: $("key-input"),
  keyError: $("key-error"), keyCancel: $("key-cancel"), forgetKey: $("forget-key"),
};

// user: {role, text, images: [data URL]}
// assistant: {role, reasoning, content, calls: [{id, name, arguments}], stats, finish, error}
let conversation = loadJSON(STORE.conversation, []);
let pending = [];  // data URLs of the images attached to the next message
let running = null;  // the AbortController of the reply streaming now

// ------------------------------------------------------------------------------ DOM helpers

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

function loadJSON(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch (e) {
    return fallback;
  }
}

function saveConversation() {
  try {
    localStorage.setItem(STORE.conversation, JSON.stringify(conversation));
  } catch (e) {  // over the storage quota: keep the text, drop the images
    const light = conversation.map((m) => m.images && m.images.length
      ? {...m, images: [], dropped: m.images.length} : m);
    try {
      localStorage.setItem(STORE.conversation, JSON.stringify(light));
    } catch (e2) { /* storage is off: the conversation lives in this tab only */ }
    showStatus("images are too large to be kept after a reload");
  }
}

function showStatus(text) {
  view.status.textContent = text;
}

function isNearBottom() {
  const m = view.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

// ------------------------------------------------------------------------------ API key

function apiKey() {
  return localStorage.getItem(STORE.key) || "";
}

let keyWaiters = [];

// Shows the key dialog (with "not accepted" when a key was sent); resolves with the key
// entered, or "" when the user cancels.
function askKey(wasRejected) {
  view.keyError.hidden = !wasRejected;
  view.keyInput.value = "";
  if (!view.keyDialog.open) view.keyDialog.showModal();
  view.keyInput.focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function answerKey(key) {
  if (view.keyDialog.open) view.keyDialog.close();
  if (key) localStorage.setItem(STORE.key, key);
  view.forgetKey.hidden = !apiKey();
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((resolve) => resolve(key));
}

// fetch() on the server's API with the key, asking for one while the answer is a 401.
async function api(path, init = {}) {
  for (;;) {
    const key = apiKey();
    const headers = {...(init.headers || {})};
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, {...init, headers});
    if (response.status !== 401) return response;
    if (!(await askKey(Boolean(key)))) return response;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

// ------------------------------------------------------------------------------ rendering

function renderUser(message) {
  const node = el("div", {class: "message user"});
  const images = el("div", {class: "images"});
  for (const url of message.images || []) images.append(el("img", {src: url, alt: "image"}));
  if (message.dropped) images.append(el("span", {class: "note",
                                                 text: `${message.dropped} image(s) not kept`}));
  node.append(images, el("div", {class: "content", text: message.text}));
  return node;
}

function renderAssistant(message) {
  const node = el("div", {class: "message assistant"});
  updateAssistant(node, message);
  return node;
}

// Brings an assistant message's node up to date (called on every streamed chunk).
function updateAssistant(node, message) {
  node.dataset.state = message.finish || message.error ? "done" : "streaming";
  let reasoning = node.querySelector("details.reasoning");
  if (message.reasoning && !reasoning) {
    reasoning = el("details", {class: "reasoning"}, el("summary"), el("pre"));
    node.prepend(reasoning);
  }
  if (reasoning) {
    const thinking = node.dataset.state === "streaming" && !message.content &&
      !message.calls.length;
    reasoning.querySelector("summary").textContent = thinking ? "Thinking…" : "Reasoning";
    reasoning.querySelector("pre").textContent = message.reasoning;
  }
  setText(part(node, "content"), message.content);
  const calls = part(node, "calls");
  calls.replaceChildren(...message.calls.map((call) => el(
    "div", {class: "tool-call"}, el("div", {class: "name", text: `tool call: ${call.name}`}),
    el("pre", {class: "arguments", text: call.arguments}))));
  calls.hidden = !message.calls.length;
  setText(part(node, "error"), message.error || "");
  setText(part(node, "stats"), statsText(message));
}

// The child div of `node` with class `name` (made on first use).
function part(node, name) {
  let child = node.querySelector(`:scope > .${name}`);
  if (!child) node.append(child = el("div", {class: name}));
  return child;
}

function setText(node, text) {
  node.textContent = text;
  node.hidden = !text;
}

function statsText(message) {
  const s = message.stats;
  if (!s) return message.finish === "stopped" ? "stopped" : "";
  const parts = [`${s.completion} tokens`];
  if (s.perSecond !== null) parts.push(`${s.perSecond.toFixed(1)} tok/s`);
  if (s.firstToken !== null) parts.push(`first token ${s.firstToken.toFixed(2)} s`);
  parts.push(`prompt ${s.prompt} tokens, ${s.cached} cached`);
  if (message.finish && message.finish !== "stop") parts.push(message.finish);
  return parts.join(" · ");
}

function renderConversation() {
  view.messages.replaceChildren(...conversation.map(
    (m) => m.role === "user" ? renderUser(m) : renderAssistant(m)));
  view.messages.scrollTop = view.messages.scrollHeight;
}

function renderAttachments() {
  view.attachments.replaceChildren(...pending.map((url, i) => {
    const remove = el("button", {type: "button", class: "remove", title: "remove",
                                 text: "×"});
    remove.addEventListener("click", () => { pending.splice(i, 1); renderAttachments(); });
    return el("div", {class: "attachment"}, el("img", {src: url, alt: "attached image"}),
              remove);
  }));
}

// ------------------------------------------------------------------------------ requests

// The conversation in the API's shape: images as image_url parts (data URLs).
function apiMessages(messages) {
  const out = [];
  for (const m of messages) {
    if (m.role === "user") {
      const images = (m.images || []).map((url) => ({type: "image_url", image_url: {url}}));
      out.push({role: "user",
                content: images.length ? [...images, {type: "text", text: m.text}] : m.text});
    } else if (m.content || m.reasoning || m.calls.length) {
      const message = {role: "assistant", content: m.content};
      if (m.reasoning) message.reasoning_content = m.reasoning;
      if (m.calls.length) {
        message.tool_calls = m.calls.map((c) => ({id: c.id, type: "function",
                                                  function: {name: c.name,
                                                             arguments: c.arguments}}));
      }
      out.push(message);
    }
  }
  return out;
}

function requestBody() {
  const s = readSettings();
  const body = {messages: apiMessages(conversation.slice(0, -1)), stream: true,
                stream_options: {include_usage: true},
                chat_template_kwargs: {thinking: s.thinking}};
  if (s.thinking && s.effort) body.reasoning_effort = s.effort;
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.maxTokens !== "") body.max_tokens = Number(s.maxTokens);
  const stops = s.stops.split("\n").filter((line) => line !== "");
  if (stops.length) body.stop = stops;
  return body;
}

// Reads server-sent events from `response`, calling `onData(json)` for each data event.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true}).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      buffer = buffer.slice(end + 2);
      if (data && data !== "[DONE]") onData(JSON.parse(data));  // ": keepalive" has none
    }
  }
}

function addDelta(reply, delta, clock) {
  if (delta.reasoning_content || delta.content || delta.tool_calls) {
    clock.first = clock.first ?? performance.now();
  }
  reply.reasoning += delta.reasoning_content || "";
  reply.content += delta.content || "";
  for (const call of delta.tool_calls || []) {
    const entry = reply.calls[call.index] ??= {id: "", name: "", arguments: ""};
    if (call.id) entry.id = call.id;
    entry.name += (call.function && call.function.name) || "";
    entry.arguments += (call.function && call.function.arguments) || "";
  }
}

function setStats(reply, usage, clock) {
  const now = performance.now();
  const decoding = clock.first === null ? 0 : (now - clock.first) / 1000;
  reply.stats = {
    prompt: usage.prompt_tokens, completion: usage.completion_tokens,
    cached: (usage.prompt_tokens_details || {}).cached_tokens || 0,
    // the first token's time is the prompt's: the rate counts the tokens after it
    perSecond: usage.completion_tokens > 1 && decoding > 0
      ? (usage.completion_tokens - 1) / decoding : null,
    firstToken: clock.first === null ? null : (clock.first - clock.start) / 1000,
  };
}

async function streamReply(reply, node) {
  const clock = {start: performance.now(), first: null};
  const update = () => {
    const follow = isNearBottom();
    updateAssistant(node, reply);
    if (follow) view.messages.scrollTop = view.messages.scrollHeight;
  };
  const response = await api("v1/chat/completions", {
    method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify(requestBody()), signal: running.signal});
  if (!response.ok) {
    reply.error = await errorText(response);
    return update();
  }
  await readEvents(response, (event) => {
    if (event.error) reply.error = event.error.message || "the reply failed";
    if (event.usage) setStats(reply, event.usage, clock);
    for (const choice of event.choices || []) {
      addDelta(reply, choice.delta || {}, clock);
      if (choice.finish_reason) reply.finish = choice.finish_reason;
    }
    update();
  });
  if (!reply.finish && !reply.error) reply.error = "the reply ended early";
  update();
}

async function send() {
  const text = view.prompt.value;
  if (running || (!text.trim() && !pending.length)) return;
  conversation.push({role: "user", text, images: pending});
  const reply = {role: "assistant", reasoning: "", content: "", calls: [], stats: null,
                 finish: null, error: null};
  conversation.push(reply);
  view.prompt.value = "";
  pending = [];
  renderAttachments();
  view.messages.append(renderUser(conversation[conversation.length - 2]));
  const node = renderAssistant(reply);
  view.messages.append(node);
  view.messages.scrollTop = view.messages.scrollHeight;
  saveConversation();
  running = new AbortController();
  setRunning(true);
  try {
    await streamReply(reply, node);
  } catch (e) {
    if (e.name === "AbortError") reply.finish = "stopped";
    else reply.error = `the request failed: ${e.message}`;
    updateAssistant(node, reply);
  } finally {
    running = null;
    setRunning(false);
    saveConversation();
  }
}

function setRunning(isRunning) {
  view.send.disabled = isRunning;
  view.stop.hidden = !isRunning;
}

// ------------------------------------------------------------------------------ settings

const SETTINGS = {thinking: "checked", effort: "value", temperature: "value",
                  maxTokens: "value", stops: "value"};

function readSettings() {
  const s = {};
  for (const [name, property] of Object.entries(SETTINGS)) s[name] = view[name][property];
  return s;
}

function applySettings() {
  const saved = loadJSON(STORE.settings, {});
  for (const [name, property] of Object.entries(SETTINGS)) {
    if (name in saved) view[name][property] = saved[name];
  }
  view.effort.disabled = !view.thinking.checked;
}

function saveSettings() {
  view.effort.disabled = !view.thinking.checked;
  localStorage.setItem(STORE.settings, JSON.stringify(readSettings()));
}

// ------------------------------------------------------------------------------ start

async function showModel() {
  try {
    const response = await api("v1/models");
    if (!response.ok) {
      showStatus(await errorText(response));
      if (response.status === 503) setTimeout(showModel, 2000);  // loading
      return;
    }
    const body = await response.json();
    view.model.textContent = body.data.length ? body.data[0].id : "";
    showStatus("");
  } catch (e) {
    showStatus(`the server did not answer: ${e.message}`);
  }
}

function readImages(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.addEventListener("load", () => { pending.push(reader.result); renderAttachments(); });
    reader.readAsDataURL(file);
  }
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
view.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
view.stop.addEventListener("click", () => running && running.abort());
view.imageInput.addEventListener("change", () => {
  readImages(view.imageInput.files);
  view.imageInput.value = "";
});
$("new-chat").addEventListener("click", () => {
  if (running) running.abort();
  conversation = [];
  localStorage.removeItem(STORE.conversation);
  renderConversation();
  view.prompt.focus();
});
for (const name of Object.keys(SETTINGS)) view[name].addEventListener("change", saveSettings);
view.keyForm.addEventListener("submit", (e) => {
  e.preventDefault();
  answerKey(view.keyInput.value.trim());
});
view.keyCancel.addEventListener("click", () => answerKey(""));
view.keyDialog.addEventListener("cancel", () => answerKey(""));
view.forgetKey.addEventListener("click", () => {
  localStorage.removeItem(STORE.key);
  view.forgetKey.hidden = true;
});

applySettings();
view.forgetKey.hidden = !apiKey();
for (const m of conversation) {  // a reply still streaming when the page was closed
  if (m.role === "assistant" && !m.finish && !m.error) m.finish = "stopped";
}
renderConversation();
showModel();
