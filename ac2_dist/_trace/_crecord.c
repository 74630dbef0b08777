/* The tracer's plain-op path and the region's pack hook in C (optional: _c_recorder in
 * ac2_dist/_trace/_tracer.py says when they are used; pyproject.toml builds them where a compiler is).
 *
 * Note [The plain-op path in C]
 *     The recording cost per op is Python bytecode: Tracer.__torch_dispatch__'s plain
 *     branch and Graph.new_node ran ~310 bytecodes per recorded op. ``Dispatch``
 *     replaces the class attribute ``Tracer.__torch_dispatch__`` by a C callable
 *     that does exactly what that branch does (Note [The plain-op path] in _tracer.py),
 *     in the same order, with the same objects: the same OpInfo table, policy frame,
 *     Graph fields, Node and MapEntry classes (their slots written at the offsets their
 *     member descriptors give), the same Graph.ref / Graph._grow_uses calls. It does
 *     not decide anything the Python branch does not: every condition the branch tests
 *     is tested here *before the op runs*, and anything else (a save, a policy
 *     function, nested frames, an observer, keyword arguments, tensor subclasses, an
 *     op not yet in the table, replays, compiling, inference mode, an unexpected type)
 *     calls the Python method with the same arguments: one code path decides, the C
 *     one only records what it would have recorded. Once the op has run there is no
 *     way back: errors (a failing Graph.ref) propagate as they would from Python.
 *
 *     It uses CPython's C API only (no torch headers): torch's objects are reached
 *     as Python objects, so the module builds with any torch and needs no rebuild
 *     when torch changes. The slots it writes are listed below (node_fields,
 *     entry_fields, handle_fields); _tracer.py compares them with the classes' slots at
 *     import and refuses a build that does not match (a field added in Python must be
 *     added here, or C-made objects would lack it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* Interned attribute names; 0 and 1. */
static PyObject *ZERO, *ONE;
static PyObject *s_depth, *s_replaying, *s_frames, *s_graph, *s_is_compiling, *s_observer, *s_entries, *s_map_cb,
    *s_seq, *s_capacity, *s_stats, *s_nodes, *s_grow_uses, *s_ref, *s_version, *s_must_recompute, *s_settled,
    *s_handle_refs;

enum { N_OP, N_SEQ, N_ARGS, N_KWARGS, N_INPUTS, N_SAVED, N_VALUES, N_NOUT, N_SCHEDULED, N_FQN,
       N_READERS, N_HELD, N_VIEWED, N_VIEWERS, N_COUNT };
static const char *node_fields[N_COUNT] = {"op", "seq", "args", "kwargs", "inputs", "saved", "values", "nout",
                                           "scheduled", "fqn", "readers", "held", "viewed", "viewers"};
enum { E_KEY, E_NODE, E_IDX, E_VERSION, E_HANDLE, E_COUNT };
static const char *entry_fields[E_COUNT] = {"key", "node", "idx", "version", "handle"};
enum { H_NODE, H_IDX, H_COUNT, H_CONSUMED, H_TAKEN, H_PREFETCHED, H_READY, H_LAST, H_FIELDS };
static const char *handle_fields[H_FIELDS] = {"node", "idx", "count", "consumed_task", "taken", "prefetched",
                                               "ready", "last"};
enum { I_PLAIN, I_GUARDED, I_CALL, I_COUNT };
static const char *info_fields[I_COUNT] = {"plain", "guarded", "call"};
enum { F_CONST, F_CONST_SAVE, F_BY_ID, F_ALLOW, F_FQN, F_COUNT };
static const char *frame_fields[F_COUNT] = {"const", "const_save", "by_id", "allow_mutation", "module_fqn"};

static PyObject *Dispatch_call(PyObject *, PyObject *const *, size_t, PyObject *);

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *slow;          /* the Python __torch_dispatch__ (a function taking self first) */
    PyObject *info;          /* dict: id(op) -> OpInfo */
    PyObject *tensor;        /* torch.Tensor */
    PyObject *compiler;      /* has _is_compiling_flag */
    PyObject *inference;     /* torch.is_inference_mode_enabled */
    PyObject *recompute;     /* the save-list default: (PREFER_RECOMPUTE, False) */
    PyObject *must_recompute;
    PyObject *nones;         /* tuple: nones[n] == (None,) * n */
    PyObject *no_kwargs;
    PyTypeObject *node_t, *entry_t, *info_t, *frame_t;
    Py_ssize_t node_off[N_COUNT], entry_off[E_COUNT], info_off[I_COUNT], frame_off[F_COUNT];
} Dispatch;

/* The referent of a weak reference, borrowed (Py_None once dead): compared by identity
 * only, never used. */
static inline PyObject *referent(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030d0000
    PyObject *o = NULL;
    if (PyWeakref_GetRef(ref, &o) < 0) PyErr_Clear();
    if (o == NULL) return Py_None;
    Py_DECREF(o); /* the caller's argument (or the map) keeps it alive for the comparison */
    return o;
#else
    return PyWeakref_GetObject(ref);
#endif
}

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* Store v (a new reference is taken) into a slot, releasing what it held. */
static inline void set_slot(PyObject *o, Py_ssize_t off, PyObject *v) {
    PyObject **p = (PyObject **)((char *)o + off);
    PyObject *old = *p;
    Py_INCREF(v);
    *p = v;
    Py_XDECREF(old);
}

