/*
 * One pass over a chunk of Kineto trace events (a JSON array of objects) into flat columns,
 * with no Python object per event: the compiled fast path of diag.analyzers.trace.scan.
 *
 * It reads the same keys, with the same types and defaults, as the tagged msgspec union of
 * diag.analyzers.trace.schema (or as its `Event`), and it is stricter: on anything it does not
 * fully understand (a JSON error, a value of an unexpected type, a category outside the table,
 * an escape in a name, a duplicate key, deep nesting, a number it cannot convert exactly) it
 * returns the offset where it stopped, and the chunk takes the Python path, which reports or
 * repairs it. So where this accepts a chunk, the columns are those the Python path would build.
 *
 * scan(data, cats, groups, as_event) -> int | ("trailing", int) | (n, names, columns)
 *   data:     a bytes-like JSON array of events
 *   cats:     {category bytes: category code}
 *   groups:   bytes; groups[code] is the code's group (G_* below)
 *   as_event: read every event as schema.Event does (the Python path's fallback from the union:
 *             a missing category is "", an unknown one is not read, every key is typed)
 *   n:        the chunk's events
 *   names:    the distinct event names of the chunk, in order of first appearance
 *   columns:  {column name: a bytearray of the column's values, one per event read: the events
 *             of categories whose struct reads nothing (flow arrows) have no row}
 *   ("trailing", i): the array is whole and valid, and text follows it from byte i
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { G_SKIP = 0, G_DEV = 1, G_RT = 2, G_CPU = 3, G_GPU_ANN = 4, G_INSTANT = 5, N_GROUPS = 6 };
/* Not a group: the types of `Event`, which holds every key of every group. */
#define G_EVENT N_GROUPS
enum { T_NONE = 0, T_STR, T_INT, T_FLOAT, T_NULL, T_BOOL, T_OBJ, T_ARR };
#define MAX_DEPTH 64
#define MAX_CATS 64

typedef struct {
    int type;
    Py_ssize_t start, end; /* the value's raw text: data[start:end] */
    int escaped;           /* a string with a backslash */
    signed char has_i, has_d; /* numbers are converted once: 1 done (iv, dv), -1 not convertible */
    int64_t iv;
    double dv;
} Tok;

/* The keys read at the top of an event and in its args. */
enum { K_CAT, K_NAME, K_TID, K_TS, K_DUR, K_ARGS, N_TOP };
enum {
    A_STREAM, A_CORR, A_EXT, A_EXT_OLD, A_FLOPS, A_BYTES, A_EV_IDX, A_DIMS, A_TYPE, A_CONCRETE,
    A_COLL, A_PG_NAME, A_PG_ID, A_PG_DESC, A_GROUP_SIZE, A_IN_NELEMS, A_OUT_NELEMS, A_DTYPE, A_SEQ,
    A_TOTAL_ALLOC, A_DEV_TYPE, A_DEV_ID, N_ARGS
};
static const char *TOP_KEYS[N_TOP] = {"cat", "name", "tid", "ts", "dur", "args"};
static const char *ARG_KEYS[N_ARGS] = {
    "stream", "correlation", "External id", "external id", "flops", "bytes", "Ev Idx", "Input Dims",
    "Input type", "Concrete Inputs", "Collective name", "Process Group Name", "Process Group ID",
    "Process Group Description", "Group size", "In msg nelems", "Out msg nelems", "dtype", "Seq",
    "Total Allocated", "Device Type", "Device Id"};

/* How each group's struct types an args key (schema._args_struct): absent from the struct
   (not read, any value), Any, int64, int64 or null, float, float or null, str or null, raw. */
enum { V_NO = 0, V_ANY, V_I64, V_I64_NULL, V_FLOAT, V_FLOAT_NULL, V_STR_NULL, V_RAW };
static unsigned char ARG_TYPE[N_GROUPS + 1][N_ARGS];

static void init_arg_types(void) {
    static const int coll[] = {A_COLL, A_PG_NAME, A_PG_ID, A_PG_DESC, A_GROUP_SIZE, A_IN_NELEMS,
                               A_OUT_NELEMS, A_DTYPE, A_SEQ};
    static const unsigned char coll_t[] = {V_STR_NULL, V_ANY, V_ANY, V_STR_NULL, V_I64_NULL,
                                           V_I64_NULL, V_I64_NULL, V_STR_NULL, V_ANY};
    memset(ARG_TYPE, V_NO, sizeof ARG_TYPE);
    unsigned char *d = ARG_TYPE[G_DEV], *r = ARG_TYPE[G_RT], *c = ARG_TYPE[G_CPU], *m = ARG_TYPE[G_INSTANT];
    d[A_STREAM] = V_ANY; d[A_CORR] = V_I64; d[A_EXT] = V_I64; d[A_EXT_OLD] = V_I64; d[A_BYTES] = V_FLOAT;
    r[A_STREAM] = V_ANY; r[A_CORR] = V_I64;
    c[A_EXT] = V_I64; c[A_EXT_OLD] = V_I64; c[A_FLOPS] = V_FLOAT; c[A_EV_IDX] = V_I64;
    c[A_DIMS] = V_RAW; c[A_TYPE] = V_RAW; c[A_CONCRETE] = V_RAW;
    for (size_t i = 0; i < sizeof coll / sizeof coll[0]; i++) {
        d[coll[i]] = coll_t[i];
        c[coll[i]] = coll_t[i];
    }
    m[A_TOTAL_ALLOC] = V_FLOAT_NULL; m[A_DEV_TYPE] = V_I64_NULL; m[A_DEV_ID] = V_I64_NULL;
    for (int a = 0; a < N_ARGS; a++) /* the groups agree on every key's type */
        ARG_TYPE[G_EVENT][a] = d[a] | r[a] | c[a] | m[a];
}

