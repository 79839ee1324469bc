/* Compiled kernels of the scheduler's per-candidate passes (see epp/kernels.py).
 *
 * Each function does exactly what its pure-Python twin does, with the same float
 * operations in the same order (built with -ffp-contract=off: no fused multiply-add), so
 * the scores are bit-identical; tests/scheduling/test_kernels.py compares them. Nothing
 * here keeps state between calls.
 *
 *   weighted_sum  w0 * s0 + w1 * s1 + ... per candidate (epp.scheduling.scheduler)
 *   tied          the candidates within eps of the best total (MaxScorePicker.pick)
 *   prefill       the prefill scorer's pass (PrefillScorer.score), for candidates none
 *                 of which has configured running slots (the slot wait stays in Python)
 *   outside_unit  the range check of a scorer's scores (Scheduler.schedule)
 *   queue_scores  the queue scorer (QueueScorer.score)
 *   model_filter, health_filter   ModelFilter and HealthFilter
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *str_lane_end, *str_name, *str_configured_slots, *str_queue_depth, *str_model,
    *str_panic, *str_excluded;

/* The float of a list item (an int or a float, as Python's arithmetic takes it). */
static inline int as_double(PyObject *item, double *out) {
    if (PyFloat_CheckExact(item)) {
        *out = PyFloat_AS_DOUBLE(item);
        return 0;
    }
    *out = PyFloat_AsDouble(item);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* weighted_sum(weights, columns) -> list[float]: per candidate i,
 * weights[0] * columns[0][i] + weights[1] * columns[1][i] + ..., added left to right.
 * Every column (any sequence) must have the length of the first. */
static PyObject *k_weighted_sum(PyObject *self, PyObject *args) {
    PyObject *weights, *columns;
    if (!PyArg_ParseTuple(args, "OO", &weights, &columns)) return NULL;
    PyObject *w = PySequence_Tuple(weights); /* copies: a __float__ hook cannot resize them */
    if (w == NULL) return NULL;
    PyObject *c = PySequence_Tuple(columns);
    if (c == NULL) {
        Py_DECREF(w);
        return NULL;
    }
    PyObject *out = NULL;
    double *wv = NULL;
    PyObject **cols = NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(w);
    if (k < 1 || k != PySequence_Fast_GET_SIZE(c)) {
        PyErr_SetString(PyExc_ValueError, "one weight per column, at least one");
        goto done;
    }
    wv = PyMem_Malloc(sizeof(double) * k);
    cols = PyMem_Calloc(k, sizeof(PyObject *));
    if (wv == NULL || cols == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = -1;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (as_double(PySequence_Fast_GET_ITEM(w, j), &wv[j]) < 0) goto done;
        cols[j] = PySequence_Tuple(PySequence_Fast_GET_ITEM(c, j));
        if (cols[j] == NULL) goto done;
        if (n < 0) n = PySequence_Fast_GET_SIZE(cols[j]);
        else if (PySequence_Fast_GET_SIZE(cols[j]) != n) {
            PyErr_SetString(PyExc_ValueError, "columns of different lengths");
            goto done;
        }
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        double x, acc;
        if (as_double(PySequence_Fast_GET_ITEM(cols[0], i), &x) < 0) goto fail;
        acc = wv[0] * x;
        for (Py_ssize_t j = 1; j < k; j++) {
            if (as_double(PySequence_Fast_GET_ITEM(cols[j], i), &x) < 0) goto fail;
            acc = acc + wv[j] * x;
        }
        PyObject *value = PyFloat_FromDouble(acc);
        if (value == NULL) goto fail;
        PyList_SET_ITEM(out, i, value);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    if (cols != NULL)
        for (Py_ssize_t j = 0; j < k; j++) Py_XDECREF(cols[j]);
    PyMem_Free(wv);
    PyMem_Free(cols);
    Py_DECREF(w);
    Py_DECREF(c);
    return out;
}

/* tied(totals, eps) -> list[int]: the indexes i with max(totals) - totals[i] <= eps, in
 * order (max as Python's: the first of equals, a NaN never replaces a number). */
static PyObject *k_tied(PyObject *self, PyObject *args) {
    PyObject *totals;
    double eps;
    if (!PyArg_ParseTuple(args, "O!d", &PyList_Type, &totals, &eps)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(totals);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no totals");
        return NULL;
    }
    PyObject *copy = PyList_AsTuple(totals); /* a __float__ hook cannot resize it */
    if (copy == NULL) return NULL;
    double *values = PyMem_Malloc(sizeof(double) * n);
    if (values == NULL) {
        Py_DECREF(copy);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_double(PyTuple_GET_ITEM(copy, i), &values[i]) < 0) {
            Py_DECREF(copy);
            PyMem_Free(values);
            return NULL;
        }
    }
    Py_DECREF(copy);
    double best = values[0];
    for (Py_ssize_t i = 1; i < n; i++)
        if (values[i] > best) best = values[i];
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        PyMem_Free(values);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (best - values[i] <= eps) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(out, index) < 0) {
                Py_XDECREF(index);
                Py_DECREF(out);
                PyMem_Free(values);
                return NULL;
            }
            Py_DECREF(index);
        }
    }
    PyMem_Free(values);
    return out;
}

