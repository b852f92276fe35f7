// The settings of the next edit: prompt, size (the first reference's, a preset or custom), steps,
// strength (empty: the server's default), number of images, seed (random or fixed), the LoRAs picked
// (loras.js), on base models guidance, and the step cache (off, the recipe, or a threshold). Limits and
// defaults come from
// /v1/config; the size presets are choices, those larger than the server makes disabled.
import { $ } from "./dom.js";
import { InputProblem } from "./errors.js";
import { readLoras, restoreLoras } from "./loras.js";

const SIZE_PRESETS = [
  [256, 256], [512, 512], [768, 768], [1024, 1024], [1024, 768], [768, 1024], [1280, 720], [720, 1280],
];
let limits = null; // /v1/config, once it has said
let first = null; // the first reference ({width, height}), whose size "auto" means

export function applyLimits(config) {
  limits = config;
  const steps = $("steps");
  steps.max = config.max_steps;
  steps.value = Math.min(config.default_steps, config.max_steps);
  $("count").max = config.max_images;
  $("guidance-field").hidden = !config.guided;
  if (config.guided) $("guidance").value = config.default_guidance_scale;
  for (const side of [$("width"), $("height")]) {
    side.min = config.min_side;
    side.step = config.size_multiple;
  }
  fillSizes(config.max_pixels);
}

function fillSizes(maxPixels) {
  const select = $("size");
  const choice = select.value;
  select.replaceChildren(new Option("", "auto"));
  for (const [w, h] of SIZE_PRESETS) {
    const option = new Option(`${w} × ${h}`, `${w}x${h}`);
    option.disabled = w * h > maxPixels;
    select.add(option);
  }
  select.add(new Option("Custom…", "custom"));
  if (choice && !select.querySelector(`option[value="${choice}"]`).disabled) select.value = choice;
  nameAuto();
}

// The "auto" size names what it will be: the first reference's size, or the model's default.
export function showFirstReference(reference) {
  first = reference;
  nameAuto();
}

function nameAuto() {
  $("size").options[0].text = first ? `From first reference (${first.width} × ${first.height})` : "Model default";
}

// The body of POST /v1/jobs; an InputProblem naming the field when one is out of range.
export function readSettings() {
  const prompt = $("prompt").value.trim();
  if (!prompt) throw new InputProblem("Write a prompt first: what to generate, or how to change the references.", "prompt");
  const body = { prompt, response_format: "b64_json" };
  body.num_inference_steps = wholeNumber("steps", "Steps", 1, limits.max_steps);
  const strength = readStrength();
  if (strength !== null) body.strength = strength;
  body.n = wholeNumber("count", "Images", 1, limits.max_images);
  // A random seed is drawn here, within JavaScript's exact integers, so the page can show and reuse it.
  const random = crypto.getRandomValues(new Uint32Array(1))[0];
  body.seed = $("seed-fixed").checked ? wholeNumber("seed", "The seed", 0, Number.MAX_SAFE_INTEGER) : random;
  body.size = readSize();
  if (limits.guided) body.guidance_scale = Number($("guidance").value);
  const loras = readLoras();
  if (loras.length) body.loras = loras;
  const cache = readCache();
  if (cache !== null) body.cache = cache;
  if (limits.previews) body.preview = true; // the server has TAEF2: show the image as it forms
  return body;
}

// The step cache: null (off), true (the recipe) or {threshold}.
function readCache() {
  if (!$("cache").checked) return null;
  const input = $("cache-threshold");
  if (input.value.trim() === "" && !input.validity.badInput) return true;
  const value = Number(input.value);
  if (input.validity.badInput || !Number.isFinite(value) || value < 0) {
    throw new InputProblem("The step cache's threshold must be a number from 0, or empty for the recipe's.", "cache-threshold");
  }
  return { threshold: value };
}

// How far the source (the first reference) is repainted; null: not given, the server decides.
function readStrength() {
  const input = $("strength");
  if (input.value.trim() === "" && !input.validity.badInput) return null;
  const value = Number(input.value);
  if (input.validity.badInput || !Number.isFinite(value) || value < 0 || value > 1) {
    throw new InputProblem("Strength must be a number from 0 to 1, or empty for the server's default.", "strength");
  }
  return value;
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
  const most = limits.max_pixels;
  const [width, height] = [side("width", "The width"), side("height", "The height")];
  if (width * height > most) {
    throw new InputProblem(`${width} × ${height} is ${width * height} px, more than the ${most} px this server makes.`, "width");
  }
  return `${width}x${height}`;
}

// A custom width or height; the server rounds it down to a multiple of its size step.
function side(id, name) {
  return wholeNumber(id, name, limits.min_side, Math.floor(limits.max_pixels / limits.min_side));
}

// After a random-seed run the seed field shows the seed used, ready for "Fixed".
export function showSeedUsed(seed) {
  if ($("seed-random").checked) $("seed").value = seed;
}

export function restoreSettings(request, seed) {
  $("prompt").value = request.prompt;
  $("steps").value = request.num_inference_steps;
  $("strength").value = request.strength ?? "";
  $("count").value = request.n;
  $("seed").value = seed;
  $("seed-fixed").checked = true;
  syncSeed();
  const size = $("size");
  size.value = [...size.options].some((option) => option.value === request.size) ? request.size : "custom";
  if (size.value === "custom") [$("width").value, $("height").value] = request.size.split("x");
  syncSize();
  restoreLoras(request.loras);
  $("cache").checked = Boolean(request.cache);
  $("cache-threshold").value = request.cache?.threshold ?? "";
  syncCache();
  $("prompt").focus();
}

function syncSeed() {
  $("seed").disabled = !$("seed-fixed").checked;
}

function syncCache() {
  $("cache-threshold").disabled = !$("cache").checked;
}

function syncSize() {
  $("custom-size").hidden = $("size").value !== "custom";
}

export function wireSettings() {
  for (const radio of document.querySelectorAll("input[name=seed-mode]")) radio.addEventListener("change", syncSeed);
  $("size").addEventListener("change", syncSize);
  $("cache").addEventListener("change", syncCache);
  fillSizes(Infinity); // until the server says how large it goes
}
