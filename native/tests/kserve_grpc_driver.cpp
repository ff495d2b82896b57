// Stress driver for the embedded Triton's C++ KServe gRPC front-end (native/triton/kserve_grpc.cpp), built by
// tests/native/test_kserve_grpc_sanitizers.py with AddressSanitizer + UndefinedBehaviorSanitizer. The front-end
// serves on a local port over the double of libtritonserver (fake_triton.hpp, whose backend threads answer every
// request with several responses and a final one), with hooks of the driver's own in place of Python's. Client
// threads, with grpc++'s generated stub:
// - open streams and send several requests on each, reading until every request's final response, and check each
//   request's responses: in order, with their text, `triton_final_response` false until the last;
// - cancel some streams after their first response (the front-end cancels their requests in Triton, and ends the call
//   CANCELLED once their final responses came back);
// - send a request for a missing model on a stream (an error message, and the stream carries on), requests on a
//   stream whose experiment header is malformed (each refused, nothing sent to Triton), unary ModelInfer calls (the
//   last response's text; a decoupled model UNIMPLEMENTED; a missing one NOT_FOUND) and a control RPC (answered by
//   the hook).
// At the end (after a graceful shutdown): every request sent to Triton deleted exactly once, after its release and
// final response; no output buffer leaked; one record per request, with the call's trace id. Any violation aborts
// with a message; "ok" otherwise.
//
// Usage: kserve_grpc_driver STREAMS REQUESTS_PER_STREAM RESPONSES_PER_REQUEST SEED
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fake_triton.hpp"
#include "grpc_service.grpc.pb.h"
#include "kserve_grpc.hpp"

using fake::die;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;

namespace {

ModelInferRequest request_for(const std::string& model, const std::string& id) {
  ModelInferRequest request;
  request.set_model_name(model);
  request.set_id(id);
  auto* input = request.add_inputs();
  input->set_name("text_input");
  input->set_datatype("BYTES");
  input->add_shape(1);
  input->mutable_contents()->add_bytes_contents("prompt of " + id);  // typed contents: the front-end lays them out
  (*request.mutable_parameters())["sampling_parameters"].set_string_param("{}");
  return request;
}

std::string text_of(const ModelInferResponse& response) {
  if (response.raw_output_contents_size() != 1) die("a response without its one output");
  const std::string& raw = response.raw_output_contents(0);
  if (raw.size() < 4) die("an output shorter than its length prefix");
  return raw.substr(4);
}

bool final_of(const ModelInferResponse& response) {
  auto found = response.parameters().find("triton_final_response");
  if (found == response.parameters().end()) die("a stream's response without triton_final_response");
  return found->second.bool_param();
}

// Requests certain to reach Triton (a cancelled stream's later requests may never be read), and requests refused
// before Triton that leave a record (a malformed header's leave none).
std::atomic<int> g_sent{0};
std::atomic<int> g_refused{0};

void stream_client(inference::GRPCInferenceService::Stub* stub, int number, int requests, bool cancel) {
  grpc::ClientContext context;
  context.AddMetadata("traceparent", "trace-" + std::to_string(number));
  auto stream = stub->ModelStreamInfer(&context);
  std::unordered_map<std::string, int> next;  // per request id, the index of its next response
  for (int k = 0; k < requests; ++k) {
    std::string id = "s" + std::to_string(number) + "-" + std::to_string(k);
    next[id] = 0;
    if (!stream->Write(request_for("model", id))) die("a stream's write failed");
    if (!cancel) ++g_sent;
  }
  const bool with_missing = !cancel && number % 5 == 0;
  if (with_missing) {
    if (!stream->Write(request_for("missing", "m" + std::to_string(number)))) die("write failed");
    ++g_refused;
  }
  if (!cancel) stream->WritesDone();
  int finals = 0, errors = 0;
  ModelStreamInferResponse message;
  while (stream->Read(&message)) {
    if (!message.error_message().empty()) {
      if (message.error_message().find("missing") == std::string::npos) die("error: " + message.error_message());
      ++errors;
      continue;
    }
    const ModelInferResponse& response = message.infer_response();
    auto found = next.find(response.id());
    if (found == next.end()) die("a response for an unknown request " + response.id());
    const std::string expect = response.id() + ":" + std::to_string(found->second);
    if (text_of(response) != expect) die("got '" + text_of(response) + "', expected '" + expect + "'");
    const bool last = found->second == fake::g_responses;
    if (final_of(response) != last) die("triton_final_response wrong for " + expect);
    ++found->second;
    if (last) ++finals;
    if (cancel) {
      context.TryCancel();
      break;
    }
  }
  grpc::Status status = stream->Finish();
  if (cancel) {
    if (status.error_code() != grpc::StatusCode::CANCELLED) die("a cancelled stream ended " + status.error_message());
    return;
  }
  if (!status.ok()) die("a stream ended " + status.error_message());
  if (finals != requests) die("stream " + std::to_string(number) + ": " + std::to_string(finals) + " finals");
  if (errors != (with_missing ? 1 : 0)) die("stream " + std::to_string(number) + ": wrong error count");
}

void refused_stream(inference::GRPCInferenceService::Stub* stub) {
  grpc::ClientContext context;
  context.AddMetadata("x-experiment", "malformed");
  auto stream = stub->ModelStreamInfer(&context);
  for (int k = 0; k < 3; ++k) stream->Write(request_for("model", "bad" + std::to_string(k)));
  stream->WritesDone();
  int refusals = 0;
  ModelStreamInferResponse message;
  while (stream->Read(&message)) {
    if (message.error_message() != "the experiment header is malformed") die("not refused: " + message.DebugString());
    ++refusals;
  }
  if (!stream->Finish().ok() || refusals != 3) die("the malformed header's stream did not refuse each request");
}

void unary_client(inference::GRPCInferenceService::Stub* stub, int number) {
  grpc::ClientContext context;
  ModelInferResponse response;
  const std::string id = "u" + std::to_string(number);
  grpc::Status status = stub->ModelInfer(&context, request_for("model", id), &response);
  ++g_sent;
  if (!status.ok()) die("ModelInfer failed: " + status.error_message());
  if (response.id() != id || text_of(response) != id + ":" + std::to_string(fake::g_responses)) {
    die("ModelInfer answered " + response.DebugString());
  }
}

void unary_refusals(inference::GRPCInferenceService::Stub* stub) {
  for (const char* model : {"decoupled", "missing"}) {
    grpc::ClientContext context;
    ModelInferResponse response;
    grpc::Status status = stub->ModelInfer(&context, request_for(model, model), &response);
    ++g_refused;
    const auto expect = std::string(model) == "decoupled" ? grpc::StatusCode::UNIMPLEMENTED
                                                          : grpc::StatusCode::NOT_FOUND;
    if (status.error_code() != expect) die(std::string("ModelInfer for ") + model + ": " + status.error_message());
  }
  grpc::ClientContext context;
  inference::ServerLiveResponse live;
  grpc::Status status = stub->ServerLive(&context, inference::ServerLiveRequest(), &live);
  if (!status.ok() || !live.live()) die("ServerLive was not answered by the hook");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) die("usage: kserve_grpc_driver STREAMS REQUESTS_PER_STREAM RESPONSES SEED");
  const int streams = std::atoi(argv[1]);
  const int requests = std::atoi(argv[2]);
  fake::g_responses = std::atoi(argv[3]);
  std::mt19937 rng(static_cast<unsigned>(std::atoi(argv[4])));
  static rp::Api api = fake::fake_api();

