// The GPU bitmask apply (native/src/mask_kernel.cu), the parts that need no GPU: argument validation, the launch
// plan (grid and block sizing), the packing of the host bitmask into the pinned staging buffer, and the per-span
// work of one CUDA thread, written once for the device and the host. A host emulation runs the kernel's exact
// block structure over host memory with these same functions, so that the tests check the launch logic and the
// kernel's semantics on machines without a GPU (tests/native/test_gpu_kernel.py).
//
// Semantics (the same as the CPU core's apply and the torch path it replaces, serving_image/constraints/engine.py):
// logits[logit_rows[i], c] = -inf where bit c of mask row mask_rows[i] is 0, for c < ncols; then a row whose
// allowed columns are all -inf (another processor had masked them: min_tokens, a -inf logit bias) gets its allowed
// columns set to 0: the constraint wins, and the sampler always has a token. NaN and +inf count as not -inf.
// Every row is checked (the torch path's rule); the CPU core checks sparse rows only, because a dense row has too
// many allowed tokens for all of them to be -inf by accident, and its check would cost a read of the row there.
//
// Values are handled as raw bits (float32, bfloat16, float16): -inf is one bit pattern per type and 0 is all
// zeros, so the kernel does no floating-point arithmetic at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define LSM_HD __host__ __device__ __forceinline__
#else
#define LSM_HD inline
#endif

namespace lsm {

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr uint32_t kNegInfF32 = 0xFF800000u;
constexpr uint16_t kNegInfBF16 = 0xFF80u;
constexpr uint16_t kNegInfF16 = 0xFC00u;

constexpr int32_t kBlockThreads = 256;    // threads per block
constexpr int32_t kMinChunkCols = 4096;   // columns per block, at least (16 per thread)
constexpr int32_t kMaxChunkCols = 65536;  // and at most (256 per thread)
constexpr int32_t kBlocksPerSm = 4;       // blocks the plan aims for per multiprocessor, when the batch is small
constexpr int64_t kMaxRows = 1 << 24;     // rows per launch (the grid is 1-D: rows x chunks < 2^31)

// How one launch covers the rows: one block per (row, chunk of columns), a 1-D grid of rows * chunks_per_row
// blocks, row-major. The staging buffer (pinned host memory, copied to the device in one asynchronous copy) holds
// the n logit-row indices (int32, padded to 16 bytes), then the n mask rows, packed: mask_words words each.
struct Plan {
  int32_t block_threads = 0;
  int32_t chunk_cols = 0;      // a multiple of 32: a block's columns start on a mask word
  int32_t chunks_per_row = 0;  // ceil(ncols / chunk_cols)
  int64_t grid_blocks = 0;     // n * chunks_per_row
  int32_t mask_words = 0;      // ceil(ncols / 32): the words of a mask row that the logits use
  int64_t header_bytes = 0;    // n int32 row indices, rounded up to 16 bytes
  int64_t staging_bytes = 0;   // header_bytes + n * mask_words * 4
};

// What one apply is given. Pointers are host pointers (the logits pointer is never dereferenced by validate).
struct Args {
  int64_t nrows = 0;          // rows of the logits tensor
  int32_t ncols = 0;          // its columns (the model's vocabulary as the sampler sees it)
  int64_t row_stride = 0;     // elements between rows
  int32_t dtype = kFloat32;
  int32_t words = 0;          // words per row of the host bitmask
  int32_t mask_capacity = 0;  // rows of the host bitmask
  int64_t n = 0;              // rows to mask
  const int32_t* logit_rows = nullptr;
  const int32_t* mask_rows = nullptr;
};

// "" when the arguments are valid, else why not (the message names the argument).
std::string validate(const Args& a);
// The launch plan of n rows of ncols columns on a device with sm_count multiprocessors (>= 1).
Plan plan(int64_t n, int32_t ncols, int32_t sm_count);
// Writes the staging buffer of `p` (p.staging_bytes bytes at `staging`): the logit rows, then the mask rows.
void pack(const Plan& p, const uint32_t* bitmask, int32_t words, const int32_t* logit_rows,
          const int32_t* mask_rows, int64_t n, void* staging);
// The kernel's work on host memory, block by block and thread by thread, reading a packed staging buffer as the
// device does; returns the number of rows rescued. For tests: it is as slow as it sounds.
int64_t emulate(const Plan& p, void* logits, int64_t row_stride, int32_t dtype, int32_t ncols, const void* staging,
                int64_t n);

inline size_t element_size(int32_t dtype) { return dtype == kFloat32 ? 4 : 2; }

// One thread's share of columns [begin, end) of a row: the columns begin + tid, begin + tid + nthreads, ... (a warp
// touches consecutive columns: coalesced). Masked columns get -inf; returns whether any allowed column it read is
// not -inf.
template <typename Bits, Bits kNegInf>
LSM_HD bool mask_span(Bits* row, const uint32_t* mask, int32_t begin, int32_t end, int32_t tid, int32_t nthreads) {
  bool alive = false;
  for (int32_t c = begin + tid; c < end; c += nthreads) {
    if ((mask[c >> 5] >> (c & 31)) & 1u) {
      alive |= row[c] != kNegInf;
    } else {
      row[c] = kNegInf;
    }
  }
  return alive;
}

// The rescue of a dead row: this thread's allowed columns of [begin, end) get logit 0.
template <typename Bits>
LSM_HD void rescue_span(Bits* row, const uint32_t* mask, int32_t begin, int32_t end, int32_t tid, int32_t nthreads) {
  for (int32_t c = begin + tid; c < end; c += nthreads)
    if ((mask[c >> 5] >> (c & 31)) & 1u) row[c] = Bits(0);
}

}  // namespace lsm
