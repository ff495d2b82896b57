// KServe v2 gRPC (port 8001) over the Triton embedded in this process, in C++: the role Triton's own gRPC front-end
// (grpc_server.cc in tritonserver, `tritonfrontend` in later releases) plays, with grpc++'s callback API.
//
// Why C++: the data path (ModelInfer, ModelStreamInfer) in grpc.aio cost the server process 18-30 µs of CPU per
// output token under bench.kserve's load, against 11-12 µs here and tritonserver's 9-10 (docs/kserve.md, "A C++
// KServe front-end for the embedded 8001"), and on a machine whose cores the engine shares that was 15-20 % of
// its throughput.
//
// What runs where:
// - ModelInfer and ModelStreamInfer are answered here: inputs parsed from the protobuf (raw or typed contents),
//   sent with the response path's Queue (response_path.hpp: Triton's callbacks in C++), and every response built
//   and written on this front-end's dispatcher thread. No Python runs per request or per response.
// - Every other RPC (ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
//   ModelStatistics, RepositoryIndex) is answered by `Hooks::control` (Python: serving_image/kserve/triton_grpc.py,
//   which owns draining and the JSON-to-protobuf mapping of Triton's messages). The rest are UNIMPLEMENTED.
// - Each call's metadata is read once by `Hooks::open_call` (Python's trace-id and experiment-arm rules); each
//   request's record (one per ModelInfer, one per request of a stream) is queued when the request ends and drained
//   by Python (`drain_records`, an eventfd its loop watches), which writes the request log.
//
// Ordering rules:
// - a request's responses are written in the order Triton produced them; requests of one stream interleave;
// - a stream ends (OK) once the client has half-closed it, every request on it has had its final response and every
//   response is written; a client that goes away cancels its requests in Triton, and the stream's object lives
//   until their final responses arrived (Triton calls back into it until then);
// - the hooks are called from gRPC's threads, never with a lock of this file held.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grpc_service.grpc.pb.h"
#include "response_path.hpp"

namespace kg {

using Metadata = std::vector<std::pair<std::string, std::string>>;

// What `open_call` read from a call's metadata.
struct CallContext {
  bool has_trace = false, has_experiment = false;
  std::string trace_id, experiment;
  std::string error;  // not empty: a malformed header, refused with this text (INVALID_ARGUMENT)
};

// A control RPC's answer: a gRPC status code (0 = OK), its message, the serialized response.
struct ControlAnswer {
  int code = 0;
  std::string message;
  std::string response;
};

struct Hooks {
  std::function<CallContext(const Metadata&)> open_call;
  std::function<ControlAnswer(const std::string& method, const std::string& request)> control;
};

// One request's record (kserve/request_log.py writes it).
struct RequestRecord {
  std::string rpc, request_id, model, model_version;
  std::shared_ptr<const CallContext> call;
  std::string status;  // the gRPC status code's name (ModelInfer); OK, ERROR or CANCELLED (a request of a stream)
  double duration_s = 0, first_response_s = -1, last_response_s = -1;  // -1: no response left
};

// The caller's key check (docs/architecture.md §3.12): "" when `authorization` (the `authorization` metadata's
// value, nullptr when absent) is "Bearer <key>" with one of `api_keys`, else the message UNAUTHENTICATED carries.
// Every key is compared, each in time independent of where the first difference lies. No keys: "" (no check).
std::string authorization_error(const std::vector<std::string>& api_keys, const std::string* authorization);
// The same, from a call's metadata (keys lower-cased, as metadata_of gives them).
std::string authorization_error(const std::vector<std::string>& api_keys, const Metadata& metadata);

// A gRPC status for a TRITONSERVER_Error code (triton_grpc.py's table).
grpc::StatusCode status_for(int triton_code);
const char* status_name(grpc::StatusCode code);

class Call;

class Frontend {
 public:
  // `api_keys`: not empty, every RPC but ServerLive and ServerReady needs one (authorization_error).
  Frontend(const rp::Api& api, void* server, const std::string& address, Hooks hooks, size_t queue_capacity,
           std::vector<std::string> api_keys = {});
  ~Frontend();
  Frontend(const Frontend&) = delete;
  Frontend& operator=(const Frontend&) = delete;

  int port() const { return port_; }
  // Stop accepting; calls in flight get `grace_s` to finish, then are cancelled. Returns once every call ended.
  void shutdown(double grace_s);
  int records_fd() const { return records_fd_; }
  std::vector<RequestRecord> drain_records();

  // -- used by the calls (kserve_grpc.cpp) --
  const Hooks& hooks() const { return hooks_; }
  const std::vector<std::string>& api_keys() const { return api_keys_; }
  // Parse and send one request; its responses go to `call` under the returned key. Throws rp::CallError (with a
  // TRITONSERVER_Error code) for what Triton refuses and for a malformed request (INVALID_ARG).
  uint64_t submit(Call* call, const inference::ModelInferRequest& request);
  void cancel(uint64_t key);
  bool is_decoupled(const std::string& model, const std::string& version);
  void record(RequestRecord record);

 private:
  void dispatch();

  const rp::Api& api_;
  void* server_;
  Hooks hooks_;
  std::vector<std::string> api_keys_;
  rp::Queue queue_;
  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> grpc_;
  int port_ = 0;
  int stop_fd_ = -1, records_fd_ = -1;
  std::thread dispatcher_;
  std::atomic<bool> shut_{false};
  std::mutex routes_mu_;
  std::unordered_map<uint64_t, Call*> routes_;
  std::mutex records_mu_;
  std::vector<RequestRecord> records_;
  bool records_notified_ = false;
};

// A call that receives responses (a ModelInfer or a ModelStreamInfer): the dispatcher hands it each Record of its
// requests, on the dispatcher's thread.
class Call {
 public:
  virtual ~Call() = default;
  virtual void on_record(uint64_t key, rp::Record& record) = 0;
};

// The datatype names of TRITONSERVER_DataType, in tritonserver.h's order.
extern const char* const kDatatypes[15];

}  // namespace kg
