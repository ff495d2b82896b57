"""Benchmark: the constraint processor's cost per engine step, native core against its baselines, in one run.

One step of the processor = advance every constrained row by the token it just generated, build each row's mask
and apply it to the logits [batch, vocab] (float32, in place). Side by side, on the same rows, token streams and
logits shapes:

  - python: the pure-Python per-request path (`reference.ReferenceState`, one torch mask per request), the way
    the first version worked;
  - torch: the same Python states, the masks built and applied in one vectorised scatter + masked_fill;
  - native-1 / native-N: the constraint engine (`ConstraintRows`: sync from the output lists, fill, apply) with 1
    thread and with every hardware thread;
  - for the apply half alone: xgrammar's CPU bitmask kernel on the very same bitmask, and the physical floor:
    the time to write the bytes the apply must write (every logit of a masked row: batch x vocab x 4 bytes) and
    nothing else, measured on the same buffer in turn with the two kernels: the fastest of plain stores,
    streaming (non-temporal) stores and `torch.Tensor.fill_`. For shapes that fit in the caches that is the
    cache's bandwidth, for large ones DRAM's. The header also gives the bandwidth on a 512 MiB buffer.

Rows are in sparse states (a few allowed tokens: DFAs, choice sequences, small allowed sets), so the fill cost
per row should not depend on the vocabulary; that is measured too. Times are medians over a few steps.

The targets are stated for what each half is bound by:
  - the host-side step, advance + bitmask fill and no logits write (what stays on the CPU when a GPU applies the
    mask, `_host_step`): in µs per step at batch 1..256, independent of the vocabulary, and at least 100x below the
    Python per-request path's host work (advance, allowed set, one mask tensor per request);
  - the apply, which writes batch x vocab logits: against the write floor (bandwidth), not against Python.
The whole-step ratio against Python is reported but is not a target: both sides are bound by writing the logits
at large shapes (2-3x at batch 256 / 128k), which says nothing about the constraint logic.

`run(out_dir)` is what `make bench` calls; `python -m bench.constraints [out_dir]` runs it alone.
"""

from __future__ import annotations

import pathlib
import random
import statistics
import time

from bench.report import main, pyplot, result, save_figure

BATCHES = (1, 8, 32, 128, 256)
VOCABS = (32_000, 128_000, 256_000)
STEPS = 7  # timed steps per configuration (after one warm-up step)
HOST_STEPS = 25  # timed steps of the host-side step alone (µs each: more samples against a shared machine's noise)
EOS = 2
TARGET = (256, 128_000)  # where the targets are read


def _specs(rng: random.Random, n: int, vocab: int):
    from serving_image.constraints.spec import validate_constraint

    def tok() -> int:
        while True:
            t = rng.randrange(3, vocab)
            if t != EOS:
                return t

    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:  # 16 states, 6 edges out of each: never only eos
            edges, seen = [], set()
            for s in range(16):
                while len([e for e in edges if e[0] == s]) < 6:
                    t = tok()
                    if (s, t) not in seen:
                        seen.add((s, t))
                        edges.append([s, t, rng.randrange(16)])
            raw = {"kind": "token_dfa", "start": 0, "accept": [3, 7], "edges": edges}
        elif kind == 1:
            body = [tok() for _ in range(20)]
            sep = tok()
            while sep in body:
                sep = tok()
            choices, at = [], 0
            for length in (1, 2, 3, 4, 2, 3, 1, 4):
                c = body[at : at + length] if at + length <= len(body) else body[:length]
                at += length
                if c not in choices:
                    choices.append(c)
            raw = {"kind": "choice_sequence", "choices": choices, "separator": [sep]}
        else:
            raw = {"kind": "allowed_tokens", "tokens": sorted({tok() for _ in range(8)})}
        out.append(validate_constraint(raw, vocab, EOS))
    return out


def _streams(rng: random.Random, specs, steps: int) -> list[list[int]]:
    """For each row, `steps` tokens its constraint allows (never eos): what the sampler would pick."""
    from serving_image.constraints.reference import ReferenceState

    streams = []
    for spec in specs:
        state, toks = ReferenceState(spec, EOS), []
        for _ in range(steps):
            t = rng.choice(sorted(state.allowed() - {EOS}))
            state.advance(t)
            toks.append(t)
        streams.append(toks)
    return streams


def _stat_ms(samples: list[float], how: str) -> float:
    return (min(samples) if how == "best" else statistics.median(samples)) * 1e3


