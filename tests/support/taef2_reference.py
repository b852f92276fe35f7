"""The reference TAEF2 decoder for parity tests: the architecture of `Decoder(32, use_midblock_gn=True)` in
github.com/madebyollin/taesd's `taesd.py`, re-typed here in torch for the tests (that file is not on PyPI,
and diffusers' `AutoencoderTiny` has no GroupNorm branch). Its `state_dict()` keys are the published
decoder's (`1.weight`, `3.pool.1.bias`, ...), so random weights saved from it are a file in TAEF2's layout.
"""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn


def _conv(cin: int, cout: int, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1, **kwargs)


class _SoftClamp(nn.Module):
    def forward(self, x):
        return 3 * torch.tanh(x / 3)


class _Block(nn.Module):
    def __init__(self, channels: int, pooled: bool):
        super().__init__()
        self.conv = nn.Sequential(
            _conv(channels, channels),
            nn.ReLU(),
            _conv(channels, channels),
            nn.ReLU(),
            _conv(channels, channels),
        )
        self.skip = nn.Identity()
        self.fuse = nn.ReLU()
        wide = 4 * channels
        self.pool = (
            nn.Sequential(
                nn.Conv2d(channels, wide, 1, bias=False),
                nn.GroupNorm(4, wide),
                nn.ReLU(),
                nn.Conv2d(wide, channels, 1, bias=False),
            )
            if pooled
            else None
        )

    def forward(self, x):
        if self.pool is not None:
            x = x + self.pool(x)
        return self.fuse(self.conv(x) + self.skip(x))


def reference_decoder(latent_channels: int = 32, seed: int = 0) -> nn.Sequential:
    """The decoder with random weights (normal GroupNorm affines too, so that they matter), in eval mode."""
    torch.manual_seed(seed)
    width = 64

    def level(pooled: bool, count: int = 3):
        return [_Block(width, pooled) for _ in range(count)]

    def up():
        return [nn.Upsample(scale_factor=2), _conv(width, width, bias=False)]

    decoder = nn.Sequential(
        _SoftClamp(),
        _conv(latent_channels, width),
        nn.ReLU(),
        *level(True),
        *up(),
        *level(False),
        *up(),
        *level(False),
        *up(),
        *level(False, 1),
        _conv(width, 3),
    )
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, nn.GroupNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    return decoder.eval()


def save_reference(decoder: nn.Sequential, path, layout: str = "decoder", dtype=torch.float16) -> None:
    """Save `decoder`'s weights as TAEF2's files hold them: "decoder" (taef2_decoder.safetensors), "module"
    (a whole TAESD module's state, under decoder.) or "diffusers" (taef2.safetensors: decoder.layers.{i-1}),
    the last two beside a stand-in encoder weight, which loading must pass over."""
    state = {k: v.to(dtype).contiguous() for k, v in decoder.state_dict().items()}
    if layout == "module":
        state = {f"decoder.{k}": v for k, v in state.items()}
    elif layout == "diffusers":
        state = {
            f"decoder.layers.{int(k.split('.')[0]) - 1}.{k.split('.', 1)[1]}": v for k, v in state.items()
        }
    if layout != "decoder":
        state["encoder.layers.0.weight" if layout == "diffusers" else "encoder.0.weight"] = torch.zeros(
            64, 3, 3, 3, dtype=dtype
        )
    save_file(state, str(path))


def reference_frames(decoder, latents: np.ndarray, h: int, w: int) -> np.ndarray:
    """The reference's [B, 16h, 16w, 3]: tokens to a [B, 128, h, w] grid, unpatchified as ComfyUI feeds
    TAEF2 (channel 4c + 2dy + dx is channel c at pixel (2i + dy, 2j + dx))."""
    b = latents.shape[0]
    grid = torch.from_numpy(np.array(latents, np.float32)).reshape(b, h, w, 128).permute(0, 3, 1, 2)
    z = grid.reshape(b, 32, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, 32, 2 * h, 2 * w)
    with torch.no_grad():
        return decoder(z).permute(0, 2, 3, 1).numpy()
