// The embedded Triton's response path in C++ (serving_image/triton/capi/inference.py is its Python side): Triton's
// response allocator, response-complete and request-release callbacks, so that no Python runs on Triton's threads.
//
// What a callback does: copy the response's outputs (name, datatype, shape, bytes), error and parameters into a
// Record, delete the response, and push the Record into a bounded queue; the first Record pushed into an empty queue
// writes the queue's eventfd, which the asyncio loop watches (one wake-up per burst). `drain` takes every waiting
// Record at once. The request is deleted here once Triton released it AND its final response arrived, never before
// (a decoupled backend may release a request and go on responding; cancel needs the request until its last
// response); its input buffers live as long as it does.
//
// The C API is declared from its documented ABI (tritonserver.h, API 1.x: every object an opaque pointer, every
// enum a C int, NULL error = success) and resolved by name at run time (`Api`), so this file builds without the
// header (the local wheel ships the library, not the header) and a test can substitute a double of the library.
//
// Threads: `on_response` / `on_release` run on Triton's threads; `submit`, `cancel`, `drain`, `close` on the
// caller's (Python's, with the GIL released around every call into Triton). One mutex guards the queue and the
// table of requests; each request has its own mutex for its flags and its Triton object. `push` blocks while the
// queue is full (backpressure on Triton's response thread, and through it on the backend), until `drain` or
// `close`; after `close` Records are dropped (nobody reads them) but requests are still deleted.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace rp {

using Error = void;  // TRITONSERVER_Error
using AllocFn = Error* (*)(void* allocator, const char* tensor_name, size_t byte_size, int memory_type,
                           int64_t memory_type_id, void* userp, void** buffer, void** buffer_userp,
                           int* actual_memory_type, int64_t* actual_memory_type_id);
using ReleaseBufferFn = Error* (*)(void* allocator, void* buffer, void* buffer_userp, size_t byte_size,
                                   int memory_type, int64_t memory_type_id);
using RequestReleaseFn = void (*)(void* request, uint32_t flags, void* userp);
using ResponseCompleteFn = void (*)(void* response, uint32_t flags, void* userp);

constexpr uint32_t kResponseFinal = 1;  // TRITONSERVER_RESPONSE_COMPLETE_FINAL
constexpr uint32_t kReleaseAll = 1;     // TRITONSERVER_REQUEST_RELEASE_ALL
constexpr int kMemoryCpu = 0;           // TRITONSERVER_MEMORY_CPU
constexpr int kBytes = 13;              // TRITONSERVER_TYPE_BYTES
constexpr int kInternal = 1;            // TRITONSERVER_ERROR_INTERNAL
// TRITONSERVER_ParameterType
constexpr int kParamString = 0, kParamInt = 1, kParamBool = 2, kParamDouble = 3;

// The C API functions this path calls.
struct Api {
  Error* (*ErrorNew)(int code, const char* message);
  void (*ErrorDelete)(Error*);
  int (*ErrorCode)(Error*);
  const char* (*ErrorMessage)(Error*);
  Error* (*ResponseAllocatorNew)(void** allocator, AllocFn, ReleaseBufferFn, void* start_fn);
  Error* (*ResponseAllocatorDelete)(void* allocator);
  Error* (*InferenceRequestNew)(void** request, void* server, const char* model, int64_t version);
  Error* (*InferenceRequestDelete)(void* request);
  Error* (*InferenceRequestSetId)(void* request, const char* id);
  Error* (*InferenceRequestAddInput)(void* request, const char* name, int datatype, const int64_t* shape,
                                     uint64_t dims);
  Error* (*InferenceRequestAppendInputData)(void* request, const char* name, const void* base, size_t size,
                                            int memory_type, int64_t memory_type_id);
  Error* (*InferenceRequestAddRequestedOutput)(void* request, const char* name);
  Error* (*InferenceRequestSetStringParameter)(void* request, const char* key, const char* value);
  Error* (*InferenceRequestSetIntParameter)(void* request, const char* key, int64_t value);
  Error* (*InferenceRequestSetBoolParameter)(void* request, const char* key, bool value);
  Error* (*InferenceRequestSetDoubleParameter)(void* request, const char* key, double value);
  Error* (*InferenceRequestSetReleaseCallback)(void* request, RequestReleaseFn, void* userp);
  Error* (*InferenceRequestSetResponseCallback)(void* request, void* allocator, void* allocator_userp,
                                                ResponseCompleteFn, void* userp);
  Error* (*InferenceRequestCancel)(void* request);
  Error* (*ServerInferAsync)(void* server, void* request, void* trace);
  Error* (*InferenceResponseDelete)(void* response);
  Error* (*InferenceResponseError)(void* response);
  Error* (*InferenceResponseOutputCount)(void* response, uint32_t* count);
  Error* (*InferenceResponseOutput)(void* response, uint32_t index, const char** name, int* datatype,
                                    const int64_t** shape, uint64_t* dims, const void** base, size_t* size,
                                    int* memory_type, int64_t* memory_type_id, void** userp);
  Error* (*InferenceResponseParameterCount)(void* response, uint32_t* count);
  Error* (*InferenceResponseParameter)(void* response, uint32_t index, const char** name, int* kind,
                                       const void** value);
  // Not called by the response path itself: the C++ KServe front-end's decoupled check (kserve_grpc.hpp).
  Error* (*ServerModelTransactionProperties)(void* server, const char* model, int64_t version, uint32_t* txn_flags,
                                             void** voidp);
};