  kg::Hooks hooks;
  hooks.open_call = [](const kg::Metadata& metadata) {
    kg::CallContext call;
    for (const auto& kv : metadata) {
      if (kv.first == "traceparent") call.has_trace = true, call.trace_id = kv.second;
      if (kv.first == "x-experiment") call.error = "the experiment header is malformed";
    }
    return call;
  };
  hooks.control = [](const std::string& method, const std::string&) {
    kg::ControlAnswer answer;
    if (method != "ServerLive") die("an unexpected control RPC " + method);
    inference::ServerLiveResponse live;
    live.set_live(true);
    answer.response = live.SerializeAsString();
    return answer;
  };
  auto frontend = std::make_unique<kg::Frontend>(api, nullptr, "127.0.0.1:0", hooks, 4);  // small: backpressure
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(frontend->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = inference::GRPCInferenceService::NewStub(channel);

  std::vector<std::thread> clients;
  std::atomic<int> cancelled{0};
  for (int s = 0; s < streams; ++s) {
    const bool cancel = rng() % 4 == 0;
    cancelled += cancel;
    clients.emplace_back(stream_client, stub.get(), s, requests, cancel);
    if (s % 3 == 0) clients.emplace_back(unary_client, stub.get(), s);
  }
  clients.emplace_back(refused_stream, stub.get());
  clients.emplace_back(unary_refusals, stub.get());
  for (std::thread& t : clients) t.join();

  frontend->shutdown(5);
  {
    std::lock_guard<std::mutex> lock(fake::g_backend_mu);
    for (std::thread& t : fake::g_backend) t.join();
  }
  std::vector<kg::RequestRecord> records = frontend->drain_records();
  frontend.reset();
  int traced = 0;
  for (const kg::RequestRecord& r : records) {
    if (r.rpc == "ModelStreamInfer" && r.request_id[0] == 's') {
      if (!r.call || !r.call->has_trace || r.call->trace_id != "trace-" + r.request_id.substr(1, r.request_id.find('-') - 1)) {
        die("record of " + r.request_id + " without its call's trace id");
      }
      ++traced;
      if (r.status != "OK" && r.status != "CANCELLED") die("record of " + r.request_id + ": " + r.status);
    }
  }
  const int reached = static_cast<int>(fake::g_requests.size());  // every request Triton got leaves one record
  if (reached < g_sent.load()) die("requests sent to Triton: " + std::to_string(reached));
  if (static_cast<int>(records.size()) != reached + g_refused.load()) {
    die(std::to_string(records.size()) + " records for " + std::to_string(reached + g_refused.load()) +
        " requests");
  }
  if (traced < (streams - cancelled.load()) * requests) die("stream records: " + std::to_string(traced));
  for (fake::FakeRequest* r : fake::g_requests) {
    if (r->deletes.load() != 1) die("request " + r->id + " deleted " + std::to_string(r->deletes.load()) + " times");
    if (!r->released || !r->final_sent) die("request " + r->id + " deleted before its release and final response");
    delete r;
  }
  if (fake::g_buffers.load() != 0) die("output buffers leaked");
  std::printf("ok %d streams, %d cancelled\n", streams, cancelled.load());
  return 0;
}
