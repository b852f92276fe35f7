"""cache-dit's DBCache on diffusers' Flux2Klein(KV)Pipeline: the reference for klein's step caching.

`cache_dit_kwargs` turns a klein `StepCache` (or anything with its fields) into the keyword arguments of
`cache_dit.enable_cache` that name the same knobs; `run_cache_dit` runs a diffusers pipeline once under
them and returns the image with cache-dit's decisions and residual differences for each block group
("double": transformer_blocks, "single": single_transformer_blocks) and CFG branch ("cond", and "uncond"
where CFG is separately accounted). The pipeline is left as it was: cache-dit patches its class's
`__call__` and its transformer's `forward` while enabled and restores them on `disable_cache`.

On Flux2KleinKVPipeline cache-dit 1.5.3 alone is not diffusers' KV pipeline: it replaces each group's block
list by one module that runs all the group's blocks, so diffusers' loop hands that module layer 0's
reference cache and every block extracts into, and attends over, layer 0's reference keys and values (with
nothing cached, the image moves by 0.016 on the tiny KV pipeline). `run_cache_dit` routes each block to its
own layer of the cache (`_kv_layers_routed`), so that the reference is diffusers' KV semantics under
cache-dit's DBCache (the cache it makes holds one layer per group: the routing adds the others); with
nothing cached it then equals diffusers' uncached image exactly.
"""

import contextlib
import copy
import dataclasses
from unittest import mock

import cache_dit
import numpy as np
import torch
from cache_dit import DBCacheConfig, ParamsModifier, TaylorSeerCalibratorConfig

GROUPS = ("double", "single")
BRANCHES = ("cond", "uncond")


def cache_dit_kwargs(cache) -> dict:
    """`enable_cache`'s cache_config, params_modifiers (the double and then the single blocks' thresholds,
    as cache-dit's FLUX.2 examples set them) and calibrator_config for a klein StepCache's fields."""
    single = cache.single_threshold if cache.single_threshold is not None else 3 * cache.threshold
    config = DBCacheConfig(
        Fn_compute_blocks=cache.compute_first,
        Bn_compute_blocks=cache.compute_last,
        residual_diff_threshold=cache.threshold,
        max_warmup_steps=cache.warmup,
        warmup_interval=cache.warmup_interval,
        max_cached_steps=cache.max_cached,
        max_continuous_cached_steps=cache.max_consecutive,
        enable_separate_cfg=cache.separate_cfg,
        steps_computation_mask=None if cache.mask is None else list(cache.mask),
        steps_computation_policy=cache.mask_policy,
    )
    modifiers = [
        ParamsModifier(cache_config=DBCacheConfig().reset(residual_diff_threshold=cache.threshold)),
        ParamsModifier(cache_config=DBCacheConfig().reset(residual_diff_threshold=single)),
    ]
    kwargs = dict(cache_config=config, params_modifiers=modifiers)
    if cache.taylorseer_order:
        kwargs["calibrator_config"] = TaylorSeerCalibratorConfig(taylorseer_order=cache.taylorseer_order)
    return kwargs


@dataclasses.dataclass
class CacheDitRun:
    """One cache-dit run: the images (np float32, NHWC in [0, 1]); per (group, branch) the steps it
    reused the cache at and its residual differences by step (-2.0: the shapes differed, -0.0: threshold
    0); per group the threshold it compared with."""

    images: np.ndarray
    cached: dict[tuple[str, str], list[int]]
    diffs: dict[tuple[str, str], dict[int, float]]
    thresholds: dict[str, float]

    def margin(self) -> float:
        """The smallest |diff - threshold| over every recorded difference compared with a threshold
        (warmup and masked steps record none; -2.0 and -0.0 are not comparisons)."""
        gaps = [
            abs(d - self.thresholds[group])
            for (group, _), diffs in self.diffs.items()
            for d in diffs.values()
            if d >= 0 and self.thresholds[group] > 0
        ]
        return min(gaps, default=float("inf"))

    def describe(self) -> str:
        lines = []
        for key in sorted(self.diffs):
            diffs = " ".join(f"{s}:{d:.3f}" for s, d in sorted(self.diffs[key].items()))
            lines.append(f"{key} thr {self.thresholds[key[0]]:.3g} cached {self.cached[key]} diffs {diffs}")
        return "\n".join(lines)


