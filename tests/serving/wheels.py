"""Build small, valid wheels for tests (plugins, hostile packages) without a build backend."""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(name: str, version: str = "0.1", *, files: dict[str, str] | None = None,
               requires: list[str] | None = None, entry_points: dict[str, dict[str, str]] | None = None) -> bytes:
    """A py3-none-any wheel with METADATA, WHEEL, entry_points.txt and a RECORD pip accepts."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    contents: dict[str, bytes] = {path: text.encode() for path, text in (files or {}).items()}
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires or []]
    contents[f"{dist}/METADATA"] = ("\n".join(meta) + "\n").encode()
    contents[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if entry_points:
        text = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                       for group, eps in entry_points.items())
        contents[f"{dist}/entry_points.txt"] = text.encode()
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in contents.items())
    record += f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    # A fixed timestamp: the same wheel byte for byte whenever it is built (a test parametrized with one at
    # collection had different ids in two pytest-xdist workers that collected it a second apart)
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in [*contents.items(), (f"{dist}/RECORD", record.encode())]:
            entry = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16  # rw-r--r--, as writestr(name, ...) would give
            archive.writestr(entry, data)
    return buffer.getvalue()


def wheel_filename(name: str, version: str = "0.1") -> str:
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
