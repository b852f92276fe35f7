"""klein's own process (Python, JAX's client, the programs, the tokenizer), counted where it shares the
device's memory: on the local CPU (docs/design/memory.md). `footprint("cpu")` is a sum of parts measured
on this repository's 2-core AMD EPYC machine (`python benchmarks/memory/process_footprint.py` prints the first two):
- `RUNTIME_BYTES`: the resident memory of a process that imported `klein.pipeline.flux2_klein` and JAX and
  ran one array op on the CPU (Python, numpy, JAX's CPU client, klein's modules, the shared libraries
  they map; 0.33 GiB, libtpu's probe included where the `tpu` extra is installed);
- `TOKENIZER_BYTES`: the Qwen3 tokenizer (151,669 tokens) read from a GGUF's metadata, 36 MiB;
- `PROGRAMS_BYTES`: the compiled programs of a request (text encoder, prefill, step, decode) and what the
  allocator keeps of the heap between stages: what the full-size quantized runs held beyond their
  planned bytes and the two parts above, 0.30-0.77 GiB over the nine runs of
  docs/benchmarks/quantized-real-size-cpu.md, mean 0.53; 0.59 GiB here, so that a plan errs toward
  fitting.
"""

from __future__ import annotations

RUNTIME_BYTES = 334 * 2**20
TOKENIZER_BYTES = 36 * 2**20
PROGRAMS_BYTES = 602 * 2**20


def footprint(platform: str) -> int:
    """Bytes the process itself holds in the memory a plan for a `platform` device counts: its own on the
    CPU (one memory for both), none on an accelerator (host memory is apart)."""
    return RUNTIME_BYTES + TOKENIZER_BYTES + PROGRAMS_BYTES if platform == "cpu" else 0


def resident() -> int:
    """Bytes this process holds now (VmRSS), 0 where /proc is not there: the host's available memory
    leaves them out, and a plan that counts the process counts them."""
    return proc_bytes("/proc/self/status", "VmRSS") or 0


def proc_bytes(path: str, field: str) -> int | None:
    """The bytes a /proc file (`/proc/meminfo`, `/proc/self/status`) gives as `field` in kB; None where
    the file or the field is not there."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
