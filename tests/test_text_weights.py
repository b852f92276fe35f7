"""`--text-encoder-weights auto`: the compute dtype's, unless 8 or 4 bits let `all` hold the request the
checkpoint is planned for; never on a CPU, in float32 or under a residency that takes turns anyway, and a GGUF
text encoder keeps its own blocks."""

import pytest

from klein.errors import InputError
from klein.memory import text_weights
from klein.memory.plan import Workload


@pytest.mark.parametrize(
    "option,platform,dtype,gguf,residency,forms",
    [
        ("auto", "tpu", "bfloat16", False, "auto", (None, "Q8_0", "Q4_0")),
        ("auto", "gpu", "bfloat16", False, "all", (None, "Q8_0", "Q4_0")),
        ("auto", "cpu", "bfloat16", False, "auto", (None,)),
        ("auto", "tpu", "float32", False, "auto", (None,)),
        ("auto", "tpu", "bfloat16", False, "sequential", (None,)),
        ("auto", "tpu", "bfloat16", True, "auto", (None,)),
        ("dtype", "tpu", "bfloat16", False, "auto", (None,)),
        ("Q4_0", "cpu", "float32", False, "sequential", ("Q4_0",)),
    ],
)
def test_the_forms_auto_weighs(option, platform, dtype, gguf, residency, forms):
    assert text_weights.candidates(option, platform, dtype, gguf, residency) == forms


def test_a_gguf_text_encoder_is_not_quantised_again():
    with pytest.raises(InputError, match="GGUF file"):
        text_weights.candidates("Q8_0", "tpu", "bfloat16", True)


def test_the_first_form_that_lets_all_fit_is_chosen():
    sizes = {None: 11, "Q8_0": 6, "Q4_0": 3}
    work = Workload(1, 1, 1024, 1024, 0, cached=False, guided=False)

    def chosen(limit):
        return text_weights.choose(
            (None, "Q8_0", "Q4_0"),
            lambda form: dict(text_encoder=sizes[form], transformer=9, vae=0),
            lambda form, work: lambda models: 1,
            work,
            limit,
        )

    assert [chosen(limit) for limit in (21, 16, 13, 12)] == [None, "Q8_0", "Q4_0", None]


def test_a_kv_variant_is_planned_for_an_edit_over_two_references():
    typical = Workload(1, 1, 1024, 1024, 0, cached=False, guided=False)
    edited = text_weights.planned_for(typical, kv=True)
    assert (edited.reference_tokens, edited.cached, edited.prefilled, edited.kv_dtype) == (
        8192,
        True,
        True,
        "int8",
    )
    assert text_weights.planned_for(typical, kv=False) is typical