/* -- the columns -------------------------------------------------------------------------- */

typedef struct {
    PyObject *arr; /* a bytearray, resized as rows come and handed to Python as it is */
    char *buf;
} Col;

enum {
    C_CODE, C_NAME, C_TS, C_DUR, C_TID, C_STREAM, C_CORR, C_EXT, C_EXT_OLD, C_FLOPS, C_BYTES, C_EV_IDX,
    C_DIMS_AT, C_DIMS_LEN, C_TYPE_AT, C_TYPE_LEN, C_CONC_AT, C_CONC_LEN, C_ARGS_AT, C_ARGS_LEN, C_COLL,
    C_TOTAL_ALLOC, C_DEV_TYPE, C_DEV_ID, N_COLS
};
static const char *COL_NAMES[N_COLS] = {
    "code", "name", "ts", "dur", "tid", "stream", "corr", "ext", "ext_old", "flops", "bytes", "ev_idx",
    "dims_at", "dims_len", "type_at", "type_len", "conc_at", "conc_len", "args_at", "args_len", "coll",
    "total_alloc", "dev_type", "dev_id"};
/* Offsets and lengths within a chunk take 32 bits: a chunk over 2 GiB is declined. */
static const int COL_SIZES[N_COLS] = {1, 4, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4, 1, 8, 8, 8};

typedef struct {
    Col cols[N_COLS];
    Py_ssize_t n, cap;
    Py_ssize_t events; /* every event of the chunk; rows are kept for the read ones only */
    Py_ssize_t first_cap; /* sized from the chunk's bytes, so that a chunk rarely grows the table */
} Table;

/* Room for more rows; -1 with an exception set. */
static int table_grow(Table *t) {
    Py_ssize_t cap = t->cap ? t->cap * 2 : t->first_cap;
    for (int i = 0; i < N_COLS; i++) {
        Col *c = &t->cols[i];
        if (c->arr == NULL && (c->arr = PyByteArray_FromStringAndSize(NULL, 0)) == NULL)
            return -1;
        if (PyByteArray_Resize(c->arr, cap * COL_SIZES[i]) < 0)
            return -1;
        c->buf = PyByteArray_AS_STRING(c->arr);
    }
    t->cap = cap;
    return 0;
}

static void table_free(Table *t) {
    for (int i = 0; i < N_COLS; i++)
        Py_CLEAR(t->cols[i].arr);
}

#define PUT(t, c, type, v) (((type *)(t)->cols[c].buf)[(t)->n] = (v))

/* -- the names: interned per chunk by their bytes --------------------------------------- */

typedef struct {
    Py_ssize_t start, len; /* into data */
    int32_t id;
} Slot;

typedef struct {
    Slot *slots;
    Py_ssize_t mask, used;
    PyObject *list; /* the names as str, by id */
} Names;

/* Eight bytes a step (names run to hundreds of bytes): a multiply and a shift per word. */
static uint64_t hash_bytes(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, p + i, (size_t)(n - i));
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 29);
}

static Slot *empty_slots(Py_ssize_t size) {
    Slot *slots = PyMem_Malloc((size_t)size * sizeof(Slot));
    if (slots != NULL)
        for (Py_ssize_t j = 0; j < size; j++)
            slots[j].id = -1;
    return slots;
}

static int names_rehash(Names *nm, const unsigned char *data) {
    Py_ssize_t size = (nm->mask + 1) * 2;
    Slot *slots = empty_slots(size);
    if (slots == NULL)
        return -1;
    for (Py_ssize_t i = 0; i <= nm->mask; i++) {
        Slot s = nm->slots[i];
        if (s.id < 0)
            continue;
        Py_ssize_t j = (Py_ssize_t)(hash_bytes(data + s.start, s.len) & (uint64_t)(size - 1));
        while (slots[j].id >= 0)
            j = (j + 1) & (size - 1);
        slots[j] = s;
    }
    PyMem_Free(nm->slots);
    nm->slots = slots;
    nm->mask = size - 1;
    return 0;
}

/* The id of the name data[start:start+len] (a string without escapes); -1 with an exception
   set on failure, -2 where its bytes are not valid UTF-8 (the Python path reports that). */
