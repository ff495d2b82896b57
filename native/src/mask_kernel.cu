// The GPU bitmask apply: one fused kernel over the logits, fed by one asynchronous copy from pinned memory.
//
// Per step the host packs the rows to mask (their logits-row indices and their bitmask rows, only the words the
// logits use) into a pinned staging buffer, copies it to the device with one cudaMemcpyAsync on the caller's
// stream, and launches one kernel on the same stream: one block per (row, chunk of columns); each thread writes
// -inf over its masked columns and notes whether an allowed column it read is still alive (not -inf). The blocks
// of a row meet through a per-row flag and ticket in device memory (atomics, no second launch): the row's last
// block learns whether the whole row is dead and, if so, sets its allowed columns to 0 (the rescue; semantics in
// mask_launch.hpp), then resets the flag and ticket for the next launch. Nothing waits for the device: the
// host returns as soon as the copy and the kernel are queued. Two staging buffers alternate; before one is
// rewritten the host waits for the event recorded after the kernel that last read it (two steps earlier, long
// done in practice).
//
// A plain shared library with a C ABI (loaded with ctypes by serving_image/constraints/gpu.py), linked with the
// static CUDA runtime: it needs only the driver at run time, and it works with any torch build, because it takes
// the logits as a device pointer and the stream as a handle. Built by native/CMakeLists.txt when nvcc is found,
// and by tests/native/test_gpu_kernel.py in `make test`. The host-side logic (validation, launch plan, packing,
// an emulation of the kernel) lives in mask_launch.cpp and is tested without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "mask_launch.hpp"

namespace {

constexpr int kAbiVersion = 1;

template <typename Bits, Bits kNegInf>
__global__ void __launch_bounds__(lsm::kBlockThreads)
    mask_kernel(Bits* __restrict__ logits, int64_t row_stride, int32_t ncols, const int32_t* __restrict__ logit_rows,
                const uint32_t* __restrict__ masks, int32_t mask_words, int32_t chunk_cols, int32_t chunks,
                int32_t* flags, int32_t* tickets, unsigned long long* rescued) {
  const int64_t block = blockIdx.x;
  const int64_t i = block / chunks;
  const int32_t chunk = static_cast<int32_t>(block - i * chunks);
  Bits* row = logits + static_cast<int64_t>(logit_rows[i]) * row_stride;
  const uint32_t* mask = masks + i * mask_words;
  const int32_t begin = chunk * chunk_cols;
  const int32_t end = min(ncols, begin + chunk_cols);
  const int32_t tid = threadIdx.x, nthreads = blockDim.x;

  const bool alive = __syncthreads_or(lsm::mask_span<Bits, kNegInf>(row, mask, begin, end, tid, nthreads));
  __shared__ bool rescue;
  if (tid == 0 && chunks == 1) {
    rescue = !alive;  // the block saw the whole row
  } else if (tid == 0) {
    if (alive) atomicOr(&flags[i], 1);
    __threadfence();  // the flag is visible before the ticket says this block is done
    rescue = false;
    if (atomicAdd(&tickets[i], 1) == chunks - 1) {  // the row's last block: every other one has set its flag
      rescue = atomicExch(&flags[i], 0) == 0;
      atomicExch(&tickets[i], 0);
    }
  }
  __syncthreads();
  if (rescue) {
    // Writes only allowed columns, which no block of this row writes otherwise: no ordering with their -inf needed.
    lsm::rescue_span<Bits>(row, mask, 0, ncols, tid, nthreads);
    if (tid == 0) atomicAdd(rescued, 1ull);
  }
}

struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    if (previous != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous) cudaSetDevice(previous);
  }
};

struct Handle {
  int device = 0;
  int sm_count = 1;
  void* host[2] = {nullptr, nullptr};  // pinned staging
  void* dev[2] = {nullptr, nullptr};
  size_t bytes[2] = {0, 0};  // capacity of host[k] and dev[k]
  cudaEvent_t done[2] = {nullptr, nullptr};  // recorded after the kernel that read dev[k]
  bool used[2] = {false, false};
  int next = 0;
  cudaStream_t last_stream = nullptr;
  bool launched = false;
  int32_t* flags = nullptr;  // per row of a launch, zero between launches
  int32_t* tickets = nullptr;
  int64_t workspace_rows = 0;
  unsigned long long* rescued = nullptr;
  std::string error;
};

bool ok(Handle* h, cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  h->error = std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
  cudaGetLastError();  // clear a non-sticky error
  return false;
}

