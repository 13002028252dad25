/* hf_paged's CPU paged attention for short query runs (decode, speculative verify): fp32, K/V read
   in place through the block table, never gathered.

   Built on first use by `hf_paged/attention/cpu_kernel.py` (the host compiler, -O3 -march=native
   -fopenmp) and called through ctypes, so it needs neither torch's headers nor a build step at
   install time. Portable C: GCC/Clang vector extensions, 16 float lanes (one AVX-512 register, two
   AVX2 ones, four NEON ones). OpenMP threads are those of the process's libgomp, the one torch has
   already loaded.

   The contract is `torch_paged.paged_attention`'s, for the sequences it is handed: query i of
   sequence s sits at position seq_lens[s] - q_len[s] + i and sees key positions p <= pos, with
   a sliding window w only p > pos - w, and with a chunk C (Llama 4's local attention) only
   p >= (pos / C) * C; softcap (softcap * tanh(x / softcap)) applies to the scaled
   scores; a sink adds exp(sink - max) to a head's denominator.

   Work is split into (sequence, key split) items over every head, so a block's K and then its V
   are each read as one contiguous [block_size, Hkv, D] run, and every K or V row is loaded once for
   the query heads that share it. Each item keeps a running max, denominator and unnormalised output
   per row (row = query * Hq + head), merged into `out` by a second pass. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#define W 16        /* lanes */
#define MAXC 16     /* head widths up to MAXC * W = 256 */
#define MAXBS 64    /* block sizes up to 64 tokens */
#define RMAX 4      /* query rows sharing a KV head that are computed together */
#define AHEAD 2     /* blocks ahead whose rows are prefetched (into L2) while this one is computed */

static inline vf vload(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline float vsum(vf v) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (a score minus its row's running max): Cephes' polynomial on x - n ln 2, scaled
   by 2^n through the exponent bits; x below -87 (and -inf, a masked key) gives exactly 0. */
static inline vf vexp(vf x) {
    const vf lo = vsplat(-87.f);
    const vi under = x < lo;
    x = vselect(under, lo, x);
    const vf t = x * vsplat(1.44269504088896341f);
    const vi n = __builtin_convertvector(t - vsplat(0.5f), vi);  /* t <= 0: truncating t - 0.5 rounds */
    const vf nf = __builtin_convertvector(n, vf);
    vf f = x - nf * vsplat(0.693359375f);
    f = f - nf * vsplat(-2.12194440e-4f);
    vf p = vsplat(1.9875691500e-4f);
    p = p * f + vsplat(1.3981999507e-3f);
    p = p * f + vsplat(8.3334519073e-3f);
    p = p * f + vsplat(4.1665795894e-2f);
    p = p * f + vsplat(1.6666665459e-1f);
    p = p * f + vsplat(5.0000001201e-1f);
    vf y = p * f * f + f + vsplat(1.f);
    y = y * (vf)((n + 127) << 23);
    return vselect(under, vsplat(0.f), y);
}

/* `nr` query rows that share one KV head, over one block's visible tokens [lo, hi). `nr`, `cd` and
   `cv` are constants at every call site, so the loops unroll and the vectors stay in registers. */
static inline __attribute__((always_inline)) void rows(
    const int nr, const int cd, const int cv,
    const float *qq, int64_t q_sh,           /* the first row's query; the next rows are q_sh further */
    const float *kh, const float *vh,        /* the block's first K / V row of this head */
    const float *kn, const float *vn,        /* the same rows of the block AHEAD blocks on (NULL: none) */
    int64_t k_st, int64_t v_st,              /* stride between tokens (Hkv * D, Hkv * Dv) */
    int lo, int hi, float scale, float softcap,
    float *sc,                               /* [RMAX][MAXBS + W] scratch */
    float *m, float *l, float *acc, int Dv)  /* the rows' running max, denominator, [nr, Dv] output */
{
    vf qv[RMAX][MAXC];
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < cd; c++) qv[j][c] = vload(qq + j * q_sh + c * W) * vsplat(scale);
    float bm[RMAX];
    for (int j = 0; j < nr; j++) bm[j] = -INFINITY;
    for (int t = lo; t < hi; t++) {
        const float *k = kh + t * k_st;
        if (kn)
            for (int c = 0; c < cd; c++) __builtin_prefetch(kn + t * k_st + c * W, 0, 1);
        vf a[RMAX];
        const vf k0 = vload(k);
        for (int j = 0; j < nr; j++) a[j] = qv[j][0] * k0;
        for (int c = 1; c < cd; c++) {
            const vf kv = vload(k + c * W);
            for (int j = 0; j < nr; j++) a[j] += qv[j][c] * kv;
        }
        for (int j = 0; j < nr; j++) {
            float d = vsum(a[j]);
            if (softcap > 0.f) d = softcap * tanhf(d / softcap);
            sc[j * (MAXBS + W) + t] = d;
            bm[j] = d > bm[j] ? d : bm[j];
        }
    }
    float alpha[RMAX];
    for (int j = 0; j < nr; j++) {
        float *row = sc + j * (MAXBS + W);
        for (int t = 0; t < lo; t++) row[t] = -INFINITY;
        for (int t = hi; t < ((hi + W - 1) / W) * W; t++) row[t] = -INFINITY;
        const float nm = bm[j] > m[j] ? bm[j] : m[j];
        alpha[j] = m[j] == -INFINITY ? 0.f : expf(m[j] - nm);
        vf psum = vsplat(0.f);
        for (int t = 0; t < hi; t += W) {
            const vf p = vexp(vload(row + t) - vsplat(nm));
            vstore(row + t, p);
            psum += p;
        }
        l[j] = l[j] * alpha[j] + vsum(psum);
        m[j] = nm;
    }
    vf o[RMAX][MAXC];
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < cv; c++) o[j][c] = vsplat(0.f);
    for (int t = lo; t < hi; t++) {
        const float *v = vh + t * v_st;
        if (vn)
            for (int c = 0; c < cv; c++) __builtin_prefetch(vn + t * v_st + c * W, 0, 1);
        vf p[RMAX];
        for (int j = 0; j < nr; j++) p[j] = vsplat(sc[j * (MAXBS + W) + t]);
        for (int c = 0; c < cv; c++) {
            const vf vv = vload(v + c * W);
            for (int j = 0; j < nr; j++) o[j][c] += p[j] * vv;
        }
    }
    for (int j = 0; j < nr; j++) {
        float *a = acc + (int64_t)j * Dv;
        const vf al = vsplat(alpha[j]);
        for (int c = 0; c < cv; c++) vstore(a + c * W, vload(a + c * W) * al + o[j][c]);
    }
}

