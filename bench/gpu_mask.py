"""Benchmark: the GPU bitmask apply, the fused kernel against xgrammar's GPU kernel, the torch path and the floor.

Self-contained: nothing is downloaded. It needs a CUDA device, a CUDA build of torch and the kernel library
(`_mask_cuda.so`: the installed one, `--library PATH`, or, where neither exists, built here from native/src with
nvcc). xgrammar is measured when it is installed (vLLM depends on it). Without a CUDA device it says so and exits 0.

For each batch and vocabulary, float32 logits on the device, a bitmask on the host (what the processor has: the
native core fills it on the CPU), rows in sparse states (a few allowed tokens, one row in 8 dense):
  - kernel: this project's path per step: pack the rows' words into pinned memory, one asynchronous copy, one
    kernel (mask + rescue), queued on the current stream (`GpuMaskApplier.apply`);
  - xgrammar: `xgrammar.apply_token_bitmask_inplace` on the device, the bitmask already there (its kernel alone),
    and "+ copy": the same after copying the bitmask from pinned host memory (what a step costs it);
  - torch: `engine.apply_bitmask_torch`, the path the kernel replaces;
  - floor: `logits.fill_(-inf)`, writing every logit once (the apply writes nearly all of them: masks are sparse).
Device times come from CUDA events (median of the repeats); the host time of the kernel's call (packing and
launching, what stays on the CPU) is reported too.

`python -m bench.gpu_mask [--quick] [--library PATH] [--out DIR]`; `make bench` calls `run(out_dir)`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.report import REPO, RESULTS, result

BATCHES = (1, 8, 32, 128, 256)
VOCABS = (32_000, 128_000, 256_000)
QUICK_BATCHES = (1, 32, 256)
QUICK_VOCABS = (128_000,)
REPEATS = 30


def gpu_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is always there in .venv-serving
        return False, f"torch is not installed ({exc})"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no device/driver"
        return False, f"no CUDA device: torch {torch.__version__} is {build}"
    return True, torch.cuda.get_device_name()


def kernel_library(path: str | None) -> pathlib.Path:
    from serving_image.constraints import gpu

    if path:
        return pathlib.Path(path)
    try:
        return gpu.library_path()
    except gpu.KernelUnavailable:
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        out = pathlib.Path(tempfile.mkdtemp(prefix="mask-kernel-")) / gpu.LIBRARY_NAME
        src = REPO / "native"
        subprocess.run([nvcc, "-std=c++17", "-O3", "-shared", "-cudart=static", "-Xcompiler=-fPIC",
                        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                        "-gencode=arch=compute_90,code=compute_90", f"-I{src / 'include'}",
                        str(src / "src" / "mask_kernel.cu"), str(src / "src" / "mask_launch.cpp"), "-o", str(out)],
                       check=True)
        return out


def _bitmask(batch: int, vocab: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    mask = np.zeros((batch, words), dtype=np.uint32)
    for r in range(batch):
        if r % 8 == 7:  # dense
            mask[r] = rng.integers(0, 2**32, size=words, dtype=np.uint32)
        else:
            for t in rng.choice(vocab, size=8, replace=False):
                mask[r, t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)


def _device_ms(fn, repeats: int) -> tuple[float, float]:
    """Median device ms (CUDA events) and median host ms of one call of fn."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    device, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    return statistics.median(device), statistics.median(host)


