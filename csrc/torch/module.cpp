// An empty Python module: importing comera._C loads this shared library,
// whose static initialisers register the comera:: operators with torch.
#include <Python.h>

extern "C" {
PyObject *PyInit__C(void) {
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
    return PyModule_Create(&def);
}
}