#define ROWS(NR, CD, CV, J) rows(NR, CD, CV, qrow + (hq + (J)) * q_sh, q_sh, kh, vh, (J) ? NULL : kn, (J) ? NULL : vn, \
                                 k_st, v_st, lo, hi, scale, \
                                 softcap, sc, m + r + (J), l + r + (J), acc + (int64_t)(r + (J)) * Dv, Dv)

/* Returns 0, or -1 for shapes it does not take (head widths not multiples of 16 or above 256, block
   sizes above 64, Hq not a multiple of Hkv); the caller checks them first (`cpu_kernel.supports`). */
int hf_paged_attention_f32(
    const float *q, int64_t q_st, int64_t q_sh,                 /* [T, Hq, D], strides in elements, last 1 */
    const float *kc, const float *vc,                           /* [NB, BS, Hkv, D], [NB, BS, Hkv, Dv] contiguous */
    const int32_t *bt, int64_t bt_stride,                        /* [S, max_blocks] */
    const int32_t *seq_lens, const int32_t *cu_q,                /* [S], [S + 1]: query run s is q[cu_q[s]:cu_q[s+1]] */
    int S, int Hq, int Hkv, int D, int Dv, int BS,
    float scale, int window, int chunk,                          /* window, chunk <= 0: none */
    float softcap, const float *sinks,                           /* softcap <= 0: none; sinks [Hq] or NULL */
    int nsplit, int max_rows,                                    /* key splits per sequence; max_rows >= every q_len * Hq */
    float *part_ml, float *part_acc,                             /* [S, nsplit, 2, max_rows], [S, nsplit, max_rows, Dv] scratch */
    float *out, int nthreads)                                    /* [T, Hq, Dv] contiguous */
{
    if (D % W || Dv % W || D > MAXC * W || Dv > MAXC * W || BS < 1 || BS > MAXBS || Hkv < 1 || Hq % Hkv || nsplit < 1)
        return -1;
    const int G = Hq / Hkv;
    const int64_t k_st = (int64_t)Hkv * D, v_st = (int64_t)Hkv * Dv;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int s = 0; s < S; s++)
    for (int sp = 0; sp < nsplit; sp++) {
        const int q0 = cu_q[s], ql = cu_q[s + 1] - cu_q[s], L = seq_lens[s], R = ql * Hq;
        float *m = part_ml + ((int64_t)s * nsplit + sp) * 2 * max_rows, *l = m + max_rows;
        float *acc = part_acc + ((int64_t)s * nsplit + sp) * max_rows * Dv;
        for (int r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.f; }
        for (int64_t e = 0; e < (int64_t)R * Dv; e++) acc[e] = 0.f;
        if (ql <= 0 || L < ql) continue;
        const int first_pos = L - ql;
        int kstart = 0;
        if (window > 0) { kstart = first_pos - window + 1; if (kstart < 0) kstart = 0; }
        if (chunk > 0 && first_pos / chunk * chunk > kstart) kstart = first_pos / chunk * chunk;
        const int nblk = (L + BS - 1) / BS, b0 = kstart / BS;
        const int per = (nblk - b0 + nsplit - 1) / nsplit;
        const int bs = b0 + sp * per;
        const int be = bs + per < nblk ? bs + per : nblk;
        float sc[RMAX * (MAXBS + W)];
        for (int b = bs; b < be; b++) {
            const int64_t phys = bt[(int64_t)s * bt_stride + b];
            /* The block AHEAD blocks on is prefetched a row at a time as this one's rows are read, so the
               memory system always has work and the core never waits on a burst of prefetches. */
            const float *ka = NULL, *va = NULL;
            if (b + AHEAD < be) {
                const int64_t ahead = bt[(int64_t)s * bt_stride + b + AHEAD];
                ka = kc + ahead * BS * k_st;
                va = vc + ahead * BS * v_st;
            }
            const int t0 = b * BS;
            const int nt = L - t0 < BS ? L - t0 : BS;
            const float *kb = kc + phys * BS * k_st, *vb = vc + phys * BS * v_st;
            for (int i = 0; i < ql; i++) {
                const int qp = first_pos + i;
                int lo = window > 0 ? qp - window + 1 - t0 : 0;
                if (chunk > 0 && qp / chunk * chunk - t0 > lo) lo = qp / chunk * chunk - t0;
                if (lo < 0) lo = 0;
                const int hi = qp + 1 - t0 < nt ? qp + 1 - t0 : nt;
                if (hi <= lo) continue;
                const float *qrow = q + (int64_t)(q0 + i) * q_st;
                for (int h = 0; h < Hkv; h++) {
                    const float *kh = kb + (int64_t)h * D, *vh = vb + (int64_t)h * Dv;
                    for (int g = 0; g < G; g += RMAX) {
                        const int n = G - g < RMAX ? G - g : RMAX, hq = h * G + g, r = i * Hq + hq;
                        /* each head's rows ahead are prefetched once: by the first query's first rows */
                        const float *kn = ka && i == 0 && g == 0 ? ka + (int64_t)h * D : NULL;
                        const float *vn = va && i == 0 && g == 0 ? va + (int64_t)h * Dv : NULL;
                        if (D == 64 && Dv == 64) {
                            switch (n) {
                            case 1: ROWS(1, 4, 4, 0); break;
                            case 2: ROWS(2, 4, 4, 0); break;
                            case 3: ROWS(3, 4, 4, 0); break;
                            default: ROWS(4, 4, 4, 0); break;
                            }
                        } else if (D == 128 && Dv == 128) {
                            for (int j = 0; j < n; j += 2) {
                                if (n - j >= 2) ROWS(2, 8, 8, j);
                                else ROWS(1, 8, 8, j);
                            }
                        } else {
                            for (int j = 0; j < n; j++) ROWS(1, D / W, Dv / W, j);
                        }
                    }
                }
            }
        }
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int s = 0; s < S; s++) {
        const int q0 = cu_q[s], ql = cu_q[s + 1] - cu_q[s];
        for (int r = 0; r < ql * Hq; r++) {
            const int hq = r % Hq;
            float M = -INFINITY;
            for (int sp = 0; sp < nsplit; sp++) {
                const float mm = part_ml[((int64_t)s * nsplit + sp) * 2 * max_rows + r];
                M = mm > M ? mm : M;
            }
            if (sinks && sinks[hq] > M) M = sinks[hq];
            float den = sinks ? expf(sinks[hq] - M) : 0.f;
            float *dst = out + ((int64_t)q0 * Hq + r) * Dv;
            for (int e = 0; e < Dv; e++) dst[e] = 0.f;
            for (int sp = 0; sp < nsplit; sp++) {
                const float *mp = part_ml + ((int64_t)s * nsplit + sp) * 2 * max_rows;
                if (mp[r] == -INFINITY) continue;
                const float w = expf(mp[r] - M);
                den += mp[max_rows + r] * w;
                const float *a = part_acc + (((int64_t)s * nsplit + sp) * max_rows + r) * Dv;
                for (int e = 0; e < Dv; e += W) vstore(dst + e, vload(dst + e) + vsplat(w) * vload(a + e));
            }
            const vf inv = vsplat(den > 0.f ? 1.f / den : 0.f);
            for (int e = 0; e < Dv; e += W) vstore(dst + e, vload(dst + e) * inv);
        }
    }
    return 0;
}
