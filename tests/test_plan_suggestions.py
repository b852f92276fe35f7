"""What the planner says when nothing fits (`klein.request.planning.suggestions`), one meaning of a device's
memory whether it is given as a size or a card's name, card names read as people type them, and a memory cap's
refusal that says what the cap was spent on. Every device's memory here is given: nothing depends on what this
machine has free."""

import dataclasses
import json

import pytest

from klein import InputError, devices
from klein.cli import main as cli
from klein.errors import CannotFitError
from klein.memory import admission, plan, residency
from klein.request import planning
from tests.test_cli import assert_clean_error, run_klein

GiB = 2**30


def published(variant: str, compute: str) -> plan.Models:
    return dataclasses.replace(plan.published(variant, "bfloat16"), compute=compute)


def asked(variant="klein-9b-kv", compute="fp8", **changes) -> dict:
    """`planning.plan`'s arguments for a device of 8-bit products, planned for an accelerator's programs
    (as `klein plan` plans a TPU chip; a named NVIDIA card with `platform="gpu"`)."""
    args = dict(variant=variant, mesh="single", refs=0, size=(1024, 1024), ref_size=None, batch=1)
    args |= dict(dtype="bfloat16", models=published(variant, compute), platform="accelerator")
    return args | changes


def auto(peaks: dict[str, int], limit: int) -> tuple[str, int]:
    """(the policy auto takes, its peak): the first that fits, else the roomiest."""
    fitting = [name for name, peak in peaks.items() if peak <= limit]
    policy = fitting[0] if fitting else min(peaks, key=peaks.get)
    return policy, peaks[policy]


def test_nothing_fits_on_an_8_gb_card_lists_what_would_with_the_planner_s_figures(
    klein_home, tmp_path, monkeypatch, capsys
):
    """klein-9b-kv with two references on an RTX 4060 (7 GiB, FP8 products): no policy fits. The plan
    lists the quantized files, the smaller model and the smaller requests that would, each figure the
    planner's own for that change; a file that does not fit alone comes with the change that makes it fit.
    (Keys and values in bf16: under --kv-dtype auto their 8 bits let `stream` fit.)"""
    args = ["plan", "--model", "klein-9b-kv", "--refs", "2", "--device", "rtx-4060", "--kv-dtype", "dtype"]
    # In this process (the planner's models are built once), as `klein plan` runs it: the command as a
    # process is tested by the refusal in test_device_names_are_read_as_typed_and_a_mistake_names_the_nearest.
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    monkeypatch.chdir(tmp_path)
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    limit = 7 * GiB
    assert report["auto"] is None and report["device_memory"]["bytes"] == limit
    found = {s["change"]: s for s in report["suggestions"]}
    base = asked(refs=2, platform="gpu")  # a named NVIDIA card plans its GPU programs
    expected = {
        "--refs 1": base | dict(refs=1),
        "--ref-size 896x896": base | dict(ref_size=(896, 896)),
        "--size 896x896 (references too)": base | dict(size=(896, 896)),
        "the smaller model (--model klein-4b)": base
        | dict(variant="klein-4b", models=published("klein-4b", "fp8")),
    }
    for change, arguments in expected.items():
        policy, peak = auto(planning.plan(**arguments).policies_on(limit), limit)
        assert (found[change]["policy"], found[change]["peak_bytes"]) == (policy, peak), change
        assert found[change]["fits"] and peak <= limit
    q8 = next(s for change, s in found.items() if change.startswith("a Q8_0 GGUF transformer"))
    policy, peak = auto(
        planning.plan(**base | dict(models=plan.in_format(base["models"], "Q8_0", "Q4_K"))).policies_on(
            limit
        ),
        limit,
    )
    assert (q8["policy"], q8["peak_bytes"], q8["fits"]) == ("stream", peak, False) and peak > limit
    assert q8["then"]["change"] == "--refs 1" and q8["then"]["fits"]
    assert {"Q4_K", "NVFP4"} <= {word for change in found for word in ("Q4_K", "NVFP4") if word in change}
    assert all(s["fits"] == (s["peak_bytes"] <= limit) for s in found.values())
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "nothing fits\nwhat would fit in 7.00 GiB" in text
    assert f"  --refs 1: stream {found['--refs 1']['peak_bytes'] / GiB:.2f} GiB, fits" in text


