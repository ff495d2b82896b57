"""Where this project's files are: the repository root of a checkout, the one definition every package uses.

In a checkout (and an editable install) it is the directory holding pyproject.toml. In an installed wheel (the
serving image) the packages sit in site-packages and there is no repository: the paths built on it (the stacks, the
Dockerfile, the virtual environments) are then the developer tools' business, which do not run there.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
