// The CPython extension module `sparsejax._cpu_ext` (plain C API, no pybind).
//
//   registrations()  {target_name: PyCapsule(XLA FFI handler)}; the Python side
//                    (sparsejax/ops/_cpu_ffi.py) registers each with
//                    `jax.ffi.register_ffi_target(name, capsule, platform="cpu")`.
//   optimizers()     {code: (class name, slot count)} for sparse_apply (optimizers.h),
//                    checked against sparsejax/ops/optimizers.py before registering.
//
//   IdMapCore, unique_keys   the ID map of dynamic tables (id_map.cc; plain Python
//                    objects, not FFI targets), wrapped by sparsejax/embedding/_id_map.py.
//   parse_criteo     the Criteo TSV parser (text.cc) of sparsejax/data/_criteo.py.
//   HttpFront        the HTTP/1.1 prediction path of `sparsejax serve` outside the GIL
//                    (http_front.cc), wrapped by sparsejax/serving/_front.py.
//
// The kernels: spmm.cc (spmm, segment_max), sparse_apply.cc, interaction.cc
// (pairwise_dots), quantized_bag.cc, all on the worker pool of worker_pool.cc.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common.h"
#include "optimizers.h"

namespace sparsejax {
int AddIdMap(PyObject* module);  // id_map.cc
int AddText(PyObject* module);   // text.cc
int AddHttpFront(PyObject* module);  // http_front.cc
}  // namespace sparsejax

extern "C" XLA_FFI_Error* SparsejaxQuantizedBag(XLA_FFI_CallFrame* call_frame);  // quantized_bag.cc

namespace {

struct Target {
  const char* name;
  XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*);
};

constexpr Target kTargets[] = {
    {"sparsejax_spmm", SparsejaxSpmm},
    {"sparsejax_segment_max", SparsejaxSegmentMax},
    {"sparsejax_sparse_apply", SparsejaxSparseApply},
    {"sparsejax_pairwise_dots", SparsejaxPairwiseDots},
    {"sparsejax_pairwise_dots_bwd", SparsejaxPairwiseDotsBwd},
    {"sparsejax_quantized_bag", SparsejaxQuantizedBag},
};

// Sets dict[key] = value and drops the reference to value; -1 on error.
int SetItem(PyObject* dict, PyObject* key, PyObject* value) {
  const int rc = (key == nullptr || value == nullptr) ? -1 : PyDict_SetItem(dict, key, value);
  Py_XDECREF(key);
  Py_XDECREF(value);
  return rc;
}

PyObject* Registrations(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  for (const Target& t : kTargets) {
    if (SetItem(d, PyUnicode_FromString(t.name),
                PyCapsule_New(reinterpret_cast<void*>(t.handler), nullptr, nullptr)) < 0) {
      Py_DECREF(d);
      return nullptr;
    }
  }
  return d;
}

PyObject* Optimizers(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  for (const sparsejax::OptimizerInfo& o : sparsejax::kOptimizers) {
    if (SetItem(d, PyLong_FromLong(o.code), Py_BuildValue("(si)", o.name, o.num_slots)) < 0) {
      Py_DECREF(d);
      return nullptr;
    }
  }
  return d;
}

PyMethodDef kMethods[] = {
    {"registrations", Registrations, METH_NOARGS,
     "Dict {ffi target name: PyCapsule(XLA FFI handler)} for jax.ffi.register_ffi_target."},
    {"optimizers", Optimizers, METH_NOARGS,
     "Dict {optimizer code: (class name, slot count)} that sparse_apply was built with."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_cpu_ext",
    "sparsejax XLA FFI CPU kernels (spmm, segment_max, sparse_apply, pairwise_dots, "
    "quantized_bag).", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_ext(void) {
  PyObject* m = PyModule_Create(&kModule);
  if (m != nullptr && (sparsejax::AddIdMap(m) < 0 || sparsejax::AddText(m) < 0 ||
                    sparsejax::AddHttpFront(m) < 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
