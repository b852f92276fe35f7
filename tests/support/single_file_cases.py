"""What the single-file tests share: one forward pass of ours and of diffusers."""

import jax
import numpy as np
from flax import nnx

from klein.models import transformer as T
from tests.support.transformer_inputs import jx, make_case, ropes, torch_call


def both_outputs(ours, reference, seed=0, batch=2, width=96):
    """(our velocity, diffusers' velocity) on the same random text-to-image input, as float32 numpy."""
    case = make_case(seed, batch, width=width)
    img_rope, txt_rope = ropes(ours, case.img_ids, case.txt_ids)
    graphdef, state = nnx.split(ours)
    # One compiled program instead of hundreds of eagerly dispatched ops: much faster on CPU.
    run = jax.jit(lambda state, *args: T.forward(nnx.merge(graphdef, state), *args))
    got = run(state, *jx(case.img, case.txt, case.t), img_rope, txt_rope)
    return np.asarray(got, np.float32), torch_call(reference, case)[0].numpy()
