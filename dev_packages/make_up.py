"""What `llm-serving up` (and `make image-check`) serve, packaged and published to a local model store before any
server starts: the LLM and, for the demo, the ranker family beside it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from dev_packages.versions import CONTENT_VERSION, build_local_package
from llm_serving.manifest import ServingMode
from llm_serving.package import PackageSpec
from llm_serving.store import LocalStore, PublishedPackage
from llm_serving.up_layout import write_served

console = Console(stderr=True)
DEMO_ENGINE_ARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": 256 * 1024 * 1024, "dtype": "float32"}


@dataclass(frozen=True)
class UpPackages:
    """What `up` serves: the LLM's and its companions' directories on the local model cache."""

    package: Path
    companions: tuple[Path, ...]


def publish_for_up(cache: Path, model_dir: Path, model_id: str, engine_args: dict, serving_mode: ServingMode, *,
                   with_companions: bool) -> UpPackages:
    """`up`'s packaging and publishing, everything before the server starts: the LLM and (`with_companions`, the
    demo) the ranker family, each with a version derived from its bytes (dev_packages/versions.py), so the
    same content publishes again as a no-op and other content (the other serving mode, other weights) as a new
    version, never refused as immutable."""
    with console.status("packaging"):
        built = build_local_package(PackageSpec(model_dir, model_id, CONTENT_VERSION, engine_args=engine_args,
                                                serving_mode=serving_mode), cache / "packages")
    console.print(f"[bold]model[/] {model_dir} -> {model_id} {built.version}")
    console.print(f"[green]packaged[/] {built.path}")
    store = LocalStore(cache / "store", cache / "model-cache")
    with console.status("publishing to the local model store"):
        published = store.publish(built.path)
    _print_published(published)
    companions = []
    served = {published.model_id: (published.version, Path(published.model_cache_uri))}
    if with_companions:
        # Every model kind on one Triton (docs/architecture.md §3.4, "Model kinds"): the demo ranker (XGBoost,
        # trained now) and its pipeline (an ensemble), each packaged and published like any other package, served
        # beside the LLM by tritonserver (standalone) or by the Triton embedded in the OpenAI front-end (openai).
        from dev_packages.demo import build_ranker_packages

        with console.status("training the demo ranker and packaging it with its pipeline"):
            extra = build_ranker_packages(cache / "packages", packed=True, serving_mode=serving_mode)
        for path in extra:
            with console.status(f"publishing {path.name}"):
                companion = store.publish(path)
            _print_published(companion)
            companions.append(Path(companion.model_cache_uri))
            served[companion.model_id] = (companion.version, Path(companion.model_cache_uri))
    write_served(cache, served)  # where a client service beside the server finds a package to run in its process
    return UpPackages(Path(published.model_cache_uri), tuple(companions))


def _print_published(published: PublishedPackage) -> None:
    state = "already published (identical)" if published.already_published else "published"
    console.print(f"[green]{state}[/] {published.model_id} {published.version}: {published.package_uri}",
                  markup=True, highlight=False)
