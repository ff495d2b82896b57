"""A content hash of the serving image's build context, used as its immutable ECR tag."""

from __future__ import annotations

import hashlib
from pathlib import Path

IGNORED_PARTS = {"__pycache__", ".pytest_cache"}


def context_hash(context: Path) -> str:
    """sha256 over every file's relative path and bytes: it changes exactly when the build context changes."""
    h = hashlib.sha256()
    if context.is_dir():
        files = sorted(p for p in context.rglob("*") if p.is_file() and not IGNORED_PARTS & set(p.parts)
                       and p.suffix not in (".so", ".pyc"))
        for path in files:
            h.update(str(path.relative_to(context)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()
