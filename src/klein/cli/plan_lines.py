"""The lines of `klein plan` beside its memory table: the text encoder's form (`--text-encoder-weights`,
auto resolved as a load on the device resolves it), why `all` does not hold a request where that form
lets it hold the planned one, and what a load keeps in host memory."""

from __future__ import annotations


def text_weights(asked: dict, limit: int | None) -> tuple[dict, str, str]:
    """(`asked` with the text encoder's Linears as --text-encoder-weights keeps them, auto resolved as a load
    on that device resolves it, that form, the line that says so)."""
    from klein.memory import plan
    from klein.request import planning

    asked = dict(asked)
    option = asked.pop("text_encoder_weights", "auto")
    form, whose = planning.text_weights_choice(asked, option, limit)
    kept = dict(asked, models=plan.with_text_blocks(asked["models"], form))
    held = "ggml blocks quantised at load, the token table in host memory" if form else "the compute dtype's"
    return kept, form or "dtype", f"text encoder: {form or 'dtype'} ({whose}; {held})"


def beyond_all(memory, limit: int | None, form: str) -> str | None:
    """Where the text encoder's blocks let `all` fit the planned request but not this one: why not."""
    peak = memory.policies_on(limit)["all"] if limit is not None else 0
    if form == "dtype" or peak <= limit:
        return None
    kv = memory.memory.reference_kv
    held = f"its reference keys and values ({kv / 2**30:.2f} GiB) and " if kv else ""
    return (
        f"all does not fit this request ({peak / 2**30:.2f} GiB): {held}the weights need more than the "
        f"{limit / 2**30:.2f} GiB, so the text encoder and the transformer take turns for it"
    )


def host_line(memory) -> str | None:
    """What the plan keeps in host memory: the token table, and each policy's host copies."""
    host = memory.host_bytes()
    parts = [f"{name} {gib}" for name, size in host.items() if size for gib in [f"{size / 2**30:.2f} GiB"]]
    return f"host memory kept: {', '.join(parts)}" if parts else None
