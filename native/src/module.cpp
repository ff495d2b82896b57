// Python bindings of the constraint engine (pybind11). The engine itself arrives with its issue; this module
// already carries the build (scikit-build-core + CMake) through to an importable extension.
#include <pybind11/pybind11.h>

#include <thread>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "llm-serving native constraint engine";
  m.attr("ABI_VERSION") = 1;
  m.def("hardware_threads", []() { return static_cast<int>(std::thread::hardware_concurrency()); },
        "Number of hardware threads the engine's thread pool may use.");
}