// A TRITONSERVER_Error raised where the caller gets it (submit): Triton's code and message.
struct CallError : std::runtime_error {
  int code;
  CallError(int code_, const std::string& message) : std::runtime_error(message), code(code_) {}
};

struct Input {
  std::string name;
  int datatype;
  std::vector<int64_t> shape;
  std::string data;
};

struct Parameter {
  std::string name;
  int kind;  // kParam*
  std::string text;
  int64_t integer = 0;
  bool flag = false;
  double number = 0.0;
};

struct Output {
  std::string name;
  int datatype;
  std::vector<int64_t> shape;
  std::string data;  // Triton's layout (BYTES: 4-byte little-endian length, then the bytes, per element)
};

struct Record {
  uint64_t key = 0;
  bool released = false;  // a release notice, not a response
  bool final = false;
  bool empty = false;     // the final flag arrived without a response object
  int error_code = -1;    // -1: no error
  std::string error_message;
  std::vector<Output> outputs;
  std::vector<Parameter> parameters;
};

class Queue;

struct RequestState {
  Queue* queue = nullptr;
  uint64_t key = 0;
  void* request = nullptr;
  std::vector<Input> inputs;  // names and buffers Triton reads until it releases the request
  std::vector<std::string> outputs;
  std::mutex mu;
  bool released = false, final = false, deleted = false;
};

class Queue {
 public:
  Queue(const Api& api, size_t capacity);
  ~Queue();
  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  int fd() const { return fd_; }
  // Send one request; its key names its Records. Throws CallError when Triton refuses it (nothing was sent).
  uint64_t submit(void* server, const std::string& model, int64_t version, const std::string& id,
                  std::vector<Input> inputs, std::vector<std::string> outputs, std::vector<Parameter> parameters);
  // Ask Triton to cancel the request; false when it already finished. Throws CallError when Triton refuses.
  bool cancel(uint64_t key);
  // Every waiting Record (at most `max`), oldest first; clears the eventfd when the queue is left empty.
  std::vector<Record> drain(size_t max);
  size_t in_flight();  // requests not yet both released and finished
  size_t waiting();    // Records not yet drained
  void close();        // stop delivering (the loop is gone): Records are dropped from now on

  static void on_response(void* response, uint32_t flags, void* userp);
  static void on_release(void* request, uint32_t flags, void* userp);

 private:
  void push(Record record);
  void finish(RequestState* state, bool released, bool final);
  void check(Error* error);

  const Api& api_;
  const size_t capacity_;
  int fd_ = -1;
  void* allocator_ = nullptr;
  std::mutex mu_;
  std::condition_variable not_full_;
  std::vector<Record> records_;
  bool notified_ = false;
  bool closed_ = false;
  uint64_t next_key_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<RequestState>> requests_;
};

}  // namespace rp