void copy_error(const std::string& msg, char* err, size_t errlen) {
  if (err == nullptr || errlen == 0) return;
  const size_t n = std::min(msg.size(), errlen - 1);
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

bool wait_all(Handle* h) {
  for (int k = 0; k < 2; ++k)
    if (h->used[k] && !ok(h, cudaEventSynchronize(h->done[k]), "cudaEventSynchronize")) return false;
  return true;
}

bool ensure_workspace(Handle* h, int64_t rows, cudaStream_t stream) {
  if (rows <= h->workspace_rows) return true;
  if (!wait_all(h)) return false;  // no kernel may still use the old workspace
  const int64_t want = std::max<int64_t>(rows, 2 * h->workspace_rows);
  cudaFree(h->flags);
  cudaFree(h->tickets);
  h->flags = h->tickets = nullptr;
  h->workspace_rows = 0;
  if (!ok(h, cudaMalloc(&h->flags, want * sizeof(int32_t)), "cudaMalloc(flags)")) return false;
  if (!ok(h, cudaMalloc(&h->tickets, want * sizeof(int32_t)), "cudaMalloc(tickets)")) return false;
  if (!ok(h, cudaMemsetAsync(h->flags, 0, want * sizeof(int32_t), stream), "cudaMemsetAsync(flags)")) return false;
  if (!ok(h, cudaMemsetAsync(h->tickets, 0, want * sizeof(int32_t), stream), "cudaMemsetAsync(tickets)")) return false;
  h->workspace_rows = want;
  return true;
}

bool ensure_staging(Handle* h, int k, size_t bytes) {
  if (bytes <= h->bytes[k]) return true;
  // the event of buffer k was already waited for by the caller
  const size_t want = std::max(bytes, 2 * h->bytes[k]);
  cudaFreeHost(h->host[k]);
  cudaFree(h->dev[k]);
  h->host[k] = h->dev[k] = nullptr;
  h->bytes[k] = 0;
  if (!ok(h, cudaHostAlloc(&h->host[k], want, cudaHostAllocDefault), "cudaHostAlloc(staging)")) return false;
  if (!ok(h, cudaMalloc(&h->dev[k], want), "cudaMalloc(staging)")) return false;
  h->bytes[k] = want;
  return true;
}

template <typename Bits, Bits kNegInf>
void launch(const lsm::Plan& p, void* logits, int64_t row_stride, int32_t ncols, const void* dev_staging, Handle* h,
            cudaStream_t stream) {
  const auto* rows = static_cast<const int32_t*>(dev_staging);
  const auto* masks = reinterpret_cast<const uint32_t*>(static_cast<const unsigned char*>(dev_staging) + p.header_bytes);
  mask_kernel<Bits, kNegInf><<<static_cast<unsigned>(p.grid_blocks), p.block_threads, 0, stream>>>(
      static_cast<Bits*>(logits), row_stride, ncols, rows, masks, p.mask_words, p.chunk_cols, p.chunks_per_row,
      h->flags, h->tickets, h->rescued);
}

}  // namespace