static int32_t name_id(Names *nm, const unsigned char *data, Py_ssize_t start, Py_ssize_t len) {
    Py_ssize_t j = (Py_ssize_t)(hash_bytes(data + start, len) & (uint64_t)nm->mask);
    while (nm->slots[j].id >= 0) {
        Slot *s = &nm->slots[j];
        if (s->len == len && memcmp(data + s->start, data + start, (size_t)len) == 0)
            return s->id;
        j = (j + 1) & nm->mask;
    }
    PyObject *str = PyUnicode_DecodeUTF8((const char *)data + start, len, "strict");
    if (str == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            return -1;
        PyErr_Clear();
        return -2;
    }
    int rc = PyList_Append(nm->list, str);
    Py_DECREF(str);
    if (rc < 0)
        return -1;
    int32_t id = (int32_t)nm->used++;
    nm->slots[j].start = start;
    nm->slots[j].len = len;
    nm->slots[j].id = id;
    if (nm->used * 2 > nm->mask + 1 && names_rehash(nm, data) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return id;
}

/* -- the JSON scanner --------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p;
    Py_ssize_t i, n;
} Scan;

static inline void skip_ws(Scan *s) {
    const unsigned char *p = s->p;
    Py_ssize_t i = s->i, n = s->n;
    if (i < n && p[i] > ' ')
        return; /* compact JSON, as most profilers write it: nothing to skip */
    while (i < n && (p[i] == ' ' || p[i] == '\n' || p[i] == '\r' || p[i] == '\t'))
        i++;
    s->i = i;
}

static inline int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The length of a valid UTF-8 sequence at p (strict, as Python decodes), else 0. */
static Py_ssize_t utf8_len(const unsigned char *p, Py_ssize_t left) {
    unsigned char c = p[0];
    if (c >= 0xC2 && c <= 0xDF)
        return left >= 2 && (p[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (left < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80)
            return 0;
        if (c == 0xE0 && p[1] < 0xA0) return 0; /* overlong */
        if (c == 0xED && p[1] >= 0xA0) return 0; /* a surrogate */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (left < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80)
            return 0;
        if (c == 0xF0 && p[1] < 0x90) return 0;
        if (c == 0xF4 && p[1] >= 0x90) return 0;
        return 4;
    }
    return 0;
}

/* The bytes that end a string's plain run: the quote, a backslash, control characters (which
   JSON forbids raw) and the lead bytes of UTF-8 sequences (checked one by one). */
static unsigned char STR_STOP[256];

static void init_str_stop(void) {
    for (int c = 0; c < 256; c++)
        STR_STOP[c] = c < 0x20 || c == '"' || c == '\\' || c >= 0x80;
}

/* The end of the plain run of string characters from i: 16 bytes a step where SSE2 is there
   (every x86-64), a table lookup a byte elsewhere. */
static inline Py_ssize_t plain_run(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) {
#if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'), space = _mm_set1_epi8(0x20);
    while (i + 16 <= n) {
        __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
        /* signed: bytes from 0x80 up compare below 0x20 too, as the table marks them */
        __m128i stop = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                                    _mm_cmplt_epi8(v, space));
        int mask = _mm_movemask_epi8(stop);
        if (mask)
            return i + __builtin_ctz((unsigned)mask);
        i += 16;
    }
#endif
    while (i < n && !STR_STOP[p[i]])
        i++;
    return i;
}

/* A string at s->i (its opening quote); its token, or -1 where it is not strictly valid. */
static int scan_string(Scan *s, Tok *t) {
    const unsigned char *p = s->p;
    Py_ssize_t i = s->i + 1, n = s->n;
    t->type = T_STR;
    t->start = s->i;
    t->escaped = 0;
    while (i < n) {
        i = plain_run(p, i, n);
        if (i >= n)
            return -1;
        unsigned char c = p[i];
        if (c == '"') {
            s->i = i + 1;
            t->end = s->i;
            return 0;
        }
        if (c < 0x20)
            return -1;
        if (c == '\\') {
            t->escaped = 1;
            if (i + 1 >= n)
                return -1;
            unsigned char e = p[i + 1];
            if (e == 'u') {
                if (i + 5 >= n)
                    return -1;
                int v = 0;
                for (int k = 2; k < 6; k++) {
                    int h = hexval(p[i + k]);
                    if (h < 0)
                        return -1;
                    v = v * 16 + h;
                }
                if (v >= 0xD800 && v <= 0xDFFF)
                    return -1; /* surrogates: the Python path decides */
                i += 6;
                continue;
            }
            if (!strchr("\"\\/bfnrt", e) || e == 0)
                return -1;
            i += 2;
            continue;
        }
        if (c >= 0x80) {
            Py_ssize_t k = utf8_len(p + i, n - i);
            if (!k)
                return -1;
            i += k;
            continue;
        }
        i++;
    }
    return -1;
}

/* A number at s->i, strictly by the JSON grammar: T_INT or T_FLOAT, or -1. */
static int scan_number(Scan *s, Tok *t) {
    const unsigned char *p = s->p;
    Py_ssize_t i = s->i, n = s->n;
    int is_float = 0;
    t->start = i;
    t->escaped = 0;
    if (i < n && p[i] == '-')
        i++;
    if (i >= n)
        return -1;
    if (p[i] == '0') {
        i++;
    } else if (p[i] >= '1' && p[i] <= '9') {
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    } else {
        return -1;
    }
    if (i < n && p[i] == '.') {
        is_float = 1;
        i++;
        if (i >= n || p[i] < '0' || p[i] > '9')
            return -1;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        is_float = 1;
        i++;
        if (i < n && (p[i] == '+' || p[i] == '-'))
            i++;
        if (i >= n || p[i] < '0' || p[i] > '9')
            return -1;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    }
    t->type = is_float ? T_FLOAT : T_INT;
    t->has_i = t->has_d = 0;
    t->end = i;
    s->i = i;
    return 0;
}

