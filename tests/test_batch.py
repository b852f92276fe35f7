"""`klein batch` on the demo checkpoint: 40 requests over 4 reference sets, a run killed halfway (SIGKILL)
and resumed, bad lines, and the refusals of bad arguments.

Outputs are named by line, so "each once" is a count of files; reference encodings are the pipeline's own
count of the work (`pipe.counters`), printed by the command in its summary."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from klein.batch import job, lines
from klein.batch.local import Local
from klein.errors import InputError
from klein.request.loading import LoadOptions
from klein.request.request import GenerationRequest

SETS = 4
LINES = 40
DEMO = LoadOptions()  # the model flags of a run on the demo checkpoint


@pytest.fixture
def requests(tmp_path) -> Path:
    """40 lines cycling over 4 reference sets (one or two 64x64 pictures each, by relative path)."""
    folder = tmp_path / "job"
    (folder / "refs").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(SETS + 1):
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        PIL.Image.fromarray(pixels).save(folder / "refs" / f"{i}.png")
    sets = [["refs/0.png"], ["refs/1.png"], ["refs/2.png", "refs/4.png"], ["refs/3.png"]]
    rows = [
        {"prompt": f"edit {n}", "image": sets[n % SETS], "height": 64, "width": 64, "steps": 2, "seed": n}
        for n in range(LINES)
    ]
    path = folder / "requests.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def command(klein_home, *args) -> tuple[list[str], dict]:
    env = {**os.environ, "KLEIN_HOME": str(klein_home), "JAX_PLATFORMS": "cpu"}
    return [sys.executable, "-m", "klein.cli.main", "batch", *map(str, args)], env


def run_batch(klein_home, *args) -> subprocess.CompletedProcess:
    argv, env = command(klein_home, *args)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def pngs(out: Path) -> list[Path]:
    return sorted(out.glob("*.png"))


def settled(out: Path) -> None:
    """Wait until no PNG has appeared in `out` for 2 s."""
    count, still = len(pngs(out)), time.monotonic()
    while time.monotonic() - still < 2:
        time.sleep(0.1)
        if len(pngs(out)) != count:
            count, still = len(pngs(out)), time.monotonic()


def encodings(stderr: str) -> int:
    return int(re.search(r"(\d+) reference encodings", stderr).group(1))


@pytest.mark.slow
def test_killed_halfway_and_resumed_on_ray_writes_every_output_once(klein_home, requests, tmp_path):
    """Killed (SIGKILL) halfway through a local run, resumed on Ray Data: one Ray start, which is most of
    the test's time. Outputs and results are written by the same code on both runners (`klein.batch.job`);
    resuming locally is tested below, with the outputs a kill leaves."""
    out = tmp_path / "out"
    argv, env = command(klein_home, requests, "--out", out)
    # A session of its own, so that the kill takes anything it started with it.
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while process.poll() is None and len(pngs(out)) < 15 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    settled(out)
    finished = {int(p.name.split("-")[1]) - 1 for p in pngs(out)}  # 0-based request numbers
    before = len(finished)
    assert 0 < before < LINES, "the first run was not killed halfway"

    resumed = run_batch(klein_home, requests, "--out", out, "--resume", "--ray")
    assert resumed.returncode == 0, resumed.stderr
    written = pngs(out)
    assert len(written) == LINES and len({p.name for p in written}) == LINES
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "a temporary file was left behind"
    assert f"{LINES - before} done, {before} already done, 0 failed" in resumed.stderr
    # Sets are run one group at a time: only the sets with lines left are encoded again, once each (one
    # worker here, locally and on Ray).
    left = {n % SETS for n in range(LINES) if n not in finished}
    assert encodings(resumed.stderr) == len(left) <= SETS

    entries = [json.loads(row) for row in (out / "results.jsonl").read_text().splitlines()]
    assert [entry["line"] for entry in entries] == list(range(1, LINES + 1))
    assert all(entry["status"] == "done" and len(entry["outputs"]) == 1 for entry in entries)
    with PIL.Image.open(out / entries[6]["outputs"][0]) as image:
        recorded = GenerationRequest.from_metadata(image.text)
    assert (recorded.prompt, recorded.seed, recorded.image) == ("edit 6", 6, ("refs/2.png", "refs/4.png"))


@pytest.fixture(scope="module")
def pipe(klein_home):
    import klein

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(klein_home))
        return klein.load_pipeline("demo")


def test_each_reference_set_is_encoded_once_per_worker(pipe, requests, tmp_path):
    out = tmp_path / "out"
    before = pipe.counters["references"]
    local = Local(lambda: pipe, out, "test")
    summary = job.run(requests, out, local, resume=False, fail_fast=False, loading=DEMO)
    assert (summary.done, summary.failed, summary.skipped) == (LINES, 0, 0)
    assert pipe.counters["references"] - before == SETS
    again = job.run(
        requests, out, Local(lambda: pipe, out, "test"), resume=True, fail_fast=False, loading=DEMO
    )
    assert (again.done, again.skipped, again.encodings) == (0, LINES, 0)


def test_bad_lines_are_reported_by_number_and_the_rest_runs(pipe, requests, tmp_path):
    good = requests.read_text().splitlines()[:2]
    bad = [
        "not json",
        '{"prompt": "x", "steps": 2.5}',
        '{"prompt": "x", "colour": 3}',
        '{"image": "refs/0.png"}',
    ]
    bad.append('{"prompt": "x", "image": "refs/missing.png"}')
    bad.append('{"prompt": "x", "image": "refs/0.png", "mask": "no-mask.png"}')
    path = requests.with_name("mixed.jsonl")
    path.write_text("\n".join([good[0], *bad, "", good[1]]) + "\n")
    out = tmp_path / "out"
    summary = job.run(
        path, out, Local(lambda: pipe, out, "test"), resume=False, fail_fast=False, loading=DEMO
    )
    assert (summary.done, summary.failed) == (2, 6)
    entries = {e["line"]: e for e in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert sorted(entries) == [1, 2, 3, 4, 5, 6, 7, 9]
    assert "not JSON" in entries[2]["error"] and "num_inference_steps" in entries[3]["error"]
    assert 'a line is one JSON object, e.g. {"prompt": ' in entries[2]["error"]  # the shape to write
    assert "unknown key 'colour'" in entries[4]["error"] and "no prompt" in entries[5]["error"]
    assert "image 'refs/missing.png' not found" in entries[6]["error"]
    assert "mask 'no-mask.png' not found" in entries[7]["error"] and entries[9]["status"] == "done"
    read = lines.read_lines(path)
    assert [line.number for line in read] == [1, 2, 3, 4, 5, 6, 7, 9]


def test_fail_fast_bad_arguments_and_a_used_folder_exit_2(klein_home, requests, tmp_path):
    path = requests.with_name("bad.jsonl")
    path.write_text(requests.read_text().splitlines()[0] + "\n{oops\n")
    results = [
        (run_batch(klein_home, path, "--out", tmp_path / "a", "--fail-fast"), "line 2: not JSON"),
        (run_batch(klein_home, requests), "--out"),
        (run_batch(klein_home, tmp_path / "none.jsonl", "--out", tmp_path / "b"), "no such file"),
    ]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "results.jsonl").write_text("")
    results.append((run_batch(klein_home, requests, "--out", tmp_path / "c"), "--resume"))
    for result, fragment in results:
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and fragment in result.stderr
    assert not pngs(tmp_path / "a")


def test_inpainting_lines_share_their_source_encoding_and_equal_the_python_call(pipe, requests, tmp_path):
    folder = requests.parent
    mask = PIL.Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    mask.save(folder / "mask.png")
    rows = [
        {
            "prompt": f"a hat {n}",
            "image": ["refs/0.png", "refs/1.png"],
            "mask": "mask.png",
            "strength": 0.75,
            "steps": 2,
            "seed": n,
        }
        for n in range(2)
    ]
    path = folder / "inpaint.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    before = pipe.counters["references"]
    summary = job.run(
        path, out, Local(lambda: pipe, out, "test"), resume=False, fail_fast=False, loading=DEMO
    )
    assert (summary.done, summary.failed) == (2, 0)
    assert pipe.counters["references"] - before == 1  # one source + reference encoding for both lines
    written = pngs(out)
    assert written[0].name.startswith("line-00001")
    with PIL.Image.open(written[0]) as image:
        got = np.asarray(image.convert("RGB"))
        assert image.text["strength"] == "0.75" and image.text["mask"].endswith("mask.png")
    want = pipe(
        "a hat 0",
        image=[folder / "refs/0.png", folder / "refs/1.png"],
        mask_image=folder / "mask.png",
        strength=0.75,
        num_inference_steps=2,
        seed=0,
    ).images[0]
    assert np.array_equal(got, np.asarray(want))


def test_results_record_what_made_each_output_and_resume_refuses_other_model_flags(
    klein_home, pipe, requests, tmp_path
):
    first_two = requests.with_name("two.jsonl")
    first_two.write_text("".join(requests.read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "out"
    job.run(first_two, out, Local(lambda: pipe, out, "test"), resume=False, fail_fast=False, loading=DEMO)
    entries = [json.loads(row) for row in (out / "results.jsonl").read_text().splitlines()]
    made_by = entries[0]["made_by"]
    assert (made_by["model"], made_by["lora"], made_by["dtype"]) == ("demo", [], None)
    settings = entries[1]["settings"]
    assert (settings["prompt"], settings["seed"], settings["model"]) == ("edit 1", 1, pipe.name)  # typed

    # Another dtype (or model, or LoRA set) on resume: exit 2 before any model loads, naming it.
    refused = run_batch(klein_home, requests, "--out", out, "--resume", "--dtype", "bfloat16")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "dtype None there, 'bfloat16' now" in refused.stderr and "--force" in refused.stderr
    assert len(pngs(out)) == 2
    # --force mixes knowingly: the new line records its own maker, the old ones keep theirs.
    other = LoadOptions(dtype="bfloat16")
    with pytest.raises(InputError, match="made otherwise"):
        job.run(requests, out, Local(lambda: pipe, out, "test"), True, False, loading=other)
    three = requests.with_name("three.jsonl")
    three.write_text("".join(requests.read_text().splitlines(keepends=True)[:3]))
    job.run(three, out, Local(lambda: pipe, out, "test"), True, False, loading=other, force=True)
    makers = [json.loads(row)["made_by"]["dtype"] for row in (out / "results.jsonl").read_text().splitlines()]
    assert makers == [None, None, "bfloat16"]


def test_resume_checks_a_finished_output_without_its_entry_by_its_own_metadata(
    klein_home, pipe, requests, tmp_path
):
    """A run stopped between a PNG and its entry in results.jsonl: the PNG's own record of the model flags
    that made it is checked as an entry's is, so a resume with another dtype or LoRA set does not count it
    as done without --force; with the same flags it is recorded, with its maker, and not made again."""
    first_two = requests.with_name("two.jsonl")
    first_two.write_text("".join(requests.read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "out"
    job.run(first_two, out, Local(lambda: pipe, out, "test"), resume=False, fail_fast=False, loading=DEMO)
    made = [json.loads(row)["made_by"] for row in (out / "results.jsonl").read_text().splitlines()]
    (out / "results.jsonl").write_text("")  # the crash: both PNGs written, no entry
    first = pngs(out)[0]

    refused = run_batch(klein_home, first_two, "--out", out, "--resume", "--dtype", "bfloat16")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    for fragment in (str(first), "not yet recorded in results.jsonl", "dtype None there, 'bfloat16' now"):
        assert fragment in refused.stderr
    assert "--force" in refused.stderr
    other_lora = LoadOptions(lora=("ink.safetensors:0.5",))
    with pytest.raises(InputError, match=r"lora \[\] there, \[\['ink.safetensors', 0.5\]\] now.*--force"):
        job.run(first_two, out, Local(lambda: pipe, out, "test"), True, False, loading=other_lora)
    assert (out / "results.jsonl").read_text() == "" and len(pngs(out)) == 2

    before = pipe.counters["references"]
    summary = job.run(first_two, out, Local(lambda: pipe, out, "test"), True, False, loading=DEMO)
    assert (summary.done, summary.skipped, pipe.counters["references"]) == (0, 2, before)
    assert [json.loads(row)["made_by"] for row in (out / "results.jsonl").read_text().splitlines()] == made


def test_a_line_larger_than_max_pixels_is_a_bad_line_and_the_others_run(klein_home, tmp_path):
    """klein batch has klein generate's (and klein serve's) size limit: a line past it is refused before any
    model work, naming the flag that lets it through, and the other lines run."""
    rows = [{"prompt": "huge", "height": 4096, "width": 4096}, {"prompt": "small", "height": 64, "width": 64}]
    path = tmp_path / "sizes.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ran = run_batch(klein_home, path, "--out", tmp_path / "out")
    assert ran.returncode == 3, ran.stderr
    message = "line 1: an output of 4096x4096 px is more than the 2048x2048 px allowed (--max-pixels)"
    assert message in ran.stderr and "--max-pixels 16777216" in ran.stderr
    entries = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert sorted(entry["status"] for entry in entries) == ["done", "error"], entries
    assert len(pngs(tmp_path / "out")) == 1
    assert run_batch(klein_home, path, "--out", tmp_path / "zero", "--max-pixels", "0").returncode == 2


def test_a_misspelt_key_is_answered_with_the_nearest_one(tmp_path):
    bad = lines.parse_line(3, '{"prompt": "x", "stepz": 2}', tmp_path)
    assert str(bad) == "line 3: unknown key 'stepz'; did you mean 'steps'?"
    far = lines.parse_line(4, '{"prompt": "x", "colour": 2}', tmp_path)
    assert "unknown key 'colour'; known keys: " in str(far) and "steps" in str(far)


def test_outputs_and_results_reach_the_disk_before_they_are_renamed_into_place(pipe, requests, tmp_path):
    from klein.io import durable, png

    events = []
    synced, replaced, linked = durable.os.fsync, png.os.replace, png.os.link
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(durable.os, "fsync", lambda fd: events.append(f"fsync {_name(fd)}") or synced(fd))
        patch.setattr(
            png.os, "replace", lambda a, b: events.append(f"rename {Path(b).name}") or replaced(a, b)
        )
        patch.setattr(png.os, "link", lambda a, b: events.append(f"link {Path(b).name}") or linked(a, b))
        one = requests.with_name("one.jsonl")
        one.write_text(requests.read_text().splitlines(keepends=True)[0])
        out = tmp_path / "out"
        job.run(one, out, Local(lambda: pipe, out, "test"), False, False, loading=DEMO)
    renamed = next(i for i, event in enumerate(events) if event.startswith("rename line-"))
    name = events[renamed].removeprefix("rename ")
    assert events[renamed - 1].startswith(f"fsync .{name}.") and events[renamed - 1].endswith(".tmp"), events
    assert events[renamed + 1] == "fsync out", "the folder holding the renamed PNG was not synced"
    compacted = events.index("rename results.jsonl")
    assert events[compacted - 1 : compacted + 2] == [
        "fsync .results.jsonl.tmp",
        "rename results.jsonl",
        "fsync out",
    ]


def _name(fd: int) -> str:
    """The name of the file or folder open as `fd`."""
    return Path(os.readlink(f"/proc/self/fd/{fd}")).name


def test_resume_reads_a_record_older_than_a_setting_as_made_with_its_default(tmp_path):
    from klein.batch.provenance import check_resume, made_by
    from klein.errors import InputError
    from klein.request.loading import LoadOptions

    now = made_by(LoadOptions())
    older = {name: value for name, value in now.items() if name != "compute"}  # written before --compute
    check_resume([older], now, tmp_path)
    with pytest.raises(InputError, match="compute 'auto' there, 'int8' now"):
        check_resume([older], made_by(LoadOptions(compute="int8")), tmp_path)


def _lora_rows(folder: Path) -> list[str]:
    """Six lines over two reference sets and three LoRA sets (none; ink at 0.8 with pen, in either order;
    ink at 0.5), interleaved."""
    for name, colour in (("a", "red"), ("b", "blue")):
        PIL.Image.new("RGB", (64, 64), colour).save(folder / f"{name}.png")
    loras = [[], ["ink:0.8", "pen"], [{"name": "pen"}, {"name": "ink", "scale": 0.8}], ["ink:0.5"]]
    rows = [("a.png", 0), ("a.png", 1), ("b.png", 1), ("a.png", 2), ("a.png", 3), ("b.png", 0)]
    common = {"height": 64, "width": 64, "steps": 2, "seed": 1}
    return [
        json.dumps({"prompt": f"p{n}", "image": image, "loras": loras[k], **common})
        for n, (image, k) in enumerate(rows)
    ]


def test_lines_are_grouped_by_reference_set_and_lora_set(tmp_path):
    from klein.batch import plan

    rows = _lora_rows(tmp_path)
    grouped = plan.groups([lines.parse_line(n, row, tmp_path) for n, row in enumerate(rows, start=1)])
    assert [[line.number for line in group] for group in grouped] == [[1], [2, 4], [3], [5], [6]]


def test_a_group_is_prefilled_once_under_its_loras(pipe, tmp_path):
    """On the demo (a KV checkpoint) a reference set's keys and values depend on the LoRAs: each group is
    encoded and prefilled once, under its own LoRAs, and no line prefills again; each PNG records its
    line's LoRAs; a line naming a LoRA the run does not offer fails alone, with the reason. (Placed last: the LoRAs loaded here stay loaded in the module's pipeline.)"""
    from klein.io import demo
    from klein.models.transformer_config import TransformerConfig
    from tests.support import lora_files as lf

    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    for seed, name in enumerate(("ink", "pen"), start=2):
        pipe.load_lora(name, lf.write_bfl(tmp_path / f"{name}.safetensors", lf.random_lora(shapes, 4, seed)))
    folder = tmp_path / "job"
    folder.mkdir()
    rows = _lora_rows(folder)[:4]  # groups [1], [2, 4], [3]
    rows.append(json.dumps({"prompt": "p", "image": "a.png", "loras": ["nope"]}))  # offered by no one
    (folder / "requests.jsonl").write_text("".join(row + "\n" for row in rows))
    before = dict(pipe.counters)
    out = tmp_path / "out"
    summary = job.run(
        folder / "requests.jsonl", out, Local(lambda: pipe, out, "test"), False, False, loading=DEMO
    )
    assert (summary.done, summary.failed) == (4, 1)
    assert pipe.counters["references"] - before.get("references", 0) == 3
    assert pipe.counters["prefill"] - before.get("prefill", 0) == 3
    entries = [json.loads(row) for row in (out / "results.jsonl").read_text().splitlines()]
    error = entries[4]["error"]  # in a batch file's words: its key, and klein batch's flags
    assert "loras: no LoRA named 'nope' is offered" in error and "klein batch --lora-dir" in error
    with PIL.Image.open(out / entries[3]["outputs"][0]) as image:
        recorded = json.loads(image.text["lora_apply"])
    assert "ink:0.8" in recorded and {use.split(":")[0] for use in recorded} == {"ink", "pen"}


def test_resume_refuses_a_lora_name_that_now_means_another_file(tmp_path):
    """--lora-dir / --lora-named are recorded as name -> the file's sha256: the same bytes under another
    path resume; another file under the name, or the name no longer offered, is refused."""
    from klein.batch.provenance import check_resume, made_by

    first, moved, other = tmp_path / "ink.safetensors", tmp_path / "moved", tmp_path / "other.safetensors"
    first.write_bytes(b"ink weights")
    moved.mkdir()
    (moved / "ink.safetensors").write_bytes(b"ink weights")
    other.write_bytes(b"other weights")
    before = made_by(LoadOptions(lora_named=(f"ink={first}",)))
    assert list(before["lora_offered"]) == ["ink"] and len(before["lora_offered"]["ink"]) == 64
    check_resume([before], made_by(LoadOptions(lora_dir=str(moved))), tmp_path)
    for now in (LoadOptions(lora_named=(f"ink={other}",)), LoadOptions()):
        with pytest.raises(InputError, match="lora_offered .*'ink'.* there"):
            check_resume([before], made_by(now), tmp_path)
