"""The repository explains itself: nothing it holds points outside it, and its references to its own documents resolve.

What is read: every file git would commit (tracked, or new and not ignored), so a document or a citation is checked
before its first commit; `.venv*`, `node_modules`, `build`, `.cache` and the other generated trees are ignored.

- No file refers to documents outside the repository (the design document and notes that once lived beside it):
  docs/architecture.md and docs/local-environment.md replace them.
- Section numbers (the "§" references) always mean sections of docs/architecture.md: each must be a heading there,
  and a "§" written right after another document's name (`docs/clients.md §3`) is refused, since no other document
  numbers its sections.
- A section cited with a quotation (`§3.4, "Model kinds"`, `§4 "GPU count stays within ..."`) must hold it: a
  heading or a bold paragraph label inside that section, or words of its text.
- Named citations of any Markdown document (`docs/architecture.md ("Layers")`, `docs/local-environment.md, "vLLM on
  CPU"`, `docs/kserve.md "Embedded Triton"`, `[docs/kserve.md](docs/kserve.md), "Embedded Triton"`, in code comments,
  docstrings and string literals as in documents) must name a heading of that document, or a bold paragraph label
  (`**Python dependencies.** ...`), by its whole title or by its first words ("Regions" for "Regions: one build, one
  digest"; a section number and code spans do not count).
- Every `make` target and every `llm-serving` subcommand that README.md, CHANGELOG.md and docs/ name (in code spans
  and code blocks) exists: a rule of the Makefile, a subcommand of the command's parsers.
- Every relative link in a Markdown file resolves to a file or directory inside the repository, and its `#anchor`,
  if any, to a heading of the target (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, `-1`,
  `-2` for repeated titles); so does a `docs/x.md#anchor` written as plain text anywhere (a code comment).

Each test lists every offending file:line with the citation and the target it misses, so one run shows everything
to fix.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from functools import cache
from pathlib import Path

from llm_serving.repository import REPO_ROOT

THIS = Path(__file__).resolve()
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
LOCAL_ENVIRONMENT = REPO_ROOT / "docs" / "local-environment.md"
# Built from pieces so that this file does not match what it forbids.
OUTSIDE_REFERENCES = ("../" + "shared", "/work/" + "shared", "ARCHITECTURE" + ".md", "ARCHITECTURE" + " §")
# Trees the setup, the tests and the tools generate (the fallback when git is not there to say what is ignored).
GENERATED = {".git", "build", ".cache", "node_modules", "__pycache__", ".import_linter_cache", ".pytest_cache",
             ".ruff_cache", ".hypothesis", "dist"}

SECTION = r"(\d+(?:\.\d+)*[a-z]?)(?![a-z0-9])"
SECTION_REF = re.compile("§" + SECTION)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SECTION_NUMBER = re.compile(r"^(\d+(?:\.\d+)*[a-z]?)\.?(?:\s+|$)")
# A bold label that opens a paragraph or a list item: `**Model kinds.** Everything ...`, `- **Outputs beyond
# `text_output`:** NVIDIA's ...`.
BOLD_LABEL = re.compile(r"^\s*(?:[-*+]\s+|\d+\.\s+)?\*\*(.+?)\*\*")
# A document's name as prose and code cite it: `docs/kserve.md`, `kserve.md`, `../docs/rehearsal.md`.
DOC_NAME = r"(?<![\w./-])(?P<doc>[\w./-]*[\w-]\.md)"
# A quotation: "...", '...', or \"...\" inside a string literal; at most a few lines, never across a blank line.
QUOTED = r"(?P<q>\\?[\"'])(?P<name>(?:(?!(?P=q))(?!\n[ \t]*\n)[^\0]){1,200}?)(?P=q)"
# `docs/x.md ("Title")`, `docs/x.md, "Title"`, `docs/x.md "Title"`, `[docs/x.md](docs/x.md), "Title"`.
NAMED_CITATION = re.compile(DOC_NAME + r"(?:#[\w-]*)?(?:\]\([^)\s]*\))?(?:\s*\(\s*|\)?\s*,\s*|\)?[ \t]+)" + QUOTED)
# `§3.4, "Model kinds"`, `§3.4 "Model kinds"`, `§4 "GPU count stays within ..."`.
SECTION_CITATION = re.compile("§" + SECTION + r"(?=[,\s]),?[ \t]*(?:\n[ \t]*(?:#+|//)?[ \t]*)?" + QUOTED)
# `docs/clients.md §3`: a section number after a document that is not docs/architecture.md.
FOREIGN_SECTION = re.compile(DOC_NAME + r"\)?,?[ \t]+§" + SECTION)
# `docs/x.md#anchor` as plain text (a code comment, prose): the anchor must be a heading's.
PLAIN_ANCHOR = re.compile(DOC_NAME + r"#(?P<anchor>[\w-]+)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@cache
def repository_files() -> tuple[Path, ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                             check=True, capture_output=True).stdout
        files = {REPO_ROOT / name for name in out.decode().split("\0") if name}
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (an unpacked archive): every file but what the setup and the tests generate.
        files = set()
        for root, dirs, names in os.walk(REPO_ROOT):
            dirs[:] = [d for d in dirs
                       if d not in GENERATED and not d.startswith(".venv") and not d.endswith(".egg-info")]
            files.update(Path(root) / name for name in names)
    # The two documents are checked even before they are first committed.
    files.update((ARCHITECTURE, LOCAL_ENVIRONMENT))
    return tuple(sorted(f for f in files if f.is_file() and not f.is_symlink() and not generated(f)))


def generated(path: Path) -> bool:
    """Inside a tree the setup generates (a virtual environment git does not yet ignore, a build directory)."""
    return any(part in GENERATED or part.startswith(".venv") or part.endswith(".egg-info")
               for part in path.relative_to(REPO_ROOT).parts[:-1])


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
    return [(path, text) for path in repository_files() if (text := text_of(path)) is not None]


def citing_files() -> list[tuple[Path, str]]:
    """The files whose citations are checked: all but this one, whose examples of each form cite nothing."""
    return [(path, text) for path, text in text_files() if path != THIS]


def markdown_files() -> list[tuple[Path, str]]:
    return [(path, text) for path, text in text_files() if path.suffix == ".md"]


def where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(REPO_ROOT)}:{text.count(chr(10), 0, offset) + 1}"


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


def unwrap_code(text: str) -> str:
    return INLINE_CODE.sub(lambda m: m.group(0).strip("`"), text)


def github_slug(title: str) -> str:
    title = unwrap_code(title)
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@cache
def heading_lines(path: Path) -> tuple[tuple[int, int, str], ...]:
    """(line index, level, title) of every heading outside fenced code."""
    text = text_of(path) or ""
    result = []
    for offset, line in outside_fences(text):
        if m := HEADING.match(line):
            result.append((text.count("\n", 0, offset), len(m.group(1)), m.group(2)))
    return tuple(result)


@cache
def headings(path: Path) -> tuple[str, ...]:
    return tuple(title for _, _, title in heading_lines(path))


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


def bold_labels(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := BOLD_LABEL.match(line))]


def title_forms(title: str) -> set[str]:
    """A heading or label as a citation may write it: whole, without its section number, code spans unwrapped, the
    closing punctuation of a label (`**Model kinds.**`) dropped."""
    forms = set()
    for form in (title, section_title(title)):
        for variant in (form, unwrap_code(form)):
            variant = " ".join(variant.split())
            forms.update({variant, variant.rstrip(".:;,")})
    return forms


def names_a_title(name: str, titles: set[str]) -> bool:
    """The whole title, or its first words: what follows the name in the title starts with no letter or digit."""
    return any(title == name or (title.startswith(name) and not title[len(name)].isalnum()) for title in titles)


@cache
def citable_titles(path: Path) -> frozenset[str]:
    text = text_of(path) or ""
    lines = [line for _, line in outside_fences(text)]
    return frozenset(form for title in (*headings(path), *bold_labels(lines)) for form in title_forms(title))


@cache
def architecture_section(number: str) -> tuple[frozenset[str], str]:
    """Section `number` of docs/architecture.md, to the next heading of its level or above: its headings' and bold
    labels' title forms, and its text as words (code spans unwrapped, emphasis dropped, lower case)."""
    text = text_of(ARCHITECTURE) or ""
    lines = text.splitlines()
    marks = heading_lines(ARCHITECTURE)
    for i, (start, level, title) in enumerate(marks):
        m = SECTION_NUMBER.match(title)
        if m and m.group(1) == number:
            end = next((line for line, other, _ in marks[i + 1:] if other <= level), len(lines))
            body = lines[start:end]
            titles = {form for t in (title, *(t for ln, _, t in marks if start < ln < end), *bold_labels(body))
                      for form in title_forms(t)}
            return frozenset(titles), as_words(" ".join(body))
    return frozenset(), ""


