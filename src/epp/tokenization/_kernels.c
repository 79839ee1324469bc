/* Compiled kernel of the fast tokenizer path (see epp/tokenization/fast.py).
 *
 * `PieceCache` does, for a segment of text, what the pure-Python twin in fast.py does with
 * `pattern.findall` and a dictionary: split the text into the pre-tokenizer's pieces and
 * join each piece's ids, asking the tokenizer's BPE model (`missing`) for a piece it has
 * not seen. The twin stays the reference: tests/tokenization/test_kernels.py compares the
 * pieces with Python's `re` on the translated pattern and the ids with the twin's, and
 * fast.py checks the split against `re` again when it loads a tokenizer.
 *
 * Two pre-tokenizer families are written out, as fast.py translates them to `re`:
 *   GPT2    's|'t|'re|'ve|'m|'ll|'d| ?L+| ?N+| ?[^\sLN]+|\s+(?!\S)|\s+
 *   LLAMA3  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nLN]?L+|N{1,D}| ?[^\sLN]+[\r\n]*|\s*[\r\n]+
 *           |\s+(?!\S)|\s+                                  (D = 3 Llama 3, 1 Qwen 2)
 * with `re`'s classes on str: L = [^\W\d_] (alphanumeric, not decimal), N = \d (decimal)
 * and \s (str.isspace). Where those differ from the tokenizer's Unicode classes (fast.py's
 * `safe`), the caller does not send the text here. Each function below returns where the
 * piece starting at p ends, as the regex's leftmost-alternative, backtracking match does;
 * `end` is the text's end for the match, as findall's endpos is. Every character is a
 * letter, a digit, a space or an "other", so some alternative always matches and the
 * pieces cover the text end to end.
 *
 * The cache is an open-addressing table of a piece's UTF-8 bytes -> ids bytes (uint32, native
 * order, as array("I") holds them), bounded like the twin's: it starts over when it holds
 * `limit` pieces, and pieces longer than `max_key` characters are not kept. A lookup
 * reads at most MAX_PROBE slots from the piece's home slot and a piece is kept only within
 * them, whatever the pieces: prompt text chooses them and FNV-1a is not keyed (the twin's
 * dict hashes with Python's randomized hash), so pieces sharing a home slot would
 * otherwise make every lookup scan all of them. A piece that finds no room is asked of
 * `missing` each time, as new text is.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { GPT2 = 0, LLAMA3 = 1 };

/* Before 3.12 a str made by the legacy API may hold its characters elsewhere until it is
 * made ready; PyUnicode_DATA and friends read only ready ones. */
static int ready(PyObject *text) {
#if PY_VERSION_HEX < 0x030C0000
    return PyUnicode_READY(text);
#else
    (void)text;
    return 0;
#endif
}

/* The text, read whatever its storage (1, 2 or 4 bytes a character): the scanners are
 * inlined into one copy per kind, where `at` is a plain load. */
typedef struct {
    const void *data;
    int kind;
    int ascii; /* every character < 128: the classes need no Unicode table */
} Text;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE Py_UCS4 at(Text t, Py_ssize_t i) {
    return t.kind == PyUnicode_1BYTE_KIND   ? ((const Py_UCS1 *)t.data)[i]
           : t.kind == PyUnicode_2BYTE_KIND ? ((const Py_UCS2 *)t.data)[i]
                                            : ((const Py_UCS4 *)t.data)[i];
}

/* Python's `re` classes on str patterns, which the translated patterns use: \s is
 * str.isspace, \d str.isdecimal, \w str.isalnum or "_". So a letter ([^\W\d_]) is an
 * alphanumeric that is not a decimal, and an "other" ((?:[^\s\w]|_)) is none of a space,
 * a letter or a digit. */
ALWAYS_INLINE int is_space(Text s, Py_UCS4 c) {
    /* str.isspace on ASCII: \t\n\v\f\r, the separators \x1c-\x1f, and " " */
    if (s.ascii || c < 128)
        return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1C && c <= 0x1F);
    return Py_UNICODE_ISSPACE(c);
}
ALWAYS_INLINE int is_letter(Text s, Py_UCS4 c) {
    if (s.ascii || c < 128)
        return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
    return Py_UNICODE_ISALNUM(c) && !Py_UNICODE_ISDECIMAL(c);
}
ALWAYS_INLINE int is_digit(Text s, Py_UCS4 c) {
    if (s.ascii || c < 128)
        return c >= '0' && c <= '9';
    return Py_UNICODE_ISDECIMAL(c);
}
ALWAYS_INLINE int is_newline(Py_UCS4 c) { return c == '\r' || c == '\n'; }
ALWAYS_INLINE int is_other(Text s, Py_UCS4 c) {
    return !is_space(s, c) && !is_letter(s, c) && !is_digit(s, c);
}
/* (?i) on a contraction's letters: ASCII case, and the long s (U+017F), which `re`
 * takes for an s. */