class _Python:
    """Per-request reference: Python state, one mask tensor per request."""

    name = "python"

    def __init__(self, specs, vocab):
        from serving_image.constraints.reference import ReferenceState

        self.states = [ReferenceState(s, EOS) for s in specs]
        self.vocab = vocab

    def step(self, logits, tokens):
        import torch

        for i, st in enumerate(self.states):
            if tokens is not None:
                st.advance(tokens[i])
            mask = torch.full((self.vocab,), float("-inf"))
            mask[list(st.allowed())] = 0
            logits[i] += mask


class _Torch:
    """Python states, masks built and applied for the whole batch with vectorised torch operations."""

    name = "torch"

    def __init__(self, specs, vocab):
        import torch

        from serving_image.constraints.reference import ReferenceState

        self.states = [ReferenceState(s, EOS) for s in specs]
        self.keep = torch.zeros(len(specs), vocab, dtype=torch.bool)

    def step(self, logits, tokens):
        import torch

        rows, cols = [], []
        for i, st in enumerate(self.states):
            if tokens is not None:
                st.advance(tokens[i])
            allowed = st.allowed()
            rows.extend([i] * len(allowed))
            cols.extend(allowed)
        self.keep.zero_()
        self.keep[torch.tensor(rows), torch.tensor(cols)] = True
        logits.masked_fill_(~self.keep, float("-inf"))


class _Native:
    def __init__(self, specs, vocab, threads):
        from serving_image.constraints.machines import ConstraintRows, compile_spec

        self.name = f"native-{threads}t"
        self.threads = threads
        self.constraint_rows = ConstraintRows(vocab, len(specs), threads=threads)
        self.lists: list[list[int]] = [[] for _ in specs]
        for i, s in enumerate(specs):
            self.constraint_rows.set_row(i, compile_spec(s, vocab, EOS), self.lists[i])

    def step(self, logits, tokens):
        if tokens is not None:  # the engine appends to its own lists; the processor's work starts at sync
            for lst, t in zip(self.lists, tokens, strict=True):
                lst.append(t)
        self._timed(logits)

    def _timed(self, logits):
        self.constraint_rows.sync()
        self.constraint_rows.fill_apply(logits, threads=self.threads)


def _time_steps(impls, logits, streams) -> dict[str, float]:
    """Median ms per step of each implementation. The implementations take turns within every step, so that a busy
    moment of a shared machine hits them all alike. Appending the sampled tokens to the engine's output lists is
    the engine's work, not the processor's: it is outside the native timing (the Python states advance inside)."""
    for impl in impls:
        impl.step(logits, None)  # warm-up
    samples: dict[str, list[float]] = {impl.name: [] for impl in impls}
    for k in range(STEPS):
        tokens = [s[k] for s in streams]
        for impl in impls:
            if isinstance(impl, _Native):
                for lst, t in zip(impl.lists, tokens, strict=True):
                    lst.append(t)
                t0 = time.perf_counter()
                impl._timed(logits)
            else:
                t0 = time.perf_counter()
                impl.step(logits, tokens)
            samples[impl.name].append(time.perf_counter() - t0)
    return {f"{name}:{how}": _stat_ms(v, how) for name, v in samples.items() for how in ("best", "median")}