static int scan_literal(Scan *s, Tok *t, const char *word, int type) {
    size_t len = strlen(word);
    if ((size_t)(s->n - s->i) < len || memcmp(s->p + s->i, word, len) != 0)
        return -1;
    t->type = type;
    t->start = s->i;
    t->end = s->i + (Py_ssize_t)len;
    t->escaped = 0;
    s->i += (Py_ssize_t)len;
    return 0;
}

static int scan_container(Scan *s, Tok *t);

/* Any JSON value at s->i, validated and skipped; nesting is followed with a bounded stack. */
static inline int scan_value(Scan *s, Tok *t) {
    skip_ws(s);
    if (s->i >= s->n)
        return -1;
    unsigned char c = s->p[s->i];
    if (c == '"')
        return scan_string(s, t);
    if (c == '-' || (c >= '0' && c <= '9'))
        return scan_number(s, t);
    if (c == 't')
        return scan_literal(s, t, "true", T_BOOL);
    if (c == 'f')
        return scan_literal(s, t, "false", T_BOOL);
    if (c == 'n')
        return scan_literal(s, t, "null", T_NULL);
    if (c != '{' && c != '[')
        return -1;
    return scan_container(s, t);
}

/* An object or array at s->i, walked with a stack of open brackets. */
static int scan_container(Scan *s, Tok *t) {
    unsigned char c = s->p[s->i];
    char stack[MAX_DEPTH];
    int depth = 0;
    Tok inner;
    t->type = c == '{' ? T_OBJ : T_ARR;
    t->start = s->i;
    t->escaped = 0;
    for (;;) {
        /* at an opening bracket */
        if (depth >= MAX_DEPTH)
            return -1;
        stack[depth++] = (char)s->p[s->i];
        s->i++;
        skip_ws(s);
        if (s->i >= s->n)
            return -1;
        if ((stack[depth - 1] == '{' && s->p[s->i] == '}') || (stack[depth - 1] == '[' && s->p[s->i] == ']'))
            goto closed; /* the closing bracket is consumed there */
    member:
        if (stack[depth - 1] == '{') {
            skip_ws(s);
            if (s->i >= s->n || s->p[s->i] != '"' || scan_string(s, &inner) < 0)
                return -1;
            skip_ws(s);
            if (s->i >= s->n || s->p[s->i] != ':')
                return -1;
            s->i++;
        }
        skip_ws(s);
        if (s->i >= s->n)
            return -1;
        c = s->p[s->i];
        if (c == '{' || c == '[')
            continue; /* descend */
        if (scan_value(s, &inner) < 0)
            return -1;
    closed:
        for (;;) {
            skip_ws(s);
            if (s->i >= s->n)
                return -1;
            c = s->p[s->i];
            if (c == ',') {
                s->i++;
                goto member;
            }
            if ((c == '}' && stack[depth - 1] == '{') || (c == ']' && stack[depth - 1] == '[')) {
                s->i++;
                if (--depth == 0) {
                    t->end = s->i;
                    return 0;
                }
                continue;
            }
            return -1;
        }
    }
}

/* Known keys by length and first byte: a lookup and a short chain instead of a scan of them all. */
typedef struct {
    const char **keys;
    size_t lens[32];
    signed char first[32][128], next[32];
} KeySet;

static KeySet TOP_SET, ARG_SET;

static void keyset_init(KeySet *ks, const char **keys, int n) {
    ks->keys = keys;
    memset(ks->first, -1, sizeof ks->first);
    for (int i = n - 1; i >= 0; i--) {
        size_t len = strlen(keys[i]);
        unsigned char c = (unsigned char)keys[i][0];
        ks->lens[i] = len;
        ks->next[i] = ks->first[len][c];
        ks->first[len][c] = (signed char)i;
    }
}

/* The index of the key at s->i in ks, -1 for another key, -2 on bad JSON; a key with an
   escape is refused (-2): msgspec matches keys after unescaping. */
static int scan_key(Scan *s, const KeySet *ks) {
    Tok k;
    if (s->i >= s->n || s->p[s->i] != '"' || scan_string(s, &k) < 0 || k.escaped)
        return -2;
    const unsigned char *key = s->p + k.start + 1;
    size_t len = (size_t)(k.end - k.start - 2);
    if (len == 0 || len >= 32 || key[0] >= 128)
        return -1;
    for (int i = ks->first[len][key[0]]; i >= 0; i = ks->next[i]) {
        size_t j = 1; /* keys are short: compared inline, not through a call */
        while (j < len && ks->keys[i][j] == (char)key[j])
            j++;
        if (j == len)
            return i;
    }
    return -1;
}

/* An object at s->i whose known keys' values are recorded in toks (type T_NONE: absent), and
   their bits in mask; -1 on bad JSON or a repeated known key. The slots of the previous
   object's keys are cleared first: a few stores instead of the whole array. */
static void forget(Tok *toks, uint32_t *mask) {
    uint32_t m = *mask;
    for (int i = 0; m; i++, m >>= 1)
        if (m & 1)
            toks[i].type = T_NONE;
    *mask = 0;
}

/* A key whose value, where it is an object, has its own known keys read too (an event's args). */
typedef struct {
    int at;
    const KeySet *ks;
    Tok *toks;
    uint32_t *mask;
} Nested;

