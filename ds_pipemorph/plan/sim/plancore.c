/* Compiled core of the planner: line-by-line ports of listsched.list_schedule_py and simulate._run_py,
plus the link-tolerance search of tolerance.py.

Shipped as package data and built on first use by plan/sim/native.py with the system C compiler (no
Python headers: called through ctypes); the library is cached under a name hashed from this file
and the compiler, and carries that hash (pm_build_key), so a library built from other source is
never used. Without a compiler the planner runs its pure-Python code, which stays the reference
these functions are tested against (tests/plan/test_native.py). Same IEEE double operations in the
same order as the Python code (-ffp-contract=off: no fused multiply-adds), so the same schedules and
bit-identical times.

Codes: an op is kind * N + m with kind 0 = F, 1 = B, 2 = W.
*/
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#ifndef PM_BUILD_KEY
#define PM_BUILD_KEY ""
#endif

/* The key plan/sim/native.py built this library for (hash of this source, flags and compiler). */
const char *pm_build_key(void) { return PM_BUILD_KEY; }

/* ---------------------------------------------------------------- list scheduler */

typedef struct {
    double *t;
    int *m;
    int head, tail; /* entries [head, tail), sorted by m; at most N ever enter one queue */
} Queue;

static void q_insert(Queue *q, double t, int m) {
    /* listsched._insert: append when m is past the last micro-batch, else insort by m (after
       equal keys, as bisect.insort does). */
    if (q->tail == q->head || q->m[q->tail - 1] < m) {
        q->t[q->tail] = t;
        q->m[q->tail] = m;
        q->tail++;
        return;
    }
    int pos = q->tail;
    while (pos > q->head && q->m[pos - 1] > m) pos--;
    memmove(q->t + pos + 1, q->t + pos, (size_t)(q->tail - pos) * sizeof(double));
    memmove(q->m + pos + 1, q->m + pos, (size_t)(q->tail - pos) * sizeof(int));
    q->t[pos] = t;
    q->m[pos] = m;
    q->tail++;
}

typedef struct {
    double t;
    int s;
} Event;

typedef struct {
    Event *v;
    long n;
} Heap;

static int ev_less(Event a, Event b) { return a.t < b.t || (a.t == b.t && a.s < b.s); }

