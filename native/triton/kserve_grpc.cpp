#include "kserve_grpc.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <deque>
#include <unordered_set>

namespace kg {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;

const char* const kDatatypes[15] = {"INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                                    "INT32",   "INT64", "FP16", "FP32",  "FP64",   "BYTES", "BF16"};

namespace {

constexpr int kInvalidArg = 3, kUnsupported = 5;  // TRITONSERVER_Error_Code
constexpr uint32_t kTxnDecoupled = 2;             // TRITONSERVER_TXN_DECOUPLED
// Triton's gRPC front-end's answer to a unary ModelInfer on a decoupled model, word for word (triton_grpc.py).
const char* const kDecoupledMessage = "ModelInfer RPC doesn't support models with decoupled transaction policy";
// Parameters Triton's gRPC front-end consumes itself instead of passing them to the request.
const std::unordered_set<std::string> kFrontendParameters = {
    "sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "triton_enable_empty_final_response",
    "headers", "binary_data_output"};
constexpr const char* kFinalParameter = "triton_final_response";

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double rounded(double seconds) { return static_cast<double>(static_cast<int64_t>(seconds * 10000 + 0.5)) / 10000; }

int datatype_code(const std::string& name) {
  for (int i = 1; i < 15; ++i) {
    if (name == kDatatypes[i]) return i;
  }
  return 0;
}

size_t item_bytes(int datatype) {
  switch (datatype) {
    case 1: case 2: case 6: return 1;            // BOOL, UINT8, INT8
    case 3: case 7: case 10: case 14: return 2;  // UINT16, INT16, FP16, BF16
    case 4: case 8: case 11: return 4;           // UINT32, INT32, FP32
    default: return 8;                           // UINT64, INT64, FP64
  }
}

[[noreturn]] void refuse(const std::string& message) { throw rp::CallError(kInvalidArg, message); }

template <typename T, typename Values>
void append_values(std::string& out, const Values& values) {
  for (const auto& v : values) {
    T item = static_cast<T>(v);
    out.append(reinterpret_cast<const char*>(&item), sizeof item);
  }
}

// A typed-contents input in Triton's layout (raw contents go as they came).
std::string typed_contents(const ModelInferRequest::InferInputTensor& tensor, int datatype) {
  const auto& c = tensor.contents();
  std::string out;
  switch (datatype) {
    case 1: append_values<uint8_t>(out, c.bool_contents()); break;
    case 2: append_values<uint8_t>(out, c.uint_contents()); break;
    case 3: append_values<uint16_t>(out, c.uint_contents()); break;
    case 4: append_values<uint32_t>(out, c.uint_contents()); break;
    case 5: append_values<uint64_t>(out, c.uint64_contents()); break;
    case 6: append_values<int8_t>(out, c.int_contents()); break;
    case 7: append_values<int16_t>(out, c.int_contents()); break;
    case 8: append_values<int32_t>(out, c.int_contents()); break;
    case 9: append_values<int64_t>(out, c.int64_contents()); break;
    case 11: append_values<float>(out, c.fp32_contents()); break;
    case 12: append_values<double>(out, c.fp64_contents()); break;
    case 13:
      for (const std::string& element : c.bytes_contents()) {
        uint32_t length = static_cast<uint32_t>(element.size());
        out.append(reinterpret_cast<const char*>(&length), 4);  // little-endian on every platform Triton runs on
        out.append(element);
      }
      break;
    default:
      refuse("input '" + tensor.name() + "': datatype " + tensor.datatype() +
             " has no typed contents; send it as raw_input_contents");
  }
  return out;
}

int64_t parse_version(const std::string& text) {
  if (text.empty()) return -1;
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size()) refuse("model version '" + text + "' is not a number");
  return value;
}

// Fill a KServe response from a Record's outputs: Triton's bytes go out as they came (its BYTES layout is KServe's
// raw_output_contents layout); an output whose shape does not hold its elements goes out flat.
void fill_response(ModelInferResponse* response, const std::string& model, const std::string& version,
                   const std::string& id, std::vector<rp::Output>& outputs) {
  response->set_model_name(model);
  response->set_model_version(version.empty() ? "1" : version);
  response->set_id(id);
  for (rp::Output& o : outputs) {
    if (o.datatype <= 0 || o.datatype >= 15) {
      throw rp::CallError(kUnsupported, "output '" + o.name + "': datatype " + std::to_string(o.datatype) +
                                            " is not sent by this front-end");
    }
    int64_t count = 0;
    if (o.datatype == rp::kBytes) {
      size_t pos = 0;
      while (pos + 4 <= o.data.size()) {
        uint32_t length;
        std::memcpy(&length, o.data.data() + pos, 4);
        pos += 4 + length;
        ++count;
      }
    } else {
      count = static_cast<int64_t>(o.data.size() / item_bytes(o.datatype));
    }
    auto* tensor = response->add_outputs();
    tensor->set_name(o.name);
    tensor->set_datatype(kDatatypes[o.datatype]);
    int64_t product = 1;
    for (int64_t d : o.shape) product *= d;
    if (!o.shape.empty() && product == count) {
      for (int64_t d : o.shape) tensor->add_shape(d);
    } else {
      tensor->add_shape(count);
    }
    response->add_raw_output_contents(std::move(o.data));
  }
}

Metadata metadata_of(const grpc::CallbackServerContext* context) {
  Metadata out;
  for (const auto& kv : context->client_metadata()) {
    std::string key(kv.first.data(), kv.first.size());
    for (char& ch : key) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    out.emplace_back(std::move(key), std::string(kv.second.data(), kv.second.size()));
  }
  return out;
}

// KServe gRPC methods answered without a key: health, as the HTTP health paths (llm_serving/pod_contract.py
// UNAUTHENTICATED_GRPC_METHODS).
bool is_open_method(const char* method) {
  return std::strcmp(method, "ServerLive") == 0 || std::strcmp(method, "ServerReady") == 0;
}

// A request of a call, from its sending to its final response.
struct Pending {
  std::string request_id, model, model_version;
  Clock::time_point started = Clock::now();
  double first = -1, last = -1;
  bool empty_final = false;

  void response_left() {
    last = rounded(seconds_since(started));
    if (first < 0) first = last;
  }
};

// ---- ModelStreamInfer ----------------------------------------------------------------------------------------

class Stream : public grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse>, public Call {
 public:
  Stream(Frontend* frontend, grpc::CallbackServerContext* context) : frontend_(frontend) {
    Metadata metadata = metadata_of(context);
    std::string refused = authorization_error(frontend->api_keys(), metadata);
    if (!refused.empty()) {  // no key, no stream: nothing is read, sent or recorded
      call_ = std::make_shared<CallContext>();
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refused));
      return;
    }
    call_ = std::make_shared<CallContext>(frontend->hooks().open_call(metadata));
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      std::lock_guard<std::recursive_mutex> lock(mu_);
      reads_done_ = true;
      maybe_finish();
      return;
    }
    handle(request_);
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    current_.reset();
    if (!ok) gone_ = true;
    if (gone_) outbox_.clear();
    if (outbox_.empty()) {
      writing_ = false;
      maybe_finish();
      return;
    }
    current_ = std::move(outbox_.front());
    outbox_.pop_front();
    StartWrite(current_.get());
  }

  void OnCancel() override {
    std::vector<uint64_t> keys;
    {
      std::lock_guard<std::recursive_mutex> lock(mu_);
      gone_ = true;
      for (const auto& kv : pending_) keys.push_back(kv.first);
    }
    for (uint64_t key : keys) frontend_->cancel(key);
    std::lock_guard<std::recursive_mutex> lock(mu_);
    maybe_finish();
  }

  void OnDone() override {
    std::unique_lock<std::recursive_mutex> lock(mu_);
    done_ = true;
    if (pending_.empty()) {
      lock.unlock();
      delete this;
    }
  }

  void on_record(uint64_t key, rp::Record& record) override {
    std::unique_lock<std::recursive_mutex> lock(mu_);
    auto found = pending_.find(key);
    if (found == pending_.end()) return;
    Pending& p = found->second;
    if (record.error_code >= 0) {
      status_[key] = "ERROR";
      emit(error_message(record.error_message));
    } else if (!record.outputs.empty() || (record.final && p.empty_final)) {
      auto message = std::make_unique<ModelStreamInferResponse>();
      try {
        fill_response(message->mutable_infer_response(), p.model, p.model_version, p.request_id, record.outputs);
        (*message->mutable_infer_response()->mutable_parameters())[kFinalParameter].set_bool_param(record.final);
        p.response_left();
      } catch (const rp::CallError& e) {
        status_[key] = "ERROR";
        message = error_message(e.what());
      }
      emit(std::move(message));
    }
    if (!record.final) return;
    RequestRecord done{"ModelStreamInfer", p.request_id, p.model, p.model_version, call_, "OK",
                       rounded(seconds_since(p.started)), p.first, p.last};
    auto status = status_.find(key);
    if (gone_) {  // the client left: its requests were cancelled, whatever they answered meanwhile
      done.status = "CANCELLED";
    } else if (status != status_.end()) {
      done.status = status->second;
    }
    if (status != status_.end()) status_.erase(status);
    pending_.erase(found);
    frontend_->record(std::move(done));
    if (done_ && pending_.empty()) {
      lock.unlock();
      delete this;
      return;
    }
    maybe_finish();
  }

 private:
  static std::unique_ptr<ModelStreamInferResponse> error_message(const std::string& text) {
    auto message = std::make_unique<ModelStreamInferResponse>();
    message->set_error_message(text);
    return message;
  }

  void handle(const ModelInferRequest& request) {
    if (!call_->error.empty()) {  // a malformed experiment header: every request of the stream is refused, unsent
      std::lock_guard<std::recursive_mutex> lock(mu_);
      emit(error_message(call_->error));
      return;
    }
    Pending p;
    p.request_id = request.id();
    p.model = request.model_name();
    p.model_version = request.model_version();
    auto flag = request.parameters().find("triton_enable_empty_final_response");
    p.empty_final = flag != request.parameters().end() && flag->second.parameter_choice_case() ==
                    inference::InferParameter::kBoolParam && flag->second.bool_param();
    std::lock_guard<std::recursive_mutex> lock(mu_);  // held across submit: no record of it can come first
    try {
      uint64_t key = frontend_->submit(this, request);
      pending_.emplace(key, std::move(p));
    } catch (const rp::CallError& e) {
      frontend_->record(RequestRecord{"ModelStreamInfer", p.request_id, p.model, p.model_version, call_, "ERROR",
                                      rounded(seconds_since(p.started)), -1, -1});
      emit(error_message(e.what()));
    }
  }

  // With mu_ held.
  void emit(std::unique_ptr<ModelStreamInferResponse> message) {
    if (gone_ || finished_) return;
    if (writing_) {
      outbox_.push_back(std::move(message));
      return;
    }
    writing_ = true;
    current_ = std::move(message);
    StartWrite(current_.get());
  }

  // With mu_ held: end the call once nothing more can be written.
  void maybe_finish() {
    if (finished_ || writing_) return;
    if (gone_) {
      finished_ = true;
      Finish(grpc::Status::CANCELLED);
    } else if (reads_done_ && pending_.empty()) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  Frontend* frontend_;
  std::shared_ptr<const CallContext> call_;
  ModelInferRequest request_;
  std::recursive_mutex mu_;  // recursive: gRPC may run a reaction inline from StartWrite
  std::unordered_map<uint64_t, Pending> pending_;
  std::unordered_map<uint64_t, std::string> status_;
  std::deque<std::unique_ptr<ModelStreamInferResponse>> outbox_;
  std::unique_ptr<ModelStreamInferResponse> current_;
  bool writing_ = false, reads_done_ = false, gone_ = false, finished_ = false, done_ = false;
};

