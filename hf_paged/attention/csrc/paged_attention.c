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
   per row (row = query * Hq + head), merged into `out` by a second pass.

   `hf_paged_latent_attention_f32`, at the end, is the same for latent attention (absorbed MLA: one
   row per token that is both K and, as its prefix, V, shared by every query head). */

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

/* ---- Latent attention (absorbed MLA) ------------------------------------------------------------
   Every query head of a sequence reads the same row per token: K is the row's first D = L + R
   columns (latent, rotary key), V its first L. A work item (sequence, head group, key split) takes
   each block once and, per tile of LRT query rows (row = query * heads_per_group + head), scores
   LTT tokens at a time (a rows x tokens tile of dot products, LRT + LTT loads per LRT * LTT FMAs),
   updates the rows' online softmax, then accumulates P V in tiles of LRT rows x LCT chunks of V
   while the block is still in L1/L2. Widths need not be multiples of the lanes: a row's last,
   partial chunk is loaded through a zero-filled copy, so nothing past column D of a row (the
   indexer's key, the next row, the end of the pool) is ever read. The tiles fit AVX-512's 32
   registers (16 accumulators and their operands). */

#define LRT 4  /* query rows per tile */
#define LTT 4  /* tokens scored together (vsum4) */
#define LCT 4  /* chunks of V accumulated together */
#define LPS (MAXBS + W)  /* a tile row's scores */

static inline vf vload_part(const float *p, int n) {
    float b[W] = {0};
    for (int i = 0; i < n; i++) b[i] = p[i];
    return vload(b);
}

/* s[0..3] = the lane sums of a, b, c, d: one shuffle tree for four dot products */
static inline void vsum4(vf a, vf b, vf c, vf d, float *s) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    const vf x = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf y = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf z = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const v8 w = __builtin_shufflevector(z, z, 0, 1, 4, 5, 8, 9, 12, 13)
               + __builtin_shufflevector(z, z, 2, 3, 6, 7, 10, 11, 14, 15);
    const v4 r = __builtin_shufflevector(w, w, 0, 2, 4, 6) + __builtin_shufflevector(w, w, 1, 3, 5, 7);
    s[0] = r[0]; s[1] = r[1]; s[2] = r[2]; s[3] = r[3];
}

/* sc[j * LPS + u] = scale * q_j . k_u over D columns, for `nr` rows and the LTT tokens `kt`
   (`kn`: rows of the block AHEAD blocks on, prefetched a line at a time meanwhile, or NULL). */
static inline __attribute__((always_inline)) void latent_scores(
    const int nr, const float *const *qp, const float *const *kt, const float *const *kn, int D, float scale,
    float *sc)
{
    vf a[LRT][LTT];
    for (int j = 0; j < nr; j++)
        for (int u = 0; u < LTT; u++) a[j][u] = vsplat(0.f);
    int c = 0;
    for (; c + W <= D; c += W) {
        if (kn)
            for (int u = 0; u < LTT; u++) __builtin_prefetch(kn[u] + c, 0, 1);
        vf qv[LRT];
        for (int j = 0; j < nr; j++) qv[j] = vload(qp[j] + c);
        for (int u = 0; u < LTT; u++) {
            const vf kv = vload(kt[u] + c);
            for (int j = 0; j < nr; j++) a[j][u] += qv[j] * kv;
        }
    }
    if (c < D) {
        for (int u = 0; u < LTT; u++) {
            const vf kv = vload_part(kt[u] + c, D - c);
            for (int j = 0; j < nr; j++) a[j][u] += vload_part(qp[j] + c, D - c) * kv;
        }
    }
    for (int j = 0; j < nr; j++) {
        float s[LTT];
        vsum4(a[j][0], a[j][1], a[j][2], a[j][3], s);
        for (int u = 0; u < LTT; u++) sc[j * LPS + u] = s[u] * scale;
    }
}

/* acc[j] = acc[j] * alpha[j] + sum over t < nt of p[j][t] v_t, over `nc` chunks from column 0 of `vb`
   (the last chunk holding `last` columns, W: a whole one); acc rows are Lp apart. */
static inline __attribute__((always_inline)) void latent_values(
    const int nr, const int nc, const int last, const float *sc, const float *vb, int64_t tst, int nt,
    float *acc, int Lp, const float *alpha)
{
    vf o[LRT][LCT];
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < nc; c++) o[j][c] = vload(acc + (int64_t)j * Lp + c * W) * vsplat(alpha[j]);
    for (int t = 0; t < nt; t++) {
        const float *v = vb + t * tst;
        vf vv[LCT];
        for (int c = 0; c < nc; c++) vv[c] = c == nc - 1 && last < W ? vload_part(v + c * W, last) : vload(v + c * W);
        for (int j = 0; j < nr; j++) {
            const vf p = vsplat(sc[j * LPS + t]);
            for (int c = 0; c < nc; c++) o[j][c] += p * vv[c];
        }
    }
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < nc; c++) vstore(acc + (int64_t)j * Lp + c * W, o[j][c]);
}

