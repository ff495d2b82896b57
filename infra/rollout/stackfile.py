"""Edit one model's entry in a stack config file in place (docs/architecture.md §3.6), keeping comments, key order and
quoting (ruamel.yaml's round-trip mode), and validate the result with the program's own schema before it is
written: a rollout never writes a file the program would reject.

The edits are the shapes of §4:
- red-black: `start` (a candidate at a weight), `set_weight`, `finalize` (the candidate becomes the active version,
  the old one leaves the file), `rollback` (the candidate leaves: the active version gets every replica back);
- versioned: `add_version`, `remove_versions` (never the newest).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from infra.config import PROJECT, ConfigError, ModelConfig, StackConfig, parse_stack_config

MODELS_KEY = f"{PROJECT}:models"


class StackFileError(ValueError):
    """The stack file or the requested edit is wrong; the message names the file, the model and the key."""


def _yaml() -> YAML:
    yaml = YAML()  # round-trip: comments, order and quotes survive
    yaml.preserve_quotes = True
    yaml.width = 120
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


@dataclass
class StackFile:
    path: Path
    doc: CommentedMap

    @classmethod
    def load(cls, path: Path) -> StackFile:
        path = Path(path)
        if not path.is_file():
            raise StackFileError(f"{path}: no such stack config file")
        doc = _yaml().load(path.read_text())
        if not isinstance(doc, CommentedMap) or not isinstance(doc.get("config"), CommentedMap):
            raise StackFileError(f"{path}: not a Pulumi stack config file (no top-level `config:` mapping)")
        return cls(path, doc)

    @property
    def stack(self) -> str:
        return self.path.name.removeprefix("Pulumi.").removesuffix(".yaml")

    @property
    def config(self) -> CommentedMap:
        return self.doc["config"]

    def typed(self) -> StackConfig:
        """The file's config as the program validates it (raises ConfigError with the key's name)."""
        values = {k.split(":", 1)[1]: _plain(v) for k, v in self.config.items() if k.startswith(f"{PROJECT}:")}
        region = self.config.get("aws:region")
        if not region:
            raise StackFileError(f"{self.path}: aws:region is not set")
        return parse_stack_config(values, str(region))

    def model(self, model_id: str) -> ModelConfig:
        for model in self.typed().models:
            if model.id == model_id:
                return model
        raise StackFileError(f"{self.path}: no model {model_id!r} under {MODELS_KEY} "
                             f"(models: {[m.id for m in self.typed().models]})")

    def _entry(self, model_id: str) -> CommentedMap:
        models = self.config.get(MODELS_KEY)
        if not isinstance(models, CommentedSeq):
            raise StackFileError(f"{self.path}: {MODELS_KEY} is not a list")
        for entry in models:
            if isinstance(entry, CommentedMap) and entry.get("id") == model_id:
                return entry
        raise StackFileError(f"{self.path}: no model {model_id!r} under {MODELS_KEY}")

    def text(self) -> str:
        out = io.StringIO()
        _yaml().dump(self.doc, out)
        return out.getvalue()

    def save(self) -> None:
        """Validate, then write atomically (a temporary file renamed over the original)."""
        try:
            self.typed()
        except ConfigError as err:
            raise StackFileError(f"{self.path}: the edit would make the stack config invalid:\n{err}") from None
        tmp = self.path.with_suffix(".yaml.rollout-tmp")
        tmp.write_text(self.text())
        tmp.replace(self.path)

    # -- red-black ---------------------------------------------------------------------------------------------

    def start(self, model_id: str, version: dict[str, str], weight: int) -> None:
        """Name `version` (a `versions[]` entry: version, package, ioFingerprint) as the candidate at `weight`."""
        entry = self._entry(model_id)
        model = self.model(model_id)
        if model.strategy != "red-black":
            raise StackFileError(f"{self.path}: model {model_id!r} is {model.strategy}; a candidate is red-black only")
        if model.candidate is not None:
            raise StackFileError(f"{self.path}: model {model_id!r} is already rolling out {model.candidate!r} "
                                 f"(weight {model.weight}); advance or abort it first")
        if version["version"] == model.active:
            raise StackFileError(f"{self.path}: {version['version']!r} is already the active version of {model_id!r}")
        entry["versions"].append(CommentedMap(version))
        self._set_after(entry, "active", "candidate", version["version"])
        self._set_after(entry, "candidate", "weight", weight)

    def set_weight(self, model_id: str, weight: int) -> None:
        entry = self._entry(model_id)
        if entry.get("candidate") is None:
            raise StackFileError(f"{self.path}: model {model_id!r} has no candidate; start a rollout first")
        entry["weight"] = weight

    def finalize(self, model_id: str) -> str:
        """The candidate (at weight 100) becomes the active version; the old one leaves. Returns the old one."""
        entry = self._entry(model_id)
        model = self.model(model_id)
        if model.candidate is None or model.weight != 100:
            raise StackFileError(f"{self.path}: model {model_id!r} can be finalized only with its candidate at weight "
                                 f"100 (candidate {model.candidate!r}, weight {model.weight})")
        old = model.active
        entry["active"] = model.candidate
        del entry["candidate"]
        del entry["weight"]
        self._drop_versions(entry, {old})
        return old  # type: ignore[return-value]

    def rollback(self, model_id: str) -> str:
        """The candidate leaves the file; the active version gets all replicas and traffic back. Returns it."""
        entry = self._entry(model_id)
        model = self.model(model_id)
        if model.candidate is None:
            raise StackFileError(f"{self.path}: model {model_id!r} has no candidate to roll back")
        for key in ("candidate", "weight"):
            if key in entry:
                del entry[key]
        self._drop_versions(entry, {model.candidate})
        return model.candidate

    # -- versioned ---------------------------------------------------------------------------------------------

    def add_version(self, model_id: str, version: dict[str, str]) -> None:
        entry = self._entry(model_id)
        model = self.model(model_id)
        if model.strategy != "versioned":
            raise StackFileError(f"{self.path}: model {model_id!r} is red-black; use a candidate, not a second "
                                 f"served version")
        if any(v.version == version["version"] for v in model.versions):
            raise StackFileError(f"{self.path}: model {model_id!r} already serves {version['version']!r}")
        entry["versions"].append(CommentedMap(version))

    def remove_versions(self, model_id: str, versions: set[str], newest: str) -> None:
        if newest in versions:
            raise StackFileError(f"{self.path}: model {model_id!r}: the newest version {newest!r} is never removed")
        entry = self._entry(model_id)
        listed = {v["version"] for v in entry["versions"]}
        unknown = sorted(versions - {str(v) for v in listed})
        if unknown:
            raise StackFileError(f"{self.path}: model {model_id!r} does not list {unknown}")
        self._drop_versions(entry, versions)

    # -- helpers -----------------------------------------------------------------------------------------------

    @staticmethod
    def _drop_versions(entry: CommentedMap, versions: set[str]) -> None:
        seq: CommentedSeq = entry["versions"]
        for i in reversed(range(len(seq))):
            if str(seq[i]["version"]) in versions:
                del seq[i]

    @staticmethod
    def _set_after(entry: CommentedMap, after: str, key: str, value: Any) -> None:
        if key in entry:
            entry[key] = value
            return
        keys = list(entry.keys())
        entry.insert(keys.index(after) + 1 if after in keys else len(keys), key, value)


def version_entry(version: str, package: str, io_fingerprint: str, weights_gib: float | None = None) -> dict:
    """A `versions[]` entry. `package` is the published package directory (llm_serving.pod_contract.package_uri);
    `weights_gib` its weights' size (required by the schema for a vllm model's versions); the stack's schema refuses
    any other key for (model, version)."""
    entry: dict = {"version": version, "package": package, "ioFingerprint": io_fingerprint}
    if weights_gib is not None:
        entry["weightsGib"] = weights_gib
    return entry
