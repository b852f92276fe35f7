"""A pipeline's admission of a resolved request (`klein.memory.admission.Budget`): its workload as it will
run (the text encoder's turn left out where the prompt cache holds every prompt, a prefill's keys and values
stored as `kv_dtype` says), the unmerged LoRAs' slots counted once they are on the device or this request
would put them there."""

from __future__ import annotations

import dataclasses
import logging
import weakref

from klein.errors import CannotFitError
from klein.memory.plan import Workload
from klein.pipeline import cache_keys
from klein.pipeline import prompts as text
from klein.request.resolve import Resolved

log = logging.getLogger("klein.residency")


TURNS = "sequential"
"""The policy a request too big for `all` runs under: the text encoder and the transformer take turns."""
_home: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Pipelines whose last request ran under `TURNS` where they keep every model resident: back to `all`."""


def admit(pipe, run: Resolved, turns: bool = True) -> tuple[bool, Workload]:
    """Refuse `run` on `pipe` if it cannot fit; (True when only the tiled decoder makes it fit, the workload
    as admitted: `Budget.admit_kv`). On a GPU or TPU, a request that `all` cannot hold but turns can (more
    references than the planned edit) runs under `TURNS`, the models moving for it alone between the
    device and their host copies (logged; the next request comes back to `all`), where `turns`; else (a
    check before queueing it) it is only admitted so. A CPU's turns would read the checkpoint again: there
    such a request is refused, as before."""
    if turns:
        restore(pipe)
    try:
        return _admitted(pipe, run)
    except CannotFitError as refused:
        if pipe.residency != "all" or pipe.devices[0].platform == "cpu":  # a CPU's turns read the checkpoint
            raise
        pipe.residency = TURNS
        try:
            admitted = _admitted(pipe, run)
        except CannotFitError:
            pipe.residency = "all"
            raise refused from None
        except BaseException:
            pipe.residency = "all"
            raise
    if turns:
        _home[pipe] = "all"
        log.info("this request does not fit with every model resident: the models take turns for it")
    else:
        pipe.residency = "all"
    return admitted


def restore(pipe) -> None:
    """`pipe` back under `all` after a request that ran under `TURNS` (`admit`)."""
    if _home.pop(pipe, None) is not None and pipe.residency == TURNS:
        pipe.residency = "all"


def forget(pipe) -> None:
    """`pipe`'s policy was set by its user (offloading): not to be restored by `admit`."""
    _home.pop(pipe, None)


def _admitted(pipe, run: Resolved) -> tuple[bool, Workload]:
    prompts = [*run.request.prompts, *[""] * run.mode.guided]
    keys = [cache_keys.prompt_key(pipe.weights_id, p, pipe.prompt_owner) for p in prompts]
    work = dataclasses.replace(run.workload, text_cached=text.kept(pipe.prompt_cache, keys))
    return pipe.budget.admit_kv(work, pipe.kv_dtype, *_limits(pipe, run))


def kv_choices(pipe, run: Resolved) -> tuple[str, ...]:
    """How `auto` would store the prefilled keys and values of `run` (`klein.request.loading.KV_DTYPES`:
    "dtype" or "int8"), its prompts new, then kept: a kept prompt leaves the text encoder's turn out, which
    can leave room for the compute dtype's where a new prompt takes 8 bits. Those that cannot fit are left
    out; ("dtype",) for a run without prefilled references. Without a prompt cache no prompt is kept."""
    chosen = []
    for kept in (False, True) if pipe.prompt_cache is not None else (False,):
        work = dataclasses.replace(run.workload, text_cached=kept)
        try:
            admitted = pipe.budget.admit_kv(work, "auto", *_limits(pipe, run))[1]
        except CannotFitError:
            continue
        kv = admitted.kv_dtype or "dtype"
        chosen += [kv] if kv not in chosen else []
    return tuple(chosen)


def _limits(pipe, run: Resolved) -> tuple:
    """`Budget.admit`'s arguments after the workload: the pipeline's limit and cap, and the unmerged LoRAs'
    slots, counted once they are on the device or `run` would put them there."""
    slots = pipe.adapters
    charged = slots.device_bytes if slots.placed or any(run.request.lora_sets) else 0
    return pipe.memory_limit, pipe.memory_cap, charged, slots.placed