def test_each_smaller_request_is_the_largest_that_fits():
    """The size, the references and their number go down only as far as they must: one step larger does
    not fit."""
    limit = int(4.5 * GiB)
    found = {s.change: s for s in planning.suggestions(asked(refs=2), limit)}
    larger = {
        "--refs 0": dict(refs=1),
        "--ref-size 640x640": dict(ref_size=(768, 768)),
        "--size 640x640 (references too)": dict(size=(768, 768)),
    }
    for change, step in larger.items():
        assert found[change].fits
        assert min(planning.plan(**asked(refs=2) | step).policies_on(limit).values()) > limit, change


def test_a_plan_that_fits_suggests_nothing(capsys):
    assert planning.suggestions(asked(refs=2), 23 * GiB) == []
    assert cli.main(["plan", "--model", "klein-9b-kv", "--refs", "2", "--device", "rtx-4090", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["suggestions"] == []


def test_a_memory_cap_that_leaves_no_room_suggests_the_cap_that_would():
    """Below the device's own memory a cap is what leaves no room: the suggested cap is the least that fits,
    and under it auto has a policy."""
    base, limit = asked("klein-4b"), int(1.5 * GiB)  # below its tiled decode's least
    found = {s.change: s for s in planning.suggestions(base, limit, memory=23 * GiB)}
    cap = next(change for change in found if change.startswith("--memory-cap "))
    assert found[cap].fits
    least = min(planning.plan(**base).policies_on(limit).values())
    cap_bytes = float(cap.removeprefix("--memory-cap ").removesuffix("GiB")) * GiB
    assert least <= cap_bytes < least + 0.01 * GiB
    # Without the device's memory (or with less than the cap would need) no cap is suggested.
    assert not any(
        c.startswith("--memory-cap") for c in (s.change for s in planning.suggestions(base, limit))
    )


@pytest.mark.parametrize("card", ["rtx-4060", "rtx-3060", "rtx-4070", "rtx-4090"])
def test_a_device_memory_plans_as_the_named_card_of_that_memory(card, capsys):
    """`--device-memory 12GB` is the memory of a 12 GB card (GB as memory is counted), less what the
    runtime keeps, planned with the 8-bit products `--compute auto` makes on every card before Blackwell:
    the same plan as the card's name; each says which compute it assumes."""
    args = ["plan", "--model", "klein-9b-kv", "--refs", "1"]
    reports, texts = {}, {}
    for named in (["--device", card], ["--device-memory", f"{devices.DEVICES[card].memory_gib}GB"]):
        assert cli.main([*args, *named, "--json"]) == 0
        reports[named[0]] = json.loads(capsys.readouterr().out)
        assert cli.main([*args, *named]) == 0
        texts[named[0]] = capsys.readouterr().out
    by_name, by_size = reports["--device"], reports["--device-memory"]
    for key in ("policies", "auto", "weights", "request_bytes"):
        assert by_name[key] == by_size[key], key
    assert (
        by_name["device_memory"]["bytes"] == by_size["device_memory"]["bytes"] == devices.DEVICES[card].limit
    )
    assert by_name["compute"] == devices.DEVICES[card].compute and by_size["compute"] == "fp8 or int8"
    assert f"compute: {by_name['compute']} (--compute auto on {card}, compute capability" in texts["--device"]
    assert (
        "compute: fp8 or int8 (--compute auto on a GPU or TPU given by its memory" in texts["--device-memory"]
    )
    # Asked for, bf16 products are planned from either, and said so.
    assert cli.main([*args, "--device-memory", "12GB", "--compute", "bf16"]) == 0
    assert "compute: bf16 (as --compute asks" in capsys.readouterr().out


def test_device_names_are_read_as_typed_and_a_mistake_names_the_nearest(klein_home, tmp_path, capsys):
    for typed in ("rtx4090", "RTX 4090", "Rtx_4090"):
        assert devices.find(typed) == "rtx-4090"
        assert cli.main(["plan", "--model", "klein-4b", "--device", typed, "--json"]) == 0
        assert (
            json.loads(capsys.readouterr().out)["device_memory"]["bytes"] == devices.DEVICES["rtx-4090"].limit
        )
    assert devices.find("h100") == "h100-80gb"  # an old name (`devices.ALIASES`)
    with pytest.raises(InputError, match="did you mean rtx-3060 or rtx-3060-ti"):
        devices.find("3060")
    result = run_klein(klein_home, "plan", "--device", "rtx-4090-ti", cwd=tmp_path)
    assert_clean_error(result, "argument --device: unknown device 'rtx-4090-ti'; did you mean rtx-4090")
    assert "tpu-v5p" not in result.stderr  # the nearest names, not the whole table


def test_a_memory_cap_s_refusal_says_what_the_cap_was_spent_on():
    """On the CPU a cap holds the weights and klein's own process too: the room it leaves a request says
    so, with the figures (explicit here: nothing read from this machine)."""
    cap, weights, own = GiB, 2 * 2**20, 970 * 2**20
    left, where = admission.under_cap(cap, weights, own, limit=20 * GiB, where="of available host memory")
    assert left == cap - weights - own
    assert where == (
        "left of the 1.00 GiB memory cap beside the weights (2.0 MiB) and klein's own process (0.95 GiB "
        "resident: Python, JAX, compiled programs, the tokenizer, counted as they share the CPU's memory)"
    )
    # A card's process lives in host memory: only the weights are named; where the device has less free
    # than the cap leaves, that is the limit.
    assert admission.under_cap(cap, weights, 0, 20 * GiB, "free")[1].endswith("beside the weights (2.0 MiB)")
    assert admission.under_cap(cap, weights, own, 10 * 2**20, "free on the device") == (
        10 * 2**20,
        "free on the device",
    )


def test_a_refused_request_hears_the_largest_smaller_forms_that_fit():
    """Admission's refusal lists, in words every front end shows, the largest size, number of images and
    references that fit, each with the estimate that admits it."""
    work = plan.Workload(
        images=4, prompts=1, height=1024, width=1024, reference_tokens=8192, cached=True, guided=False
    )

    def peak(w: plan.Workload) -> int:  # a stand-in estimate: bytes in proportion to pixels and tokens
        return w.images * w.height * w.width + 64 * w.reference_tokens

    limit = 3 * 2**20
    found = admission.smaller_requests(work, peak, limit)
    assert found == [
        "768x768 px (2.8 MiB)",  # 4 x 768^2 + 64 x 8192 = 2.75 MiB; 896^2 does not fit
        "2 images at a time (2.5 MiB)",
    ]
    memory = plan.RequestMemory(reference_kv=0, prefill=0, text=0, step=peak(work), decode=0)
    with pytest.raises(
        InputError, match=r"1.5 MiB more than the 3.0 MiB allowed; ask for less.*these fit: 768x768 px"
    ):
        admission.check(work, lambda w: dataclasses.replace(memory, step=peak(w)), limit, "allowed")


def test_a_load_that_fits_under_no_policy_says_what_the_weights_alone_need():
    """`auto` loads the roomiest policy where its weights (and the process) fit, for smaller requests: a
    refusal says how much that is, and where the plan of what would fit is."""
    sizes = dict(text_encoder=10 * GiB, transformer=17 * GiB, vae=GiB)
    sizes |= dict(transformer_streamed=12 * GiB, text_encoder_streamed=7 * GiB)
    assert residency.peaks(sizes, 3 * GiB) == {"all": 31 * GiB, "sequential": 21 * GiB, "stream": 9 * GiB}
    with pytest.raises(
        CannotFitError,
        match=r"more than the 6.00 GiB free; under stream the weights and klein's own process alone need 7.00 GiB; "
        r"use a smaller model, a quantized or FP8 transformer file \(klein plan lists what would fit",
    ):
        residency.choose("auto", sizes, 2 * GiB, 6 * GiB, "free", process=GiB)
