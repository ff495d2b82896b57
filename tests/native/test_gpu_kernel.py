"""The GPU bitmask kernel (native/src/mask_kernel.cu): built with nvcc here, its host side checked without a GPU.

- The kernel library is compiled with nvcc from the sources, warnings as errors (so `make test` builds it on every
  run, on CI's machine as on this one). Without nvcc the build tests skip and say so, unless
  LLM_SERVING_REQUIRE_NVCC=1 (set it where nvcc must be present) makes that a failure.
- The host-side logic (argument validation, launch plan, packing of the pinned staging buffer) and an emulation
  of the kernel's blocks and threads over host memory are checked twice: through the pybind11 module (always
  built) and through the freshly built CUDA library (ctypes), against the torch path the kernel replaces
  (`engine.apply_bitmask_torch`), bit for bit, in float32, bfloat16 and float16, with rows rescued.
- On a machine with a CUDA device (the GPU image) the kernel itself runs against the torch path.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_serving.repository import REPO_ROOT
from serving_image.constraints import _native, gpu
from serving_image.constraints.machines import apply_bitmask_torch

NATIVE = REPO_ROOT / "native"
REQUIRE_ENV = "LLM_SERVING_REQUIRE_NVCC"
MIN_CHUNK, MAX_CHUNK, BLOCK = 4096, 65536, 256
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BITS = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16}


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                      str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def build_kernel_library(out_dir: Path) -> Path:
    """Compile the kernel library with nvcc the way the package build does (static CUDA runtime, C ABI)."""
    nvcc = find_nvcc()
    if nvcc is None:
        message = ("nvcc not found (PATH, $CUDACXX, $CUDA_HOME/bin, /usr/local/cuda/bin): the GPU bitmask kernel "
                   "cannot be built here; install the CUDA toolkit")
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1)")
        pytest.skip(message)
    out = out_dir / gpu.LIBRARY_NAME
    cmd = [nvcc, "-std=c++17", "-O2", "-shared", "-cudart=static", "-arch=sm_90", "--Werror=all-warnings",
           "-Xcompiler=-fPIC,-Wall,-Wextra,-Werror", f"-I{NATIVE / 'include'}",
           str(NATIVE / "src" / "mask_kernel.cu"), str(NATIVE / "src" / "mask_launch.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory) -> Path:
    return build_kernel_library(tmp_path_factory.mktemp("cuda"))


class NativeHostLogic:
    """The same host logic through the pybind11 module (no nvcc needed)."""

    def plan(self, n, ncols, sm_count):
        return dict(_native.gpu_plan(n, ncols, sm_count))

    def validate(self, nrows, ncols, row_stride, dtype, words, mask_capacity, logit_rows, mask_rows):
        return _native.gpu_validate(nrows, ncols, row_stride, gpu.DTYPE_CODES.get(dtype, -1), words, mask_capacity,
                                    np.asarray(logit_rows, dtype=np.int32), np.asarray(mask_rows, dtype=np.int32))

    def emulate(self, logits, dtype, bitmask, logit_rows, mask_rows, sm_count):
        return _native.gpu_emulate(logits.ctypes.data, logits.shape[0], logits.shape[1],
                                   logits.strides[0] // logits.itemsize, gpu.DTYPE_CODES[dtype],
                                   np.ascontiguousarray(bitmask).view(np.uint32), np.asarray(logit_rows, np.int32),
                                   np.asarray(mask_rows, np.int32), sm_count)


@pytest.fixture(params=["pybind", "nvcc"])
def host(request):
    if request.param == "pybind":
        return NativeHostLogic()
    return gpu.HostLogic(gpu.load_library(request.getfixturevalue("cuda_library")))


# ---- the build -----------------------------------------------------------------------------------------------------
def test_kernel_library_builds_with_nvcc_and_exports_its_c_abi(cuda_library):
    lib = gpu.load_library(cuda_library)
    assert lib.lsm_abi_version() == gpu.ABI_VERSION
    exported = subprocess.run(["nm", "-D", "--defined-only", str(cuda_library)], capture_output=True, text=True).stdout
    for name in ("lsm_apply", "lsm_create", "lsm_destroy", "lsm_plan", "lsm_validate", "lsm_emulate", "lsm_rescued"):
        assert f" {name}\n" in exported
    # the static CUDA runtime: the library needs the driver at run time, not a CUDA toolkit
    linked = subprocess.run(["ldd", str(cuda_library)], capture_output=True, text=True).stdout
    assert "libcudart" not in linked


def test_the_package_build_ships_the_kernel_where_nvcc_is(cuda_library):
    # native/CMakeLists.txt builds _mask_cuda.so beside the extension when it finds nvcc (make serving-env)
    assert gpu.library_path().is_file(), "nvcc is here but the package build did not install the kernel: re-run " \
                                         "`make serving-env` (native/CMakeLists.txt, LLM_SERVING_BUILD_CUDA)"


# ---- launch plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 256, 1024, 5000])
@pytest.mark.parametrize("ncols", [1, 31, 33, 4095, 32_000, 128_000, 131_072, 256_000, 1_000_003])
@pytest.mark.parametrize("sm_count", [1, 132])
def test_the_plan_covers_every_column_once_with_aligned_bounded_chunks(host, n, ncols, sm_count):
    p = host.plan(n, ncols, sm_count)
    assert p["block_threads"] == BLOCK
    chunk, chunks = p["chunk_cols"], p["chunks_per_row"]
    assert chunk % 32 == 0  # a block starts on a mask word
    assert chunk <= MAX_CHUNK
    assert chunk >= MIN_CHUNK or chunks == 1
    assert (chunks - 1) * chunk < ncols <= chunks * chunk  # every column in exactly one block
    assert p["grid_blocks"] == n * chunks < 2**31
    assert p["mask_words"] == (ncols + 31) // 32
    assert p["header_bytes"] % 16 == 0 and p["header_bytes"] >= 4 * n and p["header_bytes"] - 4 * n < 16
    assert p["staging_bytes"] == p["header_bytes"] + n * p["mask_words"] * 4


def test_a_small_batch_still_spreads_over_the_device_and_a_large_one_stays_one_block_per_chunk(host):
    one = host.plan(1, 128_000, 132)
    assert one["grid_blocks"] >= 32  # one row of 128k columns: many blocks, not one
    big = host.plan(256, 128_000, 132)
    assert big["grid_blocks"] >= 256 * 2 and big["chunk_cols"] > MIN_CHUNK  # fewer, larger chunks per row
    assert host.plan(256, 128_000, 132) == host.plan(256, 128_000, 132)  # deterministic


# ---- validation ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"ncols": 0}, "ncols"),
        ({"ncols": 97}, "ncols"),  # wider than the bitmask (3 words = 96 columns)
        ({"row_stride": 50}, "row_stride"),
        ({"logit_rows": [0, 4]}, "logit_rows[1]"),
        ({"logit_rows": [0, -1]}, "logit_rows[1]"),
        ({"mask_rows": [0, 5]}, "mask_rows[1]"),
        ({"logit_rows": [2, 2]}, "logit_rows: row 2 appears twice"),
        ({"words": 0}, "words"),
    ],
)
def test_invalid_arguments_are_refused_with_the_argument_named(host, change, names):
    args = {"nrows": 4, "ncols": 90, "row_stride": 96, "dtype": "float32", "words": 3, "mask_capacity": 5,
            "logit_rows": [0, 3], "mask_rows": [4, 0]}
    assert host.validate(**args) == ""
    args.update(change)
    assert host.validate(**args).startswith(names)


# ---- the kernel's semantics, emulated on the host ------------------------------------------------------------------
def _case(seed: int, dtype: str, n_logit_rows: int = 9, ncols: int = 9000, capacity: int = 12):
    """Logits with -inf, NaN and +inf here and there, a bitmask of sparse and dense rows (bits set beyond ncols
    too: the vocabulary padding), a V2-like mapping of logits rows to mask rows, and two rows whose allowed
    columns are all -inf already (to be rescued)."""
    g = torch.Generator().manual_seed(seed)
    words = (ncols + 31) // 32 + 1
    logits = torch.randn(n_logit_rows, ncols + 5, generator=g).to(TORCH_DTYPES[dtype])[:, :ncols]  # row stride > ncols
    logits[0, :7] = float("-inf")
    logits[1, 3] = float("nan")
    logits[2, 11] = float("inf")
    bits = torch.rand(capacity, words * 32, generator=g) < 0.002
    bits[3] = torch.rand(words * 32, generator=g) < 0.7  # a dense row
    for r in range(capacity):
        bits[r, torch.randint(0, ncols, (1,), generator=g)] = True  # never empty
    packed = (bits.view(capacity, words, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    bitmask = packed.to(torch.uint32).view(torch.int32).contiguous() if hasattr(torch, "uint32") else None
    bitmask = torch.from_numpy(packed.numpy().astype(np.uint32).view(np.int32)) if bitmask is None else bitmask
    logit_rows = [4, 0, 7, 2, 8, 1, 5]
    mask_rows = [3, 11, 0, 6, 1, 9, 4]
    for dead in (2, 5):  # entries whose allowed columns are all -inf before the apply
        allowed = bits[mask_rows[dead], :ncols]
        logits[logit_rows[dead], allowed] = float("-inf")
    return logits, bitmask, logit_rows, mask_rows


def _bits(t: torch.Tensor, dtype: str) -> np.ndarray:
    return t.contiguous().view(BITS[dtype]).numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("sm_count", [1, 16, 132, 4000])  # one chunk per row up to many chunks per row
def test_the_emulated_kernel_equals_the_torch_path_bit_for_bit(host, dtype, sm_count):
    logits, bitmask, logit_rows, mask_rows = _case(sm_count, dtype)
    expected = logits.clone()
    apply_bitmask_torch(expected, bitmask, logit_rows, mask_rows)

    base = torch.empty(logits.shape[0], logits.stride(0), dtype=logits.dtype)
    base[:, : logits.shape[1]] = logits
    raw = base.view(BITS[dtype]).numpy()  # the kernel sees raw bits with a row stride wider than ncols
    view = raw[:, : logits.shape[1]]
    rescued = host.emulate(view, dtype, bitmask.numpy(), logit_rows, mask_rows, sm_count)
    assert rescued == 2
    got = base[:, : logits.shape[1]]
    np.testing.assert_array_equal(_bits(got, dtype), _bits(expected, dtype))
    assert (raw[:, logits.shape[1]:] == base.view(BITS[dtype]).numpy()[:, logits.shape[1]:]).all()


def test_the_emulated_kernel_agrees_with_the_cpu_core_on_sparse_rows(host):
    # The CPU core (the processor's path on this machine) rescues sparse rows the same way.
    from serving_image.constraints.machines import ConstraintRows, compile_spec
    from serving_image.constraints.spec import validate_constraint

    vocab, eos = 5000, 1
    specs = [{"kind": "allowed_tokens", "tokens": [5, 7, 9]}, {"kind": "token_dfa", "start": 0, "accept": [1],
             "edges": [[0, 17, 1], [1, 42, 0]]}, {"kind": "allowed_tokens", "tokens": [100, 4000]}]
    batch = ConstraintRows(vocab, 4, threads=1)
    for row, raw in enumerate(specs):
        batch.set_row(row, compile_spec(validate_constraint(raw, vocab, eos), vocab, eos), [])
    logits = torch.randn(3, vocab)
    logits[2, [100, 4000, eos]] = float("-inf")  # dead: the constraint wins
    cpu = logits.clone()
    assert batch.fill_apply(cpu) == 3
    assert batch.core.rescued == 1
    emulated = logits.clone()
    rescued = host.emulate(emulated.numpy().view(np.int32), "float32", batch.core.bitmask(), [0, 1, 2], [0, 1, 2], 132)
    assert rescued == 1
    assert torch.equal(emulated, cpu)


def test_an_invalid_emulation_raises_with_the_reason(host):
    logits = np.zeros((2, 64), dtype=np.int32)
    with pytest.raises(ValueError, match="logit_rows"):
        host.emulate(logits, "float32", np.zeros((2, 2), np.int32), [0, 0], [0, 1], 1)


def test_packing_lays_out_rows_then_packed_mask_words():
    bitmask = np.arange(5 * 4, dtype=np.uint32).reshape(5, 4)
    staging = np.frombuffer(_native.gpu_pack(bitmask, np.array([3, 0, 6], np.int32), np.array([4, 1, 2], np.int32),
                                             70, 132), dtype=np.int32)
    plan = _native.gpu_plan(3, 70, 132)
    assert plan["mask_words"] == 3 and plan["header_bytes"] == 16
    assert staging.size * 4 == plan["staging_bytes"]
    assert staging[:4].tolist() == [3, 0, 6, 0]  # logit rows, zero padding to 16 bytes
    masks = staging[4:].view(np.uint32).reshape(3, 3)
    np.testing.assert_array_equal(masks, bitmask[[4, 1, 2], :3])  # only the words the logits use


# ---- the device path's selection -----------------------------------------------------------------------------------
@pytest.fixture
def fresh_gpu_state(monkeypatch):
    monkeypatch.setattr(gpu, "_warned", set())
    monkeypatch.setattr(gpu, "_appliers", {})


def _no_device(cuda_library) -> None:
    try:
        gpu.GpuMaskApplier(0, gpu.load_library(cuda_library)).close()
    except gpu.KernelUnavailable:
        return
    pytest.skip("a CUDA device is present: the fallback cases do not apply")


def test_without_a_usable_device_the_torch_path_is_used_and_the_log_says_so_once(cuda_library, fresh_gpu_state,
                                                                                     monkeypatch, caplog):
    _no_device(cuda_library)
    monkeypatch.setenv(gpu.LIBRARY_ENV, str(cuda_library))
    monkeypatch.delenv(gpu.MODE_ENV, raising=False)
    with caplog.at_level(logging.ERROR, logger=gpu.__name__):
        assert gpu.applier_for(torch.device("cuda", 0)) is None
        assert gpu.applier_for(torch.device("cuda", 0)) is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "GPU bitmask kernel is NOT used" in errors[0].getMessage() and "CUDA device 0" in errors[0].getMessage()


def test_require_turns_an_unavailable_kernel_into_an_error(cuda_library, fresh_gpu_state, monkeypatch, tmp_path):
    _no_device(cuda_library)
    monkeypatch.setenv(gpu.MODE_ENV, "require")
    monkeypatch.setenv(gpu.LIBRARY_ENV, str(cuda_library))
    with pytest.raises(gpu.KernelUnavailable, match="CUDA device 0"):
        gpu.applier_for(torch.device("cuda", 0))
    monkeypatch.setenv(gpu.LIBRARY_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(gpu.KernelUnavailable, match="missing.so"):
        gpu.applier_for(torch.device("cuda", 1))


def test_torch_mode_is_chosen_on_purpose_and_a_bad_mode_is_refused(fresh_gpu_state, monkeypatch, caplog):
    monkeypatch.setenv(gpu.MODE_ENV, "torch")
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        assert gpu.applier_for(torch.device("cuda", 0)) is None
    assert "chosen on purpose" in caplog.text
    monkeypatch.setenv(gpu.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="LLM_SERVING_CONSTRAINT_CUDA"):
        gpu.applier_for(torch.device("cuda", 0))


# ---- on a GPU (the image): the kernel itself -----------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (this torch build or this machine)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_kernel_on_the_device_equals_the_torch_path(dtype):
    applier = gpu.GpuMaskApplier(torch.cuda.current_device())
    for seed in range(4):
        logits, bitmask, logit_rows, mask_rows = _case(seed, dtype, n_logit_rows=9, ncols=130_000)
        expected = logits.clone()
        apply_bitmask_torch(expected, bitmask, logit_rows, mask_rows)
        dev = logits.cuda()
        applier.apply(dev, bitmask.numpy(), logit_rows, mask_rows)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(_bits(dev.cpu(), dtype), _bits(expected, dtype))
    assert applier.rescued() == 8
    applier.close()


def test_the_torch_fallback_takes_the_row_arrays_the_gpu_path_hands_it():
    # Off the CPU the batch fills through `fill_constrained` (an int32 array) and hands the rows to the kernel or,
    # without it, to torch: the torch path must accept them and mask as the core does.
    from serving_image.constraints.machines import ConstraintRows, compile_spec
    from serving_image.constraints.spec import validate_constraint

    vocab, eos = 3000, 1
    batch = ConstraintRows(vocab, 4, threads=1)
    spec = validate_constraint({"kind": "allowed_tokens", "tokens": [5, 7, 2999]}, vocab, eos)
    batch.set_row(2, compile_spec(spec, vocab, eos), [])
    rows = batch.core.fill_constrained(4, 1)
    assert rows.dtype == np.int32 and rows.tolist() == [2]
    logits = torch.randn(4, vocab)
    expected = logits.clone()
    assert batch.fill_apply(expected) == 1  # the CPU core
    before = batch.torch_steps
    batch._apply_device(logits, rows, rows)
    assert batch.torch_steps == before + 1
    assert torch.equal(logits, expected)
