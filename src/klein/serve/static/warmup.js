// A server that compiles ahead (klein serve without --no-warm) runs no request until it is done, and says
// so in /v1/config (`warming`). The page asks again every second until it is over. An edit asked for
// meanwhile waits for it here, before anything is sent: the wait is the server's warm-up, not the edit's
// time, and is told apart from it.
import { getJSON } from "./api.js";

const POLL_MS = 1000;
let over = null; // while the server warms: the promise of its config once it has finished

// From a /v1/config: when the server warms, the promise of its config once it has finished (the same one
// for every caller), else null.
export function watch(config) {
  if (config.warming && over === null) {
    over = poll().finally(() => {
      over = null;
    });
  }
  return over;
}

export const warming = () => over !== null;

async function poll() {
  for (;;) {
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    const config = await getJSON("v1/config");
    if (!config.warming) return config;
  }
}

// The seconds spent waiting for the warm-up to finish (0 when the server is not warming), calling
// onTick(seconds waited so far) now and every second meanwhile.
export async function wait(onTick) {
  if (over === null) return 0;
  const started = performance.now();
  const waited = () => (performance.now() - started) / 1000;
  onTick(0);
  const ticker = setInterval(() => onTick(waited()), 1000);
  try {
    await over;
  } finally {
    clearInterval(ticker);
  }
  return waited();
}
