// Python's view of the response path (serving_image.triton.capi._response_path): resolve the C API from the loaded
// libtritonserver, a ResponseQueue per event loop, and Records turned into plain Python values in one call per burst.
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kserve_grpc.hpp"
#include "response_path.hpp"

namespace py = pybind11;

namespace {

// The C API resolved from an already loaded library (serving_image/triton/capi/library.py loads it with its
// dependencies first); RTLD_NOLOAD: never a second copy.
struct Library {
  rp::Api api{};
  void* handle = nullptr;

  explicit Library(const std::string& path) {
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) {
      throw std::runtime_error(path + " is not loaded in this process (load it with load_library first)");
    }
    resolve(api.ErrorNew, "TRITONSERVER_ErrorNew");
    resolve(api.ErrorDelete, "TRITONSERVER_ErrorDelete");
    resolve(api.ErrorCode, "TRITONSERVER_ErrorCode");
    resolve(api.ErrorMessage, "TRITONSERVER_ErrorMessage");
    resolve(api.ResponseAllocatorNew, "TRITONSERVER_ResponseAllocatorNew");
    resolve(api.ResponseAllocatorDelete, "TRITONSERVER_ResponseAllocatorDelete");
    resolve(api.InferenceRequestNew, "TRITONSERVER_InferenceRequestNew");
    resolve(api.InferenceRequestDelete, "TRITONSERVER_InferenceRequestDelete");
    resolve(api.InferenceRequestSetId, "TRITONSERVER_InferenceRequestSetId");
    resolve(api.InferenceRequestAddInput, "TRITONSERVER_InferenceRequestAddInput");
    resolve(api.InferenceRequestAppendInputData, "TRITONSERVER_InferenceRequestAppendInputData");
    resolve(api.InferenceRequestAddRequestedOutput, "TRITONSERVER_InferenceRequestAddRequestedOutput");
    resolve(api.InferenceRequestSetStringParameter, "TRITONSERVER_InferenceRequestSetStringParameter");
    resolve(api.InferenceRequestSetIntParameter, "TRITONSERVER_InferenceRequestSetIntParameter");
    resolve(api.InferenceRequestSetBoolParameter, "TRITONSERVER_InferenceRequestSetBoolParameter");
    resolve(api.InferenceRequestSetDoubleParameter, "TRITONSERVER_InferenceRequestSetDoubleParameter");
    resolve(api.InferenceRequestSetReleaseCallback, "TRITONSERVER_InferenceRequestSetReleaseCallback");
    resolve(api.InferenceRequestSetResponseCallback, "TRITONSERVER_InferenceRequestSetResponseCallback");
    resolve(api.InferenceRequestCancel, "TRITONSERVER_InferenceRequestCancel");
    resolve(api.ServerInferAsync, "TRITONSERVER_ServerInferAsync");
    resolve(api.InferenceResponseDelete, "TRITONSERVER_InferenceResponseDelete");
    resolve(api.InferenceResponseError, "TRITONSERVER_InferenceResponseError");
    resolve(api.InferenceResponseOutputCount, "TRITONSERVER_InferenceResponseOutputCount");
    resolve(api.InferenceResponseOutput, "TRITONSERVER_InferenceResponseOutput");
    resolve(api.InferenceResponseParameterCount, "TRITONSERVER_InferenceResponseParameterCount");
    resolve(api.InferenceResponseParameter, "TRITONSERVER_InferenceResponseParameter");
    resolve(api.ServerModelTransactionProperties, "TRITONSERVER_ServerModelTransactionProperties");
  }

  template <typename F>
  void resolve(F& slot, const char* name) {
    void* symbol = dlsym(handle, name);
    if (symbol == nullptr) throw std::runtime_error(std::string("libtritonserver has no ") + name);
    slot = reinterpret_cast<F>(symbol);
  }
};

py::object bytes_elements(const std::string& data) {
  py::list items;
  size_t pos = 0;
  while (pos + 4 <= data.size()) {
    uint32_t length;
    std::memcpy(&length, data.data() + pos, 4);  // little-endian on every platform Triton runs on
    pos += 4;
    if (length > data.size() - pos) length = static_cast<uint32_t>(data.size() - pos);
    items.append(py::bytes(data.data() + pos, length));
    pos += length;
  }
  return std::move(items);
}

py::object parameter_value(const rp::Parameter& p) {
  switch (p.kind) {
    case rp::kParamString: return py::str(p.text);
    case rp::kParamInt: return py::int_(p.integer);
    case rp::kParamBool: return py::bool_(p.flag);
    default: return py::float_(p.number);
  }
}