def _host_step(vocab: int, specs, rng: random.Random) -> dict[str, float]:
    """The host-side step alone, µs (best of the steps): the constraint engine's sync + fill of the constrained rows
    as the GPU path runs them (`ConstraintRows.fill_apply` on CUDA logits; 1 thread: the per-row cost, no hand-off)
    against the Python per-request path's host work, with its mask tensors (`python`) and without
    them (`python_state`: advance and allowed set only, the least any Python per-request path does)."""
    import torch

    from serving_image.constraints.reference import ReferenceState

    streams = _streams(rng, specs, HOST_STEPS)
    nat = _Native(specs, vocab, 1)
    states = [ReferenceState(s, EOS) for s in specs]
    states_only = [ReferenceState(s, EOS) for s in specs]
    samples: dict[str, list[float]] = {"native": [], "python": [], "python_state": []}
    nat.constraint_rows.sync()
    nat.constraint_rows.core.fill_constrained(-1, 1)  # warm-up
    for k in range(HOST_STEPS):
        tokens = [s[k] for s in streams]
        for lst, t in zip(nat.lists, tokens, strict=True):
            lst.append(t)
        t0 = time.perf_counter()
        nat.constraint_rows.sync()
        nat.constraint_rows.core.fill_constrained(-1, 1)  # what the GPU path runs on the host before its kernel
        samples["native"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for st, t in zip(states, tokens, strict=True):
            st.advance(t)
            mask = torch.full((vocab,), float("-inf"))
            mask[list(st.allowed())] = 0
        samples["python"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for st, t in zip(states_only, tokens, strict=True):
            st.advance(t)
            st.allowed()
        samples["python_state"].append(time.perf_counter() - t0)
    return {name: min(v) * 1e6 for name, v in samples.items()}


def measure_write_bandwidth() -> dict[str, float]:
    """Bytes/s written into a 512 MiB float32 buffer (every thread, best of 5): torch's fill_, and -inf written
    with streaming stores by the core's store loop without a mask (`Engine.write_bandwidth`)."""
    import torch

    from serving_image.constraints import _native

    buf = torch.empty(128 * 1024 * 1024, dtype=torch.float32)
    buf.fill_(1.0)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.fill_(float("-inf"))
        best = min(best, time.perf_counter() - t0)
    probe = _native.Engine(32, 1, 0)
    return {"torch_fill": buf.numel() * 4 / best, "streaming": probe.write_bandwidth(buf.numpy(), True)}


def _apply_only(vocab: int, batch: int, threads: int, streams, specs) -> dict[str, float]:
    """The apply half alone on one filled bitmask: native (threads) and xgrammar's CPU kernel."""
    import torch
    import xgrammar as xgr

    nat = _Native(specs, vocab, threads)
    logits = torch.randn(batch, vocab)
    nat.step(logits, [s[0] for s in streams])
    rows = list(range(batch))
    nat.constraint_rows.core.fill(rows, threads)
    bitmask = nat.constraint_rows.bitmask()[:batch].clone()
    # The floor of this very shape: writing batch x vocab floats of -inf, nothing else (no mask to read), with
    # the fastest of plain stores, streaming stores and torch's fill_; measured in turn with the two kernels so
    # that all three see the same machine (caches for small shapes, DRAM for large ones).
    flat = logits.view(-1).numpy()
    probe = nat.constraint_rows.core
    native, xgrammar = [], []
    floors: dict[str, list[float]] = {"plain": [], "streaming": [], "torch": []}
    for _ in range(STEPS):
        t0 = time.perf_counter()
        probe.apply(logits.data_ptr(), batch, vocab, logits.stride(0), "float32", rows, rows, threads)
        native.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        xgrammar.append(time.perf_counter() - t0)
        for key, stream in (("plain", False), ("streaming", True)):
            floors[key].append(flat.nbytes / probe.write_bandwidth(flat, stream, threads, 1))
        t0 = time.perf_counter()
        logits.fill_(float("-inf"))
        floors["torch"].append(time.perf_counter() - t0)
    # The fastest way of writing sets the floor: chosen on medians, then reported like the kernels (as many
    # samples as they had, so that the floor is not the luckiest of three times as many tries).
    fastest = min(floors, key=lambda k: statistics.median(floors[k]))
    out = {f"{key}:{how}": _stat_ms(v, how) for key, v in (("native", native), ("xgrammar", xgrammar),
                                                            ("floor", floors[fastest])) for how in ("best", "median")}
    # fill alone, per row (sparse states): the cost that must not grow with the vocabulary
    samples = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        nat.constraint_rows.core.fill(rows, 1)
        samples.append(time.perf_counter() - t0)
    out["fill_us_per_row"] = min(samples) * 1e6 / batch
    return out


def run(out_dir: pathlib.Path) -> dict:
    import torch

    from serving_image.constraints import _native

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_threads = _native.hardware_threads()
    torch.set_num_threads(all_threads)
    bandwidths = measure_write_bandwidth()

    step: dict[tuple[int, int], dict[str, float]] = {}
    apply: dict[tuple[int, int], dict[str, float]] = {}
    host: dict[tuple[int, int], dict[str, float]] = {}
    for vocab in VOCABS:
        rng = random.Random(vocab)
        specs_all = _specs(rng, max(BATCHES), vocab)
        streams_all = _streams(rng, specs_all, STEPS)
        for batch in BATCHES:
            specs, streams = specs_all[:batch], streams_all[:batch]
            logits = torch.randn(batch, vocab)
            impls = (_Python(specs, vocab), _Torch(specs, vocab), _Native(specs, vocab, 1),
                     _Native(specs, vocab, all_threads))
            step[(batch, vocab)] = _time_steps(impls, logits, streams)
            apply[(batch, vocab)] = _apply_only(vocab, batch, all_threads, streams, specs)
            host[(batch, vocab)] = _host_step(vocab, specs, random.Random(batch + vocab))
            del logits

    native_all = f"native-{all_threads}t"
    names = ["python", "torch", "native-1t", native_all]
    B = "best"  # tables and plots: best of the steps (the machine may be shared); medians at the targets too
    lines = [
        f"Hardware threads: {all_threads}. Write bandwidth measured in this run (512 MiB, every thread, best of 5): "
        f"torch fill_ {bandwidths['torch_fill'] / 1e9:.1f} GB/s, streaming stores {bandwidths['streaming'] / 1e9:.1f} "
        f"GB/s. Rows in sparse states (DFA / choice sequence / 8-token sets); float32 logits on the CPU. Each time is "
        f"the best of {STEPS} steps, the implementations taking turns within each step so that a busy moment of a "
        "shared machine hits them alike; the targets below give the ratios of medians as well. The floor of each "
        "shape is measured on that shape, in turn with the kernels (see the module docstring).",
        "",
        "### Time per engine step (ms): advance + mask + apply, whole batch",
        "",
        "| batch | vocab | python | torch | native 1 thread | native all threads | python / native | torch / native |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (batch, vocab), r in step.items():
        nat = r[f"{native_all}:{B}"]
        lines.append(
            f"| {batch} | {vocab // 1000}k | {r[f'python:{B}']:.3f} | {r[f'torch:{B}']:.3f} | "
            f"{r[f'native-1t:{B}']:.3f} | {nat:.3f} | {r[f'python:{B}'] / nat:.1f}x | {r[f'torch:{B}'] / nat:.1f}x |"
        )
    lines += [
        "",
        "### Apply half alone (ms), against xgrammar's CPU kernel and the write floor",
        "",
        "| batch | vocab | native (all threads) | xgrammar | write floor | native / floor | xgrammar / native | "
        "fill µs per row (1 thread) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (batch, vocab), a in apply.items():
        nat, xg, fl = a[f"native:{B}"], a[f"xgrammar:{B}"], a[f"floor:{B}"]
        lines.append(
            f"| {batch} | {vocab // 1000}k | {nat:.3f} | {xg:.3f} | {fl:.3f} | {nat / fl:.2f}x | {xg / nat:.2f}x | "
            f"{a['fill_us_per_row']:.2f} |"
        )

    lines += [
        "",
        "### Host-side step alone (µs): advance + bitmask fill, no logits write (what stays on the CPU with a GPU)",
        "",
        "| batch | " + " | ".join(f"native {v // 1000}k" for v in VOCABS) + " | python (state + mask) 128k | "
        "python (state only) 128k | python / native 128k | python state-only / native 128k |",
        "| ---: |" + " ---: |" * (len(VOCABS) + 4),
    ]
    for batch in BATCHES:
        h = host[(batch, 128_000)]
        lines.append(
            f"| {batch} | " + " | ".join(f"{host[(batch, v)]['native']:.1f}" for v in VOCABS)
            + f" | {h['python']:.0f} | {h['python_state']:.0f} | {h['python'] / h['native']:.0f}x | "
            f"{h['python_state'] / h['native']:.0f}x |"
        )

    # Targets, stated as met or missed, on best-of and on medians.
    def ratios(how: str) -> tuple[float, float]:
        t, a = step[TARGET], apply[TARGET]
        return t[f"python:{how}"] / t[f"{native_all}:{how}"], a[f"native:{how}"] / a[f"floor:{how}"]

    (speedup, floor_ratio), (speedup_med, floor_med) = ratios("best"), ratios("median")
    big = [a for (b, _), a in apply.items() if b >= 32]
    worst_floor = max(a[f"native:{B}"] / a[f"floor:{B}"] for a in big)
    fills = {v: apply[(256, v)]["fill_us_per_row"] for v in VOCABS}
    fill_spread = max(fills.values()) / min(fills.values())
    xgr_ratio = apply[TARGET][f"xgrammar:{B}"] / apply[TARGET][f"native:{B}"]
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    host_ratio = {b: host[(b, 128_000)]["python"] / host[(b, 128_000)]["native"] for b in BATCHES}
    state_ratio = {b: host[(b, 128_000)]["python_state"] / host[(b, 128_000)]["native"] for b in BATCHES}
    host_spread = {b: max(host[(b, v)]["native"] for v in VOCABS) / min(host[(b, v)]["native"] for v in VOCABS)
                   for b in BATCHES}
    judged = [b for b in BATCHES if b >= 32] or list(BATCHES)  # a few µs of call overhead below that: noise
    worst_spread = max(host_spread[b] for b in judged)
    lines += [
        "",
        "### Targets",
        "",
        "- host-side step (advance + bitmask fill, no logits write), µs per step at vocabulary 128k: "
        + ", ".join(f"batch {b}: {host[(b, 128_000)]['native']:.1f}" for b in BATCHES),
        f"- ... independent of the vocabulary ({VOCABS[0] // 1000}k to {VOCABS[-1] // 1000}k): worst spread over "
        f"batches >= {judged[0]}: {worst_spread:.2f}x ({verdict(worst_spread <= 1.5)}); per batch: "
        + ", ".join(f"{b}: {host_spread[b]:.2f}x" for b in BATCHES),
        f"- ... at least 100x below the Python per-request path (state + mask per request) at batch 256, 128k: "
        f"**{host_ratio[256]:.0f}x** ({verdict(host_ratio[256] >= 100)}). Per batch: "
        + ", ".join(f"{b}: {host_ratio[b]:.0f}x" for b in BATCHES)
        + " (at batch 1 the native step is a microsecond of call overhead). Against the Python state alone (no mask "
        f"tensors, the least a Python per-request path does): {state_ratio[256]:.0f}x at batch 256",
        f"- apply within 1.5x of the write floor at batch 256, vocabulary 128k: **{floor_ratio:.2f}x** "
        f"({verdict(floor_ratio <= 1.5)}); medians: {floor_med:.2f}x ({verdict(floor_med <= 1.5)}); worst over "
        f"batches >= 32: {worst_floor:.2f}x ({verdict(worst_floor <= 1.5)})",
        "- fill cost per row independent of the vocabulary (sparse states, batch 256): "
        + ", ".join(f"{v // 1000}k: {us:.2f} µs" for v, us in fills.items())
        + f", spread {fill_spread:.2f}x ({verdict(fill_spread <= 1.5)})",
        f"- peer: xgrammar's CPU bitmask apply takes {xgr_ratio:.1f}x this engine's apply at batch 256, "
        "vocabulary 128k (same bitmask, same logits)",
        f"- not a target: the whole CPU step (advance + fill + apply) against the Python path at batch 256, 128k: "
        f"{speedup:.1f}x (medians {speedup_med:.1f}x). Both sides are bound by writing 128 MB of logits there, "
        "so this ratio measures memory bandwidth, not the constraint logic",
    ]

    plots = []
    plt = pyplot()
    fig, axes = plt.subplots(1, len(VOCABS), figsize=(15, 4.2), sharey=True)
    for ax, vocab in zip(axes, VOCABS, strict=True):
        for name in names:
            ax.plot(BATCHES, [step[(b, vocab)][f"{name}:{B}"] for b in BATCHES], marker="o", label=name)
        ax.plot(BATCHES, [apply[(b, vocab)][f"floor:{B}"] for b in BATCHES], "k--", label="write floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"vocab {vocab // 1000}k")
        ax.set_xlabel("batch size")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms per engine step")
    axes[0].legend()
    fig.suptitle(f"Constraint processor: time per engine step (best of {STEPS})")
    plots.append(save_figure(fig, out_dir, "constraints_step.png", dpi=110))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    vocab = 128_000
    for key, label in (("native", "native (all threads)"), ("xgrammar", "xgrammar CPU"), ("floor", "write floor")):
        ax1.plot(BATCHES, [apply[(b, vocab)][f"{key}:{B}"] for b in BATCHES], marker="o", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("ms")
    ax1.set_title("apply half, vocab 128k")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    for b in [b for b in BATCHES if b >= 32]:
        ax2.plot([v // 1000 for v in VOCABS], [apply[(b, v)]["fill_us_per_row"] for v in VOCABS], marker="o",
                 label=f"batch {b}")
    ax2.set_xlabel("vocabulary (k tokens)")
    ax2.set_ylabel("µs per row")
    ax2.set_ylim(bottom=0)
    ax2.set_title("fill per row, sparse states (1 thread)")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    plots.append(save_figure(fig, out_dir, "constraints_apply_fill.png", dpi=110))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for v in VOCABS:
        ax.plot(BATCHES, [host[(b, v)]["native"] for b in BATCHES], marker="o", label=f"native, vocab {v // 1000}k")
    ax.plot(BATCHES, [host[(b, 128_000)]["python"] for b in BATCHES], "k--", marker="x",
            label="python per request (state + mask), 128k")
    ax.plot(BATCHES, [host[(b, 128_000)]["python_state"] for b in BATCHES], "k:", marker="x",
            label="python per request (state only), 128k")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("µs per step")
    ax.set_title("host-side step: advance + bitmask fill (no logits write)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(save_figure(fig, out_dir, "constraints_host_step.png", dpi=110))

    return result("Constraint engine (native core vs Python, torch, xgrammar, bandwidth floor)", lines, plots)


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
