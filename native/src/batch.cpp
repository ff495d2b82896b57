// Thread pool and batch operations (see constraint_batch.hpp).
#include "constraint_batch.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace cons {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 0; i < threads - 1; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::work(const std::function<void(int64_t, int64_t)>& fn) {
  for (;;) {
    const int64_t begin = next_.fetch_add(grain_);
    if (begin >= n_) return;
    fn(begin, std::min(n_, begin + grain_));
  }
}

// A worker joins a job only while it is open; the caller closes it once every chunk is claimed and waits only
// for workers that joined. So a worker that is slow to wake (a busy machine) never delays the caller: it finds
// the job closed and goes back to sleep, and the caller has done its share of the work.
void ThreadPool::worker_loop(int id) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (!open_ || id + 1 >= job_threads_) continue;
      ++inflight_;
      job = job_;
    }
    work(*job);
    std::lock_guard<std::mutex> lock(mu_);
    if (--inflight_ == 0) done_cv_.notify_one();
  }
}

void ThreadPool::run(int64_t n, int threads, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (threads <= 0 || threads > size()) threads = size();
  threads = static_cast<int>(std::min<int64_t>(threads, (n + grain - 1) / grain));
  if (threads <= 1) {  // no hand-off for small jobs
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_threads_ = threads;
    inflight_ = 0;
    open_ = true;
    n_ = n;
    grain_ = grain;
    next_.store(0);
    ++generation_;
  }
  start_cv_.notify_all();
  work(fn);  // returns once every chunk is claimed
  std::unique_lock<std::mutex> lock(mu_);
  open_ = false;
  done_cv_.wait(lock, [&] { return inflight_ == 0; });
  job_ = nullptr;
}

// ---------------------------------------------------------------------------------------------------------------
Batch::Batch(int32_t vocab, int32_t capacity, int threads)
    : vocab_(vocab), words_((vocab + 31) / 32), capacity_(0), pool_(threads) {
  if (vocab <= 0) throw std::invalid_argument("vocab must be positive");
  ensure_capacity(std::max(capacity, 1));
}

void Batch::ensure_capacity(int32_t rows) {
  if (rows <= capacity_) return;
  bitmask_.resize(static_cast<size_t>(rows) * static_cast<size_t>(words_), 0u);
  rows_.resize(static_cast<size_t>(rows));
  dirty_.resize(static_cast<size_t>(rows));
  capacity_ = rows;
}

void Batch::check(int32_t row) const {
  if (row < 0 || row >= capacity_)
    throw std::out_of_range("row " + std::to_string(row) + " outside the batch (capacity " +
                            std::to_string(capacity_) + ")");
}

void Batch::set(int32_t row, MachinePtr m) {
  check(row);
  if (m && m->vocab != vocab_) throw std::invalid_argument("machine compiled for another vocabulary size");
  rows_[static_cast<size_t>(row)].reset(std::move(m));
}

void Batch::clear(int32_t row) {
  check(row);
  rows_[static_cast<size_t>(row)].reset(nullptr);
}

void Batch::move(int32_t from, int32_t to) {
  check(from);
  check(to);
  if (from == to) return;
  rows_[static_cast<size_t>(to)] = std::move(rows_[static_cast<size_t>(from)]);
  rows_[static_cast<size_t>(from)].reset(nullptr);
}

void Batch::swap(int32_t a, int32_t b) {
  check(a);
  check(b);
  std::swap(rows_[static_cast<size_t>(a)], rows_[static_cast<size_t>(b)]);
}

void Batch::fill(const int32_t* rows, int64_t n, int threads) {
  for (int64_t i = 0; i < n; ++i) check(rows[i]);
  pool_.run(n, threads, 8, [&](int64_t begin, int64_t end) {
    std::vector<Token> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const auto r = static_cast<size_t>(rows[i]);
      if (!rows_[r].m) continue;
      fill_row(rows_[r], bitmask_.data() + r * static_cast<size_t>(words_), words_, dirty_[r], scratch);
    }
  });
}