static int scan_object(Scan *s, const KeySet *ks, Tok *toks, uint32_t *mask, const Nested *nested) {
    forget(toks, mask);
    if (s->i >= s->n || s->p[s->i] != '{')
        return -1;
    s->i++;
    skip_ws(s);
    if (s->i < s->n && s->p[s->i] == '}') {
        s->i++;
        return 0;
    }
    for (;;) {
        skip_ws(s);
        int k = scan_key(s, ks);
        if (k == -2)
            return -1;
        skip_ws(s);
        if (s->i >= s->n || s->p[s->i] != ':')
            return -1;
        s->i++;
        skip_ws(s);
        Tok skipped, *v = k >= 0 ? &toks[k] : &skipped;
        if (k >= 0 && (*mask & (1u << k)))
            return -1;
        if (nested != NULL && k == nested->at && s->i < s->n && s->p[s->i] == '{') {
            v->type = T_OBJ;
            v->start = s->i;
            v->escaped = 0;
            if (scan_object(s, nested->ks, nested->toks, nested->mask, NULL) < 0)
                return -1;
            v->end = s->i;
        } else if (scan_value(s, v) < 0) {
            return -1;
        }
        if (k >= 0)
            *mask |= 1u << k;
        skip_ws(s);
        if (s->i >= s->n)
            return -1;
        if (s->p[s->i] == ',') {
            s->i++;
            continue;
        }
        if (s->p[s->i] == '}') {
            s->i++;
            return 0;
        }
        return -1;
    }
}

/* -- values, as the struct types read them ------------------------------------------------ */

/* An integer token as int64; -1 where it is out of range (msgspec would refuse or widen). */
static int convert_i64(const Scan *s, const Tok *t, int64_t *out) {
    if (t->type != T_INT)
        return -1;
    const unsigned char *p = s->p + t->start;
    Py_ssize_t len = t->end - t->start;
    int neg = p[0] == '-';
    if (len - neg > 18)
        return -1; /* beyond 18 digits the Python path decides */
    int64_t v = 0;
    for (Py_ssize_t i = neg; i < len; i++)
        v = v * 10 + (p[i] - '0');
    *out = neg ? -v : v;
    return 0;
}

/* Clinger's fast path: a decimal whose digits, read as an integer m, stay within 2^53 and
   whose exponent e lies within +-22 is m * 10^e or m / 10^-e, both exact operands, so one
   correctly rounded operation gives the correctly rounded value (SSE doubles, no x87 excess
   precision). Anything else: -1, for the full conversion. */
static const double POW10[23] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static int fast_double(const unsigned char *p, Py_ssize_t len, double *out) {
    Py_ssize_t i = 0;
    int neg = p[0] == '-';
    uint64_t m = 0;
    int e10 = 0;
    i += neg;
    for (; i < len && p[i] >= '0' && p[i] <= '9'; i++) {
        m = m * 10 + (uint64_t)(p[i] - '0');
        if (m > (1ULL << 53))
            return -1;
    }
    if (i < len && p[i] == '.') {
        for (i++; i < len && p[i] >= '0' && p[i] <= '9'; i++) {
            m = m * 10 + (uint64_t)(p[i] - '0');
            if (m > (1ULL << 53))
                return -1;
            e10--;
        }
    }
    if (i < len) { /* an exponent */
        i++;
        int eneg = 0, ev = 0;
        if (p[i] == '+' || p[i] == '-')
            eneg = p[i++] == '-';
        for (; i < len; i++) {
            ev = ev * 10 + (p[i] - '0');
            if (ev > 400)
                return -1;
        }
        e10 += eneg ? -ev : ev;
    }
    if (e10 < -22 || e10 > 22)
        return -1;
    double v = (double)m;
    v = e10 < 0 ? v / POW10[-e10] : v * POW10[e10];
    *out = neg ? -v : v;
    return 0;
}

/* A number token as a double, correctly rounded as msgspec's; -1 for anything else. */
static int convert_double(const Scan *s, const Tok *t, double *out) {
    if (t->type == T_INT) {
        int64_t v;
        if (convert_i64(s, t, &v) < 0)
            return -1;
        *out = (double)v; /* round to nearest, as the number's text would */
        return 0;
    }
    if (t->type != T_FLOAT)
        return -1;
    if (fast_double(s->p + t->start, t->end - t->start, out) == 0)
        return 0;
    char tmp[64];
    Py_ssize_t len = t->end - t->start;
    if (len >= (Py_ssize_t)sizeof tmp)
        return -1;
    memcpy(tmp, s->p + t->start, (size_t)len);
    tmp[len] = 0;
    char *end = NULL;
    double v = PyOS_string_to_double(tmp, &end, NULL);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (end != tmp + len || !isfinite(v))
        return -1;
    *out = v;
    return 0;
}

/* The token as an int64 or a double, converted once per token. */
static int as_i64(const Scan *s, Tok *t, int64_t *out) {
    if (t->type != T_INT)
        return -1;
    if (!t->has_i)
        t->has_i = convert_i64(s, t, &t->iv) == 0 ? 1 : -1;
    *out = t->iv;
    return t->has_i > 0 ? 0 : -1;
}

static int as_double(const Scan *s, Tok *t, double *out) {
    if (t->type != T_INT && t->type != T_FLOAT)
        return -1;
    if (!t->has_d)
        t->has_d = convert_double(s, t, &t->dv) == 0 ? 1 : -1;
    *out = t->dv;
    return t->has_d > 0 ? 0 : -1;
}

