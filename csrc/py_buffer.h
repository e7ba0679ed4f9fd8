// Python-side helpers of `sparsejax._cpu_ext`'s plain functions (id_map.cc, text.cc):
// integer buffers passed from numpy, and running C++ with the GIL released.

#ifndef SPARSEJAX_CSRC_PY_BUFFER_H_
#define SPARSEJAX_CSRC_PY_BUFFER_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <new>

namespace sparsejax {

// A C-contiguous 1-D buffer of 8- or 4-byte signed integers, released on destruction.
class Buffer {
 public:
  ~Buffer() {
    if (ok_) PyBuffer_Release(&view_);
  }
  // False with a Python exception set when `obj` is not a contiguous 1-D buffer of
  // signed integers of `itemsize` bytes (writable if asked).
  bool Get(PyObject* obj, Py_ssize_t itemsize, bool writable, const char* name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view_, flags) < 0) return false;
    ok_ = true;
    const char* f = view_.format == nullptr ? "B" : view_.format;
    if (*f == '@' || *f == '=' || *f == '<') ++f;
    const bool int_format = f[1] == '\0' && (f[0] == 'q' || f[0] == 'l' || f[0] == 'i');
    if (view_.ndim != 1 || view_.itemsize != itemsize || !int_format) {
      PyErr_Format(PyExc_TypeError, "%s: expected a 1-D int%d buffer (format '%s', ndim %d)",
                   name, static_cast<int>(itemsize * 8), view_.format ? view_.format : "B",
                   view_.ndim);
      return false;
    }
    return true;
  }
  int64_t size() const { return view_.shape != nullptr ? view_.shape[0] : view_.len / 8; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(view_.buf);
  }

 private:
  Py_buffer view_{};
  bool ok_ = false;
};

// Runs fn() with the GIL released; a C++ exception becomes a Python MemoryError (`what`) /
// RuntimeError. Returns false with the exception set.
template <typename Fn>
inline bool WithoutGil(Fn&& fn, const char* what = "IdMap: out of memory while growing the table") {
  bool bad_alloc = false;
  bool other = false;
  Py_BEGIN_ALLOW_THREADS;
  try {
    fn();
  } catch (const std::bad_alloc&) {
    bad_alloc = true;
  } catch (...) {
    other = true;
  }
  Py_END_ALLOW_THREADS;
  if (bad_alloc) {
    PyErr_SetString(PyExc_MemoryError, what);
    return false;
  }
  if (other) {
    PyErr_SetString(PyExc_RuntimeError, "sparsejax._cpu_ext: unexpected C++ exception");
    return false;
  }
  return true;
}

}  // namespace sparsejax

#endif  // SPARSEJAX_CSRC_PY_BUFFER_H_
