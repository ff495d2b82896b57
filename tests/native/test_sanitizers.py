"""The core built with AddressSanitizer and UndefinedBehaviorSanitizer, replaying random batch scripts.

A standalone C++ driver (native/tests/sanitize_driver.cpp) is compiled here with -fsanitize=address,undefined
and fed scripts of batch operations (specs, tokens, moves, swaps, shrunk histories) over the thread pool,
bitmask fill and float32/bfloat16 apply. Any sanitizer report aborts it; its printed allowed sets must equal the
pure-Python reference's, so the sanitized build is held to the same semantics as the extension.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from llm_serving.repository import REPO_ROOT
from tests.native.gen import BatchModel, next_token, random_batch_op, random_vocab, script_line

NATIVE = REPO_ROOT / "native"


def _driver_env() -> dict[str, str]:
    """The driver's environment without LD_PRELOAD: a library preloaded into the test session (vLLM's CPU platform
    sets LD_PRELOAD for its allocator) makes ASan refuse to start unless its runtime comes first."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the package build needs one too)"
    out = tmp_path_factory.mktemp("asan") / "sanitize_driver"
    cmd = [
        cxx, "-std=c++17", "-O0", "-g", "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
        f"-I{NATIVE / 'include'}",
        str(NATIVE / "src" / "core.cpp"), str(NATIVE / "src" / "batch.cpp"),
        str(NATIVE / "tests" / "sanitize_driver.cpp"),
        "-pthread", "-o", str(out),
    ]
    subprocess.run(cmd, check=True, timeout=300)
    return out


def make_script(seed: int) -> tuple[str, list[str]]:
    """A random script and the reference's expected QUERY lines."""
    rng = random.Random(seed)
    vocab, eos = random_vocab(rng)
    capacity = rng.randint(1, 12)
    lines = [f"BATCH {vocab} {capacity} {rng.choice((1, 2, 4))}"]
    model = BatchModel(capacity)  # row -> (spec, history)
    expected: list[str] = []
    queries = 0
    for _ in range(rng.randint(20, 120)):
        match random_batch_op(rng, model, vocab, eos):
            case ("set", row, spec, _):
                lines.append(script_line(row, spec, eos))
            case ("clear", row):
                lines.append(f"CLEAR {row}")
            case ("move", src, dst):
                lines.append(f"MOVE {src} {dst}")
            case ("swap", a, b):
                lines.append(f"SWAP {a} {b}")
            case ("history", row):
                hist = model.rows[row][1]
                if rng.random() < 0.1:
                    k = rng.randint(0, 3)
                    del hist[max(0, len(hist) - k):]
                    lines.append(f"SHRINK {row} {k}")
                else:
                    t = next_token(rng, model.reference(row, eos).allowed(), vocab, eos)
                    hist.append(t)
                    lines.append(f"TOK {row} {t}")
        if rng.random() < 0.3:
            queries += 1
            lines.append("QUERY")
            for r in sorted(model.rows):
                expected.append(f"Q{queries} row {r}:" + "".join(f" {t}" for t in model.allowed(r, eos)))
    expected.append(f"DONE {queries}")
    return "\n".join(lines) + "\n", expected


def test_sanitized_core_replays_random_scripts_like_the_reference(driver: Path):
    for seed in range(60):
        script, expected = make_script(seed)
        run = subprocess.run([str(driver)], input=script, capture_output=True, text=True, timeout=120,
                             env=_driver_env())
        assert run.returncode == 0, f"seed {seed}: driver failed\n{run.stderr[-4000:]}"
        assert "runtime error" not in run.stderr, run.stderr[-4000:]  # UBSan, belt and braces
        assert run.stdout.splitlines() == expected, f"seed {seed}"


def test_sanitized_core_rejects_malformed_machines(driver: Path):
    """Compilers check their input even though Python validates first: no out-of-bounds on bad specs."""
    for bad in (
        "BATCH 64 2 1\nDFA 0 0 0 1 0 1 0 99 0\n",  # token outside the vocabulary
        "BATCH 64 2 1\nCHOICE 0 0 1 1 5 1 5 1 -1 0\n",  # separator's first token inside a choice
        "BATCH 64 2 1\nALLOWED 5 0 1 3\n",  # row outside the batch
        "BATCH 64 2 1\nPACKED 0 0 2 3 99\n",  # a packed id outside the vocabulary
    ):
        run = subprocess.run([str(driver)], input=bad, capture_output=True, text=True, timeout=60, env=_driver_env())
        assert run.returncode != 0
        assert "AddressSanitizer" not in run.stderr and "runtime error" not in run.stderr, run.stderr


