"""The models as pure math (Flax NNX): the FLUX.2 [klein] transformer (`transformer`, `blocks`, `layers`,
`attention`, `rope`, `stacks`), the Qwen3 text encoder (`qwen3`) and the VAE (`vae`), with their configs.

Axes, in every module of the package: B batch, N image tokens, R reference tokens (all references of a
request), T text tokens, S a sequence of any of them, C latent channels per token (128), J text-embedding
width, D model width, L layers, H attention heads, Dh head dim; in the VAE, H and W are the pixel or latent
height and width and Ch the channels.

Reads no file and imports nothing of klein but `klein.sharding` (layout constraints) and `klein.errors`.
"""
