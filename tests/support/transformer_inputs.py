"""Inputs shared by the transformer tests: tokens, position ids (as the diffusers pipelines make them)
and the same call made on diffusers' model and on ours."""

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.sampling import image_ids, reference_ids, text_ids

# Each compiled whole: one program per model shape and way of running it, where running it eagerly
# compiles many small ones (the parity grid's time is mostly compiling).
forward = nnx.jit(T.forward)
prefill = nnx.jit(T.prefill)
forward_cached = nnx.jit(T.forward_cached)
forward_kv_uncached = nnx.jit(T.forward_kv_uncached)


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


def torch_call(model, case: Case, img=None, img_ids=None, txt=None, **kwargs):
    img = case.img if img is None else img
    img_ids = case.img_ids if img_ids is None else img_ids
    txt = case.txt if txt is None else txt
    with torch.no_grad():
        return model(
            hidden_states=torch.from_numpy(np.ascontiguousarray(img)),
            encoder_hidden_states=torch.from_numpy(np.ascontiguousarray(txt)),
            timestep=torch.from_numpy(case.t),
            img_ids=torch.from_numpy(img_ids),
            txt_ids=torch.from_numpy(case.txt_ids),
            return_dict=False,
            **kwargs,
        )


def jx(*arrays):
    return [jnp.asarray(a) for a in arrays]


def ours_plain(model, case: Case, refs=None) -> np.ndarray:
    """Our `forward` on `case`: text-to-image, or standard editing with `refs` = (tokens, rope)."""
    img_rope, txt_rope = ropes(model, case.img_ids, case.txt_ids)
    return np.asarray(forward(model, *jx(case.img, case.txt, case.t), img_rope, txt_rope, refs=refs))


def diffusers_references(model, case: Case) -> np.ndarray:
    """Diffusers' standard editing on `case`: its references appended to the image tokens, full attention;
    the image tokens' velocity."""
    batch = case.img.shape[0]
    joint = np.concatenate([case.img, np.broadcast_to(case.ref, (batch, *case.ref.shape))], axis=1)
    ids = np.concatenate([case.img_ids, case.ref_ids])
    return torch_call(model, case, img=joint, img_ids=ids)[0].numpy()[:, : case.img.shape[1]]


def diffusers_extract(model, case: Case):
    """Diffusers' KV step 0 on `case` (model with `with_kv_processors`): (velocity, reference cache)."""
    batch = case.img.shape[0]
    joint = np.concatenate([np.broadcast_to(case.ref, (batch, *case.ref.shape)), case.img], axis=1)
    ids = np.concatenate([case.ref_ids, case.img_ids])
    out, cache = torch_call(
        model, case, img=joint, img_ids=ids, kv_cache_mode="extract", num_ref_tokens=case.ref.shape[0]
    )
    return out.numpy(), cache


def ours_kv(model, case: Case):
    """Our prefill of `case`'s references and a cached step with it: (velocity, `ReferenceKV`)."""
    img_rope, txt_rope, ref_rope = ropes(model, case.img_ids, case.txt_ids, case.ref_ids)
    kv = prefill(model, jx(case.ref)[0], ref_rope)
    out = forward_cached(model, *jx(case.img, case.txt, case.t), img_rope, txt_rope, kv)
    return np.asarray(out), kv
