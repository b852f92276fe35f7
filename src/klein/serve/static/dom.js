// Small DOM helpers shared by the page's modules.

export const $ = (id) => document.getElementById(id);

export function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function thumbnail(url, alt, className = "thumb") {
  const img = element("img", className);
  img.src = url;
  img.alt = alt;
  return img;
}

// Inline SVG paths (24x24, stroked): the page loads no icon font or image.
const ICONS = {
  up: "M12 19V5M6 11l6-6 6 6",
  down: "M12 5v14M6 13l6 6 6-6",
  remove: "M6 6l12 12M18 6L6 18",
};

export function iconButton(kind, label, disabled, onClick) {
  const button = element("button", `icon ${kind}`);
  button.type = "button";
  button.setAttribute("aria-label", label);
  button.title = label;
  button.disabled = disabled;
  button.innerHTML = `<svg aria-hidden="true" viewBox="0 0 24 24" width="16" height="16"><path d="${ICONS[kind]}"/></svg>`;
  button.addEventListener("click", onClick);
  return button;
}

export function counted(count, noun) {
  return `${count} ${noun}${count === 1 ? "" : "s"}`;
}

export function formatSeconds(seconds) {
  if (seconds >= 10) return `${seconds.toFixed(1)} s`;
  return seconds >= 0.01 ? `${seconds.toFixed(2)} s` : `${Math.round(seconds * 1000)} ms`;
}

export function formatBytes(bytes) {
  if (bytes < 2 ** 10) return `${bytes} bytes`;
  return bytes < 2 ** 20 ? `${Math.round(bytes / 2 ** 10)} KiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}