ALWAYS_INLINE Py_UCS4 fold(Py_UCS4 c) {
    return (c >= 'A' && c <= 'Z') ? (c | 0x20) : c == 0x17F ? 's' : c;
}

/* 's 't 're 've 'm 'll 'd at p (a quote): its length, or 0. */
ALWAYS_INLINE Py_ssize_t contraction(Text s, Py_ssize_t p, Py_ssize_t end, int ignore_case) {
    if (p + 1 >= end)
        return 0;
    Py_UCS4 a = ignore_case ? fold(at(s, p + 1)) : at(s, p + 1);
    if (a == 's' || a == 't' || a == 'm' || a == 'd')
        return 2;
    if (p + 2 >= end)
        return 0;
    Py_UCS4 b = ignore_case ? fold(at(s, p + 2)) : at(s, p + 2);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        return 3;
    return 0;
}

/* \s+(?!\S)|\s+ at p (a space): a run that reaches the end whole; a longer run followed
 * by a non-space less its last character (which goes with the next piece); a single
 * space before a non-space alone. */
ALWAYS_INLINE Py_ssize_t space_run(Text s, Py_ssize_t p, Py_ssize_t end) {
    Py_ssize_t q = p + 1;
    while (q < end && is_space(s, at(s, q)))
        q++;
    return (q == end || q - p == 1) ? q : q - 1;
}

ALWAYS_INLINE Py_ssize_t gpt2_piece(Text s, Py_ssize_t p, Py_ssize_t end) {
    Py_UCS4 first = at(s, p);
    if (first == '\'') {
        Py_ssize_t n = contraction(s, p, end, 0);
        if (n)
            return p + n;
    }
    Py_ssize_t i = p;
    if (first == ' ' && p + 1 < end && !is_space(s, at(s, p + 1)))
        i = p + 1; /* " ?" before a letter, a digit or an other */
    Py_UCS4 c = at(s, i);
    if (is_letter(s, c)) {
        do i++; while (i < end && is_letter(s, at(s, i)));
        return i;
    }
    if (is_digit(s, c)) {
        do i++; while (i < end && is_digit(s, at(s, i)));
        return i;
    }
    if (!is_space(s, c)) {
        do i++; while (i < end && is_other(s, at(s, i)));
        return i;
    }
    return space_run(s, p, end);
}

ALWAYS_INLINE Py_ssize_t llama3_piece(Text s, Py_ssize_t p, Py_ssize_t end, int max_digits) {
    Py_UCS4 c = at(s, p);
    Py_ssize_t i;
    if (c == '\'') {
        Py_ssize_t n = contraction(s, p, end, 1);
        if (n)
            return p + n;
    }
    /* [^\r\nLN]?L+ */
    if (is_letter(s, c) ||
        (!is_newline(c) && !is_digit(s, c) && p + 1 < end && is_letter(s, at(s, p + 1)))) {
        i = p + 1;
        while (i < end && is_letter(s, at(s, i)))
            i++;
        return i;
    }
    if (is_digit(s, c)) {
        i = p + 1;
        while (i < end && i - p < max_digits && is_digit(s, at(s, i)))
            i++;
        return i;
    }
    /* " ?[^\sLN]+[\r\n]*" */
    i = (c == ' ' && p + 1 < end && is_other(s, at(s, p + 1))) ? p + 1 : p;
    if (is_other(s, at(s, i))) {
        do i++; while (i < end && is_other(s, at(s, i)));
        while (i < end && is_newline(at(s, i)))
            i++;
        return i;
    }
    /* \s*[\r\n]+: the space run up to and with its last line break, if it has one */
    Py_ssize_t q = p, last_break = -1;
    while (q < end && is_space(s, at(s, q))) {
        if (is_newline(at(s, q)))
            last_break = q;
        q++;
    }
    if (last_break >= 0)
        return last_break + 1;
    return space_run(s, p, end);
}

typedef struct {
    uint64_t hash;
    unsigned char *data; /* the key's bytes, then the ids' bytes; NULL: an empty slot */
    uint32_t key_len;
    uint32_t ids_len;
} Slot;

