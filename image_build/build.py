"""`make image`: serving_image/Dockerfile built on this machine, FROM stand-in bases made from Debian's and PyPI's
packages (docs/first-update.md, "The image built here").

    1. debian      mmdebstrap's Debian 12 root file system (image/stand-in/debian.packages), imported into podman
    2. bases       the stand-ins for NGC's Triton vLLM image and CUDA devel image (image/stand-in/*.Containerfile)
    3. serving     serving_image/Dockerfile with the stand-ins' build arguments (compat.toml [stand_in])
    4. checks      on the built image: its config against the pod contract, the modules the startup and the stub
                   import, the pins as installed; its size by layer; its SBOM copied to .cache/image/

Every image's tag is derived from the inputs that decide its bytes (its definition's files, its build arguments and
its bases' image ids), so a tag that exists is reused, and the same tag cannot name two different images.
Layer caching (`buildah bud --layers`) keeps the bases and the native stage when only Python files change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from image_build import containers, verify
from image_build.containers import STATE, ContainerToolError
from infra.image_context import context_files, image_tag
from llm_serving.compat import load_compat
from llm_serving.repository import REPO_ROOT

STAND_IN = REPO_ROOT / "image" / "stand-in"
DOCKERFILE = REPO_ROOT / "serving_image" / "Dockerfile"
RECORD = STATE / "image.json"  # what the last build made: `make image-check` and the rehearsal run this image
SBOM = STATE / "sbom.cdx.json"
DEBIAN_SUITE = "bookworm"
REPOSITORY = "localhost/llm-serving"


@dataclass(frozen=True)
class BuiltImage:
    ref: str  # localhost/llm-serving:<tag>
    image_id: str
    build_args: dict[str, str]
    bases: dict[str, str]  # stand-in name -> its ref
    seconds: float
    cached: bool  # the tag existed: nothing was built


def _say(text: str) -> None:
    print(f"== image: {text}", flush=True)


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def _files_digest(paths: list[Path]) -> bytes:
    return b"".join(p.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0"
                    for p in sorted(paths))


def stage_context(files: list[Path], name: str) -> Path:
    """A build context holding exactly `files` (hard links where possible), so the build reads nothing else (the
    repository root also holds several GB of virtual environments)."""
    root = STATE / "contexts" / name
    if root.exists():
        shutil.rmtree(root)
    for path in files:
        target = root / path.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
    return root


def debian_base() -> str:
    """The Debian root file system the stand-ins start from, imported into podman once per package list."""
    packages = [line.strip() for line in (STAND_IN / "debian.packages").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    digest = _digest([DEBIAN_SUITE.encode(), *map(str.encode, packages)])[:16]
    ref = f"localhost/llm-serving-stand-in/debian:{DEBIAN_SUITE}-{digest}"
    if containers.image_exists(ref):
        _say(f"debian base {ref} exists")
        return ref
    _say(f"debian base: mmdebstrap {DEBIAN_SUITE} with {', '.join(packages)}")
    tar = STATE / "debian-rootfs.tar"
    STATE.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}", DEBIAN_SUITE, str(tar)],
                   check=True)
    containers.run(containers.podman("import", str(tar), ref))
    tar.unlink()
    return ref


def buildah_bud(containerfile: Path, files: list[Path], build_args: dict[str, str], ref: str, name: str,
                pip: containers.PipSettings) -> None:
    context = stage_context(files, name)
    argv = ["buildah", "bud", "--isolation", "chroot", "--layers", "--format", "docker",
            "-f", str(context / containerfile.relative_to(REPO_ROOT)), "-t", ref,
            *containers.build_volumes(pip)]
    for key, value in sorted(build_args.items()):
        argv += ["--build-arg", f"{key}={value}"]
    log = STATE / f"build-{name}.log"
    _say(f"building {ref} (log: {log.relative_to(REPO_ROOT)})")
    with open(log, "w") as out:
        proc = subprocess.Popen([*argv, str(context)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=containers.environment())
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            # Progress: buildah's step lines and anything that says why a step failed.
            if (" STEP " in f" {line}" or line.startswith(("Error", "error", "COMMIT"))
                    or "--> Using cache" in line):
                print(f"   {line.rstrip()[:200]}", flush=True)
        status = proc.wait()
    if status != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise ContainerToolError(f"building {ref} failed (status {status}); the log's end:\n{tail}")


def stand_in_bases(debian: str, pip: containers.PipSettings) -> dict[str, str]:
    """The stand-ins for NGC's two bases, each tagged by its definition and the Debian base's id."""
    debian_id = containers.inspect(debian)["Id"]
    bases = {}
    for name, locks in (("tritonserver", ["stand-in-vllm.txt", "stand-in-triton.txt", "stand-in-stub.txt"]),
                        ("cuda", ["stand-in-cuda.txt"])):
        containerfile = STAND_IN / {"tritonserver": "triton-vllm", "cuda": "cuda-devel"}[name]
        containerfile = containerfile.with_name(containerfile.name + ".Containerfile")
        files = [containerfile, *(REPO_ROOT / "image" / "locks" / lock for lock in locks)]
        if name == "tritonserver":
            files += [STAND_IN / "nvidia_entrypoint.sh", STAND_IN / "triton_python_backend_stub.sh"]
        ref = f"localhost/llm-serving-stand-in/{name}:{_digest([_files_digest(files), debian_id.encode()])[:16]}"
        if containers.image_exists(ref):
            _say(f"stand-in {name} base {ref} exists")
        else:
            buildah_bud(containerfile, files, {"DEBIAN_BASE": debian}, ref, f"stand-in-{name}", pip)
        bases[name] = ref
    return bases


def stand_in_build_args(bases: dict[str, str]) -> dict[str, str]:
    """The Dockerfile's build arguments for the stand-in bases (compat.toml [stand_in]); every other argument keeps
    its production default."""
    stand_in = load_compat().stand_in
    return {"TRITON_IMAGE": bases["tritonserver"], "CUDA_DEVEL_IMAGE": bases["cuda"], **stand_in.build_args}


def serving_image(build_args: dict[str, str], pip: containers.PipSettings, bases: dict[str, str]) -> BuiltImage:
    started = time.monotonic()
    files = context_files(REPO_ROOT, DOCKERFILE)
    base_ids = {name: containers.inspect(ref)["Id"] for name, ref in bases.items()}
    tag = image_tag(REPO_ROOT, DOCKERFILE, {**build_args, **{f"base:{k}": v for k, v in base_ids.items()}},
                    prefix="stand-in")
    ref = f"{REPOSITORY}:{tag}"
    cached = containers.image_exists(ref)
    if cached:
        _say(f"{ref} exists (same inputs): not rebuilt")
    else:
        buildah_bud(DOCKERFILE, files, build_args, ref, "serving", pip)
    image_id = containers.inspect(ref)["Id"]
    return BuiltImage(ref, image_id, build_args, bases, round(time.monotonic() - started, 1), cached)


def layer_sizes(ref: str) -> list[tuple[int, str]]:
    """(bytes, the instruction that made it) for each layer, base layers included."""
    history = json.loads(containers.run(containers.podman("history", "--format", "json", "--no-trunc", ref)).stdout)
    layers = []
    for h in reversed(history):
        created = " ".join((h.get("CreatedBy") or h.get("created_by") or "").split())
        # A RUN's record starts with its build arguments (`|N K=V ... /bin/bash -o pipefail -c CMD`): show CMD.
        created = created.split(" -c ", 1)[1] if " -c " in created else created
        layers.append((int(h.get("size") or 0), created.removeprefix("#(nop) ")[:110]))
    return layers


def print_layers(ref: str) -> None:
    layers = layer_sizes(ref)
    total = sum(size for size, _ in layers)
    print(f"   {ref}: {total / 1e9:.2f} GB in {len(layers)} layers (the non-empty ones, oldest first):")
    for size, created in layers:
        if size:
            print(f"   {size / 1e6:10.1f} MB  {created}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-serving image build", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    try:
        containers.require_tools()
        pip = containers.host_pip_settings(sys.executable)
        debian = debian_base()
        bases = stand_in_bases(debian, pip)
        built = serving_image(stand_in_build_args(bases), pip, bases)
        print_layers(built.ref)
        verify.built_image(built.ref)
        SBOM.write_text(containers.run(containers.podman(
            "run", "--rm", "--entrypoint", "cat", built.ref, verify.SBOM_PATH)).stdout)
        RECORD.write_text(json.dumps(asdict(built), indent=1) + "\n")
    except (ContainerToolError, subprocess.CalledProcessError, verify.ImageCheckError) as exc:
        print(f"image: {exc}", file=sys.stderr)
        return 1
    _say(f"built {built.ref} ({built.image_id[:12]}) in {built.seconds:.0f} s; SBOM: {SBOM.relative_to(REPO_ROOT)}; "
         f"record: {RECORD.relative_to(REPO_ROOT)}")
    return 0


def built_ref() -> str:
    """The image the last `make image` built (what `make image-check` and the rehearsal run)."""
    if not RECORD.is_file():
        raise ContainerToolError(f"no image built yet ({RECORD.relative_to(REPO_ROOT)} is missing): run `make image`")
    ref = json.loads(RECORD.read_text())["ref"]
    if not containers.image_exists(ref):
        raise ContainerToolError(f"{ref} (recorded in {RECORD.relative_to(REPO_ROOT)}) is not in podman's storage: "
                                 "run `make image`")
    return ref


if __name__ == "__main__":
    sys.exit(main())