def as_words(text: str) -> str:
    return " ".join(re.sub(r"[*_]", "", unwrap_code(text)).lower().split())


def cited_document(cited: str, citing: Path) -> Path | None:
    """The document a citation names: beside the citing file, from the repository root, or in docs/."""
    for base in (citing.parent, REPO_ROOT, REPO_ROOT / "docs"):
        candidate = (base / cited).resolve()
        if candidate.is_relative_to(REPO_ROOT) and candidate.is_file():
            return candidate
    return None


def cited_name(raw: str) -> str:
    """The quoted name with the source's line breaks taken out: a comment's `#`, `//` or `*` on the next line, two
    string literals written one after the other (`"Embeddings and scoring through "\\n "Triton"`)."""
    name = re.sub(r"[\"']\s*\n\s*[\"']", "", raw)
    name = re.sub(r"\s*\n\s*(?:#+|//|\*|--|;+)?\s*", " ", name)
    return " ".join(name.split())


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
                    offending.append(f"{path.relative_to(REPO_ROOT)}:{number}: {needle!r} in {line.strip()[:100]!r}")
    assert not offending, ("files refer to documents outside the repository (cite docs/architecture.md or "
                           "docs/local-environment.md instead):\n" + "\n".join(offending))


def test_every_section_reference_is_a_heading_of_the_architecture_document():
    numbers = section_numbers()
    offending = [f"{where(path, text, m.start())}: §{m.group(1)}: no heading numbered {m.group(1)} in "
                 f"docs/architecture.md"
                 for path, text in citing_files() for m in SECTION_REF.finditer(text) if m.group(1) not in numbers]
    for path, text in citing_files():
        for m in FOREIGN_SECTION.finditer(text):
            if cited_document(m.group("doc"), path) != ARCHITECTURE:
                offending.append(f"{where(path, text, m.start())}: {m.group('doc')} §{m.group(SECTION_GROUP)}: "
                                 f"section numbers are docs/architecture.md's; cite {m.group('doc')} by a heading "
                                 f"(`{m.group('doc')}, \"Title\"`)")
    assert not offending, (f"section references that are not headings of docs/architecture.md (it has "
                           f"{', '.join(sorted(numbers))}):\n" + "\n".join(offending))


