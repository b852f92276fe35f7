"""The README's memory table, from the planner (`klein.memory.plan`): each download (the bf16 folders, and
the quantized files people run on 8-12 GB cards: GGUF transformers with a Q4_K Qwen3 GGUF text encoder,
BFL's NVFP4) for one 1024x1024 image, its peak under each residency policy, and what `auto` picks on
each card of `CARDS` (with the 8-bit products `--compute auto` makes there: FP8 on RTX 40xx / 50xx, INT8
on RTX 30xx, and the text encoder's Linears in ggml blocks where auto quantises them: "all, text Q8_0"),
each planned for the cards' GPU programs as `klein plan --device` plans them. Planned, not measured: `benchmarks/checkpoints/real_size.py --quantized` writes the full-size files for
the measured runs.

    python benchmarks/memory/plan_table.py
"""

import dataclasses

from klein import devices
from klein.memory import plan
from klein.models import products
from klein.request import planning

CARDS = {
    "8 GB (RTX 4060)": "rtx-4060",
    "12 GB (RTX 3060)": "rtx-3060",
    "12 GB (RTX 4070)": "rtx-4070",
    "16 GB (RTX 4080)": "rtx-4080",
    "24 GB (RTX 4090)": "rtx-4090",
    "80 GB": "h100-80gb",
}
ROWS = [
    ("klein-4b, bf16", "klein-4b", 0, None, None),
    ("klein-4b, Q8_0 GGUF + Qwen3-4B Q4_K GGUF", "klein-4b", 0, "Q8_0", "Q4_K"),
    ("klein-4b, Q4_0 / Q4_K GGUF + Qwen3-4B Q4_K GGUF", "klein-4b", 0, "Q4_K", "Q4_K"),
    ("klein-9b-kv, bf16", "klein-9b-kv", 0, None, None),
    ("klein-9b-kv, bf16, 2 references (KV)", "klein-9b-kv", 2, None, None),
    ("klein-9b-kv, Q8_0 GGUF + Qwen3-8B Q4_K GGUF", "klein-9b-kv", 0, "Q8_0", "Q4_K"),
    ("klein-9b-kv, Q4_0 / Q4_K GGUF + Qwen3-8B Q4_K GGUF", "klein-9b-kv", 0, "Q4_K", "Q4_K"),
    ("klein-9b-kv, Q4_0 / Q4_K GGUF + Qwen3-8B Q4_K GGUF, 2 references", "klein-9b-kv", 2, "Q4_K", "Q4_K"),
    ("klein-9b-kv, NVFP4 + Qwen3-8B Q4_K GGUF", "klein-9b-kv", 0, "NVFP4", "Q4_K"),
]


def planned(variant: str, refs: int, transformer, text_encoder, compute: str = products.BF16):
    models = plan.in_format(plan.published(variant, "bfloat16"), transformer, text_encoder)
    models = dataclasses.replace(models, compute=compute)
    return planning.plan(variant, refs=refs, size=(1024, 1024), models=models, platform="gpu")


def auto_on(card: str, variant: str, refs: int, transformer, text_encoder) -> str:
    """What `auto` picks on `card`: its policy, and the text encoder's ggml blocks where auto quantises a
    bf16 one's Linears at load (`--text-encoder-weights auto`: only where that lets `all` hold the
    checkpoint's planned request)."""
    compute, limit = devices.DEVICES[card].compute, devices.DEVICES[card].limit
    models = plan.in_format(plan.published(variant, "bfloat16"), transformer, text_encoder)
    models = dataclasses.replace(models, compute=compute)
    asked = dict(variant=variant, models=models, platform="gpu")
    form, _ = planning.text_weights_choice(asked, "auto", limit)
    models = plan.with_text_blocks(models, form)
    on = planning.plan(variant, refs=refs, size=(1024, 1024), models=models, platform="gpu")
    policy = next((name for name, peak in on.policies_on(limit).items() if peak <= limit), "nothing fits")
    return f"{policy}, text {form}" if form and policy != "nothing fits" else policy


def main() -> None:
    policies = ["`all`, bf16 products", "`sequential`, bf16", "`stream`, bf16"]
    head = ["download, one 1024x1024 image", *policies, *(f"{card}: auto" for card in CARDS)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, variant, refs, transformer, text_encoder in ROWS:
        peaks = planned(variant, refs, transformer, text_encoder).policies
        cells = [f"{peaks[policy] / 2**30:.2f} GiB" for policy in ("all", "sequential", "stream")]
        cells += [auto_on(card, variant, refs, transformer, text_encoder) for card in CARDS.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
