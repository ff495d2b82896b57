"""The OpenAI front-end over Triton embedded in its process (issue 14, scope 7) against vLLM's own OpenAI server, same
model, same load, as bench.openai_frontend measures the front-end over vLLM in the process.

Ours is the real entrypoint with `LLM_SERVING_OPENAI_ENGINE=triton`: the OpenAI front-end, Triton (the local 2.51)
through the project's C API binding, the stand-in `vllm` backend in Triton's Python backend stub, and its engine
process (the stub needs numpy < 2, vLLM numpy >= 2: every request and every streamed delta crosses a Unix socket
between the two). Targets: throughput ratio >= 0.95, p99 TTFT ratio <= 1.1; the CPU rows say where the time goes
(front-end: this process, Triton's core included; engine: the stub, the engine host and vLLM's processes).
"""

from __future__ import annotations

import pathlib
import tempfile

from bench.openai_frontend import INPUT_LEN, NUM_PROMPTS, OUTPUT_LEN, ROUNDS, measure, summarise
from bench.report import demo_model, main, ratio_plot, ratio_table, result

EMBEDDED = {"LLM_SERVING_OPENAI_ENGINE": "triton"}


def run(out_dir: pathlib.Path, rounds: int = ROUNDS) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-openai-embedded-") as tmp:
        results = measure(demo_model(), pathlib.Path(tmp), extra_env=EMBEDDED, rounds=rounds)
    ours, base, ratio, verdict_tp, verdict_ttft = summarise(results)
    lines = [
        f"vLLM's serving benchmark, random dataset, {INPUT_LEN} in / {OUTPUT_LEN} out, {NUM_PROMPTS} prompts; the "
        f"OpenAI front-end over the embedded Triton and vLLM's own server alternate ({rounds} rounds each, medians "
        "shown) on the demo model.",
        "",
        *ratio_table(ours, base, ("llm-serving (embedded Triton)", "vLLM's server", "ratio (ours / vLLM)")),
        "",
        f"Target throughput ratio >= 0.95: **{verdict_tp}** ({ratio['request_throughput']:.3f}). "
        f"Target p99 TTFT ratio <= 1.1: **{verdict_ttft}** ({ratio['p99_ttft_ms']:.3f}). Where the embedded path "
        "spends more, the engine row holds the stand-in backend's hop (Python backend stub, a Unix socket, the "
        "engine host) that NVIDIA's backend does not have (its vLLM runs in the stub's process).",
    ]
    plot = ratio_plot(ratio, out_dir, "openai_embedded.png", height=3.5,
                      xlabel="llm-serving over embedded Triton / vLLM's own server (same run)",
                      title="OpenAI front-end over embedded Triton vs vLLM's server")
    return result("OpenAI front-end over embedded Triton vs vLLM's own server", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