py::tuple record_tuple(const rp::Record& r) {
  py::object error = py::none();
  if (r.error_code >= 0) error = py::make_tuple(r.error_code, py::str(r.error_message));
  py::list outputs;
  for (const rp::Output& o : r.outputs) {
    py::tuple shape(o.shape.size());
    for (size_t i = 0; i < o.shape.size(); ++i) shape[i] = py::int_(o.shape[i]);
    py::object payload = o.datatype == rp::kBytes ? bytes_elements(o.data) : py::bytes(o.data);
    outputs.append(py::make_tuple(py::str(o.name), o.datatype, std::move(shape), std::move(payload)));
  }
  py::dict parameters;
  for (const rp::Parameter& p : r.parameters) parameters[py::str(p.name)] = parameter_value(p);
  return py::make_tuple(r.key, r.released, r.final, r.empty, std::move(error), std::move(outputs),
                        std::move(parameters));
}

py::object optional_text(bool present, const std::string& text) {
  return present ? py::object(py::str(text)) : py::object(py::none());
}

// The front-end's hooks, calling Python with the GIL taken (they run on gRPC's threads). An exception of
// `open_call` is the call's refusal (its text); one of `control` is answered as UNKNOWN, as grpc's Python server
// answers a handler's exception.
kg::Hooks python_hooks(py::function open_call, py::function control) {
  auto open = std::make_shared<py::function>(std::move(open_call));
  auto answer = std::make_shared<py::function>(std::move(control));
  kg::Hooks hooks;
  hooks.open_call = [open](const kg::Metadata& metadata) {
    py::gil_scoped_acquire gil;
    kg::CallContext call;
    try {
      py::list pairs;
      for (const auto& kv : metadata) pairs.append(py::make_tuple(kv.first, py::bytes(kv.second)));
      auto result = (*open)(pairs).cast<py::tuple>();
      if (!result[0].is_none()) call.has_trace = true, call.trace_id = result[0].cast<std::string>();
      if (!result[1].is_none()) call.has_experiment = true, call.experiment = result[1].cast<std::string>();
    } catch (py::error_already_set& e) {
      call.error = py::str(e.value());
    }
    return call;
  };
  hooks.control = [answer](const std::string& method, const std::string& request) {
    py::gil_scoped_acquire gil;
    kg::ControlAnswer out;
    try {
      auto result = (*answer)(method, py::bytes(request)).cast<py::tuple>();
      out.code = result[0].cast<int>();
      out.message = result[1].cast<std::string>();
      out.response = result[2].cast<std::string>();
    } catch (py::error_already_set& e) {
      out.code = static_cast<int>(grpc::StatusCode::UNKNOWN);
      out.message = std::string("Unexpected error in ") + method + ": " + std::string(py::str(e.value()));
    }
    return out;
  };
  return hooks;
}

// Shut down with the GIL released (its shutdown waits for gRPC's threads, which may be waiting for the GIL in a
// hook), then deleted with it held (the hooks hold Python callables). pybind11 drops objects with the GIL held.
struct FrontendDeleter {
  void operator()(kg::Frontend* frontend) const {
    {
      py::gil_scoped_release unlocked;
      frontend->shutdown(0);
    }
    delete frontend;
  }
};

}  // namespace