/* A timestamp or duration: a number within msgspec's Finite bounds. */
static int as_finite(const Scan *s, Tok *t, double dflt, double *out) {
    if (t->type == T_NONE) {
        *out = dflt;
        return 0;
    }
    if (as_double(s, t, out) < 0 || *out < -1e300 || *out > 1e300)
        return -1;
    return 0;
}

/* Whether the arg token is of a type its struct field accepts. */
static int arg_ok(const Tok *t, int vt) {
    if (t->type == T_NONE || vt == V_NO || vt == V_ANY || vt == V_RAW)
        return 1;
    switch (vt) {
    case V_I64: return t->type == T_INT;
    case V_I64_NULL: return t->type == T_INT || t->type == T_NULL;
    case V_FLOAT: return t->type == T_INT || t->type == T_FLOAT;
    case V_FLOAT_NULL: return t->type == T_INT || t->type == T_FLOAT || t->type == T_NULL;
    case V_STR_NULL: return (t->type == T_STR && !t->escaped) || t->type == T_NULL;
    }
    return 0;
}

/* -- one event ---------------------------------------------------------------------------- */

typedef struct {
    const unsigned char *cat[MAX_CATS];
    Py_ssize_t cat_len[MAX_CATS];
    int code[MAX_CATS];
    int n_cats;
    int empty_code; /* the code of "", an event without a category under `Event` */
    unsigned char group_of[256];
    signed char first[32][256], next[MAX_CATS]; /* by length and first byte, as KeySet */
} Cats;

static int cat_code(const Cats *c, const Scan *s, const Tok *t) {
    const unsigned char *p = s->p + t->start + 1;
    Py_ssize_t len = t->end - t->start - 2;
    if (len >= 32)
        return -1;
    for (int i = c->first[len][len ? p[0] : 0]; i >= 0; i = c->next[i])
        if (memcmp(c->cat[i], p, (size_t)len) == 0)
            return c->code[i];
    return -1;
}

/* Where a value's raw text lies in the chunk (0, 0 where the key is absent); chunks are under
   2 GiB, so 32 bits hold it. */
static inline int32_t span_at(const Tok *t) {
    return t->type == T_NONE ? 0 : (int32_t)t->start;
}

static inline int32_t span_len(const Tok *t) {
    return t->type == T_NONE ? 0 : (int32_t)(t->end - t->start);
}

static int64_t i64_or(const Scan *s, Tok *t, int64_t dflt) {
    int64_t v;
    return t->type != T_NONE && t->type != T_NULL && as_i64(s, t, &v) == 0 ? v : dflt;
}

static double f64_or(const Scan *s, Tok *t, double dflt) {
    double v;
    return t->type != T_NONE && t->type != T_NULL && as_double(s, t, &v) == 0 ? v : dflt;
}

/* Whether the event's fields have the types the struct of group g (G_EVENT: `Event`) gives
   them; its start and duration. */
static int fields_ok(const Scan *s, int g, Tok *top, Tok *args, uint32_t present, double *ts, double *dur) {
    if (g == G_SKIP)
        return 1; /* an empty struct: nothing is read */
    int timed = g != G_INSTANT;
    if (timed && top[K_NAME].type != T_NONE && (top[K_NAME].type != T_STR || top[K_NAME].escaped))
        return 0;
    if ((timed && as_finite(s, &top[K_TS], 0.0, ts) < 0) || as_finite(s, &top[K_DUR], -1.0, dur) < 0)
        return 0;
    if (top[K_ARGS].type != T_NONE && top[K_ARGS].type != T_OBJ)
        return 0;
    const unsigned char *types = ARG_TYPE[g];
    for (int a = 0; present; a++, present >>= 1) {
        if (!(present & 1))
            continue;
        int vt = types[a];
        if (!arg_ok(&args[a], vt))
            return 0;
        if (args[a].type == T_NONE || args[a].type == T_NULL)
            continue;
        int64_t i;
        double f;
        if ((vt == V_I64 || vt == V_I64_NULL) && as_i64(s, &args[a], &i) < 0)
            return 0; /* beyond what this converts exactly */
        if ((vt == V_FLOAT || vt == V_FLOAT_NULL) && as_double(s, &args[a], &f) < 0)
            return 0;
    }
    return 1;
}

/* A stream the columns read as the Python path does: an integer; null, or a HIP stream written
   "0x...", which int() refuses, reads -1. Anything else is left to the Python path. */
static int stream_ok(const Scan *s, Tok *t) {
    int64_t v;
    if (t->type == T_NONE || t->type == T_NULL || (t->type == T_INT && as_i64(s, t, &v) == 0))
        return 1;
    return t->type == T_STR && t->end - t->start >= 4 && s->p[t->start + 1] == '0' &&
           (s->p[t->start + 2] == 'x' || s->p[t->start + 2] == 'X');
}

/* The tokens of one event's known keys, kept from event to event (only the set ones are cleared). */
typedef struct {
    Tok top[N_TOP], args[N_ARGS];
    uint32_t top_mask, args_mask; /* the keys present in the current event */
} Fields;

static void fields_init(Fields *f) {
    for (int i = 0; i < N_TOP; i++)
        f->top[i].type = T_NONE;
    for (int i = 0; i < N_ARGS; i++)
        f->args[i].type = T_NONE;
    f->top_mask = f->args_mask = 0;
}

