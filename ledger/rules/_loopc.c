/* ledger.rules._loopc: the loop detector of ledger/rules/loop.py, compiled (and, at the end, the
 * paraphrase detector of ledger/rules/paraphrase.py).
 *
 * Same algorithm, same answers as the pure-Python ``PyLoopDetector`` (the reference): a hash chain over
 * the bigrams of the last max_period + 1 positions, MAX_CHAIN links walked per token, at most
 * MAX_CANDIDATES candidate periods (the one with the smallest run evicted, the oldest first on a tie,
 * as ``min`` over a dict does), near-loop mode (changes=1), the same thresholds and the same LoopHit.
 * Read loop.py first: this file follows it statement by statement.
 *
 * Storage (per detector):
 *   ring   uint32 tokens, position j at ring[j % size]; grows with the output (doubling) up to size
 *   chain  uint32 stored positions, the previous position with the same bigram hash, at chain[j % csize];
 *          grows with the output up to csize = max_period + 1
 *   head   uint32 stored positions, one per hash slot (the same table size as the Python one, so the
 *          same hash collisions and the same chain walks)
 * A stored position is v = pos - base (base starts at -csize), 0 meaning "none" (Python's _FAR): every
 * real position within max_period of the current one is exact, and 0 is always more than max_period
 * away. After 2**31 tokens the positions are rebased (stale ones become 0, which the walk treats
 * exactly as the stale position itself: out of range), so a detector takes any number of tokens.
 *
 * Token ids are 0 .. 2**31 - 1 (ValueError otherwise). extend() converts and checks the whole input
 * before adding any token: a bad id anywhere leaves the detector as it was (an iterator is read to its
 * end first). extend_many(detectors, counts, tokens) checks every detector, count and id, then feeds
 * each detector its slice (loop and paraphrase detectors alike); it prefetches the state of the loop
 * detectors a few places ahead, as thousands of them do not fit in the caches.
 *
 * Beyond the Python detector: max_period is at most 2**24 (the Python one would need a 256 MiB hash
 * table there), and thresholds past 2**36 repeats, 2**60 confirmation tokens or 2**61 tokens are held at
 * that (a run that long is never reached either way). _set_rebase_span and _set_limits exist for the tests only.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_CANDIDATES 8
#define MAX_CHAIN 2
#define MIN_RUN 3
#define NEVER ((int64_t)1 << 62)
#define FAR (-((int64_t)1 << 62))
#define MULT 0x9E3779B1ULL
#define TOKEN_MAX 0x7FFFFFFFLL
#define MAX_PERIOD_LIMIT (1LL << 24)
#define STACK_TOKENS 512

#if defined(__GNUC__)
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define PREFETCH(p) __builtin_prefetch(p)
#define PREFETCH_W(p) __builtin_prefetch((p), 1)
#else
#define LIKELY(x) (x)
#define UNLIKELY(x) (x)
#define PREFETCH(p) ((void)0)
#define PREFETCH_W(p) ((void)0)
#endif

typedef struct {
    int64_t p;    /* candidate period */
    int64_t run;  /* run ending at the last token */
    int64_t need; /* run needed to fire (needs[p]) */
    int64_t mism; /* near-loops: position of its last mismatch */
} Cand;

typedef struct {
    PyObject_HEAD
    /* hot: read on every call (extend_many prefetches these lines) */
    int fired;
    int near;
    int ncands;
    int max_cands; /* MAX_CANDIDATES (tests: _set_limits) */
    int max_chain; /* MAX_CHAIN (tests: _set_limits) */
    uint32_t prev; /* the last token */
    uint32_t mask; /* hash table slots - 1 */
    int64_t n;     /* tokens seen */
    int64_t r;     /* n % size */
    int64_t ci;    /* n % csize */
    int64_t base;  /* stored position v means base + v; 0: none */
    int64_t rebase_at;
    int64_t ring_cap;
    int64_t chain_cap;
    int64_t size;  /* ring window */
    int64_t csize; /* max_period + 1 */
    int64_t max_period;
    uint32_t *ring;
    uint32_t *chain;
    uint32_t *head;
    Cand cands[MAX_CANDIDATES];
    /* cold */
    int64_t min_period;
    int64_t min_repeats, min_span, confirm; /* clamped: a need beyond any output is never reached */
    int64_t hsize;
    int64_t rebase_every;
    int64_t hit_at, hit_period, hit_span, hit_changes;
    PyObject *hit; /* cached LoopHit, made on first use after firing */
    /* public settings, as given (exact ints) */
    PyObject *o_max_period, *o_min_period, *o_min_repeats, *o_min_span, *o_changes, *o_confirm;
} Det;

static PyTypeObject DetType;
static PyObject *LoopHitType = NULL; /* ledger.rules.loop.LoopHit, imported on first hit */
static PyObject *str_at, *str_period, *str_repeats, *str_span, *str_changes;
static int64_t rebase_span = (int64_t)1 << 31; /* _set_rebase_span: tests only */
static int limit_cands = MAX_CANDIDATES, limit_chain = MAX_CHAIN; /* _set_limits: tests only */

/* -- the detector ------------------------------------------------------------------------------- */

static inline int64_t
need_of(const Det *d, int64_t p)
{
    if (p < d->min_period) return NEVER;
    int64_t a = d->min_repeats * p + d->confirm; /* <= 2**60 + 2**60: no overflow */
    int64_t b = d->min_span;
    return (a > b ? a : b) - p;
}

static inline int64_t
wrap(int64_t idx, int64_t size)
{
    return idx < 0 ? idx + size : idx;
}