typedef struct {
    PyObject_HEAD
    int family;
    int max_digits;
    PyObject *missing; /* missing(piece: str) -> bytes: the BPE model's ids for a piece */
    Slot *slots;
    size_t mask; /* capacity - 1; capacity a power of two, at most half full */
    size_t count;
    size_t limit;
    Py_ssize_t max_key;
} PieceCache;

#define INITIAL_CAPACITY 1024
#define MAX_PROBE 64 /* at most half full, honest pieces are this far from home ~never */

/* Where the piece starting at p ends: one copy of the scanners per storage kind. */
#define PIECE_END(NAME, KIND, ASCII)                                                    \
    static Py_ssize_t piece_end_##NAME(const PieceCache *self, const void *data, Py_ssize_t p, \
                                       Py_ssize_t end) {                                \
        Text s = {data, KIND, ASCII};                                                   \
        return self->family == GPT2 ? gpt2_piece(s, p, end)                             \
                                    : llama3_piece(s, p, end, self->max_digits);        \
    }
PIECE_END(ascii, PyUnicode_1BYTE_KIND, 1)
PIECE_END(1, PyUnicode_1BYTE_KIND, 0)
PIECE_END(2, PyUnicode_2BYTE_KIND, 0)
PIECE_END(4, PyUnicode_4BYTE_KIND, 0)

static inline Py_ssize_t next_piece(const PieceCache *self, Text s, Py_ssize_t p, Py_ssize_t end) {
    if (s.ascii)
        return piece_end_ascii(self, s.data, p, end);
    switch (s.kind) {
    case PyUnicode_1BYTE_KIND:
        return piece_end_1(self, s.data, p, end);
    case PyUnicode_2BYTE_KIND:
        return piece_end_2(self, s.data, p, end);
    default:
        return piece_end_4(self, s.data, p, end);
    }
}

