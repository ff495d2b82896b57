// The GPU apply's host-side logic (mask_launch.hpp) under AddressSanitizer and UndefinedBehaviorSanitizer, against
// a naive reference, over random shapes: validation of good and bad arguments, plans that cover every column once,
// packing, and the kernel's emulation (mask + rescue) in the three dtypes. Prints "ok <cases>" or aborts.
// Built and run by tests/native/test_sanitizers.py.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "mask_launch.hpp"

namespace {

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

template <typename Bits, Bits kNegInf>
void reference(std::vector<Bits>& logits, int64_t stride, int32_t ncols, const std::vector<uint32_t>& bitmask,
               int32_t words, const std::vector<int32_t>& lr, const std::vector<int32_t>& mr, int64_t& rescued) {
  for (size_t i = 0; i < lr.size(); ++i) {
    Bits* row = logits.data() + lr[i] * stride;
    const uint32_t* mask = bitmask.data() + static_cast<int64_t>(mr[i]) * words;
    bool alive = false;
    for (int32_t c = 0; c < ncols; ++c) {
      if ((mask[c / 32] >> (c % 32)) & 1u) {
        alive |= row[c] != kNegInf;
      } else {
        row[c] = kNegInf;
      }
    }
    if (!alive) {
      ++rescued;
      for (int32_t c = 0; c < ncols; ++c)
        if ((mask[c / 32] >> (c % 32)) & 1u) row[c] = 0;
    }
  }
}

template <typename Bits, Bits kNegInf>
void one_case(std::mt19937& rng, int32_t dtype) {
  std::uniform_int_distribution<int32_t> ncols_d(1, 20000), rows_d(1, 9), sm_d(1, 300);
  const int32_t ncols = ncols_d(rng);
  const int32_t words = (ncols + 31) / 32 + static_cast<int32_t>(rng() % 2);
  const int64_t stride = ncols + static_cast<int64_t>(rng() % 3);
  const int32_t nrows = rows_d(rng), capacity = rows_d(rng);
  const int32_t sm = sm_d(rng);
  std::vector<uint32_t> bitmask(static_cast<size_t>(capacity) * words);
  for (auto& w : bitmask) w = (rng() % 4 == 0) ? static_cast<uint32_t>(rng()) : (rng() % 3 == 0 ? 1u << (rng() % 32) : 0u);
  std::vector<int32_t> lr, mr;
  std::vector<int32_t> perm(nrows);
  for (int32_t r = 0; r < nrows; ++r) perm[r] = r;
  std::shuffle(perm.begin(), perm.end(), rng);
  const int32_t n = static_cast<int32_t>(rng() % (nrows + 1));
  for (int32_t i = 0; i < n; ++i) {
    lr.push_back(perm[i]);
    mr.push_back(static_cast<int32_t>(rng() % capacity));
  }
  std::vector<Bits> logits(static_cast<size_t>(nrows) * stride);
  for (auto& v : logits) v = (rng() % 5 == 0) ? kNegInf : static_cast<Bits>(rng() % 1000 + 1);
  if (n > 0) {  // one dead row: every allowed column of the first entry already -inf
    const uint32_t* mask = bitmask.data() + static_cast<int64_t>(mr[0]) * words;
    for (int32_t c = 0; c < ncols; ++c)
      if ((mask[c / 32] >> (c % 32)) & 1u) logits[lr[0] * stride + c] = kNegInf;
  }
  lsm::Args args{nrows, ncols, stride, dtype, words, capacity, n, lr.data(), mr.data()};
  CHECK(lsm::validate(args).empty());
  const lsm::Plan p = lsm::plan(n, ncols, sm);
  CHECK(p.chunk_cols % 32 == 0 && p.chunks_per_row >= 1);
  CHECK(static_cast<int64_t>(p.chunks_per_row - 1) * p.chunk_cols < ncols);
  CHECK(static_cast<int64_t>(p.chunks_per_row) * p.chunk_cols >= ncols);
  std::vector<uint64_t> staging(static_cast<size_t>((p.staging_bytes + 7) / 8) + 1);
  lsm::pack(p, bitmask.data(), words, lr.data(), mr.data(), n, staging.data());
  std::vector<Bits> expected = logits;
  int64_t want = 0;
  reference<Bits, kNegInf>(expected, stride, ncols, bitmask, words, lr, mr, want);
  const int64_t got = lsm::emulate(p, logits.data(), stride, dtype, ncols, staging.data(), n);
  CHECK(got == want);
  CHECK(logits == expected);

  // invalid arguments are refused, never read out of bounds
  if (n > 0) {
    std::vector<int32_t> bad = lr;
    bad[0] = nrows;
    lsm::Args b = args;
    b.logit_rows = bad.data();
    CHECK(!lsm::validate(b).empty());
    std::vector<int32_t> badm = mr;
    badm[n - 1] = -1;
    b = args;
    b.mask_rows = badm.data();
    CHECK(!lsm::validate(b).empty());
  }
  lsm::Args wide = args;
  wide.ncols = words * 32 + 1;
  wide.row_stride = wide.ncols;
  CHECK(!lsm::validate(wide).empty());
}

}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 200;
  std::mt19937 rng(argc > 2 ? static_cast<unsigned>(std::atoi(argv[2])) : 20u);
  for (int i = 0; i < cases; ++i) {
    switch (i % 3) {
      case 0: one_case<uint32_t, lsm::kNegInfF32>(rng, lsm::kFloat32); break;
      case 1: one_case<uint16_t, lsm::kNegInfBF16>(rng, lsm::kBFloat16); break;
      default: one_case<uint16_t, lsm::kNegInfF16>(rng, lsm::kFloat16); break;
    }
  }
  std::printf("ok %d\n", cases);
  return 0;
}
