// The settings of the next edit: prompt, size (the first reference's, a preset or custom), steps,
// number of images, seed (random or fixed) and, on base models, guidance. Limits come from /v1/config.
import { $ } from "./dom.js";
import { InputProblem } from "./errors.js";

const SIZE_PRESETS = [
  [256, 256], [512, 512], [768, 768], [1024, 1024], [1024, 768], [768, 1024], [1280, 720], [720, 1280],
];
let limits = { max_steps: 1000, max_images: 8, guided: false };

export function applyLimits(config) {
  limits = { ...limits, ...config };
  const steps = $("steps");
  steps.max = limits.max_steps;
  steps.value = Math.min(config.default_steps || steps.value, steps.max);
  $("count").max = limits.max_images;
  $("guidance-field").hidden = !config.guided;
  if (config.default_guidance_scale) $("guidance").value = config.default_guidance_scale;
  fillSizes(config.max_pixels);
}

function fillSizes(maxPixels) {
  const select = $("size");
  select.replaceChildren(new Option("From first reference", "auto"));
  for (const [w, h] of SIZE_PRESETS) {
    const option = new Option(`${w} × ${h}`, `${w}x${h}`);
    option.disabled = Boolean(maxPixels) && w * h > maxPixels;
    select.add(option);
  }
  select.add(new Option("Custom…", "custom"));
}

// The "auto" size names what it will be: the first reference's size, or the model's default.
export function showFirstReference(first) {
  const auto = $("size").options[0];
  if (!auto) return;
  const size = first && first.width ? ` (${first.width} × ${first.height})` : "";
  auto.text = first ? `From first reference${size}` : "Model default";
}

// The body of POST /v1/jobs; an InputProblem naming the field when one is out of range.
export function readSettings() {
  const prompt = $("prompt").value.trim();
  if (!prompt) throw new InputProblem("Write a prompt first: what to generate, or how to change the references.", "prompt");
  const body = { prompt, response_format: "b64_json" };
  body.num_inference_steps = wholeNumber("steps", "Steps", 1, limits.max_steps);
  body.n = wholeNumber("count", "Images", 1, limits.max_images);
  // A random seed is drawn here, within JavaScript's exact integers, so the page can show and reuse it.
  const random = crypto.getRandomValues(new Uint32Array(1))[0];
  body.seed = $("seed-fixed").checked ? wholeNumber("seed", "The seed", 0, Number.MAX_SAFE_INTEGER) : random;
  body.size = readSize();
  if (limits.guided) body.guidance_scale = Number($("guidance").value);
  return body;
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
  return `${wholeNumber("width", "The width", 16, 16384)}x${wholeNumber("height", "The height", 16, 16384)}`;
}

// After a random-seed run the seed field shows the seed used, ready for "Fixed".
export function showSeedUsed(seed) {
  if ($("seed-random").checked) $("seed").value = seed;
}

export function restoreSettings(request, seed) {
  $("prompt").value = request.prompt;
  $("steps").value = request.num_inference_steps;
  $("count").value = request.n;
  $("seed").value = seed;
  $("seed-fixed").checked = true;
  syncSeed();
  const size = $("size");
  size.value = [...size.options].some((option) => option.value === request.size) ? request.size : "custom";
  if (size.value === "custom") [$("width").value, $("height").value] = request.size.split("x");
  syncSize();
  $("prompt").focus();
}

function syncSeed() {
  $("seed").disabled = !$("seed-fixed").checked;
}

function syncSize() {
  $("custom-size").hidden = $("size").value !== "custom";
}

export function wireSettings() {
  for (const radio of document.querySelectorAll("input[name=seed-mode]")) radio.addEventListener("change", syncSeed);
  $("size").addEventListener("change", syncSize);
  fillSizes(0);
}