static int member_offsets(PyTypeObject *t, const char **names, int n, Py_ssize_t *out) {
    for (int i = 0; i < n; i++) {
        PyObject *d = t->tp_dict ? PyDict_GetItemString(t->tp_dict, names[i]) : NULL;
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "ac2_dist._trace._crecord: %s.%s is not a slot", t->tp_name, names[i]);
            return -1;
        }
        out[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    return 0;
}

static int take_type(PyObject *o, PyTypeObject **out, const char *what) {
    if (!PyType_Check(o)) {
        PyErr_Format(PyExc_TypeError, "ac2_dist._trace._crecord: %s must be a class", what);
        return -1;
    }
    Py_INCREF(o);
    *out = (PyTypeObject *)o;
    return 0;
}

static PyObject *Dispatch_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"slow", "info", "tensor", "compiler", "inference", "recompute", "must_recompute",
                            "nones", "no_kwargs", "node", "entry", "opinfo", "frame", NULL};
    PyObject *slow, *info, *tensor, *compiler, *inference, *recompute, *must, *nones, *no_kwargs, *node, *entry,
        *opinfo, *frame;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!OOOO!OO!OOOOO:Dispatch", names, &slow, &PyDict_Type, &info,
                                     &tensor, &compiler, &inference, &PyTuple_Type, &recompute, &must,
                                     &PyTuple_Type, &nones, &no_kwargs, &node, &entry, &opinfo, &frame))
        return NULL;
    if (PyTuple_GET_SIZE(recompute) != 2) {
        PyErr_SetString(PyExc_ValueError, "ac2_dist._trace._crecord: recompute must be a (decision, save) pair");
        return NULL;
    }
    Dispatch *d = (Dispatch *)type->tp_alloc(type, 0);
    if (d == NULL) return NULL;
    d->vectorcall = NULL;
    Py_INCREF(slow); d->slow = slow;
    Py_INCREF(info); d->info = info;
    Py_INCREF(tensor); d->tensor = tensor;
    Py_INCREF(compiler); d->compiler = compiler;
    Py_INCREF(inference); d->inference = inference;
    Py_INCREF(recompute); d->recompute = recompute;
    Py_INCREF(must); d->must_recompute = must;
    Py_INCREF(nones); d->nones = nones;
    Py_INCREF(no_kwargs); d->no_kwargs = no_kwargs;
    if (take_type(node, &d->node_t, "node") < 0 || take_type(entry, &d->entry_t, "entry") < 0 ||
        take_type(opinfo, &d->info_t, "opinfo") < 0 || take_type(frame, &d->frame_t, "frame") < 0 ||
        member_offsets(d->node_t, node_fields, N_COUNT, d->node_off) < 0 ||
        member_offsets(d->entry_t, entry_fields, E_COUNT, d->entry_off) < 0 ||
        member_offsets(d->info_t, info_fields, I_COUNT, d->info_off) < 0 ||
        member_offsets(d->frame_t, frame_fields, F_COUNT, d->frame_off) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    d->vectorcall = Dispatch_call;
    return (PyObject *)d;
}

static int Dispatch_traverse(Dispatch *d, visitproc visit, void *arg) {
    Py_VISIT(d->slow); Py_VISIT(d->info); Py_VISIT(d->tensor); Py_VISIT(d->compiler); Py_VISIT(d->inference);
    Py_VISIT(d->recompute); Py_VISIT(d->must_recompute); Py_VISIT(d->nones); Py_VISIT(d->no_kwargs);
    Py_VISIT(d->node_t); Py_VISIT(d->entry_t); Py_VISIT(d->info_t); Py_VISIT(d->frame_t);
    return 0;
}

static int Dispatch_clear(Dispatch *d) {
    Py_CLEAR(d->slow); Py_CLEAR(d->info); Py_CLEAR(d->tensor); Py_CLEAR(d->compiler); Py_CLEAR(d->inference);
    Py_CLEAR(d->recompute); Py_CLEAR(d->must_recompute); Py_CLEAR(d->nones); Py_CLEAR(d->no_kwargs);
    Py_CLEAR(d->node_t); Py_CLEAR(d->entry_t); Py_CLEAR(d->info_t); Py_CLEAR(d->frame_t);
    return 0;
}

