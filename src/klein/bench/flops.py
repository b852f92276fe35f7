"""FLOP model of the transformer: the work of each benchmark case, and what the KV cache can save at best.

Axes: T text tokens, N output image tokens, R reference tokens (all references), D width, L layers.

Assumptions (they reproduce docs/design.md, "FLOP model"): every block, double or single, costs each token it
processes 26 D^2 FLOPs in its Linears (13 D^2 multiply-adds: double = q, k, v, out 4 D^2 + SwiGLU in
6 D^2 + out 3 D^2; single = fused in 9 D^2 + out 4 D^2), and its attention costs 4 Sq Sk D FLOPs
(Q K^T and A V over Sq queries and Sk keys). Embedders, modulation, norms, RoPE and softmax are
left out (under 0.1% at 9b); so are the text encoder and the VAE, which the KV cache does not touch.
The model counts the work of the plain formulation (every block over every token it is given), so
both engines are credited the same FLOPs for the same case: FLOP/s divided by it compare like for like.
"""

from __future__ import annotations

from klein.models.transformer_config import TransformerConfig


def layer_flops(width: int, queries: int, keys: int) -> float:
    """One block: Linears over `queries` tokens plus attention of `queries` over `keys`."""
    return 26.0 * width * width * queries + 4.0 * queries * keys * width


def _pass(cfg: TransformerConfig, queries: int, keys: int) -> float:
    return (cfg.num_layers + cfg.num_single_layers) * layer_flops(cfg.hidden, queries, keys)


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