/* The event at s->i into the table's next row: 0, 1 to fall back to Python, -1 on an error. */
static int scan_event(Scan *s, const Cats *cats, int event_mode, Table *tb, Names *nm, Fields *f) {
    Tok *top = f->top, *args = f->args;
    /* The top level's known keys, and the args' where args is an object. */
    forget(args, &f->args_mask);
    const Nested args_of = {K_ARGS, &ARG_SET, args, &f->args_mask};
    if (scan_object(s, &TOP_SET, top, &f->top_mask, &args_of) < 0)
        return 1;
    /* The category: the union's tag; for `Event`, "" when absent and 0 when unknown. */
    int code;
    if (top[K_CAT].type == T_NONE && event_mode) {
        code = cats->empty_code;
    } else {
        if (top[K_CAT].type != T_STR || top[K_CAT].escaped)
            return 1;
        code = cat_code(cats, s, &top[K_CAT]);
        if (code < 0 && !event_mode)
            return 1;
        code = code < 0 ? 0 : code;
    }
    int g = cats->group_of[code];
    if (tb->n == tb->cap && table_grow(tb) < 0)
        return -1;
    double ts = 0.0, dur = -1.0;
    int64_t tid = 0;
    if (!fields_ok(s, event_mode ? G_EVENT : g, top, args, f->args_mask, &ts, &dur))
        return 1;
    /* What the columns read must be an integer where they take one (else: the Python path). */
    if (g == G_CPU && top[K_TID].type != T_NONE && as_i64(s, &top[K_TID], &tid) < 0)
        return 1;
    if ((g == G_DEV || g == G_RT) && !stream_ok(s, &args[A_STREAM]))
        return 1;
    int32_t name = -1;
    if (g == G_DEV || g == G_RT || g == G_CPU || g == G_GPU_ANN) {
        Py_ssize_t at = top[K_NAME].type == T_NONE ? 0 : top[K_NAME].start + 1;
        Py_ssize_t len = top[K_NAME].type == T_NONE ? 0 : top[K_NAME].end - top[K_NAME].start - 2;
        name = name_id(nm, s->p, at, len);
        if (name == -1)
            return -1;
        if (name == -2)
            return 1;
    }
    tb->events++;
    if (g == G_SKIP)
        return 0; /* counted, and no row: nothing of it is read */
    Tok *a = args;
    PUT(tb, C_CODE, int8_t, (int8_t)code);
    PUT(tb, C_NAME, int32_t, name);
    PUT(tb, C_TS, double, ts);
    PUT(tb, C_DUR, double, dur);
    PUT(tb, C_TID, int64_t, tid);
    PUT(tb, C_STREAM, int64_t, i64_or(s, &a[A_STREAM], -1));
    PUT(tb, C_CORR, int64_t, i64_or(s, &a[A_CORR], -1));
    PUT(tb, C_EXT, int64_t, i64_or(s, &a[A_EXT], -1));
    PUT(tb, C_EXT_OLD, int64_t, i64_or(s, &a[A_EXT_OLD], -1));
    PUT(tb, C_FLOPS, double, f64_or(s, &a[A_FLOPS], NAN));
    PUT(tb, C_BYTES, double, f64_or(s, &a[A_BYTES], NAN));
    PUT(tb, C_EV_IDX, int64_t, i64_or(s, &a[A_EV_IDX], -1));
    PUT(tb, C_DIMS_AT, int32_t, span_at(&a[A_DIMS]));
    PUT(tb, C_DIMS_LEN, int32_t, span_len(&a[A_DIMS]));
    PUT(tb, C_TYPE_AT, int32_t, span_at(&a[A_TYPE]));
    PUT(tb, C_TYPE_LEN, int32_t, span_len(&a[A_TYPE]));
    PUT(tb, C_CONC_AT, int32_t, span_at(&a[A_CONCRETE]));
    PUT(tb, C_CONC_LEN, int32_t, span_len(&a[A_CONCRETE]));
    PUT(tb, C_ARGS_AT, int32_t, span_at(&top[K_ARGS]));
    PUT(tb, C_ARGS_LEN, int32_t, span_len(&top[K_ARGS]));
    PUT(tb, C_COLL, int8_t, (int8_t)(a[A_COLL].type == T_STR));
    PUT(tb, C_TOTAL_ALLOC, double, f64_or(s, &a[A_TOTAL_ALLOC], NAN));
    PUT(tb, C_DEV_TYPE, int64_t, i64_or(s, &a[A_DEV_TYPE], INT64_MIN));
    PUT(tb, C_DEV_ID, int64_t, i64_or(s, &a[A_DEV_ID], INT64_MIN));
    tb->n++;
    return 0;
}

/* -- the module --------------------------------------------------------------------------- */