/* FNV-1a: pieces are a few bytes long, where it is as good as any. */
static inline uint64_t piece_hash(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (Py_ssize_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

static void free_slots(Slot *slots, size_t capacity) {
    for (size_t i = 0; i < capacity; i++)
        PyMem_Free(slots[i].data);
    PyMem_Free(slots);
}

static int reset(PieceCache *self) {
    Slot *fresh = PyMem_Calloc(INITIAL_CAPACITY, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (self->slots != NULL)
        free_slots(self->slots, self->mask + 1);
    self->slots = fresh;
    self->mask = INITIAL_CAPACITY - 1;
    self->count = 0;
    return 0;
}

/* The piece's slot, else the empty slot where it would go, else NULL (neither within
 * MAX_PROBE slots of its home). A piece that `grow` moved further is not found: it is
 * asked of `missing` again and not kept twice (the slots from its home to it are full). */
static Slot *find(const PieceCache *self, const unsigned char *key, Py_ssize_t n, uint64_t h) {
    size_t i = (size_t)h & self->mask;
    for (int probe = 0; probe < MAX_PROBE; probe++) {
        Slot *slot = &self->slots[i];
        if (slot->data == NULL)
            return slot;
        if (slot->hash == h && slot->key_len == (uint32_t)n && memcmp(slot->data, key, n) == 0)
            return slot;
        i = (i + 1) & self->mask;
    }
    return NULL;
}

static int grow(PieceCache *self) {
    size_t capacity = (self->mask + 1) * 2;
    Slot *fresh = PyMem_Calloc(capacity, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i <= self->mask; i++) {
        Slot old = self->slots[i];
        if (old.data == NULL)
            continue;
        size_t j = (size_t)old.hash & (capacity - 1);
        while (fresh[j].data != NULL)
            j = (j + 1) & (capacity - 1);
        fresh[j] = old;
    }
    PyMem_Free(self->slots);
    self->slots = fresh;
    self->mask = capacity - 1;
    return 0;
}

/* Keep a piece's ids (after a miss). The table may have changed while `missing` ran
 * Python code, so the slot is looked up afresh. */
static int keep(PieceCache *self, const unsigned char *key, Py_ssize_t n, Py_ssize_t chars,
                uint64_t h, const char *ids, Py_ssize_t ids_len) {
    if (chars > self->max_key || (size_t)n > UINT32_MAX || (size_t)ids_len > UINT32_MAX)
        return 0;
    if (self->count >= self->limit && reset(self) < 0)
        return -1;
    if ((self->count + 1) * 2 > self->mask + 1 && grow(self) < 0)
        return -1;
    Slot *slot = find(self, key, n, h);
    if (slot == NULL || slot->data != NULL)
        return 0; /* no room near its home, or kept meanwhile */
    unsigned char *data = PyMem_Malloc((size_t)n + (size_t)ids_len + 1);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(data, key, n);
    memcpy(data + n, ids, ids_len);
    slot->hash = h;
    slot->data = data;
    slot->key_len = (uint32_t)n;
    slot->ids_len = (uint32_t)ids_len;
    self->count++;
    return 0;
}

typedef struct {
    char *data;
    Py_ssize_t len, capacity;
} Buffer;

/* Room for n more bytes. */
static int reserve(Buffer *out, Py_ssize_t n) {
    if (out->len + n > out->capacity) {
        Py_ssize_t capacity = out->capacity ? out->capacity : 4096;
        while (capacity < out->len + n)
            capacity *= 2;
        char *grown = PyMem_Realloc(out->data, capacity);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        out->data = grown;
        out->capacity = capacity;
    }
    return 0;
}

static int append(Buffer *out, const void *data, Py_ssize_t n) {
    if (n == 0)
        return 0; /* memcpy to a NULL buffer is undefined, even of nothing */
    if (reserve(out, n) < 0)
        return -1;
    memcpy(out->data + out->len, data, n);
    out->len += n;
    return 0;
}

/* The piece text[p:q] as the cache's key, its UTF-8 bytes (what the BPE model reads):
 * ASCII text's own bytes, or encoded into `scratch` (a surrogate as its 3-byte form; the
 * caller never passes one: fast.py's `safe` keeps them out). */
static const unsigned char *piece_key(Text s, Py_ssize_t p, Py_ssize_t q, Buffer *scratch,
                                      Py_ssize_t *n) {
    if (s.ascii) {
        *n = q - p;
        return (const unsigned char *)s.data + p;
    }
    scratch->len = 0;
    if (reserve(scratch, 4 * (q - p) + 1) < 0)
        return NULL;
    unsigned char *o = (unsigned char *)scratch->data;
    for (Py_ssize_t i = p; i < q; i++) {
        Py_UCS4 c = PyUnicode_READ(s.kind, s.data, i);
        if (c < 0x80) {
            *o++ = (unsigned char)c;
        } else if (c < 0x800) {
            *o++ = 0xC0 | (c >> 6);
            *o++ = 0x80 | (c & 0x3F);
        } else if (c < 0x10000) {
            *o++ = 0xE0 | (c >> 12);
            *o++ = 0x80 | ((c >> 6) & 0x3F);
            *o++ = 0x80 | (c & 0x3F);
        } else {
            *o++ = 0xF0 | (c >> 18);
            *o++ = 0x80 | ((c >> 12) & 0x3F);
            *o++ = 0x80 | ((c >> 6) & 0x3F);
            *o++ = 0x80 | (c & 0x3F);
        }
    }
    *n = (Py_ssize_t)(o - (unsigned char *)scratch->data);
    return (const unsigned char *)scratch->data;
}

/* The ids of the piece text[p:q], appended to `out`: from the table, or from `missing`. */
static int piece_ids(PieceCache *self, PyObject *text, Text s, Py_ssize_t p, Py_ssize_t q,
                     Buffer *out, Buffer *scratch) {
    Py_ssize_t n;
    const unsigned char *key = piece_key(s, p, q, scratch, &n);
    if (key == NULL)
        return -1;
    uint64_t h = piece_hash(key, n);
    if (q - p <= self->max_key) {
        Slot *slot = find(self, key, n, h);
        if (slot != NULL && slot->data != NULL)
            return append(out, slot->data + n, slot->ids_len);
    }
    PyObject *piece = PyUnicode_Substring(text, p, q);
    if (piece == NULL)
        return -1;
    /* Held for the call: it may replace itself (__init__ again) while it runs. */
    PyObject *missing = Py_NewRef(self->missing);
    PyObject *ids = PyObject_CallOneArg(missing, piece);
    Py_DECREF(missing);
    Py_DECREF(piece);
    if (ids == NULL)
        return -1;
    if (!PyBytes_Check(ids)) {
        PyErr_Format(PyExc_TypeError, "missing() must return bytes, not %.100s", Py_TYPE(ids)->tp_name);
        Py_DECREF(ids);
        return -1;
    }
    int rc = append(out, PyBytes_AS_STRING(ids), PyBytes_GET_SIZE(ids));
    if (rc == 0)
        rc = keep(self, key, n, q - p, h, PyBytes_AS_STRING(ids), PyBytes_GET_SIZE(ids));
    Py_DECREF(ids);
    return rc;
}

/* A str's characters, the range [pos, end) within it checked; data NULL on error. */
static Text text_range(PyObject *text, Py_ssize_t pos, Py_ssize_t end) {
    Text s = {NULL, 0, 0};
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "text must be a str");
        return s;
    }
    if (ready(text) < 0)
        return s;
    if (pos < 0 || end < pos || end > PyUnicode_GET_LENGTH(text)) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= pos <= end <= len(text)");
        return s;
    }
    s.data = PyUnicode_DATA(text);
    s.kind = PyUnicode_KIND(text);
    s.ascii = PyUnicode_IS_ASCII(text);
    return s;
}

