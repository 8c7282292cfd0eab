/* The prefix cache's chain keys (pagedjax/host/cache/prefix_cache.py chain_keys) in C: a
 * Python extension module, compiled at first use by native_keys.py, that computes exactly what
 * the pure-Python loop does, without its per-block interpreter work.
 *
 *   chain_keys(token_ids, start, num_blocks, block_size, head) -> list of int
 *
 * Block b (b = 0 .. num_blocks - 1) covers token_ids[start + b * block_size, ... + block_size);
 * its key is the first 8 bytes of BLAKE2b-64 (RFC 7693, digest length 8, no key) of
 * head_b + the block's ids as native int64s, read as a little-endian unsigned integer; head_0
 * is `head` (the first block's parent or salt encoding) and head_{b+1} = b"P" + digest_b. The
 * ids are read with PyLong_AsLongLong (an int outside int64 is an OverflowError, as
 * struct.pack's 'q' raises struct.error). Plain C99 plus the CPython API; no third-party code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t kIV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t* p) {  /* little-endian */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
#else
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#endif
}

#define G(a, b, c, d, x, y)          \
  do {                               \
    v[a] = v[a] + v[b] + (x);        \
    v[d] = rotr64(v[d] ^ v[a], 32);  \
    v[c] = v[c] + v[d];              \
    v[b] = rotr64(v[b] ^ v[c], 24);  \
    v[a] = v[a] + v[b] + (y);        \
    v[d] = rotr64(v[d] ^ v[a], 16);  \
    v[c] = v[c] + v[d];              \
    v[b] = rotr64(v[b] ^ v[c], 63);  \
  } while (0)

/* One 128-byte block into h; t the bytes hashed so far including this block; last: the final
 * block. */
static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  for (int i = 0; i < 8; ++i) {
    v[i] = h[i];
    v[i + 8] = kIV[i];
  }
  v[12] ^= t;  /* the counter's high word stays 0: inputs are far below 2^64 bytes */
  if (last) v[14] = ~v[14];
#if defined(__GNUC__)
#pragma GCC unroll 12
#endif
  for (int r = 0; r < 12; ++r) {
    const uint8_t* s = kSigma[r];
    G(0, 4, 8, 12, m[s[0]], m[s[1]]);
    G(1, 5, 9, 13, m[s[2]], m[s[3]]);
    G(2, 6, 10, 14, m[s[4]], m[s[5]]);
    G(3, 7, 11, 15, m[s[6]], m[s[7]]);
    G(0, 5, 10, 15, m[s[8]], m[s[9]]);
    G(1, 6, 11, 12, m[s[10]], m[s[11]]);
    G(2, 7, 8, 13, m[s[12]], m[s[13]]);
    G(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b with an 8-byte digest of data[0, n) -> out[8]. */
static void blake2b_64(const uint8_t* data, size_t n, uint8_t out[8]) {
  uint64_t h[8];
  memcpy(h, kIV, sizeof h);
  h[0] ^= 0x01010000ULL ^ 8ULL;  /* depth 1, fanout 1, no key, digest length 8 */
  size_t done = 0;
  while (n - done > 128) {
    compress(h, data + done, (uint64_t)(done + 128), 0);
    done += 128;
  }
  uint8_t last[128] = {0};
  memcpy(last, data + done, n - done);
  compress(h, last, (uint64_t)n, 1);
  for (int i = 0; i < 8; ++i) out[i] = (uint8_t)(h[0] >> (8 * i));
}

static PyObject* chain_keys(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* ids;
  Py_ssize_t start, num_blocks, block_size;
  const char* head;
  Py_ssize_t head_len;
  if (!PyArg_ParseTuple(args, "Onnny#", &ids, &start, &num_blocks, &block_size, &head,
                        &head_len)) {
    return NULL;
  }
  if (start < 0 || num_blocks < 0 || block_size < 1) {
    PyErr_Format(PyExc_ValueError,
                 "chain_keys: start=%zd, num_blocks=%zd, block_size=%zd: start and num_blocks "
                 "must be >= 0, block_size >= 1", start, num_blocks, block_size);
    return NULL;
  }
  PyObject* seq = PySequence_Fast(ids, "chain_keys: token_ids must be a sequence of ints");
  if (seq == NULL) return NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (start + num_blocks * block_size > n) {
    PyErr_Format(PyExc_ValueError,
                 "chain_keys: %zd blocks of %zd from token %zd need %zd token ids; there are "
                 "%zd", num_blocks, block_size, start, start + num_blocks * block_size, n);
    Py_DECREF(seq);
    return NULL;
  }
  PyObject** items = PySequence_Fast_ITEMS(seq);
  const size_t body = (size_t)block_size * 8;
  const size_t cap = (head_len > 9 ? (size_t)head_len : 9) + body;
  uint8_t* buf = (uint8_t*)PyMem_Malloc(cap);
  PyObject* keys = PyList_New(num_blocks);
  if (buf == NULL || keys == NULL) {
    PyMem_Free(buf);
    Py_XDECREF(keys);
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  size_t prefix = (size_t)head_len;
  memcpy(buf, head, prefix);
  uint8_t digest[8];
  for (Py_ssize_t b = 0; b < num_blocks; ++b) {
    PyObject** block = items + start + b * block_size;
    uint8_t* p = buf + prefix;
    for (Py_ssize_t i = 0; i < block_size; ++i) {
      const long long id = PyLong_AsLongLong(block[i]);
      if (id == -1 && PyErr_Occurred()) {
        PyMem_Free(buf);
        Py_DECREF(keys);
        Py_DECREF(seq);
        return NULL;
      }
      const int64_t v = (int64_t)id;
      memcpy(p + 8 * (size_t)i, &v, 8);  /* native byte order, as struct.pack's 'q' */
    }
    blake2b_64(buf, prefix + body, digest);
    PyObject* key = PyLong_FromUnsignedLongLong(load64(digest));
    if (key == NULL) {
      PyMem_Free(buf);
      Py_DECREF(keys);
      Py_DECREF(seq);
      return NULL;
    }
    PyList_SET_ITEM(keys, b, key);
    buf[0] = 'P';  /* the next block's parent encoding: b"P" + this digest */
    memcpy(buf + 1, digest, 8);
    prefix = 9;
  }
  PyMem_Free(buf);
  Py_DECREF(seq);
  return keys;
}

static PyMethodDef kMethods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(token_ids, start, num_blocks, block_size, head) -> list of int"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_chain_keys", NULL, -1, kMethods,
                                     NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__chain_keys(void) { return PyModule_Create(&kModule); }