static int
grow(uint32_t **arr, int64_t *cap, int64_t limit)
{
    int64_t nc = *cap < 8 ? 16 : *cap * 2;
    if (nc > limit) nc = limit;
    uint32_t *a = PyMem_Realloc(*arr, (size_t)nc * sizeof(uint32_t));
    if (a == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = a;
    *cap = nc;
    return 0;
}

static void
rebase(Det *d, int64_t i)
{
    int64_t nb = i - d->csize - 1, delta = nb - d->base;
    /* a stored position at or below nb is more than max_period before i: "none" from now on */
    for (int64_t k = 0; k < d->hsize; k++) {
        int64_t v = d->head[k];
        d->head[k] = v > delta ? (uint32_t)(v - delta) : 0;
    }
    int64_t len = d->n < d->csize ? d->n : d->csize;
    for (int64_t k = 0; k < len; k++) {
        int64_t v = d->chain[k];
        d->chain[k] = v > delta ? (uint32_t)(v - delta) : 0;
    }
    d->base = nb;
    d->rebase_at = nb + d->rebase_every;
}

static void
fire(Det *d, int64_t i, uint32_t token, int64_t p, int64_t run)
{
    d->n = i + 1;
    d->prev = token;
    d->fired = 1;
    int64_t span = run + p, changes = 0;
    if (d->near) {
        int64_t len = d->n < d->size ? d->n : d->size;
        for (int64_t j = i - run + 1; j <= i; j++) {
            int64_t a = ((j % d->size) + d->size) % d->size;
            int64_t b = (((j - p) % d->size) + d->size) % d->size;
            if (a < len && b < len && d->ring[a] != d->ring[b]) changes++;
        }
    }
    d->hit_at = i;
    d->hit_period = p;
    d->hit_span = span;
    d->hit_changes = changes;
}

/* Feed tokens; 1 when the detector fired on one of them (the rest are not added), else 0;
 * -1 with an exception set (out of memory: the tokens before the failing one were added). */
static int
feed(Det *d, const uint32_t *toks, Py_ssize_t count)
{
    if (d->fired) return 0;
    const int64_t size = d->size, csize = d->csize, max_period = d->max_period;
    const uint32_t mask = d->mask;
    const int near = d->near, max_cands = d->max_cands, max_chain = d->max_chain;
    uint32_t *ring = d->ring, *chain = d->chain, *head = d->head;
    int64_t i = d->n, r = d->r, ci = d->ci;
    uint32_t prev = d->prev;
    Cand *cands = d->cands;
    int rc = 0;

    for (Py_ssize_t k = 0; k < count; k++) {
        const uint32_t token = toks[k];
        if (UNLIKELY(r == d->ring_cap)) { /* only while i < size */
            d->n = i; d->r = r; d->ci = ci; d->prev = prev;
            if (grow(&d->ring, &d->ring_cap, size) < 0) { rc = -1; goto out; }
            ring = d->ring;
        }
        if (UNLIKELY(ci == d->chain_cap)) { /* only while i < csize */
            d->n = i; d->r = r; d->ci = ci; d->prev = prev;
            if (grow(&d->chain, &d->chain_cap, csize) < 0) { rc = -1; goto out; }
            chain = d->chain;
        }
        if (UNLIKELY(i >= d->rebase_at)) {
            d->n = i;
            rebase(d, i);
        }
        ring[r] = token;
        int nc = d->ncands;
        if (nc) {
            unsigned dead = 0;
            for (int c = 0; c < nc; c++) {
                Cand *cd = &cands[c];
                if (ring[wrap(r - cd->p, size)] == token) {
                    cd->run++;
                }
                else if (near && i - cd->mism >= cd->p) {
                    cd->mism = i; /* the one change this period may have */
                    cd->run++;
                }
                else {
                    dead |= 1u << c;
                    continue;
                }
                if (cd->run >= cd->need) {
                    fire(d, i, token, cd->p, cd->run);
                    rc = 1;
                    goto done;
                }
            }
            if (dead) {
                int w = 0;
                for (int c = 0; c < nc; c++)
                    if (!(dead & (1u << c))) cands[w++] = cands[c];
                d->ncands = nc = w;
            }
        }
        {
            const int64_t base = d->base;
            const uint32_t h = (uint32_t)((((uint64_t)prev * MULT) ^ token) & mask);
            int64_t ir = i - base;
            int64_t v = head[h];
            head[h] = (uint32_t)ir;
            chain[ci] = (uint32_t)v;
            int hops = 0;
            while (ir - v <= max_period) {
                const int64_t dist = ir - v;
                int known = 0;
                for (int c = 0; c < nc; c++)
                    if (cands[c].p == dist) { known = 1; break; }
                if (!known && dist != i && ring[wrap(r - dist, size)] == token
                    && ring[wrap(r - dist - 1, size)] == prev) {
                    /* t[i-1..i] == t[i-1-d..i-d]: measure the exact run back from i */
                    const int64_t need = need_of(d, dist);
                    const int64_t lim2 = i - dist + 1;
                    const int64_t limit = need < lim2 ? need : lim2;
                    int64_t run = 2;
                    int64_t a = r - 2, b = r - 2 - dist;
                    while (run < limit) {
                        if (a < 0) a += size;
                        if (b < 0) b += size;
                        if (ring[a] != ring[b]) break;
                        run++;
                        a--;
                        b--;
                    }
                    if (run >= need) {
                        fire(d, i, token, dist, run);
                        rc = 1;
                        goto done;
                    }
                    if (run >= MIN_RUN) {
                        if (nc >= max_cands) {
                            int worst = 0;
                            for (int c = 1; c < nc; c++)
                                if (cands[c].run < cands[worst].run) worst = c;
                            memmove(&cands[worst], &cands[worst + 1],
                                    (size_t)(nc - worst - 1) * sizeof(Cand));
                            nc--;
                        }
                        cands[nc].p = dist;
                        cands[nc].run = run;
                        cands[nc].need = need;
                        cands[nc].mism = i - run; /* where the exact run stopped: this period's change */
                        nc++;
                        d->ncands = nc;
                    }
                }
                if (++hops == max_chain) break;
                v = chain[wrap(ci - dist, csize)];
            }
        }
        prev = token;
        i++;
        if (++r == size) r = 0;
        if (++ci == csize) ci = 0;
    }
out:
    d->n = i;
    d->prev = prev;
    d->r = r;
    d->ci = ci;
    return rc;
done:
    /* fire() set n and prev; keep the ring indices in step */
    if (++r == size) r = 0;
    if (++ci == csize) ci = 0;
    d->r = r;
    d->ci = ci;
    return rc;
}

static PyObject *
get_hit(Det *d)
{
    if (!d->fired) Py_RETURN_NONE;
    if (d->hit == NULL) {
        if (LoopHitType == NULL) {
            PyObject *mod = PyImport_ImportModule("ledger.rules.loop");
            if (mod == NULL) return NULL;
            LoopHitType = PyObject_GetAttrString(mod, "LoopHit");
            Py_DECREF(mod);
            if (LoopHitType == NULL) return NULL;
        }
        PyObject *kw = Py_BuildValue("{OLOLOLOLOL}", str_at, (long long)d->hit_at, str_period,
                                     (long long)d->hit_period, str_repeats,
                                     (long long)(d->hit_span / d->hit_period), str_span,
                                     (long long)d->hit_span, str_changes, (long long)d->hit_changes);
        if (kw == NULL) return NULL;
        PyObject *empty = PyTuple_New(0);
        if (empty == NULL) {
            Py_DECREF(kw);
            return NULL;
        }
        d->hit = PyObject_Call(LoopHitType, empty, kw);
        Py_DECREF(empty);
        Py_DECREF(kw);
        if (d->hit == NULL) return NULL;
    }
    Py_INCREF(d->hit);
    return d->hit;
}

/* -- converting token ids ----------------------------------------------------------------------- */

static int
bad_token(PyObject *o)
{
    PyErr_Format(PyExc_ValueError, "token ids must be in 0..2147483647, got %R", o);
    return -1;
}

static inline int
as_token(PyObject *o, uint32_t *out)
{
    int overflow;
    long long v;
    /* small exact ints without a call (the layout of CPython's ints, public in its headers) */
#if PY_VERSION_HEX >= 0x030C0000
    if (LIKELY(PyLong_CheckExact(o)) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        Py_ssize_t sv = PyUnstable_Long_CompactValue((PyLongObject *)o);
        if (LIKELY(sv >= 0)) { /* compact: |v| < 2**30 */
            *out = (uint32_t)sv;
            return 0;
        }
    }
#elif PY_VERSION_HEX >= 0x030B0000 && PyLong_SHIFT == 30
    if (LIKELY(PyLong_CheckExact(o))) {
        Py_ssize_t sz = Py_SIZE(o);
        const digit *dg = ((PyLongObject *)o)->ob_digit;
        if (sz == 1) {
            *out = (uint32_t)dg[0];
            return 0;
        }
        if (sz == 0) {
            *out = 0;
            return 0;
        }
        if (sz == 2 && dg[1] <= 1) { /* < 2**31 */
            *out = (uint32_t)dg[0] | ((uint32_t)dg[1] << 30);
            return 0;
        }
    }
#endif
    if (LIKELY(PyLong_Check(o))) {
        v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (UNLIKELY(overflow || v < 0 || v > TOKEN_MAX)) {
            if (v == -1 && PyErr_Occurred()) return -1;
            return bad_token(o);
        }
    }
    else {
        Py_INCREF(o); /* __index__ may drop the container's reference */
        PyObject *idx = PyNumber_Index(o);
        if (idx == NULL) {
            Py_DECREF(o);
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "token ids must be ints, got %.100s",
                             Py_TYPE(o)->tp_name);
            }
            return -1;
        }
        v = PyLong_AsLongLongAndOverflow(idx, &overflow);
        Py_DECREF(idx);
        if (overflow || v < 0 || v > TOKEN_MAX) {
            if (!(v == -1 && PyErr_Occurred())) bad_token(o);
            Py_DECREF(o);
            return -1;
        }
        Py_DECREF(o);
    }
    *out = (uint32_t)v;
    return 0;
}