/* max(pods[e].lane_end - now, 0), with fresh_lane for a pod without state. */
static int lane_wait(PyObject *e, PyObject *pods, double fresh_lane, double now, double *wait) {
    double lane_end = fresh_lane;
    PyObject *state = PyDict_GetItemWithError(pods, e);
    if (state == NULL && PyErr_Occurred()) return -1;
    if (state != NULL) {
        PyObject *lane = PyObject_GetAttr(state, str_lane_end);
        if (lane == NULL) return -1;
        int rc = as_double(lane, &lane_end);
        Py_DECREF(lane);
        if (rc < 0) return -1;
    }
    double lane = lane_end - now;
    *wait = lane > 0.0 ? lane : 0.0;
    return 0;
}

/* matched.get(e.name, 0) as a C integer. */
static int matched_blocks(PyObject *e, PyObject *matched, long long *count) {
    PyObject *name = PyObject_GetAttr(e, str_name);
    if (name == NULL) return -1;
    PyObject *blocks = PyDict_GetItemWithError(matched, name);
    Py_DECREF(name);
    if (blocks == NULL && PyErr_Occurred()) return -1;
    *count = 0;
    if (blocks != NULL) {
        *count = PyLong_AsLongLong(blocks);
        if (*count == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* [min(ttft) / t if t > 0.0 else 1.0 for t in ttft] (min as Python's: the first of equals). */
static PyObject *best_over_each(const double *ttft, Py_ssize_t n) {
    double best = ttft[0];
    for (Py_ssize_t i = 1; i < n; i++)
        if (ttft[i] < best) best = ttft[i];
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyFloat_FromDouble(ttft[i] > 0.0 ? best / ttft[i] : 1.0);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
    }
    return out;
}

/* prefill(candidates, pods, matched, now, fresh_lane_end, overhead, per_token,
 *         per_cached, prompt_tokens, block_size) -> list[float] | None
 * The prefill scorer's pass: per candidate e, wait = max(pods[e].lane_end - now, 0)
 * (fresh_lane_end for a pod without state), cached = min(prompt_tokens - 1 (0 for a
 * prompt of at most one token), matched[e.name] * block_size), ttft = wait + (overhead +
 * (prompt_tokens - cached) * per_token + cached * per_cached); then min(ttft) / ttft
 * (1.0 where ttft is not positive). None, having changed nothing, when a candidate has
 * configured running slots (its slot wait is the Python twin's) or a match so large that
 * matched * block_size overflows 64 bits (the twin's ints do not). */
static PyObject *k_prefill(PyObject *self, PyObject *args) {
    PyObject *candidates, *pods, *matched;
    double now, fresh_lane, overhead, per_token, per_cached;
    long long prompt_tokens, block_size;
    if (!PyArg_ParseTuple(args, "O!O!O!dddddLL", &PyList_Type, &candidates, &PyDict_Type, &pods,
                          &PyDict_Type, &matched, &now, &fresh_lane, &overhead, &per_token,
                          &per_cached, &prompt_tokens, &block_size))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(candidates);
    if (n == 0) return PyList_New(0);
    /* A copy holding each candidate: an attribute hook cannot free what is read. */
    PyObject *pods_seen = PyList_AsTuple(candidates);
    if (pods_seen == NULL) return NULL;
    double *ttft = PyMem_Malloc(sizeof(double) * n);
    if (ttft == NULL) {
        Py_DECREF(pods_seen);
        return PyErr_NoMemory();
    }
    long long most_cached = prompt_tokens > 1 ? prompt_tokens - 1 : 0;
    double cold = overhead + (double)prompt_tokens * per_token + 0.0 * per_cached;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(pods_seen, i);
        PyObject *slots = PyObject_GetAttr(e, str_configured_slots);
        if (slots == NULL) goto fail;
        int has_slots = PyObject_IsTrue(slots);
        Py_DECREF(slots);
        if (has_slots < 0) goto fail;
        if (has_slots) goto twin;
        double wait;
        long long count;
        if (lane_wait(e, pods, fresh_lane, now, &wait) < 0) goto fail;
        if (matched_blocks(e, matched, &count) < 0) goto fail;
        if (count) {
            long long cached;
            if (__builtin_mul_overflow(count, block_size, &cached)) goto twin; /* exact ints */
            if (cached > most_cached) cached = most_cached;
            ttft[i] = wait + (overhead + (double)(prompt_tokens - cached) * per_token +
                              (double)cached * per_cached);
        } else {
            ttft[i] = wait + cold;
        }
    }
    PyObject *out = best_over_each(ttft, n);
    if (out == NULL) goto fail;
    PyMem_Free(ttft);
    Py_DECREF(pods_seen);
    return out;
twin:
    PyMem_Free(ttft);
    Py_DECREF(pods_seen);
    Py_RETURN_NONE;
fail:
    PyMem_Free(ttft);
    Py_DECREF(pods_seen);
    return NULL;
}

/* outside_unit(scores) -> bool | None: whether a score is outside [0, 1] or NaN, for a
 * list of floats (exact floats run no Python code); None for anything else (the twin). */
static PyObject *k_outside_unit(PyObject *self, PyObject *scores) {
    if (!PyList_CheckExact(scores)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(scores);
    int outside = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(scores, i);
        if (!PyFloat_CheckExact(item)) Py_RETURN_NONE;
        double v = PyFloat_AS_DOUBLE(item);
        if (!(v >= 0.0 && v <= 1.0)) outside = 1;
    }
    return PyBool_FromLong(outside);
}

/* The float of attribute `name` of `obj` (Python's float(), as arithmetic takes it). */
static int attr_double(PyObject *obj, PyObject *name, double *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    int rc = as_double(value, out);
    Py_DECREF(value);
    return rc;
}

/* queue_scores(candidates, max_queue) -> list[float]: per candidate,
 * 1.0 - min(e.queue_depth / max_queue, 1.0) (the queue scorer). */
static PyObject *k_queue_scores(PyObject *self, PyObject *args) {
    PyObject *candidates;
    double max_queue;
    if (!PyArg_ParseTuple(args, "O!d", &PyList_Type, &candidates, &max_queue)) return NULL;
    if (max_queue == 0.0) {
        PyErr_SetString(PyExc_ZeroDivisionError, "float division by zero");
        return NULL;
    }
    PyObject *pods_seen = PyList_AsTuple(candidates); /* hooks cannot free what is read */
    if (pods_seen == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(pods_seen);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(pods_seen);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double depth;
        if (attr_double(PyTuple_GET_ITEM(pods_seen, i), str_queue_depth, &depth) < 0) {
            Py_DECREF(pods_seen);
            Py_DECREF(out);
            return NULL;
        }
        double q = depth / max_queue;
        PyObject *value = PyFloat_FromDouble(1.0 - (q > 1.0 ? 1.0 : q));
        if (value == NULL) {
            Py_DECREF(pods_seen);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
    }
    Py_DECREF(pods_seen);
    return out;
}

/* keep(candidates, test): the candidates for which test(e) is 1, in order. */
static PyObject *keep(PyObject *candidates, int (*test)(PyObject *, void *), void *arg) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    /* The size is read at each step: a test's attribute hook may shrink the list. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(candidates); i++) {
        PyObject *e = PyList_GET_ITEM(candidates, i);
        Py_INCREF(e); /* a test's attribute hook may drop the list's reference */
        int kept = test(e, arg);
        int rc = kept > 0 ? PyList_Append(out, e) : kept;
        Py_DECREF(e);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static int serves_model(PyObject *e, void *wanted) {
    PyObject *model = PyObject_GetAttr(e, str_model);
    if (model == NULL) return -1;
    int rc = model == Py_None ? 1 : PyObject_RichCompareBool(model, (PyObject *)wanted, Py_EQ);
    Py_DECREF(model);
    return rc;
}

static int routable(PyObject *e, void *unused) {
    PyObject *panic = PyObject_GetAttr(e, str_panic);
    if (panic == NULL) return -1;
    int rc = PyObject_IsTrue(panic);
    Py_DECREF(panic);
    if (rc != 0) return rc;
    PyObject *excluded = PyObject_GetAttr(e, str_excluded);
    if (excluded == NULL) return -1;
    rc = PyObject_IsTrue(excluded);
    Py_DECREF(excluded);
    return rc < 0 ? rc : !rc;
}

/* model_filter(candidates, wanted) -> list: [e for e in candidates
 *     if e.model is None or e.model == wanted] (ModelFilter). */
static PyObject *k_model_filter(PyObject *self, PyObject *args) {
    PyObject *candidates, *wanted;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &candidates, &wanted)) return NULL;
    return keep(candidates, serves_model, wanted);
}

/* health_filter(candidates) -> list: [e for e in candidates if e.panic or not e.excluded]
 * (HealthFilter). */
static PyObject *k_health_filter(PyObject *self, PyObject *candidates) {
    if (!PyList_Check(candidates)) {
        PyErr_SetString(PyExc_TypeError, "candidates must be a list");
        return NULL;
    }
    return keep(candidates, routable, NULL);
}

static PyMethodDef methods[] = {
    {"weighted_sum", k_weighted_sum, METH_VARARGS,
     "weighted_sum(weights, columns) -> list[float]"},
    {"tied", k_tied, METH_VARARGS, "tied(totals, eps) -> list[int]"},
    {"outside_unit", k_outside_unit, METH_O, "outside_unit(scores) -> bool | None"},
    {"queue_scores", k_queue_scores, METH_VARARGS,
     "queue_scores(candidates, max_queue) -> list[float]"},
    {"model_filter", k_model_filter, METH_VARARGS, "model_filter(candidates, wanted) -> list"},
    {"health_filter", k_health_filter, METH_O, "health_filter(candidates) -> list"},
    {"prefill", k_prefill, METH_VARARGS,
     "prefill(candidates, pods, matched, now, fresh_lane_end, overhead, per_token, "
     "per_cached, prompt_tokens, block_size) -> list[float] | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Compiled kernels of the scheduler.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    str_lane_end = PyUnicode_InternFromString("lane_end");
    str_name = PyUnicode_InternFromString("name");
    str_configured_slots = PyUnicode_InternFromString("configured_slots");
    str_queue_depth = PyUnicode_InternFromString("queue_depth");
    str_model = PyUnicode_InternFromString("model");
    str_panic = PyUnicode_InternFromString("panic");
    str_excluded = PyUnicode_InternFromString("excluded");
    if (str_lane_end == NULL || str_name == NULL || str_configured_slots == NULL ||
        str_queue_depth == NULL || str_model == NULL || str_panic == NULL || str_excluded == NULL)
        return NULL;
    return PyModule_Create(&module);
}
