"""The documentation's links: every relative link in the README and under docs/ reaches a file that
exists, and a link to a heading (`page.md#heading`) reaches a heading of that page."""

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings inside code blocks
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_link_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# A heading, with punctuation!\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md) [ok](b.md#a-heading-with-punctuation) [web](https://example.com)\n"
                    "[bad](missing.md) [bad anchor](b.md#nowhere)\n```\n[in code](ignored.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "b.md#nowhere (no such heading)"]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    assert len(pages()) > 5  # the README and the docs were found
    broken = {str(page.relative_to(REPO_ROOT)): links for page in pages() if (links := broken_links(page))}
    assert broken == {}
