// A double of libtritonserver for the native drivers (response_path_driver.cpp, kserve_grpc_driver.cpp): every
// request is answered on a backend thread of its own (g_responses responses, then a final one; CANCELLED once
// cancelled), its release callback comes before, between or after the responses, each response's output buffer
// comes from the path's allocator and goes back to it when the response is deleted. A request for the model
// "missing" is refused (NOT_FOUND), and the model "decoupled" says so in its transaction properties.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "response_path.hpp"

namespace fake {

[[noreturn]] inline void die(const std::string& why) {
  std::fprintf(stderr, "driver: %s\n", why.c_str());
  std::abort();
}


struct FakeError {
  int code;
  std::string message;
};

struct FakeRequest {
  std::string id;
  std::vector<rp::Input> inputs;
  rp::RequestReleaseFn release_fn = nullptr;
  void* release_userp = nullptr;
  rp::ResponseCompleteFn response_fn = nullptr;
  void* response_userp = nullptr;
  std::atomic<bool> cancelled{false};
  std::atomic<bool> released{false};
  std::atomic<bool> final_sent{false};
  std::atomic<int> deletes{0};
};

struct FakeResponse {
  FakeError* error = nullptr;
  std::string name = "text_output";
  std::vector<int64_t> shape{1};
  void* buffer = nullptr;
  size_t size = 0;
};

inline rp::AllocFn g_alloc = nullptr;
inline rp::ReleaseBufferFn g_release = nullptr;
inline std::atomic<long> g_buffers{0};
inline int g_responses = 3;
inline std::mutex g_requests_mu;
inline std::vector<FakeRequest*> g_requests;
inline std::vector<std::thread> g_backend;
inline std::mutex g_backend_mu;

inline rp::Error* err(int code, const char* message) { return new FakeError{code, message}; }

inline void serve(FakeRequest* request, unsigned seed) {
  std::mt19937 rng(seed);
  const int release_at = static_cast<int>(rng() % (g_responses + 2));  // before response i, or after the last
  auto release = [&] {
    request->released = true;
    request->release_fn(request, rp::kReleaseAll, request->release_userp);
  };
  for (int i = 0; i <= g_responses; ++i) {
    if (i == release_at) release();
    if (rng() % 4 == 0) std::this_thread::yield();
    const bool last = i == g_responses || request->cancelled.load();
    auto* response = new FakeResponse();
    if (request->cancelled.load()) {
      response->error = new FakeError{7, "Request was cancelled"};
    } else {
      // The text of response i: "<request id>:<i>", in a BYTES element the path's allocator provides.
      std::string text = request->id + ":" + std::to_string(i);
      uint32_t length = static_cast<uint32_t>(text.size());
      void* buffer_userp = nullptr;
      int actual = 0;
      int64_t actual_id = 0;
      rp::Error* failed = g_alloc(nullptr, "text_output", 4 + text.size(), rp::kMemoryCpu, 0, nullptr,
                                  &response->buffer, &buffer_userp, &actual, &actual_id);
      if (failed != nullptr) die("allocation failed");
      ++g_buffers;
      std::memcpy(response->buffer, &length, 4);
      std::memcpy(static_cast<char*>(response->buffer) + 4, text.data(), text.size());
      response->size = 4 + text.size();
    }
    if (last) request->final_sent = true;
    request->response_fn(response, last ? rp::kResponseFinal : 0, request->response_userp);
    if (last) {
      if (i < release_at) release();
      return;
    }
  }
}

inline rp::Api fake_api() {
  rp::Api api{};
  api.ErrorNew = [](int code, const char* message) -> rp::Error* { return err(code, message); };
  api.ErrorDelete = [](rp::Error* e) { delete static_cast<FakeError*>(e); };
  api.ErrorCode = [](rp::Error* e) { return static_cast<FakeError*>(e)->code; };
  api.ErrorMessage = [](rp::Error* e) { return static_cast<FakeError*>(e)->message.c_str(); };
  api.ResponseAllocatorNew = [](void** allocator, rp::AllocFn alloc, rp::ReleaseBufferFn release,
                                void*) -> rp::Error* {
    g_alloc = alloc;
    g_release = release;
    *allocator = reinterpret_cast<void*>(0x1);
    return nullptr;
  };
  api.ResponseAllocatorDelete = [](void*) -> rp::Error* { return nullptr; };
  api.InferenceRequestNew = [](void** request, void*, const char* model, int64_t) -> rp::Error* {
    if (std::string(model) == "missing") return err(2, "Request for unknown model: 'missing' is not found");
    auto* r = new FakeRequest();
    std::lock_guard<std::mutex> lock(g_requests_mu);
    g_requests.push_back(r);
    *request = r;
    return nullptr;
  };
  api.InferenceRequestDelete = [](void* request) -> rp::Error* {
    auto* r = static_cast<FakeRequest*>(request);
    if (r->deletes.fetch_add(1) != 0) die("request " + r->id + " deleted twice");
    return nullptr;
  };
  api.InferenceRequestSetId = [](void* request, const char* id) -> rp::Error* {
    static_cast<FakeRequest*>(request)->id = id;
    return nullptr;
  };
  api.InferenceRequestAddInput = [](void*, const char*, int, const int64_t*, uint64_t) -> rp::Error* {
    return nullptr;
  };
  api.InferenceRequestAppendInputData = [](void*, const char*, const void* base, size_t size, int,
                                           int64_t) -> rp::Error* {
    volatile char sink = 0;  // the backend reads its inputs: the buffer must be valid
    for (size_t i = 0; i < size; ++i) sink = sink ^ static_cast<const char*>(base)[i];
    (void)sink;
    return nullptr;
  };
  api.InferenceRequestAddRequestedOutput = [](void*, const char*) -> rp::Error* { return nullptr; };
  api.InferenceRequestSetStringParameter = [](void*, const char*, const char*) -> rp::Error* { return nullptr; };
  api.InferenceRequestSetIntParameter = [](void*, const char*, int64_t) -> rp::Error* { return nullptr; };
  api.InferenceRequestSetBoolParameter = [](void*, const char*, bool) -> rp::Error* { return nullptr; };
  api.InferenceRequestSetDoubleParameter = [](void*, const char*, double) -> rp::Error* { return nullptr; };
  api.InferenceRequestSetReleaseCallback = [](void* request, rp::RequestReleaseFn fn, void* userp) -> rp::Error* {
    auto* r = static_cast<FakeRequest*>(request);
    r->release_fn = fn;
    r->release_userp = userp;
    return nullptr;
  };
  api.InferenceRequestSetResponseCallback = [](void* request, void*, void*, rp::ResponseCompleteFn fn,
                                               void* userp) -> rp::Error* {
    auto* r = static_cast<FakeRequest*>(request);
    r->response_fn = fn;
    r->response_userp = userp;
    return nullptr;
  };
  api.InferenceRequestCancel = [](void* request) -> rp::Error* {
    auto* r = static_cast<FakeRequest*>(request);
    if (r->deletes.load() != 0) die("cancel on a deleted request " + r->id);
    r->cancelled = true;
    return nullptr;
  };
  api.ServerInferAsync = [](void*, void* request, void*) -> rp::Error* {
    auto* r = static_cast<FakeRequest*>(request);
    std::lock_guard<std::mutex> lock(g_backend_mu);
    g_backend.emplace_back(serve, r, static_cast<unsigned>(std::hash<std::string>{}(r->id)));
    return nullptr;
  };
  api.InferenceResponseDelete = [](void* response) -> rp::Error* {
    auto* r = static_cast<FakeResponse*>(response);
    if (r->buffer != nullptr) {
      g_release(nullptr, r->buffer, nullptr, r->size, rp::kMemoryCpu, 0);
      --g_buffers;
    }
    delete r->error;
    delete r;
    return nullptr;
  };
  api.InferenceResponseError = [](void* response) -> rp::Error* { return static_cast<FakeResponse*>(response)->error; };
  api.InferenceResponseOutputCount = [](void* response, uint32_t* count) -> rp::Error* {
    *count = static_cast<FakeResponse*>(response)->buffer != nullptr ? 1 : 0;
    return nullptr;
  };
  api.InferenceResponseOutput = [](void* response, uint32_t, const char** name, int* datatype, const int64_t** shape,
                                   uint64_t* dims, const void** base, size_t* size, int* memory_type,
                                   int64_t* memory_type_id, void** userp) -> rp::Error* {
    auto* r = static_cast<FakeResponse*>(response);
    *name = r->name.c_str();
    *datatype = rp::kBytes;
    *shape = r->shape.data();
    *dims = r->shape.size();
    *base = r->buffer;
    *size = r->size;
    *memory_type = rp::kMemoryCpu;
    *memory_type_id = 0;
    *userp = nullptr;
    return nullptr;
  };
  api.InferenceResponseParameterCount = [](void*, uint32_t* count) -> rp::Error* {
    *count = 0;
    return nullptr;
  };
  api.InferenceResponseParameter = [](void*, uint32_t, const char**, int*, const void**) -> rp::Error* {
    return err(1, "no parameters");
  };
  api.ServerModelTransactionProperties = [](void*, const char* model, int64_t, uint32_t* flags,
                                            void**) -> rp::Error* {
    if (std::string(model) == "missing") return err(2, "Request for unknown model: 'missing' is not found");
    *flags = std::string(model) == "decoupled" ? 2 : 1;  // TRITONSERVER_TXN_DECOUPLED : ONE_TO_ONE
    return nullptr;
  };
  return api;
}

}  // namespace fake
