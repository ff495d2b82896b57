"""What the benchmarks share: the demo model they run on, headless matplotlib, saving a figure, the side-by-side
ratio table and plot, percentiles, the result each `run(out_dir)` hands to `bench.run`, and the command line that
runs one benchmark alone (`python -m bench.<name> [out_dir]`).

matplotlib and the serving image are imported only when called: `bench.rollout_cost` is imported by the infra tests,
whose environment has neither.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from llm_serving.repository import REPO_ROOT as REPO  # noqa: E402  the one definition; bench modules import it from here

RESULTS = REPO / "bench" / "results"


def demo_model() -> pathlib.Path:
    """The demo model's directory, made on first use (the model every engine benchmark runs)."""
    from serving_image.demo_model import ensure_demo_model

    return ensure_demo_model(REPO / ".cache" / "llm-serving" / "models" / "demo-tiny")


def pyplot():
    """matplotlib.pyplot on the Agg backend: the benchmarks only write files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_dir: pathlib.Path, name: str, dpi: int = 120) -> pathlib.Path:
    """Lay out, write `out_dir/name` and close the figure; returns the path."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank `q` quantile (0..1); NaN for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def ratios(ours: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """ours / base per metric (NaN where the baseline is 0), in the baseline's order."""
    return {m: ours[m] / base[m] if base[m] else math.nan for m in base}


def ratio_table(ours: dict[str, float], base: dict[str, float], columns: tuple[str, str, str]) -> list[str]:
    """A markdown table, one metric a row: ours, the baseline and their ratio; `columns` names those three."""
    ratio = ratios(ours, base)
    return [
        "| metric | " + " | ".join(columns) + " |",
        "| --- | ---: | ---: | ---: |",
        *(f"| {m} | {ours[m]:.2f} | {base[m]:.2f} | {ratio[m]:.3f} |" for m in base),
    ]


def ratio_plot(ratio: dict[str, float], out_dir: pathlib.Path, name: str, *, xlabel: str, title: str,
               color: str = "tab:blue", height: float = 3.0) -> pathlib.Path:
    """One horizontal bar a metric with a line at 1.0 (parity with the baseline), written to `out_dir/name`."""
    fig, ax = pyplot().subplots(figsize=(7, height))
    names = list(ratio)
    ax.barh(names, [ratio[m] for m in names], color=color)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return save_figure(fig, out_dir, name)


def result(title: str, lines: Sequence[str], plots: Sequence[pathlib.Path | str]) -> dict[str, Any]:
    """What `run(out_dir)` returns to `bench.run`: the section's title, its markdown and its plots."""
    return {"title": title, "markdown": "\n".join(lines), "plots": [str(p) for p in plots]}


def main(run: Callable[[pathlib.Path], dict], description: str | None = None) -> None:
    """Run one benchmark alone: `python -m bench.<name> [out_dir]` (default bench/results); prints its markdown."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out", nargs="?", type=pathlib.Path, help="where the plots go (default bench/results)")
    parser.add_argument("--out", dest="out_option", type=pathlib.Path, help="the same, as an option")
    args = parser.parse_args()
    print(run(args.out_option or args.out or RESULTS)["markdown"])