SECTION_GROUP = 2  # FOREIGN_SECTION's number: the group after `doc`


def test_every_section_cited_with_a_quotation_holds_it():
    offending = []
    for path, text in citing_files():
        for m in SECTION_CITATION.finditer(text):
            number, name = m.group(1), cited_name(m.group("name"))
            titles, words = architecture_section(number)
            if not titles:
                continue  # not a section: the section-reference test names it
            if names_a_title(name, set(titles)) or as_words(name) in words:
                continue
            offending.append(f"{where(path, text, m.start())}: §{number} \"{name}\": neither a heading, a bold label "
                             f"nor words of docs/architecture.md §{number}")
    assert not offending, "quotations of sections that do not hold them:\n" + "\n".join(offending)


def test_every_named_citation_is_a_heading_of_its_document():
    offending = []
    for path, text in citing_files():
        for m in NAMED_CITATION.finditer(text):
            cited, name = m.group("doc"), cited_name(m.group("name"))
            doc = cited_document(cited, path)
            if doc is None:
                offending.append(f"{where(path, text, m.start())}: {cited}, \"{name}\": no document {cited}")
            elif not names_a_title(name, set(citable_titles(doc))):
                offending.append(f"{where(path, text, m.start())}: {cited}, \"{name}\": no heading or bold label "
                                 f"\"{name}\" in {doc.relative_to(REPO_ROOT)}")
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
    for path, text in markdown_files():
        for offset, target in _links(text):
            if not target or SCHEME.match(target):
                continue
            file_part, _, fragment = target.partition("#")
            if file_part:
                base = REPO_ROOT if file_part.startswith("/") else path.parent
                resolved = (base / file_part.lstrip("/")).resolve()
            else:
                resolved = path
            if not resolved.is_relative_to(REPO_ROOT):
                offending.append(f"{where(path, text, offset)}: {target} leaves the repository")
            elif not resolved.exists():
                offending.append(f"{where(path, text, offset)}: {target} does not exist "
                                 f"({resolved.relative_to(REPO_ROOT)})")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                offending.append(f"{where(path, text, offset)}: {target}: no heading with anchor #{fragment} in "
                                 f"{resolved.relative_to(REPO_ROOT)}")
    assert not offending, "Markdown links that do not resolve:\n" + "\n".join(offending)


