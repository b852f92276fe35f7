"""The models as pure math (Flax NNX): the FLUX.2 [klein] transformer (`transformer`, `blocks`, `layers`,
`attention`, `rope`, `stacks`), the Qwen3 text encoder (`qwen3`) and the VAE (`vae`), with their configs, and the published variants
(`variants`: which configs, steps and guidance each checkpoint has).

Axes, one legend for every module of the package: B batch; T text tokens, N image tokens, R reference
tokens (all references of a request), S a joint sequence of them; C latent channels per token (128), J
text-embedding width, D model width, M MLP width; L layers; H attention heads (query heads), K key/value
heads (Qwen3's grouped queries), Dh head dim; E hidden states selected for the prompt embedding (3).
Images (the VAE): Y, X height and width in pixels, y, x the VAE's latent grid (Y/8, X/8).

Reads no file and imports nothing of klein but `klein.sharding` (layout constraints) and `klein.errors`.
"""