def _group(context_name: str) -> str:
    # cache-dit names a context after its blocks' attribute and the blocks' id.
    return "single" if context_name.startswith("single_transformer_blocks") else "double"


def run_cache_dit(pipe, kwargs: dict, latents: np.ndarray, **call) -> CacheDitRun:
    """`pipe(latents=..., output_type="np", **call)` under `cache_dit.enable_cache(pipe, **kwargs)`;
    cache-dit is disabled again afterwards, whatever happens."""
    separate = bool(kwargs["cache_config"].enable_separate_cfg)
    cache_dit.enable_cache(pipe, **_copied(kwargs))
    try:
        with torch.no_grad(), _kv_layers_routed(pipe.transformer):
            images = pipe(latents=torch.from_numpy(latents), output_type="np", **call).images
        cached, diffs, thresholds = {}, {}, {}
        for name, context in pipe._context_manager._cached_context_manager.items():
            group = _group(name)
            thresholds[group] = float(context.get_residual_diff_threshold())
            recorded = [("cond", context.cached_steps, context.residual_diffs)]
            if separate:
                recorded.append(("uncond", context.cfg_cached_steps, context.cfg_residual_diffs))
            for branch, steps, by_step in recorded:
                cached[group, branch] = list(steps)
                diffs[group, branch] = {int(s): float(d) for s, d in by_step.items()}
    finally:
        cache_dit.disable_cache(pipe)
    assert set(thresholds) == set(GROUPS), thresholds
    return CacheDitRun(np.asarray(images, np.float32), cached, diffs, thresholds)


def _copied(kwargs: dict) -> dict:
    """cache-dit updates the configs it is given in place (a modifier's fields onto the base config):
    give it copies, so that one kwargs dict can run twice and feed klein unchanged."""
    return copy.deepcopy(kwargs)


@contextlib.contextmanager
def _kv_layers_routed(transformer):
    """Each block of `transformer` given its own layer of a KV pipeline's reference cache, whichever layer
    the loop around it handed over (cache-dit's wrapper hands every block layer 0's): the cache object is
    remembered as diffusers' loop asks it for a layer, and a pre-hook on block i swaps in layer i."""
    from diffusers.models.transformers.transformer_flux2 import Flux2KVCache, Flux2KVLayerCache

    seen = {}
    doubles, singles = len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)
    gets = {"get_double": Flux2KVCache.get_double, "get_single": Flux2KVCache.get_single}

    def remembering(get):
        def wrapped(self, index):
            seen["cache"] = self
            return get(self, index)

        return wrapped

    def routing(get, index):
        def hook(module, args, kwargs):
            extra = kwargs.get("joint_attention_kwargs")
            if extra and extra.get("kv_cache") is not None:
                cache = seen["cache"]
                # The extracting step made the cache as long as the group's block list: one layer.
                for layers, count in (
                    (cache.double_block_caches, doubles),
                    (cache.single_block_caches, singles),
                ):
                    layers.extend(Flux2KVLayerCache() for _ in range(count - len(layers)))
                kwargs["joint_attention_kwargs"] = {**extra, "kv_cache": get(cache, index)}
            return args, kwargs

        return hook

    handles = []
    for name, blocks in (
        ("get_double", transformer.transformer_blocks),
        ("get_single", transformer.single_transformer_blocks),
    ):
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(routing(gets[name], i), with_kwargs=True))
    try:
        with contextlib.ExitStack() as stack:
            for name, get in gets.items():
                stack.enter_context(mock.patch.object(Flux2KVCache, name, remembering(get)))
            yield
    finally:
        for handle in handles:
            handle.remove()