/* A 1-D contiguous buffer of integers (array('q'), numpy int arrays, bytes): 1 and the tokens in
 * *out (PyMem_Malloc'ed, or buf when they fit), 0 when obj is not such a buffer, -1 on error. */
static int
convert_buffer(PyObject *obj, uint32_t *buf, Py_ssize_t bufn, uint32_t **out, Py_ssize_t *n)
{
    if (!PyObject_CheckBuffer(obj)) return 0;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view.format ? view.format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN) || (*f == '>' && !PY_LITTLE_ENDIAN))
        f++;
    int is_signed;
    if (f[0] == 0 || f[1] != 0 || view.ndim != 1 || strchr("bBhHiIlLqQnN", f[0]) == NULL) {
        PyBuffer_Release(&view);
        return 0;
    }
    is_signed = f[0] >= 'a';
    Py_ssize_t isz = view.itemsize, len = isz > 0 ? view.len / isz : 0;
    if (isz != 1 && isz != 2 && isz != 4 && isz != 8) {
        PyBuffer_Release(&view);
        return 0;
    }
    uint32_t *o = buf;
    if (len > bufn) {
        o = PyMem_Malloc((size_t)len * sizeof(uint32_t));
        if (o == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return -1;
        }
    }
    const char *p = view.buf;
    for (Py_ssize_t k = 0; k < len; k++, p += isz) {
        long long v;
        unsigned long long u = 0;
        int bad = 0;
        switch (isz) {
            case 1:
                v = is_signed ? (long long)*(const int8_t *)p : (long long)*(const uint8_t *)p;
                break;
            case 2: {
                int16_t s; uint16_t us;
                memcpy(&s, p, 2); memcpy(&us, p, 2);
                v = is_signed ? (long long)s : (long long)us;
                break;
            }
            case 4: {
                int32_t s; uint32_t us;
                memcpy(&s, p, 4); memcpy(&us, p, 4);
                v = is_signed ? (long long)s : (long long)us;
                break;
            }
            default:
                memcpy(&u, p, 8);
                if (is_signed) v = (long long)u;
                else if (u > (unsigned long long)TOKEN_MAX) { bad = 1; v = 0; }
                else v = (long long)u;
                break;
        }
        if (bad || v < 0 || v > TOKEN_MAX) {
            if (isz == 8 && !is_signed) PyErr_Format(PyExc_ValueError,
                "token ids must be in 0..2147483647, got %llu", u);
            else PyErr_Format(PyExc_ValueError, "token ids must be in 0..2147483647, got %lld", v);
            if (o != buf) PyMem_Free(o);
            PyBuffer_Release(&view);
            return -1;
        }
        o[k] = (uint32_t)v;
    }
    PyBuffer_Release(&view);
    *out = o;
    *n = len;
    return 1;
}

/* Any iterable of ints -> uint32 tokens in *out (buf when they fit, else PyMem_Malloc'ed).
 * Every id is checked before any is used. */
static int
convert(PyObject *obj, uint32_t *buf, Py_ssize_t bufn, uint32_t **out, Py_ssize_t *n)
{
    if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj)) {
        int rc = convert_buffer(obj, buf, bufn, out, n);
        if (rc != 0) return rc < 0 ? -1 : 0;
    }
    PyObject *seq = PySequence_Fast(obj, "tokens must be an iterable of ints");
    if (seq == NULL) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    uint32_t *o = buf;
    if (len > bufn) {
        o = PyMem_Malloc((size_t)len * sizeof(uint32_t));
        if (o == NULL) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
    }
    /* items may run arbitrary code (__index__) that shrinks a list: re-check its size */
    for (Py_ssize_t k = 0; k < len; k++) {
        if (k >= PySequence_Fast_GET_SIZE(seq)) {
            len = k;
            break;
        }
        if (as_token(PySequence_Fast_GET_ITEM(seq, k), &o[k]) < 0) {
            if (o != buf) PyMem_Free(o);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = o;
    *n = len;
    return 0;
}

/* -- the type ------------------------------------------------------------------------------------ */

static int
arg_ll(PyObject *o, const char *name, PyObject **keep, int64_t *out, int64_t cap)
{
    PyObject *idx = PyNumber_Index(o);
    if (idx == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name, Py_TYPE(o)->tp_name);
        }
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(idx);
        return -1;
    }
    if (overflow > 0 || v > cap) v = cap; /* beyond any output: the same as the exact value */
    if (overflow < 0) v = -cap;
    Py_XSETREF(*keep, idx);
    *out = v;
    return 0;
}

