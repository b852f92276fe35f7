"""`klein.request.resolve`: the decision table of every request, written out (not recomputed)."""

import numpy as np
import pytest

from klein.errors import InputError
from klein.models.variants import DEMO_LABEL, VARIANTS
from klein.request.modes import Conditioning
from klein.request.request import GenerationRequest, Settings
from klein.request.resolve import resolve, typical

TEXT, REFS, CACHED = Conditioning.TEXT, Conditioning.REFERENCES, Conditioning.CACHED
REJECTED = "rejected"

# variant, references, use_kv -> conditioning (or rejected)
CONDITIONING = [
    ("klein-4b", 0, None, TEXT),
    ("klein-4b", 0, False, TEXT),
    ("klein-4b", 0, True, REJECTED),
    ("klein-4b", 2, None, REFS),
    ("klein-4b", 2, False, REFS),
    ("klein-4b", 2, True, REJECTED),
    ("klein-9b-kv", 0, None, TEXT),
    ("klein-9b-kv", 0, False, TEXT),
    ("klein-9b-kv", 0, True, TEXT),
    ("klein-9b-kv", 2, None, CACHED),
    ("klein-9b-kv", 2, False, REFS),
    ("klein-9b-kv", 2, True, CACHED),
    ("klein-base-9b", 0, None, TEXT),
    ("klein-base-9b", 2, None, REFS),
    ("klein-base-9b", 2, True, REJECTED),
]

# variant, guidance_scale -> (guidance that runs, steps by default)
GUIDANCE = [
    ("klein-4b", None, None, 4),
    ("klein-4b", 3.5, None, 4),
    ("klein-9b-kv", 5.0, None, 4),
    ("klein-base-4b", None, 4.0, 50),
    ("klein-base-4b", 1.0, None, 50),
    ("klein-base-4b", 0.5, None, 50),
    ("klein-base-9b", 3.5, 3.5, 50),
]


@pytest.mark.parametrize("variant,references,use_kv,expected", CONDITIONING)
def test_how_references_enter(variant, references, use_kv, expected):
    request = GenerationRequest(prompt="x", use_kv=use_kv)
    sizes = [(64, 96)] * references
    if expected == REJECTED:
        with pytest.raises(InputError, match="use_kv=True needs a KV checkpoint"):
            resolve(request, VARIANTS[variant], "the model", sizes)
        return
    run = resolve(request, VARIANTS[variant], "the model", sizes)
    assert run.mode.conditioning is expected
    assert run.request.use_kv == (expected is CACHED)
    assert run.workload.reference_tokens == references * 4 * 6


@pytest.mark.parametrize("variant,scale,guidance,steps", GUIDANCE)
def test_guidance_and_steps(variant, scale, guidance, steps):
    run = resolve(GenerationRequest(prompt=["a", "b"], guidance_scale=scale), VARIANTS[variant], "m")
    assert run.request.guidance_scale == guidance
    assert run.mode.guided is (guidance is not None)
    assert run.request.num_inference_steps == steps
    assert run.workload.prompts == 2 + run.mode.guided  # the negative prompt with CFG


def test_size_seed_and_batch():
    variant = VARIANTS["klein-4b"]
    run = resolve(
        GenerationRequest(prompt=["a", "b"], num_images_per_prompt=3), variant, "m", [(200, 300)], lambda: 11
    )
    assert (run.request.height, run.request.width, run.rounded) == (
        192,
        288,
        True,
    )  # the reference's, rounded
    assert (run.images, run.request.seed) == (6, 11)
    run = resolve(GenerationRequest(prompt="a", height=512, seed=3), variant, "m", [(200, 300)])
    assert (run.request.height, run.request.width, run.rounded) == (
        512,
        288,
        True,
    )  # width from the reference
    assert run.request.seed == 3
    run = resolve(GenerationRequest(prompt="a"), variant, "m")
    assert (run.request.height, run.request.width, run.rounded) == (1024, 1024, False)
    assert (
        resolve(GenerationRequest(prompt="a", latents=0), variant, "m", (), lambda: 1 / 0).request.seed
        is None
    )


def test_encoded_references_decide_their_mode_and_must_agree_with_use_kv():
    from klein.request.references import References

    kv = VARIANTS["klein-9b-kv"]
    plain = References(tokens=None, ids=None, pixel_sizes=((64, 64),), kv=None)
    run = resolve(GenerationRequest(prompt="a", references=plain), kv, "m", [(64, 64)])
    assert run.mode.conditioning is REFS  # encoded without the cache: used as encoded
    with pytest.raises(InputError, match="use_kv disagrees"):
        resolve(GenerationRequest(prompt="a", references=plain, use_kv=True), kv, "m", [(64, 64)])


def test_a_pipeline_is_planned_for_one_1024_image_with_cfg_where_it_runs():
    assert typical(VARIANTS["klein-base-9b"]).workload.prompts == 2
    work = typical(VARIANTS["klein-9b-kv"]).workload
    assert (work.prompts, work.images, work.height, work.reference_tokens, work.cached) == (
        1,
        1,
        1024,
        0,
        False,
    )


# steps, strength -> the first step that runs (diffusers' get_timesteps: int(steps - steps * strength)),
# or rejected when none would run.
REPAINT = [
    (4, 1.0, 0),
    (4, 0.8, 0),
    (4, 0.6, 1),
    (4, 0.25, 3),
    (4, 0.1, 3),
    (4, 0.0, REJECTED),
    (50, 0.5, 25),
    (50, 0.33, 33),
]


