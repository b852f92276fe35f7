// klein's editing page: references, prompt and settings on the left; live progress, results and their
// history on the right. It speaks only to the server that served it, through the HTTP API
// (/v1/config, /v1/loras, /v1/references, /v1/jobs and the job's events; /v1/images/edits for a repaint), and
// keeps its results, references and mask in the browser across a reload. This module runs one edit end
// to end and wires the page together; each part lives in its own module.
import { $ } from "./dom.js";
import { ServerError, followJob, getJSON, onRetry, postForm, postJSON } from "./api.js";
import { InputProblem, clearError, showFailure } from "./errors.js";
import { loadLoras } from "./loras.js";
import * as mask from "./mask.js";
import * as progress from "./progress.js";
import * as references from "./references.js";
import * as results from "./results.js";
import * as settings from "./settings.js";
import * as storage from "./storage.js";
import * as warmup from "./warmup.js";

const EMPTY = $("empty").textContent;
let connected = false;
let running = false;

const WARMING = "Warming up: the server is compiling the model's programs…";

// A server compiling ahead: said in the status line until it has finished (what an edit shows while it
// waits for it replaces this).
async function sayWarming(over) {
  progress.setStatus(WARMING);
  const config = await over.catch(() => null);
  if (config) progress.knowServer(config);
  if ($("status").textContent === WARMING) progress.setStatus("");
}

async function loadConfig() {
  try {
    const config = await getJSON("v1/config");
    $("model").textContent = [config.model, config.variant].filter(Boolean).join(" · ");
    settings.applyLimits(config);
    references.setLimits(config);
    progress.knowServer(config);
    await loadLoras();
    progress.setStatus("");
    const over = warmup.watch(config);
    if (over) sayWarming(over);
    connected = true;
    showButton();
  } catch (error) {
    const refused = error instanceof ServerError && error.status === 401;
    $("model").textContent = refused ? (error.keySent ? "API key refused" : "API key needed") : "not connected";
    progress.setStatus("");
    showFailure(error, loadConfig);
  }
}

async function generate() {
  if (!connected || running) return;
  clearError();
  let body;
  try {
    body = settings.readSettings();
  } catch (problem) {
    showFailure(problem);
    return;
  }
  const started = performance.now();
  setRunning(true);
  const used = references.current();
  let ok = false;
  try {
    // A painted mask or a strength repaints the source: one multipart edit with the images and the mask.
    const painted = await mask.file();
    const repaint = painted !== null || body.strength !== undefined;
    if (repaint && !used.length) {
      throw new InputProblem("A strength repaints the source, the first reference: add one, or empty Strength.", "strength");
    }
    const waited = await warmup.wait(progress.waitingForWarmUp);
    const { result, upload } = repaint ? await submitRepaint(body, painted) : await submitJob(body);
    const seconds = (performance.now() - started) / 1000 - waited;
    const entry = results.addResult(body, result, used, upload, { seconds, waited }, painted);
    settings.showSeedUsed(entry.seed);
    results.showEntry(entry);
    progress.done(seconds, waited);
    ok = true;
    keep(entry);
  } catch (error) {
    progress.setStatus("");
    showFailure(error, generate);
  } finally {
    setRunning(false, ok);
  }
}

// A job's {result, upload}: its references uploaded as a set if the list changed, then the job followed
// through its events.
async function submitJob(body) {
  const { job, upload } = await submit(body);
  progress.setStatus("Queued");
  return { result: await followJob(job.id, progress.jobEvent), upload };
}

// A repaint's {result, upload}: POST /v1/images/edits with the references as image files (the first is
// the source) and the mask, if one is painted, as OpenAI's mask file; the settings as form fields (the
// LoRAs as JSON text, as the server reads that field).
async function submitRepaint(body, painted) {
  const refs = references.current();
  const form = new FormData();
  const { preview, ...fields } = body; // a repaint is answered whole, not a job: it has no previews
  for (const [name, value] of Object.entries(fields)) form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
  for (const ref of refs) form.append("image", ref.blob, ref.name);
  if (painted) form.append("mask", painted, "mask.png");
  const started = performance.now();
  let sent = started;
  const result = await postForm("v1/images/edits", form, {
    onProgress: (fraction) => progress.uploading(refs.length, fraction),
    onSent: () => {
      sent = performance.now();
      progress.repainting(painted !== null);
    },
  });
  return { result, upload: { id: null, encoded: false, seconds: (sent - started) / 1000 } };
}

