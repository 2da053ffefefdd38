"""README.md is a front door and docs/ holds the rest: the README stays short and starts with the two
set-up commands, the docs pages the README promises exist, and every relative link and anchor in README.md
and docs/*.md resolves (pure file reads)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 250

PAGES = {
    "architecture": "architecture.md",
    "blending and fidelity": "blending-and-fidelity.md",
    "models and training": "models-and-training.md",
    "operator and CRD reference": "operator.md",
    "chart": "chart.md",
    "local cluster": "local-cluster.md",
    "benchmarks": "benchmarks.md",
    "experiments": "experiments.md",
}
"""The pages issue 40 asks for, by topic."""

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _links(path: Path) -> list[str]:
    return _LINK.findall(_prose(path.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in one page (repeated headings get -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_slug_follows_github() -> None:
    assert slug("The demo (`make demo`)") == "the-demo-make-demo"
    assert slug("2026-12-03: the shipped late scorer, one 56-minute run") == (
        "2026-12-03-the-shipped-late-scorer-one-56-minute-run")
    assert slug("vLLM: `kvshard bench vllm`") == "vllm-kvshard-bench-vllm"
    assert slug("What the router weighs cached tokens against") == "what-the-router-weighs-cached-tokens-against"


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = re.search(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert first_block, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]


@pytest.mark.parametrize("topic", sorted(PAGES))
def test_docs_page_exists(topic: str) -> None:
    page = DOCS / PAGES[topic]
    assert page.is_file(), f"docs page for {topic} missing: {page.relative_to(REPO)}"
    assert _HEADING.search(page.read_text()), f"{page.relative_to(REPO)} has no heading"


def test_readme_links_every_docs_page() -> None:
    linked = {Path(link.split("#")[0]).name for link in _links(README) if link.startswith("docs/")}
    missing = sorted(set(PAGES.values()) - linked)
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("document", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for link in _links(document):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("//"):
            continue  # http(s), mailto: not checked here
        target, _, anchor = link.partition("#")
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link} (no heading with anchor #{anchor} in {path.relative_to(REPO)})")
    assert not broken, f"{document.relative_to(REPO)}: " + "; ".join(broken)