// ---- ModelInfer ----------------------------------------------------------------------------------------------

class Unary : public grpc::ServerUnaryReactor, public Call {
 public:
  Unary(Frontend* frontend, grpc::CallbackServerContext* context, const ModelInferRequest* request,
        ModelInferResponse* response)
      : frontend_(frontend), response_(response) {
    Metadata metadata = metadata_of(context);
    std::string refused = authorization_error(frontend->api_keys(), metadata);
    if (!refused.empty()) {  // before a record is opened, as a malformed header is refused
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refused));
      return;
    }
    CallContext call = frontend->hooks().open_call(metadata);
    if (!call.error.empty()) {  // refused before a record is opened, as the Python front-end did
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, call.error));
      return;
    }
    call_ = std::make_shared<CallContext>(std::move(call));
    p_.request_id = request->id();
    p_.model = request->model_name();
    p_.model_version = request->model_version();
    std::lock_guard<std::recursive_mutex> lock(mu_);
    try {
      if (frontend->is_decoupled(request->model_name(), request->model_version())) {
        end(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, kDecoupledMessage));
        return;
      }
      key_ = frontend->submit(this, *request);
      sent_ = true;
    } catch (const rp::CallError& e) {
      end(grpc::Status(status_for(e.code), e.what()));
    }
  }

  void OnCancel() override {
    uint64_t key = 0;
    {
      std::lock_guard<std::recursive_mutex> lock(mu_);
      gone_ = true;
      if (!sent_) return;
      key = key_;
    }
    frontend_->cancel(key);
  }

  void OnDone() override {
    std::unique_lock<std::recursive_mutex> lock(mu_);
    done_ = true;
    if (!sent_) {
      lock.unlock();
      delete this;
    }
  }

  void on_record(uint64_t, rp::Record& record) override {
    std::unique_lock<std::recursive_mutex> lock(mu_);
    if (record.error_code >= 0) {
      if (!status_) status_ = std::make_unique<grpc::Status>(status_for(record.error_code), record.error_message);
    } else if (!record.outputs.empty() && !status_) {
      try {
        response_->Clear();
        fill_response(response_, p_.model, p_.model_version, p_.request_id, record.outputs);
        p_.response_left();
      } catch (const rp::CallError& e) {
        status_ = std::make_unique<grpc::Status>(status_for(e.code), e.what());
      }
    }
    if (!record.final) return;
    sent_ = false;
    if (!status_ && response_->model_name().empty()) {  // no response had outputs: an empty answer
      std::vector<rp::Output> none;
      fill_response(response_, p_.model, p_.model_version, p_.request_id, none);
    }
    grpc::Status status = status_ ? *status_ : grpc::Status::OK;
    if (gone_ && status.ok()) status = grpc::Status::CANCELLED;
    end(status);
    if (done_) {
      lock.unlock();
      delete this;
    }
  }

 private:
  // With mu_ held: the call's status, its record, and Finish.
  void end(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    frontend_->record(RequestRecord{"ModelInfer", p_.request_id, p_.model, p_.model_version, call_,
                                    status_name(status.error_code()), rounded(seconds_since(p_.started)), p_.first,
                                    p_.last});
    Finish(status);
  }

  Frontend* frontend_;
  ModelInferResponse* response_;
  std::shared_ptr<const CallContext> call_;
  Pending p_;
  std::recursive_mutex mu_;  // as the stream's
  uint64_t key_ = 0;
  std::unique_ptr<grpc::Status> status_;
  bool sent_ = false, gone_ = false, finished_ = false, done_ = false;
};

