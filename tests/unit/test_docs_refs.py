"""The design notes the code cites are in docs/, and every citation resolves.

Comments in ``src/oomguard`` cite the memory model by section (``§2.4``, ``§2.3–2.6``,
``§2–§7``); each cited number must be a heading of ``docs/memory-model.md``. Every ``docs/``
page a comment names must exist, no comment may name the old note's file, and every page in
``docs/`` must be reachable from the site's navigation (``mkdocs.yml``).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "oomguard"
DOCS = ROOT / "docs"
MEMORY_MODEL = DOCS / "memory-model.md"

_NUMBER = r"\d+(?:\.\d+)?"
# "§2.4", "§ 2.4", "§2.3–2.6", "§2–§7", "§4-§5"
_CITATION = re.compile(rf"§\s?({_NUMBER})(?:\s?[–-]\s?§?({_NUMBER}))?")
_NAMED = re.compile(r"§\s?([A-Za-z]\w+)")  # "§ conventions"
_HEADING = re.compile(rf"^#{{2,3}}\s+({_NUMBER})\.?\s", re.MULTILINE)
_DOCS_PATH = re.compile(r"docs/[\w./-]+\.md")


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _sections() -> set[str]:
    return set(_HEADING.findall(MEMORY_MODEL.read_text(encoding="utf-8")))


def test_the_memory_model_is_in_the_docs() -> None:
    sections = _sections()
    # the top-level chapters 0-13 and the subsections the code leans on most
    assert {str(n) for n in range(14)} <= sections
    assert {"2.1", "2.4", "4.6", "5.1", "7.2"} <= sections


def test_every_section_citation_in_src_resolves() -> None:
    sections = _sections()
    cited: dict[str, list[str]] = {}
    for path in _sources():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in _CITATION.finditer(line):
                for number in filter(None, match.groups()):
                    cited.setdefault(number, []).append(f"{path.relative_to(ROOT)}:{lineno}")
    assert len(cited) >= 30, "the scan found too few citations: has the § form changed?"
    missing = {n: where[:3] for n, where in cited.items() if n not in sections}
    assert not missing, f"§ citations with no heading in docs/memory-model.md: {missing}"


def test_named_section_citations_resolve() -> None:
    headings = [
        h.lower()
        for h in re.findall(r"^#+\s+(.*)$", MEMORY_MODEL.read_text(encoding="utf-8"), re.M)
    ]
    for path in _sources():
        for word in _NAMED.findall(path.read_text(encoding="utf-8")):
            assert any(word.lower() in h for h in headings), f"{path}: § {word} has no heading"


def test_comments_name_pages_that_exist() -> None:
    named: set[str] = set()
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w-])vllm-memory\b", text), (
            f"{path.relative_to(ROOT)} names the memory model by its old file name; "
            "cite docs/memory-model.md"
        )
        named.update(_DOCS_PATH.findall(text))
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"src names docs pages that do not exist: {missing}"


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_every_docs_page_is_in_the_site_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = set(_nav_pages(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav, f"not in nav: {sorted(pages - nav)}; missing files: {sorted(nav - pages)}"


QUICK_START = (
    "python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/oomguard plan "
    'meta-llama/Llama-3.1-70B-Instruct --gpu "RTX 4090" --p99-tokens 8192 --concurrency 16'
)


def test_the_readme_is_a_landing_page_whose_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    assert QUICK_START in readme and "bash scripts/test-all.sh" in readme
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 10
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert not missing, f"README links to missing pages: {missing}"
