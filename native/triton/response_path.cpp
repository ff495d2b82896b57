// The response path's core (see response_path.hpp): no Python here, so the sanitizer driver builds it alone.
#include "response_path.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace rp {

namespace {

// The process-wide allocator's functions: host memory from malloc, freed when Triton releases the buffer.
const Api* g_alloc_api = nullptr;

Error* alloc_fn(void*, const char*, size_t byte_size, int, int64_t, void*, void** buffer, void** buffer_userp,
                int* actual_memory_type, int64_t* actual_memory_type_id) {
  *buffer_userp = nullptr;
  *actual_memory_type = kMemoryCpu;
  *actual_memory_type_id = 0;
  if (byte_size == 0) {
    *buffer = nullptr;
    return nullptr;
  }
  *buffer = std::malloc(byte_size);
  if (*buffer == nullptr) {
    return g_alloc_api->ErrorNew(kInternal, ("out of memory for " + std::to_string(byte_size) + " bytes").c_str());
  }
  return nullptr;
}

Error* release_fn(void*, void* buffer, void*, size_t, int, int64_t) {
  std::free(buffer);
  return nullptr;
}

std::string message_of(const Api& api, Error* error) {
  const char* text = api.ErrorMessage(error);
  return text ? std::string(text) : std::string();
}

}  // namespace

Queue::Queue(const Api& api, size_t capacity) : api_(api), capacity_(capacity ? capacity : 1) {
  fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  g_alloc_api = &api_;
  Error* error = api_.ResponseAllocatorNew(&allocator_, alloc_fn, release_fn, nullptr);
  if (error != nullptr) {
    ::close(fd_);
    std::string message = message_of(api_, error);
    int code = api_.ErrorCode(error);
    api_.ErrorDelete(error);
    throw CallError(code, message);
  }
}

Queue::~Queue() {
  close();
  if (allocator_ != nullptr) {
    Error* error = api_.ResponseAllocatorDelete(allocator_);
    if (error != nullptr) api_.ErrorDelete(error);
  }
  if (fd_ >= 0) ::close(fd_);
}

void Queue::check(Error* error) {
  if (error == nullptr) return;
  std::string message = message_of(api_, error);
  int code = api_.ErrorCode(error);
  api_.ErrorDelete(error);
  throw CallError(code, message);
}

uint64_t Queue::submit(void* server, const std::string& model, int64_t version, const std::string& id,
                       std::vector<Input> inputs, std::vector<std::string> outputs,
                       std::vector<Parameter> parameters) {
  auto state = std::make_shared<RequestState>();
  state->queue = this;
  state->inputs = std::move(inputs);
  state->outputs = std::move(outputs);
  void* request = nullptr;
  check(api_.InferenceRequestNew(&request, server, model.c_str(), version));
  state->request = request;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      api_.InferenceRequestDelete(request);
      throw CallError(kInternal, "the response queue is closed");
    }
    state->key = next_key_++;
    requests_[state->key] = state;
  }
  try {
    if (!id.empty()) check(api_.InferenceRequestSetId(request, id.c_str()));
    for (const Input& input : state->inputs) {
      check(api_.InferenceRequestAddInput(request, input.name.c_str(), input.datatype, input.shape.data(),
                                          input.shape.size()));
      check(api_.InferenceRequestAppendInputData(request, input.name.c_str(), input.data.data(), input.data.size(),
                                                 kMemoryCpu, 0));
    }
    for (const std::string& output : state->outputs) {
      check(api_.InferenceRequestAddRequestedOutput(request, output.c_str()));
    }
    for (const Parameter& p : parameters) {
      switch (p.kind) {
        case kParamString: check(api_.InferenceRequestSetStringParameter(request, p.name.c_str(), p.text.c_str()));
          break;
        case kParamInt: check(api_.InferenceRequestSetIntParameter(request, p.name.c_str(), p.integer)); break;
        case kParamBool: check(api_.InferenceRequestSetBoolParameter(request, p.name.c_str(), p.flag)); break;
        case kParamDouble: check(api_.InferenceRequestSetDoubleParameter(request, p.name.c_str(), p.number));
          break;
        default: throw CallError(kInternal, "parameter '" + p.name + "': unknown kind");
      }
    }
    check(api_.InferenceRequestSetReleaseCallback(request, &Queue::on_release, state.get()));
    check(api_.InferenceRequestSetResponseCallback(request, allocator_, nullptr, &Queue::on_response,
                                                   state.get()));
    check(api_.ServerInferAsync(server, request, nullptr));
  } catch (...) {
    api_.InferenceRequestDelete(request);  // not taken by Triton: still ours
    std::lock_guard<std::mutex> lock(mu_);
    requests_.erase(state->key);
    throw;
  }
  return state->key;
}

bool Queue::cancel(uint64_t key) {
  std::shared_ptr<RequestState> state;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = requests_.find(key);
    if (found == requests_.end()) return false;
    state = found->second;  // kept alive while cancelling, even if it finishes meanwhile
  }
  std::lock_guard<std::mutex> lock(state->mu);
  if (state->deleted || state->final) return false;
  check(api_.InferenceRequestCancel(state->request));
  return true;
}