// ---- the service -----------------------------------------------------------------------------------------------

#define CONTROL_RPC(Method, Request, Response)                                                                    \
  grpc::ServerUnaryReactor* Method(grpc::CallbackServerContext* context, const inference::Request* request,     \
                                   inference::Response* response) override {                                     \
    return control(context, #Method, *request, response);                                                        \
  }

class Service : public inference::GRPCInferenceService::CallbackService {
 public:
  explicit Service(Frontend* frontend) : frontend_(frontend) {}

  CONTROL_RPC(ServerLive, ServerLiveRequest, ServerLiveResponse)
  CONTROL_RPC(ServerReady, ServerReadyRequest, ServerReadyResponse)
  CONTROL_RPC(ModelReady, ModelReadyRequest, ModelReadyResponse)
  CONTROL_RPC(ServerMetadata, ServerMetadataRequest, ServerMetadataResponse)
  CONTROL_RPC(ModelMetadata, ModelMetadataRequest, ModelMetadataResponse)
  CONTROL_RPC(ModelConfig, ModelConfigRequest, ModelConfigResponse)
  CONTROL_RPC(ModelStatistics, ModelStatisticsRequest, ModelStatisticsResponse)
  CONTROL_RPC(RepositoryIndex, RepositoryIndexRequest, RepositoryIndexResponse)

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context, const ModelInferRequest* request,
                                       ModelInferResponse* response) override {
    return new Unary(frontend_, context, request, response);
  }

  grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override {
    return new Stream(frontend_, context);
  }

 private:
  grpc::ServerUnaryReactor* control(grpc::CallbackServerContext* context, const char* method,
                                    const google::protobuf::Message& request, google::protobuf::Message* response) {
    if (!is_open_method(method)) {
      std::string refused = authorization_error(frontend_->api_keys(), metadata_of(context));
      if (!refused.empty()) {
        auto* reactor = context->DefaultReactor();
        reactor->Finish(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, refused));
        return reactor;
      }
    }
    ControlAnswer answer = frontend_->hooks().control(method, request.SerializeAsString());
    grpc::Status status = grpc::Status::OK;
    if (answer.code != 0) {
      status = grpc::Status(static_cast<grpc::StatusCode>(answer.code), answer.message);
    } else if (!response->ParseFromString(answer.response)) {
      status = grpc::Status(grpc::StatusCode::INTERNAL, std::string(method) + ": the answer is not a response");
    }
    auto* reactor = context->DefaultReactor();
    reactor->Finish(status);
    return reactor;
  }

  Frontend* frontend_;
};