static void Dispatch_dealloc(Dispatch *d) {
    PyObject_GC_UnTrack(d);
    Dispatch_clear(d);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

/* Bound like a function: tracer.__torch_dispatch__ is a method. */
static PyObject *Dispatch_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

/* Truth of getattr(o, name); -1 with an exception set on error. */
static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* ``graph.stats.nodes += 1`` and the next ``nout`` (= 1) use counters: Graph.new_node's
 * bookkeeping. Returns the node's seq (a new reference) or NULL. */
static PyObject *take_seq(PyObject *graph) {
    PyObject *seq = PyObject_GetAttr(graph, s_seq);
    if (seq == NULL) return NULL;
    PyObject *end = PyNumber_Add(seq, ONE);
    PyObject *cap = end ? PyObject_GetAttr(graph, s_capacity) : NULL;
    if (cap == NULL || PyObject_SetAttr(graph, s_seq, end) < 0) goto fail;
    int grow = PyObject_RichCompareBool(end, cap, Py_GT);
    if (grow < 0) goto fail;
    if (grow) {
        PyObject *r = PyObject_CallMethodOneArg(graph, s_grow_uses, end);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    }
    PyObject *stats = PyObject_GetAttr(graph, s_stats);
    if (stats == NULL) goto fail;
    PyObject *nodes = PyObject_GetAttr(stats, s_nodes);
    PyObject *more = nodes ? PyNumber_Add(nodes, ONE) : NULL;
    int bad = more == NULL || PyObject_SetAttr(stats, s_nodes, more) < 0;
    Py_XDECREF(nodes);
    Py_XDECREF(more);
    Py_DECREF(stats);
    if (bad) goto fail;
    Py_DECREF(end);
    Py_DECREF(cap);
    return seq;
fail:
    Py_DECREF(seq);
    Py_XDECREF(end);
    Py_XDECREF(cap);
    return NULL;
}

/* Note [Plain records are not tracked by the collector]
 *     A recorded op keeps objects alive until backward: its Node and the Node's flat
 *     ``inputs`` tuple (Note [Node inputs are one flat tuple] in _nodes.py), and for
 *     every second op of a tanh/mul chain a Handle with the weak reference the graph
 *     lists it by. Left to the cyclic collector, each of those is tracked, survives two
 *     young collections into the oldest generation, and after about a quarter of the
 *     process's long-lived objects (~75k in a process that imports torch) forces a full
 *     collection, a scan of the whole heap: a 64k-op forward paid one (~150 ms, 2.4 us
 *     per op against 18 us of recording), and a training loop pays them all the time.
 *     So the nodes and input tuples made here, and the weak references Pack makes, are
 *     taken off the collector's lists when they are made. Reference counting alone frees
 *     them, as it frees autograd's own (C++) nodes:
 *     - a callback-less weak reference refers to nothing the collector could follow:
 *       untracking it loses nothing;
 *     - a node made here refers to its op (a torch global), scalars, the shared empty
 *       kwargs, and through ``inputs`` to older nodes; fields set later (saved values,
 *       recomputed values, rare fields) refer to tensors. Nothing in ac2 refers from
 *       those back to a node: a graph is freed by reference counting alone (tests:
 *       test_graph_freed_by_refcount_alone and the other refcount tests), so no cycle
 *       ac2 makes runs through an untracked object.
 *     The one case the collector would still be needed for is a cycle through user
 *     objects: a tensor the region saved (a parameter, an input) that reaches an object
 *     holding the region or its graph, while the graph reaches untracked nodes. During
 *     forward the thread's region state holds the graph (nothing is garbage); after it,
 *     a graph reaches nodes only through its random ops' chains, and region exit tracks
 *     every node reachable from there again (Note [A graph holds only tracked nodes] in
 *     _tracer.py; test_a_cycle_through_user_objects_is_still_collected). The Python
 *     recorder (AC2_DIST_PURE_PYTHON=1) tracks everything.
 */

/* Graph.new_node(op, 1, fqn, inputs, args, fresh=out), for a plain op (Note [The
 * plain-op path] in _tracer.py): a Node with every slot set and out's MapEntry
 * (version 0), stored in entries. Returns the node (a new reference) or NULL. */
static PyObject *record(Dispatch *d, PyObject *graph, PyObject *entries, PyObject *func, PyObject *fqn,
                        PyObject *inputs, PyObject *argtuple, PyObject *out) {
    PyObject *seq = take_seq(graph);
    if (seq == NULL) return NULL;
    PyObject *node = d->node_t->tp_alloc(d->node_t, 0);
    if (node == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    const Py_ssize_t *o = d->node_off;
    PyObject *zero = ZERO, *one = ONE;
    set_slot(node, o[N_OP], func);
    set_slot(node, o[N_SEQ], seq);
    Py_DECREF(seq);
    set_slot(node, o[N_ARGS], argtuple);
    set_slot(node, o[N_KWARGS], d->no_kwargs);
    set_slot(node, o[N_INPUTS], inputs);
    set_slot(node, o[N_SAVED], Py_None);
    set_slot(node, o[N_VALUES], Py_None);
    set_slot(node, o[N_NOUT], one);
    set_slot(node, o[N_SCHEDULED], Py_False);
    set_slot(node, o[N_FQN], fqn);
    set_slot(node, o[N_READERS], zero);
    set_slot(node, o[N_HELD], zero);
    set_slot(node, o[N_VIEWED], Py_False);
    set_slot(node, o[N_VIEWERS], zero);

    PyObject *cb = PyObject_GetAttr(graph, s_map_cb);
    if (cb == NULL) goto fail;
    PyObject *e = PyObject_CallFunctionObjArgs((PyObject *)d->entry_t, out, cb, NULL);
    Py_DECREF(cb);
    if (e == NULL) goto fail;
    if (Py_TYPE(e) != d->entry_t) {
        Py_DECREF(e);
        PyErr_SetString(PyExc_TypeError, "ac2_dist._trace._crecord: the map entry class made another type");
        goto fail;
    }
    PyObject *key = PyLong_FromVoidPtr(out);
    if (key == NULL) {
        Py_DECREF(e);
        goto fail;
    }
    const Py_ssize_t *q = d->entry_off;
    set_slot(e, q[E_KEY], key);
    set_slot(e, q[E_NODE], node);
    set_slot(e, q[E_IDX], zero);
    set_slot(e, q[E_VERSION], zero);
    set_slot(e, q[E_HANDLE], Py_None);
    int r = PyDict_SetItem(entries, key, e);
    Py_DECREF(key);
    Py_DECREF(e);
    if (r < 0) goto fail;
    /* Note [Plain records are not tracked by the collector] */
    PyObject_GC_UnTrack(node);
    if (PyTuple_GET_SIZE(inputs) > 0) PyObject_GC_UnTrack(inputs);
    return node;
fail:
    Py_DECREF(node);
    return NULL;
}

static int incr_slot(PyObject *o, Py_ssize_t off);

/* The argument walk of the plain-op path: for each positional tensor argument its
 * (position, producer node, output index), flat, into ``inputs`` (a new tuple), each
 * producer's ``readers`` counted; ``*scalars`` set when a non-tensor argument other than
 * None was passed. Returns 0, or -1 with an exception set. */
static int walk(Dispatch *d, PyObject *graph, PyObject *entries, PyObject *args, PyObject *allow, PyObject **inputs,
                int *scalars) {
    Py_ssize_t nargs = PyTuple_GET_SIZE(args), ntensors = 0;
    PyObject *stack[3 * 8];
    PyObject **flat = stack;
    if (nargs > 8 && (flat = PyMem_Malloc(sizeof(PyObject *) * 3 * nargs)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        int is_t = PyObject_IsInstance(a, d->tensor);
        if (is_t < 0) goto error;
        if (!is_t) {
            if (a != Py_None) *scalars = 1;
            continue;
        }
        PyObject *m = NULL, *j = NULL;
        PyObject *akey = PyLong_FromVoidPtr(a);
        if (akey == NULL) goto error;
        PyObject *e = PyDict_GetItemWithError(entries, akey);
        Py_DECREF(akey);
        if (e == NULL && PyErr_Occurred()) goto error;
        if (e != NULL && Py_TYPE(e) == d->entry_t && referent(e) == a) {
            Py_INCREF(e);
            PyObject *v = SLOT(e, d->entry_off[E_VERSION]);
            int current = v == Py_None;
            if (!current && v != NULL) {
                PyObject *av = PyObject_GetAttr(a, s_version);
                current = av == NULL ? -1 : PyObject_RichCompareBool(v, av, Py_EQ);
                Py_XDECREF(av);
            }
            if (current > 0) {
                m = SLOT(e, d->entry_off[E_NODE]);
                j = SLOT(e, d->entry_off[E_IDX]);
                Py_XINCREF(m);
                Py_XINCREF(j);
                if (m == NULL || j == NULL) {
                    Py_XDECREF(m);
                    Py_XDECREF(j);
                    PyErr_SetString(PyExc_AttributeError, "ac2_dist._trace._crecord: a tensor map entry without its node");
                    current = -1;
                }
            }
            Py_DECREF(e);
            if (current < 0) goto error;
        }
        if (m == NULL) { /* m, j = graph.ref(a, inner.allow_mutation) */
            PyObject *res = PyObject_CallMethodObjArgs(graph, s_ref, a, allow, NULL);
            if (res == NULL) goto error;
            if (!PyTuple_CheckExact(res) || PyTuple_GET_SIZE(res) != 2) {
                Py_DECREF(res);
                PyErr_SetString(PyExc_TypeError, "ac2_dist._trace._crecord: Graph.ref must return (node, index)");
                goto error;
            }
            m = PyTuple_GET_ITEM(res, 0);
            j = PyTuple_GET_ITEM(res, 1);
            Py_INCREF(m);
            Py_INCREF(j);
            Py_DECREF(res);
        }
        PyObject *pos = Py_TYPE(m) == d->node_t ? PyLong_FromSsize_t(i) : NULL;
        if (pos == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ac2_dist._trace._crecord: a producer that is not a Node");
            Py_DECREF(m);
            Py_DECREF(j);
            goto error;
        }
        flat[3 * ntensors] = pos;
        flat[3 * ntensors + 1] = m;
        flat[3 * ntensors + 2] = j;
        ntensors++;
        if (incr_slot(m, d->node_off[N_READERS]) < 0) goto error; /* m.readers += 1 */
    }
    if ((*inputs = PyTuple_New(3 * ntensors)) == NULL) goto error;
    for (Py_ssize_t k = 0; k < 3 * ntensors; k++) PyTuple_SET_ITEM(*inputs, k, flat[k]); /* steals */
    if (flat != stack) PyMem_Free(flat);
    return 0;
error:
    for (Py_ssize_t k = 0; k < 3 * ntensors; k++) Py_DECREF(flat[k]);
    if (flat != stack) PyMem_Free(flat);
    return -1;
}

/* The recorded args: tensors replaced by None (their positions are the walk's, every
 * third item of ``inputs``); the shared tuple of Nones of that length when no argument
 * is a scalar. A new reference, or NULL. */
static PyObject *recorded_args(Dispatch *d, PyObject *args, PyObject *inputs, int scalars) {
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (!scalars && nargs < PyTuple_GET_SIZE(d->nones)) {
        PyObject *t = PyTuple_GET_ITEM(d->nones, nargs);
        Py_INCREF(t);
        return t;
    }
    PyObject *t = PyTuple_New(nargs);
    if (t == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        Py_INCREF(a);
        PyTuple_SET_ITEM(t, i, a);
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(inputs); k += 3) {
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(inputs, k));
        if (pos < 0 || pos >= nargs) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "ac2_dist._trace._crecord: a bad input position");
            Py_DECREF(t);
            return NULL;
        }
        PyObject *old = PyTuple_GET_ITEM(t, pos);
        Py_INCREF(Py_None);
        PyTuple_SET_ITEM(t, pos, Py_None);
        Py_DECREF(old);
    }
    return t;
}

