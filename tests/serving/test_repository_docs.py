"""The repository explains itself: nothing it holds points outside it, and its references to its own documents resolve.

- No tracked file refers to documents outside the repository (the design document and notes that once lived beside
  it): docs/architecture.md and docs/local-environment.md replace them.
- Section numbers (the "§" references) always mean sections of docs/architecture.md: each must be a heading there.
  Named citations (`docs/architecture.md ("Layers")`, `docs/local-environment.md, "vLLM on CPU"`) must name a
  heading of that file.
- Every relative link in a tracked Markdown file resolves to a file or directory inside the repository, and its
  `#anchor`, if any, to a heading of the target.

Each test lists every offending file:line, so one run shows everything to fix.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
LOCAL_ENVIRONMENT = REPO / "docs" / "local-environment.md"
# Built from pieces so that this file does not match what it forbids.
OUTSIDE_REFERENCES = ("../" + "shared", "/work/" + "shared", "ARCHITECTURE" + ".md", "ARCHITECTURE" + " §")

SECTION_REF = re.compile(r"§(\d+(?:\.\d+)*[a-z]?)(?![a-z0-9])")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SECTION_NUMBER = re.compile(r"^(\d+(?:\.\d+)*[a-z]?)\.?(?:\s+|$)")
NAMED_CITATIONS = (
    (re.compile(r"architecture\.md\s*\(\s*\"([^\"]+)\"\s*\)"), ARCHITECTURE),
    (re.compile(r"local-environment\.md,\s*\"([^\"]+)\""), LOCAL_ENVIRONMENT),
)
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@cache
def tracked_files() -> tuple[Path, ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
        files = [REPO / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (an unpacked archive): every file but what the setup and the tests generate.
        generated = {".git", "build", ".cache", "node_modules", "__pycache__", ".import_linter_cache"}
        files = [path for path in REPO.rglob("*")
                 if not generated.intersection(path.relative_to(REPO).parts)
                 and not path.relative_to(REPO).parts[0].startswith(".venv")]
    # The two documents are checked even before they are first committed.
    for doc in (ARCHITECTURE, LOCAL_ENVIRONMENT):
        if doc not in files:
            files.append(doc)
    return tuple(f for f in files if f.is_file() and not f.is_symlink())


@cache
def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def text_files() -> list[tuple[Path, str]]:
    return [(path, text) for path in tracked_files() if (text := text_of(path)) is not None]


def where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(REPO)}:{text.count(chr(10), 0, offset) + 1}"


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(offset, line) of every Markdown line outside fenced code blocks."""
    lines, offset, fence = [], 0, None
    for line in text.splitlines(keepends=True):
        marker = FENCE.match(line)
        if fence is None and marker:
            fence = marker.group(1)
        elif fence is not None and marker and marker.group(1) == fence:
            fence = None
        elif fence is None:
            lines.append((offset, line.rstrip("\n")))
        offset += len(line)
    return lines


def github_slug(title: str) -> str:
    title = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), title)
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@cache
def headings(path: Path) -> tuple[str, ...]:
    text = text_of(path) or ""
    return tuple(m.group(2) for _, line in outside_fences(text) if (m := HEADING.match(line)))


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    result = set()
    for title in headings(path):
        slug = github_slug(title)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(result)


def section_numbers() -> set[str]:
    return {m.group(1) for title in headings(ARCHITECTURE) if (m := SECTION_NUMBER.match(title))}


def section_title(heading: str) -> str:
    return SECTION_NUMBER.sub("", heading, count=1).strip()


def test_the_design_documents_exist_with_their_cited_sections():
    assert ARCHITECTURE.is_file(), "docs/architecture.md is missing: code and docs cite it by section"
    assert LOCAL_ENVIRONMENT.is_file(), "docs/local-environment.md is missing: code and docs cite its sections"
    numbers = section_numbers()
    required = {"1", "2", "3", *(f"3.{i}" for i in range(1, 12)), "3.10b", "4", "5"}
    assert not required - numbers, f"docs/architecture.md lacks sections {sorted(required - numbers)}"
    titles = {section_title(h) for h in headings(LOCAL_ENVIRONMENT)}
    required_titles = {"vLLM on CPU", "Pulumi offline", "Triton locally"}
    assert not required_titles - titles, f"docs/local-environment.md lacks {sorted(required_titles - titles)}"


def test_nothing_refers_outside_the_repository():
    offending = []
    for path, text in text_files():
        for number, line in enumerate(text.splitlines(), 1):
            for needle in OUTSIDE_REFERENCES:
                if needle in line:
                    offending.append(f"{path.relative_to(REPO)}:{number}: {needle!r} in {line.strip()[:100]!r}")
    assert not offending, ("files refer to documents outside the repository (cite docs/architecture.md or "
                           "docs/local-environment.md instead):\n" + "\n".join(offending))


def test_every_section_reference_is_a_heading_of_the_architecture_document():
    numbers = section_numbers()
    offending = [f"{where(path, text, m.start())}: §{m.group(1)}"
                 for path, text in text_files() for m in SECTION_REF.finditer(text) if m.group(1) not in numbers]
    assert not offending, (f"section references that are not headings of docs/architecture.md (it has "
                           f"{', '.join(sorted(numbers))}):\n" + "\n".join(offending))


def test_every_named_citation_is_a_heading_of_its_document():
    offending = []
    for path, text in text_files():
        for pattern, doc in NAMED_CITATIONS:
            titles = {section_title(h) for h in headings(doc)} | set(headings(doc))
            for m in pattern.finditer(text):
                name = " ".join(m.group(1).split())
                if name not in titles:
                    offending.append(f"{where(path, text, m.start())}: \"{name}\" is not a heading of "
                                     f"{doc.relative_to(REPO)}")
    assert not offending, "citations of sections that do not exist:\n" + "\n".join(offending)


def _links(text: str):
    for offset, line in outside_fences(text):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            yield offset, definition.group(1)
            continue
        code_free = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        # Keep the link text's code spans out of the way but the targets intact: targets never hold backticks.
        for m in INLINE_LINK.finditer(code_free):
            yield offset + m.start(), m.group(1).strip("<>")


def test_every_relative_markdown_link_resolves():
    offending = []
    for path, text in text_files():
        if path.suffix != ".md":
            continue
        for offset, target in _links(text):
            if not target or SCHEME.match(target):
                continue
            file_part, _, fragment = target.partition("#")
            if file_part:
                base = REPO if file_part.startswith("/") else path.parent
                resolved = (base / file_part.lstrip("/")).resolve()
            else:
                resolved = path
            if not resolved.is_relative_to(REPO):
                offending.append(f"{where(path, text, offset)}: {target} leaves the repository")
            elif not resolved.exists():
                offending.append(f"{where(path, text, offset)}: {target} does not exist "
                                 f"({resolved.relative_to(REPO)})")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                offending.append(f"{where(path, text, offset)}: {target}: no heading with anchor #{fragment} in "
                                 f"{resolved.relative_to(REPO)}")
    assert not offending, "Markdown links that do not resolve:\n" + "\n".join(offending)
