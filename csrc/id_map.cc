// The ID map of dynamic embedding tables: an int64 key -> int32 value hash table, and
// `unique_keys` (first-appearance unique, inverse, counts). Python: `_cpu_ext.IdMapCore`
// and `_cpu_ext.unique_keys`, wrapped by sparsejax/embedding/_id_map.py (which validates
// dtypes and values; the checks here only keep the table memory-safe).
//
// Layout: open addressing with linear probing over 16-byte slots {~key, value}, four to
// a 64-byte cache line, so a probe is one line (and usually one probe: the load factor
// stays <= 0.5). Storing ~key makes the reserved key -1 (EMPTY_KEY) a zero tag: a fresh
// calloc'd table is all empty without a fill pass, and the kernel zero-fills its pages
// lazily. Deletion shifts the following cluster back (no tombstones), so lookups never
// slow down with churn. Growth doubles the slot count and rehashes.
//
// Throughput: a random lookup in a table of GiBs is a DRAM miss (~100 ns), so each batch
// loop hashes the key kPrefetchDistance positions ahead and prefetches its bucket: many
// misses in flight instead of one; tables of 1 GiB or more use huge pages (AllocSlots).
//
// Threads: each call runs on the calling thread with the GIL released; a per-table mutex
// serializes calls on the same table (different tables run in parallel).

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "py_buffer.h"

namespace sparsejax {
namespace {

#define SJ_IDMAP_INLINE inline __attribute__((always_inline))

constexpr int64_t kPrefetchDistance = 16;  // keys hashed ahead; a power of two
constexpr int64_t kMinSlots = 16;

// murmur3's 64-bit finalizer: every input bit affects every output bit.
SJ_IDMAP_INLINE uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

struct Slot {
  uint64_t tag;   // ~key; 0 = empty (key -1 is never stored)
  int32_t value;  // the IdMap's value; for unique_keys' scratch table, the unique index
  int32_t pad;
};
static_assert(sizeof(Slot) == 16, "four slots per cache line");

SJ_IDMAP_INLINE uint64_t Tag(int64_t key) { return ~static_cast<uint64_t>(key); }

// Slot arrays of 64 MiB or more are mmap'd 2 MiB-aligned; from 1 GiB on (3.4e7 keys)
// they are advised MADV_HUGEPAGE. Measured on this VM: at 1e8 keys (4 GiB) lookups are
// 2.5-3x faster with huge pages (with 4 KiB pages nearly every probe's page walk misses
// the cache), at 1e7 keys (512 MiB) no faster; the price is paid when the memory is
// first touched (the kernel compacts memory to find huge pages: 10 s instead of 3 s for
// 4 GiB), so smaller tables skip it. SPARSEJAX_HUGE_PAGES=0 turns it off, as for the
// kernels (common.cc).
constexpr size_t kMmapMinBytes = size_t{64} << 20;
constexpr size_t kHugeMinBytes = size_t{1} << 30;
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

bool UseHugePages() {
  static const bool on = [] {
    const char* e = std::getenv("SPARSEJAX_HUGE_PAGES");
    return e == nullptr || *e == '\0' || std::strtol(e, nullptr, 10) != 0;
  }();
  return on;
}

// Zeroed slots (all empty: the kernel zero-fills pages lazily, no fill pass); nullptr
// when out of memory. Free with FreeSlots(p, n).
Slot* AllocSlots(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(Slot);
  if (bytes < kMmapMinBytes) return static_cast<Slot*>(std::calloc(bytes, 1));
  const size_t len = bytes + kHugePage;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t b = (a + kHugePage - 1) & ~(kHugePage - 1);
  if (b > a) munmap(p, b - a);
  if (a + len > b + bytes) munmap(reinterpret_cast<void*>(b + bytes), a + len - (b + bytes));
#ifdef MADV_HUGEPAGE
  if (bytes >= kHugeMinBytes && UseHugePages()) {
    madvise(reinterpret_cast<void*>(b), bytes, MADV_HUGEPAGE);
  }
#endif
  return reinterpret_cast<Slot*>(b);
}

void FreeSlots(Slot* p, int64_t n) {
  if (p == nullptr) return;
  const size_t bytes = static_cast<size_t>(n) * sizeof(Slot);
  if (bytes < kMmapMinBytes) {
    std::free(p);
  } else {
    munmap(p, bytes);
  }
}

// Calls fn(i, hash of keys[i]) for i in [0, n) in order, prefetching the bucket of key
// i + kPrefetchDistance first (RW: 0 read, 1 write).
template <int RW, typename Fn>
SJ_IDMAP_INLINE void ForEachPrefetched(const int64_t* keys, int64_t n, const Slot* slots,
                                       uint64_t mask, Fn&& fn) {
  constexpr int64_t D = kPrefetchDistance;
  uint64_t ring[D];
  const int64_t head = std::min(n, D);
  for (int64_t i = 0; i < head; ++i) {
    ring[i] = Mix(static_cast<uint64_t>(keys[i]));
    __builtin_prefetch(&slots[ring[i] & mask], RW, 3);
  }
  int64_t i = 0;
  for (; i + D < n; ++i) {
    const uint64_t h = ring[i & (D - 1)];
    const uint64_t ahead = Mix(static_cast<uint64_t>(keys[i + D]));
    ring[(i + D) & (D - 1)] = ahead;
    __builtin_prefetch(&slots[ahead & mask], RW, 3);
    fn(i, h);
  }
  for (; i < n; ++i) fn(i, ring[i & (D - 1)]);
}

// Slot count for `keys` keys at load factor <= 0.5.
int64_t SlotsFor(int64_t keys) {
  int64_t s = kMinSlots;
  while (s / 2 < keys) s *= 2;
  return s;
}

class Table {
 public:
  explicit Table(int64_t capacity) {
    num_slots_ = SlotsFor(capacity);
    slots_ = AllocSlots(num_slots_);
    if (slots_ == nullptr) throw std::bad_alloc();
    mask_ = static_cast<uint64_t>(num_slots_ - 1);
  }
  ~Table() { FreeSlots(slots_, num_slots_); }
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  int64_t size() const { return size_; }
  int64_t num_slots() const { return num_slots_; }
  int64_t nbytes() const { return num_slots_ * static_cast<int64_t>(sizeof(Slot)); }
  std::mutex& mu() { return mu_; }