static PyObject *Dispatch_call(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Dispatch *d = (Dispatch *)self;
    /* Every reference owned here; released at the end whichever way it goes. */
    PyObject *key = NULL, *replaying = NULL, *info = NULL, *frames = NULL, *inner = NULL, *decision = NULL,
             *graph = NULL, *observer = NULL, *entries = NULL, *fn = NULL, *allow = NULL, *fqn = NULL,
             *out = NULL, *inputs = NULL, *argtuple = NULL, *node = NULL, *result = NULL;
    int r = 0, scalars = 0;
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != 5) goto slow;
    PyObject *tracer = argv[0], *func = argv[1], *types = argv[2], *args = argv[3], *kwargs = argv[4];
    if (!PyTuple_CheckExact(args) || !PyTuple_CheckExact(types) || PyTuple_GET_SIZE(types) != 0) goto slow;
    if (kwargs != Py_None && !(PyDict_CheckExact(kwargs) && PyDict_GET_SIZE(kwargs) == 0)) goto slow;

    /* if self.replaying.depth or _COMPILER._is_compiling_flag or inference mode: Python */
    if ((replaying = PyObject_GetAttr(tracer, s_replaying)) == NULL) goto done;
    if ((r = attr_true(replaying, s_depth)) != 0) goto slow_or_error;
    if ((r = attr_true(d->compiler, s_is_compiling)) != 0) goto slow_or_error;
    PyObject *inf = PyObject_CallNoArgs(d->inference);
    if (inf == NULL) goto done;
    r = PyObject_IsTrue(inf);
    Py_DECREF(inf);
    if (r != 0) goto slow_or_error;

    /* info = _INFO.get(id(func)): a plain op (an op not in the table yet: Python) */
    if ((key = PyLong_FromVoidPtr(func)) == NULL) goto done;
    info = PyDict_GetItemWithError(d->info, key);
    if (info == NULL) goto slow_or_error_set;
    Py_INCREF(info);
    if (Py_TYPE(info) != d->info_t || SLOT(info, d->info_off[I_PLAIN]) != Py_True) goto slow;
    /* one policy frame, whose answer needs no output and says recompute */
    if ((frames = PyObject_GetAttr(tracer, s_frames)) == NULL) goto done;
    if (!PyList_CheckExact(frames) || PyList_GET_SIZE(frames) != 1) goto slow;
    inner = PyList_GET_ITEM(frames, 0);
    Py_INCREF(inner);
    if (Py_TYPE(inner) != d->frame_t) goto slow;
    PyObject *save;
    decision = SLOT(inner, d->frame_off[F_CONST]);
    if (decision == NULL) goto slow;
    if (decision != Py_None) {
        save = SLOT(inner, d->frame_off[F_CONST_SAVE]);
    } else {
        PyObject *by_id = SLOT(inner, d->frame_off[F_BY_ID]);
        if (by_id == NULL || !PyDict_CheckExact(by_id)) goto slow; /* None: a policy function */
        PyObject *pair = PyDict_GetItemWithError(by_id, key);
        if (pair == NULL && PyErr_Occurred()) goto done;
        if (pair == NULL) pair = d->recompute;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) goto slow;
        decision = PyTuple_GET_ITEM(pair, 0);
        save = PyTuple_GET_ITEM(pair, 1);
    }
    Py_INCREF(decision);
    if (save == NULL) goto slow;
    if ((r = PyObject_IsTrue(save)) != 0) goto slow_or_error;
    if ((graph = PyObject_GetAttr(tracer, s_graph)) == NULL) goto done;
    if ((observer = PyObject_GetAttr(graph, s_observer)) == NULL) goto done;
    if (observer != Py_None) goto slow;
    if ((entries = PyObject_GetAttr(graph, s_entries)) == NULL) goto done;
    if (!PyDict_CheckExact(entries)) goto slow;
    allow = SLOT(inner, d->frame_off[F_ALLOW]);
    fqn = SLOT(inner, d->frame_off[F_FQN]);
    fn = SLOT(info, d->info_off[I_CALL]);
    if (allow == NULL || fqn == NULL || fn == NULL) {
        allow = fqn = fn = NULL;
        goto slow;
    }
    Py_INCREF(allow);
    Py_INCREF(fqn);
    Py_INCREF(fn);
    if (SLOT(info, d->info_off[I_GUARDED]) == Py_True) {
        /* a Python dispatcher sits between OpOverload.__call__ and the C++ op */
        PyObject *op = PyObject_GetAttrString(func, "_op");
        if (op == NULL) goto done;
        Py_DECREF(op);
        if (op != fn) {
            Py_DECREF(fn);
            fn = func;
            Py_INCREF(fn);
        }
    }

    /* The op runs: from here on no way back to Python, errors propagate. */
    out = PyObject_Vectorcall(fn, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), NULL);
    if (out == NULL) goto done;
    if (walk(d, graph, entries, args, allow, &inputs, &scalars) < 0) goto done;
    if ((argtuple = recorded_args(d, args, inputs, scalars)) == NULL) goto done;
    if ((node = record(d, graph, entries, func, fqn, inputs, argtuple, out)) == NULL) goto done;
    if (decision == d->must_recompute && PyObject_SetAttr(node, s_must_recompute, Py_True) < 0) goto done;
    result = out;
    out = NULL;
    goto done;