static void h_push(Heap *h, double t, int s) {
    Event x = {t, s};
    long i = h->n++;
    while (i > 0) {
        long p = (i - 1) / 2;
        if (!ev_less(x, h->v[p])) break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = x;
}

static Event h_pop(Heap *h) {
    Event top = h->v[0];
    Event x = h->v[--h->n];
    long n = h->n, i = 0;
    for (;;) {
        long c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && ev_less(h->v[c + 1], h->v[c])) c++;
        if (!ev_less(h->v[c], x)) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (n > 0) h->v[i] = x;
    return top;
}

/* listsched.list_schedule_py: event-driven per stage (see there why it is the reference's schedule).
   Returns 0, 1 if stalled (t in *stall_t), -1 if out of memory. out: S rows of 3N codes. */
int pm_list_schedule(int S, int N, const double *f, const double *b, const double *w, const double *links,
                     const int *warmup, const int *pri, int npri, int w_fits_gap, const unsigned char *late_w,
                     const double *units, double w_share, int *out, double *stall_t) {
    const double eps = 1e-12;
    long total = 3L * N;
    long remaining = total * S;
    int ok = -1;
    size_t nn = (size_t)(N > 0 ? N : 1);
    double *times = malloc(sizeof(double) * 3 * (size_t)S);
    Queue *qs = calloc((size_t)3 * S, sizeof(Queue));
    double *qt = malloc(sizeof(double) * 3 * (size_t)S * nn);
    int *qm = malloc(sizeof(int) * 3 * (size_t)S * nn);
    double *fr = malloc(sizeof(double) * (size_t)S);
    int *inflight = calloc((size_t)S, sizeof(int));
    int *pend_w = calloc((size_t)S, sizeof(int)); /* B done, W not yet */
    int *f_done = calloc((size_t)S, sizeof(int));
    long *started = calloc((size_t)S, sizeof(long));
    unsigned char *mark = calloc((size_t)S, 1); /* in nxt */
    int *nxt = malloc(sizeof(int) * ((size_t)S + 1)); /* stages to visit at the next sweep */
    int *order = malloc(sizeof(int) * ((size_t)S + 2)); /* this sweep's stages, ascending */
    Heap h;
    h.v = malloc(sizeof(Event) * (size_t)(2 * total * S + 2));
    h.n = 0;
    if (!times || !qs || !qt || !qm || !fr || !inflight || !pend_w || !f_done || !started || !mark || !nxt || !order || !h.v)
        goto done;
    for (int s = 0; s < S; s++) {
        times[3 * s] = f[s];
        times[3 * s + 1] = b[s];
        times[3 * s + 2] = w[s];
        fr[s] = 0.0;
        for (int k = 0; k < 3; k++) {
            Queue *q = &qs[3 * s + k];
            q->t = qt + (size_t)(3 * s + k) * nn;
            q->m = qm + (size_t)(3 * s + k) * nn;
            q->head = q->tail = 0;
        }
    }
    if (S > 0)
        for (int m = 0; m < N; m++) q_insert(&qs[0], 0.0, m);
    int nn_next = 0;
    for (int s = 0; s < S; s++) {
        nxt[nn_next++] = s;
        mark[s] = 1;
    }
#define ADD_NEXT(r)                  \
    do {                             \
        if (!mark[r]) {              \
            mark[r] = 1;             \
            nxt[nn_next++] = (r);    \
        }                            \
    } while (0)
    double t = 0.0;
    for (;;) {
        int progressed = 0;
        double now = t + eps;
        while (h.n && h.v[0].t <= now) {
            Event e = h_pop(&h);
            ADD_NEXT(e.s);
        }
        /* order = sorted nxt; then nxt is emptied */
        int no = nn_next;
        for (int i = 0; i < no; i++) {
            int x = nxt[i], j = i;
            while (j > 0 && order[j - 1] > x) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = x;
            mark[x] = 0;
        }
        nn_next = 0;
        for (int i = 0; i < no;) {
            int s = order[i++];
            if (started[s] >= total || fr[s] > now) continue;
            Queue *fa = &qs[3 * s], *ba = &qs[3 * s + 1], *wa = &qs[3 * s + 2];
            int ready_f = fa->tail > fa->head && fa->t[fa->head] <= now;
            int choice = -1;
            if (f_done[s] < warmup[s]) {
                if (ready_f) choice = 0;
            } else {
                int can_b = ba->tail > ba->head && ba->t[ba->head] <= now;
                int can_f = ready_f && inflight[s] < warmup[s];
                int mem_full = 0;
                if (units) { /* listsched_py: room for the F or the B, or a W first (memory.EPS) */
                    double held = inflight[s] + w_share * pend_w[s];
                    if (can_f && held + 1 > units[s] + 1e-6) { can_f = 0; mem_full = 1; }
                    if (can_b && pend_w[s] && held - 1 + w_share > units[s] + 1e-6) { can_b = 0; mem_full = 1; }
                }
                int can_w = wa->tail > wa->head && wa->t[wa->head] <= now && (mem_full || !(late_w[s] && f_done[s] < N));
                for (int p = 0; p < npri; p++) {
                    int k = pri[p];
                    if (k == 1) {
                        if (can_b) { choice = 1; break; }
                    } else if (k == 0) {
                        if (can_f) { choice = 0; break; }
                    } else if (can_w) {
                        int blocks = 0;
                        if (w_fits_gap && !mem_full) { /* listsched._w_blocks_q */
                            double end = t + times[3 * s + 2];
                            double nx = 1.0 / 0.0;
                            if (ba->tail > ba->head && ba->t[ba->head] < nx) nx = ba->t[ba->head];
                            if (fa->tail > fa->head && inflight[s] < warmup[s] && fa->t[fa->head] < nx)
                                nx = fa->t[fa->head];
                            blocks = nx < end - 1e-12;
                        }
                        if (!blocks) { choice = 2; break; }
                    }
                }
                if (choice < 0 && can_w) choice = 2;
            }
            if (choice < 0) continue;
            Queue *q = &qs[3 * s + choice];
            int m = q->m[q->head++];
            double end = t + times[3 * s + choice];
            fr[s] = end;
            out[(size_t)s * total + started[s]] = choice * N + m;
            started[s]++;
            remaining--;
            if (end <= now) ADD_NEXT(s); else h_push(&h, end, s);
            progressed = 1;
            if (choice == 0) {
                inflight[s]++;
                f_done[s]++;
                if (s < S - 1) {
                    double r = end + links[s];
                    q_insert(&qs[3 * (s + 1)], r, m);
                    if (r <= now) {
                        ADD_NEXT(s + 1);
                        if (i >= no || order[i] != s + 1) { /* visit it in this sweep too */
                            memmove(order + i + 1, order + i, sizeof(int) * (size_t)(no - i));
                            order[i] = s + 1;
                            no++;
                        }
                    } else {
                        h_push(&h, r, s + 1);
                    }
                } else {
                    q_insert(&qs[3 * s + 1], end, m);
                }
            } else if (choice == 1) {
                inflight[s]--;
                pend_w[s]++;
                q_insert(&qs[3 * s + 2], end, m);
                if (s > 0) {
                    double r = end + links[s - 1];
                    q_insert(&qs[3 * (s - 1) + 1], r, m);
                    if (r <= now) ADD_NEXT(s - 1); else h_push(&h, r, s - 1);
                }
            } else {
                pend_w[s]--;
            }
        }
        if (!remaining) { ok = 0; break; }
        if (!h.n) {
            if (progressed) continue;
            *stall_t = t;
            ok = 1;
            break;
        }
        t = h.v[0].t;
    }
#undef ADD_NEXT
done:
    free(times); free(qs); free(qt); free(qm); free(fr); free(inflight); free(pend_w); free(f_done); free(started);
    free(mark); free(nxt); free(order); free(h.v);
    return ok;
}

/* ---------------------------------------------------------------- replay simulator */

/* model[l]: 0 latency, 1 direct (one FIFO, the sender blocks), 2 delegated with queues[l] FIFOs.
   res[0] = first start, res[1] = last end. slots (optional, may be NULL): per op run, in run order,
   its stage and position in the row, start and end. pos_start (optional): start per position,
   rows concatenated. limit < 0: none; else give up (return 2) when the last end exceeds it.
   Returns 0, 1 if stuck (ptr tells where each stage stopped), -1 if out of memory, 2 over limit. */
int pm_replay(int S, int N, const int *lens, const int *codes, const double *f, const double *b, const double *w,
              const double *links, const int *model, const int *queues, int fused, double limit,
              double *res, double *busy, int *ptr, int *slot_stage, int *slot_pos, double *slot_start,
              double *slot_end, double *pos_start) {
    const double inf = 1.0 / 0.0;
    int L = S > 1 ? S - 1 : 0;
    int ok = -1;
    long *off = malloc(sizeof(long) * ((size_t)S + 1));
    double *end = malloc(sizeof(double) * 3 * (size_t)S * (size_t)(N > 0 ? N : 1));
    double *arr_f = malloc(sizeof(double) * (size_t)S * (size_t)(N > 0 ? N : 1));
    double *arr_b = malloc(sizeof(double) * (size_t)S * (size_t)(N > 0 ? N : 1));
    double *link_free = calloc((size_t)2 * S, sizeof(double));
    int *qoff = malloc(sizeof(int) * ((size_t)L + 1));
    double *qfree[2] = {NULL, NULL};
    int *qnext[2] = {calloc((size_t)L + 1, sizeof(int)), calloc((size_t)L + 1, sizeof(int))};
    int *hold_m = malloc(sizeof(int) * (size_t)S);
    double *hold_d = malloc(sizeof(double) * (size_t)S);
    double *fr = calloc((size_t)S, sizeof(double));
    int *queue = malloc(sizeof(int) * ((size_t)S + 1));
    unsigned char *queued = malloc((size_t)S + 1);
    if (!off || !end || !arr_f || !arr_b || !link_free || !qoff || !qnext[0] || !qnext[1] || !hold_m || !hold_d ||
        !fr || !queue || !queued)
        goto done;
    off[0] = 0;
    for (int s = 0; s < S; s++) off[s + 1] = off[s] + lens[s];
    qoff[0] = 0;
    for (int l = 0; l < L; l++) qoff[l + 1] = qoff[l] + (model[l] == 2 && queues[l] > 1 ? queues[l] : 1);
    for (int d = 0; d < 2; d++) {
        qfree[d] = calloc((size_t)qoff[L] + 1, sizeof(double));
        if (!qfree[d]) goto done;
    }
    for (size_t i = 0; i < 3 * (size_t)S * (size_t)N; i++) end[i] = inf;
    for (size_t i = 0; i < (size_t)S * (size_t)N; i++) arr_f[i] = arr_b[i] = inf;
    for (int s = 0; s < S; s++) {
        hold_m[s] = -1;
        busy[s] = 0.0;
        ptr[s] = 0;
        queue[s] = s;
        queued[s] = 1;
    }
    double first = inf, last_end = 0.0;
    int qh = 0, qn = S; /* ring buffer of stages, at most S queued at once */
    long nslots = 0;
    int last = S - 1;
    while (qn) {
        int s = queue[qh];
        qh = (qh + 1) % (S + 1);
        qn--;
        queued[s] = 0;
        const int *row = codes + off[s];
        int len = lens[s];
        double *es = end + (size_t)3 * s * N;
        int progressed = 0;
        while (ptr[s] < len) {
            int code = row[ptr[s]];
            int k = code / N, m = code % N;
            double ready, r;
            if (k == 0) {
                if (s > 0) {
                    ready = arr_f[(size_t)(s - 1) * N + m];
                    if (ready == inf) break;
                } else {
                    ready = 0.0;
                }
            } else if (k == 1) {
                ready = es[m];
                if (ready == inf) break;
                if (s < last) {
                    r = arr_b[(size_t)(s + 1) * N + m];
                    if (r == inf) break;
                    if (r > ready) ready = r;
                }
            } else {
                ready = es[(size_t)N + m];
                if (ready == inf) break;
            }
            double start = fr[s] > ready ? fr[s] : ready;
            double dur = k == 0 ? f[s] : k == 1 ? b[s] : w[s];
            double fin = start + dur;
            es[(size_t)k * N + m] = fin;
            double blocked_until = fin;
            int d = -1;
            double t_send = 0.0, c = 0.0, *target = NULL;
            int is_hold = 0;
            if (k == 0 && s < last) {
                d = 0; t_send = fin; c = links[s]; target = &arr_f[(size_t)s * N + m];
            } else if (k == 1 && s > 0) {
                int nxt = ptr[s] + 1;
                d = 1;
                c = links[s - 1];
                target = &arr_b[(size_t)s * N + m];
                if (fused && nxt < len && row[nxt] == 2 * N + m) {
                    t_send = fin + w[s];
                    is_hold = 1;
                } else {
                    t_send = fin;
                }
            }
            if (d >= 0) { /* simulate._run.send */
                int link = s - d;
                double arrival, depart;
                if (c > 0 && model[link] == 1) {
                    double lf = link_free[2 * s + d];
                    depart = t_send > lf ? t_send : lf;
                    link_free[2 * s + d] = depart + c;
                    arrival = depart + c;
                } else if (c > 0 && model[link] == 2 && queues[link] > 0) {
                    int n = qnext[d][link];
                    qnext[d][link] = n + 1;
                    double *lane = qfree[d] + qoff[link];
                    int i = n % queues[link];
                    depart = t_send > lane[i] ? t_send : lane[i];
                    lane[i] = depart + c;
                    arrival = depart + c;
                    depart = t_send;
                } else {
                    arrival = t_send + c;
                    depart = t_send;
                }
                *target = arrival;
                if (is_hold) {
                    hold_m[s] = m;
                    hold_d[s] = depart;
                } else {
                    blocked_until = depart;
                }
            } else if (k == 2 && hold_m[s] >= 0 && hold_m[s] == m) {
                blocked_until = fin > hold_d[s] ? fin : hold_d[s];
                hold_m[s] = -1;
            }
            fr[s] = blocked_until > fin ? blocked_until : fin;
            busy[s] += dur;
            if (start < first) first = start;
            if (fin > last_end) last_end = fin;
            if (slot_stage) {
                slot_stage[nslots] = s;
                slot_pos[nslots] = ptr[s];
                slot_start[nslots] = start;
                slot_end[nslots] = fin;
            }
            if (pos_start) pos_start[off[s] + ptr[s]] = start;
            nslots++;
            ptr[s]++;
            progressed = 1;
        }
        if (progressed) {
            for (int nb = s - 1; nb <= s + 1; nb += 2) {
                if (nb >= 0 && nb < S && !queued[nb] && ptr[nb] < lens[nb]) {
                    queued[nb] = 1;
                    queue[(qh + qn) % (S + 1)] = nb;
                    qn++;
                }
            }
        }
    }
    res[0] = first == inf ? 0.0 : first;
    res[1] = last_end;
    ok = 0;
    for (int s = 0; s < S; s++)
        if (ptr[s] < lens[s]) ok = 1;
    if (ok == 0 && limit >= 0 && last_end - res[0] > limit) ok = 2;
done:
    free(off); free(end); free(arr_f); free(arr_b); free(link_free); free(qoff);
    free(qfree[0]); free(qfree[1]); free(qnext[0]); free(qnext[1]);
    free(hold_m); free(hold_d); free(fr); free(queue); free(queued);
    return ok;
}

/* simulate.peak_inflight and simulate.warmup_counts on an encoded schedule. */
void pm_peak(int S, int N, const int *lens, const int *codes, int *peak_out, int *warm_out) {
    long o = 0;
    for (int s = 0; s < S; s++) {
        int cur = 0, peak = 0, warm = 0, seen_b = 0;
        for (int i = 0; i < lens[s]; i++) {
            int k = codes[o + i] / N;
            if (k == 0) {
                if (++cur > peak) peak = cur;
                if (!seen_b) warm++;
            } else if (k == 1) {
                cur--;
                seen_b = 1;
            }
        }
        peak_out[s] = peak;
        warm_out[s] = warm;
        o += lens[s];
    }
}

/* ---------------------------------------------------------------- link tolerance (tolerance.py) */

typedef struct {
    int s, k, m, hold; /* hold: a fused B whose W follows it (its gradient leaves after the W) */
} Step;

static long evals_done = 0;

long pm_tolerance_evals(void) { return evals_done; } /* replays run by pm_tolerance so far */

/* The replay of pure-latency links along a fixed order (the one pm_replay ran: with pure latency the
   order in which ops become runnable does not depend on the delays; same arithmetic as pm_replay),
   for LANES links at once: lane j with link li[j] at delay cl[j] (li[j] = -1: no change). One pass
   along the order serves all lanes, so each (stage, micro-batch) cell is read once. T[j] = the
   makespan, kout[j] = how often a critical path crosses link li[j] (fewest among ties). */
#define LANES 8
typedef struct { /* one (stage, micro-batch): its F and B ends per lane; arrivals are derived when read */
    double ef[LANES], eb[LANES];
    short kef[LANES], keb[LANES];
    unsigned char hold; /* the B was a fused one: its gradient left when its W ended */
} Cell;

static void eval_lanes(int S, int N, const Step *order, long n, const double *f, const double *b, const double *w,
                       const double *links, const int *li, const double *cl, Cell *cells, double *fr, int *kfr,
                       double *hold_d, double *T, int *kout) {
    const double inf = 1.0 / 0.0;
    double first[LANES], last_end[LANES];
    int klast[LANES];
    int last = S - 1;
    for (int j = 0; j < LANES; j++) {
        first[j] = inf;
        last_end[j] = 0.0;
        klast[j] = 0;
    }
    for (int s = 0; s < S; s++)
        for (int j = 0; j < LANES; j++) {
            fr[s * LANES + j] = 0.0;
            kfr[s * LANES + j] = 0;
            hold_d[s * LANES + j] = -inf;
        }
    for (long i = 0; i < n; i++) {
        const Step *o = &order[i];
        int s = o->s, m = o->m, kind = o->k;
        Cell *cs = &cells[(size_t)s * N + m];
        double *frs = fr + s * LANES, *hds = hold_d + s * LANES;
        int *kfrs = kfr + s * LANES;
        double dur = kind == 0 ? f[s] : kind == 1 ? b[s] : w[s];
        double ready[LANES];
        int kr[LANES];
        if (kind == 0) {
            if (s > 0) { /* the activation: F m's end upstream + that link's delay */
                const Cell *up = cs - N;
                double base = links[s - 1];
                for (int j = 0; j < LANES; j++) {
                    int x = s - 1 == li[j];
                    ready[j] = up->ef[j] + (x ? cl[j] : base);
                    kr[j] = up->kef[j] + x;
                }
            } else {
                for (int j = 0; j < LANES; j++) {
                    ready[j] = 0.0;
                    kr[j] = 0;
                }
            }
        } else if (kind == 1) {
            for (int j = 0; j < LANES; j++) {
                ready[j] = cs->ef[j];
                kr[j] = cs->kef[j];
            }
            if (s < last) { /* the gradient: B m's send downstream + this link's delay */
                const Cell *dn = cs + N;
                double base = links[s], wd = w[s + 1];
                for (int j = 0; j < LANES; j++) {
                    int x = s == li[j];
                    double t_send = dn->hold ? dn->eb[j] + wd : dn->eb[j];
                    double r = t_send + (x ? cl[j] : base);
                    int k2 = dn->keb[j] + x;
                    if (r > ready[j] || (r == ready[j] && k2 < kr[j])) {
                        ready[j] = r;
                        kr[j] = k2;
                    }
                }
            }
        } else {
            for (int j = 0; j < LANES; j++) {
                ready[j] = cs->eb[j];
                kr[j] = cs->keb[j];
            }
        }
        if (kind == 1) cs->hold = (unsigned char)o->hold;
        for (int j = 0; j < LANES; j++) {
            double start;
            int ks;
            if (frs[j] > ready[j]) {
                start = frs[j];
                ks = kfrs[j];
            } else {
                start = ready[j];
                ks = (frs[j] == ready[j] && kfrs[j] < kr[j]) ? kfrs[j] : kr[j];
            }
            double fin = start + dur;
            double blocked = fin;
            if (kind == 0) {
                cs->ef[j] = fin;
                cs->kef[j] = (short)ks;
            } else if (kind == 1) {
                cs->eb[j] = fin;
                cs->keb[j] = (short)ks;
                if (o->hold) hds[j] = fin + w[s];
            } else if (hds[j] > -inf) {
                if (hds[j] > blocked) blocked = hds[j];
                hds[j] = -inf;
            }
            frs[j] = blocked > fin ? blocked : fin;
            kfrs[j] = ks;
            if (start < first[j]) first[j] = start;
            if (fin > last_end[j] || (fin == last_end[j] && ks < klast[j])) {
                last_end[j] = fin;
                klast[j] = ks;
            }
        }
    }
    for (int j = 0; j < LANES; j++) {
        T[j] = last_end[j] - (first[j] == inf ? 0.0 : first[j]);
        kout[j] = klast[j];
    }
}

typedef struct {
    int S, N, nq, first, stride, ok;
    const Step *order;
    long total, evals;
    const double *f, *b, *w, *lk;
    const int *query;
    double base, res, *out;
    int *how;
} TolWork;

/* One thread of pm_tolerance: queried links first, first + stride, ... through LANES lanes. */
static void *tol_worker(void *arg) {
    TolWork *w = arg;
    const double inf = 1.0 / 0.0;
    size_t sn = (size_t)w->S * (size_t)(w->N > 0 ? w->N : 1);
    Cell *cells = malloc(sizeof(Cell) * sn);
    double *lfr = malloc(sizeof(double) * (size_t)w->S * LANES), *lhd = malloc(sizeof(double) * (size_t)w->S * LANES);
    int *lkfr = malloc(sizeof(int) * (size_t)w->S * LANES);
    w->ok = -1;
    if (!cells || !lfr || !lhd || !lkfr) goto out;
    /* Lanes take the queried links in turn; a lane whose link is done takes the next one. A link
       without delay in the profile starts from the base replay's time, which is its T(0). */
    double base = w->base, res = w->res;
    const double *lk = w->lk;
    int S = w->S, N = w->N;
    int li[LANES], k[LANES], state[LANES], qi[LANES]; /* state: 0 to eval at c=0, 1 at the far end, 2 steps, 3 idle */
    double c[LANES], t0[LANES], tol[LANES], T[LANES];
    int next = w->first, steps[LANES];
    for (int j = 0; j < LANES; j++) state[j] = 3;
    for (;;) {
        for (int j = 0; j < LANES; j++) {
            if (state[j] != 3 || next >= w->nq) continue;
            qi[j] = next;
            li[j] = w->query[next];
            w->how[next] = 0;
            next += w->stride;
            steps[j] = 0;
            if (lk[li[j]] == 0.0) {
                t0[j] = base;
                tol[j] = 1e-9 * (base > 1.0 ? base : 1.0);
                c[j] = base + (res > 1.0 ? res : 1.0);
                state[j] = 1;
            } else {
                c[j] = 0.0;
                state[j] = 0;
            }
        }
        int busy = 0;
        for (int j = 0; j < LANES; j++) {
            busy |= state[j] != 3;
            if (state[j] == 3) { li[j] = -1; c[j] = 0.0; }
        }
        if (!busy) break;
        eval_lanes(S, N, w->order, w->total, w->f, w->b, w->w, lk, li, c, cells, lfr, lkfr, lhd, T, k);
        w->evals += LANES;
        for (int j = 0; j < LANES; j++) {
            int q = qi[j];
            if (state[j] == 3) continue;
            if (state[j] == 0) {
                t0[j] = T[j];
                tol[j] = 1e-9 * (t0[j] > 1.0 ? t0[j] : 1.0);
                c[j] = t0[j] + (res > 1.0 ? res : 1.0);
                state[j] = 1;
                continue;
            }
            double g = T[j] - c[j] - t0[j];
            if (g <= tol[j]) {
                w->out[q] = state[j] == 1 ? inf : c[j];
                state[j] = 3;
                continue;
            }
            state[j] = 2;
            double cn = k[j] >= 2 ? (t0[j] - (T[j] - k[j] * c[j])) / (k[j] - 1) : c[j];
            if (cn < 0.0) cn = 0.0;
            if (!(cn < c[j]) || ++steps[j] > 1000) { /* stalled: the caller searches itself */
                w->how[q] = 1;
                w->out[q] = c[j];
                state[j] = 3;
                continue;
            }
            c[j] = cn;
        }
    }
    w->ok = 0;
out:
    free(cells); free(lfr); free(lhd); free(lkfr);
    return NULL;
}

/* Per queried link: the largest delay c with T(c) - c - T(0) <= 1e-9 max(1, T(0)) (T(c): the
   makespan with that link at c), by Newton steps from the right on the convex piecewise-linear T:
   at c the critical path crossing the link k times has length T(c) - k c, and its line meets
   T(0) + c at (T(0) - (T(c) - k c)) / (k - 1), which is at or right of the answer; each step
   lands on a new line. out[j] = the delay (inf if no path crosses the link twice); how[j] = 0
   done, 1 if the steps stalled (the caller then uses its own search). ``threads`` threads share
   the links (each its own lanes). Returns 0, 1 stuck, -1 OOM. */
int pm_tolerance(int S, int N, const int *lens, const int *codes, const double *f, const double *b,
                 const double *w, const double *links, int fused, int nq, const int *query, double res,
                 int threads, double *out, int *how) {
    long total = 0;
    for (int s = 0; s < S; s++) total += lens[s];
    int ok = -1;
    int L = S > 1 ? S - 1 : 0;
    int *model = calloc((size_t)L + 1, sizeof(int)), *queues = calloc((size_t)L + 1, sizeof(int));
    int *ss = malloc(sizeof(int) * ((size_t)total + 1)), *sp = malloc(sizeof(int) * ((size_t)total + 1));
    double *st = malloc(sizeof(double) * ((size_t)total + 1)), *se = malloc(sizeof(double) * ((size_t)total + 1));
    double *busy = malloc(sizeof(double) * (size_t)S), res2[2];
    int *ptr = malloc(sizeof(int) * (size_t)S);
    long *off = malloc(sizeof(long) * ((size_t)S + 1));
    Step *order = malloc(sizeof(Step) * ((size_t)total + 1));
    double *lk = malloc(sizeof(double) * ((size_t)L + 1));
    if (!model || !queues || !ss || !sp || !st || !se || !busy || !ptr || !off || !order || !lk)
        goto done;
    ok = pm_replay(S, N, lens, codes, f, b, w, links, model, queues, fused, -1.0, res2, busy, ptr, ss, sp, st, se,
                   NULL);
    if (ok != 0) goto done;
    off[0] = 0;
    for (int s = 0; s < S; s++) off[s + 1] = off[s] + lens[s];
    for (long i = 0; i < total; i++) {
        int s = ss[i], p = sp[i], code = codes[off[s] + p];
        order[i].s = s;
        order[i].k = code / N;
        order[i].m = code % N;
        order[i].hold = fused && order[i].k == 1 && s > 0 && p + 1 < lens[s] && codes[off[s] + p + 1] == 2 * N + code % N;
    }
    for (int l = 0; l < L; l++) lk[l] = links[l];
    {
        int nt = threads < 1 ? 1 : threads > 16 ? 16 : threads;
        if (nt > nq) nt = nq > 0 ? nq : 1;
        TolWork work[16];
        pthread_t tid[16];
        int started[16] = {0};
        for (int t = 0; t < nt; t++) {
            TolWork x = {S, N, nq, t, nt, -1, order, total, 0, f, b, w, lk, query, res2[1] - res2[0], res, out, how};
            work[t] = x;
        }
        for (int t = 1; t < nt; t++) started[t] = pthread_create(&tid[t], NULL, tol_worker, &work[t]) == 0;
        tol_worker(&work[0]);
        for (int t = 1; t < nt; t++) {
            if (started[t]) pthread_join(tid[t], NULL);
            else tol_worker(&work[t]); /* no thread: do its share here */
        }
        ok = 0;
        for (int t = 0; t < nt; t++) {
            evals_done += work[t].evals;
            if (work[t].ok != 0) ok = -1;
        }
        if (ok != 0) goto done;
    }
done:
    free(model); free(queues); free(ss); free(sp); free(st); free(se); free(busy); free(ptr); free(off); free(order);
    free(lk);
    return ok;
}
