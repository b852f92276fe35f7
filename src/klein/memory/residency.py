"""Residency: which of a pipeline's models (text encoder, transformer, VAE) hold device memory when, as
a policy (`POLICIES`, `SUMMARIES`; `auto` picks the first that fits, `choose`). See docs/design/memory.md.
Off the device a model's weights live in host memory, or nowhere (`klein.pipeline.device_weights`).
"""

from __future__ import annotations

from collections.abc import Callable

from klein.errors import CannotFitError

AUTO = "auto"
"""The policy that picks the first of `POLICIES` that fits (`choose`): the default."""

TEXT_ENCODER, TRANSFORMER, VAE = "text_encoder", "transformer", "vae"
MODELS = (TEXT_ENCODER, TRANSFORMER, VAE)
STACKS = {TRANSFORMER: ("transformer_blocks", "single_transformer_blocks"), TEXT_ENCODER: ("model.layers",)}
"""Each model's stacked layers (dotted paths in its weights): what `stream` keeps in host memory."""


def streamed(model: str) -> str:
    """Key of the weight sizes: the bytes of `model` that `stream` keeps in host memory (its stacks less
    the two layers on the device at a time)."""
    return f"{model}_streamed"


# The sets of models each policy may hold at once, in `auto`'s order of preference.
POLICIES: dict[str, tuple[frozenset[str], ...]] = {
    "all": (frozenset(MODELS),),
    "sequential": (frozenset({TEXT_ENCODER, VAE}), frozenset({TRANSFORMER, VAE})),
    "stream": (frozenset({TEXT_ENCODER, VAE}), frozenset({TRANSFORMER, VAE})),
}
SUMMARIES = {
    "all": "every model resident",
    "sequential": "text encoder and transformer take turns",
    "stream": "as sequential, each model's layers streamed from host memory",
}
STREAMS = frozenset({"stream"})
"""The policies that keep the transformer's blocks in host memory."""
PROMPT_CACHE_BYTES = 256 * 2**20
"""Default prompt-cache budget under a policy that moves the text encoder (about 20 klein-9b prompts):
a new prompt alone brings it back."""


def on(platform: str, sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` as they weigh on a device of `platform`: where the device's memory is the host's (CPU),
    layers streamed from host memory stay in the same memory, so `stream` saves nothing there."""
    if platform != "cpu":
        return sizes
    streams = {streamed(model) for model in MODELS}
    return {name: 0 if name in streams else size for name, size in sizes.items()}


def resident_weights(policy: str, sizes: dict[str, int]) -> int:
    """The most weight bytes `policy` holds on the device at once, given each model's bytes (and those
    it streams, under `streamed(model)`)."""
    return max(_set_weights(policy, sizes).values())


def _set_weights(policy: str, sizes: dict[str, int]) -> dict[frozenset[str], int]:
    """Weight bytes of each set of models `policy` holds at once."""
    held = dict(sizes)
    if policy in STREAMS:
        held = {model: size - sizes.get(streamed(model), 0) for model, size in sizes.items()}
    return {together: sum(held[model] for model in together) for together in POLICIES[policy]}


Request = int | Callable[[frozenset[str]], int]
"""A request's device bytes beside the weights: the same whatever is resident, or `(models) -> bytes`
while the set `models` is on the device (`klein.memory.plan.RequestMemory.during`: under `sequential`
the text encoder's turn runs the text alone)."""


def _during(request: Request) -> Callable[[frozenset[str]], int]:
    return request if callable(request) else lambda _: request


def hold(models: dict, policy, name: str):
    """`() -> (graphdef, state)` of model `name` of `models` (`klein.pipeline.device_weights.Weights` by
    name) on the device, after moving off the models the policy `policy()` (read at each call: offloading
    changes it) does not hold beside it."""

    def weights():
        beside = set().union(*(together for together in POLICIES[policy()] if name in together))
        for other, model in models.items():
            if other not in beside:
                model.release()
        return models[name].get()

    return weights


def held(models: dict, policy, sizes: dict[str, int]) -> tuple[int, int]:
    """(weight bytes of `models` on the device now, the most the policy `policy()` holds while a request
    runs)."""
    now = sum(sizes[name] for name, model in models.items() if model.resident)
    return now, resident_weights(policy(), sizes)


def peaks(sizes: dict[str, int], request: Request) -> dict[str, int]:
    """Planned peak bytes under each policy: the most any of its resident sets holds with `request`'s
    bytes during that set's turn beside it."""
    return {policy: _peak(policy, sizes, _during(request)) for policy in POLICIES}


def _peak(policy: str, sizes: dict[str, int], during: Callable[[frozenset[str]], int]) -> int:
    return max(weights + during(together) for together, weights in _set_weights(policy, sizes).items())


def beyond(policy: str, sizes: dict[str, int], request: Request) -> int:
    """`request`'s bytes beyond the most weight bytes `policy` holds (`resident_weights`): what it needs
    free with those weights on the device; less than its largest turn where that turn's models are the
    lighter ones."""
    return _peak(policy, sizes, _during(request)) - resident_weights(policy, sizes)


def choose(
    policy: str, sizes: dict[str, int], request: Request, limit: int, where: str, process: int = 0
) -> str:
    """`policy`, or under `auto` the first policy that fits `limit`; a `CannotFitError` naming the
    estimates, the limit and what would fit when the asked policy (or, under auto, every policy) does not.
    `process`: bytes of klein's own process in the same memory (`klein.memory.process`; the CPU's).

    Where no policy has room for `request` (a typical one), `auto` takes the policy that leaves requests
    the most room, if its weights fit: smaller requests then run, each admitted against what is left,
    rather than none (a memory cap below a 1024x1024 request's needs is such a case)."""
    during = _during(request)
    planned = peaks(sizes, lambda models: during(models) + process)
    fitting = [name for name, peak in planned.items() if peak <= limit]
    chosen = (fitting[0] if fitting else None) if policy == AUTO else policy
    if chosen in fitting:
        return chosen
    weights = {name: resident_weights(name, sizes) + process for name in POLICIES}
    roomiest = min(planned, key=planned.get)
    if policy == AUTO and weights[roomiest] <= limit:
        return roomiest
    estimates = ", ".join(f"{name} {gib(peak)}" for name, peak in planned.items())
    held = "the weights and klein's own process" if process else "the weights"
    alone = f"{held} alone need {gib(weights[roomiest])}"  # what loads, for smaller requests
    advice = (
        f"use --residency {fitting[0]}"
        if fitting
        else f"under {roomiest} {alone}; use a smaller model, a quantized or FP8 transformer file (klein plan "
        "lists what would fit, with its figures), or a device with more memory"
    )
    asked = "no residency policy fits" if policy == AUTO else f"residency {policy} does not fit"
    whole = during(frozenset(MODELS))
    parts = f"the weights, a {gib(whole)} request and klein's own {gib(process)}"
    parts = parts if process else f"the weights and a {gib(whole)} request"
    raise CannotFitError(
        f"{asked}: {parts} need about {estimates}, more than the {gib(limit)} {where}; {advice}"
    )


def gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"