static PyObject *cache_split(PieceCache *self, PyObject *args) {
    PyObject *text;
    Py_ssize_t pos, end;
    if (!PyArg_ParseTuple(args, "Unn:split", &text, &pos, &end))
        return NULL;
    Text s = text_range(text, pos, end);
    if (s.data == NULL)
        return NULL;
    PyObject *pieces = PyList_New(0);
    if (pieces == NULL)
        return NULL;
    for (Py_ssize_t p = pos; p < end;) {
        Py_ssize_t q = next_piece(self, s, p, end);
        PyObject *piece = PyUnicode_Substring(text, p, q);
        if (piece == NULL || PyList_Append(pieces, piece) < 0) {
            Py_XDECREF(piece);
            Py_DECREF(pieces);
            return NULL;
        }
        Py_DECREF(piece);
        p = q;
    }
    return pieces;
}

/* encode(text, pos, end, keep_back) -> (ids, pieces, consumed_to): the ids of the pieces
 * of text[pos:end] but the last `keep_back`, how many pieces there were, and where the
 * last encoded piece ends. */
static PyObject *cache_encode(PieceCache *self, PyObject *args) {
    PyObject *text;
    Py_ssize_t pos, end, keep_back;
    if (!PyArg_ParseTuple(args, "Unnn:encode", &text, &pos, &end, &keep_back))
        return NULL;
    if (self->missing == NULL) { /* made by __new__ alone, or cleared by the GC */
        PyErr_SetString(PyExc_TypeError, "PieceCache.__init__ has not run");
        return NULL;
    }
    Text s = text_range(text, pos, end);
    if (s.data == NULL)
        return NULL;
    if (keep_back < 0) {
        PyErr_SetString(PyExc_ValueError, "keep_back must be >= 0");
        return NULL;
    }
    if (keep_back > end - pos)
        keep_back = end - pos + 1; /* more than there can be pieces: the same answer */
    /* The starts of the last keep_back + 1 pieces, in a ring: piece j is encoded once
     * piece j + keep_back is found, and it ends where piece j + 1 starts. */
    Py_ssize_t ring_small[8];
    Py_ssize_t *ring = ring_small, size = keep_back + 1;
    if (size > 8 && (ring = PyMem_Malloc(sizeof(Py_ssize_t) * size)) == NULL)
        return PyErr_NoMemory();
    Buffer out = {NULL, 0, 0}, scratch = {NULL, 0, 0};
    Py_ssize_t count = 0, consumed = pos;
    for (Py_ssize_t p = pos; p < end; count++) {
        Py_ssize_t q = next_piece(self, s, p, end);
        ring[count % size] = p;
        if (count >= keep_back) {
            Py_ssize_t j = count - keep_back;
            Py_ssize_t start = ring[j % size];
            Py_ssize_t stop = keep_back == 0 ? q : ring[(j + 1) % size];
            if (piece_ids(self, text, s, start, stop, &out, &scratch) < 0)
                goto fail;
            consumed = stop;
        }
        p = q;
    }
    if (ring != ring_small)
        PyMem_Free(ring);
    PyMem_Free(scratch.data);
    PyObject *ids = PyBytes_FromStringAndSize(out.data ? out.data : "", out.len);
    PyMem_Free(out.data);
    if (ids == NULL)
        return NULL;
    return Py_BuildValue("Nnn", ids, count, consumed);
fail:
    if (ring != ring_small)
        PyMem_Free(ring);
    PyMem_Free(scratch.data);
    PyMem_Free(out.data);
    return NULL;
}

