"""On a GPU or TPU, a request that `all` cannot hold but turns can (more references than the edit a pipeline was planned for)
runs with the text encoder and the transformer taking turns for it alone: admission moves the pipeline to
`sequential` for that request, the next request comes back to `all`; a check before queueing only admits."""

import dataclasses
import types

import pytest

from klein.errors import CannotFitError
from klein.pipeline import admitting


class Budget:
    """Admits under `sequential` always; under `all` only requests of `small` references."""

    def __init__(self, pipe):
        self.pipe = pipe

    def admit_kv(self, work, kv_dtype, *limits):
        if self.pipe.residency == "all" and work.reference_tokens > 1:
            raise CannotFitError("does not fit under all")
        return False, work


@dataclasses.dataclass(frozen=True)
class Work:
    reference_tokens: int
    text_cached: bool = False


def run_of(references: int):
    request = types.SimpleNamespace(prompts=["a fox"], lora_sets=[()])
    return types.SimpleNamespace(
        request=request, mode=types.SimpleNamespace(guided=False), workload=Work(references)
    )


class Pipe(types.SimpleNamespace):
    """A pipeline's admission surface (weakly referable and hashed by identity, as a pipeline is)."""

    __hash__ = object.__hash__


@pytest.fixture
def pipe():
    pipe = Pipe(residency="all", weights_id="w", prompt_owner=None, prompt_cache=None, kv_dtype="auto")
    pipe.adapters = types.SimpleNamespace(placed=False, device_bytes=0)
    pipe.budget = Budget(pipe)
    pipe.memory_limit = pipe.memory_cap = None
    pipe.devices = [types.SimpleNamespace(platform="tpu")]
    return pipe


def test_a_big_request_takes_turns_and_the_next_comes_back(pipe):
    admitting.admit(pipe, run_of(1))
    assert pipe.residency == "all"
    admitting.admit(pipe, run_of(4))
    assert pipe.residency == "sequential"  # for this request's stages
    admitting.admit(pipe, run_of(1))
    assert pipe.residency == "all"


def test_on_a_cpu_it_is_refused_as_before(pipe):
    pipe.devices = [types.SimpleNamespace(platform="cpu")]
    with pytest.raises(CannotFitError, match="under all"):
        admitting.admit(pipe, run_of(4))
    assert pipe.residency == "all"


def test_a_check_admits_without_moving_anything(pipe):
    admitting.admit(pipe, run_of(4), turns=False)
    assert pipe.residency == "all"


def test_what_turns_cannot_hold_is_refused_with_alls_reason(pipe):
    pipe.budget.admit_kv = lambda work, *a: (_ for _ in ()).throw(CannotFitError(pipe.residency))
    with pytest.raises(CannotFitError, match="^all$"):
        admitting.admit(pipe, run_of(4))
    assert pipe.residency == "all"


def test_a_policy_its_user_chose_stays(pipe):
    admitting.admit(pipe, run_of(4))
    admitting.forget(pipe)  # enable_model_cpu_offload() while it was under turns
    admitting.admit(pipe, run_of(1))
    assert pipe.residency == "sequential"
