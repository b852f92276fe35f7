// The inpainting mask, painted over the source: the first reference, the image an edit repaints. A
// brush (mouse, pen or touch, through pointer events) paints or erases; Clear and Invert act on the
// whole mask, which shows as a translucent overlay on the image. The canvas holds the mask at the
// source's natural pixel size, whatever size it is shown at; it leaves as OpenAI's kind of mask, a PNG
// of that size whose fully transparent pixels are the painted ones (repaint) and the rest opaque
// (keep). With nothing painted there is no mask, and the edit is a plain one.
import { $ } from "./dom.js";

const PAINTED = 128; // the alpha from which a pixel counts as painted (the brush's edge is antialiased)
const COLOUR = "#ff2d6f"; // of the strokes; the canvas itself is translucent (style.css)
const TALLEST = 300; // px: the source is shown as wide as the panel, at most this tall
let source = null; // {key, url, width, height}: the first reference, or null
let carry = false; // the next source keeps this mask ("Use as source": a result of this source)
let stroke = null; // {id, x, y}: the pointer that draws and its last point, in mask pixels
let painted = 0; // the share of the mask painted, as of the last change
let changed = () => {};

const canvas = () => $("mask-canvas");
const context = () => canvas().getContext("2d", { willReadFrequently: true });

// callback(share painted, 0 to 1) after every change of the mask.
export function onChange(callback) {
  changed = callback;
}

export const hasMask = () => painted > 0;

// The first reference ({key, url, width, height}) or null. A new source starts with an empty mask,
// unless keepForNextSource() said otherwise: then the mask is kept, resized to it if it differs.
export function setSource(reference) {
  if (reference && source && reference.key === source.key) return;
  const keep = carry && reference && source && hasMask();
  carry = false;
  const old = keep ? copy(canvas()) : null;
  source = reference;
  $("mask-editor").hidden = !reference;
  $("mask-empty").hidden = Boolean(reference);
  if (!reference) {
    canvas().width = canvas().height = 0;
    return update();
  }
  // Shown at the panel's width (small sources enlarged), the canvas over it in the same box.
  const stage = $("mask-stage");
  stage.style.aspectRatio = `${reference.width} / ${reference.height}`;
  stage.style.width = `min(100%, ${(TALLEST * reference.width) / reference.height}px)`;
  $("mask-image").src = reference.url;
  $("mask-image").alt = `The source to repaint: reference 1, ${reference.width} × ${reference.height}`;
  canvas().width = reference.width; // also clears it
  canvas().height = reference.height;
  if (old) context().drawImage(old, 0, 0, reference.width, reference.height);
  update();
}

// keep: whether the next source keeps this mask (true just before a result replaces the source, false
// once that is done or refused).
export function keepForNextSource(keep) {
  carry = keep;
}

function copy(from) {
  const to = document.createElement("canvas");
  to.width = from.width;
  to.height = from.height;
  to.getContext("2d").drawImage(from, 0, 0);
  return to;
}

export function clear() {
  context().clearRect(0, 0, canvas().width, canvas().height);
  update();
}

// Painted becomes kept and kept painted.
export function invert() {
  const { width, height } = canvas();
  if (!width) return;
  const image = context().getImageData(0, 0, width, height);
  const [r, g, b] = [1, 3, 5].map((at) => parseInt(COLOUR.slice(at, at + 2), 16));
  const data = image.data;
  for (let i = 0; i < data.length; i += 4) {
    data[i] = r;
    data[i + 1] = g;
    data[i + 2] = b;
    data[i + 3] = 255 - data[i + 3];
  }
  context().putImageData(image, 0, 0);
  update();
}

