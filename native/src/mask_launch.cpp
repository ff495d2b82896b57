// Host side of the GPU bitmask apply (see mask_launch.hpp): validation, launch plan, packing, host emulation.
// Compiled into the pybind11 module (so the tests check it without nvcc) and into the CUDA library.
#include "mask_launch.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

namespace lsm {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
}  // namespace

std::string validate(const Args& a) {
  if (a.dtype != kFloat32 && a.dtype != kBFloat16 && a.dtype != kFloat16)
    return "dtype: " + std::to_string(a.dtype) + " is not float32 (0), bfloat16 (1) or float16 (2)";
  if (a.ncols <= 0) return "ncols: " + std::to_string(a.ncols) + ", must be positive";
  if (a.nrows < 0) return "nrows: " + std::to_string(a.nrows) + ", must not be negative";
  if (a.words <= 0) return "words: " + std::to_string(a.words) + ", must be positive";
  if (static_cast<int64_t>(a.ncols) > static_cast<int64_t>(a.words) * 32)
    return "ncols: the logits have " + std::to_string(a.ncols) + " columns, the bitmask covers " +
           std::to_string(static_cast<int64_t>(a.words) * 32);
  if (a.row_stride < a.ncols)
    return "row_stride: " + std::to_string(a.row_stride) + " is less than ncols " + std::to_string(a.ncols);
  if (a.n < 0) return "n: " + std::to_string(a.n) + ", must not be negative";
  if (a.n > kMaxRows) return "n: " + std::to_string(a.n) + " rows, at most " + std::to_string(kMaxRows);
  if (a.n * ceil_div(a.ncols, kMinChunkCols) > INT32_MAX) return "n: too many blocks for one launch";
  if (a.n > 0 && (a.logit_rows == nullptr || a.mask_rows == nullptr)) return "logit_rows/mask_rows: null";
  if (a.n > a.nrows) return "n: " + std::to_string(a.n) + " rows to mask, the logits have " + std::to_string(a.nrows);
  for (int64_t i = 0; i < a.n; ++i) {
    if (a.logit_rows[i] < 0 || a.logit_rows[i] >= a.nrows)
      return "logit_rows[" + std::to_string(i) + "]: " + std::to_string(a.logit_rows[i]) + " outside [0, " +
             std::to_string(a.nrows) + ")";
    if (a.mask_rows[i] < 0 || a.mask_rows[i] >= a.mask_capacity)
      return "mask_rows[" + std::to_string(i) + "]: " + std::to_string(a.mask_rows[i]) + " outside [0, " +
             std::to_string(a.mask_capacity) + ")";
  }
  // Two entries on one logits row would race in the kernel (and mean nothing: which mask wins?).
  std::vector<int32_t> sorted(a.logit_rows, a.logit_rows + a.n);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) return "logit_rows: row " + std::to_string(*dup) + " appears twice";
  return "";
}

Plan plan(int64_t n, int32_t ncols, int32_t sm_count) {
  Plan p;
  p.block_threads = kBlockThreads;
  p.mask_words = static_cast<int32_t>(ceil_div(std::max(ncols, 1), 32));
  // Enough blocks to fill the device when the batch is small (one row alone spreads over kBlocksPerSm blocks per
  // multiprocessor), but never fewer than kMinChunkCols columns per block, so each thread has a few columns to
  // amortise the block's start; and never more than kMaxChunkCols.
  const int64_t rows = std::max<int64_t>(n, 1);
  const int64_t target = static_cast<int64_t>(std::max(sm_count, 1)) * kBlocksPerSm;
  const int64_t chunks_wanted = std::max<int64_t>(1, ceil_div(target, rows));
  int64_t chunk = round_up(ceil_div(std::max(ncols, 1), chunks_wanted), 32);
  chunk = std::clamp<int64_t>(chunk, kMinChunkCols, kMaxChunkCols);
  chunk = std::min<int64_t>(chunk, round_up(std::max(ncols, 1), 32));
  p.chunk_cols = static_cast<int32_t>(chunk);
  p.chunks_per_row = static_cast<int32_t>(ceil_div(std::max(ncols, 1), chunk));
  p.grid_blocks = std::max<int64_t>(n, 0) * p.chunks_per_row;
  p.header_bytes = round_up(std::max<int64_t>(n, 0) * 4, 16);
  p.staging_bytes = p.header_bytes + std::max<int64_t>(n, 0) * p.mask_words * 4;
  return p;
}

void pack(const Plan& p, const uint32_t* bitmask, int32_t words, const int32_t* logit_rows,
          const int32_t* mask_rows, int64_t n, void* staging) {
  auto* bytes = static_cast<unsigned char*>(staging);
  if (n > 0) std::memcpy(bytes, logit_rows, static_cast<size_t>(n) * 4);  // n == 0: the pointers may be null
  if (p.header_bytes > n * 4) std::memset(bytes + n * 4, 0, static_cast<size_t>(p.header_bytes - n * 4));
  auto* masks = reinterpret_cast<uint32_t*>(bytes + p.header_bytes);
  const size_t row_bytes = static_cast<size_t>(p.mask_words) * 4;
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(masks + i * p.mask_words, bitmask + static_cast<int64_t>(mask_rows[i]) * words, row_bytes);
}

namespace {
template <typename Bits, Bits kNegInf>
int64_t emulate_typed(const Plan& p, Bits* logits, int64_t row_stride, int32_t ncols, const void* staging, int64_t n) {
  const auto* rows = static_cast<const int32_t*>(staging);
  const auto* masks = reinterpret_cast<const uint32_t*>(static_cast<const unsigned char*>(staging) + p.header_bytes);
  int64_t rescued = 0;
  for (int64_t i = 0; i < n; ++i) {
    Bits* row = logits + static_cast<int64_t>(rows[i]) * row_stride;
    const uint32_t* mask = masks + i * p.mask_words;
    bool alive = false;
    for (int32_t c = 0; c < p.chunks_per_row; ++c) {  // the blocks of this row
      const int32_t begin = c * p.chunk_cols;
      const int32_t end = std::min(ncols, begin + p.chunk_cols);
      for (int32_t tid = 0; tid < p.block_threads; ++tid)
        alive |= mask_span<Bits, kNegInf>(row, mask, begin, end, tid, p.block_threads);
    }
    if (!alive) {  // what the row's last block does
      for (int32_t tid = 0; tid < p.block_threads; ++tid) rescue_span<Bits>(row, mask, 0, ncols, tid, p.block_threads);
      ++rescued;
    }
  }
  return rescued;
}
}  // namespace

int64_t emulate(const Plan& p, void* logits, int64_t row_stride, int32_t dtype, int32_t ncols, const void* staging,
                int64_t n) {
  switch (dtype) {
    case kFloat32:
      return emulate_typed<uint32_t, kNegInfF32>(p, static_cast<uint32_t*>(logits), row_stride, ncols, staging, n);
    case kBFloat16:
      return emulate_typed<uint16_t, kNegInfBF16>(p, static_cast<uint16_t*>(logits), row_stride, ncols, staging, n);
    case kFloat16:
      return emulate_typed<uint16_t, kNegInfF16>(p, static_cast<uint16_t*>(logits), row_stride, ncols, staging, n);
    default:
      return -1;
  }
}

}  // namespace lsm
