// How the running edit is going, above the results: a status line, which names the server's stage
// (waiting for its warm-up, encoding, compiling, step k of n, decoding) and, at the end, the time taken,
// apart from the wait for a warm-up; the progress bar, which follows the bytes of a reference upload, then
// the denoising steps (a repaint, one request, shows no steps); on a server with previews, the first image
// as it forms (a frame at most each second, decoded by TAEF2); and, once, a notice that a fresh server's
// first request compiles the model's programs and so takes much longer than the ones after it.
import { $, counted, formatSeconds } from "./dom.js";

const NOTICE_AFTER_MS = 3000; // a request this slow on a fresh server is compiling
let compileAhead = false; // the server had finished no job yet, and the notice has not been shown
let noticeTimer = null;

// From /v1/config: whether the server has finished a job since it started, or compiles or compiled ahead
// (then its first request compiles nothing, and an edit waits for the warm-up before it is sent).
export function knowServer(config) {
  compileAhead = config.jobs_done === 0 && !config.warmed && !config.warming;
}

// fraction: 0 to 1 fills the bar; null leaves it moving without a value (waiting, encoding).
export function setStatus(text, fraction = null) {
  $("status").textContent = text;
  const bar = $("progress");
  if (fraction === null) bar.removeAttribute("value");
  else bar.value = fraction;
}

export function begin() {
  $("progress").hidden = false;
  if (compileAhead) noticeTimer = setTimeout(showNotice, NOTICE_AFTER_MS);
}

function showNotice() {
  compileAhead = false;
  $("notice").hidden = false;
}

// ok: the request got its result, so the server's programs are compiled.
export function end(ok) {
  clearTimeout(noticeTimer);
  if (ok) compileAhead = false;
  $("notice").hidden = true;
  $("progress").hidden = true;
  $("preview").hidden = true;
  $("preview").removeAttribute("src");
}

// An edit asked for while the server warms up waits for it, before anything is sent.
export function waitingForWarmUp(seconds) {
  setStatus(`Waiting for the server to warm up (compiling the model's programs) before sending: ${Math.floor(seconds)} s`);
}

// The edit's own time, from sending to the result, and apart from it the wait for the server's warm-up.
export function done(seconds, waited) {
  const took = formatSeconds(seconds);
  setStatus(waited ? `Waited ${formatSeconds(waited)} for the server to warm up; generated in ${took}` : `Done in ${took}`);
}

export function uploading(count, fraction) {
  setStatus(`Uploading ${counted(count, "reference")}: ${Math.round(100 * fraction)}%`, fraction);
}

export function encoding(count) {
  setStatus(`Encoding ${counted(count, "reference")}…`);
}

// A repaint's files are all sent; the server prepares them, encodes and denoises in one request.
export function repainting(masked) {
  setStatus(masked ? "Repainting the masked area…" : "Repainting the source…");
}

// The server's job events: where it is in the queue, then each stage of the pipeline as it starts (and
// when a first run compiles it), then each denoising step.
export function jobEvent(event) {
  if (event.name === "queued") {
    const ahead = event.data.position;
    setStatus(ahead > 0 ? `Queued: ${ahead} ahead` : "Starting…");
  } else if (event.name === "stage") {
    const { stage, label, compiling } = event.data;
    const text = compiling ? `Compiling (first run only): ${label}…` : `${label[0].toUpperCase()}${label.slice(1)}…`;
    setStatus(text, stage.startsWith("decode") ? 1 : null);
  } else if (event.name === "step") {
    const { step, steps } = event.data;
    setStatus(`Step ${step} of ${steps}`, step / steps);
  } else if (event.name === "preview" && event.data.image) {
    const frame = $("preview");
    frame.src = event.data.image;
    frame.hidden = false;
  }
}

// The API's retry policy is waiting before it asks again.
export function retrying({ error, seconds, attempt, of }) {
  const why = error.status === 429 ? "The server is busy" : error.status ? "The server is unavailable" : "No answer from the server";
  setStatus(`${why}: trying again in ${Math.ceil(seconds)} s (${attempt} of ${of})`);
}
