"""`llm-serving publish --warm-region R ...`: publishing ends when every named region's model cache holds the version.

The request goes into the home bucket beside the package (it replicates with it); each region's cache warmer
(serving_image/cache_warmer.py, a CronJob of that region's stack) restores and verifies every file on its FSx and
writes a resident marker in its own bucket (llm_serving.cache_state). This waits for those markers, one line per
region, and fails naming the regions still cold when the timeout passes: `llm-serving rollout start` refuses the
version in those regions anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from llm_serving.store import PublishedPackage, PublishError, S3Store, resident_problem


def wait_resident(store: S3Store, published: PublishedPackage, home_region: str, regions: list[str],
                  timeout_s: float, poll_s: float, console: Console,
                  s3_for_region: Callable[[str], object] | None = None,
                  sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic
                  ) -> dict[str, str]:
    """Poll each region's marker until all are resident or `timeout_s` passes; returns {region: why not} for the
    regions still not resident (empty when publishing is complete)."""
    if s3_for_region is None:
        import boto3

        clients: dict[str, object] = {}

        def s3_for_region(region: str):
            return clients.setdefault(region, boto3.client("s3", region_name=region))

    buckets = {r: store.regional_bucket(home_region, r) for r in regions}
    pending = {r: "not checked yet" for r in regions}
    deadline = clock() + timeout_s
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} "
                  "regions resident"), TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task(f"{published.model_id} {published.version} on the model caches", total=len(regions))
        while True:
            for region in list(pending):
                why = resident_problem(s3_for_region, buckets[region], region, published)
                if why is None:
                    del pending[region]
                    progress.advance(task)
                    console.print(f"  [green]resident[/] {region} (s3://{buckets[region]})")
                else:
                    pending[region] = why
            if not pending or clock() >= deadline:
                return pending
            sleep(min(poll_s, max(0.0, deadline - clock())))


def check_regions(store: object, regions: list[str], home_region: str | None) -> S3Store:
    """The flags' preconditions: an S3 store (a local store has no regional caches) and the home region."""
    if not isinstance(store, S3Store):
        raise PublishError("--warm-region needs an s3:// store: a local store has no regional model caches")
    if not home_region:
        raise PublishError("--warm-region needs --home-region (the region of the store's bucket)")
    if home_region not in regions:
        raise PublishError(f"--warm-region: the home region {home_region} must be among them (its own cache "
                           f"serves it too): {', '.join(regions)}")
    return store