#undef CONTROL_RPC

}  // namespace

grpc::StatusCode status_for(int triton_code) {
  switch (triton_code) {
    case 1: return grpc::StatusCode::INTERNAL;
    case 2: return grpc::StatusCode::NOT_FOUND;
    case 3: return grpc::StatusCode::INVALID_ARGUMENT;
    case 4: return grpc::StatusCode::UNAVAILABLE;
    case 5: return grpc::StatusCode::UNIMPLEMENTED;
    case 6: return grpc::StatusCode::ALREADY_EXISTS;
    case 7: return grpc::StatusCode::CANCELLED;
    default: return grpc::StatusCode::UNKNOWN;
  }
}

const char* status_name(grpc::StatusCode code) {
  static const char* const names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                      "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                      "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  int index = static_cast<int>(code);
  return index >= 0 && index <= 16 ? names[index] : "UNKNOWN";
}

namespace {

// Equal bytes, compared in time that depends on the lengths only (as Python's hmac.compare_digest).
bool same_key(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

std::string authorization_error(const std::vector<std::string>& api_keys, const std::string* authorization) {
  if (api_keys.empty()) return "";
  static const char* const kMissing = "missing API key: send metadata 'authorization: Bearer <key>'";
  if (authorization == nullptr) return kMissing;
  const std::string& value = *authorization;
  const size_t space = value.find(' ');
  std::string scheme = value.substr(0, space == std::string::npos ? value.size() : space);
  for (char& ch : scheme) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (scheme != "bearer" || space == std::string::npos) return kMissing;
  size_t begin = space + 1, end = value.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(value[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(value[end - 1]))) --end;
  if (begin == end) return kMissing;
  const std::string token = value.substr(begin, end - begin);
  bool matched = false;
  for (const std::string& key : api_keys) matched = same_key(token, key) || matched;  // every key, always
  return matched ? "" : "incorrect API key provided";
}

std::string authorization_error(const std::vector<std::string>& api_keys, const Metadata& metadata) {
  for (const auto& kv : metadata) {
    if (kv.first == "authorization") return authorization_error(api_keys, &kv.second);
  }
  return authorization_error(api_keys, static_cast<const std::string*>(nullptr));
}

Frontend::Frontend(const rp::Api& api, void* server, const std::string& address, Hooks hooks, size_t capacity,
                   std::vector<std::string> api_keys)
    : api_(api), server_(server), hooks_(std::move(hooks)), api_keys_(std::move(api_keys)), queue_(api, capacity) {
  stop_fd_ = eventfd(0, EFD_CLOEXEC);
  records_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (stop_fd_ < 0 || records_fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  service_ = std::make_unique<Service>(this);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port_);
  builder.SetMaxReceiveMessageSize(64 * 1024 * 1024);  // larger messages: RESOURCE_EXHAUSTED, from gRPC itself
  builder.SetMaxSendMessageSize(64 * 1024 * 1024);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use is an error, never shared
  builder.RegisterService(service_.get());
  grpc_ = builder.BuildAndStart();
  if (!grpc_ || port_ == 0) {
    ::close(stop_fd_);
    ::close(records_fd_);
    throw std::runtime_error("KServe gRPC: cannot bind " + address);
  }
  dispatcher_ = std::thread([this] { dispatch(); });
}

Frontend::~Frontend() {
  shutdown(0);
  ::close(stop_fd_);
  ::close(records_fd_);
}

void Frontend::shutdown(double grace_s) {
  if (shut_.exchange(true)) return;
  // The dispatcher runs on meanwhile: the calls still in flight need their final responses to end.
  grpc_->Shutdown(std::chrono::system_clock::now() +
                  std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6)));
  grpc_->Wait();
  uint64_t one = 1;
  ssize_t written = ::write(stop_fd_, &one, sizeof one);
  (void)written;
  dispatcher_.join();
  queue_.close();
}

