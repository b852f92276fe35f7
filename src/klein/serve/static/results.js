// Results: the shown one (images with "Use as source", "Use as reference" and "Download PNG", its
// settings and, for a repaint, its strength and mask, whether
// the references came from the cache, the time of each stage) and the history of them. An entry is
// plain data, its images and references as blobs, so that it can be kept across a reload; the object
// URLs that show them are made here when first shown and revoked when the entry is removed.
import { $, counted, element, formatSeconds, iconButton, thumbnail } from "./dom.js";

const EMPTY = $("empty"); // the note shown while there is no result
const history = []; // oldest first
const urls = new WeakMap(); // an image of an entry ({blob, name}) -> its object URL
let nextNumber = 1;
let shown = null;
let actions = { useAsSource: () => {}, useAsReference: () => {}, reuse: () => {}, remove: () => {} };

// useAsSource(image {blob, name}), useAsReference(image), reuse(entry) and remove(entry) are what the
// buttons do.
export function onResultActions(callbacks) {
  actions = callbacks;
}

export const hasShown = () => shown !== null;

// A finished job as a history entry: what was asked (request), what ran (the response's `klein`),
// the references it used (refs: {blob, name, width, height}), what their upload did (upload, or null),
// its time (seconds: from sending to the result, upload, queue and transfer included; waited: the
// seconds it waited, before that, for the server's warm-up) and, for a repaint with a mask, the mask
// sent (a PNG blob).
export function addResult(request, result, refs, upload, { seconds, waited }, mask = null) {
  const klein = result.klein || {};
  const seed = klein.seed ?? request.seed;
  const entry = {
    number: nextNumber++,
    request,
    refs,
    mask: mask && { blob: mask, name: "mask.png" },
    upload,
    seconds,
    waited,
    seed,
    settings: klein.settings || {},
    timings: klein.timings || {},
    references: klein.references || null,
    warnings: klein.warnings || [],
    stepCache: klein.step_cache || null,
    images: result.data.map((item, index) => pngImage(item.b64_json, request.n > 1 ? `-${index + 1}` : "", seed)),
  };
  history.push(entry);
  renderHistory();
  return entry;
}

function pngImage(b64, suffix, seed) {
  // The server's PNG bytes exactly as sent, so a download keeps klein's metadata.
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return { blob: new Blob([bytes], { type: "image/png" }), name: `klein-${seed}${suffix}.png` };
}

// The entries a previous visit left, oldest first; the newest is shown.
export function restore(entries) {
  history.push(...entries);
  nextNumber = Math.max(nextNumber, ...entries.map((entry) => entry.number + 1));
  renderHistory();
  if (entries.length) showEntry(history.at(-1));
}

export function remove(number) {
  const index = history.findIndex((entry) => entry.number === number);
  if (index < 0) return;
  const [entry] = history.splice(index, 1);
  if (shown === entry) showNothing();
  renderHistory();
  for (const image of [...entry.images, ...entry.refs, ...(entry.mask ? [entry.mask] : [])]) {
    if (urls.has(image)) URL.revokeObjectURL(urls.get(image));
  }
}

function showNothing() {
  shown = null;
  $("current").replaceChildren(EMPTY);
}

function urlOf(image) {
  if (!urls.has(image)) urls.set(image, URL.createObjectURL(image.blob));
  return urls.get(image);
}

export function showEntry(entry) {
  shown = entry;
  $("current").replaceChildren(imageGrid(entry), details(entry));
  for (const item of $("history").children) {
    item.querySelector(".history-item").setAttribute("aria-current", String(Number(item.dataset.number) === entry.number));
  }
}

function imageGrid(entry) {
  const several = entry.images.length > 1;
  const grid = element("div", `images count-${Math.min(entry.images.length, 4)}`);
  entry.images.forEach((image, index) => {
    const figure = element("figure", "result");
    const img = thumbnail(urlOf(image), `Result ${index + 1} of ${entry.images.length} for “${entry.request.prompt}”`, "");
    const buttons = element("figcaption", "result-actions");
    const source = element("button", "use-source", "Use as source");
    source.type = "button";
    source.title = "Put this image first in the references, in place of the source: the next edit repaints it";
    source.addEventListener("click", () => actions.useAsSource(image));
    const use = element("button", "use", "Use as reference");
    use.type = "button";
    use.title = "Add this image at the end of the references";
    use.addEventListener("click", () => actions.useAsReference(image));
    const download = element("a", "button download", several ? "Download" : "Download PNG");
    download.title = "The PNG as the server made it, with klein's settings in its metadata";
    download.href = urlOf(image);
    download.download = image.name;
    buttons.append(source, use, download);
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
  const parts = [facts(entry), ...warningLines(entry), cacheLine(entry), ...warmUpLine(entry), timingChart(entry)];
  box.append(element("p", "prompt-shown", entry.request.prompt), ...parts, reuse);
  return box;
}

// What the server changed or ignored of the request (a size rounded down, guidance on a distilled model).
function warningLines(entry) {
  return (entry.warnings || []).map((text) => element("p", "warning", text));
}

function facts(entry) {
  const { settings, request } = entry;
  const size = settings.width && settings.height ? `${settings.width} × ${settings.height}` : request.size;
  const refs = element("span", "fact-refs");
  refs.append(...entry.refs.map((ref, index) => thumbnail(urlOf(ref), `Reference ${index + 1}: ${ref.name}`)));
  if (!entry.refs.length) refs.textContent = "none";
  const list = element("dl", "facts");
  const rows = [["Size", size], ["Steps", settings.num_inference_steps ?? request.num_inference_steps], ["Seed", entry.seed], ["References", refs]];
  if (settings.strength !== undefined && settings.strength !== null) rows.push(["Strength", String(settings.strength)], ["Mask", maskFact(entry)]);
  if (entry.stepCache) rows.push(["Step cache", stepCacheFact(entry.stepCache)]);
  if (request.loras) rows.push(["LoRAs", request.loras.map((lora) => `${lora.name} × ${lora.scale}`).join(", ")]);
  for (const [name, value] of rows) {
    const row = element("div");
    const dd = element("dd");
    dd.append(value);
    row.append(element("dt", null, name), dd);
    list.append(row);
  }
  return list;
}

// What the step cache computed: each block group's passes run of those the steps asked for.
function stepCacheFact({ passes, computed }) {
  return `double blocks ${computed.double} of ${passes} passes, single blocks ${computed.single} of ${passes}`;
}

// A repaint's mask as sent (transparent: repainted), or what ran without one.
function maskFact(entry) {
  if (!entry.mask) return "none: image to image";
  const fact = element("span", "fact-mask");
  fact.append(thumbnail(urlOf(entry.mask), "The mask sent: its transparent pixels were repainted"));
  return fact;
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

// An edit asked for while the server warmed up waited for it before it was sent: that wait is the
// server's start, not the edit's time, so it is told apart from the stages below.
function warmUpLine(entry) {
  if (!entry.waited) return [];
  const line = element("p", "waited");
  line.append(element("span", "badge", "Warm-up"), ` Waited ${formatSeconds(entry.waited)} for the server to compile its programs before sending; the times below are this edit's own`);
  return [line];
}

// The server's stages, after the upload when this edit uploaded its references; the total is the time
// from sending to the result, as the status line says (after a wait for the warm-up, if any).
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
  sum.title = "From sending to the image: upload, queue and transfer included";
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
  button.append(thumbnail(urlOf(entry.images[0]), "", ""), text);
  item.append(button, iconButton("remove", `Remove result ${entry.number}`, false, () => actions.remove(entry)));
  return item;
}
