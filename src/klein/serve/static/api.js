// The server's HTTP API as the page uses it: relative URLs (only the server that served the page),
// the API key when one is set, OpenAI-shaped errors as `ServerError`, and a job's server-sent events.

const KEY_STORE = "klein-api-key";
let apiKey = sessionStorage.getItem(KEY_STORE) || "";

export function setApiKey(key) {
  apiKey = key;
  sessionStorage.setItem(KEY_STORE, key);
}

export class ServerError extends Error {
  // status: the HTTP status, or null for a job that failed after it was accepted.
  constructor(status, error, retryAfter) {
    super(error.message);
    this.status = status;
    this.code = error.code || null;
    this.param = error.param || null;
    this.retryAfter = retryAfter;
  }
}

export async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (apiKey) headers.set("Authorization", `Bearer ${apiKey}`);
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

export async function getJSON(path) {
  return (await api(path)).json();
}

export async function postJSON(path, body) {
  const headers = { "Content-Type": "application/json" };
  return (await api(path, { method: "POST", headers, body: JSON.stringify(body) })).json();
}

export async function postForm(path, form) {
  return (await api(path, { method: "POST", body: form })).json();
}

// The job's result, calling onEvent for each queued / step event on the way. Read through fetch
// rather than EventSource, which cannot send the API key.
export async function followJob(id, onEvent) {
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
  return jobOutcome(await getJSON(path));
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
