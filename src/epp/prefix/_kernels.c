/* Compiled kernels of the prefix index's hot loops (see epp/prefix/kernels.py).
 *
 * Each function does exactly what its pure-Python twin does (the twin is the reference:
 * tests/prefix/test_kernels.py compares them on random inputs), without the interpreter's
 * per-iteration cost. Nothing here keeps state between calls.
 *
 *   xxh64_chain  the chained xxHash64 of full token blocks (epp.prefix.hashing)
 *   walk, match  the holders walk of a lookup (epp.prefix.holders.Holders.match)
 *   record_new   approximate mode's record loop (epp.prefix.approximate.record)
 *   evict        approximate mode's CLOCK (epp.prefix.approximate.evict)
 *
 * XXH64 is written here from its specification (github.com/Cyan4973/xxHash,
 * doc/xxhash_spec.md): five primes, 32-byte stripes of four lanes, then the tail and the
 * avalanche. Lanes are read little-endian whatever the host, as the spec requires.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t P1 = 0x9E3779B185EBCA87ULL;
static const uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t P3 = 0x165667B19E3779F9ULL;
static const uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t P5 = 0x27D4EB2F165667C5ULL;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t read32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t val) {
    acc ^= xxh_round(0, val);
    return acc * P1 + P4;
}

static uint64_t xxh64(const unsigned char *p, size_t len, uint64_t seed) {
    const unsigned char *end = p + len;
    uint64_t h;
    if (len >= 32) {
        const unsigned char *limit = end - 32;
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        do {
            v1 = xxh_round(v1, read64(p));
            v2 = xxh_round(v2, read64(p + 8));
            v3 = xxh_round(v3, read64(p + 16));
            v4 = xxh_round(v4, read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xxh_merge(h, v1);
        h = xxh_merge(h, v2);
        h = xxh_merge(h, v3);
        h = xxh_merge(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= xxh_round(0, read64(p));
        h = rotl64(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* xxh64(data, seed) -> int: one digest (the tests' check of the hash itself). */
static PyObject *k_xxh64(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*K", &view, &seed)) return NULL;
    uint64_t h = xxh64((const unsigned char *)view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* xxh64_chain(data, block_bytes, seed, blocks) -> list[int]: block i is the digest of
 * data[i*block_bytes:(i+1)*block_bytes] seeded with block i-1's digest (block 0: seed). */
static PyObject *k_xxh64_chain(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t block_bytes, blocks;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*nKn", &view, &block_bytes, &seed, &blocks)) return NULL;
    if (block_bytes <= 0 || blocks < 0 || blocks > view.len / block_bytes) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "blocks * block_bytes exceeds the data");
        return NULL;
    }
    PyObject *out = PyList_New(blocks);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    uint64_t prev = seed;
    for (Py_ssize_t i = 0; i < blocks; i++) {
        prev = xxh64(p + i * block_bytes, (size_t)block_bytes, prev);
        PyObject *value = PyLong_FromUnsignedLongLong(prev);
        if (value == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
    }
    PyBuffer_Release(&view);
    return out;
}

/* Appends (depth, mask) to `events`; steals nothing. */
static int add_event(PyObject *events, Py_ssize_t depth, PyObject *mask) {
    PyObject *event = Py_BuildValue("(nO)", depth, mask);
    if (event == NULL) return -1;
    int rc = PyList_Append(events, event);
    Py_DECREF(event);
    return rc;
}

/* walk(bits, hashes, active) -> list[(depth, mask)]: the lookup's walk. `active` is the
 * hold bits of the pods holding hashes[0]; at each block the pods that do not hold it
 * drop out, and an event (depth, their bits) says they matched `depth` blocks. The pods
 * still active after the last block end with an event (len(hashes), their bits). */
static PyObject *k_walk(PyObject *self, PyObject *args) {
    PyObject *bits, *hashes, *active;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &bits, &hashes, &active)) return NULL;
    /* A tuple copy: a key whose __hash__ or __eq__ runs Python code cannot resize it. */
    PyObject *seq = PySequence_Tuple(hashes);
    if (seq == NULL) return NULL;
    PyObject *events = PyList_New(0);
    if (events == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_INCREF(active);
    /* A block's value that already contained every active pod: the same object on the
     * next block (a pod's shared hold int) cannot drop anyone either. */
    PyObject *covering = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t depth;
    for (depth = 0; depth < n; depth++) {
        PyObject *value = PyDict_GetItemWithError(bits, items[depth]);
        if (value == NULL && PyErr_Occurred()) goto fail;
        if (value != NULL && value == covering) continue;
        PyObject *both;
        if (value == NULL) {
            both = PyLong_FromLong(0);
        } else {
            both = PyNumber_And(active, value);
        }
        if (both == NULL) goto fail;
        int same = PyObject_RichCompareBool(both, active, Py_EQ);
        if (same < 0) {
            Py_DECREF(both);
            goto fail;
        }
        if (same) {
            Py_DECREF(both);
            covering = value;
            continue;
        }
        PyObject *dropped = PyNumber_Xor(active, both);
        if (dropped == NULL || add_event(events, depth, dropped) < 0) {
            Py_XDECREF(dropped);
            Py_DECREF(both);
            goto fail;
        }
        Py_DECREF(dropped);
        Py_DECREF(active);
        active = both;
        covering = NULL;
        int any = PyObject_IsTrue(active);
        if (any < 0) goto fail;
        if (!any) {
            Py_DECREF(active);
            Py_DECREF(seq);
            return events;
        }
    }
    if (add_event(events, n, active) < 0) goto fail;
    Py_DECREF(active);
    Py_DECREF(seq);
    return events;
fail:
    Py_DECREF(active);
    Py_DECREF(seq);
    Py_DECREF(events);
    return NULL;
}

