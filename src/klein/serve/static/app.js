// klein's editing page: references, prompt and settings on the left; live progress, results and the
// session's history on the right. It speaks only to the server that served it, through the HTTP API
// (/v1/config, /v1/references, /v1/jobs and the job's events). This module runs one edit end to end
// and wires the page together; each part lives in its own module.
import { $, counted, formatSeconds } from "./dom.js";
import { ServerError, followJob, getJSON, postJSON } from "./api.js";
import { clearError, showFailure } from "./errors.js";
import * as references from "./references.js";
import * as results from "./results.js";
import * as settings from "./settings.js";

const EMPTY = $("empty").textContent;
let connected = false;
let running = false;

async function loadConfig() {
  try {
    const config = await getJSON("v1/config");
    $("model").textContent = [config.model, config.variant].filter(Boolean).join(" · ");
    settings.applyLimits(config);
    references.setLimits(config);
    connected = true;
    showButton();
  } catch (error) {
    $("model").textContent = error instanceof ServerError && error.status === 401 ? "API key needed" : "not connected";
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
  setRunning(true);
  const used = references.current().map((ref) => ({ url: ref.url, name: ref.name }));
  try {
    const { job, upload } = await submit(body);
    setStatus("Queued", null);
    const entry = results.addResult(body, await followJob(job.id, showProgress), used, upload);
    settings.showSeedUsed(entry.seed);
    results.showEntry(entry);
    setStatus(`Done in ${formatSeconds(results.totalSeconds(entry.timings))}`, null);
  } catch (error) {
    setStatus("", null);
    showFailure(error, generate);
  } finally {
    setRunning(false);
  }
}

// POST /v1/jobs, after uploading the references if their list changed; {job, upload}.
async function submit(body) {
  const count = references.current().length;
  let upload = null;
  if (count) {
    setStatus(references.needsUpload() ? `Uploading and encoding ${counted(count, "reference")}…` : "Sending…", null);
    upload = await references.upload();
    body.references = upload.id;
  }
  try {
    return { job: await postJSON("v1/jobs", body), upload };
  } catch (error) {
    // The server may have dropped the list (a restart, or evicted from its cache): upload it again, once.
    if (!(error instanceof ServerError && error.code === "unknown_reference")) throw error;
    references.forgetUpload();
    upload = await references.upload();
    body.references = upload.id;
    return { job: await postJSON("v1/jobs", body), upload };
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
  if (fraction === null) bar.removeAttribute("value");
  else bar.value = fraction;
}

function setRunning(now) {
  running = now;
  showButton();
  $("progress").hidden = !now;
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

async function useAsReference(image) {
  clearError();
  try {
    const position = await references.addReference(image.blob, image.name);
    setStatus(`Added ${image.name} as reference ${position}`, null);
    $("prompt").focus();
  } catch (problem) {
    showFailure(problem);
  }
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
  references.onChange(settings.showFirstReference);
  references.wireReferences();
  results.onResultActions({ useAsReference, reuse: (entry) => settings.restoreSettings(entry.request, entry.seed) });
}

wire();
loadConfig();
