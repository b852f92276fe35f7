// klein's editing page: references, prompt and settings on the left; live progress, results and the
// session's history on the right. It speaks only to the server that served it (relative URLs), through
// the documented HTTP API: /v1/config, /v1/references, /v1/jobs and the job's server-sent events.
"use strict";

const $ = (id) => document.getElementById(id);
const SIZE_PRESETS = [
  [256, 256], [512, 512], [768, 768], [1024, 1024], [1024, 768], [768, 1024], [1280, 720], [720, 1280],
];
const MAX_IMAGES = 8;
const KEY_STORE = "klein-api-key";
const EMPTY = "Add a reference image, write a prompt and press Generate. Each result can become the reference of the next edit.";

const state = {
  config: null,
  refs: [], // {key, blob, name, url, width, height}, in the order the model sees them
  nextKey: 1,
  uploaded: null, // {keys, id}: the server's id of the current reference list, reused while it holds
  running: false,
  history: [], // newest last
  shown: null,
  apiKey: sessionStorage.getItem(KEY_STORE) || "",
};

class ServerError extends Error {
  constructor(status, error, retryAfter) {
    super(error.message);
    this.status = status;
    this.code = error.code || null;
    this.param = error.param || null;
    this.retryAfter = retryAfter;
  }
}

class InputProblem extends Error {
  constructor(message, field) {
    super(message);
    this.field = field;
  }
}

// ---------------------------------------------------------------- talking to the server

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (state.apiKey) headers.set("Authorization", `Bearer ${state.apiKey}`);
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) throw await serverError(response);
  return response;
}

async function serverError(response) {
  let error = { message: `The server answered ${response.status} ${response.statusText}.` };
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) error = body.error;
  } catch {
    // Not JSON (a proxy's page, say): keep the status line.
  }
  return new ServerError(response.status, error, response.headers.get("Retry-After"));
}

async function postJSON(path, body) {
  const headers = { "Content-Type": "application/json" };
  return (await api(path, { method: "POST", headers, body: JSON.stringify(body) })).json();
}

// The current reference list as the server's id. The server encodes a new list on upload, so the
// answer says whether this upload paid for the encoding (`encoded`) and how long it took, as seen here.
async function uploadReferences() {
  const keys = state.refs.map((ref) => ref.key).join(",");
  if (state.uploaded && state.uploaded.keys === keys) return { id: state.uploaded.id, encoded: false };
  const count = state.refs.length;
  setStatus(`Uploading and encoding ${count === 1 ? "1 reference" : `${count} references`}…`, null);
  const form = new FormData();
  for (const ref of state.refs) form.append("image", ref.blob, ref.name);
  const started = performance.now();
  const answer = await (await api("v1/references", { method: "POST", body: form })).json();
  state.uploaded = { keys, id: answer.id };
  return { id: answer.id, encoded: !answer.cached, seconds: (performance.now() - started) / 1000 };
}

// Submits the job; resolves to {job, upload} (upload: null without references).
async function submitJob(body) {
  let upload = state.refs.length ? await uploadReferences() : null;
  if (upload) body.references = upload.id;
  try {
    return { job: await postJSON("v1/jobs", body), upload };
  } catch (error) {
    // The server may have dropped our references (restart, eviction): send them again, once.
    if (!(error instanceof ServerError && error.code === "unknown_reference")) throw error;
    state.uploaded = null;
    upload = await uploadReferences();
    body.references = upload.id;
    return { job: await postJSON("v1/jobs", body), upload };
  }
}

// Server-sent events read through fetch rather than EventSource, which cannot send the API key.
async function followJob(id, onEvent) {
  const path = `v1/jobs/${encodeURIComponent(id)}`;
  const response = await api(`${path}/events`, { headers: { Accept: "text/event-stream" } });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer = (buffer + value).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = parseEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (event.name === "done") return event.data;
      if (event.name === "error") throw new ServerError(null, event.data.error || event.data, null);
      if (event.name) onEvent(event);
    }
  }
  return jobOutcome(await (await api(path)).json());
}

function parseEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":") || !line) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") name = value;
    if (field === "data") data.push(value);
  }
  if (!data.length) return { name: null };
  return { name, data: JSON.parse(data.join("\n")) };
}

function jobOutcome(job) {
  // The stream ended without its last event (a proxy cut it): the job's own record says how it went.
  if (job.status === "done" && job.result) return job.result;
  if (job.error) throw new ServerError(null, job.error.error || job.error, null);
  throw new Error(`the progress stream ended while the job was ${job.status}; try again`);
}

// ---------------------------------------------------------------- configuration

async function loadConfig() {
  try {
    state.config = await (await api("v1/config")).json();
    applyConfig(state.config);
  } catch (error) {
    $("model").textContent = error instanceof ServerError && error.status === 401 ? "API key needed" : "not connected";
    showFailure(error, loadConfig);
  }
}

function applyConfig(config) {
  $("model").textContent = [config.model, config.variant].filter(Boolean).join(" · ");
  const steps = $("steps");
  steps.max = config.max_steps || 1000;
  steps.value = Math.min(config.default_steps || steps.value, steps.max);
  $("count").max = maxImages();
  $("guidance-field").hidden = !config.guided;
  if (config.default_guidance_scale) $("guidance").value = config.default_guidance_scale;
  fillSizes(config.max_pixels);
  renderRefs();
}

function fillSizes(maxPixels) {
  const select = $("size");
  select.replaceChildren(new Option("From first reference", "auto"));
  for (const [w, h] of SIZE_PRESETS) {
    const option = new Option(`${w} × ${h}`, `${w}x${h}`);
    option.disabled = Boolean(maxPixels) && w * h > maxPixels;
    select.add(option);
  }
  select.add(new Option("Custom…", "custom"));
}

// ---------------------------------------------------------------- references

function maxImages() {
  return (state.config && state.config.max_images) || MAX_IMAGES;
}

function maxReferences() {
  return (state.config && state.config.max_references) || 4;
}

function addReference(blob, name) {
  if (state.refs.length >= maxReferences()) {
    showProblem(new InputProblem(`This server takes at most ${maxReferences()} references: remove one first.`, "ref-input"));
    return false;
  }
  const ref = { key: state.nextKey++, blob, name, url: URL.createObjectURL(blob), width: 0, height: 0 };
  state.refs.push(ref);
  const probe = new Image();
  probe.onload = () => {
    ref.width = probe.naturalWidth;
    ref.height = probe.naturalHeight;
    renderRefs();
  };
  probe.src = ref.url;
  renderRefs();
  return true;
}

function addFiles(files) {
  clearError();
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      showProblem(new InputProblem(`${file.name} is not an image: choose PNG, JPEG or WebP files.`, "ref-input"));
      continue;
    }
    if (!addReference(file, file.name)) break;
  }
}

function moveReference(index, by, focusClass) {
  const target = index + by;
  if (target < 0 || target >= state.refs.length) return;
  const [ref] = state.refs.splice(index, 1);
  state.refs.splice(target, 0, ref);
  renderRefs();
  const button = $("refs").children[target].querySelector(`.${focusClass}`);
  (button.disabled ? $("refs").children[target].querySelector("button:not([disabled])") : button).focus();
}

function removeReference(index) {
  const [ref] = state.refs.splice(index, 1);
  URL.revokeObjectURL(ref.url);
  renderRefs();
  const items = $("refs").children;
  (items.length ? items[Math.min(index, items.length - 1)].querySelector(".remove") : $("ref-input")).focus();
}

function renderRefs() {
  const list = $("refs");
  list.replaceChildren(...state.refs.map(refItem));
  const count = state.refs.length;
  const full = count >= maxReferences();
  $("ref-count").textContent = `${count} of ${maxReferences()}`;
  $("ref-input").disabled = full;
  $("drop").classList.toggle("full", full);
  $("drop-text").textContent = full ? "Reference limit reached" : "Add reference images";
  const first = state.refs[0];
  const auto = $("size").options[0];
  if (auto) auto.text = first ? `From first reference${first.width ? ` (${first.width} × ${first.height})` : ""}` : "Model default";
}