static int
Det_init(Det *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_period", "min_repeats", "min_span_tokens", "min_period", "changes",
                             "confirm_tokens", NULL};
    PyObject *mp = NULL, *mr = NULL, *ms = NULL, *mn = NULL, *ch = NULL, *cf = NULL;
    if (self->head != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LoopDetector is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOOOO:LoopDetector", kwlist, &mp, &mr, &ms, &mn, &ch,
                                     &cf))
        return -1;
    if (mp == NULL || mr == NULL || ms == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "LoopDetector() missing required keyword-only arguments: 'max_period', "
                        "'min_repeats' and 'min_span_tokens'");
        return -1;
    }
    int64_t max_period, min_repeats, min_span, min_period = 1, changes = 0, confirm = 0;
    if (arg_ll(mp, "max_period", &self->o_max_period, &max_period, NEVER) < 0
        || arg_ll(mr, "min_repeats", &self->o_min_repeats, &min_repeats, (int64_t)1 << 36) < 0
        || arg_ll(ms, "min_span_tokens", &self->o_min_span, &min_span, NEVER >> 1) < 0)
        return -1;
    if (mn != NULL) {
        if (arg_ll(mn, "min_period", &self->o_min_period, &min_period, NEVER) < 0) return -1;
    }
    else {
        Py_XSETREF(self->o_min_period, PyLong_FromLong(1));
    }
    if (ch != NULL) {
        if (arg_ll(ch, "changes", &self->o_changes, &changes, NEVER) < 0) return -1;
    }
    else {
        Py_XSETREF(self->o_changes, PyLong_FromLong(0));
    }
    if (cf != NULL) {
        if (arg_ll(cf, "confirm_tokens", &self->o_confirm, &confirm, (int64_t)1 << 60) < 0) return -1;
    }
    else {
        Py_XSETREF(self->o_confirm, PyLong_FromLong(0));
    }
    if (max_period < 1 || min_repeats < 2 || min_span < 2) {
        PyErr_SetString(PyExc_ValueError,
                        "max_period >= 1, min_repeats >= 2 and min_span_tokens >= 2 are required");
        return -1;
    }
    if (confirm < 0) {
        PyErr_SetString(PyExc_ValueError, "confirm_tokens >= 0 is required");
        return -1;
    }
    if (!(1 <= min_period && min_period <= max_period)) {
        PyErr_SetString(PyExc_ValueError, "1 <= min_period <= max_period is required");
        return -1;
    }
    if (changes != 0 && changes != 1) {
        PyErr_SetString(PyExc_ValueError,
                        "changes must be 0 (exact loops) or 1 (one changed token per repeat)");
        return -1;
    }
    if (max_period > MAX_PERIOD_LIMIT) {
        PyErr_SetString(PyExc_ValueError, "max_period <= 16777216 is required (compiled detector)");
        return -1;
    }
    self->max_period = max_period;
    self->min_period = min_period;
    self->min_repeats = min_repeats;
    self->min_span = min_span;
    self->confirm = confirm;
    self->near = (int)changes;
    int64_t w = min_repeats * max_period + confirm; /* <= 2**61 */
    self->size = (w > min_span ? w : min_span) + 1;
    self->csize = max_period + 1;
    int bits = 0;
    while (((int64_t)1 << bits) <= max_period) bits++; /* (csize - 1).bit_length() */
    self->hsize = (int64_t)1 << (bits > 4 ? bits : 4);
    self->mask = (uint32_t)(self->hsize - 1);
    self->head = PyMem_Calloc((size_t)self->hsize, sizeof(uint32_t));
    if (self->head == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->max_cands = limit_cands;
    self->max_chain = limit_chain;
    self->base = -self->csize;
    self->rebase_every = rebase_span > 4 * self->csize + 4 ? rebase_span : 4 * self->csize + 4;
    self->rebase_at = self->base + self->rebase_every;
    return 0;
}

static void
Det_dealloc(Det *self)
{
    PyMem_Free(self->ring);
    PyMem_Free(self->chain);
    PyMem_Free(self->head);
    Py_XDECREF(self->o_max_period);
    Py_XDECREF(self->o_min_period);
    Py_XDECREF(self->o_min_repeats);
    Py_XDECREF(self->o_min_span);
    Py_XDECREF(self->o_changes);
    Py_XDECREF(self->o_confirm);
    Py_XDECREF(self->hit);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
check_ready(Det *self)
{
    if (self->head == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LoopDetector.__init__ was not called");
        return -1;
    }
    return 0;
}

static PyObject *
Det_extend(Det *self, PyObject *tokens)
{
    if (check_ready(self) < 0) return NULL;
    if (self->fired) Py_RETURN_NONE;
    uint32_t stack[STACK_TOKENS], *toks;
    Py_ssize_t n;
    if (convert(tokens, stack, STACK_TOKENS, &toks, &n) < 0) return NULL;
    int rc = feed(self, toks, n);
    if (toks != stack) PyMem_Free(toks);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    return get_hit(self);
}

static PyObject *
Det_push(Det *self, PyObject *token)
{
    if (check_ready(self) < 0) return NULL;
    if (self->fired) Py_RETURN_NONE;
    uint32_t t;
    if (as_token(token, &t) < 0) return NULL;
    int rc = feed(self, &t, 1);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    return get_hit(self);
}

static PyObject *
Det_state_slots(Det *self, PyObject *Py_UNUSED(ignored))
{
    int64_t c = self->ncands;
    return PyLong_FromLongLong(self->ring_cap + self->chain_cap + self->hsize + 2 * (c + (self->near ? c : 0)));
}

static PyObject *
Det_sizeof(Det *self, PyObject *Py_UNUSED(ignored))
{
    int64_t bytes = (int64_t)Py_TYPE(self)->tp_basicsize
                    + 4 * (self->ring_cap + self->chain_cap + (self->head ? self->hsize : 0));
    return PyLong_FromLongLong(bytes);
}

/* debug views, the same contents as the Python detector's private fields */

static PyObject *
pos_obj(Det *self, uint32_t v)
{
    return PyLong_FromLongLong(v == 0 ? FAR : self->base + (int64_t)v);
}

static PyObject *
Det_get_ring(Det *self, void *Py_UNUSED(c))
{
    int64_t len = self->n < self->size ? self->n : self->size;
    PyObject *l = PyList_New(len);
    if (l == NULL) return NULL;
    for (int64_t k = 0; k < len; k++) {
        PyObject *x = PyLong_FromUnsignedLong(self->ring[k]);
        if (x == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, k, x);
    }
    return l;
}

static PyObject *
Det_get_chain(Det *self, void *Py_UNUSED(c))
{
    int64_t len = self->n < self->csize ? self->n : self->csize;
    PyObject *l = PyList_New(len);
    if (l == NULL) return NULL;
    for (int64_t k = 0; k < len; k++) {
        PyObject *x = pos_obj(self, self->chain[k]);
        if (x == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, k, x);
    }
    return l;
}

static PyObject *
Det_get_head(Det *self, void *Py_UNUSED(c))
{
    if (check_ready(self) < 0) return NULL;
    PyObject *l = PyList_New(self->hsize);
    if (l == NULL) return NULL;
    for (int64_t k = 0; k < self->hsize; k++) {
        PyObject *x = pos_obj(self, self->head[k]);
        if (x == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, k, x);
    }
    return l;
}

static PyObject *
cand_dict(Det *self, int mism)
{
    PyObject *dct = PyDict_New();
    if (dct == NULL) return NULL;
    if (mism && !self->near) return dct;
    for (int c = 0; c < self->ncands; c++) {
        PyObject *k = PyLong_FromLongLong(self->cands[c].p);
        PyObject *v = PyLong_FromLongLong(mism ? self->cands[c].mism : self->cands[c].run);
        if (k == NULL || v == NULL || PyDict_SetItem(dct, k, v) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(dct);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return dct;
}

static PyObject *
Det_get_cands(Det *self, void *Py_UNUSED(c))
{
    return cand_dict(self, 0);
}

static PyObject *
Det_get_mism(Det *self, void *Py_UNUSED(c))
{
    return cand_dict(self, 1);
}

static PyObject *
Det_get_hit(Det *self, void *Py_UNUSED(c))
{
    return get_hit(self);
}

static PyObject *
Det_get_n(Det *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->n);
}

static PyObject *
Det_get_prev(Det *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLong(self->prev);
}

static PyObject *
Det_get_size(Det *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->size);
}

static PyObject *
Det_get_csize(Det *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->csize);
}

static PyObject *
Det_get_mask(Det *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLong(self->mask);
}

