// The server's HTTP API as the page uses it: relative URLs (only the server that served the page),
// the API key when one is set, OpenAI-shaped errors as `ServerError`, uploads that report their
// progress, a job's server-sent events, and the one retry policy that every request goes through.

const KEY_STORE = "klein-api-key";
let apiKey = sessionStorage.getItem(KEY_STORE) || "";

export function setApiKey(key) {
  apiKey = key;
  sessionStorage.setItem(KEY_STORE, key);
}

export class ServerError extends Error {
  // status: the HTTP status, or null for a job that failed after it was accepted; keySent: whether the
  // request carried an API key (a 401 then means a wrong key rather than none).
  constructor(status, error, retryAfter, keySent = false) {
    super(error.message);
    this.status = status;
    this.code = error.code || null;
    this.param = error.param || null;
    this.retryAfter = retryAfter;
    this.keySent = keySent;
  }
}

// No answer at all: the server is not running, or the connection broke.
export class NetworkError extends Error {}

// ---------------------------------------------------------------- the retry policy

// A full queue (429) or a server going away (503) that says when to come back (Retry-After, at most
// LONGEST_WAIT seconds) is asked again then; a request that got no answer, after 1, 2, then 4 s.
// Anything else is the caller's to show. onRetry's callback hears of each wait, to say so.
const RETRIES = 3;
const LONGEST_WAIT = 30;
let announce = () => {};

export function onRetry(callback) {
  announce = callback;
}

// Seconds to wait before trying again after `error` on try number `attempt` (0 first), or null.
function retryDelay(error, attempt) {
  if (attempt >= RETRIES) return null;
  if (error instanceof NetworkError) return 2 ** attempt;
  if (!(error instanceof ServerError && (error.status === 429 || error.status === 503))) return null;
  const seconds = retryAfterSeconds(error.retryAfter);
  return seconds !== null && seconds <= LONGEST_WAIT ? seconds : null;
}

function retryAfterSeconds(header) {
  if (!header) return null;
  const text = header.trim();
  const seconds = /^\d+$/.test(text) ? Number(text) : (Date.parse(text) - Date.now()) / 1000;
  return Number.isFinite(seconds) ? Math.max(0, seconds) : null;
}

async function retrying(send) {
  for (let attempt = 0; ; attempt++) {
    try {
      return await send();
    } catch (error) {
      const seconds = retryDelay(error, attempt);
      if (seconds === null) throw error;
      announce({ error, seconds, attempt: attempt + 1, of: RETRIES });
      await new Promise((resolve) => setTimeout(resolve, seconds * 1000));
    }
  }
}

// ---------------------------------------------------------------- requests

// One try: the response, a ServerError for a refusal, or a NetworkError for no answer.
async function once(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey;
  if (key) headers.set("Authorization", `Bearer ${key}`);
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (error) {
    throw new NetworkError(error.message);
  }
  if (!response.ok) {
    const body = await response.json().catch(() => null); // not JSON: a proxy's page, say
    throw serverError(response.status, response.statusText, body, response.headers.get("Retry-After"), Boolean(key));
  }
  return response;
}

function serverError(status, statusText, body, retryAfter, keySent) {
  const error = body && body.error && body.error.message ? body.error : { message: `The server answered ${status} ${statusText}.` };
  return new ServerError(status, error, retryAfter, keySent);
}

export async function getJSON(path) {
  return retrying(async () => (await once(path)).json());
}

export async function postJSON(path, body) {
  const options = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  return retrying(async () => (await once(path, options)).json());
}

// POST a multipart form, its JSON answer. Sent through XMLHttpRequest, whose upload reports progress
// (fetch's does not): onProgress(fraction of the bytes sent), then onSent() once the server has them all.
export async function postForm(path, form, { onProgress, onSent }) {
  return retrying(() => sendForm(path, form, onProgress, onSent));
}

function sendForm(path, form, onProgress, onSent) {
  return new Promise((resolve, reject) => {
    const request = new XMLHttpRequest();
    request.open("POST", path);
    const key = apiKey;
    if (key) request.setRequestHeader("Authorization", `Bearer ${key}`);
    request.responseType = "json";
    request.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress(event.loaded / event.total);
    });
    request.upload.addEventListener("load", onSent);
    request.addEventListener("error", () => reject(new NetworkError("the upload got no answer")));
    request.addEventListener("load", () => {
      if (request.status >= 200 && request.status < 300) return resolve(request.response);
      const retryAfter = request.getResponseHeader("Retry-After");
      reject(serverError(request.status, request.statusText, request.response, retryAfter, Boolean(key)));
    });
    request.send(form);
  });
}

// ---------------------------------------------------------------- a job's events

// The job's result, calling onEvent for each queued / step event on the way. Read through fetch
// rather than EventSource, which cannot send the API key. A stream that breaks is opened again (the
// retry policy's network errors); the server sends the job's events from the start each time.
export async function followJob(id, onEvent) {
  const path = `v1/jobs/${encodeURIComponent(id)}`;
  return retrying(() => follow(path, onEvent));
}

async function follow(path, onEvent) {
  const response = await once(`${path}/events`, { headers: { Accept: "text/event-stream" } });
  for await (const event of events(response)) {
    if (event.name === "done") return event.data;
    if (event.name === "error") throw new ServerError(null, event.data.error || event.data, null);
    onEvent(event);
  }
  return jobOutcome(await (await once(path)).json());
}

async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read().catch((error) => {
      throw new NetworkError(error.message);
    });
    if (done) return;
    buffer = (buffer + value).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = parseEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (event.name) yield event;
    }
  }
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
  // The stream ended without its last event (a proxy cut it): the job's own record says how it went,
  // or, while it still runs, the stream is opened again.
  if (job.status === "done" && job.result) return job.result;
  if (job.error) throw new ServerError(null, job.error.error || job.error, null);
  throw new NetworkError(`the progress stream ended while the job was ${job.status}`);
}