template <typename T, typename F>
void Batch::apply_impl(T* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows,
                       const int32_t* mask_rows, int64_t n, int threads, F kernel) {
  if (ncols > words_ * 32) throw std::invalid_argument("logits wider than the bitmask");
  for (int64_t i = 0; i < n; ++i) check(mask_rows[i]);
  // Tasks are (row, column chunk) pairs so that a single wide row still spreads over the threads.
  constexpr int32_t kChunk = 32 * 1024;  // columns, a multiple of 32
  const int64_t chunks = (ncols + kChunk - 1) / kChunk;
  // Streaming stores pay off once the logits cannot stay in the caches anyway (the sampler reads them next).
  constexpr int64_t kStreamBytes = 32ll << 20;
  const bool stream = n * static_cast<int64_t>(ncols) * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
  pool_.run(n * chunks, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / chunks;
      const int32_t c0 = static_cast<int32_t>(t % chunks) * kChunk;
      const int32_t width = std::min(kChunk, ncols - c0);
      T* row = logits + static_cast<int64_t>(logit_rows[i]) * row_stride + c0;
      const uint32_t* mask = bitmask_.data() + static_cast<size_t>(mask_rows[i]) * static_cast<size_t>(words_) + c0 / 32;
      kernel(row, mask, width, stream);
    }
  });
}

namespace {
inline bool is_ninf(float v) { return std::isinf(v) && v < 0; }
inline bool is_ninf(uint16_t v) { return v == 0xFF80; }
inline void set_zero(float& v) { v = 0.0f; }
inline void set_zero(uint16_t& v) { v = 0; }
}  // namespace

// A row whose allowed tokens had all been set to -inf before this processor ran (another processor disagreed:
// min_tokens masking eos when the constraint can only end, a logit bias of -inf) would leave the sampler nothing
// to sample. The constraint wins: its allowed tokens get logit 0. Checked for sparse sets only (a few reads per
// row); a dense set has too many tokens for all of them to have been masked by accident.
template <typename T>
void Batch::rescue(T* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows, const int32_t* mask_rows,
                   int64_t n, int threads) {
  pool_.run(n, threads, 32, [&](int64_t begin, int64_t end) {
    std::vector<Token> allowed;
    for (int64_t i = begin; i < end; ++i) {
      const RowState& st = rows_[static_cast<size_t>(mask_rows[i])];
      if (!st.m) continue;
      const uint32_t* dense = nullptr;
      st.allowed(allowed, dense);
      if (dense) continue;
      T* row = logits + static_cast<int64_t>(logit_rows[i]) * row_stride;
      bool any = false;
      for (Token t : allowed)
        if (t < ncols && !is_ninf(row[t])) {
          any = true;
          break;
        }
      if (any) continue;
      for (Token t : allowed)
        if (t < ncols) set_zero(row[t]);
      rescued_.fetch_add(1);
    }
  });
}

void Batch::apply_f32(float* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows,
                      const int32_t* mask_rows, int64_t n, int threads) {
  apply_impl(logits, row_stride, ncols, logit_rows, mask_rows, n, threads, apply_row_f32);
  rescue(logits, row_stride, ncols, logit_rows, mask_rows, n, threads);
}

void Batch::apply_bf16(uint16_t* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows,
                       const int32_t* mask_rows, int64_t n, int threads) {
  apply_impl(logits, row_stride, ncols, logit_rows, mask_rows, n, threads, apply_row_bf16);
  rescue(logits, row_stride, ncols, logit_rows, mask_rows, n, threads);
}

void Batch::write_neg_inf(float* out, int64_t n, bool stream, int threads) {
  constexpr int64_t kChunk = 32 * 1024;
  static const std::vector<uint32_t> zeros(kChunk / 32, 0u);  // an all-masked word row
  pool_.run((n + kChunk - 1) / kChunk, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t at = c * kChunk;
      apply_row_f32(out + at, zeros.data(), static_cast<int32_t>(std::min(kChunk, n - at)), stream);
    }
  });
}

}  // namespace cons
