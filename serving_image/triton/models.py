"""Which Triton models a package becomes (docs/kserve.md, "Embeddings and scoring through Triton").

vLLM runs one runner per engine (generation or pooling), and NVIDIA's vllm backend serves the tasks its engine
supports: it refuses an `embedding_request` on a generation model ("Model m does not support 'embed' request") and
a generation request on a pooling model. It returns no prompt log-probabilities at all. So a vllm-backend package
becomes one Triton model per engine:

- `generate`: `<id>`, the `vllm` backend (NVIDIA's; locally the stand-in), the §3.3 tensors, decoupled;
- `embed` beside `generate`: `<id>-embed`, the same backend with `runner: pooling` in its model.json:
  `embedding_request` in, the vector as JSON in `text_output` (NVIDIA's format);
- `embed` alone: that pooling model under the package's id;
- `score` (needs `generate`): `<id>-score`, Triton's `python` backend running the platform's scoring model
  (serving_image/triton_stub/scoring_model/model.py): `prompt` + `candidates` in, `logprob` + `num_tokens` per
  candidate out, unary.

Every one of them is generated into the repository and loaded with the package (explicit model control), so the
package is ready only when all are; each runs an engine of its own on the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_serving.manifest import Backend, Manifest
from llm_serving.tensor_contract import TensorSpec

EMBED_SUFFIX = "-embed"
SCORE_SUFFIX = "-score"

# The scoring model's I/O (its config.pbtxt, written by serving_image/triton/repository.py). Not decoupled: one
# response per request, so clients call it with unary ModelInfer like any non-LLM model.
SCORING_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("prompt", "BYTES", (1,)),  # UTF-8 text, tokenized with the model's special tokens (BOS)
    TensorSpec("candidates", "BYTES", (-1,)),  # continuations, each tokenized alone (no special tokens)
)
SCORING_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("logprob", "FP32", (-1,)),  # per candidate: sum of log P(token | prompt, earlier candidate tokens)
    TensorSpec("num_tokens", "UINT32", (-1,)),  # per candidate: its token count
    TensorSpec("num_input_tokens", "UINT32", (1,)),  # the prompt's token count
)


@dataclass(frozen=True)
class PackageModels:
    """The Triton models of one package, by task (None: the package does not serve that task through Triton)."""

    main: str  # what the package's id names on Triton (readiness, metrics, the KServe clients' model)
    generate: str | None
    embed: str | None
    score: str | None

    @property
    def names(self) -> tuple[str, ...]:
        """Every model to load, the main one first."""
        seen: list[str] = []
        for name in (self.main, self.generate, self.embed, self.score):
            if name is not None and name not in seen:
                seen.append(name)
        return tuple(seen)


def package_models(manifest: Manifest) -> PackageModels:
    model_id = manifest.model.id
    if manifest.model.backend is not Backend.VLLM:
        return PackageModels(main=model_id, generate=None, embed=None, score=None)
    assert manifest.engine is not None
    tasks = set(manifest.engine.tasks)
    generate = model_id if "generate" in tasks else None
    embed = None
    if "embed" in tasks:
        embed = model_id + EMBED_SUFFIX if generate else model_id
    score = model_id + SCORE_SUFFIX if "score" in tasks else None
    return PackageModels(main=model_id, generate=generate, embed=embed, score=score)
