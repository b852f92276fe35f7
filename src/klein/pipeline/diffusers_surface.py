"""diffusers' pipeline methods around a call, so that a diffusers script runs with only its import changed
(docs/requests.md, "Scripts written for diffusers"). Dtypes and devices are read by their names, so klein
never imports torch; offloading is a residency policy (`klein.memory.residency`); the call's own arguments
are `klein.request.diffusers_args`'.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping

import jax
import numpy as np

from klein import sharding
from klein.dtypes import DTYPES
from klein.errors import InputError
from klein.memory import residency as residency_policy
from klein.models.variants import VARIANTS
from klein.pipeline import admitting, preview, reading
from klein.pipeline.cache import ByteBudgetCache
from klein.pipeline.output import GenerationOutput
from klein.pipeline.progress_bar import CallBar
from klein.request import diffusers_args
from klein.request.loading import LoadOptions
from klein.request.request import GenerationRequest

_TORCH_PLATFORMS = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu", "xla": "tpu"}
"""torch's (and jax's) device types, as jax names the platform of a device."""
_HUB_DEFAULTS = {
    "revision": ("main",),
    "cache_dir": (),
    "force_download": (False,),
    "proxies": (),
    "token": (),
}
"""diffusers' download arguments klein takes only at their defaults (None or these): it fetches a repo id
itself, into the default Hugging Face cache (`klein.io.sources`)."""
_NO_EFFECT = ("low_cpu_mem_usage", "output_loading_info")
"""diffusers' loading arguments that change nothing in klein: each weight is read straight to its place."""


def dtype_name(value, call: str | None = None) -> str | None:
    """klein's name of a dtype given as torch's (`torch.bfloat16`), NumPy's or a name ("bfloat16");
    None for None or "auto" (the dtype the checkpoint stores). An `InputError` for a dtype klein does not
    compute in, saying where it was given (`call`, by default `torch_dtype=...`)."""
    call = call or f"torch_dtype={value!r}"
    if value is None or value == "auto":
        return None
    if isinstance(value, Mapping):  # diffusers' per-model dtypes: klein computes every model in one
        dtypes = {dtype_name(one, call) for one in value.values()}
        if len(dtypes) != 1:
            raise InputError(
                f"{call} gives the models different dtypes; klein computes every model in one: pass one of "
                f"{', '.join(DTYPES)}"
            )
        return dtypes.pop()
    text = str(value)
    if not (isinstance(value, str) or text.startswith("torch.")):
        try:
            text = np.dtype(value).name
        except TypeError:
            text = repr(value)
    name = text.removeprefix("torch.")
    if name not in DTYPES:
        raise InputError(
            f"{call}: klein computes in {' or '.join(DTYPES)}; pass torch.bfloat16 (what every "
            "published klein checkpoint stores) or torch.float32"
        )
    return name


