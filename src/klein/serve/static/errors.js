// What went wrong, said in the page: one message box (role=alert) above the results, the field at
// fault marked and focused, and the API key asked for on a 401: calmly when none was sent (a keyed
// server's page opens so), as an error when the key sent was refused. Nothing the person entered is reset.
import { $ } from "./dom.js";
import { NetworkError, ServerError, setApiKey } from "./api.js";

// A problem the page finds itself, before asking the server; `field` is the id of the input at fault.
export class InputProblem extends Error {
  constructor(message, field) {
    super(message);
    this.field = field;
  }
}

// The server's `param` names a request field; these are the inputs that set them.
const FIELDS = {
  prompt: "prompt", num_inference_steps: "steps", n: "count", seed: "seed", size: "size",
  guidance_scale: "guidance", image: "ref-input", references: "ref-input", strength: "strength", mask: "mask-canvas",
  loras: "lora-0", cache: "cache-threshold",
};

// What to do, where the server's own sentence may leave it out.
const ADVICE = {
  upload_too_large: "Use smaller images or fewer references.",
};

export function showFailure(error, retry) {
  if (error instanceof InputProblem) return showError(error.message, error.field);
  if (error instanceof ServerError && error.status === 401) return askForKey(retry, error.keySent);
  if (error instanceof NetworkError) {
    return showError(`Could not reach the server (${error.message}). Is klein serve still running?`, null);
  }
  if (!(error instanceof ServerError)) return showError(`Something went wrong in the page: ${error.message}`, null);
  let text = sentence(error.message);
  if (ADVICE[error.code]) text += ` ${ADVICE[error.code]}`;
  if (error.retryAfter && !/retry/i.test(text)) text += ` Try again in ${error.retryAfter} s.`;
  showError(text, FIELDS[error.param] || (error.code === "upload_too_large" ? "ref-input" : null));
}

function sentence(text) {
  const trimmed = text.trim();
  const capital = trimmed.charAt(0).toUpperCase() + trimmed.slice(1);
  return /[.!?]$/.test(capital) ? capital : `${capital}.`;
}

function showError(text, field) {
  const box = $("error");
  box.textContent = text;
  box.hidden = false;
  const input = field && $(field);
  if (input) {
    input.setAttribute("aria-invalid", "true");
    input.setAttribute("aria-describedby", "error");
    if (!input.disabled) input.focus();
  }
}

export function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
  for (const input of document.querySelectorAll("[aria-invalid]")) {
    input.removeAttribute("aria-invalid");
    input.removeAttribute("aria-describedby");
  }
}

// keyRefused: the request carried a key, and the server did not take it.
function askForKey(retry, keyRefused) {
  $("auth").hidden = false;
  const field = $("api-key");
  if (keyRefused) {
    showError("The server did not accept the API key sent: check it and enter it again.", "api-key");
    field.select();
  } else {
    field.focus();
  }
  $("auth").onsubmit = (event) => {
    event.preventDefault();
    setApiKey($("api-key").value.trim());
    $("auth").hidden = true;
    clearError();
    retry();
  };
}