/* One tile of `nr` rows over one block's first `nt` tokens: row j sees tokens [0, hi[j]), ntile is the
   largest hi. m, l, acc: the rows' running max, denominator and [nr, Lp] unnormalised output. `ka`:
   the block AHEAD blocks on, which the block's first tile prefetches as it scores (NULL: none). */
static inline __attribute__((always_inline)) void latent_tile(
    const int nr, const float *const *qp, const int *hi, int ntile, int nt,
    const float *kb, const float *ka, int64_t tst, int D, int L, int Lp, float scale,
    float *m, float *l, float *acc)
{
    float sc[LRT * LPS];
    for (int t = 0; t < ntile; t += LTT) {
        const float *kt[LTT], *kn[LTT];
        for (int u = 0; u < LTT; u++) {
            const int tt = t + u < nt ? t + u : nt - 1;  /* a padded tile column scores a real row, unused */
            kt[u] = kb + tt * tst;
            kn[u] = ka ? ka + tt * tst : NULL;
        }
        latent_scores(nr, qp, kt, ka ? kn : NULL, D, scale, sc + t);
    }
    const int tv = (ntile + W - 1) / W * W;
    float alpha[LRT];
    for (int j = 0; j < nr; j++) {
        float *row = sc + j * LPS;
        const int h = hi[j] > 0 ? hi[j] : 0;
        float bm = -INFINITY;
        for (int t = 0; t < h; t++) bm = row[t] > bm ? row[t] : bm;
        for (int t = h; t < tv; t++) row[t] = -INFINITY;
        const float nm = bm > m[j] ? bm : m[j];
        if (nm == -INFINITY) {  /* nothing seen yet: its weights stay 0 and its output 0 */
            alpha[j] = 1.f;
            for (int t = 0; t < tv; t++) row[t] = 0.f;
            continue;
        }
        alpha[j] = m[j] == -INFINITY ? 0.f : expf(m[j] - nm);
        vf psum = vsplat(0.f);
        for (int t = 0; t < tv; t += W) {
            const vf p = vexp(vload(row + t) - vsplat(nm));
            vstore(row + t, p);
            psum += p;
        }
        l[j] = l[j] * alpha[j] + vsum(psum);
        m[j] = nm;
    }
    int c = 0;
    for (; c + LCT * W <= L; c += LCT * W) latent_values(nr, LCT, W, sc, kb + c, tst, ntile, acc + c, Lp, alpha);
    for (; c < L; c += W) latent_values(nr, 1, L - c < W ? L - c : W, sc, kb + c, tst, ntile, acc + c, Lp, alpha);
}

#define LTILE(NR) latent_tile(NR, qp, hi, ntile, nt, kb, r == 0 ? ka : NULL, kv_tst, D, L, Lp, scale, \
                              m + r, l + r, acc + (int64_t)r * Lp)

/* Returns 0; -1 for shapes it does not take (block sizes above 64, empty widths or counts); -2 for
   metadata that would take it outside its tensors (cu_q not from 0 to T, a run longer than its
   sequence or than max_rows allows, a sequence longer than its block-table row); -3 for a block id
   outside the pool. All are checked before anything is read through them or written. */