void Queue::push(Record record) {
  bool wake = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    not_full_.wait(lock, [this] { return closed_ || records_.size() < capacity_; });
    if (closed_) return;
    records_.push_back(std::move(record));
    if (!notified_) {
      notified_ = true;
      wake = true;
    }
  }
  if (wake) {
    uint64_t one = 1;
    // A full eventfd counter (never reached: it is read on every drain) is the only failure, and leaves it readable.
    ssize_t written = ::write(fd_, &one, sizeof one);
    (void)written;
  }
}

std::vector<Record> Queue::drain(size_t max) {
  std::vector<Record> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (records_.size() <= max) {
      out.swap(records_);
    } else {
      out.assign(std::make_move_iterator(records_.begin()), std::make_move_iterator(records_.begin() + max));
      records_.erase(records_.begin(), records_.begin() + max);
    }
    if (records_.empty()) {
      notified_ = false;
      uint64_t value;
      ssize_t got = ::read(fd_, &value, sizeof value);  // EAGAIN when already clear
      (void)got;
    }
  }
  not_full_.notify_all();
  return out;
}

size_t Queue::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return requests_.size();
}

size_t Queue::waiting() {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.size();
}

void Queue::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    records_.clear();
  }
  not_full_.notify_all();
}

void Queue::finish(RequestState* state, bool released, bool final) {
  // Under the request's mutex: delete the Triton request once it is both released and finished. After this
  // function nothing touches `state`: the table's reference may be the last.
  const uint64_t key = state->key;
  bool erase = false;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->released = state->released || released;
    state->final = state->final || final;
    if (state->released && state->final && !state->deleted) {
      state->deleted = true;
      Error* error = api_.InferenceRequestDelete(state->request);
      if (error != nullptr) api_.ErrorDelete(error);
      erase = true;
    }
  }
  if (erase) {
    std::shared_ptr<RequestState> last;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto found = requests_.find(key);
    if (found != requests_.end()) {
      last = std::move(found->second);
      requests_.erase(found);
    }
  }
}

void Queue::on_release(void*, uint32_t flags, void* userp) {
  auto* state = static_cast<RequestState*>(userp);
  if (state == nullptr || !(flags & kReleaseAll)) return;
  Queue* queue = state->queue;
  Record record;
  record.key = state->key;
  record.released = true;
  queue->finish(state, true, false);  // after it `state` may be gone: only `queue` and `record` are used
  queue->push(std::move(record));
}

void Queue::on_response(void* response, uint32_t flags, void* userp) {
  auto* state = static_cast<RequestState*>(userp);
  Queue* queue = state->queue;
  const Api& api = queue->api_;
  Record record;
  record.key = state->key;
  record.final = (flags & kResponseFinal) != 0;
  if (response == nullptr) {
    record.empty = true;
  } else {
    Error* error = api.InferenceResponseError(response);  // owned by the response
    if (error != nullptr) {
      record.error_code = api.ErrorCode(error);
      record.error_message = message_of(api, error);
    }
    uint32_t count = 0;
    Error* failed = api.InferenceResponseParameterCount(response, &count);
    for (uint32_t i = 0; failed == nullptr && i < count; ++i) {
      const char* name = nullptr;
      int kind = 0;
      const void* value = nullptr;
      failed = api.InferenceResponseParameter(response, i, &name, &kind, &value);
      if (failed != nullptr) break;
      Parameter p;
      p.name = name ? name : "";
      p.kind = kind;
      if (kind == kParamString) p.text = value ? static_cast<const char*>(value) : "";
      else if (kind == kParamInt) p.integer = *static_cast<const int64_t*>(value);
      else if (kind == kParamBool) p.flag = *static_cast<const bool*>(value);
      else if (kind == kParamDouble) p.number = *static_cast<const double*>(value);
      else continue;  // TRITONSERVER_PARAMETER_BYTES: never sent on a response by the backends served here
      record.parameters.push_back(std::move(p));
    }
    if (failed == nullptr) failed = api.InferenceResponseOutputCount(response, &count);
    for (uint32_t i = 0; failed == nullptr && i < count; ++i) {
      const char* name = nullptr;
      const int64_t* shape = nullptr;
      uint64_t dims = 0;
      const void* base = nullptr;
      size_t size = 0;
      int datatype = 0, memory_type = 0;
      int64_t memory_type_id = 0;
      void* buffer_userp = nullptr;
      failed = api.InferenceResponseOutput(response, i, &name, &datatype, &shape, &dims, &base, &size, &memory_type,
                                           &memory_type_id, &buffer_userp);
      if (failed != nullptr) break;
      Output out;
      out.name = name ? name : "";
      out.datatype = datatype;
      out.shape.assign(shape, shape + dims);
      if (size) out.data.assign(static_cast<const char*>(base), size);
      record.outputs.push_back(std::move(out));
    }
    if (failed != nullptr) {  // a response this path cannot read: an error response for the caller
      record.outputs.clear();
      record.error_code = kInternal;
      record.error_message = "reading a response failed: " + message_of(api, failed);
      api.ErrorDelete(failed);
    }
    Error* deleted = api.InferenceResponseDelete(response);
    if (deleted != nullptr) api.ErrorDelete(deleted);
  }
  // The request is deleted (when released too) before the caller can see its final response; after finish
  // `state` may be gone: only `queue` and `record` are used.
  if (record.final) queue->finish(state, false, true);
  queue->push(std::move(record));
}

}  // namespace rp