  void Lookup(const int64_t* keys, int64_t n, int32_t* out) const {
    const Slot* slots = slots_;
    const uint64_t mask = mask_;
    ForEachPrefetched<0>(keys, n, slots, mask, [&](int64_t i, uint64_t h) {
      const uint64_t tag = Tag(keys[i]);
      int32_t v = -1;
      if (tag != 0) {
        for (uint64_t p = h & mask;; p = (p + 1) & mask) {
          const Slot& s = slots[p];
          if (s.tag == tag) {
            v = s.value;
            break;
          }
          if (s.tag == 0) break;
        }
      }
      out[i] = v;
    });
  }

  // Sets keys[i] -> values[i] in order (a later duplicate wins); skips EMPTY_KEY.
  void Insert(const int64_t* keys, const int32_t* values, int64_t n) {
    int64_t c = 0;
    while (c < n) {
      int64_t room = num_slots_ / 2 - size_;
      if (room <= 0) {
        Rehash(num_slots_ * 2);
        continue;
      }
      // Within a chunk no insert can pass the load limit, so the table does not move.
      const int64_t m = std::min(n - c, room);
      const int64_t* k = keys + c;
      const int32_t* v = values + c;
      Slot* slots = slots_;
      const uint64_t mask = mask_;
      int64_t added = 0;
      ForEachPrefetched<1>(k, m, slots, mask, [&](int64_t i, uint64_t h) {
        const uint64_t tag = Tag(k[i]);
        if (tag == 0) return;
        for (uint64_t p = h & mask;; p = (p + 1) & mask) {
          Slot& s = slots[p];
          if (s.tag == tag) {
            s.value = v[i];
            return;
          }
          if (s.tag == 0) {
            s.tag = tag;
            s.value = v[i];
            ++added;
            return;
          }
        }
      });
      size_ += added;
      c += m;
    }
  }

  // out[i] = the value keys[i] had (-1 where absent), and removes it.
  void Erase(const int64_t* keys, int64_t n, int32_t* out) {
    Slot* slots = slots_;
    const uint64_t mask = mask_;
    int64_t removed = 0;
    ForEachPrefetched<1>(keys, n, slots, mask, [&](int64_t i, uint64_t h) {
      const uint64_t tag = Tag(keys[i]);
      out[i] = -1;
      if (tag == 0) return;
      uint64_t hole = h & mask;
      for (;; hole = (hole + 1) & mask) {
        if (slots[hole].tag == tag) break;
        if (slots[hole].tag == 0) return;
      }
      out[i] = slots[hole].value;
      ++removed;
      // Backward shift: move each later entry of the cluster whose home is not in
      // (hole, j] into the hole, so every entry stays reachable from its home.
      for (uint64_t j = (hole + 1) & mask;; j = (j + 1) & mask) {
        const Slot s = slots[j];
        if (s.tag == 0) break;
        const uint64_t home = Mix(~s.tag) & mask;
        if (((j - home) & mask) >= ((j - hole) & mask)) {
          slots[hole] = s;
          hole = j;
        }
      }
      slots[hole] = Slot{0, 0, 0};
    });
    size_ -= removed;
  }