slow_or_error_set:
    if (PyErr_Occurred()) goto done;
    goto slow;
slow_or_error:
    if (r < 0) goto done;
slow:
    result = PyObject_Vectorcall(d->slow, argv, nargsf, kwnames);
done:
    Py_XDECREF(key);
    Py_XDECREF(replaying);
    Py_XDECREF(info);
    Py_XDECREF(frames);
    Py_XDECREF(inner);
    Py_XDECREF(decision);
    Py_XDECREF(graph);
    Py_XDECREF(observer);
    Py_XDECREF(entries);
    Py_XDECREF(fn);
    Py_XDECREF(allow);
    Py_XDECREF(fqn);
    Py_XDECREF(out);
    Py_XDECREF(inputs);
    Py_XDECREF(argtuple);
    Py_XDECREF(node);
    return result;
}

static PyMemberDef Dispatch_members[] = {
    {"python", T_OBJECT, offsetof(Dispatch, slow), READONLY, "The Python method this one records for."},
    {NULL},
};

static PyTypeObject DispatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ac2_dist._trace._crecord.Dispatch",
    .tp_basicsize = sizeof(Dispatch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "Tracer.__torch_dispatch__ with its plain-op path in C (Note [The plain-op path in C]).",
    .tp_new = Dispatch_new,
    .tp_traverse = (traverseproc)Dispatch_traverse,
    .tp_clear = (inquiry)Dispatch_clear,
    .tp_dealloc = (destructor)Dispatch_dealloc,
    .tp_descr_get = Dispatch_get,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Dispatch, vectorcall),
    .tp_members = Dispatch_members,
};

