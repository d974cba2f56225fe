// tokenloom native helpers (pybind11 module tokenloom._native).
// Each function here has a numpy reference with the same signature in
// tokenloom/blending/; tests compare the two on random inputs.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
    m.doc() = "tokenloom native index builders";
    m.attr("ABI_VERSION") = 1;
}
