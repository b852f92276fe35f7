// The LoRA picker: the LoRAs the server offers (GET /v1/loras, the operator's --lora-dir /
// --lora-named), each chosen by name with a scale, sent as the request's `loras`. Shown only when the
// server offers any; a server that lists none, or cannot be asked, has no picker.
import { $, element } from "./dom.js";
import { getJSON } from "./api.js";
import { InputProblem } from "./errors.js";

export async function loadLoras() {
  const listed = await getJSON("v1/loras").catch(() => ({ data: [] }));
  const list = $("lora-list");
  list.replaceChildren(...listed.data.map((lora, index) => row(lora.name, index)));
  $("loras-panel").hidden = !listed.data.length;
}

function row(name, index) {
  const item = element("li", "lora");
  const pick = element("input");
  Object.assign(pick, { type: "checkbox", id: `lora-${index}`, value: name });
  const label = element("label", "lora-name", name);
  label.htmlFor = pick.id;
  const scale = element("input", "lora-scale");
  Object.assign(scale, { type: "number", id: `lora-scale-${index}`, step: "0.05", value: "1", inputMode: "decimal" });
  scale.setAttribute("aria-label", `Scale of ${name}`);
  item.append(pick, label, scale);
  return item;
}

function rows() {
  return [...document.querySelectorAll("#lora-list .lora")].map((item) => item.querySelectorAll("input"));
}

// The chosen LoRAs as the request's `loras` ([{name, scale}], empty for none); an InputProblem naming
// a scale that is not a number.
export function readLoras() {
  const chosen = [];
  for (const [pick, scale] of rows()) {
    if (!pick.checked) continue;
    const value = Number(scale.value);
    if (scale.value.trim() === "" || scale.validity.badInput || !Number.isFinite(value)) {
      throw new InputProblem(`The scale of LoRA ${pick.value} must be a number (1: as trained).`, scale.id);
    }
    chosen.push({ name: pick.value, scale: value });
  }
  return chosen;
}

// A result's LoRAs chosen again ("Reuse settings"); those the server no longer offers are left out.
export function restoreLoras(loras = []) {
  const scales = new Map(loras.map((lora) => [lora.name, lora.scale]));
  for (const [pick, scale] of rows()) {
    pick.checked = scales.has(pick.value);
    scale.value = scales.get(pick.value) ?? 1;
  }
}
