// What the page keeps across a reload, in the browser's IndexedDB: the results (their PNGs and
// references as blobs, what was asked, the timings) within a byte budget, the oldest dropped first,
// and the reference list. Where IndexedDB fails (a private window, a full disk) the page carries on
// with what it has in memory, for this visit only.

const DATABASE = "klein";
const RESULTS = "results"; // history entries by number
const STATE = "state"; // "references": the reference list; "mask": the mask painted on its first
const BUDGET_BYTES = 64 * 2 ** 20;
let opened = null;

function database() {
  opened ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DATABASE, 1);
    request.addEventListener("upgradeneeded", () => {
      request.result.createObjectStore(RESULTS, { keyPath: "number" });
      request.result.createObjectStore(STATE);
    });
    request.addEventListener("success", () => resolve(request.result));
    request.addEventListener("error", () => reject(request.error));
  });
  return opened;
}

// Runs work(store) in one transaction on `name`; what work returns, once the transaction is committed.
async function transaction(name, mode, work) {
  const db = await database();
  const tx = db.transaction(name, mode);
  const outcome = work(tx.objectStore(name));
  await new Promise((resolve, reject) => {
    tx.addEventListener("complete", resolve);
    tx.addEventListener("abort", () => reject(tx.error));
  });
  return outcome;
}

// The result of the request that call(store) makes, read once its transaction has completed.
async function read(name, call) {
  return (await transaction(name, "readonly", call)).result;
}

async function safely(action, fallback) {
  try {
    return await action();
  } catch (error) {
    console.warn(`klein: the browser's storage failed (${error && error.message}); nothing is kept across a reload`);
    return fallback;
  }
}

// {results: oldest first, references}: what the last visit left.
export async function load() {
  return safely(async () => {
    const results = await read(RESULTS, (store) => store.getAll());
    const references = await read(STATE, (store) => store.get("references"));
    const mask = await read(STATE, (store) => store.get("mask"));
    return { results, references: references || [], mask: mask || null };
  }, { results: [], references: [], mask: null });
}

// Keeps a result; the numbers of the results dropped to stay within the budget.
export async function saveResult(entry) {
  return safely(() => transaction(RESULTS, "readwrite", (store) => {
    const dropped = [];
    store.put(entry);
    store.getAll().addEventListener("success", (event) => {
      dropped.push(...oldestOver(event.target.result, BUDGET_BYTES));
      for (const number of dropped) store.delete(number);
    });
    return dropped;
  }), []);
}

export async function deleteResult(number) {
  return safely(() => transaction(RESULTS, "readwrite", (store) => {
    store.delete(number);
  }), undefined);
}

export async function saveReferences(list) {
  return safely(() => transaction(STATE, "readwrite", (store) => {
    store.put(list, "references");
  }), undefined);
}

// The mask as mask.js's file() gives it (a PNG blob), or null for none.
export async function saveMask(blob) {
  return safely(() => transaction(STATE, "readwrite", (store) => {
    store.put(blob, "mask");
  }), undefined);
}

// The numbers of the oldest entries (of `entries`, oldest first) to drop so that the rest take at most
// `budget` bytes; the newest is kept whatever its size.
export function oldestOver(entries, budget) {
  let bytes = entries.reduce((sum, entry) => sum + entryBytes(entry), 0);
  const dropped = [];
  for (const entry of entries.slice(0, -1)) {
    if (bytes <= budget) break;
    bytes -= entryBytes(entry);
    dropped.push(entry.number);
  }
  return dropped;
}

const entryBytes = (entry) => [...entry.images, ...entry.refs, ...(entry.mask ? [entry.mask] : [])].reduce((sum, item) => sum + item.blob.size, 0);