#define SETTING(field)                                                \
    static PyObject *Det_get_##field(Det *self, void *Py_UNUSED(c))   \
    {                                                                 \
        if (check_ready(self) < 0) return NULL;                       \
        Py_INCREF(self->o_##field);                                   \
        return self->o_##field;                                       \
    }
SETTING(max_period)
SETTING(min_period)
SETTING(min_repeats)
SETTING(min_span)
SETTING(changes)
SETTING(confirm)

static PyGetSetDef Det_getset[] = {
    {"max_period", (getter)Det_get_max_period, NULL, "longest period looked for", NULL},
    {"min_period", (getter)Det_get_min_period, NULL, "shortest period that can fire", NULL},
    {"min_repeats", (getter)Det_get_min_repeats, NULL, "repeats needed at the tail", NULL},
    {"min_span_tokens", (getter)Det_get_min_span, NULL, "and the periodic tail at least this long", NULL},
    {"changes", (getter)Det_get_changes, NULL, "0: exact loops, 1: near-loops", NULL},
    {"confirm_tokens", (getter)Det_get_confirm, NULL, "and min_repeats * p + this many tokens", NULL},
    {"n", (getter)Det_get_n, NULL, "tokens seen", NULL},
    {"hit", (getter)Det_get_hit, NULL, "the LoopHit of the first loop, or None", NULL},
    {"_ring", (getter)Det_get_ring, NULL, "debug view: the ring as the Python detector's list", NULL},
    {"_chain", (getter)Det_get_chain, NULL, "debug view: the chain as the Python detector's list", NULL},
    {"_head", (getter)Det_get_head, NULL, "debug view: the hash heads as the Python detector's list", NULL},
    {"_cands", (getter)Det_get_cands, NULL, "debug view: candidate period -> run", NULL},
    {"_mism", (getter)Det_get_mism, NULL, "debug view: near-loops, candidate -> last mismatch", NULL},
    {"_prev", (getter)Det_get_prev, NULL, "debug view: the last token", NULL},
    {"_size", (getter)Det_get_size, NULL, "debug view: ring window", NULL},
    {"_csize", (getter)Det_get_csize, NULL, "debug view: chain length", NULL},
    {"_mask", (getter)Det_get_mask, NULL, "debug view: hash mask", NULL},
    {NULL},
};

static PyMethodDef Det_methods[] = {
    {"push", (PyCFunction)Det_push, METH_O,
     "push(token) -> LoopHit | None: add one token; the hit on the token where a loop is first found."},
    {"extend", (PyCFunction)Det_extend, METH_O,
     "extend(tokens) -> LoopHit | None: add tokens in order (a list, tuple, 1-D int buffer or any "
     "iterable); the hit on the token where a loop is first found, else None. Every id is checked "
     "(0..2**31-1) before any is added. Once a loop is found later calls add nothing and return None."},
    {"state_slots", (PyCFunction)Det_state_slots, METH_NOARGS,
     "state_slots() -> int: 4-byte slots of the ring, chain and hash table as allocated, plus 2 per live "
     "candidate (and 2 more each for near-loops), as the Python detector counts them. The candidate "
     "table itself is fixed inside the object; sys.getsizeof gives all the bytes."},
    {"__sizeof__", (PyCFunction)Det_sizeof, METH_NOARGS, "bytes held: the object and its arrays"},
    {NULL},
};

static PyTypeObject DetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ledger.rules._loopc.LoopDetector",
    .tp_basicsize = sizeof(Det),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "LoopDetector(*, max_period, min_repeats, min_span_tokens, min_period=1, changes=0, "
              "confirm_tokens=0)\n\n"
              "The compiled loop detector: the same answers as ledger.rules.loop.PyLoopDetector.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Det_init,
    .tp_dealloc = (destructor)Det_dealloc,
    .tp_methods = Det_methods,
    .tp_getset = Det_getset,
};

/* -- the paraphrase detector ---------------------------------------------------------------------- */

/* ledger.rules.paraphrase.PyParaphraseDetector compiled, statement by statement (read it first): each
 * token ends an ngram-token phrase; a phrase is recurrent when said min_seen times before, a jump when
 * its previous occurrence does not follow the previous phrase's; over the last `window` tokens the
 * recurrent phrases, the jumps and the distinct tokens ending a recurrent phrase are counted.
 *
 * Storage: phrases in an open-addressing table of uint32 slots (linear probing, doubled at half full:
 * one entry per distinct phrase of the output, as the Python dict), an entry its count (0: empty), the
 * end position of its newest occurrence (modulo 2**32, as the Python one holds positions below 2**40)
 * and its ngram ids: 24 bytes for 4-token phrases; three rings of `window` slots; the vocabulary of the
 * window in a second table of token -> count (at most `window` live tokens, deletion by backward
 * shift). */

#define PARA_MAX_NGRAM 8
#define PARA_MAX_WINDOW (1 << 20)

typedef struct {
    PyObject_HEAD
    int ready, fired;
    int ngram;
    int64_t min_seen, window, min_jumps, min_vocab;
    double ratio, need;
    int64_t n, recurrent, jumps, vocab_n;
    uint32_t last; /* where the previous phrase occurred before (its end), NONE: nowhere */
    uint32_t recent[PARA_MAX_NGRAM]; /* the last ngram ids, oldest first */
    uint32_t *phrases; /* entries of 2 + ngram slots: count, last, ids */
    int64_t pcap, pcount;
    uint8_t *rec_ring, *jump_ring;
    uint32_t *tok_ring; /* the token ending a recurrent phrase, else NONE */
    uint32_t *vkeys, *vcounts; /* vocabulary: token -> recurrent phrases it ends in the window */
    int64_t vcap;
    int64_t hit_at, hit_window, hit_recurrent, hit_jumps, hit_vocab;
    PyObject *hit;
    PyObject *o_min_seen, *o_min_jumps, *o_min_vocab; /* as given */
} Para;

static PyTypeObject ParaType;
static PyObject *ParaHitType = NULL;

static inline uint64_t
mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

static inline uint64_t
phrase_hash(const uint32_t *ids, int k)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    for (int j = 0; j < k; j++) h = mix64(h ^ ((uint64_t)ids[j] + 0x100000000ULL * (uint64_t)(j + 1)));
    return h;
}

#define NONE 0xFFFFFFFFu /* token ids are below 2**31 */

static int
phrases_grow(Para *d)
{
    const int64_t stride = 2 + d->ngram, ncap = d->pcap ? d->pcap * 2 : 64;
    const uint64_t mask = (uint64_t)(ncap - 1);
    uint32_t *np = PyMem_Calloc((size_t)(ncap * stride), sizeof(uint32_t));
    if (np == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t k = 0; k < d->pcap; k++) {
        const uint32_t *e = d->phrases + k * stride;
        if (!e[0]) continue;
        uint64_t j = phrase_hash(e + 2, d->ngram) & mask;
        while (np[j * stride]) j = (j + 1) & mask;
        memcpy(np + j * stride, e, (size_t)stride * sizeof(uint32_t));
    }
    PyMem_Free(d->phrases);
    d->phrases = np;
    d->pcap = ncap;
    return 0;
}

/* The entry of the phrase in d->recent (a new one with count 0 when it was never said), or NULL. */
static uint32_t *
phrase_find(Para *d)
{
    if (2 * (d->pcount + 1) > d->pcap && phrases_grow(d) < 0) return NULL;
    const int k = d->ngram;
    const int64_t stride = 2 + k;
    const uint64_t mask = (uint64_t)(d->pcap - 1);
    uint64_t j = phrase_hash(d->recent, k) & mask;
    for (;;) {
        uint32_t *e = d->phrases + j * stride;
        if (!e[0]) {
            memcpy(e + 2, d->recent, (size_t)k * sizeof(uint32_t));
            d->pcount++;
            return e;
        }
        if (memcmp(e + 2, d->recent, (size_t)k * sizeof(uint32_t)) == 0) return e;
        j = (j + 1) & mask;
    }
}

