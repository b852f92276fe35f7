"""The schedule against the check values of docs/design.md and diffusers' scheduler as the klein pipeline drives it."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

from klein import sampling


def test_check_values():
    np.testing.assert_allclose(sampling.sigmas(4, 1024), [1, 0.95809, 0.88398, 0.71750, 0], atol=1e-5)
    np.testing.assert_allclose(sampling.sigmas(4, 4096), [1, 0.96738, 0.90814, 0.76720, 0], atol=1e-5)


@pytest.mark.parametrize("tokens", [16, 1024, 4096, 4301, 9000])
@pytest.mark.parametrize("steps", [1, 4, 50])
def test_schedule_equals_diffusers(tokens, steps):
    assert sampling.empirical_mu(tokens, steps) == pytest.approx(
        compute_empirical_mu(tokens, steps), rel=1e-12
    )
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    base = np.linspace(1.0, 1 / steps, steps)
    retrieve_timesteps(scheduler, steps, "cpu", sigmas=base, mu=compute_empirical_mu(tokens, steps))
    np.testing.assert_allclose(sampling.sigmas(steps, tokens), scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens", [12, 4096, 9000])
@pytest.mark.parametrize("given,shift_steps", [([1.0, 0.7, 0.3], 3), ([0.9, 0.6, 0.35, 0.1], 50), ([0.8], 4)])
def test_a_given_schedule_is_shifted_as_diffusers_shifts_it(tokens, given, shift_steps):
    """As the klein pipelines drive the scheduler: the given sigmas set the steps, the call's
    num_inference_steps only mu."""
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    _, steps = retrieve_timesteps(
        scheduler, shift_steps, "cpu", sigmas=given, mu=compute_empirical_mu(tokens, shift_steps)
    )
    got = sampling.sigmas(shift_steps, tokens, given)
    assert steps == len(given) == len(got) - 1
    np.testing.assert_allclose(got, scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)
    # Sensitivity: read at the run's own length instead, the shift differs wherever mu depends on it.
    if tokens <= 4300 and shift_steps != len(given):
        assert not np.allclose(sampling.sigmas(len(given), tokens, given), got, rtol=1e-4)


def test_euler_step_equals_scheduler():
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    retrieve_timesteps(scheduler, 4, "cpu", sigmas=np.linspace(1, 0.25, 4), mu=1.0)
    rng = np.random.default_rng(0)
    x, v = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    s = scheduler.sigmas.numpy()
    want = scheduler.step(torch.from_numpy(v), scheduler.timesteps[1], torch.from_numpy(x), return_dict=False)
    got = sampling.euler_step(x, v, s[1], s[2])
    np.testing.assert_allclose(np.asarray(got), want[0].numpy(), atol=1e-6)


def test_pack_and_ids_follow_diffusers_layout():
    latents = np.arange(2 * 128 * 3 * 5, dtype=np.float32).reshape(2, 128, 3, 5)
    tokens = sampling.pack(latents)
    assert tokens.shape == (2, 15, 128)
    np.testing.assert_array_equal(tokens[1, 7], latents[1, :, 1, 2])  # token 7 = row 1, col 2
    np.testing.assert_array_equal(np.asarray(sampling.unpack(tokens, 3, 5)), latents.transpose(0, 2, 3, 1))
    ids = sampling.reference_ids([(2, 2), (1, 3)])
    assert ids.tolist()[3] == [10, 1, 1, 0] and ids.tolist()[4:] == [[20, 0, c, 0] for c in range(3)]
    assert sampling.text_ids(3).tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]]