static int read_cats(PyObject *cats, PyObject *groups, Cats *c) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    c->n_cats = 0;
    c->empty_code = 0;
    memset(c->first, -1, sizeof c->first);
    if (!PyDict_Check(cats) || !PyBytes_Check(groups)) {
        PyErr_SetString(PyExc_TypeError, "cats must be a dict and groups bytes");
        return -1;
    }
    Py_ssize_t n_groups = PyBytes_GET_SIZE(groups);
    memset(c->group_of, 0, sizeof c->group_of);
    for (Py_ssize_t i = 0; i < n_groups && i < 256; i++) {
        unsigned char g = (unsigned char)PyBytes_AS_STRING(groups)[i];
        if (g >= N_GROUPS) {
            PyErr_SetString(PyExc_ValueError, "unknown group");
            return -1;
        }
        c->group_of[i] = g;
    }
    while (PyDict_Next(cats, &pos, &key, &value)) {
        if (!PyBytes_Check(key) || !PyLong_Check(value) || c->n_cats >= MAX_CATS) {
            PyErr_SetString(PyExc_TypeError, "cats must map bytes to int (at most 64)");
            return -1;
        }
        long code = PyLong_AsLong(value);
        if (code < 0 || code >= n_groups) {
            PyErr_SetString(PyExc_ValueError, "a category code without a group");
            return -1;
        }
        c->cat[c->n_cats] = (const unsigned char *)PyBytes_AS_STRING(key);
        c->cat_len[c->n_cats] = PyBytes_GET_SIZE(key);
        c->code[c->n_cats] = (int)code;
        Py_ssize_t len = PyBytes_GET_SIZE(key);
        if (len == 0)
            c->empty_code = (int)code;
        if (len >= 32) {
            PyErr_SetString(PyExc_ValueError, "a category longer than 31 bytes");
            return -1;
        }
        unsigned char first = len ? (unsigned char)PyBytes_AS_STRING(key)[0] : 0;
        c->next[c->n_cats] = c->first[len][first];
        c->first[len][first] = (signed char)c->n_cats;
        c->n_cats++;
    }
    return 0;
}

static PyObject *result_of(Table *tb, Names *nm) {
    PyObject *cols = PyDict_New();
    if (cols == NULL)
        return NULL;
    if (tb->cols[0].arr == NULL && table_grow(tb) < 0) { /* no row at all: empty columns */
        Py_DECREF(cols);
        return NULL;
    }
    for (int i = 0; i < N_COLS; i++) {
        PyObject *arr = tb->cols[i].arr;
        if (PyByteArray_Resize(arr, tb->n * COL_SIZES[i]) < 0 || PyDict_SetItemString(cols, COL_NAMES[i], arr) < 0) {
            Py_DECREF(cols);
            return NULL;
        }
    }
    return Py_BuildValue("(nON)", tb->events, nm->list, cols);
}

static PyObject *scan(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 4) {
        PyErr_SetString(PyExc_TypeError, "scan(data, cats, groups, as_event)");
        return NULL;
    }
    int event_mode = PyObject_IsTrue(argv[3]);
    if (event_mode < 0)
        return NULL;
    Cats cats;
    if (read_cats(argv[1], argv[2], &cats) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(argv[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Table tb;
    memset(&tb, 0, sizeof tb);
    tb.first_cap = view.len / 96 > 1024 ? view.len / 96 : 1024; /* Kineto's events: about 100-300 bytes */
    Names nm = {NULL, 63, 0, PyList_New(0)};
    PyObject *out = NULL;
    int rc = 1;
    nm.slots = empty_slots(64);
    if (nm.list == NULL || nm.slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (view.len > INT32_MAX) { /* spans are 32-bit: the Python path reads it */
        out = PyLong_FromSsize_t(0);
        goto done;
    }
    Scan s = {(const unsigned char *)view.buf, 0, view.len};
    Fields fields;
    fields_init(&fields);
    /* The GIL stays held: new names become str objects as they are met. */
    skip_ws(&s);
    if (s.i >= s.n || s.p[s.i] != '[') {
        out = PyLong_FromSsize_t(s.i); /* not an array: the Python path says what it is */
        goto done;
    }
    s.i++;
    skip_ws(&s);
    if (s.i < s.n && s.p[s.i] == ']') {
        s.i++;
        rc = 0;
    }
    while (rc == 1) {
        skip_ws(&s);
        int r = scan_event(&s, &cats, event_mode, &tb, &nm, &fields);
        if (r != 0) {
            rc = r;
            break;
        }
        skip_ws(&s);
        if (s.i < s.n && s.p[s.i] == ',') {
            s.i++;
            continue;
        }
        if (s.i < s.n && s.p[s.i] == ']') {
            s.i++;
            rc = 0;
        }
        break;
    }
    if (rc == 0) {
        skip_ws(&s);
        if (s.i != s.n)
            rc = 2; /* a whole array, and something after it */
    }
    if (rc == 0)
        out = result_of(&tb, &nm);
    else if (rc == 1)
        out = PyLong_FromSsize_t(s.i); /* where it stopped: the Python path takes the chunk */
    else if (rc == 2)
        out = Py_BuildValue("(sn)", "trailing", s.i);
done:
    PyBuffer_Release(&view);
    table_free(&tb);
    PyMem_Free(nm.slots);
    Py_XDECREF(nm.list);
    return out;
}

static PyMethodDef METHODS[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(data, cats, groups, as_event) -> int | (n, names, columns): one chunk of trace events as columns, or the offset where it declined"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_kineto_scan", NULL, -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kineto_scan(void) {
    init_arg_types();
    init_str_stop();
    keyset_init(&TOP_SET, TOP_KEYS, N_TOP);
    keyset_init(&ARG_SET, ARG_KEYS, N_ARGS);
    return PyModule_Create(&MODULE);
}
