"""Full-size klein checkpoints, random weights: does `klein generate` run, how much memory does it take,
and how close is the planner's estimate?

1. Writes, once, a full-size random checkpoint folder per model under --root (default
   `$KLEIN_HOME/real-size`): every tensor at its published shape, bf16, in the diffusers layout with
   Hugging Face shards of at most 2 GiB and their index files; only the tokenizer is tiny (its ids index
   the published vocabulary).
     klein-9b-kv  Flux2KleinKVPipeline: the klein-9b transformer (9.08 B params), the real VAE, Qwen3-8B
                  (all 36 layers, 151936-token vocabulary, its own lm_head, as published): ~35 GB
     klein-4b     Flux2KleinPipeline: the klein-4b transformer, the real VAE, Qwen3-4B: ~16 GB
   A folder whose model_index.json exists is kept; a new one is written to a staging folder next to it
   and renamed when complete (an interrupted write leaves nothing behind); nothing is written unless all
   the missing folders fit on the disk. Writing holds about 0.5 GB of memory and one core, and takes
   about 3 s per GB where the disk keeps up (klein-4b: 16.0 GB in 47 s on a 2-core VM).
2. Runs the CLI as a user would, once per model and --policies entry, one process at a time:
     klein generate --model DIR --prompt "put a hat on it" --image ref.png --height 64 --width 64
                    --steps 1 --out OUT.png --overwrite [--residency POLICY]
   (no --residency for `auto`, the default), with a 64x64 noise reference, and records the exit code,
   wall time, the process's peak resident memory, the stage times and the residency policy it reports
   on stderr, and whether the PNG was written.
3. Asks the planner what it expects of the same request:
     klein plan --model DIR --refs 1 --ref-size 64x64 --size 64x64 --json
   (each policy's peak bytes per device, and auto's choice); a failure is printed and the runs go on
   without an estimate.
4. Prints a Markdown table (measured peak against the estimate of the policy that ran) and writes it all
   as JSON to --out.

The peak resident memory is host memory. With JAX on the CPU the device is host memory, so it compares
with the planner's device peak directly (which there counts klein's own process, `klein.memory.process`);
on an accelerator it is only the host side of the run.

With --quantized NAME... it also writes (once, under --root/quantized, by `benchmarks/checkpoints/quantized_files.py`:
random blocks with valid scales, no quantising pass) the full-size quantized files people download:
    flux-2-klein-9b-kv-Q4_0.gguf, -Q4_K.gguf  klein-9b-kv transformer, ComfyUI-GGUF layout      5.25 GB
    flux-2-klein-4b-Q4_0.gguf, -Q4_K.gguf     klein-4b transformer                             2.26 GB
    flux-2-klein-9b-kv-nvfp4.safetensors      BFL's NVFP4 layout with _quantization_metadata   5.25 GB
    qwen3-8b-Q4_K.gguf, qwen3-4b-Q4_K.gguf    text encoders, llama.cpp names and tokenizer     4.61 / 2.27 GB
(the five above, 19.6 GB, in 2 min holding 0.6 GB on a 2-core VM shared with other work), to be run
(issue 33's proof at full size) as
    klein generate --model DIR --transformer quantized/flux-2-klein-9b-kv-Q4_0.gguf
                   --text-encoder quantized/qwen3-8b-Q4_K.gguf --image ref.png --height 64 --width 64
                   --steps 1 --out OUT.png
beside `klein plan --model DIR --transformer ... --text-encoder ... --refs 1 --ref-size 64x64 --size
64x64 --json` (DIR: the model's bf16 folder above, for its VAE and tokenizer; or `--vae` a VAE alone and the
tokenizer from the Qwen3 GGUF). Measured: docs/benchmarks/quantized-real-size-cpu.md.

Not a test: it writes ~51 GB (check the free space of --root) and each generate run of klein-9b-kv needs
tens of GB of memory.

    python benchmarks/checkpoints/real_size.py --write-only --root /data/ckpt        # only write the folders
    python benchmarks/checkpoints/real_size.py --root /data/ckpt --policies sequential --models klein-4b
    python benchmarks/checkpoints/real_size.py --write-only --models --quantized flux-2-klein-9b-kv-Q4_0.gguf \
        qwen3-8b-Q4_K.gguf                                            # only the quantized files
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# The child runs see the environment as it was given (JAX_PLATFORMS included); this process only writes
# files and computes shapes, on the CPU, so that it never takes an accelerator's memory from them.
CHILD_ENV = dict(os.environ)
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
from quantized_files import (  # noqa: E402
    T,
    write_gguf_qwen3,
    write_gguf_transformer,
    write_nvfp4_transformer,
)

from klein import dtypes  # noqa: E402
from klein.bench.configs import REAL_VAE, _transformer  # noqa: E402
from klein.io import demo  # noqa: E402
from klein.io.paths import klein_home  # noqa: E402
from klein.models.qwen3_config import Qwen3Config  # noqa: E402
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B  # noqa: E402

POLICIES = ("auto", "all", "sequential", "stream")
PROMPT = "put a hat on it"
SIDE = 64  # px of the output and of the reference
GiB = 2**30


def published_text_encoder(cfg: Qwen3Config) -> dict:
    """The transformers `config.json` of a published Qwen3 (vocabulary and tied head included)."""
    return dict(
        demo.text_encoder_config(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        ),
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta),
        tie_word_embeddings=cfg.tie_word_embeddings,  # Qwen3-8B: False, with an lm_head of its own
    )


def _spec(transformer, text: Qwen3Config, pipeline: str) -> demo.RandomCheckpoint:
    return demo.RandomCheckpoint(
        _transformer(transformer),
        REAL_VAE,
        published_text_encoder(text),
        pipeline=pipeline,
        dtype="bfloat16",
        vocab_size=text.vocab_size,
    )


MODELS = {
    "klein-9b-kv": _spec(KLEIN_9B, Qwen3Config.qwen3_8b(), "Flux2KleinKVPipeline"),
    "klein-4b": _spec(KLEIN_4B, Qwen3Config.qwen3_4b(), "Flux2KleinPipeline"),
}


QUANTIZED = {
    "flux-2-klein-9b-kv-Q4_0.gguf": lambda path: write_gguf_transformer(path, KLEIN_9B, T.Q4_0),
    "flux-2-klein-9b-kv-Q4_K.gguf": lambda path: write_gguf_transformer(path, KLEIN_9B, T.Q4_K),
    "flux-2-klein-4b-Q4_0.gguf": lambda path: write_gguf_transformer(path, KLEIN_4B, T.Q4_0),
    "flux-2-klein-4b-Q4_K.gguf": lambda path: write_gguf_transformer(path, KLEIN_4B, T.Q4_K),
    "flux-2-klein-9b-kv-nvfp4.safetensors": lambda path: write_nvfp4_transformer(path, KLEIN_9B),
    "qwen3-8b-Q4_K.gguf": lambda path: write_gguf_qwen3(path, Qwen3Config.qwen3_8b(), T.Q4_K),
    "qwen3-4b-Q4_K.gguf": lambda path: write_gguf_qwen3(path, Qwen3Config.qwen3_4b(), T.Q4_K),
}
"""The quantized files --quantized writes, by file name (the transformer's variant is read from it)."""


def write_quantized(names: list[str], folder: Path) -> dict[str, dict]:
    """Write the files of `names` into `folder` that are not there yet, each to a staging name renamed when
    complete; their paths, sizes and seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in names:
        path = folder / name
        if path.is_file():
            print(f"{name}: {path} exists, kept", flush=True)
            written[name] = dict(path=str(path), written_seconds=None, disk_bytes=path.stat().st_size)
            continue
        staging = path.with_name(f".{name}.partial")
        started = time.perf_counter()
        size = QUANTIZED[name](staging)
        staging.rename(path)
        seconds = time.perf_counter() - started
        print(f"{name}: {size / 1e9:.2f} GB in {seconds:.0f} s", flush=True)
        written[name] = dict(path=str(path), written_seconds=round(seconds, 1), disk_bytes=size)
    return written


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="folder of the checkpoints, one subfolder per model (default: $KLEIN_HOME/real-size); the "
        "reference and the generated PNGs go to its runs/ subfolder",
    )
    parser.add_argument(
        "--models",
        nargs="*",
        choices=tuple(MODELS),
        default=list(MODELS),
        help="default: all of them (none: only the --quantized files)",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help="residency policies to run each model with (auto: no --residency flag; default: every one)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("real-size.json"), help="JSON results (default: %(default)s)"
    )
    parser.add_argument(
        "--write-only", action="store_true", help="only write the checkpoint folders, run nothing"
    )
    parser.add_argument(
        "--quantized",
        nargs="*",
        choices=tuple(QUANTIZED),
        default=[],
        metavar="FILE",
        help=f"quantized files to write under --root/quantized: {', '.join(QUANTIZED)} (default: none)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds before a generate run is killed (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    args.root = args.root or klein_home() / "real-size"
    return args


# --- 1. the checkpoints ----------------------------------------------------------------------------


def write_models(names: list[str], root: Path) -> dict[str, dict]:
    """Write the folders of `names` under `root` that are not complete yet, if all of them fit on its disk."""
    missing = [name for name in names if not (root / name / "model_index.json").is_file()]
    need = {name: tensor_bytes(MODELS[name]) for name in missing}
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if sum(need.values()) * 1.01 > free:
        sizes = ", ".join(f"{name} {size / 1e9:.1f} GB" for name, size in need.items())
        raise SystemExit(f"{root} has {free / 1e9:.1f} GB free; to write: {sizes}")
    return {name: write_model(name, root / name) for name in names}


def tensor_bytes(spec: demo.RandomCheckpoint) -> int:
    shapes = demo.tensor_shapes(spec, tokenizer_vocab=320)  # unused: spec.vocab_size is set
    count = sum(int(np.prod(s, dtype=np.int64)) for part in shapes.values() for s in part.values())
    return count * dtypes.itemsize(spec.dtype)


def write_model(name: str, home: Path) -> dict:
    """Write `home` for model `name` unless it is complete already; what was written and how long it took."""
    if (home / "model_index.json").is_file():
        print(f"{name}: {home} exists, kept", flush=True)
        return dict(path=str(home), written_seconds=None, disk_bytes=disk_bytes(home))
    print(f"{name}: writing {tensor_bytes(MODELS[name]) / 1e9:.1f} GB to {home}", flush=True)
    started = last = time.perf_counter()

    def progress(path: Path, done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        print(
            f"  {name} {path.parent.name:<12} {path.name:<50} {done / 1e9:6.2f} / {total / 1e9:6.2f} GB"
            f"  {now - started:6.0f} s",
            flush=True,
        )
        if done == total:
            print(f"  {name} {path.parent.name}: {total / 1e9:.2f} GB in {now - last:.0f} s", flush=True)
            last = now

    demo.ensure_checkpoint(home, MODELS[name], progress=progress)
    seconds = time.perf_counter() - started
    size = disk_bytes(home)
    print(f"{name}: {size / 1e9:.1f} GB in {seconds:.0f} s ({size / 1e9 / seconds:.2f} GB/s)", flush=True)
    return dict(path=str(home), written_seconds=round(seconds, 1), disk_bytes=size)


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --- 2. the runs ------------------------------------------------------------------------------------


def klein_command() -> list[str]:
    """The `klein` entry point of this Python's environment (as a user's shell finds it), else the module."""
    script = Path(sys.executable).parent / "klein"
    if script.is_file():
        return [str(script)]
    found = shutil.which("klein")
    return [found] if found else [sys.executable, "-m", "klein.cli.main"]


def run_measured(command: list[str], timeout: float, log: Path) -> dict:
    """Run `command` to its end; its exit code, wall time and peak resident memory; stdout and stderr go to
    `log` (a file, not a pipe: nothing to drain while waiting).

    Peak memory: the kernel's own maximum resident set size of the child, from the rusage that wait4 returns
    when it is reaped (ru_maxrss, KiB on Linux), which is what `/usr/bin/time -v` reports, without needing
    that binary or parsing its output. It is exact, where polling /proc/<pid>/status every 0.2 s would miss a
    peak between two polls and lose VmHWM when the process exits; and it is this one child's, where
    getrusage(RUSAGE_CHILDREN) is the largest of every child reaped so far. Processes the child starts and
    waits for count too (it is their maximum, not their sum, as for /usr/bin/time).
    """
    started = time.perf_counter()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=CHILD_ENV, start_new_session=True
        )
        killed = False
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if not killed and time.perf_counter() - started > timeout:
                # Not reaped yet, so its process group id is still its own: kill it and what it started.
                os.killpg(process.pid, signal.SIGKILL)
                killed = True
            time.sleep(0.2)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return dict(
        exit_code=process.returncode,
        timed_out=killed,
        wall_seconds=round(time.perf_counter() - started, 2),
        peak_rss_bytes=usage.ru_maxrss * 1024,
    )


def generate(name: str, home: Path, policy: str, runs: Path, reference: Path, timeout: float) -> dict:
    out = runs / f"{name}-{policy}.png"
    out.unlink(missing_ok=True)
    command = [
        *klein_command(),
        "generate",
        "--model",
        str(home),
        "--prompt",
        PROMPT,
        "--image",
        str(reference),
    ]
    command += ["--height", str(SIDE), "--width", str(SIDE), "--steps", "1", "--out", str(out), "--overwrite"]
    if policy != "auto":
        command += ["--residency", policy]
    print(f"$ {' '.join(command)}", flush=True)
    log = runs / f"{name}-{policy}.log"
    result = run_measured(command, timeout, log)
    text = log.read_text(errors="replace").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n") if line.strip()]
    result.update(
        model=name,
        policy=policy,
        png_written=out.is_file(),
        stages=stage_times(lines),
        residency_lines=[line for line in lines if "residency" in line.lower()],
        chosen=chosen_policy(lines),
        last_lines=lines[-15:],
    )
    print(
        f"  exit {result['exit_code']}, {result['wall_seconds']:.1f} s, peak RSS "
        f"{result['peak_rss_bytes'] / GiB:.2f} GiB, PNG {'written' if result['png_written'] else 'missing'}",
        flush=True,
    )
    print("\n".join(f"  | {line}" for line in result["last_lines"]), flush=True)
    return result


def stage_times(lines: list[str]) -> dict[str, float]:
    """The `time (s):` block the CLI prints on stderr: stage -> seconds (total included)."""
    times: dict[str, float] = {}
    for i, line in enumerate(lines):
        if line.strip() == "time (s):":
            times = {}
            for row in lines[i + 1 :]:
                match = re.fullmatch(r"\s+(\w+)\s+([0-9.]+)", row)
                if not match:
                    break
                times[match[1]] = float(match[2])
    return times


def chosen_policy(lines: list[str]) -> str | None:
    """The residency policy the CLI says it used ("residency: sequential (bfloat16)"), if it says."""
    mentions = [line for line in lines if "residency" in line.lower()]
    for pattern in (
        r"residency:\s*(all|sequential|stream)\b",
        r"\bcho(?:se|sen|ice)\W+(all|sequential|stream)\b",
    ):
        for line in mentions:
            if match := re.search(pattern, line, re.IGNORECASE):
                return match[1].lower()
    for line in mentions:
        if match := re.search(r"\b(all|sequential)\b", line):
            return match[1]
    return None


# --- 3. the planner's estimate -----------------------------------------------------------------------


def planned(name: str, home: Path) -> dict:
    """`klein plan --json` of the benchmark's request: {"peaks": {policy: bytes}, "auto": name}, or the
    error."""
    size = f"{SIDE}x{SIDE}"
    command = [*klein_command(), "plan", "--model", str(home), "--refs", "1", "--ref-size", size]
    command += ["--size", size, "--json"]
    print(f"$ {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=CHILD_ENV, timeout=600)
        if done.returncode:
            raise RuntimeError(f"exit code {done.returncode}: {done.stderr.strip()[-2000:]}")
        plan = json.loads(done.stdout)
        peaks = {p["name"]: int(p["peak_bytes"]) for p in plan["policies"]}
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired) as exc:
        print(f"  {name}: no estimate from klein plan: {exc}", flush=True)
        return dict(error=str(exc))
    print(f"  {name}: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in peaks.items()), flush=True)
    return dict(peaks=peaks, auto=plan.get("auto"), plan=plan)


# --- 4. the report ----------------------------------------------------------------------------------


def attach_estimates(runs: list[dict], plans: dict[str, dict]) -> None:
    """Each run's `estimate_bytes`: the planner's peak for the policy that ran (for auto: the one the CLI
    says it chose, else the planner's own choice); None without a plan."""
    for run in runs:
        plan = plans.get(run["model"], {})
        policy = run["policy"] if run["policy"] != "auto" else run["chosen"] or plan.get("auto")
        run["estimate_bytes"] = plan.get("peaks", {}).get(policy)


def table(runs: list[dict]) -> str:
    rows = [
        "| model | policy | exit | peak RSS GiB | estimate GiB | measured / estimate | wall s | stages (s) "
        "| chose |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        estimate = run["estimate_bytes"]
        measured = run["peak_rss_bytes"]
        stages = ", ".join(f"{k} {v:.1f}" for k, v in run["stages"].items())
        rows.append(
            f"| {run['model']} | {run['policy']} | {run['exit_code']}{' (timed out)' if run['timed_out'] else ''} "
            f"| {measured / GiB:.2f} | {'-' if estimate is None else f'{estimate / GiB:.2f}'} "
            f"| {'-' if not estimate else f'{measured / estimate:.2f}'} | {run['wall_seconds']:.1f} "
            f"| {stages or '-'} | {run['chosen'] or '-'}{'' if run['png_written'] else ' (no PNG)'} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    checkpoints = write_models(args.models, args.root)
    write_quantized(args.quantized, args.root / "quantized")
    if args.write_only:
        return 0
    runs_folder = args.root / "runs"
    runs_folder.mkdir(parents=True, exist_ok=True)
    reference = runs_folder / "ref.png"
    noise = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    PIL.Image.fromarray(noise).save(reference)
    plans = {name: planned(name, args.root / name) for name in args.models}
    runs = [
        generate(name, args.root / name, policy, runs_folder, reference, args.timeout)
        for name in args.models
        for policy in args.policies
    ]
    attach_estimates(runs, plans)
    report = table(runs)
    print(report)
    results = dict(
        root=str(args.root),
        request=dict(prompt=PROMPT, size=SIDE, references=1, steps=1),
        checkpoints=checkpoints,
        plans=plans,
        runs=runs,
        table=report,
    )
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(run["exit_code"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
