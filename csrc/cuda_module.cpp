// comera._C_cuda: the CUDA kernels as a second Python extension module.
//
// comera._C (csrc/registration.cpp) defines every operator schema and
// registers the CPU kernels; this module holds the same glue
// (csrc/<op>/op.cpp) compiled with COMERA_WITH_CUDA, which registers only
// the CUDA kernels (csrc/<op>/*.cu), so no kernel is registered twice.  It
// is built with nvcc against torch's stable headers alone, so a wheel built
// with a CPU-only torch carries it; comera/_cuda.py imports it only when the
// running torch has CUDA (its libcudart and libcublas are then loaded).
#include <Python.h>
#include <cuda_runtime_api.h>

// The module's one attribute: the CUDA runtime version it was compiled
// against (e.g. 13000 for 13.0), for comera.cuda_kernels().
extern "C" {
PyObject *PyInit__C_cuda(void) {
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr};
    PyObject *m = PyModule_Create(&def);
    if (m != nullptr && PyModule_AddIntConstant(m, "cuda_runtime_version", CUDART_VERSION) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
}
