"""The documentation pages read the same on GitHub as on the site: they hold their commands and examples
written out, not as MkDocs includes (which GitHub shows as raw `--8<--` lines), and each copy of a README
section or of a file is checked here to be that section or file, so the two cannot drift apart.

A copy in a page sits between `<!-- copy of README.md, section NAME -->` (or `<!-- copy of PATH -->` for a
whole file, as a fenced block) and `<!-- end of copy -->`; a README section between
`<!-- section NAME -->` and `<!-- end of section NAME -->`."""

import re

from tests.test_readme import README, ROOT

DOCS = ROOT / "docs"
COPY = re.compile(
    r"<!-- copy of (?P<source>[^,>]+?)(?:, section (?P<section>[\w-]+))? -->\n(?P<text>.*?)<!-- end of copy -->",
    re.S,
)
FENCED = re.compile(r"^```\w*\n(.*?)```\s*$", re.S)


def section(name: str) -> str:
    found = re.search(
        rf"<!-- section {name} -->\n(.*?)<!-- end of section {name} -->", README.read_text(), re.S
    )
    assert found, f"README.md has no section {name!r}"
    return found.group(1)


def copies() -> list[tuple[str, str, str | None, str]]:
    """(page, source, section, text) of every copy in the pages."""
    return [
        (str(page.relative_to(ROOT)), found["source"], found["section"], found["text"])
        for page in sorted(DOCS.rglob("*.md"))
        for found in COPY.finditer(page.read_text())
    ]


def test_every_copy_is_its_source():
    found = copies()
    assert found, "no page holds a copy any more: drop this test"
    for page, source, name, text in found:
        if name is not None:
            assert source == "README.md", (page, source)
            assert text.strip() == section(name).strip(), f"{page}: its copy of the README's {name!r} differs"
        else:
            fenced = FENCED.match(text.strip())
            assert fenced, f"{page}: a copy of {source} is one fenced block"
            assert fenced.group(1).rstrip("\n") == (ROOT / source).read_text().rstrip("\n"), (
                f"{page}: its copy of {source} differs from the file"
            )


def test_the_readme_sections_the_pages_copy_are_copied_somewhere():
    """A README section is marked only to be copied: one no page copies is a marker left behind."""
    marked = set(re.findall(r"<!-- section ([\w-]+) -->", README.read_text()))
    copied = {name for _, _, name, _ in copies() if name}
    assert marked == copied, (marked, copied)


def test_no_page_includes_a_file_that_github_would_show_raw():
    """A `--8<--` include renders only on the site; on GitHub the reader sees the marker."""
    raw = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in sorted(DOCS.rglob("*.md"))
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if line.lstrip().startswith("--8<--")
    ]
    assert not raw, raw
