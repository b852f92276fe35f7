"""A pipeline's admission of a resolved request (`klein.memory.admission.Budget`): its workload as it will
run (the text encoder's turn left out where the prompt cache holds every prompt, a prefill's keys and values
stored as `kv_dtype` says), the unmerged LoRAs' slots counted once they are on the device or this request
would put them there."""

from __future__ import annotations

import dataclasses

from klein.memory.plan import Workload
from klein.pipeline import cache_keys
from klein.pipeline import prompts as text
from klein.request.resolve import Resolved


def admit(pipe, run: Resolved) -> tuple[bool, Workload]:
    """Refuse `run` on `pipe` if it cannot fit; (True when only the tiled decoder makes it fit, the workload
    as admitted: `Budget.admit_kv`)."""
    prompts = [*run.request.prompts, *[""] * run.mode.guided]
    keys = [cache_keys.prompt_key(pipe.weights_id, p, pipe.prompt_owner) for p in prompts]
    slots, work = (
        pipe.adapters,
        dataclasses.replace(run.workload, text_cached=text.kept(pipe.prompt_cache, keys)),
    )
    charged = slots.device_bytes if slots.placed or any(run.request.lora_sets) else 0
    limits = (pipe.memory_limit, pipe.memory_cap, charged, slots.placed)
    return pipe.budget.admit_kv(work, pipe.kv_dtype, *limits)