function refItem(ref, index) {
  const item = element("li", "ref");
  item.draggable = true;
  item.dataset.index = index;
  const img = element("img");
  img.src = ref.url;
  img.alt = `Reference ${index + 1}: ${ref.name}`;
  const label = element("div", "ref-label");
  label.append(element("span", "ref-index", String(index + 1)), element("span", "ref-name", ref.name));
  if (ref.width) label.append(element("span", "ref-size", `${ref.width} × ${ref.height}`));
  const tools = element("div", "ref-tools");
  tools.append(
    iconButton("up", `Move reference ${index + 1} earlier`, index === 0, () => moveReference(index, -1, "up")),
    iconButton("down", `Move reference ${index + 1} later`, index === state.refs.length - 1, () => moveReference(index, 1, "down")),
    iconButton("remove", `Remove reference ${index + 1}`, false, () => removeReference(index)),
  );
  item.append(img, label, tools);
  return item;
}

const ICONS = {
  up: "M12 19V5M6 11l6-6 6 6",
  down: "M12 5v14M6 13l6 6 6-6",
  remove: "M6 6l12 12M18 6L6 18",
};

function iconButton(kind, label, disabled, onClick) {
  const button = element("button", `icon ${kind}`);
  button.type = "button";
  button.setAttribute("aria-label", label);
  button.title = label;
  button.disabled = disabled;
  button.innerHTML = `<svg aria-hidden="true" viewBox="0 0 24 24" width="16" height="16"><path d="${ICONS[kind]}"/></svg>`;
  button.addEventListener("click", onClick);
  return button;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---------------------------------------------------------------- settings

function readSettings() {
  const config = state.config || {};
  const prompt = $("prompt").value.trim();
  if (!prompt) throw new InputProblem("Write a prompt first: what to generate, or how to change the references.", "prompt");
  const body = { prompt, response_format: "b64_json" };
  body.num_inference_steps = wholeNumber("steps", "Steps", 1, config.max_steps || 1000);
  body.n = wholeNumber("count", "Images", 1, maxImages());
  body.seed = $("seed-fixed").checked ? wholeNumber("seed", "The seed", 0, Number.MAX_SAFE_INTEGER) : randomSeed();
  body.size = readSize();
  if (config.guided) body.guidance_scale = Number($("guidance").value);
  return body;
}

function wholeNumber(id, name, low, high) {
  const value = Number($(id).value);
  if (!Number.isInteger(value) || value < low || value > high) {
    throw new InputProblem(`${name} must be a whole number from ${low} to ${high}.`, id);
  }
  return value;
}

function readSize() {
  const choice = $("size").value;
  if (choice !== "custom") return choice;
  const width = wholeNumber("width", "The width", 16, 16384);
  const height = wholeNumber("height", "The height", 16, 16384);
  return `${width}x${height}`;
}

function randomSeed() {
  return crypto.getRandomValues(new Uint32Array(1))[0];
}

function restoreSettings(entry) {
  const body = entry.request;
  $("prompt").value = body.prompt;
  $("steps").value = body.num_inference_steps;
  $("count").value = body.n;
  $("seed").value = entry.seed;
  $("seed-fixed").checked = true;
  syncSeed();
  const size = $("size");
  size.value = [...size.options].some((o) => o.value === body.size) ? body.size : "custom";
  if (size.value === "custom") [$("width").value, $("height").value] = body.size.split("x");
  syncSize();
  $("prompt").focus();
}

function syncSeed() {
  $("seed").disabled = !$("seed-fixed").checked;
}

function syncSize() {
  $("custom-size").hidden = $("size").value !== "custom";
}

// ---------------------------------------------------------------- generating

async function generate() {
  if (state.running) return;
  clearError();
  let body;
  try {
    body = readSettings();
  } catch (problem) {
    showProblem(problem);
    return;
  }
  setRunning(true);
  const refs = state.refs.map((ref) => ({ url: ref.url, name: ref.name }));
  try {
    setStatus("Sending…", null);
    const { job, upload } = await submitJob(body);
    setStatus("Queued", null);
    const result = await followJob(job.id, showProgress);
    const entry = addHistory(body, result, refs, upload);
    if ($("seed-random").checked) $("seed").value = entry.seed;
    showEntry(entry);
    setStatus(`Done in ${formatSeconds(totalSeconds(entry.timings))}`, null);
  } catch (error) {
    setStatus("", null);
    showFailure(error, generate);
  } finally {
    setRunning(false);
  }
}

function showProgress(event) {
  if (event.name === "queued") {
    const ahead = event.data.position;
    setStatus(ahead > 0 ? `Queued: ${ahead} ahead` : "Queued: next", null);
  } else if (event.name === "step") {
    const { step, steps } = event.data;
    setStatus(step >= steps ? `Step ${step} of ${steps}, decoding…` : `Step ${step} of ${steps}`, step / steps);
  }
}

function setStatus(text, fraction) {
  $("status").textContent = text;
  const bar = $("progress");
  bar.hidden = !state.running;
  if (fraction === null) bar.removeAttribute("value");
  else bar.value = fraction;
}

function setRunning(running) {
  state.running = running;
  const button = $("generate");
  button.disabled = running;
  button.textContent = running ? "Generating…" : "Generate";
  $("results-title").closest(".results").classList.toggle("busy", running);
  if (!state.shown) $("empty").textContent = running ? "Working on it: the image appears here as soon as it is decoded." : EMPTY;
  $("progress").hidden = !running;
}

// ---------------------------------------------------------------- results and history

function addHistory(request, result, refs, upload) {
  const klein = result.klein || {};
  const entry = {
    number: state.history.length + 1,
    request,
    refs,
    upload,
    seed: klein.seed ?? request.seed,
    settings: klein.settings || {},
    timings: klein.timings || {},
    references: klein.references || null,
    images: result.data.map((item, index) => pngImage(item.b64_json, request, klein.seed ?? request.seed, index)),
  };
  state.history.push(entry);
  renderHistory();
  return entry;
}

function pngImage(b64, request, seed, index) {
  // The server's PNG bytes exactly as sent, so a download keeps klein's metadata.
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const blob = new Blob([bytes], { type: "image/png" });
  const suffix = request.n > 1 ? `-${index + 1}` : "";
  return { blob, url: URL.createObjectURL(blob), name: `klein-${seed}${suffix}.png` };
}

function showEntry(entry) {
  state.shown = entry;
  const current = $("current");
  current.replaceChildren(imageGrid(entry), entryDetails(entry));
  for (const item of $("history").children) {
    item.querySelector("button").setAttribute("aria-current", String(Number(item.dataset.number) === entry.number));
  }
}

function imageGrid(entry) {
  const grid = element("div", `images count-${Math.min(entry.images.length, 4)}`);
  entry.images.forEach((image, index) => {
    const figure = element("figure", "result");
    const img = element("img");
    img.src = image.url;
    img.alt = `Result ${index + 1} of ${entry.images.length} for “${entry.request.prompt}”`;
    const actions = element("figcaption", "result-actions");
    const use = element("button", "use", "Use as reference");
    use.type = "button";
    use.addEventListener("click", () => useAsReference(image));
    const download = element("a", "button download", entry.images.length > 1 ? "Download" : "Download PNG");
    download.title = "The PNG as the server made it, with klein's settings in its metadata";
    download.href = image.url;
    download.download = image.name;
    actions.append(use, download);
    figure.append(img, actions);
    grid.append(figure);
  });
  return grid;
}

function useAsReference(image) {
  clearError();
  if (addReference(image.blob, image.name)) {
    setStatus(`Added ${image.name} as reference ${state.refs.length}`, null);
    $("prompt").focus();
  }
}

function entryDetails(entry) {
  const details = element("div", "details");
  const settings = entry.settings;
  const size = settings.width && settings.height ? `${settings.width} × ${settings.height}` : entry.request.size;
  const steps = settings.num_inference_steps ?? settings.steps ?? entry.request.num_inference_steps;
  const facts = element("dl", "facts");
  const refs = element("span", "fact-refs");
  refs.append(...entry.refs.map((ref, index) => thumbnail(ref.url, `Reference ${index + 1}: ${ref.name}`)));
  if (!entry.refs.length) refs.textContent = "none";
  for (const [name, value] of [["Size", size], ["Steps", steps], ["Seed", entry.seed], ["References", refs]]) {
    const row = element("div");
    const dd = element("dd");
    dd.append(value);
    row.append(element("dt", null, name), dd);
    facts.append(row);
  }
  const reuse = element("button", "link", "Reuse these settings");
  reuse.type = "button";
  reuse.addEventListener("click", () => restoreSettings(entry));
  details.append(element("p", "prompt-shown", entry.request.prompt), facts, cacheLine(entry), timingChart(entry.timings), reuse);
  return details;
}

function thumbnail(url, alt) {
  const img = element("img", "thumb");
  img.src = url;
  img.alt = alt;
  return img;
}

function cacheLine(entry) {
  const refs = entry.references;
  const line = element("p", "cache");
  if (!refs) {
    line.textContent = "No references: text to image.";
    return line;
  }
  const count = entry.refs.length === 1 ? "1 reference" : `${entry.refs.length} references`;
  if (refs.cache === "hit" && entry.upload && entry.upload.encoded) {
    const took = formatSeconds(entry.upload.seconds);
    line.append(element("span", "badge", "Encoded"), ` ${count} encoded on upload (${took}); the next prompts reuse the encoding`);
  } else if (refs.cache === "hit") {
    line.classList.add("hit");
    line.append(element("span", "badge", "Cache hit"), ` ${count} reused, encoded earlier: saved ${formatSeconds(refs.saved_seconds || 0)}`);
  } else {
    line.append(element("span", "badge", "Encoded"), ` ${count} encoded for this edit`);
  }
  return line;
}

function timingChart(timings) {
  const stages = Object.entries(timings).filter(([name, value]) => name !== "total" && typeof value === "number");
  const total = totalSeconds(timings);
  const chart = element("dl", "timings");
  chart.setAttribute("aria-label", "Time per stage");
  for (const [name, seconds] of stages) {
    const row = element("div", "timing");
    const bar = element("span", "bar");
    bar.style.width = `${total > 0 ? Math.max(1, (100 * seconds) / total) : 0}%`;
    const value = element("dd");
    value.append(bar, element("span", "seconds", formatSeconds(seconds)));
    row.append(element("dt", null, name.replaceAll("_", " ")), value);
    chart.append(row);
  }
  const sum = element("div", "timing total");
  sum.append(element("dt", null, "total"), element("dd", "seconds", formatSeconds(total)));
  chart.append(sum);
  return chart;
}

function totalSeconds(timings) {
  if (typeof timings.total === "number") return timings.total;
  return Object.values(timings).reduce((sum, value) => sum + (typeof value === "number" ? value : 0), 0);
}

function formatSeconds(seconds) {
  return seconds >= 10 ? `${seconds.toFixed(1)} s` : seconds >= 0.01 ? `${seconds.toFixed(2)} s` : `${Math.round(seconds * 1000)} ms`;
}

function renderHistory() {
  $("history-title").hidden = state.history.length === 0;
  const items = [...state.history].reverse().map((entry) => {
    const item = element("li");
    item.dataset.number = entry.number;
    const button = element("button", "history-item");
    button.type = "button";
    const thumb = element("img");
    thumb.src = entry.images[0].url;
    thumb.alt = "";
    const text = element("span", "history-text");
    const refs = entry.refs.length ? ` · ${entry.refs.length} ref${entry.refs.length > 1 ? "s" : ""}` : "";
    text.append(element("span", "history-prompt", entry.request.prompt), element("span", "muted", `#${entry.number} · seed ${entry.seed}${refs}`));
    button.append(thumb, text);
    button.setAttribute("aria-label", `Show result ${entry.number}: ${entry.request.prompt}`);
    button.addEventListener("click", () => showEntry(entry));
    item.append(button);
    return item;
  });
  $("history").replaceChildren(...items);
}

// ---------------------------------------------------------------- errors

const FIELDS = {
  prompt: "prompt", num_inference_steps: "steps", n: "count", seed: "seed", size: "size",
  guidance_scale: "guidance", image: "ref-input", references: "ref-input",
};

// What to do, where the server's own sentence may leave it out.
const ADVICE = {
  upload_too_large: "Use smaller images or fewer references.",
};

function showFailure(error, retry) {
  if (error instanceof InputProblem) return showProblem(error);
  if (error instanceof ServerError && error.status === 401) return askForKey(retry);
  if (!(error instanceof ServerError)) {
    return showError(`Could not reach the server (${error.message}). Is klein serve still running?`, null);
  }
  let text = sentence(error.message);
  if (ADVICE[error.code]) text += ` ${ADVICE[error.code]}`;
  if (error.retryAfter && !/retry/i.test(text)) text += ` Try again in ${error.retryAfter} s.`;
  showError(text, FIELDS[error.param] || (error.code === "upload_too_large" ? "ref-input" : null));
}

function sentence(text) {
  const trimmed = text.trim();
  const capital = trimmed.charAt(0).toUpperCase() + trimmed.slice(1);
  return /[.!?]$/.test(capital) ? capital : `${capital}.`;
}

function showProblem(problem) {
  showError(problem.message, problem.field);
}

function showError(text, field) {
  const box = $("error");
  box.textContent = text;
  box.hidden = false;
  if (field && $(field)) {
    const input = $(field);
    input.setAttribute("aria-invalid", "true");
    input.setAttribute("aria-describedby", "error");
    if (!input.disabled) input.focus();
  }
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
  for (const input of document.querySelectorAll("[aria-invalid]")) {
    input.removeAttribute("aria-invalid");
    input.removeAttribute("aria-describedby");
  }
}

function askForKey(retry) {
  $("auth").hidden = false;
  showError("The server refused the request: it needs an API key.", null);
  $("api-key").focus();
  $("auth").onsubmit = (event) => {
    event.preventDefault();
    state.apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, state.apiKey);
    $("auth").hidden = true;
    clearError();
    retry();
  };
}