def test_every_plain_anchor_is_a_heading_of_its_document():
    offending = []
    for path, text in citing_files():
        if path.suffix == ".md":  # links are the link test's; a plain mention outside a link is this one's
            text = INLINE_LINK.sub(lambda m: " " * len(m.group(0)), text)
        for m in PLAIN_ANCHOR.finditer(text):
            if text[m.start() - 1:m.start()] == ":":  # a URL's path (https://...), not this repository's
                continue
            doc = cited_document(m.group("doc"), path)
            target = f"{m.group('doc')}#{m.group('anchor')}"
            if doc is None:
                offending.append(f"{where(path, text, m.start())}: {target}: no document {m.group('doc')}")
            elif m.group("anchor") not in anchors(doc):
                offending.append(f"{where(path, text, m.start())}: {target}: no heading with anchor "
                                 f"#{m.group('anchor')} in {doc.relative_to(REPO_ROOT)}")
    assert not offending, "anchors that are no heading of their document:\n" + "\n".join(offending)


def test_the_checks_recognise_what_they_check():
    """The patterns above find the forms the repository writes, and GitHub's anchors come out as GitHub makes them."""
    assert github_slug("3.7 Startup procedure") == "37-startup-procedure"
    assert github_slug("`make up` in both serving modes") == "make-up-in-both-serving-modes"
    assert github_slug("The rollout's Automation runner") == "the-rollouts-automation-runner"
    found = [(m.group("doc"), cited_name(m.group("name"))) for m in NAMED_CITATION.finditer(
        '(docs/architecture.md ("Layers")) docs/kserve.md, "Embedded\n#   Triton" [docs/kserve.md](docs/kserve.md), '
        '"Side by side" f"(docs/clients.md, \'Discovery\')" "docs/kserve.md, \\"Embeddings and scoring through "\n'
        '    "Triton\\"" ("README.md", "not a citation")')]
    assert found == [("docs/architecture.md", "Layers"), ("docs/kserve.md", "Embedded Triton"),
                     ("docs/kserve.md", "Side by side"), ("docs/clients.md", "Discovery"),
                     ("docs/kserve.md", "Embeddings and scoring through Triton")]
    assert [(m.group(1), cited_name(m.group("name"))) for m in SECTION_CITATION.finditer(
        '(§3.4, "Model kinds") (§4 "GPU count stays\n  within")')] == [("3.4", "Model kinds"),
                                                                         ("4", "GPU count stays within")]
    assert [(m.group("doc"), m.group(SECTION_GROUP)) for m in FOREIGN_SECTION.finditer(
        "(docs/clients.md §3) (docs/architecture.md §3.10b, §5)")] == [("docs/clients.md", "3"),
                                                                        ("docs/architecture.md", "3.10b")]
    assert names_a_title("Regions", {"Regions: one build, one digest"})
    assert not names_a_title("Region", {"Regions: one build, one digest"})
    assert names_a_title("Outputs beyond text_output", title_forms("Outputs beyond `text_output`:"))


# --- `make` targets and `llm-serving` subcommands named by the reader-facing documents -----------------------------

MAKEFILE = REPO_ROOT / "Makefile"
# A rule's targets: `name other:` at a line's start, not a recipe (a tab), not an assignment (`X := ...`).
MAKE_RULE = re.compile(r"^([A-Za-z0-9_.%/-]+(?:[ \t]+[A-Za-z0-9_.%/-]+)*)[ \t]*::?(?!=)", re.MULTILINE)
# `make up`, `make up MODE=standalone`, `make STACK=x rehearse`: the first word that is not an assignment.
MAKE_CALL = re.compile(r"(?:^|[;&|(]\s*|\$\s+)make[ \t]+(?:[A-Z_]+=\S*[ \t]+)*(?P<target>[a-z][\w.-]*)")
CLI_CALL = re.compile(r"(?:^|[;&|(/]\s*|\$\s+|\s)llm-serving[ \t]+(?P<sub>[a-z][\w-]*)"
                      r"(?:[ \t]+(?P<action>[a-z][\w-]*(?:\\?\|[a-z][\w-]*)*)(?![\w./-]))?")