uint64_t Frontend::submit(Call* call, const ModelInferRequest& request) {
  const int64_t version = parse_version(request.model_version());
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    refuse("raw_input_contents has " + std::to_string(request.raw_input_contents_size()) + " entries for " +
           std::to_string(request.inputs_size()) + " inputs");
  }
  std::vector<rp::Input> inputs;
  inputs.reserve(request.inputs_size());
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& tensor = request.inputs(i);
    rp::Input input;
    input.name = tensor.name();
    input.datatype = datatype_code(tensor.datatype());
    if (input.datatype == 0) refuse("input '" + tensor.name() + "': unknown datatype " + tensor.datatype());
    input.shape.assign(tensor.shape().begin(), tensor.shape().end());
    input.data = raw ? request.raw_input_contents(i) : typed_contents(tensor, input.datatype);
    inputs.push_back(std::move(input));
  }
  std::vector<std::string> outputs;
  for (const auto& output : request.outputs()) outputs.push_back(output.name());
  std::vector<rp::Parameter> parameters;
  for (const auto& kv : request.parameters()) {
    if (kFrontendParameters.count(kv.first)) continue;
    rp::Parameter p;
    p.name = kv.first;
    switch (kv.second.parameter_choice_case()) {
      case inference::InferParameter::kBoolParam: p.kind = rp::kParamBool; p.flag = kv.second.bool_param(); break;
      case inference::InferParameter::kInt64Param:
        p.kind = rp::kParamInt;
        p.integer = kv.second.int64_param();
        break;
      case inference::InferParameter::kUint64Param:
        p.kind = rp::kParamInt;
        p.integer = static_cast<int64_t>(kv.second.uint64_param());
        break;
      case inference::InferParameter::kDoubleParam:
        p.kind = rp::kParamDouble;
        p.number = kv.second.double_param();
        break;
      case inference::InferParameter::kStringParam:
        p.kind = rp::kParamString;
        p.text = kv.second.string_param();
        break;
      default: refuse("parameter '" + kv.first + "' has no value");
    }
    parameters.push_back(std::move(p));
  }
  // The route is in place before Triton can answer: held across the submit, which the dispatcher's lookup waits for.
  std::lock_guard<std::mutex> lock(routes_mu_);
  uint64_t key = queue_.submit(server_, request.model_name(), version, request.id(), std::move(inputs),
                               std::move(outputs), std::move(parameters));
  routes_[key] = call;
  return key;
}

