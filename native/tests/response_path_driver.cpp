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

#include "fake_triton.hpp"
#include "response_path.hpp"

using namespace fake;  // NOLINT: the double's names read as Triton's

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