def load_options(pretrained_model_name_or_path=None, **kwargs) -> tuple[dict, str | None]:
    """(`LoadOptions` fields, the device asked for by `device_map`) of a `from_pretrained` call."""
    options = dict(kwargs)
    if "torch_dtype" in options:
        if options.get("dtype") is not None:
            raise InputError("give torch_dtype or dtype, not both")
        options["dtype"] = dtype_name(options.pop("torch_dtype"))
    else:
        options["dtype"] = dtype_name(options.get("dtype"), f"dtype={options.get('dtype')!r}")
    variant = options.get("variant")
    if variant is not None and variant not in VARIANTS:
        raise InputError(
            f"variant={variant!r} names diffusers' weight files (diffusion_pytorch_model.{variant}.safetensors); "
            f"klein reads a checkpoint's own files and computes in torch_dtype: drop variant= (klein's "
            f"variant names a single transformer file's model: {', '.join(VARIANTS)})"
        )
    if options.pop("use_safetensors", None) is False:
        raise InputError("use_safetensors=False: klein reads safetensors (and GGUF) files only; drop it")
    for name in _NO_EFFECT:
        options.pop(name, None)
    for name, defaults in _HUB_DEFAULTS.items():
        value = options.pop(name, None)
        if value is not None and value not in defaults:
            raise InputError(
                f"{name}={value!r}: klein fetches a repo id itself, into the default Hugging Face cache; "
                f"fetch it as you need (`hf download REPO --local-dir DIR`, with its --revision or --token) "
                f"and pass the folder"
            )
    if options.pop("local_files_only", False):
        _check_local(pretrained_model_name_or_path)
    device = options.pop("device_map", None)
    if device is not None and (
        isinstance(device, Mapping) or str(device).split(":")[0] not in _TORCH_PLATFORMS
    ):
        raise InputError(
            f"device_map={device!r} spreads diffusers' models over devices; klein shards every model over "
            "all of them with mesh='fsdp' (or places the pipeline on one device with no device_map)"
        )
    if options.pop("quantization_config", None) is not None:
        raise InputError(
            "quantization_config is not read: klein loads FP8, NVFP4 and GGUF files as they are "
            "(transformer=FILE) and makes 8-bit products with compute='fp8' or 'int8'"
        )
    for part in ("transformer", "text_encoder", "vae", "tokenizer"):
        value = options.get(part)
        if value is not None and not isinstance(value, str | os.PathLike):
            raise InputError(
                f"{part}= takes a path (a file, a folder or a repo id), not a loaded {type(value).__name__}: "
                "klein reads every part itself"
            )
    known = {field for field in LoadOptions.__dataclass_fields__ if field != "model"} | {"loras"}
    unknown = sorted(set(options) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = (
            f"did you mean {close[0]}?" if close else f"klein's loading options: {', '.join(sorted(known))}"
        )
        raise InputError(f"from_pretrained does not take {unknown[0]}; {hint}")
    return options, device


def _check_local(source) -> None:
    """`local_files_only=True`: a repo id must be in the Hugging Face cache already (klein would fetch it)."""
    source = str(source)
    if source == "demo" or os.path.exists(source) or source.count("/") != 1:
        return
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(source, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - every cache miss reads the same to the user
        raise InputError(
            f"{source} is not in the local Hugging Face cache, and local_files_only=True forbids fetching it"
        ) from exc


def check_device(devices, device, call: str) -> None:
    """Refuse `device` (torch's name of a device, or a torch.device) unless the pipeline, on `devices`, is on
    it: klein places weights as it reads them, so a pipeline does not move."""
    text = str(device)
    kind, _, index = text.partition(":")
    platform = _TORCH_PLATFORMS.get(kind)
    have = f"jax.devices(): {_listing(jax.devices())}"
    if platform is None:
        raise InputError(f"{call}: klein runs on cuda, cpu or tpu devices, not {text!r} ({have})")
    if any(d.platform == platform and (not index or str(d.id) == index) for d in devices):
        return
    if not any(d.platform == platform for d in jax.devices()):
        plugin = "install jax's CUDA plugin (pip install 'jax[cuda12]') and " if platform == "gpu" else ""
        how = f"{plugin}drop the call to run where the pipeline is"
    elif any(d.platform == platform for d in devices):
        how = "klein loads onto jax's first device: choose it with CUDA_VISIBLE_DEVICES, or shard with mesh="
    else:
        how = f"start Python with JAX_PLATFORMS={platform}: klein loads onto jax's first device"
    raise InputError(
        f"{call}: the pipeline is on {_listing(devices)}, where klein placed its weights as it read them, "
        f"not on {text} ({have}); {how}"
    )


def _listing(devices) -> str:
    return ", ".join(f"{d.platform}:{d.id}" for d in devices)


class DiffusersSurface:
    """diffusers' call, loading, device and offloading methods of `Flux2KleinPipeline`."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path=None, **kwargs):
        """Load as diffusers' `from_pretrained` does: a Hugging Face repo id, a diffusers-layout folder or
        "demo"; `torch_dtype=torch.bfloat16` or "bfloat16" (read by name: klein does not import torch);
        any of klein's loading options (`residency`, `compute`, `memory_cap`, `mesh`, `loras`, ...).
        diffusers' `low_cpu_mem_usage` changes nothing (each weight is read straight to its place);
        `device_map="cuda"` checks the device as `.to` does; download arguments other than their defaults
        and `use_safetensors=False` are refused saying what to do."""
        options, device = load_options(pretrained_model_name_or_path, **kwargs)
        if "loras" in options:
            options["lora"] = options.pop("loras")
        model = None if pretrained_model_name_or_path is None else str(pretrained_model_name_or_path)
        pipe = cls(reading.read(LoadOptions(model=model, **options)))
        if device is not None:
            check_device(pipe.devices, device, f"device_map={device!r}")
        return pipe

    def __call__(self, prompt=None, *, progress=None, **settings) -> GenerationOutput | tuple:
        """Generate from a `GenerationRequest`, or from a prompt and settings named as its fields, by
        keyword as diffusers' scripts pass them (`pipe(prompt=..., image=[...], num_inference_steps=...)`)
        or with the prompt first. diffusers' other arguments (`generator`, `return_dict`,
        `callback_on_step_end`, ...) are read or refused by `klein.request.diffusers_args`; klein's own
        `preview=True` (or TAEF2's path) adds each step's frames to the callback's dict as "preview".
        `progress(event)` hears of every stage and step (`klein.pipeline.stage_events.StageEvent`); without
        one, a tqdm bar on stderr shows them (`set_progress_bar_config`)."""
        settings, options = diffusers_args.split(settings)
        if isinstance(prompt, GenerationRequest):
            request = dataclasses.replace(prompt, **settings) if settings else prompt
        else:
            request = GenerationRequest.create(prompt=prompt, **settings)
        bar = None if progress is not None or self._bar_options.get("disable") else CallBar(self._bar_options)
        step_end = options.callback_on_step_end
        channels = self.vae_config.latent_channels
        previews = preview.previewer(options.preview, channels) if options.preview else None

        def on_step_end(i, t, latents, grid):
            return step_end(self, i, t, preview.StepKwargs(latents, grid, previews))

        try:
            out = self.generate(request, progress or bar, on_step_end=step_end and on_step_end)
        finally:
            if bar:
                bar.close()
        return out if options.return_dict else (out.images,)

    def to(self, *args, device=None, dtype=None, silence_dtype_warnings: bool = False):
        """diffusers' `.to(device)`, `.to(dtype)` or both: returns the pipeline, which is already where
        klein placed its weights as it read them, in the dtype it loaded; anything else is refused naming
        what the pipeline has (the devices jax has, or the dtype to load with). klein prints no dtype
        warning to silence."""
        for arg in args:  # torch's dtypes print as "torch.bfloat16", its devices as "cuda:0"
            if str(arg).startswith("torch.") or str(arg) in DTYPES or isinstance(arg, np.dtype | type):
                dtype = arg
            else:
                device = arg
        if device is not None:
            check_device(self.devices, device, f"pipe.to({str(device)!r})")
        if dtype is not None and dtype_name(dtype, f"pipe.to({dtype!r})") != self.dtype.name:
            raise InputError(
                f"pipe.to({dtype!r}): the pipeline computes in {self.dtype.name}, chosen when it loads: "
                f"load it with from_pretrained(..., torch_dtype={dtype!r})"
            )
        return self

    def set_progress_bar_config(self, **options) -> None:
        """tqdm options for the bar each call draws, as diffusers' method: `disable=True` turns it off."""
        self._bar_options = dict(options)

    @property
    def devices(self) -> list:
        """The jax devices of this process the pipeline's weights are on."""
        return sharding.local_devices(self.mesh)

    def enable_model_cpu_offload(self, gpu_id: int | None = None, device=None) -> None:
        """diffusers' model offloading, as klein's `sequential` residency: the text encoder and the
        transformer take turns on the device (the VAE, 1% of the weights, stays)."""
        self._offload("sequential", gpu_id, device, "enable_model_cpu_offload")

    def enable_sequential_cpu_offload(self, gpu_id: int | None = None, device=None) -> None:
        """diffusers' layer-by-layer offloading, as klein's `stream` residency: as `sequential`, with each
        model's stacked layers in host memory, brought to the device as the loop reaches them (the text
        encoder and the transformer are read again, their layers into host memory)."""
        self._offload("stream", gpu_id, device, "enable_sequential_cpu_offload")

    def _offload(self, policy: str, gpu_id, device, call: str) -> None:
        if device is not None or gpu_id is not None:
            kind = str(device or "cuda").partition(":")[0]
            check_device(self.devices, kind if gpu_id is None else f"{kind}:{gpu_id}", f"{call}()")
        admitting.forget(self)  # a policy its user set stays
        order = list(residency_policy.POLICIES)  # from the one holding the most on the device
        if order.index(policy) <= order.index(self.residency):
            return  # the pipeline already holds no more than `policy` would
        if policy in residency_policy.STREAMS:
            for name in residency_policy.STACKS:
                self._models[name].reread(self.readers(policy)[name])
        self.residency = policy
        if self.prompt_cache is None:  # a new prompt alone now brings the text encoder back: keep them
            self.prompt_cache = ByteBudgetCache(residency_policy.PROMPT_CACHE_BYTES)
