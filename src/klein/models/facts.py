"""What requests and flags know of the models without loading them (nor JAX): the pixels of a token, a
step's phase under a step cache, the name of 8-bit reference keys and values. The modules that use them
(`vae`, `step_cache`, `reference_kv8`) take them from here."""

PIXELS_PER_TOKEN = 16
"""Pixels along each side of one transformer token under the FLUX.2 VAE (8x downsampling, then 2x2 patches),
for code with no model config at hand (requests, images); code that has one reads `pixels_per_token`."""

DYNAMIC, COMPUTE, CACHE = 0, 1, 2
"""A step's phase, decided on the host from its index alone: the threshold decides (DYNAMIC), the step
computes (warm-up, a mask's 1) or it reuses (a static mask's 0)."""

KV_INT8 = "int8"
"""`kv_dtype` of 8-bit keys and values (`klein.request.loading.KV_DTYPES`); None keeps them in the compute
dtype."""