// The mask to send: a PNG Blob at the source's size, transparent where painted; null if nothing is.
export async function file() {
  const { width, height } = canvas();
  if (!width || !hasMask()) return null;
  const painting = context().getImageData(0, 0, width, height).data;
  const mask = new ImageData(width, height); // transparent black
  for (let i = 3; i < painting.length; i += 4) mask.data[i] = painting[i] >= PAINTED ? 0 : 255;
  const out = document.createElement("canvas");
  out.width = width;
  out.height = height;
  out.getContext("2d").putImageData(mask, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

// A mask a previous visit kept (file()'s PNG), put back if it fits the source.
export async function restore(blob) {
  if (!source || !blob) return;
  const bitmap = await createImageBitmap(blob).catch(() => null);
  if (!bitmap) return;
  if (bitmap.width === source.width && bitmap.height === source.height) {
    // file()'s transparent pixels are the painted ones: paint where the kept mask has no alpha.
    const kept = copy(bitmap);
    context().fillStyle = COLOUR;
    context().fillRect(0, 0, source.width, source.height);
    context().globalCompositeOperation = "destination-out";
    context().drawImage(kept, 0, 0);
    context().globalCompositeOperation = "source-over";
    update();
  }
  bitmap.close();
}

function update() {
  painted = share();
  const percent = painted > 0 ? Math.max(1, Math.round(100 * painted)) : 0;
  $("mask-count").textContent = source ? (painted ? `${percent}% painted` : "none") : "";
  $("mask-hint").textContent = painted
    ? "Generate repaints the painted area of the source and keeps the rest."
    : "Paint where the source should change; with nothing painted, Generate edits the whole image.";
  $("mask-clear").disabled = !painted;
  changed(painted);
}

function share() {
  const { width, height } = canvas();
  if (!width) return 0;
  const data = context().getImageData(0, 0, width, height).data;
  let count = 0;
  for (let i = 3; i < data.length; i += 4) if (data[i] >= PAINTED) count++;
  return count / (width * height);
}

// ---------------------------------------------------------------- the brush

// A pointer event's position in mask pixels.
function point(event) {
  const box = canvas().getBoundingClientRect();
  return {
    x: ((event.clientX - box.left) * canvas().width) / box.width,
    y: ((event.clientY - box.top) * canvas().height) / box.height,
  };
}

// The brush's diameter in mask pixels: the slider gives it in pixels of the image as shown.
function brushWidth() {
  const box = canvas().getBoundingClientRect();
  return (Number($("brush-size").value) * canvas().width) / Math.max(1, box.width);
}

function draw(from, to) {
  const ctx = context();
  ctx.globalCompositeOperation = $("brush-erase").checked ? "destination-out" : "source-over";
  ctx.strokeStyle = ctx.fillStyle = COLOUR;
  ctx.lineWidth = brushWidth();
  ctx.lineCap = ctx.lineJoin = "round";
  ctx.beginPath();
  if (from.x === to.x && from.y === to.y) {
    ctx.arc(to.x, to.y, ctx.lineWidth / 2, 0, 2 * Math.PI);
    ctx.fill();
  } else {
    ctx.moveTo(from.x, from.y);
    ctx.lineTo(to.x, to.y);
    ctx.stroke();
  }
  ctx.globalCompositeOperation = "source-over";
}

function showRing(event) {
  const ring = $("brush-ring");
  const box = canvas().getBoundingClientRect();
  const size = Number($("brush-size").value);
  ring.hidden = false;
  ring.style.width = ring.style.height = `${size}px`;
  ring.style.left = `${event.clientX - box.left - size / 2}px`;
  ring.style.top = `${event.clientY - box.top - size / 2}px`;
}

function wireBrush(surface) {
  surface.addEventListener("pointerdown", (event) => {
    if (event.button !== 0 || stroke) return;
    event.preventDefault();
    surface.setPointerCapture(event.pointerId);
    const at = point(event);
    stroke = { id: event.pointerId, ...at };
    draw(at, at);
  });
  surface.addEventListener("pointermove", (event) => {
    if (event.pointerType !== "touch") showRing(event);
    if (!stroke || event.pointerId !== stroke.id) return;
    const moves = event.getCoalescedEvents ? event.getCoalescedEvents() : [];
    for (const each of moves.length ? moves : [event]) {
      const at = point(each);
      draw(stroke, at);
      Object.assign(stroke, at);
    }
  });
  const end = (event) => {
    if (!stroke || event.pointerId !== stroke.id) return;
    stroke = null;
    update();
  };
  surface.addEventListener("pointerup", end);
  surface.addEventListener("pointercancel", end);
  surface.addEventListener("lostpointercapture", end);
  surface.addEventListener("pointerleave", () => {
    $("brush-ring").hidden = true;
  });
}

export function wireMask() {
  wireBrush(canvas());
  $("mask-clear").addEventListener("click", clear);
  $("mask-invert").addEventListener("click", invert);
  setSource(null);
}