extern "C" {

int lsm_abi_version() { return kAbiVersion; }

// ---- host-only entry points: no GPU needed ------------------------------------------------------------------------
// out: block_threads, chunk_cols, chunks_per_row, grid_blocks, mask_words, header_bytes, staging_bytes
void lsm_plan(int64_t n, int32_t ncols, int32_t sm_count, int64_t* out) {
  const lsm::Plan p = lsm::plan(n, ncols, sm_count);
  const int64_t v[7] = {p.block_threads, p.chunk_cols, p.chunks_per_row, p.grid_blocks,
                        p.mask_words,    p.header_bytes, p.staging_bytes};
  std::memcpy(out, v, sizeof(v));
}

int lsm_validate(int64_t nrows, int32_t ncols, int64_t row_stride, int32_t dtype, int32_t words, int32_t mask_capacity,
                 const int32_t* logit_rows, const int32_t* mask_rows, int64_t n, char* err, size_t errlen) {
  lsm::Args a{nrows, ncols, row_stride, dtype, words, mask_capacity, n, logit_rows, mask_rows};
  const std::string why = lsm::validate(a);
  copy_error(why, err, errlen);
  return why.empty() ? 0 : -1;
}

// The kernel emulated on host memory (tests): validate, plan, pack, emulate. Returns rows rescued, or -1.
int64_t lsm_emulate(void* logits, int64_t nrows, int32_t ncols, int64_t row_stride, int32_t dtype,
                    const uint32_t* bitmask, int32_t words, int32_t mask_capacity, const int32_t* logit_rows,
                    const int32_t* mask_rows, int64_t n, int32_t sm_count, char* err, size_t errlen) {
  lsm::Args a{nrows, ncols, row_stride, dtype, words, mask_capacity, n, logit_rows, mask_rows};
  const std::string why = lsm::validate(a);
  copy_error(why, err, errlen);
  if (!why.empty()) return -1;
  const lsm::Plan p = lsm::plan(n, ncols, sm_count);
  std::vector<uint64_t> staging(static_cast<size_t>((p.staging_bytes + 7) / 8));
  lsm::pack(p, bitmask, words, logit_rows, mask_rows, n, staging.data());
  return lsm::emulate(p, logits, row_stride, dtype, ncols, staging.data(), n);
}

// ---- the device path -------------------------------------------------------------------------------------------------
void* lsm_create(int device, char* err, size_t errlen) {
  auto* h = new Handle();
  h->device = device;
  int count = 0;
  if (!ok(h, cudaGetDeviceCount(&count), "cudaGetDeviceCount") ||
      (count <= device && ((h->error = "device " + std::to_string(device) + " of " + std::to_string(count)), true))) {
    copy_error(h->error, err, errlen);
    delete h;
    return nullptr;
  }
  DeviceGuard guard(device);
  bool good = ok(h, cudaDeviceGetAttribute(&h->sm_count, cudaDevAttrMultiProcessorCount, device), "sm count") &&
              ok(h, cudaEventCreateWithFlags(&h->done[0], cudaEventDisableTiming), "cudaEventCreate") &&
              ok(h, cudaEventCreateWithFlags(&h->done[1], cudaEventDisableTiming), "cudaEventCreate") &&
              ok(h, cudaMalloc(&h->rescued, sizeof(unsigned long long)), "cudaMalloc(rescued)") &&
              ok(h, cudaMemset(h->rescued, 0, sizeof(unsigned long long)), "cudaMemset(rescued)");
  if (!good) {
    copy_error(h->error, err, errlen);
    delete h;  // the few allocations leak on this failure path only
    return nullptr;
  }
  return h;
}

void lsm_destroy(void* handle) {
  auto* h = static_cast<Handle*>(handle);
  if (h == nullptr) return;
  DeviceGuard guard(h->device);
  wait_all(h);
  for (int k = 0; k < 2; ++k) {
    cudaFreeHost(h->host[k]);
    cudaFree(h->dev[k]);
    if (h->done[k]) cudaEventDestroy(h->done[k]);
  }
  cudaFree(h->flags);
  cudaFree(h->tickets);
  cudaFree(h->rescued);
  delete h;
}

const char* lsm_error(void* handle) { return static_cast<Handle*>(handle)->error.c_str(); }
int lsm_sm_count(void* handle) { return static_cast<Handle*>(handle)->sm_count; }

// Queue the masking of n rows on `stream` (a cudaStream_t; 0 the legacy default stream). Returns 0, or -1 with
// lsm_error set; nothing is queued when the arguments are invalid.
int lsm_apply(void* handle, void* logits, int64_t nrows, int32_t ncols, int64_t row_stride, int32_t dtype,
              const uint32_t* bitmask, int32_t words, int32_t mask_capacity, const int32_t* logit_rows,
              const int32_t* mask_rows, int64_t n, uintptr_t stream_handle) {
  auto* h = static_cast<Handle*>(handle);
  lsm::Args a{nrows, ncols, row_stride, dtype, words, mask_capacity, n, logit_rows, mask_rows};
  h->error = lsm::validate(a);
  if (!h->error.empty()) return -1;
  if (logits == nullptr) {
    h->error = "logits: null";
    return -1;
  }
  if (n == 0) return 0;
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(h->device);
  const lsm::Plan p = lsm::plan(n, ncols, h->sm_count);
  // The flags and tickets are shared by every launch: a launch on another stream waits for the previous one.
  if (h->launched && stream != h->last_stream) {
    const int prev = 1 - h->next;
    if (!ok(h, cudaStreamWaitEvent(stream, h->done[prev], 0), "cudaStreamWaitEvent")) return -1;
  }
  if (!ensure_workspace(h, n, stream)) return -1;
  const int k = h->next;
  if (h->used[k] && !ok(h, cudaEventSynchronize(h->done[k]), "cudaEventSynchronize")) return -1;
  if (!ensure_staging(h, k, static_cast<size_t>(p.staging_bytes))) return -1;
  lsm::pack(p, bitmask, words, logit_rows, mask_rows, n, h->host[k]);
  if (!ok(h, cudaMemcpyAsync(h->dev[k], h->host[k], static_cast<size_t>(p.staging_bytes), cudaMemcpyHostToDevice,
                             stream),
          "cudaMemcpyAsync"))
    return -1;
  switch (dtype) {
    case lsm::kFloat32:
      launch<uint32_t, lsm::kNegInfF32>(p, logits, row_stride, ncols, h->dev[k], h, stream);
      break;
    case lsm::kBFloat16:
      launch<uint16_t, lsm::kNegInfBF16>(p, logits, row_stride, ncols, h->dev[k], h, stream);
      break;
    default:
      launch<uint16_t, lsm::kNegInfF16>(p, logits, row_stride, ncols, h->dev[k], h, stream);
      break;
  }
  if (!ok(h, cudaGetLastError(), "mask_kernel launch")) return -1;
  if (!ok(h, cudaEventRecord(h->done[k], stream), "cudaEventRecord")) return -1;
  h->used[k] = true;
  h->next = 1 - k;
  h->last_stream = stream;
  h->launched = true;
  return 0;
}

// Rows rescued since the handle was created. Waits for the launches queued so far (diagnostics, not per step).
int64_t lsm_rescued(void* handle) {
  auto* h = static_cast<Handle*>(handle);
  DeviceGuard guard(h->device);
  if (!wait_all(h)) return -1;
  unsigned long long v = 0;
  if (!ok(h, cudaMemcpy(&v, h->rescued, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy(rescued)")) return -1;
  return static_cast<int64_t>(v);
}

}  // extern "C"