/* matched[names[i]] = depth for every pod i whose hold bit (bit 2i) is set in `mask`,
 * lowest first, as Holders.python_match does. */
static int add_reached(PyObject *matched, PyObject *names, PyObject *mask, Py_ssize_t depth) {
    /* `names` is the caller's tuple copy: a name's __hash__ cannot resize it. */
    PyObject *length = PyObject_CallMethod(mask, "bit_length", NULL);
    if (length == NULL) return -1;
    Py_ssize_t nbits = PyLong_AsSsize_t(length);
    Py_DECREF(length);
    if (nbits < 0) return -1;
    PyObject *raw = PyObject_CallMethod(mask, "to_bytes", "ns", (nbits + 7) / 8, "little");
    if (raw == NULL) return -1;
    if (!PyBytes_Check(raw)) { /* an int subclass's own to_bytes */
        Py_DECREF(raw);
        PyErr_SetString(PyExc_TypeError, "a hold mask's to_bytes() must return bytes");
        return -1;
    }
    PyObject *at = PyLong_FromSsize_t(depth);
    if (at == NULL) {
        Py_DECREF(raw);
        return -1;
    }
    const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(raw);
    Py_ssize_t size = PyBytes_GET_SIZE(raw), count = PyTuple_GET_SIZE(names);
    int rc = 0;
    for (Py_ssize_t j = 0; j < size && rc == 0; j++) {
        for (int k = 0; k < 8 && rc == 0; k++) {
            if (!(bytes[j] >> k & 1)) continue;
            Py_ssize_t pod = (j * 8 + k) >> 1;
            if (pod >= count) {
                PyErr_SetString(PyExc_IndexError, "list index out of range");
                rc = -1;
            } else {
                rc = PyDict_SetItem(matched, PyTuple_GET_ITEM(names, pod), at);
            }
        }
    }
    Py_DECREF(at);
    Py_DECREF(raw);
    return rc;
}

/* match(bits, hashes, active, names) -> dict[str, int]: Holders.match from the hold bits
 * `active` of the pods holding hashes[0]: the walk, each pod named with its depth. */
static PyObject *k_match(PyObject *self, PyObject *args) {
    PyObject *bits, *hashes, *active, *names;
    if (!PyArg_ParseTuple(args, "O!OOO!", &PyDict_Type, &bits, &hashes, &active, &PyList_Type,
                          &names))
        return NULL;
    PyObject *walk_args = PyTuple_Pack(3, bits, hashes, active);
    if (walk_args == NULL) return NULL;
    PyObject *events = k_walk(self, walk_args);
    Py_DECREF(walk_args);
    if (events == NULL) return NULL;
    PyObject *named = NULL;
    PyObject *matched = PyDict_New();
    if (matched == NULL) goto fail;
    named = PyList_AsTuple(names);
    if (named == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        Py_ssize_t depth = PyLong_AsSsize_t(PyTuple_GET_ITEM(event, 0));
        if (depth < 0 && PyErr_Occurred()) goto fail;
        if (add_reached(matched, named, PyTuple_GET_ITEM(event, 1), depth) < 0) goto fail;
    }
    Py_DECREF(named);
    Py_DECREF(events);
    return matched;
fail:
    Py_XDECREF(named);
    Py_XDECREF(matched);
    Py_DECREF(events);
    return NULL;
}

/* What record does with a block whose value is `mask` (not NULL): *update gets the new
 * value (a new reference) or NULL for none, *add whether the pod newly holds it. */
