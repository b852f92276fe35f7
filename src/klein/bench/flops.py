"""FLOP model of the transformer: the work of each benchmark case, and what the KV cache can save at best
(docs/benchmarks.md, "KV ceiling"; it reproduces docs/design.md, "FLOP model").

Every block, double or single, costs each token it processes 26 D^2 FLOPs in its Linears (D the width; 13 D^2
multiply-adds: double = q, k, v, out 4 D^2 + SwiGLU in 6 D^2 + out 3 D^2; single = fused in 9 D^2 + out 4 D^2),
and its attention 4 Sq Sk D (Q K^T and A V over Sq queries and Sk keys). Embedders, modulation, norms, RoPE
and softmax are left out (under 0.1% at 9b). It counts the plain formulation (every block over every token
it is given), so both engines are credited the same FLOPs for the same case. `text_encoder_flops` and
`decode_flops` count the stages the KV cache does not touch, for `klein.bench.roofline`.
"""

from __future__ import annotations

from klein.models.qwen3 import PROMPT_LAYERS
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import VAEConfig


def product_share(cfg: TransformerConfig, queries: int, keys: int) -> float:
    """The part of a pass's FLOPs made in the blocks' Linears (what 8-bit products multiply), the rest
    being attention."""
    return _pass(cfg, queries, 0) / _pass(cfg, queries, keys)


def _pass(cfg: TransformerConfig, queries: int, keys: int) -> float:
    """Every block: Linears over `queries` tokens plus attention of `queries` over `keys`."""
    per_block = 26.0 * cfg.hidden * cfg.hidden * queries + 4.0 * queries * keys * cfg.hidden
    return (cfg.num_layers + cfg.num_single_layers) * per_block


def standard_flops(cfg: TransformerConfig, n_txt: int, n_img: int, n_ref: int, steps: int) -> float:
    """Text-to-image (n_ref = 0) or standard editing: every step runs [txt, img, ref] in full."""
    tokens = n_txt + n_img + n_ref
    return steps * _pass(cfg, tokens, tokens)


def prefill_flops(cfg: TransformerConfig, n_ref: int) -> float:
    """The reference prefill: reference tokens alone, attending to themselves."""
    return _pass(cfg, n_ref, n_ref)


def cached_flops(cfg: TransformerConfig, n_txt: int, n_img: int, n_ref: int, steps: int) -> float:
    """Steps over [txt, img] whose attention also reads the cached reference keys and values."""
    return steps * _pass(cfg, n_txt + n_img, n_txt + n_ref + n_img)


def kv_flops(cfg: TransformerConfig, n_txt: int, n_img: int, n_ref: int, steps: int, warm: bool) -> float:
    """KV editing: the cached steps, plus the prefill unless the references are already warm."""
    return cached_flops(cfg, n_txt, n_img, n_ref, steps) + (0.0 if warm else prefill_flops(cfg, n_ref))


def kv_ceiling(cfg: TransformerConfig, n_txt: int, n_img: int, n_ref: int, steps: int, warm: bool) -> float:
    """Standard-editing FLOPs over KV-editing FLOPs: with the cache built in the run, or already warm."""
    return standard_flops(cfg, n_txt, n_img, n_ref, steps) / kv_flops(cfg, n_txt, n_img, n_ref, steps, warm)


def text_encoder_flops(config: Qwen3Config, prompts: int, tokens: int) -> float:
    """The decoder layers the prompt embedding runs (up to the deepest of `PROMPT_LAYERS`) over `prompts`
    x `tokens`: q, k, v, o and the SwiGLU MLP, and attention over every token (causality not subtracted)."""
    c = config
    projections = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    per_token = 2.0 * (projections + 3 * c.hidden_size * c.intermediate_size)
    per_token += 4.0 * tokens * c.num_attention_heads * c.head_dim
    return max(PROMPT_LAYERS) * prompts * tokens * per_token


def decode_flops(vae: VAEConfig, images: int, height: int, width: int) -> float:
    """The VAE decoder over `images` latents of `height` x `width` px: its 3x3 and 1x1 convolutions (each
    upsampler as a 3x3 convolution at the output resolution) and the mid block's single-head attention."""
    widths = tuple(reversed(vae.decoder_channels))  # lowest resolution first, as the decoder runs
    pixels = (height // vae.downscale) * (width // vae.downscale)

    def conv(cin: int, cout: int, size: int, at: int) -> float:
        return 2.0 * size * size * cin * cout * at

    def resnet(cin: int, cout: int, at: int) -> float:
        return (
            conv(cin, cout, 3, at) + conv(cout, cout, 3, at) + (conv(cin, cout, 1, at) if cin != cout else 0)
        )

    total = conv(vae.latent_channels, widths[0], 3, pixels) + 2 * resnet(widths[0], widths[0], pixels)
    if vae.mid_block_add_attention:  # q, k, v, out projections and Q K^T, A V over every position
        total += 4 * conv(widths[0], widths[0], 1, pixels) + 4.0 * pixels * pixels * widths[0]
    channels = widths[0]
    for level, width in enumerate(widths):
        for _ in range(vae.layers_per_block + 1):
            total += resnet(channels, width, pixels)
            channels = width
        if level < len(widths) - 1:
            pixels *= 4
            total += conv(width, width, 3, pixels)
    return images * (total + conv(channels, vae.out_channels, 3, pixels))