static inline uint64_t
vslot(uint32_t t, int64_t cap)
{
    return mix64((uint64_t)t + 1) & (uint64_t)(cap - 1);
}

static void
vocab_add(Para *d, uint32_t t)
{
    uint64_t j = vslot(t, d->vcap), mask = (uint64_t)(d->vcap - 1);
    while (d->vcounts[j] && d->vkeys[j] != t) j = (j + 1) & mask;
    if (!d->vcounts[j]) {
        d->vkeys[j] = t;
        d->vocab_n++;
    }
    d->vcounts[j]++;
}

static void
vocab_remove(Para *d, uint32_t t)
{
    uint64_t j = vslot(t, d->vcap), mask = (uint64_t)(d->vcap - 1);
    while (d->vkeys[j] != t || !d->vcounts[j]) j = (j + 1) & mask; /* it is there */
    if (--d->vcounts[j]) return;
    d->vocab_n--;
    /* backward shift: move later entries of the probe run into the hole */
    uint64_t hole = j;
    for (uint64_t k = (j + 1) & mask; d->vcounts[k]; k = (k + 1) & mask) {
        uint64_t home = vslot(d->vkeys[k], d->vcap);
        if (((k - home) & mask) >= ((k - hole) & mask)) {
            d->vkeys[hole] = d->vkeys[k];
            d->vcounts[hole] = d->vcounts[k];
            d->vcounts[k] = 0;
            hole = k;
        }
    }
}

/* Feed tokens; 1 when it fired (the rest are not added), 0, or -1 with an exception (out of memory). */
static int
para_feed(Para *d, const uint32_t *toks, Py_ssize_t count)
{
    if (d->fired) return 0;
    const int k = d->ngram;
    const int64_t w = d->window;
    for (Py_ssize_t x = 0; x < count; x++) {
        const uint32_t token = toks[x];
        const int64_t i = d->n;
        if (i < k) d->recent[i] = token;
        else {
            memmove(d->recent, d->recent + 1, (size_t)(k - 1) * sizeof(uint32_t));
            d->recent[k - 1] = token;
        }
        int rec = 0, jump = 0;
        if (i >= k - 1) {
            uint32_t *e = phrase_find(d);
            if (e == NULL) return -1;
            if (!e[0]) {
                e[0] = 1;
                e[1] = (uint32_t)i;
                d->last = NONE - 1; /* -2, as the Python one */
            }
            else {
                uint32_t prev = e[1];
                if (e[0] >= d->min_seen) {
                    rec = 1;
                    jump = prev != (uint32_t)(d->last + 1);
                }
                if (e[0] < NONE) e[0]++;
                e[1] = (uint32_t)i;
                d->last = prev;
            }
        }
        const int64_t slot = i % w;
        if (d->tok_ring[slot] != NONE) vocab_remove(d, d->tok_ring[slot]);
        if (rec) vocab_add(d, token);
        d->tok_ring[slot] = rec ? token : NONE;
        d->recurrent += rec - d->rec_ring[slot];
        d->jumps += jump - d->jump_ring[slot];
        d->rec_ring[slot] = (uint8_t)rec;
        d->jump_ring[slot] = (uint8_t)jump;
        d->n = i + 1;
        if ((double)d->recurrent >= d->need && d->jumps >= d->min_jumps && d->vocab_n >= d->min_vocab) {
            d->fired = 1;
            d->hit_at = i;
            d->hit_window = d->n < w ? d->n : w;
            d->hit_recurrent = d->recurrent;
            d->hit_jumps = d->jumps;
            d->hit_vocab = d->vocab_n;
            return 1;
        }
    }
    return 0;
}

static PyObject *
para_get_hit(Para *d)
{
    if (!d->fired) Py_RETURN_NONE;
    if (d->hit == NULL) {
        if (ParaHitType == NULL) {
            PyObject *mod = PyImport_ImportModule("ledger.rules.paraphrase");
            if (mod == NULL) return NULL;
            ParaHitType = PyObject_GetAttrString(mod, "ParaphraseHit");
            Py_DECREF(mod);
            if (ParaHitType == NULL) return NULL;
        }
        d->hit = PyObject_CallFunction(ParaHitType, "LLLLL", (long long)d->hit_at, (long long)d->hit_window,
                                       (long long)d->hit_recurrent, (long long)d->hit_jumps,
                                       (long long)d->hit_vocab);
        if (d->hit == NULL) return NULL;
    }
    Py_INCREF(d->hit);
    return d->hit;
}

static int
Para_init(Para *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ngram", "min_seen", "window", "min_recurrent_ratio", "min_jumps",
                             "min_vocabulary", NULL};
    PyObject *ng = NULL, *ms = NULL, *wn = NULL, *mj = NULL, *mv = NULL;
    double ratio = 0.8;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "ParaphraseDetector is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOdOO:ParaphraseDetector", kwlist, &ng, &ms, &wn,
                                     &ratio, &mj, &mv))
        return -1;
    int64_t ngram = 4, min_seen = 3, window = 256, min_jumps = 24, min_vocab = 64;
    PyObject *keep_ng = NULL, *keep_wn = NULL;
    if ((ng && arg_ll(ng, "ngram", &keep_ng, &ngram, NEVER) < 0)
        || (ms && arg_ll(ms, "min_seen", &self->o_min_seen, &min_seen, NEVER) < 0)
        || (wn && arg_ll(wn, "window", &keep_wn, &window, NEVER) < 0)
        || (mj && arg_ll(mj, "min_jumps", &self->o_min_jumps, &min_jumps, NEVER) < 0)
        || (mv && arg_ll(mv, "min_vocabulary", &self->o_min_vocab, &min_vocab, NEVER) < 0)) {
        Py_XDECREF(keep_ng);
        Py_XDECREF(keep_wn);
        return -1;
    }
    Py_XDECREF(keep_ng);
    Py_XDECREF(keep_wn);
    if (!ms) Py_XSETREF(self->o_min_seen, PyLong_FromLongLong(min_seen));
    if (!mj) Py_XSETREF(self->o_min_jumps, PyLong_FromLongLong(min_jumps));
    if (!mv) Py_XSETREF(self->o_min_vocab, PyLong_FromLongLong(min_vocab));
    if (ngram < 1 || min_seen < 1 || window < 1) {
        PyErr_SetString(PyExc_ValueError, "ngram, min_seen and window must be at least 1");
        return -1;
    }
    if (ngram > PARA_MAX_NGRAM || window > PARA_MAX_WINDOW) {
        PyErr_SetString(PyExc_ValueError, "ngram <= 8 and window <= 1048576 are required (compiled detector)");
        return -1;
    }
    self->ngram = (int)ngram;
    self->min_seen = min_seen;
    self->window = window;
    self->min_jumps = min_jumps;
    self->min_vocab = min_vocab;
    self->ratio = ratio;
    self->need = ratio * (double)window;
    self->last = NONE - 1;
    int64_t vcap = 16;
    while (vcap < 2 * window) vcap *= 2;
    self->vcap = vcap;
    self->rec_ring = PyMem_Calloc((size_t)window, 1);
    self->jump_ring = PyMem_Calloc((size_t)window, 1);
    self->tok_ring = PyMem_Malloc((size_t)window * sizeof(uint32_t));
    self->vkeys = PyMem_Calloc((size_t)vcap, sizeof(uint32_t));
    self->vcounts = PyMem_Calloc((size_t)vcap, sizeof(uint32_t));
    if (!self->rec_ring || !self->jump_ring || !self->tok_ring || !self->vkeys || !self->vcounts) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t k = 0; k < window; k++) self->tok_ring[k] = NONE;
    self->ready = 1;
    return 0;
}