static int decide(PyObject *mask, PyObject *hold, PyObject *mark, PyObject *both,
                  PyObject **update, int *add) {
    *update = NULL;
    *add = 0;
    int eq = PyObject_RichCompareBool(mask, both, Py_EQ);
    if (eq < 0) return -1;
    if (eq) return 0; /* held and marked already */
    eq = PyObject_RichCompareBool(mask, hold, Py_EQ);
    if (eq < 0) return -1;
    if (eq) {
        *update = Py_NewRef(both);
        return 0;
    }
    PyObject *held = PyNumber_And(mask, hold);
    if (held == NULL) return -1;
    int is_held = PyObject_IsTrue(held);
    Py_DECREF(held);
    if (is_held < 0) return -1;
    if (!is_held) { /* only other pods hold it */
        *update = PyNumber_Or(mask, hold);
        *add = 1;
        return *update == NULL ? -1 : 0;
    }
    PyObject *marked = PyNumber_And(mask, mark);
    if (marked == NULL) return -1;
    int is_marked = PyObject_IsTrue(marked);
    Py_DECREF(marked);
    if (is_marked < 0) return -1;
    if (!is_marked) {
        *update = PyNumber_Or(mask, mark);
        if (*update == NULL) return -1;
    }
    return 0;
}

/* record_new(bits, hashes, hold, mark, both) -> bytes | None: approximate mode's record
 * loop over `hashes` tail first. A block nobody holds gets `hold`; one this pod holds gets
 * its mark; one only others hold gets this pod's hold bit. Returns the blocks this pod did
 * not hold before, in that order, as native 8-byte unsigned values (for the pod's CLOCK
 * queue), or None, changing nothing, when a hash is not a 64-bit unsigned int. */
static PyObject *k_record_new(PyObject *self, PyObject *args) {
    PyObject *bits, *hashes, *hold, *mark, *both;
    if (!PyArg_ParseTuple(args, "O!OOOO", &PyDict_Type, &bits, &hashes, &hold, &mark, &both))
        return NULL;
    /* A tuple copy: a key whose __hash__ or __eq__ runs Python code cannot resize it. */
    PyObject *seq = PySequence_Tuple(hashes);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(items[i])) goto unfit;
        (void)PyLong_AsUnsignedLongLong(items[i]);
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                Py_DECREF(seq);
                return NULL;
            }
            PyErr_Clear();
            goto unfit;
        }
    }
    PyObject *added = PyBytes_FromStringAndSize(NULL, n * 8);
    if (added == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(added);
    Py_ssize_t count = 0;
    /* The previous block's old value and what it became: a run of blocks sharing one value
     * object takes one decision, and their new values share one object too (so the next
     * walk and record over them are identity checks). Strong references: a freed value's
     * address may be reused by a new int. */
    PyObject *run_mask = NULL, *run_update = NULL;
    int run_add = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *block = items[i];
        PyObject *mask = PyDict_GetItemWithError(bits, block);
        PyObject *update = NULL; /* the new value, a new reference; NULL: none */
        int add = 0;
        if (mask == NULL) {
            if (PyErr_Occurred()) goto fail;
            update = Py_NewRef(hold);
            add = 1;
        } else if (mask == both) {
            continue;
        } else if (mask == run_mask) {
            update = Py_XNewRef(run_update);
            add = run_add;
        } else {
            if (decide(mask, hold, mark, both, &update, &add) < 0) goto fail;
            Py_XSETREF(run_mask, Py_NewRef(mask));
            Py_XSETREF(run_update, Py_XNewRef(update));
            run_add = add;
        }
        if (update != NULL) {
            int rc = PyDict_SetItem(bits, block, update);
            Py_DECREF(update);
            if (rc < 0) goto fail;
        }
        if (add) out[count++] = (uint64_t)PyLong_AsUnsignedLongLong(block);
    }
    Py_XDECREF(run_mask);
    Py_XDECREF(run_update);
    Py_DECREF(seq);
    if (_PyBytes_Resize(&added, count * 8) < 0) return NULL;
    return added;
fail:
    Py_XDECREF(run_mask);
    Py_XDECREF(run_update);
    Py_DECREF(seq);
    Py_DECREF(added);
    return NULL;
unfit:
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* Whether `mask & bit` is nonzero: -1 on error. */
static int has_bit(PyObject *mask, PyObject *bit) {
    PyObject *both = PyNumber_And(mask, bit);
    if (both == NULL) return -1;
    int set = PyObject_IsTrue(both);
    Py_DECREF(both);
    return set;
}

/* evict(bits, log, pos, excess, hold, mark, both) -> (pos, requeued): approximate mode's
 * CLOCK from log[pos] (an array of 8-byte unsigned hashes): a block this pod holds marked
 * loses its mark and is queued again at the back; one held unmarked loses this pod's hold
 * bit (and its entry when no pod is left); until `excess` blocks are evicted. Returns
 * where the queue now starts and the blocks queued again, in order, for the caller to
 * append to the log; positions past the log's end read those, as the twin's appends do.
 * The log is read through its buffer, so it cannot be resized meanwhile. */
