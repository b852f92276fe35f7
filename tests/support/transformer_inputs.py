"""Inputs shared by the transformer tests: tokens, position ids (as the diffusers pipelines make them)
and the same call made on diffusers' model and on ours."""

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import torch

from klein.models.rope import rope_tables
from klein.sampling import image_ids, reference_ids, text_ids


@dataclass
class Case:
    img: np.ndarray  # [B, N, C]
    txt: np.ndarray  # [B, T, J]
    t: np.ndarray  # [B]
    img_ids: np.ndarray
    txt_ids: np.ndarray
    ref: np.ndarray | None = None  # [R, C]
    ref_ids: np.ndarray | None = None


def make_case(seed, batch, hw=(4, 6), n_txt=8, ref_sizes=(), t=None, width=96) -> Case:
    rng = np.random.default_rng(seed)
    n_img = hw[0] * hw[1]
    n_ref = sum(h * w for h, w in ref_sizes)
    return Case(
        img=rng.standard_normal((batch, n_img, 128)).astype(np.float32),
        txt=rng.standard_normal((batch, n_txt, width)).astype(np.float32),
        t=np.asarray(t if t is not None else rng.uniform(0.1, 1.0, batch), np.float32),
        img_ids=image_ids(*hw),
        txt_ids=text_ids(n_txt),
        ref=rng.standard_normal((n_ref, 128)).astype(np.float32) if ref_sizes else None,
        ref_ids=reference_ids(ref_sizes) if ref_sizes else None,
    )


def ropes(model, *ids):
    cfg = model.cfg
    return [rope_tables(i, cfg.axes_dims_rope, cfg.rope_theta) for i in ids]


def torch_call(model, case: Case, img=None, img_ids=None, **kwargs):
    img = case.img if img is None else img
    img_ids = case.img_ids if img_ids is None else img_ids
    with torch.no_grad():
        return model(
            hidden_states=torch.from_numpy(img),
            encoder_hidden_states=torch.from_numpy(case.txt),
            timestep=torch.from_numpy(case.t),
            img_ids=torch.from_numpy(img_ids),
            txt_ids=torch.from_numpy(case.txt_ids),
            return_dict=False,
            **kwargs,
        )


def jx(*arrays):
    return [jnp.asarray(a) for a in arrays]