int hf_paged_latent_attention_f32(
    const float *q, int64_t q_st, int64_t q_sh, int T,          /* [T, H, L + R], strides in elements, last 1 */
    const float *kv, int64_t kv_bst, int64_t kv_tst, int NB,    /* rows [NB, BS, >= L + R]: block, token strides */
    const int32_t *bt, int64_t bt_stride, int bt_width,          /* [S, bt_width] */
    const int32_t *seq_lens, const int32_t *cu_q,                /* [S], [S + 1]: query run s is q[cu_q[s]:cu_q[s+1]] */
    int S, int H, int L, int R, int BS, float scale,
    int nsplit, int hpg, int max_rows,                           /* key splits; heads per group; rows of an item */
    float *part_ml, float *part_acc,                             /* [S, G, nsplit, 2, max_rows], [S, G, nsplit, max_rows, Lp] */
    float *out, int nthreads)                                    /* [T, H, L] contiguous */
{
    if (L < 1 || R < 0 || BS < 1 || BS > MAXBS || H < 1 || nsplit < 1 || hpg < 1 || max_rows < 1 || S < 0) return -1;
    if (cu_q[0] != 0 || cu_q[S] != T) return -2;
    for (int s = 0; s < S; s++) {
        const int ql = cu_q[s + 1] - cu_q[s], Lk = seq_lens[s];
        const int64_t nblk = ((int64_t)Lk + BS - 1) / BS;
        if (ql < 0 || Lk < ql || (int64_t)ql * (hpg < H ? hpg : H) > max_rows || nblk > bt_width) return -2;
        for (int b = 0; b < nblk; b++)
            if (bt[(int64_t)s * bt_stride + b] < 0 || bt[(int64_t)s * bt_stride + b] >= NB) return -3;
    }
    const int D = L + R, Lp = (L + W - 1) / W * W, G = (H + hpg - 1) / hpg;
    #pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int s = 0; s < S; s++)
    for (int g = 0; g < G; g++)
    for (int sp = 0; sp < nsplit; sp++) {
        const int64_t item = ((int64_t)s * G + g) * nsplit + sp;
        const int q0 = cu_q[s], ql = cu_q[s + 1] - cu_q[s], Lk = seq_lens[s];
        const int h0 = g * hpg, hn = H - h0 < hpg ? H - h0 : hpg, nrow = ql * hn;
        float *m = part_ml + item * 2 * max_rows, *l = m + max_rows;
        float *acc = part_acc + item * max_rows * Lp;
        for (int r = 0; r < nrow; r++) { m[r] = -INFINITY; l[r] = 0.f; }
        for (int64_t e = 0; e < (int64_t)nrow * Lp; e++) acc[e] = 0.f;
        if (ql <= 0) continue;
        const int first_pos = Lk - ql, nblk = (Lk + BS - 1) / BS;
        const int per = (nblk + nsplit - 1) / nsplit, bs = sp * per;
        const int be = bs + per < nblk ? bs + per : nblk;
        for (int b = bs; b < be; b++) {
            const float *kb = kv + bt[(int64_t)s * bt_stride + b] * kv_bst;
            const float *ka = b + AHEAD < be ? kv + bt[(int64_t)s * bt_stride + b + AHEAD] * kv_bst : NULL;
            const int t0 = b * BS, nt = Lk - t0 < BS ? Lk - t0 : BS;
            for (int r = 0; r < nrow; r += LRT) {
                const int n = nrow - r < LRT ? nrow - r : LRT;
                const float *qp[LRT];
                int hi[LRT], ntile = 0;
                for (int j = 0; j < n; j++) {
                    const int i = (r + j) / hn, h = h0 + (r + j) % hn;
                    qp[j] = q + (int64_t)(q0 + i) * q_st + (int64_t)h * q_sh;
                    hi[j] = first_pos + i + 1 - t0 < nt ? first_pos + i + 1 - t0 : nt;
                    ntile = hi[j] > ntile ? hi[j] : ntile;
                }
                if (ntile <= 0) continue;  /* a block after every query of the tile */
                switch (n) {
                case 1: LTILE(1); break;
                case 2: LTILE(2); break;
                case 3: LTILE(3); break;
                default: LTILE(4); break;
                }
            }
        }
    }
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int s = 0; s < S; s++)
    for (int g = 0; g < G; g++) {
        const int q0 = cu_q[s], ql = cu_q[s + 1] - cu_q[s];
        const int h0 = g * hpg, hn = H - h0 < hpg ? H - h0 : hpg;
        const int64_t item0 = ((int64_t)s * G + g) * nsplit;
        for (int r = 0; r < ql * hn; r++) {
            float *dst = out + ((int64_t)(q0 + r / hn) * H + h0 + r % hn) * L;
            float M = -INFINITY, den = 0.f;
            for (int sp = 0; sp < nsplit; sp++) {
                const float mm = part_ml[(item0 + sp) * 2 * max_rows + r];
                M = mm > M ? mm : M;
            }
            for (int e = 0; e < L; e++) dst[e] = 0.f;
            for (int sp = 0; sp < nsplit; sp++) {
                const float *mp = part_ml + (item0 + sp) * 2 * max_rows;
                if (mp[r] == -INFINITY) continue;
                const float w = expf(mp[r] - M);
                den += mp[max_rows + r] * w;
                const float *a = part_acc + ((item0 + sp) * max_rows + r) * Lp;
                int e = 0;
                for (; e + W <= L; e += W) vstore(dst + e, vload(dst + e) + vsplat(w) * vload(a + e));
                for (; e < L; e++) dst[e] += w * a[e];
            }
            const float inv = den > 0.f ? 1.f / den : 0.f;
            for (int e = 0; e < L; e++) dst[e] *= inv;
        }
    }
    return 0;
}
