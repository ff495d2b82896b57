"""Startup time: the serving entrypoint (verify package, plugins, metrics dir, engine, ports) against vLLM's own
OpenAI server starting on the same weights with the same engine settings, in alternating rounds.

Two packages: the demo model, and a float32 model of more than 2 GiB of weights made here (a randomly initialised
Llama, seeded, the demo model's tokenizer; nothing can be downloaded). Each on a cold page cache (every file of the
package dropped with posix_fadvise(DONTNEED) before the start: the weights are read from the disk) and a warm one
(every file read just before). vLLM's server reads the package's own `weights/` directory: the same files.

The figure: the platform's *extra* time to ready over vLLM's server (ours minus vLLM's, paired within
a round), per model and cache state, as the median over the rounds with its spread. The sides alternate which
goes first each round; on a shared 2-core machine the medians are the figures to read, not single runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time

from bench.local_server import ENGINE_ARGS, start_server
from bench.report import REPO, demo_model, main, pyplot, result, save_figure
from bench.vllm_server import start_vllm_server, stop_vllm_server
from llm_serving.package import PackageSpec, build_package

QUICK = os.environ.get("LLM_SERVING_BENCH_QUICK") == "1"
ROUNDS = int(os.environ.get("LLM_SERVING_BENCH_STARTUP_ROUNDS", "1" if QUICK else "3"))
# Rounds spread over several runs (one round each): which side goes first alternates with the round's number.
FIRST_ROUND = int(os.environ.get("LLM_SERVING_BENCH_STARTUP_FIRST_ROUND", "0"))
BIG_ROOT = REPO / ".cache" / "llm-serving" / "bench-startup"
BIG_REVISION = 2  # bump when the builder below changes
# Eager on both sides: graph compilation is the same work for both (55-75 s of a demo start on 2 cores, and a
# compile cache makes it vary from run to run), and would bury the seconds this benchmark is about.
BENCH_ENGINE_ARGS = {**ENGINE_ARGS, "enforce_eager": True}
# Llama shape of the big model: most bytes in the embedding and the LM head (vocabulary 262144 x hidden 1024,
# float32, 1 GiB each, one safetensors shard each), so the engine's warm-up compute stays small and the time to
# ready is dominated by what grows with the bytes: reading (and hashing) them.
BIG_CONFIG = {"vocab_size": 262144, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2}
MIN_BIG_BYTES = 2 << 30
STEP = re.compile(r"startup step \d/5 ([a-z-]+): done in (\d+\.\d+)s")
WEIGHTS_CHECKED = re.compile(r"checksums verified .* in (\d+\.\d+)s beside the engine.s start; waited (\d+\.\d+)s")


def _build_big_model(out: pathlib.Path, tokenizer_from: pathlib.Path) -> None:
    """A seeded random Llama of more than 2 GiB float32 weights in two safetensors shards, with the demo model's
    tokenizer (its vocabulary is smaller than the model's: the extra rows are never produced by the tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from serving_image.demo_model import TOKENIZER_VOCAB

    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copyfile(tokenizer_from / name, out / name)
    special = json.loads((tokenizer_from / "config.json").read_text())
    config = LlamaConfig(**BIG_CONFIG, max_position_embeddings=2048, tie_word_embeddings=False,
                         torch_dtype="float32", bos_token_id=special.get("bos_token_id"),
                         eos_token_id=special.get("eos_token_id"), pad_token_id=special.get("pad_token_id"))
    config.save_pretrained(out)
    gen = torch.Generator().manual_seed(0)
    h, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    layers: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.update({p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                       p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                       p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                       p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": torch.ones(h),
                       p + "post_attention_layernorm.weight": torch.ones(h)})
    shards = {"model-00001-of-00002.safetensors": {"model.embed_tokens.weight": rand(config.vocab_size, h), **layers},
              "model-00002-of-00002.safetensors": {"lm_head.weight": rand(config.vocab_size, h)}}
    weight_map, total = {}, 0
    for shard, tensors in shards.items():
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    assert total >= MIN_BIG_BYTES and TOKENIZER_VOCAB <= config.vocab_size


def big_package() -> pathlib.Path:
    """The big model's package directory, as a published package lies on the model cache (built once, kept under
    .cache/, which git ignores)."""
    package = BIG_ROOT / f"package-{BIG_REVISION}"
    if (package / "package.toml").is_file():
        return package
    shutil.rmtree(BIG_ROOT, ignore_errors=True)
    model = BIG_ROOT / "model"
    _build_big_model(model, demo_model())
    build_package(PackageSpec(model, "demo-tiny", "big-2g", engine_args=BENCH_ENGINE_ARGS), package)
    shutil.rmtree(model)
    return package


def _files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def drop_from_page_cache(root: pathlib.Path) -> None:
    """Cold: every file of the package out of the page cache (clean pages of files no process maps)."""
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into_page_cache(root: pathlib.Path) -> None:
    """Warm: every file of the package read once."""
    for path in _files(root):
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass


def _ours(package: pathlib.Path, workdir: pathlib.Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    # each server in a session of its own, as `make up` and `vllm serve` in a terminal start them
    server = start_server(package, workdir, own_session=True)
    seconds = time.perf_counter() - t0
    log = server.log()
    server.stop()
    steps = {m.group(1): float(m.group(2)) for m in STEP.finditer(log)}
    checked = WEIGHTS_CHECKED.search(log)
    if checked:
        steps["checksums (beside the engine)"] = float(checked.group(1))
        steps["ready waited on checksums"] = float(checked.group(2))
    return seconds, steps


def _theirs(package: pathlib.Path, workdir: pathlib.Path) -> float:
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc, _url = start_vllm_server(package / "weights", workdir, enforce_eager=True, timeout_s=900,
                                     own_session=True)
    seconds = time.perf_counter() - t0
    stop_vllm_server(proc)
    return seconds


def measure(packages: dict[str, pathlib.Path], workdir: pathlib.Path) -> dict:
    runs: dict[str, dict] = {f"{m} {c}": {"ours": [], "vllm": [], "steps": []}
                             for m in packages for c in ("cold", "warm")}
    for model, package in packages.items():  # untimed: first starts fill the file system's and Python's caches
        if not QUICK:
            _theirs(package, workdir / f"warm-up-{model}")
    n = 0
    for r in range(ROUNDS):
        for model, package in packages.items():
            for cache in ("cold", "warm"):
                key, n = f"{model} {cache}", n + 1
                prepare = drop_from_page_cache if cache == "cold" else read_into_page_cache
                order = ("ours", "vllm") if (FIRST_ROUND + r + n) % 2 == 0 else ("vllm", "ours")
                for side in order:
                    prepare(package)
                    if side == "ours":
                        seconds, steps = _ours(package, workdir / f"ours-{n}")
                        runs[key]["steps"].append(steps)
                    else:
                        seconds = _theirs(package, workdir / f"vllm-{n}")
                    runs[key][side].append(seconds)
                    print(f"bench.startup: round {r + 1}/{ROUNDS}, {key}, {side}: ready in {seconds:.1f} s",
                          file=sys.stderr, flush=True)  # about 25 min in all: show where it is
    return runs


def _size(package: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in _files(package / "weights"))


def run(out_dir: pathlib.Path) -> dict:
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        demo = build_package(PackageSpec(demo_model(), "demo-tiny", "bench-startup", engine_args=BENCH_ENGINE_ARGS),
                             pathlib.Path(tmp) / "demo-package")
        packages = {"demo": demo, "2 GiB": big_package()}
        sizes = {m: _size(p) for m, p in packages.items()}
        runs = measure(packages, pathlib.Path(tmp))
    (out_dir / "startup.json").write_text(json.dumps({"rounds": ROUNDS, "weights_bytes": sizes, "runs": runs},
                                                     indent=2))
    lines = [
        f"Process start to ready (our `/health/ready` 200, vLLM's `/health` 200) on the same package files, both "
        f"eager (`enforce_eager`: no graph compilation on either side), "
        f"{'no' if QUICK else 'after one'} untimed start of vLLM's server per package, {ROUNDS} round(s); within "
        "a round the two sides take turns going first. Extra = ours minus "
        "vLLM's in the same round; median, then the spread (min to max) over the rounds. Cold: the package's files "
        "dropped from the page cache (posix_fadvise) before each start; warm: read just before.",
        "",
        "| package (weights) | page cache | ours median s | vLLM median s | extra median s | extra spread s | "
        "our steps (median s) |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    extras: dict[str, float] = {}
    for key, r in runs.items():
        model = key.rsplit(" ", 1)[0]
        paired = [o - v for o, v in zip(r["ours"], r["vllm"], strict=True)]
        extras[key] = statistics.median(paired)
        names = list(r["steps"][0])
        steps = ", ".join(f"{name} {statistics.median(s.get(name, 0.0) for s in r['steps']):.2f}" for name in names)
        lines.append(f"| {model} ({sizes[model] / 2**30:.2f} GiB) | {key.rsplit(' ', 1)[1]} | "
                     f"{statistics.median(r['ours']):.1f} | {statistics.median(r['vllm']):.1f} | "
                     f"**{extras[key]:.2f}** | {min(paired):.2f} to {max(paired):.2f} | {steps} |")
    lines.append("")
    for cache in ("cold", "warm"):
        big, small = extras[f"2 GiB {cache}"], extras[f"demo {cache}"]
        within = abs(big - small) <= 0.10 * abs(small)
        lines.append(f"- {cache}: extra on the 2 GiB package {big:.2f} s vs {small:.2f} s on the demo model: "
                     f"{big - small:+.2f} s ({'within' if within else 'not within'} 10 % of the demo's extra).")
    fig, ax = pyplot().subplots(figsize=(7, 3))
    keys = list(runs)
    ax.barh(keys, [extras[k] for k in keys], color="tab:blue")
    ax.set_xlabel("extra seconds to ready over vLLM's own server (median)")
    plot = save_figure(fig, out_dir, "startup.png")
    return result("Startup time vs vLLM's own server (demo and 2 GiB packages, cold and warm)", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