  // Writes the live (key, value) pairs in slot order; returns how many (at most cap).
  int64_t Items(int64_t* keys, int32_t* values, int64_t cap) const {
    int64_t k = 0;
    for (int64_t p = 0; p < num_slots_ && k < cap; ++p) {
      const Slot& s = slots_[p];
      if (s.tag != 0) {
        keys[k] = static_cast<int64_t>(~s.tag);
        values[k] = s.value;
        ++k;
      }
    }
    return k;
  }

 private:
  void Rehash(int64_t new_slots) {
    Slot* fresh = AllocSlots(new_slots);
    if (fresh == nullptr) throw std::bad_alloc();
    const uint64_t mask = static_cast<uint64_t>(new_slots - 1);
    // Old slots are read in order from just after an empty one (no cluster wraps across
    // the start), and an entry's new home is its old home or that plus the old size, so
    // the writes go to two nearly sequential streams: no random DRAM access, no prefetch.
    int64_t start = 0;
    while (slots_[start].tag != 0) ++start;
    for (int64_t k = 1; k <= num_slots_; ++k) {
      const Slot s = slots_[(start + k) & (num_slots_ - 1)];
      if (s.tag == 0) continue;
      uint64_t q = Mix(~s.tag) & mask;
      while (fresh[q].tag != 0) q = (q + 1) & mask;
      fresh[q] = s;
    }
    FreeSlots(slots_, num_slots_);
    slots_ = fresh;
    num_slots_ = new_slots;
    mask_ = mask;
  }