def _measure_one(applier, xgr, apply_bitmask_torch, batch: int, vocab: int) -> dict:
    import torch

    mask = _bitmask(batch, vocab, seed=batch * 7 + vocab)
    mask_t = torch.from_numpy(mask)
    pinned = mask_t.pin_memory()
    on_device = mask_t.cuda()
    logits = torch.randn(batch, vocab, device="cuda")
    rows = list(range(batch))
    r: dict = {"batch": batch, "vocab": vocab}
    # First the kernel's result against the torch path's, on the same logits (timings of a wrong kernel are moot).
    ours, theirs = logits.clone(), logits.clone()
    applier.apply(ours, mask, rows, rows)
    apply_bitmask_torch(theirs, mask_t, rows, rows)
    r["equal_to_torch"] = bool(torch.equal(ours, theirs))
    r["kernel"], r["kernel_host"] = _device_ms(lambda: applier.apply(logits, mask, rows, rows), REPEATS)
    r["torch"], _ = _device_ms(lambda: apply_bitmask_torch(logits, mask_t, rows, rows), REPEATS)
    r["floor"], _ = _device_ms(lambda: logits.fill_(float("-inf")), REPEATS)
    if xgr is not None:
        r["xgrammar"], _ = _device_ms(lambda: xgr.apply_token_bitmask_inplace(logits, on_device), REPEATS)
        r["xgrammar_copy"], _ = _device_ms(
            lambda: xgr.apply_token_bitmask_inplace(logits, pinned.to("cuda", non_blocking=True)), REPEATS)
    return r


def measure(quick: bool, library: str | None) -> dict:
    import torch

    from serving_image.constraints import gpu
    from serving_image.constraints.machines import apply_bitmask_torch

    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    lib = gpu.load_library(kernel_library(library))
    applier = gpu.GpuMaskApplier(torch.cuda.current_device(), lib)
    rows_out = [_measure_one(applier, xgr, apply_bitmask_torch, batch, vocab)
                for vocab in (QUICK_VOCABS if quick else VOCABS) for batch in (QUICK_BATCHES if quick else BATCHES)]
    applier.close()
    return {"device": torch.cuda.get_device_name(), "sm_count": applier.sm_count, "rows": rows_out,
            "xgrammar": None if xgr is None else importlib.metadata.version("xgrammar")}


def markdown(data: dict) -> list[str]:
    has_xgr = data["xgrammar"] is not None
    lines = [
        f"Device: {data['device']} ({data['sm_count']} SMs); xgrammar {data['xgrammar'] or 'not installed'}. "
        f"Median device time per apply over {REPEATS} runs (CUDA events), float32 logits, sparse rows (one in 8 "
        "dense). kernel = pack into pinned memory + one async copy + one fused kernel; xgrammar + copy = its kernel "
        "after copying the bitmask from pinned memory; floor = writing every logit once.",
        "",
        "| batch | vocab | kernel (ms) | host part of kernel call (ms) | torch (ms) | xgrammar (ms) | xgrammar + copy "
        "(ms) | floor (ms) | kernel / floor | torch / kernel | (xgrammar + copy) / kernel |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        xg = f"{r['xgrammar']:.4f}" if has_xgr else "-"
        xgc = f"{r['xgrammar_copy']:.4f}" if has_xgr else "-"
        xratio = f"{r['xgrammar_copy'] / r['kernel']:.2f}x" if has_xgr else "-"
        lines.append(
            f"| {r['batch']} | {r['vocab'] // 1000}k{'' if r['equal_to_torch'] else ' (KERNEL != TORCH)'} "
            f"| {r['kernel']:.4f} | {r['kernel_host']:.4f} | {r['torch']:.4f} "
            f"| {xg} | {xgc} | {r['floor']:.4f} | {r['kernel'] / r['floor']:.2f}x | {r['torch'] / r['kernel']:.1f}x "
            f"| {xratio} |")
    return lines


def run(out_dir: pathlib.Path, quick: bool = False, library: str | None = None) -> dict:
    title = "GPU bitmask apply (fused CUDA kernel vs xgrammar's GPU kernel, the torch path and the write floor)"
    ok, what = gpu_available()
    if not ok:
        return result(title, [f"Not measured: {what}. Run `python -m bench.gpu_mask` on a machine with a CUDA "
                              "device (the kernel is built by the package build, or here with nvcc)."], [])
    data = measure(quick, library)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_mask.json").write_text(json.dumps(data, indent=1))
    return result(title, markdown(data), [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batches 1, 32, 256 at vocabulary 128k only")
    parser.add_argument("--library", help="the kernel library to measure (default: the installed one)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    ok, what = gpu_available()
    if not ok:
        print(f"bench.gpu_mask: {what}; nothing to measure here (run it where a GPU is).")
        return 0
    print("\n".join(run(args.out, args.quick, args.library)["markdown"].splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
