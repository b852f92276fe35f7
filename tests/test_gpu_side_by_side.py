"""benchmarks/gpu/gpu_side_by_side.py at toy size on the CPU (`--tiny`), so that the GPU benchmark keeps
working between the runs on a GPU: its klein-9b-kv part runs both engines on text-to-image and every
editing case, with the KV speed-up against the FLOP ceiling, and writes its report, table and seconds
(the klein-4b part is the same runner on fewer cases: checked as a config, not run, to keep CI short);
the full parts are the cases the GPU run is for. Never timings."""

import importlib.util
import json
from pathlib import Path

import pytest

from klein.bench.cases import CaseKind

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "gpu_side_by_side.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_tiny_kv_part_runs_both_engines_and_writes_its_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KLEIN_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    assert _script().main(["--tiny", "--part", "9b-kv", "--repeats", "1", "--out", str(out)]) == 0
    kv = json.loads((out / "gpu-tiny-kv.json").read_text())
    modes = [(c["mode"], c["references"]) for c in kv["cases"]]
    assert modes == [
        (CaseKind.TEXT_TO_IMAGE.value, 0),
        (CaseKind.STANDARD.value, 1),
        (CaseKind.KV.value, 1),
        (CaseKind.KV_WARM.value, 1),
    ]
    for case in kv["cases"]:
        assert set(case["engines"]) == {"klein", "diffusers"} and case["max_abs_diff"] < 1e-3
        assert 0 < case["klein_fraction_of_peak"] and 0 < case["diffusers_fraction_of_peak"]
        for engine in case["engines"].values():
            assert {"text", "references", "denoise", "decode"} <= set(engine["stages"])
    for case in kv["cases"][2:]:
        assert case["kv"]["ceiling"] > 1 and set(case["kv"]["speedup"]) == {"klein", "diffusers"}
    assert kv["command"] == "python benchmarks/gpu/gpu_side_by_side.py --tiny"
    seconds = json.loads((out / "gpu-side-by-side-seconds.json").read_text())
    assert set(seconds) == {"gpu-tiny-kv", "total"} and not (out / "gpu-tiny.json").exists()
    assert capsys.readouterr().out.count("| case | klein s/image |") == 1
    assert list((tmp_path / "home" / "bench").iterdir()) == []  # the part's weights are removed


def test_the_full_parts_are_the_cases_asked_for_and_repeats_must_be_positive(tmp_path, monkeypatch):
    script = _script()
    assert [c.name for c in script.parts(tiny=False, repeats=3)] == ["gpu-9b-kv", "gpu-4b"]
    kv, plain = script.parts(tiny=False, repeats=3)
    assert kv.kv and kv.output_sizes == (1024,) and kv.reference_counts == (1, 2, 4)
    assert not plain.kv and plain.output_sizes == (1024,) and plain.reference_counts == ()
    assert kv.checkpoint.dtype == plain.checkpoint.dtype == "bfloat16"
    tiny_kv, tiny = script.parts(tiny=True, repeats=1)
    assert tiny_kv.kv and not tiny.kv and tiny.reference_counts == () and tiny.output_sizes == (32,)
    with pytest.raises(SystemExit) as refused:
        script.main(["--tiny", "--repeats", "0", "--out", str(tmp_path)])
    assert refused.value.code == 2
