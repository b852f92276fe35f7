"""The documentation site holds together: every page under docs/ is in mkdocs.yml's navigation (no page a
reader cannot reach), the README's links lead to files that exist, and the API reference documents each
name `klein` exports from the module that defines it. `mkdocs build --strict` (in .ci/run) checks the
links between pages and that each documented name exists."""

import re
import tomllib

import klein
from tests.test_readme import README, ROOT, site_pages

DOCS = ROOT / "docs"


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page():
    pages = site_pages()
    assert all(page.is_file() for page in pages), [str(p) for p in pages if not p.is_file()]
    orphans = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md") if path not in pages)
    assert not orphans, f"pages missing from mkdocs.yml's nav: {orphans}"
    assert len(set(pages)) == len(pages), "a page is in the navigation twice"


def anchors(page) -> set[str]:
    """The ids MkDocs gives a page's headings (its toc extension's slugs)."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower()) for heading in headings}


def test_the_readmes_links_lead_to_pages_of_the_site_and_their_headings():
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)]*))?\)", README.read_text())
    local = [(target, anchor) for target, anchor in links if "://" not in target]
    assert local, "the README links to no page any more: drop this test"
    pages = site_pages()
    for target, anchor in local:
        path = ROOT / target
        assert path.exists(), target
        if path.suffix == ".md":
            assert path in pages, f"{target} is not a page of the site (mkdocs.yml's nav)"
            assert not anchor or anchor in anchors(path), f"{target} has no heading #{anchor}"


def test_the_api_reference_documents_each_export_where_klein_finds_it():
    """A name of `klein.__all__` is documented under the module `klein` imports it from (its lazy table, or
    klein itself for the errors), so moving a class moves its entry or fails here."""
    documented = set(re.findall(r"^::: (\S+)$", (DOCS / "api.md").read_text(), re.M))
    expected = {f"{klein._LAZY.get(name, 'klein')}.{name}" for name in klein.__all__}
    assert expected <= documented, sorted(expected - documented)


def test_the_docs_extra_has_the_formatter_mkdocstrings_formats_signatures_with():
    """mkdocstrings formats signatures with ruff (or black), and warns without one: the docs extra pins ruff
    as the test extra does."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ruff = [pin for pin in extras["test"] if pin.startswith("ruff==")]
    assert ruff and ruff[0] in extras["docs"], extras["docs"]
