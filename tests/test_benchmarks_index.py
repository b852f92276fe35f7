"""The benchmark scripts and what names them: every `benchmarks/...` script path that the README, the docs,
the sources, the tests or the scripts themselves name exists, and benchmarks/README.md's index lists every
script in benchmarks/ (and nothing that is not there)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
INDEX = BENCHMARKS / "README.md"

# A script path as prose and commands write it, from the repository root (not docs/benchmarks/, where the
# measured results are).
NAMED = re.compile(r"(?<![\w./-])benchmarks/[a-z0-9_/.-]+?\.(?:py|sh)\b")
# An index row's first cell: `folder/name.py`.
ROW = re.compile(r"^\| `([\w/.-]+\.(?:py|sh))` \|", re.MULTILINE)


def texts() -> list[Path]:
    """The files that may name a script: prose and code, not the recorded results (JSON, logs)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("src", "tests", "benchmarks", "integrations", ".ci"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in {".py", ".sh", ".md", ""}]
    return [p for p in files if p.is_file()]


def scripts() -> set[str]:
    return {str(p.relative_to(BENCHMARKS)) for p in BENCHMARKS.rglob("*") if p.suffix in {".py", ".sh"}}


def test_every_named_script_exists():
    missing = []
    for path in texts():
        for name in NAMED.findall(path.read_text(errors="replace")):
            if not (ROOT / name).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "script paths that do not exist:\n" + "\n".join(missing)


def test_the_index_lists_every_script():
    listed = ROW.findall(INDEX.read_text())
    assert len(listed) == len(set(listed)), "a script listed twice"
    assert set(listed) == scripts(), (
        f"not in benchmarks/README.md: {sorted(scripts() - set(listed))}; "
        f"listed but not there: {sorted(set(listed) - scripts())}"
    )


def test_scripts_are_grouped():
    """A newcomer finds a script by its subject: none lies loose at the top of benchmarks/."""
    assert not [p.name for p in BENCHMARKS.iterdir() if p.suffix in {".py", ".sh"}]