def test_sanitized_gpu_launch_logic_matches_a_naive_reference(tmp_path):
    """The GPU apply's host side (validation, launch plan, packing, the kernel's emulation: mask_launch.cpp) under
    ASan/UBSan, against a naive reference over random shapes, dtypes and row mappings (native/tests/
    mask_launch_driver.cpp); no nvcc or GPU needed."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the package build needs one too)"
    out = tmp_path / "mask_launch_driver"
    subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Werror", f"-I{NATIVE / 'include'}",
                    str(NATIVE / "src" / "mask_launch.cpp"), str(NATIVE / "tests" / "mask_launch_driver.cpp"),
                    "-o", str(out)], check=True, timeout=300)
    for seed in (1, 2):
        run = subprocess.run([str(out), "150", str(seed)], capture_output=True, text=True, timeout=300,
                             env=_driver_env())
        assert run.returncode == 0, run.stderr[-4000:]
        assert "runtime error" not in run.stderr, run.stderr[-4000:]
        assert run.stdout.strip() == "ok 150"


def _json_corpus(seed: int) -> list[bytes]:
    """Spec texts for the JSON readers: good and bad ones (the parity test's), every prefix of each (a read past the
    end of a truncated text is what ASan would catch), and random byte edits."""
    from tests.native.test_constraint_text import BAD, GOOD

    rng = random.Random(seed)
    base = [t.encode() for t in GOOD + BAD if len(t) < 400]
    base += [b'{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,1],[1,6,0]]}', b"", b"{", b"[1]"]
    corpus = list(base)
    for text in base:
        corpus += [text[:k] for k in range(len(text))]
        for _ in range(40):
            edited = bytearray(text)
            for _ in range(rng.randint(1, 3)):
                k = rng.randrange(len(edited) + 1)
                digits = [j for j, c in enumerate(edited) if 48 <= c <= 57]
                match rng.randrange(6):
                    case 3 | 4 | 5 if digits:  # another number: mostly still the plain form
                        edited[rng.choice(digits)] = rng.choice(b"0123456789")
                    case 0 if edited:
                        del edited[min(k, len(edited) - 1)]
                    case 1:
                        edited.insert(k, rng.choice(b'0123456789[]{},:" -.e\\\n'))
                    case _ if edited:
                        edited[min(k, len(edited) - 1)] = rng.randrange(256)
            corpus.append(bytes(edited))
    return corpus


def test_sanitized_json_readers_read_client_text_as_the_extension_does(tmp_path):
    """The spec readers that take client text straight from a request (constraint_json.hpp: allowed_tokens and
    token_dfa in their plain forms) under ASan/UBSan, over good and bad specs, all their prefixes and random edits,
    each in a heap buffer of exactly its size; they must answer as the extension's bindings of the same code do."""
    from serving_image.constraints import _native

    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the package build needs one too)"
    out = tmp_path / "json_driver"
    subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Werror", f"-I{NATIVE / 'include'}",
                    str(NATIVE / "tests" / "json_driver.cpp"), "-o", str(out)], check=True, timeout=300)
    corpus = _json_corpus(11)
    records, expected = bytearray(), []
    for i, text in enumerate(corpus):
        hi, eos = (1024, 2) if i % 2 else (-1, -1)
        records += b"ALLOWED %d %d\n" % (hi, len(text)) + text + b"\n"
        count, start, stop = _native.json_allowed_tokens(text, hi)
        expected.append(f"ALLOWED {count} {start} {stop}")
        records += b"DFA %d %d %d %d\n" % (hi, eos, 1 << 20, len(text)) + text + b"\n"
        dfa = _native.json_token_dfa(text, hi, eos, 1 << 20)
        expected.append("deterministic" if dfa else "refused")  # the driver reads, then says if it is deterministic
    run = subprocess.run([str(out)], input=bytes(records), capture_output=True, timeout=300, env=_driver_env())
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-4000:]
    assert b"runtime error" not in run.stderr, run.stderr[-4000:]
    lines = run.stdout.decode().splitlines()
    assert len(lines) == len(expected)
    for line, want in zip(lines, expected, strict=True):
        if want == "deterministic":
            assert line.startswith("DFA 1 ") and line.endswith(" 1"), line
        elif want == "refused":  # not the plain form, or read but not deterministic
            assert line == "DFA 0" or (line.startswith("DFA 1 ") and line.endswith(" 0")), line
        else:
            assert line == want
    accepted = sum(1 for line in lines if line.startswith("DFA 1") or (line.startswith("ALLOWED") and
                                                                        not line.startswith("ALLOWED -1")))
    assert accepted > 100  # the corpus reaches past the readers' refusals