void Frontend::cancel(uint64_t key) {
  try {
    queue_.cancel(key);
  } catch (const rp::CallError&) {  // finished meanwhile: nothing to cancel
  }
}

bool Frontend::is_decoupled(const std::string& model, const std::string& version) {
  uint32_t flags = 0;
  void* unused = nullptr;
  rp::Error* error = api_.ServerModelTransactionProperties(server_, model.c_str(), parse_version(version), &flags,
                                                           &unused);
  if (error != nullptr) {
    std::string message = api_.ErrorMessage(error) ? api_.ErrorMessage(error) : "";
    int code = api_.ErrorCode(error);
    api_.ErrorDelete(error);
    throw rp::CallError(code, message);
  }
  return (flags & kTxnDecoupled) != 0;
}

void Frontend::record(RequestRecord record) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(records_mu_);
    records_.push_back(std::move(record));
    wake = !records_notified_;
    records_notified_ = true;
  }
  if (wake) {
    uint64_t one = 1;
    ssize_t written = ::write(records_fd_, &one, sizeof one);
    (void)written;
  }
}

std::vector<RequestRecord> Frontend::drain_records() {
  std::vector<RequestRecord> out;
  std::lock_guard<std::mutex> lock(records_mu_);
  out.swap(records_);
  records_notified_ = false;
  uint64_t value;
  ssize_t got = ::read(records_fd_, &value, sizeof value);  // EAGAIN when already clear
  (void)got;
  return out;
}

void Frontend::dispatch() {
  pollfd fds[2] = {{queue_.fd(), POLLIN, 0}, {stop_fd_, POLLIN, 0}};
  while (true) {
    if (::poll(fds, 2, -1) < 0) continue;  // EINTR
    if (fds[1].revents) return;
    for (rp::Record& record : queue_.drain(static_cast<size_t>(1) << 30)) {
      if (record.released && !record.final) continue;  // a release notice: nothing for the caller
      Call* call = nullptr;
      {
        std::lock_guard<std::mutex> lock(routes_mu_);
        auto found = routes_.find(record.key);
        if (found == routes_.end()) continue;
        call = found->second;
        if (record.final) routes_.erase(found);
      }
      call->on_record(record.key, record);  // a call lives until its requests' final records
    }
  }
}

}  // namespace kg
