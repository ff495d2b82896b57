"""What a Dockerfile's final stage says about the image's runtime: its ENV, USER, WORKDIR, EXPOSE and ENTRYPOINT.

Read by the tests that hold serving_image/Dockerfile to the pod contract (llm_serving/pod_contract.py) and by the
rehearsal, which runs the image's ENTRYPOINT over the image's own ENV. Standard library only.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class ImageFacts:
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    workdir: str | None = None
    exposed: tuple[int, ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    run: tuple[str, ...] = ()  # the final stage's RUN commands, as written


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, rest) of every instruction, continuation lines joined, comments and parser directives dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue
        if not line and not current:
            continue
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        full = (current + line).strip()
        current = ""
        if full:
            keyword, _, rest = full.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    if current.strip():
        keyword, _, rest = current.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def _exec_form(rest: str, keyword: str) -> tuple[str, ...]:
    if not rest.startswith("["):
        raise DockerfileError(f"{keyword} {rest!r}: only the exec (JSON) form is supported (a shell form would run "
                              "under /bin/sh -c and not receive signals)")
    try:
        words = json.loads(rest)
    except json.JSONDecodeError as err:
        raise DockerfileError(f"{keyword} {rest!r}: not a JSON array ({err})") from None
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise DockerfileError(f"{keyword} {rest!r}: expected a JSON array of strings")
    return tuple(words)


def _env(rest: str, known: dict[str, str]) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # legacy `ENV KEY value`
        return {words[0]: " ".join(words[1:])}
    out = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise DockerfileError(f"ENV {rest!r}: {word!r} is not KEY=VALUE")
        for name, val in {**known, **out}.items():  # ${VAR} of an earlier ENV
            value = value.replace("${" + name + "}", val).replace("$" + name, val)
        out[key] = value
    return out


def final_stage(text: str) -> ImageFacts:
    """The facts of the last stage (after its last FROM)."""
    items = instructions(text)
    starts = [i for i, (k, _) in enumerate(items) if k == "FROM"]
    if not starts:
        raise DockerfileError("no FROM instruction")
    env: dict[str, str] = {}
    user = workdir = None
    exposed: list[int] = []
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    run: list[str] = []
    for keyword, rest in items[starts[-1] + 1:]:
        if keyword == "ENV":
            env.update(_env(rest, env))
        elif keyword == "USER":
            user = rest
        elif keyword == "WORKDIR":
            workdir = rest
        elif keyword == "EXPOSE":
            exposed += [int(p.split("/")[0]) for p in rest.split()]
        elif keyword == "ENTRYPOINT":
            entrypoint = _exec_form(rest, keyword)
        elif keyword == "CMD":
            cmd = _exec_form(rest, keyword)
        elif keyword == "RUN":
            run.append(rest)
    return ImageFacts(env, user, workdir, tuple(exposed), entrypoint, cmd, tuple(run))


def read(path: Path) -> ImageFacts:
    return final_stage(Path(path).read_text())


def from_image_config(config: dict) -> ImageFacts:
    """The same facts read from a built image's configuration (`podman image inspect`'s `Config`)."""
    env = {}
    for item in config.get("Env") or []:
        key, _, value = item.partition("=")
        env[key] = value
    exposed = tuple(sorted(int(p.split("/")[0]) for p in (config.get("ExposedPorts") or {})))
    return ImageFacts(env, config.get("User") or None, config.get("WorkingDir") or None, exposed,
                      tuple(config.get("Entrypoint") or ()), tuple(config.get("Cmd") or ()), ())


def pod_contract_problems(facts: ImageFacts) -> list[str]:
    """Where an image's runtime facts differ from the pod contract (llm_serving/pod_contract.py): its ENTRYPOINT
    and CMD, the ENV the contract fixes, its user, its ports, and every directory it writes being on a writable
    volume. Empty when they agree."""
    from llm_serving import pod_contract as pc

    problems = []
    if facts.entrypoint != pc.ENTRYPOINT:
        problems.append(f"ENTRYPOINT is {list(facts.entrypoint)}, the pod contract's is {list(pc.ENTRYPOINT)}")
    if facts.cmd:
        problems.append(f"CMD is {list(facts.cmd)}: the package comes from the Deployment's env, never from CMD")
    for name, value in {**pc.IMAGE_ENV, **pc.CACHE_ENV}.items():
        if facts.env.get(name) != value:
            problems.append(f"ENV {name} is {facts.env.get(name)!r}, the pod contract's is {value!r}")
    if facts.user != str(pc.RUN_AS_UID):
        problems.append(f"USER is {facts.user!r}, the pod contract's is {pc.RUN_AS_UID}")
    if set(facts.exposed) != set(pc.PORTS.values()):
        problems.append(f"EXPOSE is {sorted(facts.exposed)}, the pod contract's ports are {sorted(pc.PORTS.values())}")
    if facts.workdir != pc.IMAGE_WORKDIR:
        problems.append(f"WORKDIR is {facts.workdir!r}, the pod contract's is {pc.IMAGE_WORKDIR!r} (a writable "
                        f"volume's mount point: the runtime would make a directory below it as root)")
    for path in (*pc.CACHE_ENV.values(), pc.MULTIPROC_DIR, pc.WORK_DIR, facts.workdir or "/"):
        if not any(path == m or path.startswith(m + "/") for m in pc.WRITABLE_MOUNTS):
            problems.append(f"{path} is on the read-only root file system (no writable volume holds it)")
    return problems
