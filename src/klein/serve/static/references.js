// The reference images of the next edit, in the order the model sees them: thumbnails, reordering
// (buttons, or dragging), removal, adding by file choice, drop or paste. Each image is checked as it is
// added (one the browser can decode, within the server's limits), so a wrong file is refused at once.
// The list travels to the server as one upload (POST /v1/references), whose id is reused for as long
// as the list is unchanged.
import { $, element, formatBytes, iconButton } from "./dom.js";
import { postForm } from "./api.js";
import { InputProblem, clearError, showFailure } from "./errors.js";

const refs = []; // {key, blob, name, url, width, height}; url: the list's own, revoked on removal
let nextKey = 1;
let limits = null; // /v1/config's max_references, max_upload_bytes and max_pixels, once it has said
let uploaded = null; // {keys, id}: the server's id for the list as it was last uploaded
let changed = () => {};

// The list as plain data (the images as blobs), to send, show with a result or keep.
export const current = () => refs.map(({ blob, name, width, height }) => ({ blob, name, width, height }));

// The first reference, the source an edit repaints: {key, url, width, height}, or null. The key names
// this entry of the list for as long as it is in it.
export function first() {
  if (!refs.length) return null;
  const { key, url, width, height } = refs[0];
  return { key, url, width, height };
}

export function setLimits(config) {
  limits = config;
  render();
}

// callback(list) after every change of the list.
export function onChange(callback) {
  changed = callback;
}

// Adds an image (a File, or a result's PNG blob) once it passes the checks; an InputProblem if not.
export async function addReference(blob, name) {
  const { width, height } = await check(blob, name);
  refs.push({ key: nextKey++, blob, name, url: URL.createObjectURL(blob), width, height });
  update();
  return refs.length;
}

// Puts an image (a result's PNG blob) first in the list, in place of the first reference: the source of
// the next edit. Its position (1) once it passes the checks; an InputProblem if not.
export async function replaceFirst(blob, name) {
  const { width, height } = await check(blob, name, refs.length ? 1 : 0);
  const added = { key: nextKey++, blob, name, url: URL.createObjectURL(blob), width, height };
  const [replaced] = refs.splice(0, 1, added);
  if (replaced) URL.revokeObjectURL(replaced.url);
  update();
  return 1;
}

// The list a previous visit left (`current()`'s items), checked when it was added.
export function restore(list) {
  for (const { blob, name, width, height } of list) {
    refs.push({ key: nextKey++, blob, name, url: URL.createObjectURL(blob), width, height });
  }
  update();
}

// {width, height} of an image the server will take; an InputProblem naming what is wrong. `replacing`:
// how many references it takes the place of.
async function check(blob, name, replacing = 0) {
  const refuse = (message) => new InputProblem(message, "ref-input");
  if (!limits) throw refuse("The server's limits are not known yet: wait until the page is connected.");
  if (blob.size > limits.max_upload_bytes) {
    const most = formatBytes(limits.max_upload_bytes);
    throw refuse(`${name} is ${formatBytes(blob.size)}, more than the ${most} this server takes in one upload (--max-upload-bytes).`);
  }
  let bitmap;
  try {
    bitmap = await createImageBitmap(blob);
  } catch {
    throw refuse(`${name} is not an image this browser can read: choose PNG, JPEG or WebP files.`);
  }
  const { width, height } = bitmap;
  bitmap.close();
  if (width * height > limits.max_pixels) {
    throw refuse(`${name} is ${width} × ${height} px, more than the ${limits.max_pixels} px this server takes (--max-pixels).`);
  }
  // Counted last, after the wait for the decoding, when the list is as it will be added to.
  if (refs.length - replacing >= limits.max_references) {
    throw refuse(`This server takes at most ${limits.max_references} references: remove one first.`);
  }
  return { width, height };
}

async function addFiles(files) {
  clearError();
  try {
    for (const file of files) await addReference(file, file.name);
  } catch (problem) {
    showFailure(problem);
  }
}

function move(from, to) {
  const [ref] = refs.splice(from, 1);
  refs.splice(to, 0, ref);
  update();
}

// Keyboard moves keep the focus on the moved item's controls, so the next press moves it again.
function moveByButton(index, by, kind) {
  move(index, index + by);
  const item = $("refs").children[index + by];
  const button = item.querySelector(`.${kind}`);
  (button.disabled ? item.querySelector("button:not([disabled])") : button).focus();
}

function remove(index) {
  const [ref] = refs.splice(index, 1);
  URL.revokeObjectURL(ref.url);
  update();
  const items = $("refs").children;
  (items.length ? items[Math.min(index, items.length - 1)].querySelector(".remove") : $("ref-input")).focus();
}

function update() {
  render();
  changed(current());
}

function render() {
  $("refs").replaceChildren(...refs.map(item));
  const full = Boolean(limits) && refs.length >= limits.max_references;
  $("ref-count").textContent = limits ? `${refs.length} of ${limits.max_references}` : "";
  $("ref-input").disabled = !limits || full;
  $("drop").classList.toggle("full", !limits || full);
  $("drop-text").textContent = full ? `All ${limits.max_references} references added` : "Add reference images";
  $("drop-hint").textContent = full ? "Remove one to add another" : "or drop / paste them here";
}

function item(ref, index) {
  const li = element("li", "ref");
  li.draggable = true;
  li.dataset.index = index;
  const img = element("img");
  img.src = ref.url;
  img.alt = `Reference ${index + 1}: ${ref.name}`;
  const label = element("div", "ref-label");
  label.append(element("span", "ref-index", String(index + 1)), element("span", "ref-name", ref.name));
  label.append(element("span", "ref-size", `${ref.width} × ${ref.height}`));
  const tools = element("div", "ref-tools");
  const last = index === refs.length - 1;
  tools.append(
    iconButton("up", `Move reference ${index + 1} earlier`, index === 0, () => moveByButton(index, -1, "up")),
    iconButton("down", `Move reference ${index + 1} later`, last, () => moveByButton(index, 1, "down")),
    iconButton("remove", `Remove reference ${index + 1}`, false, () => remove(index)),
  );
  li.append(img, label, tools);
  return li;
}

// ---------------------------------------------------------------- the upload

const listKeys = () => refs.map((ref) => ref.key).join(",");

export function needsUpload() {
  return refs.length > 0 && !(uploaded && uploaded.keys === listKeys());
}

export function forgetUpload() {
  uploaded = null;
}

// The list's id on the server. The server encodes a new list when it is uploaded, so the answer also
// says whether this upload paid for the encoding (`encoded`) and how long the upload and the encoding
// took, seen from here. progress: postForm's {onProgress, onSent}.
export async function upload(progress) {
  const keys = listKeys();
  if (uploaded && uploaded.keys === keys) return { id: uploaded.id, encoded: false, seconds: 0 };
  const form = new FormData();
  for (const ref of refs) form.append("image", ref.blob, ref.name);
  const started = performance.now();
  const answer = await postForm("v1/references", form, progress);
  uploaded = { keys, id: answer.id };
  return { id: answer.id, encoded: !answer.cached, seconds: (performance.now() - started) / 1000 };
}

// ---------------------------------------------------------------- wiring

export function wireReferences() {
  $("ref-input").addEventListener("change", (event) => {
    addFiles([...event.target.files]);
    event.target.value = "";
  });
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
    const files = [...event.clipboardData.files];
    if (files.length) addFiles(files);
  });
  wireReorder($("refs"));
  render();
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
    move(from, Number(target.dataset.index));
    from = null;
  });
  list.addEventListener("dragend", () => {
    from = null;
  });
}