static PyObject *cache_clear(PieceCache *self, PyObject *Py_UNUSED(ignored)) {
    if (reset(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static Py_ssize_t cache_len(PieceCache *self) { return (Py_ssize_t)self->count; }

static int cache_init(PieceCache *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"family", "max_digits", "missing", "limit", "max_key", NULL};
    int family, max_digits;
    PyObject *missing;
    Py_ssize_t limit, max_key;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiOnn:PieceCache", keywords, &family,
                                     &max_digits, &missing, &limit, &max_key))
        return -1;
    if (family != GPT2 && family != LLAMA3) {
        PyErr_SetString(PyExc_ValueError, "family must be 0 (GPT-2) or 1 (Llama 3)");
        return -1;
    }
    if (max_digits < 1 || limit < 1 || max_key < 0 || !PyCallable_Check(missing)) {
        PyErr_SetString(PyExc_ValueError,
                        "need max_digits >= 1, limit >= 1, max_key >= 0, a callable missing");
        return -1;
    }
    if (reset(self) < 0)
        return -1;
    self->family = family;
    self->max_digits = max_digits;
    self->limit = (size_t)limit;
    self->max_key = max_key;
    Py_INCREF(missing);
    Py_XSETREF(self->missing, missing);
    return 0;
}

static int cache_traverse(PieceCache *self, visitproc visit, void *arg) {
    Py_VISIT(self->missing);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int cache_gc_clear(PieceCache *self) {
    Py_CLEAR(self->missing);
    return 0;
}

static void cache_dealloc(PieceCache *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    cache_gc_clear(self);
    if (self->slots != NULL)
        free_slots(self->slots, self->mask + 1);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyMethodDef cache_methods[] = {
    {"split", (PyCFunction)cache_split, METH_VARARGS,
     "split(text, pos, end) -> list[str]: the pieces of the ASCII text[pos:end]"},
    {"encode", (PyCFunction)cache_encode, METH_VARARGS,
     "encode(text, pos, end, keep_back) -> (ids: bytes, pieces: int, consumed_to: int)"},
    {"clear", (PyCFunction)cache_clear, METH_NOARGS, "Forget every piece."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot cache_slots[] = {
    {Py_tp_doc, "PieceCache(family, max_digits, missing, limit, max_key): an ASCII "
                "pre-tokenizer split and a bounded cache of each piece's ids."},
    {Py_tp_init, cache_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, cache_dealloc},
    {Py_tp_traverse, cache_traverse},
    {Py_tp_clear, cache_gc_clear},
    {Py_tp_methods, cache_methods},
    {Py_mp_length, cache_len},
    {Py_sq_length, cache_len},
    {0, NULL},
};

static PyType_Spec cache_spec = {
    "epp.tokenization._kernels.PieceCache", sizeof(PieceCache), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, cache_slots,
};

/* none_in(text, bitmap) -> bool: whether no character of `text` has its bit set in
 * `bitmap` (bit c % 8 of byte c / 8, for every code point: 0x110000 bits). fast.py's
 * `safe` on text that is not ASCII: one load per character where `re` matched a class of
 * hundreds of ranges. */
static PyObject *k_none_in(PyObject *self, PyObject *args) {
    PyObject *text;
    Py_buffer bitmap;
    if (!PyArg_ParseTuple(args, "Uy*:none_in", &text, &bitmap))
        return NULL;
    if (bitmap.len < (0x10FFFF >> 3) + 1) {
        PyBuffer_Release(&bitmap);
        PyErr_SetString(PyExc_ValueError, "bitmap must hold a bit for every code point");
        return NULL;
    }
    if (ready(text) < 0) {
        PyBuffer_Release(&bitmap);
        return NULL;
    }
    const unsigned char *bits = bitmap.buf;
    const void *data = PyUnicode_DATA(text);
    int kind = PyUnicode_KIND(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    int clear = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (bits[c >> 3] & (1u << (c & 7))) {
            clear = 0;
            break;
        }
    }
    PyBuffer_Release(&bitmap);
    return PyBool_FromLong(clear);
}

static PyMethodDef module_methods[] = {
    {"none_in", k_none_in, METH_VARARGS,
     "none_in(text, bitmap) -> bool: no character of text has its bit set"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Compiled kernel of the fast tokenizer path.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *type = PyType_FromSpec(&cache_spec);
    if (type == NULL || PyModule_AddObject(m, "PieceCache", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "GPT2", GPT2) < 0 || PyModule_AddIntConstant(m, "LLAMA3", LLAMA3) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