@pytest.mark.parametrize("steps,strength,first", REPAINT)
def test_strength_cuts_the_schedule(steps, strength, first):
    request = GenerationRequest(prompt="x", strength=strength, num_inference_steps=steps)
    variant = VARIANTS["klein-4b"]
    if first == REJECTED:
        with pytest.raises(InputError, match="no denoising step"):
            resolve(request, variant, "m", [(64, 96)])
        return
    run = resolve(request, variant, "m", [(64, 96)], lambda: 0)
    assert run.first_step == first and run.request.strength == strength
    assert (run.request.height, run.request.width) == (64, 96)  # the source's size


def test_sigmas_set_the_steps_and_the_given_count_only_the_shift():
    variant = VARIANTS["klein-4b"]
    assert GenerationRequest(prompt="x", sigmas=np.linspace(1, 0.25, 4)).sigmas == (1.0, 0.75, 0.5, 0.25)
    alone = resolve(GenerationRequest(prompt="x", sigmas=[1.0, 0.5, 0.25]), variant, "m", [], lambda: 0)
    assert alone.steps == 3 and alone.request.num_inference_steps == variant.steps and not alone.notes
    given = resolve(GenerationRequest(prompt="x", sigmas=(1, 0.5), num_inference_steps=10), variant, "m")
    assert given.steps == 2 and given.request.num_inference_steps == 10
    assert given.notes == (
        "2 sigmas run 2 steps: num_inference_steps 10 only sets the schedule's shift (as in diffusers)",
    )
    repaint = GenerationRequest(prompt="x", strength=0.5, sigmas=[1.0, 0.8, 0.6, 0.4], num_inference_steps=50)
    assert resolve(repaint, variant, "m", [(64, 64)], lambda: 0).first_step == 2  # of the 4 sigmas, not 50
    # The PNG's settings record them, and read back they give the same schedule and shift.
    settings = Settings(given.request, given.mode, "m", "klein-4b", ())
    text = settings.metadata(0, "0")
    assert text["sigmas"] == "1.0,0.5" and text["steps"] == "10"
    again = GenerationRequest.from_metadata(text)
    assert again.sigmas == (1.0, 0.5) and again.num_inference_steps == 10 and again.steps_run == 2


@pytest.mark.parametrize(
    "sigmas,match",
    [
        ([], "1 to 1000 numbers"),
        ("1,0.5", "1 to 1000 numbers"),
        ([[1.0, 0.5]], "1 to 1000 numbers"),
        ([1.0, "0.5"], "must be numbers"),
        ([1.0, True], "must be numbers"),
        ([1.0, 0.5, 0.0], "above 0 and at most 1.*got 0.0"),
        ([1.5, 0.5], "got 1.5"),
        ([1.0, float("nan")], "got nan"),
        ([1.0] * 1001, "1 to 1000 numbers"),
    ],
)
def test_sigmas_that_are_no_schedule_are_refused(sigmas, match):
    with pytest.raises(InputError, match=match):
        GenerationRequest(prompt="x", sigmas=sigmas)


def test_a_mask_defaults_to_diffusers_strength_and_text_to_image_has_no_first_step():
    variant = VARIANTS["klein-4b"]
    masked = resolve(GenerationRequest(prompt="x", mask_image="m.png"), variant, "m", [(64, 64)], lambda: 0)
    assert masked.request.strength == 0.8 and masked.first_step == 0
    plain = resolve(GenerationRequest(prompt="x"), variant, "m", [], lambda: 0)
    assert plain.request.strength is None and plain.first_step == 0
    with pytest.raises(InputError, match="mask_image needs the image to repaint"):
        resolve(GenerationRequest(prompt="x", mask_image="m.png"), variant, "m", [], lambda: 0)


def test_a_repaint_is_named_in_the_mode_with_its_mask_and_strength():
    """What `describe()`, the CLI's settings line and the PNG's `mode` say: inpainting with its mask and
    strength, or image-to-image, before how the references enter; the step function stays the plain one."""
    variant = VARIANTS["klein-9b-kv"]
    masked = GenerationRequest(prompt="x", mask_image="m.png", strength=0.6)
    mode = resolve(masked, variant, "m", [(64, 64)], lambda: 0).mode
    assert str(mode) == "inpainting with a mask at strength 0.6, cached references"
    assert mode == resolve(GenerationRequest(prompt="x"), variant, "m", [(64, 64)], lambda: 0).mode
    image_to_image = resolve(GenerationRequest(prompt="x", strength=0.5), variant, "m", [(64, 64)], lambda: 0)
    assert str(image_to_image.mode) == "image-to-image at strength 0.5, cached references"
    default = resolve(
        GenerationRequest(prompt="x", mask_image="m.png"), VARIANTS["klein-4b"], "m", [(64, 64)]
    )
    assert str(default.mode) == "inpainting with a mask at strength 0.8, references"
    # As `describe()` and the PNG's metadata say it.
    run = resolve(masked, variant, "m", [(64, 64)], lambda: 0)
    settings = Settings(run.request, run.mode, "m", variant.name, ((64, 64),), (), "all", ())
    assert ", inpainting with a mask at strength 0.6, cached references, seed 0" in settings.describe()
    assert settings.metadata(0, "test")["mode"] == str(mode)


def test_only_the_demo_says_it_cannot_show_inpainting_keep_the_unmasked_area():
    masked = GenerationRequest(prompt="x", mask_image="m.png", seed=0)
    variant = VARIANTS["klein-9b-kv"]
    demo = resolve(masked, variant, DEMO_LABEL, [(64, 64)]).notes
    assert [note for note in demo if "cannot show inpainting keeping the unmasked area" in note]
    assert resolve(masked, variant, "black-forest-labs/FLUX.2-klein-9b-kv", [(64, 64)]).notes == ()
    image_to_image = GenerationRequest(prompt="x", strength=0.5, seed=0)  # no unmasked area to keep
    assert resolve(image_to_image, variant, DEMO_LABEL, [(64, 64)]).notes == ()
