"""The serving image's build context and its content hash, used as the image's immutable ECR tag.

The context is the repository root (the Dockerfile copies `pyproject.toml`, `native/`, `llm_serving/`,
`serving_image/`, `infra/`, `policies/`), filtered by `serving_image/Dockerfile.dockerignore` as BuildKit filters it.
The hash covers exactly what the build can see: the Dockerfile, its ignore file, and every file below each source of
the Dockerfile's `COPY` instructions (those without `--from`) that the ignore file lets through. A change to any of
them changes the tag and, through the image's digest, every Deployment (docs/architecture.md §2).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shlex
from pathlib import Path

# Never part of a build, whatever the ignore file says: interpreter caches and locally built extensions.
ALWAYS_IGNORED_PARTS = {"__pycache__", ".pytest_cache"}
ALWAYS_IGNORED_SUFFIXES = (".so", ".pyc")


class ImageContextError(ValueError):
    pass


def _instructions(dockerfile_text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in dockerfile_text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append((current + line).strip())
        current = ""
    if current:
        out.append(current.strip())
    return out


def copy_sources(dockerfile: Path) -> list[str]:
    """The context paths the Dockerfile's `COPY`/`ADD` instructions read (not `--from` another stage)."""
    sources: list[str] = []
    for instruction in _instructions(dockerfile.read_text()):
        keyword, _, rest = instruction.partition(" ")
        if keyword.upper() not in ("COPY", "ADD"):
            continue
        rest = rest.strip()
        if rest.startswith("["):
            import json

            words = json.loads(rest)
        else:
            words = shlex.split(rest)
        flags = [w for w in words if w.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            continue
        paths = [w for w in words if not w.startswith("--")]
        if len(paths) < 2:
            raise ImageContextError(f"{dockerfile}: cannot read the sources of {instruction!r}")
        sources += [p.rstrip("/") or "." for p in paths[:-1]]
    return sources


def dockerignore_patterns(dockerfile: Path) -> list[str]:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if not ignore.is_file():
        ignore = dockerfile.parent / ".dockerignore"
    if not ignore.is_file():
        return []
    return [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    result = False
    parts = rel.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]  # a pattern matching a directory
        bare = pat.removeprefix("**/")
        hit = any(fnmatch.fnmatchcase(c, pat) for c in candidates) or (
            pat.startswith("**/") and any(fnmatch.fnmatchcase(p, bare) or fnmatch.fnmatchcase(c, "*/" + bare)
                                          for p, c in zip(parts, candidates, strict=True)))
        if hit:
            result = not negate
    return result


def context_files(context: Path, dockerfile: Path) -> list[Path]:
    """Every file the build reads from `context`: the Dockerfile, its ignore file, and the COPY sources' files."""
    context = context.resolve()
    patterns = dockerignore_patterns(dockerfile)
    files: set[Path] = {dockerfile.resolve()}
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if ignore_file.is_file():
        files.add(ignore_file.resolve())
    for source in copy_sources(dockerfile):
        if re.search(r"[*?\[]", source):
            matches = sorted(context.glob(source))
        else:
            matches = [context / source]
        if not any(m.exists() for m in matches):
            raise ImageContextError(f"{dockerfile} copies {source!r}, which is not in the build context {context}")
        for match in matches:
            for path in ([match] if match.is_file() else _walk(match, context, patterns)):
                rel = path.resolve().relative_to(context).as_posix()
                if ALWAYS_IGNORED_PARTS & set(rel.split("/")) or rel.endswith(ALWAYS_IGNORED_SUFFIXES):
                    continue
                if _ignored(rel, patterns):
                    continue
                files.add(path.resolve())
    return sorted(files)


def _walk(top: Path, context: Path, patterns: list[str]) -> list[Path]:
    """Files below `top`, not descending into directories the build ignores (node_modules, caches)."""
    out = []
    for root, dirs, names in os.walk(top):
        base = Path(root)
        dirs[:] = sorted(d for d in dirs if d not in ALWAYS_IGNORED_PARTS
                         and not _ignored((base / d).resolve().relative_to(context).as_posix(), patterns))
        out += [base / n for n in sorted(names) if (base / n).is_file()]
    return out


def context_hash(context: Path, dockerfile: Path) -> str:
    """sha256 over every file the build reads (relative path and bytes): it changes exactly when one of them does."""
    h = hashlib.sha256()
    context = context.resolve()
    for path in context_files(context, dockerfile):
        h.update(path.relative_to(context).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def image_tag(context: Path, dockerfile: Path, build_args: dict[str, str], prefix: str) -> str:
    """The image's tag: `prefix` and a hash of everything that decides its bytes, the build context's files and
    the build arguments (the base images among them), so the same inputs always get the same tag and a tag never
    names two different images (ECR's tags are immutable; `make image` reuses a tag it finds)."""
    h = hashlib.sha256(context_hash(context, dockerfile).encode())
    for key, value in sorted(build_args.items()):
        h.update(f"\0{key}={value}".encode())
    return f"{prefix}-{h.hexdigest()[:16]}"