PYBIND11_MODULE(_response_path, m) {
  m.doc() = "The embedded Triton's response path in C++ (native/triton/response_path.hpp)";
  static py::exception<rp::CallError> call_error(m, "CallError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const rp::CallError& e) {
      py::tuple args = py::make_tuple(e.code, e.what());  // CallError(code, message)
      PyErr_SetObject(call_error.ptr(), args.ptr());
    }
  });

  py::class_<Library, std::shared_ptr<Library>>(m, "Library").def(py::init<const std::string&>(), py::arg("path"));

  py::class_<rp::Queue>(m, "ResponseQueue")
      .def(py::init([](std::shared_ptr<Library> library, size_t capacity) {
             return new rp::Queue(library->api, capacity);
           }),
           py::arg("library"), py::arg("capacity"), py::keep_alive<1, 2>())
      .def_property_readonly("fd", &rp::Queue::fd)
      .def(
          "submit",
          [](rp::Queue& q, uintptr_t server, const std::string& model, int64_t version, const std::string& id,
             const py::list& inputs, const std::vector<std::string>& outputs, const py::list& parameters) {
            std::vector<rp::Input> in;
            in.reserve(inputs.size());
            for (const py::handle item : inputs) {
              auto t = item.cast<py::tuple>();
              rp::Input input;
              input.name = t[0].cast<std::string>();
              input.datatype = t[1].cast<int>();
              input.shape = t[2].cast<std::vector<int64_t>>();
              input.data = t[3].cast<std::string>();
              in.push_back(std::move(input));
            }
            std::vector<rp::Parameter> params;
            for (const py::handle item : parameters) {
              auto t = item.cast<py::tuple>();
              rp::Parameter p;
              p.name = t[0].cast<std::string>();
              py::handle value = t[1];
              if (py::isinstance<py::bool_>(value)) {
                p.kind = rp::kParamBool;
                p.flag = value.cast<bool>();
              } else if (py::isinstance<py::int_>(value)) {
                p.kind = rp::kParamInt;
                p.integer = value.cast<int64_t>();
              } else if (py::isinstance<py::float_>(value)) {
                p.kind = rp::kParamDouble;
                p.number = value.cast<double>();
              } else if (py::isinstance<py::str>(value)) {
                p.kind = rp::kParamString;
                p.text = value.cast<std::string>();
              } else {
                throw py::type_error("parameter '" + p.name + "': " +
                                     std::string(py::str(py::type::handle_of(value).attr("__name__"))) +
                                     " is not a Triton parameter type (bool, int, float or str)");
              }
              params.push_back(std::move(p));
            }
            py::gil_scoped_release unlocked;
            return q.submit(reinterpret_cast<void*>(server), model, version, id, std::move(in), outputs,
                            std::move(params));
          },
          py::arg("server"), py::arg("model"), py::arg("version"), py::arg("request_id"), py::arg("inputs"),
          py::arg("outputs"), py::arg("parameters"))
      .def(
          "cancel",
          [](rp::Queue& q, uint64_t key) {
            py::gil_scoped_release unlocked;
            return q.cancel(key);
          },
          py::arg("key"))
      .def(
          "drain",
          [](rp::Queue& q, size_t max) {
            std::vector<rp::Record> records;
            {
              py::gil_scoped_release unlocked;
              records = q.drain(max);
            }
            py::list out;
            for (const rp::Record& r : records) out.append(record_tuple(r));
            return out;
          },
          py::arg("max") = static_cast<size_t>(1) << 30)
      .def("in_flight", &rp::Queue::in_flight)
      .def("waiting", &rp::Queue::waiting)
      .def("close", &rp::Queue::close);

  py::class_<kg::Frontend, std::unique_ptr<kg::Frontend, FrontendDeleter>>(m, "KServeGrpc")
      .def(py::init([](std::shared_ptr<Library> library, uintptr_t server, const std::string& address,
                       py::function open_call, py::function control, size_t capacity,
                       std::vector<std::string> api_keys) {
             kg::Hooks hooks = python_hooks(std::move(open_call), std::move(control));
             py::gil_scoped_release unlocked;
             return std::unique_ptr<kg::Frontend, FrontendDeleter>(
                 new kg::Frontend(library->api, reinterpret_cast<void*>(server), address, std::move(hooks),
                                  capacity, std::move(api_keys)));
           }),
           py::arg("library"), py::arg("server"), py::arg("address"), py::arg("open_call"), py::arg("control"),
           py::arg("capacity"), py::arg("api_keys") = std::vector<std::string>{}, py::keep_alive<1, 2>())
      .def_static(
          "authorization_error",
          [](const std::vector<std::string>& api_keys, std::optional<std::string> authorization) {
            return kg::authorization_error(api_keys, authorization ? &*authorization : nullptr);
          },
          py::arg("api_keys"), py::arg("authorization"),
          "The KServe gRPC front-end's key check as it runs per call: '' when `authorization` (the metadata's "
          "value, or None) presents one of `api_keys`, else the message UNAUTHENTICATED carries.")
      .def_property_readonly("port", &kg::Frontend::port)
      .def_property_readonly("records_fd", &kg::Frontend::records_fd)
      .def(
          "drain_records",
          [](kg::Frontend& f) {
            std::vector<kg::RequestRecord> records;
            {
              py::gil_scoped_release unlocked;
              records = f.drain_records();
            }
            py::list out;
            for (const kg::RequestRecord& r : records) {
              py::object first = r.first_response_s < 0 ? py::object(py::none()) : py::float_(r.first_response_s);
              py::object last = r.last_response_s < 0 ? py::object(py::none()) : py::float_(r.last_response_s);
              out.append(py::make_tuple(r.rpc, r.request_id, r.model, r.model_version,
                                        optional_text(r.call && r.call->has_trace, r.call ? r.call->trace_id : ""),
                                        optional_text(r.call && r.call->has_experiment,
                                                      r.call ? r.call->experiment : ""),
                                        r.status, r.duration_s, std::move(first), std::move(last)));
            }
            return out;
          })
      .def("shutdown", &kg::Frontend::shutdown, py::arg("grace_s"), py::call_guard<py::gil_scoped_release>());
}
