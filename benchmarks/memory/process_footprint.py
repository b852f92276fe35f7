"""The measurable parts of klein's own process on the CPU, beside the constants the planner adds for it
(`klein.memory.process`): run it on a machine to see whether they still hold there.

Prints the resident memory (VmRSS, RssAnon, RssFile) of this process after importing klein's pipeline
and JAX and running one array op on the first device (`RUNTIME_BYTES`), and after reading a tokenizer
(`TOKENIZER_BYTES`): from --text-encoder, a Qwen3 GGUF file or folder, or the demo's. `PROGRAMS_BYTES`
is not measured here: it is what a full-size run holds beyond the planned bytes and these two
(docs/benchmarks/quantized-real-size-cpu.md).

    python benchmarks/memory/process_footprint.py [--text-encoder qwen3-8b-Q4_K.gguf --transformer FILE --vae VAE]
"""

import argparse

GiB = 2**30


def resident() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in bytes."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                found[name] = int(value.split()[0]) * 1024
    return found


def show(stage: str, rss: dict[str, int]) -> None:
    print(f"{stage:<34}" + "  ".join(f"{name} {value / GiB:.3f} GiB" for name, value in rss.items()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text-encoder", help="a Qwen3 GGUF file or folder whose tokenizer to read")
    parser.add_argument("--transformer", help="the transformer file beside it (to locate the parts)")
    parser.add_argument("--vae", help="the VAE beside them")
    flags = parser.parse_args()
    show("python", resident())
    import jax
    import jax.numpy as jnp

    import klein.pipeline.loading  # noqa: F401 (what `klein generate` imports before loading)
    from klein.memory import process
    from klein.pipeline import components, prompts

    (jnp.ones(3) + 1).block_until_ready()
    runtime = resident()
    show(f"runtime ({jax.devices()[0].platform})", runtime)
    model = None if flags.text_encoder else "demo"
    located = components.locate(model, components.Parts(flags.transformer, flags.text_encoder, flags.vae))
    tokenizer = prompts.load_tokenizer(located.tokenizer)
    after = resident()
    show("with the tokenizer", after)
    print(f"tokenizer: {(after['VmRSS'] - runtime['VmRSS']) / 2**20:.0f} MiB ({type(tokenizer).__name__})")
    print(
        f"klein.memory.process: RUNTIME_BYTES {process.RUNTIME_BYTES / GiB:.3f} GiB, TOKENIZER_BYTES "
        f"{process.TOKENIZER_BYTES / 2**20:.0f} MiB, PROGRAMS_BYTES {process.PROGRAMS_BYTES / GiB:.3f} GiB, "
        f"footprint('cpu') {process.footprint('cpu') / GiB:.3f} GiB"
    )


if __name__ == "__main__":
    main()