// ---------------------------------------------------------------- wiring

function wire() {
  $("form").addEventListener("submit", (event) => {
    event.preventDefault();
    generate();
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      generate();
    }
  });
  $("ref-input").addEventListener("change", (event) => {
    addFiles([...event.target.files]);
    event.target.value = "";
  });
  for (const radio of document.querySelectorAll("input[name=seed-mode]")) radio.addEventListener("change", syncSeed);
  $("size").addEventListener("change", syncSize);
  wireDrops();
}

function wireDrops() {
  const drop = $("drop");
  drop.addEventListener("dragover", (event) => {
    if (![...event.dataTransfer.types].includes("Files")) return;
    event.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    addFiles([...event.dataTransfer.files]);
  });
  document.addEventListener("paste", (event) => {
    const files = [...event.clipboardData.files].filter((file) => file.type.startsWith("image/"));
    if (files.length) addFiles(files);
  });
  wireReorder($("refs"));
}

function wireReorder(list) {
  let from = null;
  list.addEventListener("dragstart", (event) => {
    from = Number(event.target.closest("li").dataset.index);
    event.dataTransfer.effectAllowed = "move";
  });
  list.addEventListener("dragover", (event) => {
    if (from !== null) event.preventDefault();
  });
  list.addEventListener("drop", (event) => {
    const target = event.target.closest("li");
    if (from === null || !target) return;
    event.preventDefault();
    const to = Number(target.dataset.index);
    const [ref] = state.refs.splice(from, 1);
    state.refs.splice(to, 0, ref);
    from = null;
    renderRefs();
  });
  list.addEventListener("dragend", () => {
    from = null;
  });
}

wire();
fillSizes(0);
renderRefs();
loadConfig();