// POST /v1/jobs, after uploading the references if their list changed; {job, upload}.
async function submit(body) {
  let upload = null;
  if (references.current().length) {
    upload = await uploadReferences();
    body.references = upload.id;
  }
  try {
    return { job: await postJSON("v1/jobs", body), upload };
  } catch (error) {
    // The server may have dropped the list (a restart, or evicted from its cache): upload it again, once.
    if (!(error instanceof ServerError && error.code === "unknown_reference")) throw error;
    references.forgetUpload();
    upload = await uploadReferences();
    body.references = upload.id;
    return { job: await postJSON("v1/jobs", body), upload };
  }
}

// references.upload(), with the bar following the upload's bytes, then the encoding.
async function uploadReferences() {
  const count = references.current().length;
  if (!references.needsUpload()) progress.setStatus("Sending…");
  return references.upload({
    onProgress: (fraction) => progress.uploading(count, fraction),
    onSent: () => progress.encoding(count),
  });
}

// The result and, once the browser has stored it, the older results dropped to stay within its budget.
async function keep(entry) {
  for (const number of await storage.saveResult(entry)) results.remove(number);
}

function setRunning(now, ok = false) {
  running = now;
  showButton();
  if (now) progress.begin();
  else progress.end(ok);
  $("current").closest(".results").classList.toggle("busy", now);
  if (!results.hasShown()) {
    $("empty").textContent = now ? "Working on it: the image appears here as soon as it is decoded." : EMPTY;
  }
}

function showButton() {
  const button = $("generate");
  button.disabled = !connected || running;
  button.textContent = running ? "Generating…" : "Generate";
}

// The result in place of the source, the first reference: the next edit repaints it. The mask is kept
// (resized if the source's sides were not multiples of 16), to repaint the same area again; Clear
// starts a new one.
async function useAsSource(image) {
  clearError();
  try {
    mask.keepForNextSource(true);
    await references.replaceFirst(image.blob, image.name);
    progress.setStatus(`${image.name} is the source now, reference 1`);
    $("prompt").focus();
  } catch (problem) {
    showFailure(problem);
  } finally {
    mask.keepForNextSource(false);
  }
}

async function useAsReference(image) {
  clearError();
  try {
    const position = await references.addReference(image.blob, image.name);
    progress.setStatus(`Added ${image.name} as reference ${position}`);
    $("prompt").focus();
  } catch (problem) {
    showFailure(problem);
  }
}

function removeResult(entry) {
  results.remove(entry.number);
  storage.deleteResult(entry.number);
  (document.querySelector("#history .history-item") || $("prompt")).focus();
}

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
  settings.wireSettings();
  mask.wireMask();
  references.onChange((list) => {
    settings.showFirstReference(list[0] || null);
    mask.setSource(references.first());
    storage.saveReferences(list);
  });
  references.wireReferences();
  results.onResultActions({
    useAsSource,
    useAsReference,
    reuse: (entry) => settings.restoreSettings(entry.request, entry.seed),
    remove: removeResult,
  });
  onRetry(progress.retrying);
}

// The mask as it is now, kept for a reload; only the latest of overlapping saves is written.
let maskSaves = 0;
async function keepMask() {
  const save = ++maskSaves;
  const painted = await mask.file();
  if (save === maskSaves) storage.saveMask(painted);
}

async function start() {
  wire();
  const saved = await storage.load();
  references.restore(saved.references);
  await mask.restore(saved.mask);
  mask.onChange(keepMask); // from here on: what the last visit kept is read by now
  results.restore(saved.results);
  await loadConfig();
}

start();