static void
Para_dealloc(Para *self)
{
    PyMem_Free(self->phrases);
    PyMem_Free(self->rec_ring);
    PyMem_Free(self->jump_ring);
    PyMem_Free(self->tok_ring);
    PyMem_Free(self->vkeys);
    PyMem_Free(self->vcounts);
    Py_XDECREF(self->hit);
    Py_XDECREF(self->o_min_seen);
    Py_XDECREF(self->o_min_jumps);
    Py_XDECREF(self->o_min_vocab);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
para_ready(Para *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "ParaphraseDetector.__init__ was not called");
        return -1;
    }
    return 0;
}

static PyObject *
Para_extend(Para *self, PyObject *tokens)
{
    if (para_ready(self) < 0) return NULL;
    if (self->fired) Py_RETURN_NONE;
    uint32_t stack[STACK_TOKENS], *toks;
    Py_ssize_t n;
    if (convert(tokens, stack, STACK_TOKENS, &toks, &n) < 0) return NULL;
    int rc = para_feed(self, toks, n);
    if (toks != stack) PyMem_Free(toks);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    return para_get_hit(self);
}

static PyObject *
Para_sizeof(Para *self, PyObject *Py_UNUSED(ignored))
{
    int64_t bytes = (int64_t)Py_TYPE(self)->tp_basicsize + self->pcap * (2 + self->ngram) * 4
                    + self->window * (2 + 4) + self->vcap * 8;
    return PyLong_FromLongLong(bytes);
}

static PyObject *
Para_get_hit(Para *self, void *Py_UNUSED(c))
{
    if (para_ready(self) < 0) return NULL;
    return para_get_hit(self);
}

static PyObject *
Para_get_n(Para *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->n);
}

static PyObject *
Para_get_ngram(Para *self, void *Py_UNUSED(c))
{
    return PyLong_FromLong(self->ngram);
}

static PyObject *
Para_get_window(Para *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->window);
}

static PyObject *
Para_get_ratio(Para *self, void *Py_UNUSED(c))
{
    return PyFloat_FromDouble(self->ratio);
}

#define PARA_SETTING(field)                                            \
    static PyObject *Para_get_##field(Para *self, void *Py_UNUSED(c))  \
    {                                                                  \
        if (para_ready(self) < 0) return NULL;                         \
        Py_INCREF(self->o_##field);                                    \
        return self->o_##field;                                        \
    }
PARA_SETTING(min_seen)
PARA_SETTING(min_jumps)
PARA_SETTING(min_vocab)

static PyGetSetDef Para_getset[] = {
    {"ngram", (getter)Para_get_ngram, NULL, "tokens per phrase", NULL},
    {"min_seen", (getter)Para_get_min_seen, NULL, "a phrase said this many times before recurs", NULL},
    {"window", (getter)Para_get_window, NULL, "recent tokens looked at", NULL},
    {"min_recurrent_ratio", (getter)Para_get_ratio, NULL, "share of the window that recurs", NULL},
    {"min_jumps", (getter)Para_get_min_jumps, NULL, "recurring phrases copied from elsewhere", NULL},
    {"min_vocabulary", (getter)Para_get_min_vocab, NULL, "distinct tokens ending a recurring phrase", NULL},
    {"n", (getter)Para_get_n, NULL, "tokens seen", NULL},
    {"hit", (getter)Para_get_hit, NULL, "the ParaphraseHit of the first firing, or None", NULL},
    {NULL},
};

static PyMethodDef Para_methods[] = {
    {"extend", (PyCFunction)Para_extend, METH_O,
     "extend(tokens) -> ParaphraseHit | None: add tokens in order; the hit on the token where it first "
     "fires, else None. Every id is checked (0..2**31-1) before any is added; once it fired later calls "
     "add nothing and return None."},
    {"__sizeof__", (PyCFunction)Para_sizeof, METH_NOARGS, "bytes held: the object and its arrays"},
    {NULL},
};

static PyTypeObject ParaType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ledger.rules._loopc.ParaphraseDetector",
    .tp_basicsize = sizeof(Para),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ParaphraseDetector(*, ngram=4, min_seen=3, window=256, min_recurrent_ratio=0.8, "
              "min_jumps=24, min_vocabulary=64)\n\n"
              "The compiled paraphrase-loop detector: the same answers as "
              "ledger.rules.paraphrase.PyParaphraseDetector.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Para_init,
    .tp_dealloc = (destructor)Para_dealloc,
    .tp_methods = Para_methods,
    .tp_getset = Para_getset,
};

/* -- module functions ---------------------------------------------------------------------------- */

static PyObject *
extend_many(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "extend_many(detectors, counts, tokens) takes 3 arguments");
        return NULL;
    }
    PyObject *dets = args[0], *counts = args[1], *tokens = args[2];
    if (!PyList_Check(dets) && !PyTuple_Check(dets)) {
        PyErr_Format(PyExc_TypeError, "detectors must be a list, got %.100s", Py_TYPE(dets)->tp_name);
        return NULL;
    }
    if (!PyList_Check(counts) && !PyTuple_Check(counts)) {
        PyErr_Format(PyExc_TypeError, "counts must be a list, got %.100s", Py_TYPE(counts)->tp_name);
        return NULL;
    }
    /* The result list and the tokens first: making a list may run a garbage collection and converting
     * the tokens Python code (__index__, an iterator), either of which may change the lists. From here
     * on nothing runs Python code: the borrowed items of the lists stay valid. */
    PyObject *result = PyList_New(0);
    if (result == NULL) return NULL;
    uint32_t stack[STACK_TOKENS], *toks;
    Py_ssize_t ntok;
    if (convert(tokens, stack, STACK_TOKENS, &toks, &ntok) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(dets);
    PyObject **ditems = PySequence_Fast_ITEMS(dets), **citems = PySequence_Fast_ITEMS(counts);
    Py_ssize_t cstack[STACK_TOKENS], *cnt = cstack;
    if (PySequence_Fast_GET_SIZE(counts) != nd) {
        PyErr_Format(PyExc_ValueError, "%zd detectors but %zd counts", nd, PySequence_Fast_GET_SIZE(counts));
        goto end;
    }
    if (nd > STACK_TOKENS) {
        cnt = PyMem_Malloc((size_t)nd * sizeof(Py_ssize_t));
        if (cnt == NULL) {
            PyErr_NoMemory();
            goto end;
        }
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t k = 0; k < nd; k++) {
        PyObject *d = ditems[k], *c = citems[k];
        if (k + 64 < nd) PREFETCH(ditems[k + 64]); /* the type check's line */
        if (Py_TYPE(d) == &ParaType) {
            if (para_ready((Para *)d) < 0) goto end;
        }
        else if (Py_TYPE(d) != &DetType) {
            PyErr_Format(PyExc_TypeError,
                         "detectors[%zd] is a %.100s, not a compiled LoopDetector or ParaphraseDetector", k,
                         Py_TYPE(d)->tp_name);
            goto end;
        }
        else if (check_ready((Det *)d) < 0) goto end;
        if (!PyLong_Check(c)) {
            PyErr_Format(PyExc_TypeError, "counts[%zd] must be an int, got %.100s", k, Py_TYPE(c)->tp_name);
            goto end;
        }
        Py_ssize_t v = PyLong_AsSsize_t(c);
        if (v == -1 && PyErr_Occurred()) goto end;
        if (v < 0) {
            PyErr_Format(PyExc_ValueError, "counts[%zd] is negative (%zd)", k, v);
            goto end;
        }
        cnt[k] = v;
        if (v > PY_SSIZE_T_MAX - total) {
            PyErr_Format(PyExc_ValueError, "counts sum to more than the %zd tokens", ntok);
            goto end;
        }
        total += v;
    }
    if (total != ntok) {
        PyErr_Format(PyExc_ValueError, "counts sum to %zd but there are %zd tokens", total, ntok);
        goto end;
    }
    /* Thousands of detectors do not fit in the caches: prefetch detector k + 2*AHEAD's object and
     * detector k + AHEAD's ring, chain and hash slots while detector k is fed. */
    enum { AHEAD = 8 };
    Py_ssize_t off = 0, off_b = 0, off_c = 0;
    for (Py_ssize_t k = 0; k < nd && k < AHEAD; k++) off_b += cnt[k];
    for (Py_ssize_t k = 0; k < nd && k < AHEAD / 2; k++) off_c += cnt[k];
    for (Py_ssize_t k = 0; k < nd; k++) {
        if (k + 2 * AHEAD < nd) {
            const char *o = (const char *)ditems[k + 2 * AHEAD];
            PREFETCH(o);
            PREFETCH(o + 64);
            PREFETCH(o + 128);
        }
        if (k + AHEAD < nd) {
            const Det *e = (const Det *)ditems[k + AHEAD];
            Py_ssize_t c = cnt[k + AHEAD];
            if (c && Py_TYPE(e) == &DetType && !e->fired) {
                PREFETCH_W(e->ring + e->r);
                PREFETCH_W(e->chain + e->ci);
                uint32_t pv = e->prev;
                const uint32_t *t = toks + off_b;
                for (Py_ssize_t j = 0; j < c && j < 8; j++) {
                    PREFETCH_W(e->head + ((((uint64_t)pv * MULT) ^ t[j]) & e->mask));
                    pv = t[j];
                }
                for (int j = 0; j < e->ncands; j += 2) PREFETCH(&e->cands[j]);
            }
            off_b += c;
        }
        if (k + AHEAD / 2 < nd) {
            /* the hash slot of its first token is in cache by now: prefetch where its chain walk reads */
            const Det *e = (const Det *)ditems[k + AHEAD / 2];
            if (cnt[k + AHEAD / 2] && Py_TYPE(e) == &DetType && !e->fired) {
                int64_t v = e->head[(((uint64_t)e->prev * MULT) ^ toks[off_c]) & e->mask];
                int64_t dist = e->n - e->base - v;
                if (v && dist <= e->max_period) {
                    PREFETCH(e->ring + wrap(e->r - dist, e->size));
                    PREFETCH(e->chain + wrap(e->ci - dist, e->csize));
                }
            }
            off_c += cnt[k + AHEAD / 2];
        }
        PyObject *dk = ditems[k];
        Py_ssize_t c = cnt[k];
        int para = Py_TYPE(dk) == &ParaType;
        if (c && !(para ? ((Para *)dk)->fired : ((Det *)dk)->fired)) {
            int rc = para ? para_feed((Para *)dk, toks + off, c) : feed((Det *)dk, toks + off, c);
            if (rc < 0) {
                Py_CLEAR(result);
                goto end;
            }
            if (rc) {
                PyObject *ix = PyLong_FromSsize_t(k);
                if (ix == NULL || PyList_Append(result, ix) < 0) {
                    Py_XDECREF(ix);
                    Py_CLEAR(result);
                    goto end;
                }
                Py_DECREF(ix);
            }
        }
        off += c;
    }
end:
    if (cnt != cstack) PyMem_Free(cnt);
    if (toks != stack) PyMem_Free(toks);
    if (PyErr_Occurred()) Py_CLEAR(result); /* every goto end before the feeding is an error */
    return result;
}

