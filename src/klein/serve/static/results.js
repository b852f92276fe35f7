// Results: the shown one (images with "Use as reference" and "Download PNG", its settings, whether
// the references came from the cache, the time of each stage) and the session's history of them.
import { $, counted, element, formatSeconds, thumbnail } from "./dom.js";

const history = []; // oldest first
let shown = null;
let actions = { useAsReference: () => {}, reuse: () => {} };

// useAsReference(image {blob, url, name}) and reuse(entry) are what the result's buttons do.
export function onResultActions(callbacks) {
  actions = callbacks;
}

export const hasShown = () => shown !== null;

// A finished job as a history entry: what was asked (request), what ran (the response's `klein`),
// the references it used (refs: {url, name}), what their upload did (upload, or null) and the seconds
// from Generate to the result (upload, queue and transfer included).
export function addResult(request, result, refs, upload, seconds) {
  const klein = result.klein || {};
  const seed = klein.seed ?? request.seed;
  const entry = {
    number: history.length + 1,
    request,
    refs,
    upload,
    seconds,
    seed,
    settings: klein.settings || {},
    timings: klein.timings || {},
    references: klein.references || null,
    images: result.data.map((item, index) => pngImage(item.b64_json, request.n > 1 ? `-${index + 1}` : "", seed)),
  };
  history.push(entry);
  renderHistory();
  return entry;
}

function pngImage(b64, suffix, seed) {
  // The server's PNG bytes exactly as sent, so a download keeps klein's metadata.
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const blob = new Blob([bytes], { type: "image/png" });
  return { blob, url: URL.createObjectURL(blob), name: `klein-${seed}${suffix}.png` };
}

export function showEntry(entry) {
  shown = entry;
  $("current").replaceChildren(imageGrid(entry), details(entry));
  for (const item of $("history").children) {
    item.querySelector("button").setAttribute("aria-current", String(Number(item.dataset.number) === entry.number));
  }
}

function imageGrid(entry) {
  const several = entry.images.length > 1;
  const grid = element("div", `images count-${Math.min(entry.images.length, 4)}`);
  entry.images.forEach((image, index) => {
    const figure = element("figure", "result");
    const img = thumbnail(image.url, `Result ${index + 1} of ${entry.images.length} for “${entry.request.prompt}”`, "");
    const buttons = element("figcaption", "result-actions");
    const use = element("button", "use", "Use as reference");
    use.type = "button";
    use.addEventListener("click", () => actions.useAsReference(image));
    const download = element("a", "button download", several ? "Download" : "Download PNG");
    download.title = "The PNG as the server made it, with klein's settings in its metadata";
    download.href = image.url;
    download.download = image.name;
    buttons.append(use, download);
    figure.append(img, buttons);
    grid.append(figure);
  });
  return grid;
}

function details(entry) {
  const box = element("div", "details");
  const reuse = element("button", "link", "Reuse these settings");
  reuse.type = "button";
  reuse.addEventListener("click", () => actions.reuse(entry));
  box.append(element("p", "prompt-shown", entry.request.prompt), facts(entry), cacheLine(entry), timingChart(entry), reuse);
  return box;
}

function facts(entry) {
  const { settings, request } = entry;
  const size = settings.width && settings.height ? `${settings.width} × ${settings.height}` : request.size;
  const refs = element("span", "fact-refs");
  refs.append(...entry.refs.map((ref, index) => thumbnail(ref.url, `Reference ${index + 1}: ${ref.name}`)));
  if (!entry.refs.length) refs.textContent = "none";
  const list = element("dl", "facts");
  const rows = [["Size", size], ["Steps", settings.num_inference_steps ?? request.num_inference_steps], ["Seed", entry.seed], ["References", refs]];
  for (const [name, value] of rows) {
    const row = element("div");
    const dd = element("dd");
    dd.append(value);
    row.append(element("dt", null, name), dd);
    list.append(row);
  }
  return list;
}

// The server reports a hit whenever the job found its references encoded; the page adds what it saw:
// whether this edit's own upload did the encoding (the first edit of a new list).
function cacheLine(entry) {
  const refs = entry.references;
  const line = element("p", "cache");
  if (!refs) {
    line.textContent = "No references: text to image.";
    return line;
  }
  const count = counted(entry.refs.length, "reference");
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

// The server's stages, after the upload when this edit uploaded its references; the total is the time
// from Generate to the result, as "Done in" says.
function timingChart(entry) {
  const stages = Object.entries(entry.timings).filter(([name, value]) => name !== "total" && typeof value === "number");
  if (entry.upload && entry.upload.seconds) stages.unshift(["upload", entry.upload.seconds]);
  const total = entry.seconds;
  const chart = element("dl", "timings");
  chart.setAttribute("aria-label", "Time per stage");
  for (const [name, seconds] of stages) {
    const row = element("div", "timing");
    const bar = element("span", "bar");
    bar.style.width = `${total > 0 ? Math.min(100, Math.max(1, (100 * seconds) / total)) : 0}%`;
    const value = element("dd");
    value.append(bar, element("span", "seconds", formatSeconds(seconds)));
    row.append(element("dt", null, name.replaceAll("_", " ")), value);
    chart.append(row);
  }
  const sum = element("div", "timing total");
  sum.title = "From Generate to the image: upload, queue and transfer included";
  sum.append(element("dt", null, "total"), element("dd", "seconds", formatSeconds(total)));
  chart.append(sum);
  return chart;
}

function renderHistory() {
  $("history-title").hidden = history.length === 0;
  $("history").replaceChildren(...[...history].reverse().map(historyItem));
}

function historyItem(entry) {
  const item = element("li");
  item.dataset.number = entry.number;
  const button = element("button", "history-item");
  button.type = "button";
  button.setAttribute("aria-label", `Show result ${entry.number}: ${entry.request.prompt}`);
  button.addEventListener("click", () => showEntry(entry));
  const text = element("span", "history-text");
  const refs = entry.refs.length ? ` · ${counted(entry.refs.length, "ref")}` : "";
  text.append(element("span", "history-prompt", entry.request.prompt), element("span", "muted", `#${entry.number} · seed ${entry.seed}${refs}`));
  button.append(thumbnail(entry.images[0].url, "", ""), text);
  item.append(button);
  return item;
}
