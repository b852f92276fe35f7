"""The README's Python examples that need no download run as written, in order, on the demo checkpoint."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_examples_run_and_their_settings_round_trip(klein_home, tmp_path, monkeypatch):
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks()
    scope: dict = {}
    for block in blocks[:2]:  # the first two: the quick start and the request round trip
        exec(compile(block, str(README), "exec"), scope)
    assert sorted(p.name for p in tmp_path.glob("cat-*.png")) == [f"cat-{i}.png" for i in (0, 1, 2, 3, 7)]
    assert scope["again"] == scope["out"].settings.request and scope["again"].seed == 7
    exec(compile(blocks[2], str(README), "exec"), scope)  # inpainting
    inpainted = sorted(p.name for p in tmp_path.glob("inpainted-*.png"))
    assert inpainted == ["inpainted-green.png", "inpainted-straw.png"]
    assert scope["out"].settings.request.strength == 0.8
    for block in blocks[3:]:  # the rest need checkpoints, files or a server: they at least parse
        compile(block, str(README), "exec")


def test_the_quick_starts_pngs_stay_out_of_git_status(tmp_path):
    """The quick start writes fresh names into the clone; .gitignore names them at its root (and only there:
    a PNG committed elsewhere, e.g. docs/, is not hidden)."""
    import fnmatch
    import itertools

    from klein.io import png

    stamp = png.plan_outputs(str(tmp_path), 1, False).stamp
    names = [path.name for path in itertools.islice(png.fresh_names(Path("."), f"klein-{stamp}-7"), 2)]
    lines = (README.parent / ".gitignore").read_text().splitlines()
    rooted = [line[1:] for line in lines if line.startswith("/") and "*" in line]
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in rooted) for name in names), (names, rooted)
