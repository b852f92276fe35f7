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