static PyObject *k_evict(PyObject *self, PyObject *args) {
    PyObject *bits, *log, *hold, *mark, *both;
    Py_ssize_t pos, excess;
    if (!PyArg_ParseTuple(args, "O!OnnOOO", &PyDict_Type, &bits, &log, &pos, &excess, &hold,
                          &mark, &both))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(log, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (view.itemsize != 8 || view.format == NULL || strcmp(view.format, "Q") != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "log must be an array of 8-byte unsigned ints ('Q')");
        return NULL;
    }
    const uint64_t *queued = (const uint64_t *)view.buf;
    Py_ssize_t n = view.len / 8;
    if (pos < 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "pos must be >= 0");
        return NULL;
    }
    uint64_t *again = NULL; /* blocks queued again, in order */
    Py_ssize_t again_len = 0, again_cap = 0;
    while (excess > 0) {
        uint64_t hash;
        if (pos < n) {
            hash = queued[pos];
        } else if (pos - n < again_len) {
            hash = again[pos - n];
        } else {
            PyErr_SetString(PyExc_IndexError, "the CLOCK queue ran out before the excess did");
            goto fail;
        }
        pos++;
        PyObject *block = PyLong_FromUnsignedLongLong(hash);
        if (block == NULL) goto fail;
        PyObject *mask = PyDict_GetItemWithError(bits, block); /* borrowed */
        if (mask == NULL) {
            Py_DECREF(block);
            if (PyErr_Occurred()) goto fail;
            continue; /* not held (each held block is queued once: cannot happen) */
        }
        Py_INCREF(mask); /* setting the item below may free the dict's reference */
        int rc = 0;
        if (mask == both) { /* this pod alone, marked: the common second chance */
            rc = PyDict_SetItem(bits, block, hold);
            goto requeue;
        }
        if (mask == hold) { /* this pod alone, unmarked: evicted */
            rc = PyDict_DelItem(bits, block);
            goto evicted;
        }
        int held = has_bit(mask, hold);
        if (held <= 0) {
            rc = held;
            goto next;
        }
        int marked = has_bit(mask, mark);
        if (marked < 0) {
            rc = -1;
            goto next;
        }
        PyObject *rest = PyNumber_Xor(mask, marked ? mark : hold);
        if (rest == NULL) {
            rc = -1;
            goto next;
        }
        if (marked) {
            int alone = PyObject_RichCompareBool(rest, hold, Py_EQ);
            rc = alone < 0 ? -1 : PyDict_SetItem(bits, block, alone ? hold : rest);
            Py_DECREF(rest);
            goto requeue;
        }
        int others = PyObject_IsTrue(rest);
        rc = others < 0 ? -1 : others ? PyDict_SetItem(bits, block, rest) : PyDict_DelItem(bits, block);
        Py_DECREF(rest);
        goto evicted;
    requeue:
        if (rc == 0) {
            if (again_len == again_cap) {
                Py_ssize_t cap = again_cap ? again_cap * 2 : 256;
                uint64_t *grown = PyMem_Realloc(again, cap * sizeof(uint64_t));
                if (grown == NULL) {
                    PyErr_NoMemory();
                    rc = -1;
                    goto next;
                }
                again = grown;
                again_cap = cap;
            }
            again[again_len++] = hash;
        }
        goto next;
    evicted:
        if (rc == 0) excess--;
    next:
        Py_DECREF(mask);
        Py_DECREF(block);
        if (rc < 0) goto fail;
    }
    PyBuffer_Release(&view);
    PyObject *requeued = PyBytes_FromStringAndSize((const char *)again, again_len * 8);
    PyMem_Free(again);
    if (requeued == NULL) return NULL;
    return Py_BuildValue("nN", pos, requeued);
fail:
    PyBuffer_Release(&view);
    PyMem_Free(again);
    return NULL;
}

static PyMethodDef methods[] = {
    {"xxh64", k_xxh64, METH_VARARGS, "xxh64(data, seed) -> int"},
    {"xxh64_chain", k_xxh64_chain, METH_VARARGS,
     "xxh64_chain(data, block_bytes, seed, blocks) -> list[int]"},
    {"walk", k_walk, METH_VARARGS, "walk(bits, hashes, active) -> list[tuple[int, int]]"},
    {"match", k_match, METH_VARARGS, "match(bits, hashes, active, names) -> dict[str, int]"},
    {"record_new", k_record_new, METH_VARARGS,
     "record_new(bits, hashes, hold, mark, both) -> bytes | None"},
    {"evict", k_evict, METH_VARARGS,
     "evict(bits, log, pos, excess, hold, mark, both) -> (pos, requeued: bytes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Compiled kernels of the prefix index.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
