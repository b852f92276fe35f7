"""The README and the documentation pages as checked against what they describe: their Python examples
that need no download run as written, in order, twice, on the demo checkpoint; a sample of a command's
output is what the command prints; a figure they quote is the one its source holds."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def site_pages() -> list[Path]:
    """The documentation site's pages (docs/), in the order of mkdocs.yml's navigation."""
    nav = re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [ROOT / "docs" / name for name in nav]


def documents() -> list[Path]:
    """What a reader reads: the README, then the site's pages as its navigation orders them."""
    return [README, *site_pages()]


def everything_said() -> str:
    return "\n".join(path.read_text() for path in documents())


def python_examples() -> list[tuple[Path, str]]:
    """(file, code) of each ```python block, in reading order (the README's first); a block that repeats
    an earlier one (a page's copy of the README's quick start, tests/test_docs_copies.py) once only."""
    seen, examples = set(), []
    for path in documents():
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            if block not in seen:
                seen.add(block)
                examples.append((path, block))
    return examples


def test_the_readme_examples_run_twice_and_their_settings_round_trip(klein_home, tmp_path, monkeypatch):
    """Run as a script is run again: twice in a row in the same folder, each time from a fresh scope (what a
    second run meets is the first run's files)."""
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    monkeypatch.chdir(tmp_path)
    blocks = python_examples()
    for _ in range(2):
        scope: dict = {}
        for path, block in blocks[:2]:  # the first two: the quick start and the request round trip
            exec(compile(block, str(path), "exec"), scope)
        assert sorted(p.name for p in tmp_path.glob("cat-*.png")) == [f"cat-{i}.png" for i in (0, 1, 2, 3, 7)]
        assert scope["again"] == scope["out"].settings.request and scope["again"].seed == 7
        path, block = blocks[2]
        exec(compile(block, str(path), "exec"), scope)  # inpainting
        inpainted = sorted(p.name for p in tmp_path.glob("inpainted-*.png"))
        assert inpainted == ["inpainted-green.png", "inpainted-straw.png"]
        assert scope["out"].settings.request.strength == 0.8
    for path, block in blocks[3:]:  # the rest need checkpoints, files or a server: they at least parse
        compile(block, str(path), "exec")


def test_the_quick_starts_pngs_stay_out_of_git_status(tmp_path):
    """The quick start writes fresh names into the clone; .gitignore names them at its root (and only there:
    a PNG committed elsewhere, e.g. docs/, is not hidden)."""
    import fnmatch
    import itertools

    from klein.io import png

    stamp = png.plan_outputs(str(tmp_path), 1, False).stamp
    names = [path.name for path in itertools.islice(png.fresh_names(Path("."), f"klein-{stamp}-7"), 2)]
    lines = (ROOT / ".gitignore").read_text().splitlines()
    rooted = [line[1:] for line in lines if line.startswith("/") and "*" in line]
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in rooted) for name in names), (names, rooted)


def command_samples() -> list[tuple[str, str]]:
    """(command, what it printed) of each ```text block that shows a `$ klein ...` command and its output."""
    blocks = re.findall(r"```text\n\$ (klein [^\n]*)\n(.*?)```", everything_said(), re.S)
    assert blocks, "the documents show no command's output any more: drop this test"
    return blocks


# What depends on the machine that runs the command: the memory it has free.
MACHINE = [
    (
        r"[\d.]+ GiB more than the [\d.]+ GiB of available host memory",
        "N GiB more than the N GiB of available host memory",
    ),
    (r"at this memory these fit: .*$", "at this memory these fit: (sizes)"),
]


def as_compared(text: str) -> str:
    """The text with its line breaks (the documents wrap long lines) and its machine's figures left out."""
    flat = " ".join(text.split())
    for pattern, replacement in MACHINE:
        flat = re.sub(pattern, replacement, flat)
    return flat


def test_a_commands_sample_output_is_what_it_prints(klein_home, tmp_path):
    for command, shown in command_samples():
        argv = [sys.executable, "-m", "klein.cli.main", *shlex.split(command)[1:]]
        env = dict(os.environ, KLEIN_HOME=str(klein_home))
        ran = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        # An error sample is the error's lines (the progress before them is drawn on a terminal only).
        printed = ran.stderr[ran.stderr.find("error: ") :] if shown.startswith("error: ") else ran.stdout
        assert shows(as_compared(shown), as_compared(printed)), (command, printed)


def shows(sample: str, printed: str) -> bool:
    """Whether `printed` is what `sample` shows, where a sample's "..." stands for lines it leaves out."""
    pieces = [re.escape(part.strip()) for part in sample.split("...")]
    return re.fullmatch(".*".join(pieces), printed, re.S) is not None


def test_bench_cpus_duration_is_the_one_its_config_gives():
    """The documents and `klein bench --help` say how long bench-cpu takes from one figure, its config's."""
    from klein.bench.configs import CONFIGS
    from klein.cli.bench import bench_parser

    minutes = CONFIGS["bench-cpu"].minutes
    (said,) = re.findall(r"`bench-cpu` \(scaled-down geometry, fp32, about (\d+) minutes", everything_said())
    assert int(said) == minutes
    assert f"bench-cpu (scaled-down geometry, about {minutes} min" in bench_parser().format_help()


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The cells of each body row of the first table after `marker` in `text`."""
    rest = text[text.index(marker) :]
    rows = re.search(r"\n(\|.*\|\n\|[-| ]+\|\n(?:\|.*\|\n)+)", rest).group(1).splitlines()[2:]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


@pytest.mark.parametrize(
    "marker, source, source_marker",
    [
        ("[benchmarks/bench-cpu.md](benchmarks/bench-cpu.md)", "docs/benchmarks/bench-cpu.md", "Matmul peak"),
        (
            "(benchmarks/quantized-real-size-cpu.md)):",
            "docs/benchmarks/quantized-real-size-cpu.md",
            "## Results",
        ),
    ],
)
def test_the_documents_measured_tables_are_those_of_their_benchmark_files(marker, source, source_marker):
    """A table of measured figures in the documents is its benchmark file's, row for row: each shown row's
    figures (every cell after the first, which may be shortened) are the file's row's, in order."""
    shown = _table_after(everything_said(), marker)
    measured = _table_after((ROOT / source).read_text(), source_marker)
    assert len(shown) == len(measured), (source, len(shown), len(measured))
    for readme_row, file_row in zip(shown, measured, strict=True):
        assert file_row[1 : len(readme_row)] == readme_row[1:], (readme_row, file_row)


def test_auto_on_blackwell_is_what_the_quality_table_passes():
    """`klein.devices.QUALITY`, which decides the block-scaled product `auto` takes on Blackwell, holds
    the image SSIMs of the quality table in docs/design/checkpoints.md, figure for figure."""
    from klein import devices

    rows = _table_after(
        (ROOT / "docs" / "design" / "checkpoints.md").read_text(), "### Quality of the low-precision paths"
    )
    ssim = {row[0]: float(row[1]) for row in rows}
    assert devices.QUALITY == {compute: ssim[compute] for compute in devices.QUALITY}