/* ---- Graph.pack ------------------------------------------------------------------ */

/* Note [The pack hook in C]
 *     Autograd calls the region's pack hook for every saved variable (1.5 per op of a
 *     tanh/mul chain). ``Pack(graph)`` is that hook for Graph.pack's two common cases
 *     in forward, before backward has settled the graph (Note [Packing before backward
 *     takes no lock]): the tensor is the current value of a node output in the map, and
 *     either its handle can be shared (Note [One handle per saved value]: held and
 *     count go up) or a new handle is made, listed (Note [Handles are weakly listed])
 *     and remembered in the entry. Anything else (no entry, a stale one, a consumed or
 *     prefetched handle, a settled graph) calls Graph.pack itself.
 */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *graph;
    PyObject *slow; /* graph.pack */
    PyTypeObject *handle_t, *entry_t, *node_t;
    Py_ssize_t h_off[H_FIELDS], e_off[E_COUNT], held_off;
} Pack;

static PyObject *Pack_call(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);

static PyObject *Pack_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"graph", "handle", "entry", "node", NULL};
    PyObject *graph, *handle, *entry, *node;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO:Pack", names, &graph, &handle, &entry, &node)) return NULL;
    PyObject *slow = PyObject_GetAttrString(graph, "pack");
    if (slow == NULL) return NULL;
    Pack *p = (Pack *)type->tp_alloc(type, 0);
    if (p == NULL) {
        Py_DECREF(slow);
        return NULL;
    }
    Py_INCREF(graph);
    p->graph = graph;
    p->slow = slow;
    static const char *held[1] = {"held"};
    Py_ssize_t held_off[1];
    if (take_type(handle, &p->handle_t, "handle") < 0 || take_type(entry, &p->entry_t, "entry") < 0 ||
        take_type(node, &p->node_t, "node") < 0 ||
        member_offsets(p->handle_t, handle_fields, H_FIELDS, p->h_off) < 0 ||
        member_offsets(p->entry_t, entry_fields, E_COUNT, p->e_off) < 0 ||
        member_offsets(p->node_t, held, 1, held_off) < 0) {
        Py_DECREF(p);
        return NULL;
    }
    p->held_off = held_off[0];
    p->vectorcall = Pack_call;
    return (PyObject *)p;
}

static int Pack_traverse(Pack *p, visitproc visit, void *arg) {
    Py_VISIT(p->graph); Py_VISIT(p->slow); Py_VISIT(p->handle_t); Py_VISIT(p->entry_t); Py_VISIT(p->node_t);
    return 0;
}

static int Pack_clear(Pack *p) {
    Py_CLEAR(p->graph); Py_CLEAR(p->slow); Py_CLEAR(p->handle_t); Py_CLEAR(p->entry_t); Py_CLEAR(p->node_t);
    return 0;
}

