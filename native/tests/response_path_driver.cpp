// Stress driver for the response path (native/triton/response_path.cpp), built by
// tests/native/test_response_path_sanitizers.py with AddressSanitizer + UndefinedBehaviorSanitizer and, separately,
// ThreadSanitizer. A double of libtritonserver plays Triton: every request is answered on backend threads of its own
// (several responses, then a final one; CANCELLED once cancelled), its release callback comes before, between or
// after the responses, each response's output buffer comes from the path's allocator and goes back to it when the
// response is deleted. The driver submits requests, drains the queue on a consumer thread (a small capacity, so
// Triton's threads wait for it: backpressure), cancels some, and checks what arrived: per request, its responses in
// order, exactly one final, the text each carried; at the end every request deleted exactly once, after its release
// and its final response, nothing in flight, no buffer leaked. Any violation aborts with a message; "ok" otherwise.
//
// Usage: response_path_driver REQUESTS RESPONSES_PER_REQUEST CAPACITY SEED
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <poll.h>

#include "response_path.hpp"

namespace {

[[noreturn]] void die(const std::string& why) {
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

rp::AllocFn g_alloc = nullptr;
rp::ReleaseBufferFn g_release = nullptr;
std::atomic<long> g_buffers{0};
int g_responses = 3;
std::mutex g_requests_mu;
std::vector<FakeRequest*> g_requests;
std::vector<std::thread> g_backend;
std::mutex g_backend_mu;

rp::Error* err(int code, const char* message) { return new FakeError{code, message}; }

void serve(FakeRequest* request, unsigned seed) {
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

rp::Api fake_api() {
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
  return api;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) die("usage: response_path_driver REQUESTS RESPONSES CAPACITY SEED");
  const int requests = std::atoi(argv[1]);
  g_responses = std::atoi(argv[2]);
  const size_t capacity = static_cast<size_t>(std::atoi(argv[3]));
  std::mt19937 rng(static_cast<unsigned>(std::atoi(argv[4])));
  static rp::Api api = fake_api();
  rp::Queue queue(api, capacity);

  try {  // a refused request is reported where it was sent, and nothing of it stays in flight
    queue.submit(nullptr, "missing", -1, "x", {}, {}, {});
    die("a request for a missing model was accepted");
  } catch (const rp::CallError& e) {
    if (e.code != 2 || std::string(e.what()).find("missing") == std::string::npos) die("wrong refusal");
  }

  struct Seen {
    int responses = 0;
    int finals = 0;
    bool released = false;
    bool cancelled = false;
    bool error = false;
  };
  std::unordered_map<uint64_t, Seen> seen;
  std::unordered_map<uint64_t, std::string> ids;
  std::mutex seen_mu;
  std::atomic<int> finished{0};
  std::atomic<int> releases{0};
  std::atomic<bool> stop{false};

  // Drains until every request's final response and its release were read: a release can come after the last
  // final, and with a full queue (capacity 1) the backend thread that holds it waits for room, so a consumer that
  // stopped at the last final left it waiting forever while main joined it (a hang about 1 run in 6).
  std::thread consumer([&, drain_rng = std::mt19937(rng())]() mutable {
    while (finished.load() < requests || releases.load() < requests) {
      pollfd p{queue.fd(), POLLIN, 0};
      ::poll(&p, 1, 50);  // the eventfd wakes the consumer once per burst
      std::vector<rp::Record> records = queue.drain(1 + drain_rng() % 7);
      std::lock_guard<std::mutex> lock(seen_mu);
      for (const rp::Record& r : records) {
        Seen& s = seen[r.key];
        if (r.released) {
          if (s.released) die("released twice");
          s.released = true;
          ++releases;
          continue;
        }
        if (s.finals != 0) die("a response after the final one");
        if (r.error_code == 7) {
          s.error = true;
        } else {
          if (r.error_code != -1 || r.outputs.size() != 1) die("a response without its output");
          const std::string& data = r.outputs[0].data;
          std::string expect = ids[r.key] + ":" + std::to_string(s.responses);
          if (data.size() != 4 + expect.size() || data.compare(4, std::string::npos, expect) != 0) {
            die("response " + std::to_string(s.responses) + " of " + ids[r.key] + " carried the wrong text");
          }
        }
        ++s.responses;
        if (r.final) {
          ++s.finals;
          ++finished;
        }
      }
    }
  });

  std::vector<uint64_t> keys;
  for (int i = 0; i < requests; ++i) {
    std::string id = "r" + std::to_string(i);
    std::vector<rp::Input> inputs{{"text_input", rp::kBytes, {1}, std::string(4, '\0') + id}};
    uint64_t key;
    {
      std::lock_guard<std::mutex> lock(seen_mu);  // the id is known before any record of it can be read
      key = queue.submit(nullptr, "model", -1, id, inputs, {"text_output"}, {});
      ids[key] = id;
    }
    keys.push_back(key);
    if (rng() % 3 == 0) {  // cancel an earlier request, in flight or finished
      uint64_t victim = keys[rng() % keys.size()];
      bool cancelled = queue.cancel(victim);
      std::lock_guard<std::mutex> lock(seen_mu);
      seen[victim].cancelled = seen[victim].cancelled || cancelled;
    }
  }
  consumer.join();
  stop = true;
  {
    std::lock_guard<std::mutex> lock(g_backend_mu);
    for (std::thread& t : g_backend) t.join();
  }
  for (const rp::Record& r : queue.drain(1 << 30)) {  // the releases that came after the last final
    if (!r.released) die("a response after every final one");
    seen[r.key].released = true;
  }
  for (uint64_t key : keys) {
    const Seen& s = seen[key];
    if (s.finals != 1) die("request " + ids[key] + ": " + std::to_string(s.finals) + " final responses");
    if (!s.released) die("request " + ids[key] + " never released");
    if (!s.error && s.responses != g_responses + 1) die("request " + ids[key] + " lost responses");
  }
  for (FakeRequest* r : g_requests) {
    if (r->deletes.load() != 1) die("request " + r->id + " deleted " + std::to_string(r->deletes.load()) + " times");
    if (!r->released || !r->final_sent) die("request " + r->id + " deleted before its release and final response");
    delete r;
  }
  if (queue.in_flight() != 0) die("requests left in flight");
  if (g_buffers.load() != 0) die("output buffers leaked");
  std::printf("ok %d requests\n", requests);
  return 0;
}
