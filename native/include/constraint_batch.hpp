// The batch: one RowState per batch row, the packed bitmask it fills (int32 words, one row per request, 1 = allowed,
// xgrammar's layout), and a persistent thread pool that fills and applies rows in parallel. No Python here: the
// bindings release the GIL around fill/apply, and the sanitizer driver uses this class directly.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "constraint_core.hpp"

namespace cons {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // total threads including the caller; <= 0: hardware concurrency
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls fn(begin, end) over [0, n) in chunks of `grain`, on at most `threads` threads (the caller is one of them).
  void run(int64_t n, int threads, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int id);
  void work(const std::function<void(int64_t, int64_t)>& fn);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int job_threads_ = 0;
  bool open_ = false;  // workers may still join the current job
  int inflight_ = 0;   // workers inside the current job
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  std::atomic<int64_t> next_{0};
  int64_t n_ = 0, grain_ = 1;
  std::mutex run_mu_;  // one job at a time
};

class Batch {
 public:
  Batch(int32_t vocab, int32_t capacity, int threads);

  int32_t vocab() const { return vocab_; }
  int32_t words() const { return words_; }
  int32_t capacity() const { return capacity_; }
  int threads() const { return pool_.size(); }
  uint32_t* bitmask() { return bitmask_.data(); }
  void ensure_capacity(int32_t rows);  // grows the bitmask: invalidates earlier pointers to it

  void set(int32_t row, MachinePtr m);  // the row starts from the machine's start state
  void clear(int32_t row);
  void move(int32_t from, int32_t to);  // to := from; from becomes unconstrained
  void swap(int32_t a, int32_t b);
  RowState& state(int32_t row) { return check(row), rows_[static_cast<size_t>(row)]; }
  bool constrained(int32_t row) const { return row >= 0 && row < capacity_ && rows_[static_cast<size_t>(row)].m; }

  // Fill the bitmask rows of the given (constrained) rows.
  void fill(const int32_t* rows, int64_t n, int threads);
  // logits[logit_rows[i], :ncols] masked by bitmask row mask_rows[i]; ncols <= words * 32.
  void apply_f32(float* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows,
                 const int32_t* mask_rows, int64_t n, int threads);
  void apply_bf16(uint16_t* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows,
                  const int32_t* mask_rows, int64_t n, int threads);
  // Write -inf over `n` floats with the apply's own store loop and no mask to read: the bandwidth probe behind
  // the benchmark's physical floor (streaming or plain stores).
  void write_neg_inf(float* out, int64_t n, bool stream, int threads);

  int64_t rescued() const { return rescued_.load(); }

 private:
  void check(int32_t row) const;
  template <typename T>
  void rescue(T* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows, const int32_t* mask_rows,
              int64_t n, int threads);
  template <typename T, typename F>
  void apply_impl(T* logits, int64_t row_stride, int32_t ncols, const int32_t* logit_rows, const int32_t* mask_rows,
                  int64_t n, int threads, F kernel);

  int32_t vocab_, words_, capacity_;
  std::vector<uint32_t> bitmask_;
  std::vector<RowState> rows_;
  std::vector<std::vector<int32_t>> dirty_;  // per bitmask row (not per request): words left non-zero
  ThreadPool pool_;
  std::atomic<int64_t> rescued_{0};  // rows whose allowed tokens were all -inf before the mask (see rescue)
};

}  // namespace cons
