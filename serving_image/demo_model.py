"""A deterministic tiny demo model: a byte-level BPE tokenizer and a randomly initialised Llama.

Nothing can be downloaded here, so `make up` and the tests build their model at setup. Same seed, same bytes:
the tokenizer is trained on a fixed corpus and the weights come from a seeded generator, so every machine serves
the identical model (a test checks the checksums of two builds).

Shape facts from docs/local-environment.md, "vLLM on CPU": 2 layers, hidden 128, 2 attention heads (head_dim 64; the CPU
attention kernels need at least 32) and 1 KV head load in vLLM in about 20 s. `vocab_size` may exceed the
tokenizer's size to give the sampler and logits processors a production-sized vocabulary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEMO_MODEL_ID = "demo-tiny"
BUILD_REVISION = 2  # bump when the builder changes, so cached builds are replaced
TOKENIZER_VOCAB = 1024
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A fixed corpus: the words the platform talks about plus JSON punctuation, so structured outputs have short tokens.
_CORPUS = [
    "The platform serves large language models next to the rest of the company's models.",
    "Client services call every model through the same KServe v2 gRPC call or an OpenAI-compatible API.",
    "Triton runs the vLLM backend on GPU nodes; FSx for Lustre caches the weights linked to S3.",
    "A red-black rollout moves traffic from the active version to the candidate in steps of 10, 25, 50 and 100.",
    '{"name": "demo", "value": 42, "ok": true, "items": [1, 2, 3], "nested": {"key": null}}',
    "The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:-_'\"()[]{}<>/\\|@#$%^&*+=~`",
    "user assistant system tool content role message response format json schema text choice",
    "Metrics, dashboards and alerts keep on-call informed: queue depth, KV-cache usage, preemptions.",
]


def _train_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=2048
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(out_dir))


def build_demo_model(out_dir: Path, *, vocab_size: int | None = None, seed: int = 0) -> Path:
    """Write the demo model (Hugging Face format) into `out_dir` and return it.

    `vocab_size` defaults to the tokenizer's size; a larger value pads the embedding and LM head.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    vocab = vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.do_sample = False
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # Record how it was made, so a reader of the directory knows it is a random model.
    (out_dir / "demo_model.json").write_text(
        json.dumps({"id": DEMO_MODEL_ID, "build": BUILD_REVISION, "seed": seed, "vocab_size": vocab,
                    "random_weights": True}, indent=2) + "\n"
    )
    return out_dir


def ensure_demo_model(out_dir: Path, *, vocab_size: int | None = None, seed: int = 0) -> Path:
    """Build the demo model unless `out_dir` already holds this exact build (same seed and vocabulary)."""
    marker = Path(out_dir) / "demo_model.json"
    if marker.exists():
        recorded = json.loads(marker.read_text())
        wanted_vocab = vocab_size or recorded.get("vocab_size")
        if (recorded.get("build"), recorded.get("seed"), recorded.get("vocab_size")) == \
                (BUILD_REVISION, seed, wanted_vocab):
            if (Path(out_dir) / "model.safetensors").exists():
                return Path(out_dir)
    return build_demo_model(out_dir, vocab_size=vocab_size, seed=seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the deterministic tiny demo model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(ensure_demo_model(args.out, vocab_size=args.vocab_size, seed=args.seed))


if __name__ == "__main__":
    main()