# The parsers a subcommand hands its arguments to: their own subcommands, or the choices of their first positional.
NESTED_PARSERS = {"batch": REPO_ROOT / "llm_serving_cli" / "batch.py",
                  "rollout": REPO_ROOT / "infra" / "rollout" / "cli.py"}


def reader_documents() -> list[tuple[Path, str]]:
    named = {REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md"}
    return [(path, text) for path, text in markdown_files()
            if path in named or path.parent == REPO_ROOT / "docs"]


def code_of(text: str) -> list[tuple[int, str]]:
    """(offset, code) of every inline code span and every line of a fenced block, its shell comment dropped."""
    result, offset, fence = [], 0, None
    for line in text.splitlines(keepends=True):
        marker = FENCE.match(line)
        if fence is None and marker:
            fence = marker.group(1)
        elif fence is not None and marker and marker.group(1) == fence:
            fence = None
        elif fence is not None:
            result.append((offset, re.sub(r"(^|\s)#.*", "", line.rstrip("\n"))))
        else:
            result.extend((offset + m.start(), m.group(0).strip("`").strip()) for m in INLINE_CODE.finditer(line))
        offset += len(line)
    return result


@cache
def make_targets() -> frozenset[str]:
    return frozenset(name for m in MAKE_RULE.finditer(MAKEFILE.read_text()) for name in m.group(1).split())


def parser_names(path: Path) -> set[str]:
    """`add_parser("name")` subcommands, and the choices of a positional `add_argument` (`action`, `command`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        if node.func.attr == "add_parser":
            names.add(first.value)
        elif node.func.attr == "add_argument" and not first.value.startswith("-"):
            for keyword in node.keywords:
                if keyword.arg == "choices" and isinstance(keyword.value, (ast.List, ast.Tuple)):
                    names.update(e.value for e in keyword.value.elts if isinstance(e, ast.Constant))
    return names


@cache
def cli_subcommands() -> dict[str, frozenset[str]]:
    """Each `llm-serving` subcommand with the subcommands of the parser it hands its arguments to (none: empty)."""
    top = parser_names(REPO_ROOT / "llm_serving_cli" / "main.py")
    return {name: frozenset(parser_names(NESTED_PARSERS[name]) if name in NESTED_PARSERS else ()) for name in top}


def test_every_make_target_and_cli_subcommand_named_in_the_docs_exists():
    targets, commands = make_targets(), cli_subcommands()
    offending = []
    for path, text in reader_documents():
        for offset, code in code_of(text):
            for m in MAKE_CALL.finditer(code):
                if m.group("target") not in targets:
                    offending.append(f"{where(path, text, offset)}: `make {m.group('target')}`: no such target in "
                                     f"the Makefile")
            for m in CLI_CALL.finditer(code):
                sub, action = m.group("sub"), m.group("action")
                if sub not in commands:
                    offending.append(f"{where(path, text, offset)}: `llm-serving {sub}`: no such subcommand "
                                     f"(llm_serving_cli/main.py has {', '.join(sorted(commands))})")
                elif action and commands[sub]:
                    for name in re.split(r"\\?\|", action):
                        if name not in commands[sub]:
                            offending.append(f"{where(path, text, offset)}: `llm-serving {sub} {name}`: no such "
                                             f"subcommand ({sub} has {', '.join(sorted(commands[sub]))})")
    assert not offending, "commands the docs name that do not exist:\n" + "\n".join(offending)


def test_the_command_checks_recognise_what_they_check():
    assert {"up", "test", "bench", "rehearse", "serving-env"} <= make_targets()
    assert "SERVING" not in make_targets()  # an assignment (`SERVING := ...`), not a rule
    assert {"package", "publish", "up", "rollout", "rehearse", "batch"} <= set(cli_subcommands())
    assert {"start", "advance", "abort", "status"} <= cli_subcommands()["rollout"]
    assert {"submit", "status", "results"} <= cli_subcommands()["batch"]
    calls = [m.group("target") for code in ("make up MODE=standalone", "make STACK=dev rehearse", "cd x && make test",
                                            "$ make plan") for m in MAKE_CALL.finditer(code)]
    assert calls == ["up", "rehearse", "test", "plan"]
    found = [(m.group("sub"), m.group("action")) for m in CLI_CALL.finditer(
        "llm-serving rollout start\\|advance MODEL; .venv-serving/bin/llm-serving up --model DIR; "
        "llm-serving publish my-model-1.2.0.tar.gz")]
    assert found == [("rollout", "start\\|advance"), ("up", None), ("publish", None)]