static void Pack_dealloc(Pack *p) {
    PyObject_GC_UnTrack(p);
    Pack_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* slot += 1 on an int slot; -1 with an exception if it is unset or not a number. */
static int incr_slot(PyObject *o, Py_ssize_t off) {
    PyObject *v = SLOT(o, off);
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "ac2_dist._trace._crecord: a counter slot is unset");
        return -1;
    }
    PyObject *w = PyNumber_Add(v, ONE);
    if (w == NULL) return -1;
    set_slot(o, off, w);
    Py_DECREF(w);
    return 0;
}

static PyObject *Pack_call(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Pack *p = (Pack *)self;
    const Py_ssize_t *q = p->e_off, *o = p->h_off;
    PyObject *entries = NULL, *key = NULL, *e = NULL, *node = NULL, *refs = NULL, *h = NULL, *result = NULL;
    int r = 0;
    if (kwnames != NULL || PyVectorcall_NARGS(nargsf) != 1) goto slow;
    PyObject *t = argv[0];
    if ((r = attr_true(p->graph, s_settled)) != 0) goto slow_or_error;
    if ((entries = PyObject_GetAttr(p->graph, s_entries)) == NULL) goto done;
    if (!PyDict_CheckExact(entries)) goto slow;
    if ((key = PyLong_FromVoidPtr(t)) == NULL) goto done;
    e = PyDict_GetItemWithError(entries, key);
    if (e == NULL) goto slow_or_error_set;
    Py_INCREF(e);
    if (Py_TYPE(e) != p->entry_t || referent(e) != t) goto slow;
    /* the entry is current: its version is the tensor's (or it has none) */
    PyObject *v = SLOT(e, q[E_VERSION]);
    if (v == NULL) goto slow;
    if (v != Py_None) {
        PyObject *tv = PyObject_GetAttr(t, s_version);
        if (tv == NULL) goto done;
        r = PyObject_RichCompareBool(v, tv, Py_EQ);
        Py_DECREF(tv);
        if (r != 1) goto slow_or_error;
    }
    node = SLOT(e, q[E_NODE]);
    PyObject *idx = SLOT(e, q[E_IDX]), *old = SLOT(e, q[E_HANDLE]);
    if (node == NULL || idx == NULL || old == NULL || Py_TYPE(node) != p->node_t) {
        node = NULL;
        goto slow;
    }
    Py_INCREF(node);
    if (old != Py_None) {
        if (Py_TYPE(old) != p->handle_t) goto slow;
        if (SLOT(old, o[H_CONSUMED]) == Py_None && SLOT(old, o[H_PREFETCHED]) == Py_None) {
            /* saved again: the same handle (Note [One handle per saved value]) */
            Py_INCREF(old);
            if (incr_slot(node, p->held_off) < 0 || incr_slot(old, o[H_COUNT]) < 0) {
                Py_DECREF(old);
                goto done;
            }
            result = old;
            goto done;
        }
    }
    if ((refs = PyObject_GetAttr(p->graph, s_handle_refs)) == NULL) goto done;
    if (!PyList_CheckExact(refs)) goto slow;
    if (incr_slot(node, p->held_off) < 0) goto done;
    if ((h = p->handle_t->tp_alloc(p->handle_t, 0)) == NULL) goto done;
    set_slot(h, o[H_NODE], node);
    set_slot(h, o[H_IDX], idx);
    set_slot(h, o[H_COUNT], ONE);
    set_slot(h, o[H_CONSUMED], Py_None);
    set_slot(h, o[H_PREFETCHED], Py_None);
    set_slot(h, o[H_READY], Py_None);
    set_slot(h, o[H_LAST], Py_None);
    set_slot(h, o[H_TAKEN], ZERO);
    set_slot(e, q[E_HANDLE], h);
    PyObject *wr = PyWeakref_NewRef(h, NULL);
    if (wr != NULL) PyObject_GC_UnTrack(wr); /* Note [Plain records are not tracked by the collector] */
    r = wr == NULL ? -1 : PyList_Append(refs, wr);
    Py_XDECREF(wr);
    if (r < 0) goto done;
    result = h;
    h = NULL;
    goto done;

slow_or_error_set:
    if (PyErr_Occurred()) goto done;
    goto slow;
slow_or_error:
    if (r < 0) goto done;
slow:
    result = PyObject_Vectorcall(p->slow, argv, nargsf, kwnames);
done:
    Py_XDECREF(entries);
    Py_XDECREF(key);
    Py_XDECREF(e);
    Py_XDECREF(node);
    Py_XDECREF(refs);
    Py_XDECREF(h);
    return result;
}

static PyMemberDef Pack_members[] = {
    {"__self__", T_OBJECT, offsetof(Pack, graph), READONLY, "The graph whose pack hook this is (as a bound Graph.pack)."},
    {NULL},
};

static PyTypeObject PackType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ac2_dist._trace._crecord.Pack",
    .tp_basicsize = sizeof(Pack),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A graph's saved-tensor pack hook, its forward cases in C (Note [The pack hook in C]).",
    .tp_new = Pack_new,
    .tp_traverse = (traverseproc)Pack_traverse,
    .tp_clear = (inquiry)Pack_clear,
    .tp_dealloc = (destructor)Pack_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Pack, vectorcall),
    .tp_members = Pack_members,
};

