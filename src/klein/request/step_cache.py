"""Step caching as a request setting: `StepCache`, klein's form of cache-dit's DBCache settings, read from
itself, from text (`--cache threshold=0.2,warmup=4`) or from cache-dit's own objects (duck-typed: cache-dit
is never imported), and what it decides on the host before any step runs (each step's phase). The
decisions themselves are taken on the device (`klein.models.step_cache`). See docs/step-cache.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from klein.errors import InputError, WordedError
from klein.models.facts import CACHE, COMPUTE, DYNAMIC

if TYPE_CHECKING:
    from klein.models import step_cache

MAX_ORDER = 3
"""The highest TaylorSeer order accepted (cache-dit recommends 1 or 2; each order keeps one more residual)."""

_POLICIES = ("dynamic", "static")


@dataclasses.dataclass(frozen=True)
class StepCache:
    """DBCache settings (cache-dit's names in brackets). The defaults are cache-dit's recipe for FLUX.2
    [klein]: each group computes its first block, the double blocks reuse below a relative residual
    difference of 0.12 and the single blocks below three times that, after 8 steps of warm-up, at most 3
    steps in a row."""

    compute_first: int = 1
    """Blocks of each group computed at every step before the decision (Fn_compute_blocks)."""
    compute_last: int = 0
    """Blocks of each group computed at every step after the cached ones (Bn_compute_blocks)."""
    threshold: float = 0.12
    """The double blocks' residual-difference threshold (residual_diff_threshold): a step reuses when the
    first blocks' residual moved less than this, relatively, since the last step computed."""
    single_threshold: float | None = None
    """The single blocks' threshold (None: 3 x threshold, cache-dit's FLUX.2 params_modifiers)."""
    warmup: int = 8
    """Steps computed before any is reused (max_warmup_steps)."""
    warmup_interval: int = 1
    """Within the warm-up, only every this many steps is forced to compute (warmup_interval)."""
    max_cached: int = -1
    """Steps reused at most per image (max_cached_steps; -1: no limit)."""
    max_consecutive: int = 3
    """Steps reused at most in a row (max_continuous_cached_steps; -1: no limit)."""
    separate_cfg: bool = True
    """Under guidance, an image's prompt and negative pass decide apart, each against its own last
    residual (enable_separate_cfg); False: together, over both."""
    mask: tuple[int, ...] | None = None
    """One 0/1 per step, 1 computing (steps_computation_mask, as LeMiCa and EasyCache use); a 0 step
    reuses under `mask_policy`."""
    mask_policy: str = "dynamic"
    """What a mask's 0 steps do (steps_computation_policy): "dynamic" lets the threshold decide,
    "static" always reuses."""
    taylorseer_order: int = 0
    """Reused residuals extrapolated by TaylorSeer of this order from the steps computed (0: off)."""

    def __post_init__(self) -> None:
        for name in (
            "compute_first",
            "compute_last",
            "warmup",
            "warmup_interval",
            "max_cached",
            "max_consecutive",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(f"cache: {name} must be an integer, got {value!r}")
        _at_least("compute_first", self.compute_first, 1)
        _at_least("compute_last", self.compute_last, 0)
        _at_least("warmup", self.warmup, 0)
        _at_least("warmup_interval", self.warmup_interval, 1)
        _at_least("max_cached", self.max_cached, -1)
        _at_least("max_consecutive", self.max_consecutive, -1)
        for name in ("threshold", "single_threshold"):
            value = getattr(self, name)
            if value is None and name == "single_threshold":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
                raise InputError(f"cache: {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.separate_cfg, bool):
            raise InputError(f"cache: separate_cfg must be True or False, got {self.separate_cfg!r}")
        if self.mask_policy not in _POLICIES:
            raise InputError(f"cache: mask_policy must be 'dynamic' or 'static', got {self.mask_policy!r}")
        order = self.taylorseer_order
        if isinstance(order, bool) or not isinstance(order, int) or not 0 <= order <= MAX_ORDER:
            raise InputError(
                f"cache: taylorseer_order must be an integer from 0 (off) to {MAX_ORDER}, got {order!r}"
            )
        if self.mask is not None:
            mask = tuple(self.mask) if isinstance(self.mask, list | tuple) else None
            if not mask or any(isinstance(m, bool) or m not in (0, 1) for m in mask):
                raise InputError(
                    f"cache: mask must be a list of 0 and 1, one per step, got {self.mask!r:.200}"
                )
            object.__setattr__(self, "mask", tuple(int(m) for m in mask))

    @property
    def thresholds(self) -> tuple[float, float]:
        """(double blocks', single blocks') thresholds."""
        single = 3 * self.threshold if self.single_threshold is None else self.single_threshold
        return self.threshold, single

    @property
    def structure(self) -> step_cache.Structure:
        """What the step's program is built for (the rest is data)."""
        from klein.models import step_cache  # JAX's: imported when a program is built, not with a request

        return step_cache.Structure(self.compute_first, self.compute_last, self.taylorseer_order)

    def check(self, steps: int, double_blocks: int, single_blocks: int) -> None:
        """Refuse settings that cannot apply to a run of `steps` steps on a model of these blocks (the
        request's field `cache` at fault, for HTTP's `param`)."""
        for group, blocks in (("double", double_blocks), ("single", single_blocks)):
            if self.compute_first + self.compute_last >= blocks:
                raise WordedError(
                    f"cache: compute_first ({self.compute_first}) + compute_last ({self.compute_last}) must leave "
                    f"blocks to reuse, but this model has {blocks} {group} blocks: lower them",
                    "cache",
                )
        if self.mask is not None and len(self.mask) != steps:
            raise WordedError(
                f"cache: mask has {len(self.mask)} entries but {steps} steps run: give one 0 or 1 per step",
                "cache",
            )
        if self.mask_policy == "static" and self.mask is not None:
            first_reused = self.mask.index(0) if 0 in self.mask else steps
            if not any(self.phases(steps, kv=False)[:first_reused] == COMPUTE) and first_reused < steps:
                raise WordedError(
                    "cache: a static mask must compute a step (a 1) before its first 0", "cache"
                )

    def phases(self, steps: int, kv: bool) -> np.ndarray:
        """int32[steps]: each step's phase (`klein.models.step_cache`): warm-up and a mask's 1 compute, a
        static mask's 0 reuses, the rest is the threshold's. With cached references (`kv`) the second step
        computes too, as under cache-dit on diffusers' KV pipeline, whose first step runs the references
        along (a residual of another shape)."""
        leading = (
            steps
            if self.mask is None
            else next((i for i, m in enumerate(self.mask) if m == 0), len(self.mask))
        )
        warm = min(self.warmup, leading)
        phases = np.full(steps, DYNAMIC, np.int32)
        for s in range(steps):
            if s < warm and s % self.warmup_interval == 0:
                phases[s] = COMPUTE
            elif self.mask is not None and self.mask[s] == 1:
                phases[s] = COMPUTE
            elif self.mask is not None and self.mask_policy == "static":
                phases[s] = CACHE
            elif kv and s == 1:
                phases[s] = COMPUTE
        return phases

    def spec(self) -> str:
        """The settings as `parse` reads them back: "on", or the ones that differ from the defaults."""
        changed = [
            f"{f.name}={_word(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return ",".join(changed) or "on"

    @classmethod
    def parse(cls, text: str) -> StepCache | None:
        """ "on" (the defaults), "off", or NAME=VALUE words joined by commas: "threshold=0.2,warmup=4"
        (a mask as 0s and 1s: mask=11110101...)."""
        words = str(text).strip()
        if words.lower() in ("", "on", "true", "yes", "1"):
            return cls()
        if words.lower() in ("off", "none", "false", "no", "0"):
            return None
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for word in words.split(","):
            name, sep, value = word.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in known:
                raise InputError(
                    f"cache: {word.strip()!r} is not NAME=VALUE with a known name; names: {', '.join(known)}"
                )
            values[name] = _read(name, value.strip())
        return cls(**values)

    @classmethod
    def of(cls, value) -> StepCache | None:
        """A request's `cache` in any accepted form: None or False (off), True (the defaults), a
        `StepCache`, text (`parse`), a mapping of these names, cache-dit's `DBCacheConfig`, or a mapping of
        `cache_dit.enable_cache`'s arguments (cache_config, params_modifiers, calibrator_config)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, StepCache):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Mapping):
            if "cache_config" in value:
                extra = set(value) - {"cache_config", "params_modifiers", "calibrator_config"}
                if extra:
                    raise InputError(f"cache: unknown cache-dit argument {sorted(extra)[0]!r}")
                return from_cache_dit(**value)
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise InputError(
                    f"cache: unknown setting {sorted(unknown)[0]!r}; settings: {', '.join(sorted(known))}"
                )
            return cls(**value)
        if hasattr(value, "residual_diff_threshold"):
            return from_cache_dit(value)
        raise InputError(
            "cache must be True, a klein StepCache, settings like 'threshold=0.2,warmup=4', or cache-dit's "
            f"DBCacheConfig; got {type(value).__name__}"
        )


def from_cache_dit(cache_config, params_modifiers=None, calibrator_config=None) -> StepCache:
    """The `StepCache` of cache-dit's `enable_cache(pipe, cache_config=..., params_modifiers=...,
    calibrator_config=...)` on a FLUX.2 pipeline: params_modifiers, if given, one per block group (double,
    then single) and changing only the threshold; calibrator_config TaylorSeer's. What klein does not do
    is refused by name."""
    read = _Fields(cache_config, "cache_config")
    kind = str(read.get("cache_type", "DBCache"))
    if "DBCache" not in kind:
        raise InputError(f"cache: klein runs cache-dit's DBCache, not {kind}")
    for name, default in (
        ("max_accumulated_residual_diff_threshold", None),
        ("force_refresh_step_hint", None),
        ("cfg_compute_first", False),
        ("cfg_diff_compute_separate", True),
    ):
        if read.get(name, default) not in (default, None):
            raise InputError(
                f"cache: klein does not support cache-dit's {name} (give it its default, {default})"
            )
    separate = read.get("enable_separate_cfg", None)
    values = dict(
        compute_first=read.get("Fn_compute_blocks", 8),
        compute_last=read.get("Bn_compute_blocks", 0),
        threshold=read.get("residual_diff_threshold", 0.08),
        warmup=read.get("max_warmup_steps", 8),
        warmup_interval=read.get("warmup_interval", 1),
        max_cached=read.get("max_cached_steps", -1),
        max_consecutive=read.get("max_continuous_cached_steps", -1),
        separate_cfg=True if separate is None else bool(separate),
        mask=read.get("steps_computation_mask", None),
        mask_policy=read.get("steps_computation_policy", "dynamic"),
    )
    if params_modifiers:
        modifiers = list(params_modifiers)
        if len(modifiers) != 2:
            raise InputError(
                f"cache: params_modifiers must be two on FLUX.2 (double blocks, then single blocks), got {len(modifiers)}"
            )
        thresholds = []
        for index, modifier in enumerate(modifiers):
            config = getattr(modifier, "_context_kwargs", {}).get("cache_config") or getattr(
                modifier, "cache_config", None
            )
            fields = _Fields(config, f"params_modifiers[{index}].cache_config")
            changed = {k for k, v in fields.items() if v is not None} - {"residual_diff_threshold"}
            if changed:
                raise InputError(
                    f"cache: klein's block groups differ only in their threshold; params_modifiers[{index}] "
                    f"also sets {sorted(changed)[0]}"
                )
            thresholds.append(fields.get("residual_diff_threshold", values["threshold"]))
        values.update(threshold=thresholds[0], single_threshold=thresholds[1])
    else:
        values.update(single_threshold=values["threshold"])
    if calibrator_config is not None:
        calibrator = _Fields(calibrator_config, "calibrator_config")
        if calibrator.get("calibrator_type", "taylorseer") != "taylorseer":
            raise InputError(
                f"cache: klein's only calibrator is TaylorSeer, not {calibrator.get('calibrator_type')}"
            )
        if not (
            calibrator.get("enable_calibrator", True) and calibrator.get("enable_encoder_calibrator", True)
        ):
            raise InputError(
                "cache: TaylorSeer runs on both streams in klein: enable_calibrator and enable_encoder_calibrator"
            )
        if calibrator.get("calibrator_cache_type", "residual") != "residual":
            raise InputError(
                "cache: TaylorSeer extrapolates residuals in klein (calibrator_cache_type 'residual')"
            )
        values["taylorseer_order"] = calibrator.get("taylorseer_order", 1)
    return StepCache(**values)


class _Fields:
    """The fields of a cache-dit config object (a dataclass) or mapping, by name."""

    def __init__(self, config, what: str):
        if isinstance(config, Mapping):
            self._values = dict(config)
        elif dataclasses.is_dataclass(config):
            self._values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        else:
            raise InputError(f"cache: {what} must be a cache-dit config, got {type(config).__name__}")

    def get(self, name, default):
        value = self._values.get(name, default)
        return default if value is None else value

    def items(self):
        return self._values.items()


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise InputError(f"cache: {name} must be at least {low}, got {value}")


def _word(value) -> str:
    if isinstance(value, tuple):
        return "".join(map(str, value))
    return str(value)


def _read(name: str, text: str):
    """One NAME=VALUE's value, by the field's kind."""
    if name == "mask":
        if text.lower() == "none":
            return None
        if not text or set(text) - {"0", "1"}:
            raise InputError(f"cache: mask must be 0s and 1s, one per step (mask=111101...), got {text!r}")
        return tuple(int(c) for c in text)
    if name == "mask_policy":
        return text
    if name == "separate_cfg":
        words = {
            "true": True,
            "yes": True,
            "on": True,
            "1": True,
            "false": False,
            "no": False,
            "off": False,
            "0": False,
        }
        if text.lower() not in words:
            raise InputError(f"cache: separate_cfg must be true or false, got {text!r}")
        return words[text.lower()]
    if name == "single_threshold" and text.lower() == "none":
        return None
    try:
        number = float(text)
    except ValueError:
        raise InputError(f"cache: {name} must be a number, got {text!r}") from None
    if name in ("threshold", "single_threshold"):
        return number
    if not number.is_integer():
        raise InputError(f"cache: {name} must be an integer, got {text!r}")
    return int(number)