  Slot* slots_ = nullptr;
  int64_t num_slots_ = 0;
  uint64_t mask_ = 0;
  int64_t size_ = 0;
  std::mutex mu_;
};

// Scratch table of unique_keys, kept per thread (zeroed between calls by clearing the
// slots it used) up to kMaxKeptScratch slots; larger calls allocate their own.
constexpr int64_t kMaxKeptScratch = int64_t{1} << 22;  // 64 MiB

struct Scratch {
  Slot* slots = nullptr;
  int64_t num_slots = 0;
  std::vector<uint64_t> used;  // slots filled by the current call
  ~Scratch() { FreeSlots(slots, num_slots); }
};

// uniq[0, u) = the distinct keys other than -1 in order of first appearance,
// inverse[i] = index of keys[i] in uniq (-1 for key -1), counts[j] = occurrences; returns u.
int64_t UniqueKeys(const int64_t* keys, int64_t n, int64_t* uniq, int32_t* inverse,
                   int32_t* counts) {
  static thread_local Scratch kept;
  const int64_t want = SlotsFor(n);
  Slot* slots;
  bool own = false;
  if (want <= kMaxKeptScratch) {
    if (kept.num_slots < want) {
      Slot* s = AllocSlots(want);
      if (s == nullptr) throw std::bad_alloc();
      FreeSlots(kept.slots, kept.num_slots);
      kept.slots = s;
      kept.num_slots = want;
    }
    slots = kept.slots;
    kept.used.clear();
    kept.used.reserve(static_cast<size_t>(n));
  } else {
    slots = AllocSlots(want);
    if (slots == nullptr) throw std::bad_alloc();
    own = true;
  }
  // A kept table larger than this call needs is probed with its full mask: still empty
  // except for this call's keys.
  const uint64_t mask = static_cast<uint64_t>((own ? want : kept.num_slots) - 1);
  std::vector<uint64_t>* used = own ? nullptr : &kept.used;
  int64_t u = 0;
  ForEachPrefetched<1>(keys, n, slots, mask, [&](int64_t i, uint64_t h) {
    const uint64_t tag = Tag(keys[i]);
    if (tag == 0) {
      inverse[i] = -1;
      return;
    }
    for (uint64_t p = h & mask;; p = (p + 1) & mask) {
      Slot& s = slots[p];
      if (s.tag == tag) {
        inverse[i] = s.value;
        ++counts[s.value];
        return;
      }
      if (s.tag == 0) {
        s.tag = tag;
        s.value = static_cast<int32_t>(u);
        uniq[u] = keys[i];
        counts[u] = 1;
        inverse[i] = static_cast<int32_t>(u);
        ++u;
        if (used != nullptr) used->push_back(p);
        return;
      }
    }
  });
  if (own) {
    FreeSlots(slots, want);
  } else {
    for (uint64_t p : kept.used) slots[p] = Slot{0, 0, 0};
  }
  return u;
}

// ---------------------------------------------------------------- Python bindings

bool SameSize(const Buffer& a, const Buffer& b, const char* what) {
  if (a.size() == b.size()) return true;
  PyErr_Format(PyExc_ValueError, "%s: %lld keys but %lld %s", what,
               static_cast<long long>(a.size()), static_cast<long long>(b.size()), what);
  return false;
}


struct PyIdMap {
  PyObject_HEAD Table* table;
};

PyObject* IdMapNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"capacity", nullptr};
  long long capacity = 1024;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|L", const_cast<char**>(kwlist), &capacity)) {
    return nullptr;
  }
  if (capacity < 0 || capacity > (int64_t{1} << 40)) {
    PyErr_Format(PyExc_ValueError, "IdMapCore: capacity must be in [0, 2**40], got %lld",
                 capacity);
    return nullptr;
  }
  PyIdMap* self = reinterpret_cast<PyIdMap*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  try {
    self->table = new Table(capacity);
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

void IdMapDealloc(PyObject* obj) {
  PyIdMap* self = reinterpret_cast<PyIdMap*>(obj);
  delete self->table;
  self->table = nullptr;
  PyTypeObject* type = Py_TYPE(obj);
  type->tp_free(obj);
  Py_DECREF(type);  // heap type
}

Table* TableOf(PyObject* obj) { return reinterpret_cast<PyIdMap*>(obj)->table; }

PyObject* IdMapLookup(PyObject* self, PyObject* args) {
  PyObject *keys_obj, *out_obj;
  if (!PyArg_ParseTuple(args, "OO", &keys_obj, &out_obj)) return nullptr;
  Buffer keys, out;
  if (!keys.Get(keys_obj, 8, false, "lookup keys") || !out.Get(out_obj, 4, true, "lookup out") ||
      !SameSize(keys, out, "outputs")) {
    return nullptr;
  }
  Table* t = TableOf(self);
  if (!WithoutGil([&] {
        std::lock_guard<std::mutex> lk(t->mu());
        t->Lookup(keys.data<int64_t>(), keys.size(), out.data<int32_t>());
      })) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* IdMapInsert(PyObject* self, PyObject* args) {
  PyObject *keys_obj, *values_obj;
  if (!PyArg_ParseTuple(args, "OO", &keys_obj, &values_obj)) return nullptr;
  Buffer keys, values;
  if (!keys.Get(keys_obj, 8, false, "insert keys") ||
      !values.Get(values_obj, 4, false, "insert values") || !SameSize(keys, values, "values")) {
    return nullptr;
  }
  Table* t = TableOf(self);
  if (!WithoutGil([&] {
        std::lock_guard<std::mutex> lk(t->mu());
        t->Insert(keys.data<int64_t>(), values.data<int32_t>(), keys.size());
      })) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* IdMapErase(PyObject* self, PyObject* args) {
  PyObject *keys_obj, *out_obj;
  if (!PyArg_ParseTuple(args, "OO", &keys_obj, &out_obj)) return nullptr;
  Buffer keys, out;
  if (!keys.Get(keys_obj, 8, false, "erase keys") || !out.Get(out_obj, 4, true, "erase out") ||
      !SameSize(keys, out, "outputs")) {
    return nullptr;
  }
  Table* t = TableOf(self);
  if (!WithoutGil([&] {
        std::lock_guard<std::mutex> lk(t->mu());
        t->Erase(keys.data<int64_t>(), keys.size(), out.data<int32_t>());
      })) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* IdMapItems(PyObject* self, PyObject* args) {
  PyObject *keys_obj, *values_obj;
  if (!PyArg_ParseTuple(args, "OO", &keys_obj, &values_obj)) return nullptr;
  Buffer keys, values;
  if (!keys.Get(keys_obj, 8, true, "items keys") ||
      !values.Get(values_obj, 4, true, "items values") || !SameSize(keys, values, "values")) {
    return nullptr;
  }
  Table* t = TableOf(self);
  int64_t written = 0;
  if (!WithoutGil([&] {
        std::lock_guard<std::mutex> lk(t->mu());
        written = t->Items(keys.data<int64_t>(), values.data<int32_t>(), keys.size());
      })) {
    return nullptr;
  }
  return PyLong_FromLongLong(written);
}

PyObject* IdMapSize(PyObject* self, PyObject*) {
  Table* t = TableOf(self);
  std::lock_guard<std::mutex> lk(t->mu());
  return PyLong_FromLongLong(t->size());
}

PyObject* IdMapNumSlots(PyObject* self, PyObject*) {
  Table* t = TableOf(self);
  std::lock_guard<std::mutex> lk(t->mu());
  return PyLong_FromLongLong(t->num_slots());
}

PyObject* IdMapNbytes(PyObject* self, PyObject*) {
  Table* t = TableOf(self);
  std::lock_guard<std::mutex> lk(t->mu());
  return PyLong_FromLongLong(t->nbytes());
}

Py_ssize_t IdMapLen(PyObject* self) {
  Table* t = TableOf(self);
  std::lock_guard<std::mutex> lk(t->mu());
  return static_cast<Py_ssize_t>(t->size());
}

PyMethodDef kIdMapMethods[] = {
    {"lookup", IdMapLookup, METH_VARARGS,
     "lookup(keys: int64[n], out: int32[n]): out[i] = value of keys[i], -1 where absent."},
    {"insert", IdMapInsert, METH_VARARGS,
     "insert(keys: int64[n], values: int32[n]): sets each key (a later duplicate wins)."},
    {"erase", IdMapErase, METH_VARARGS,
     "erase(keys: int64[n], out: int32[n]): removes keys; out = old values, -1 where absent."},
    {"items", IdMapItems, METH_VARARGS,
     "items(keys_out: int64[m], values_out: int32[m]) -> count written (slot order)."},
    {"size", IdMapSize, METH_NOARGS, "Live keys."},
    {"num_slots", IdMapNumSlots, METH_NOARGS, "Slots allocated (a power of two)."},
    {"nbytes", IdMapNbytes, METH_NOARGS, "Bytes of the slot array (16 per slot)."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot kIdMapSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(IdMapNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(IdMapDealloc)},
    {Py_tp_methods, kIdMapMethods},
    {Py_sq_length, reinterpret_cast<void*>(IdMapLen)},
    {Py_tp_doc, const_cast<char*>("IdMapCore(capacity=1024): int64 key -> int32 value hash table "
                                  "(open addressing, linear probing); key -1 is reserved.")},
    {0, nullptr},
};

PyType_Spec kIdMapSpec = {
    "sparsejax._cpu_ext.IdMapCore",
    sizeof(PyIdMap),
    0,
    Py_TPFLAGS_DEFAULT,
    kIdMapSlots,
};

PyObject* PyUniqueKeys(PyObject*, PyObject* args) {
  PyObject *keys_obj, *uniq_obj, *inverse_obj, *counts_obj;
  if (!PyArg_ParseTuple(args, "OOOO", &keys_obj, &uniq_obj, &inverse_obj, &counts_obj)) {
    return nullptr;
  }
  Buffer keys, uniq, inverse, counts;
  if (!keys.Get(keys_obj, 8, false, "unique_keys keys") ||
      !uniq.Get(uniq_obj, 8, true, "unique_keys uniq") ||
      !inverse.Get(inverse_obj, 4, true, "unique_keys inverse") ||
      !counts.Get(counts_obj, 4, true, "unique_keys counts") ||
      !SameSize(keys, uniq, "uniq") || !SameSize(keys, inverse, "inverse") ||
      !SameSize(keys, counts, "counts")) {
    return nullptr;
  }
  if (keys.size() >= (int64_t{1} << 31)) {
    PyErr_SetString(PyExc_ValueError, "unique_keys: at most 2**31 - 1 keys (int32 inverse)");
    return nullptr;
  }
  int64_t u = 0;
  if (!WithoutGil([&] {
        u = UniqueKeys(keys.data<int64_t>(), keys.size(), uniq.data<int64_t>(),
                       inverse.data<int32_t>(), counts.data<int32_t>());
      })) {
    return nullptr;
  }
  return PyLong_FromLongLong(u);
}

PyMethodDef kIdMapFunctions[] = {
    {"unique_keys", PyUniqueKeys, METH_VARARGS,
     "unique_keys(keys: int64[n], uniq: int64[n], inverse: int32[n], counts: int32[n]) -> u: "
     "uniq[:u] in first-appearance order, key -1 skipped (inverse -1)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// Adds IdMapCore and unique_keys to the module; -1 with an exception set on failure.
int AddIdMap(PyObject* module) {
  PyObject* type = PyType_FromSpec(&kIdMapSpec);
  if (type == nullptr) return -1;
  if (PyModule_AddObject(module, "IdMapCore", type) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return PyModule_AddFunctions(module, kIdMapFunctions);
}

}  // namespace sparsejax