/* track_from(roots, node_type) (Note [A graph holds only tracked nodes] in _tracer.py):
 * every object reachable from ``roots`` through nodes (exactly node_type), tuples and dicts
 * -- a node's inputs tuple, its rare-field dict and what they hold -- goes back on the
 * collector's lists. Referents are found with each object's tp_traverse, as
 * gc.get_referents does. An untracked object is visited once (the visit tracks it); a
 * tracked one (a node recorded in Python, whose ancestors may be untracked) once too, by a
 * set of addresses. No Python code runs during the walk. */
typedef struct {
    PyObject **items; /* owned references */
    Py_ssize_t size, capacity;
    PyTypeObject *node_t;
} TrackWalk;

static int track_push(TrackWalk *w, PyObject *o) {
    if (w->size == w->capacity) {
        Py_ssize_t cap = w->capacity ? 2 * w->capacity : 256;
        PyObject **items = PyMem_Realloc(w->items, sizeof(PyObject *) * cap);
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        w->items = items;
        w->capacity = cap;
    }
    Py_INCREF(o);
    w->items[w->size++] = o;
    return 0;
}

static int track_visit(PyObject *o, void *arg) {
    TrackWalk *w = (TrackWalk *)arg;
    if (Py_TYPE(o) == w->node_t || PyTuple_CheckExact(o) || PyDict_CheckExact(o)) return track_push(w, o);
    return 0;
}

static PyObject *track_from(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *roots, *seen = NULL, *result = NULL, *list = NULL;
    PyTypeObject *node_t;
    if (!PyArg_ParseTuple(args, "OO!:track_from", &roots, &PyType_Type, &node_t)) return NULL;
    TrackWalk w = {NULL, 0, 0, node_t};
    if ((list = PySequence_List(roots)) == NULL || (seen = PySet_New(NULL)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (track_visit(PyList_GET_ITEM(list, i), &w) < 0) goto done;
    while (w.size > 0) {
        PyObject *o = w.items[--w.size]; /* owned */
        int r = 0;                         /* 0: visit it, 1: seen already, -1: error */
        if (!PyObject_GC_IsTracked(o)) {
            PyObject_GC_Track(o);
        } else {
            PyObject *key = PyLong_FromVoidPtr(o);
            r = key == NULL ? -1 : PySet_Contains(seen, key);
            if (r == 0) r = PySet_Add(seen, key);
            Py_XDECREF(key);
        }
        traverseproc traverse = Py_TYPE(o)->tp_traverse;
        if (r == 0 && traverse != NULL && traverse(o, track_visit, &w) < 0) r = -1;
        Py_DECREF(o);
        if (r < 0) goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    while (w.size > 0) Py_DECREF(w.items[--w.size]);
    PyMem_Free(w.items);
    Py_XDECREF(list);
    Py_XDECREF(seen);
    return result;
}

static PyMethodDef module_methods[] = {
    {"track_from", track_from, METH_VARARGS,
     "track_from(roots, node_type): put every node reachable from roots (and its tuples and dicts) back on the "
     "cyclic collector's lists."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ac2_dist._trace._crecord",
    "The tracer's plain-op path in C (Note [The plain-op path in C]).", -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crecord(void) {
#define INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(s_depth, "depth");
    INTERN(s_replaying, "replaying");
    if ((ZERO = PyLong_FromLong(0)) == NULL || (ONE = PyLong_FromLong(1)) == NULL) return NULL;
    INTERN(s_frames, "frames");
    INTERN(s_graph, "graph");
    INTERN(s_is_compiling, "_is_compiling_flag");
    INTERN(s_observer, "observer");
    INTERN(s_entries, "_entries");
    INTERN(s_map_cb, "_map_cb");
    INTERN(s_seq, "seq");
    INTERN(s_capacity, "capacity");
    INTERN(s_stats, "stats");
    INTERN(s_nodes, "nodes");
    INTERN(s_grow_uses, "_grow_uses");
    INTERN(s_ref, "ref");
    INTERN(s_version, "_version");
    INTERN(s_must_recompute, "must_recompute");
    INTERN(s_settled, "settled");
    INTERN(s_handle_refs, "_handle_refs");
#undef INTERN
    if (PyType_Ready(&DispatchType) < 0 || PyType_Ready(&PackType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&DispatchType);
    if (PyModule_AddObject(m, "Dispatch", (PyObject *)&DispatchType) < 0) {
        Py_DECREF(&DispatchType);
        Py_DECREF(m);
        return NULL;
    }
    /* The slots the C code writes: _tracer.py checks them against the classes. */
    const char **fields[3] = {node_fields, entry_fields, handle_fields};
    const int counts[3] = {N_COUNT, E_COUNT, H_FIELDS};
    const char *names[3] = {"NODE_FIELDS", "ENTRY_FIELDS", "HANDLE_FIELDS"};
    for (int k = 0; k < 3; k++) {
        PyObject *t = PyTuple_New(counts[k]);
        if (t == NULL) return NULL;
        for (int i = 0; i < counts[k]; i++) {
            PyObject *u = PyUnicode_FromString(fields[k][i]);
            if (u == NULL) {
                Py_DECREF(t);
                return NULL;
            }
            PyTuple_SET_ITEM(t, i, u);
        }
        if (PyModule_AddObject(m, names[k], t) < 0) {
            Py_DECREF(t);
            return NULL;
        }
    }
    Py_INCREF(&PackType);
    if (PyModule_AddObject(m, "Pack", (PyObject *)&PackType) < 0) {
        Py_DECREF(&PackType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