static PyObject *
set_rebase_span(PyObject *Py_UNUSED(mod), PyObject *arg)
{
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v < 16 || v > ((long long)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "rebase span must be in 16..2**31");
        return NULL;
    }
    long long old = rebase_span;
    rebase_span = v;
    return PyLong_FromLongLong(old);
}

static PyObject *
set_limits(PyObject *Py_UNUSED(mod), PyObject *args)
{
    int cands, chain;
    if (!PyArg_ParseTuple(args, "ii:_set_limits", &cands, &chain)) return NULL;
    if (cands < 1 || cands > MAX_CANDIDATES || chain < 1 || chain > 1024) {
        PyErr_SetString(PyExc_ValueError, "1 <= max_candidates <= 8 and 1 <= max_chain <= 1024 are required");
        return NULL;
    }
    PyObject *old = Py_BuildValue("(ii)", limit_cands, limit_chain);
    limit_cands = cands;
    limit_chain = chain;
    return old;
}

static PyMethodDef module_methods[] = {
    {"extend_many", (PyCFunction)(void (*)(void))extend_many, METH_FASTCALL,
     "extend_many(detectors, counts, tokens) -> list[int]: feed detectors[k] (a LoopDetector or a "
     "ParaphraseDetector) the next counts[k] of the flat tokens, in order, in one call; the indices of the detectors that fired during this call (one "
     "that had fired before gets nothing). Every count and id is checked before any detector is fed."},
    {"_set_limits", (PyCFunction)set_limits, METH_VARARGS,
     "tests only: _set_limits(max_candidates, max_chain) for detectors made from now on (default 8, 2; "
     "the Python detector reads loop.MAX_CANDIDATES and loop.MAX_CHAIN); returns the previous pair"},
    {"_set_rebase_span", (PyCFunction)set_rebase_span, METH_O,
     "tests only: tokens between position rebases for detectors made from now on (default 2**31); "
     "returns the previous value"},
    {NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ledger.rules._loopc",
    .m_doc = "The compiled loop and paraphrase detectors (see ledger.rules.loop and ledger.rules.paraphrase): "
             "the same answers as the Python ones.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__loopc(void)
{
    if (PyType_Ready(&DetType) < 0) return NULL;
    if (PyType_Ready(&ParaType) < 0) return NULL;
    str_at = PyUnicode_InternFromString("at");
    str_period = PyUnicode_InternFromString("period");
    str_repeats = PyUnicode_InternFromString("repeats");
    str_span = PyUnicode_InternFromString("span");
    str_changes = PyUnicode_InternFromString("changes");
    if (!str_at || !str_period || !str_repeats || !str_span || !str_changes) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&DetType);
    if (PyModule_AddObject(m, "LoopDetector", (PyObject *)&DetType) < 0
        || PyModule_AddIntConstant(m, "MAX_CANDIDATES", MAX_CANDIDATES) < 0
        || PyModule_AddIntConstant(m, "MAX_CHAIN", MAX_CHAIN) < 0) {
        Py_DECREF(&DetType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ParaType);
    if (PyModule_AddObject(m, "ParaphraseDetector", (PyObject *)&ParaType) < 0) {
        Py_DECREF(&ParaType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
