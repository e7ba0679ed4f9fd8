// The Criteo TSV parser of `sparsejax._cpu_ext` (a plain function, not an FFI target),
// used by sparsejax/data/_criteo.py `CriteoParser` in place of its numpy path.
//
//   parse_criteo(data, labeled, out: int64[n * 41], line_start: int64[n + 1]) -> None
//   count_lines(data) -> the newlines in data
//
// `data` holds n whole lines, each ending with "\n", no "\r". Row i of out is
// [label, I1..I13, C1..C26, bad]: label 0/1 (the field must be exactly "0" or "1"),
// dense decimal integers (empty -> 0; an optional "-" and 1 to 18 digits), categorical
// ids of 1 to 8 hex digits (empty -> -1), and bad = 1 when the line is anything else
// (another field count, a stray byte, a longer number). Bad lines are re-parsed one by
// one by the Python side, which names the reason or accepts them, so this parser may
// flag more than it must but never accepts a line the Python rules reject, and what it
// accepts it parses to the same values. line_start[i] is the byte offset of line i
// (line_start[n] = len(data)). Lines are parsed in parallel on the worker pool, with the
// GIL released.

#include <cstdint>
#include <cstring>

#include "py_buffer.h"
#include "worker_pool.h"

namespace sparsejax {
namespace {

constexpr int kDense = 13;
constexpr int kCategorical = 26;
constexpr int kRow = 1 + kDense + kCategorical + 1;  // label, dense, ids, bad

// Hex digit values; 16 and above: not a hex digit.
struct HexTable {
  uint8_t v[256];
  constexpr HexTable() : v() {
    for (int c = 0; c < 256; ++c) v[c] = 255;
    for (int c = 0; c < 10; ++c) v['0' + c] = static_cast<uint8_t>(c);
    for (int c = 0; c < 6; ++c) v['a' + c] = v['A' + c] = static_cast<uint8_t>(10 + c);
  }
};
constexpr HexTable kHex;

// Parses the line [p, end) into row; false when it is bad (row is then partly written).
bool ParseLine(const unsigned char* p, const unsigned char* end, bool labeled, int64_t* row) {
  if (labeled) {
    if (end - p < 2 || (p[0] != '0' && p[0] != '1') || p[1] != '\t') return false;
    row[0] = p[0] - '0';
    p += 2;
  } else {
    row[0] = 0;
  }
  for (int j = 0; j < kDense; ++j) {
    const bool neg = p < end && *p == '-';
    const unsigned char* q = p + neg;
    int64_t v = 0;
    int digits = 0;
    while (q < end && *q >= '0' && *q <= '9') {
      v = v * 10 + (*q++ - '0');
      if (++digits > 18) return false;
    }
    if ((neg && digits == 0) || q == end || *q != '\t') return false;
    row[1 + j] = neg ? -v : v;
    p = q + 1;
  }
  for (int j = 0; j < kCategorical; ++j) {
    int64_t v = 0;
    int digits = 0;
    unsigned d;
    while (p < end && (d = kHex.v[*p]) < 16) {
      v = (v << 4) | d;
      ++p;
      if (++digits > 8) return false;
    }
    const bool last = j == kCategorical - 1;
    if (last ? p != end : (p == end || *p != '\t')) return false;
    row[1 + kDense + j] = digits ? v : -1;
    ++p;
  }
  return true;
}

PyObject* PyParseCriteo(PyObject*, PyObject* args) {
  PyObject *data_obj, *out_obj, *start_obj;
  int labeled;
  if (!PyArg_ParseTuple(args, "OpOO", &data_obj, &labeled, &out_obj, &start_obj)) {
    return nullptr;
  }
  Py_buffer data{};
  if (PyObject_GetBuffer(data_obj, &data, PyBUF_SIMPLE) < 0) return nullptr;
  Buffer out, starts;
  if (!out.Get(out_obj, 8, true, "parse_criteo out") ||
      !starts.Get(start_obj, 8, true, "parse_criteo line_start")) {
    PyBuffer_Release(&data);
    return nullptr;
  }
  const int64_t n = starts.size() - 1;
  const auto* bytes = static_cast<const unsigned char*>(data.buf);
  const int64_t len = data.len;
  if (n < 0 || out.size() != n * kRow || (len > 0 && bytes[len - 1] != '\n')) {
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_ValueError,
                    "parse_criteo: out must hold 41 int64 per line, line_start n + 1, and "
                    "data must end with a newline");
    return nullptr;
  }
  int64_t* row = out.data<int64_t>();
  int64_t* line = starts.data<int64_t>();
  bool counted = true;
  const bool ok = WithoutGil(
      [&] {
        int64_t i = 0;
        for (const unsigned char *p = bytes, *e = bytes + len; p < e && i < n; ++i) {
          line[i] = p - bytes;
          const void* nl = std::memchr(p, '\n', e - p);
          p = static_cast<const unsigned char*>(nl) + 1;
        }
        line[n] = len;
        if (i != n) {
          counted = false;
          return;
        }
        ParallelRange(n, 1024, [&](int64_t lo, int64_t hi) {
          for (int64_t k = lo; k < hi; ++k) {
            int64_t* r = row + k * kRow;
            const bool good = ParseLine(bytes + line[k], bytes + line[k + 1] - 1, labeled, r);
            r[kRow - 1] = !good;
          }
        });
      },
      "parse_criteo: out of memory");
  PyBuffer_Release(&data);
  if (!ok) return nullptr;
  if (!counted) {
    PyErr_SetString(PyExc_ValueError, "parse_criteo: data has fewer lines than line_start");
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* PyCountLines(PyObject*, PyObject* arg) {
  Py_buffer data{};
  if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) return nullptr;
  int64_t n = 0;
  Py_BEGIN_ALLOW_THREADS;
  const auto* p = static_cast<const char*>(data.buf);
  const char* e = p + data.len;
  while (p < e && (p = static_cast<const char*>(std::memchr(p, '\n', e - p))) != nullptr) {
    ++n;
    ++p;
  }
  Py_END_ALLOW_THREADS;
  PyBuffer_Release(&data);
  return PyLong_FromLongLong(n);
}

PyMethodDef kTextFunctions[] = {
    {"count_lines", PyCountLines, METH_O,
     "count_lines(data: bytes) -> the number of b'\\n' in data (memchr, without the GIL)."},
    {"parse_criteo", PyParseCriteo, METH_VARARGS,
     "parse_criteo(data: bytes, labeled: bool, out: int64[n*41], line_start: int64[n+1]): "
     "rows [label, I1..I13, C1..C26, bad] of n Criteo TSV lines (see csrc/text.cc)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// Adds parse_criteo and count_lines to the module; -1 with an exception set on failure.
int AddText(PyObject* module) { return PyModule_AddFunctions(module, kTextFunctions); }

}  // namespace sparsejax
