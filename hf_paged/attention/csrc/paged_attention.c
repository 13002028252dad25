/* hf_paged's CPU paged attention for short query runs (decode, speculative verify): K/V read in
   place through the block table, never gathered, in the pool's own dtype.

   Built on first use by `hf_paged/attention/cpu_kernel.py` (the host compiler, -O3 -march=native
   -fopenmp) and called through ctypes, so it needs neither torch's headers nor a build step at
   install time. Portable C: GCC/Clang vector extensions, 16 float lanes (one AVX-512 register, two
   AVX2 ones, four NEON ones), with AVX-512 intrinsics for the loads that convert (the vector
   extensions' conversions between widths come out scalar). OpenMP threads are those of the
   process's libgomp, the one torch has already loaded.

   The contract is `torch_paged.paged_attention`'s, for the sequences it is handed: query i of
   sequence s sits at position seq_lens[s] - q_len[s] + i and sees key positions p <= pos, with
   a sliding window w only p > pos - w, and with a chunk C (Llama 4's local attention) only
   p >= (pos / C) * C; softcap (softcap * tanh(x / softcap)) applies to the scaled
   scores; a sink adds exp(sink - max) to a head's denominator.

   Work is split into (sequence, key split) items over every head, taken a span at a time (up to
   MAXBS tokens of whole blocks), and every K or V row is loaded once for the query heads that share
   it (RMAX at a time): their scores 16 tokens at a time, each token's dot products summed across
   lanes by a shared tree of shuffles (`comb1`..`comb4`); then the span's softmax bookkeeping, once
   per span, not per block; then P V. The next span's rows are prefetched, a row at a time, as this
   one's are read, and the pages of the span after it are touched (`warm_pages`). Each item keeps a
   running max, denominator and unnormalised output per row (row = query * Hq + head), merged into
   `out` by a second pass.

   Dtypes (`DT_*`, `cpu_kernel.DTYPE_CODES`): queries and output fp32, bf16 or fp16; K/V fp32, bf16,
   fp16, or one-byte int8 / fp8 (e4m3fn, e5m2) payloads with per-token float32 scales (`kv_quant`:
   x = q * scale (+ offset)). Every element becomes fp32 in registers as it is loaded (`load16`) and
   all arithmetic is fp32, the output rounded once: bf16 is fp32's top half; fp16 goes through
   vcvtph2ps; e5m2 is fp16's top byte; e4m3 is shifted into fp16's bits (its value times 2^-8, which
   the scale gives back), its NaN codes made NaN. A scale is never applied per element: it multiplies
   a token's dot product (q . k * scale + offset * sum(q)) and its weight in P V (p * scale, plus
   p * offset summed once per row), which equals dequantising first up to fp32 rounding. A NaN or
   infinite scale (the dynamic scale of a row holding NaN/inf) gives that token a NaN score, as its
   dequantised row does on the torch path; a NaN reaches the output (a split whose every score is
   NaN is merged, not skipped as empty).

   `hf_paged_latent_attention_f32`, at the end, is the same for latent attention (absorbed MLA: one
   row per token that is both K and, as its prefix, V, shared by every query head), fp32 only. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int16_t vh __attribute__((vector_size(32)));   /* 16 x 16 bits */
typedef uint16_t vuh __attribute__((vector_size(32)));
typedef int8_t vb __attribute__((vector_size(16)));    /* 16 x 8 bits */
#define W 16        /* lanes */
#define MAXC 16     /* head widths up to MAXC * W = 256 */
#define MAXBS 64    /* block sizes up to 64 tokens */
#define RMAX 4      /* query rows sharing a KV head that are computed together */
#define AHEAD 2     /* latent: blocks ahead whose rows are prefetched (into L2) while this one is computed */

/* Element types (the codes `cpu_kernel.DTYPE_CODES` passes). Queries and outputs: the first three. */
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define DT_I8 3
#define DT_E4M3 4
#define DT_E5M2 5
/* The K/V type this build reads: -DHF_PAGED_KV=<code> (`cpu_kernel` builds one library per K/V dtype on
   its first use, so each dtype's compile is paid only where it is read); every type without it. */
#ifndef HF_PAGED_KV
#define HF_PAGED_KV (-1)
#endif
#define KV_BUILT(t) (HF_PAGED_KV < 0 || HF_PAGED_KV == (t))

static inline int dtype_size(int t) { return t == DT_F32 ? 4 : t <= DT_F16 ? 2 : 1; }

static inline vf vload(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* 16 fp16 bit patterns as fp32 values, exactly (subnormals, inf, NaN included). */
static inline vf half_to_float(vuh h) {
#if defined(__AVX512F__)
    __m256i x;
    __builtin_memcpy(&x, &h, sizeof x);
    return (vf)_mm512_cvtph_ps(x);
#else
    const vu u = __builtin_convertvector(h, vu);
    const vu em = u & 0x7FFF, sign = (u & 0x8000) << 16;
    /* finite: the bits moved under fp32's exponent, times 2^(127 - 15) (a subnormal half comes out normal) */
    const vu finite = (vu)((vf)(em << 13) * vsplat(0x1p112f));
    const vu special = (vu)(em >= 0x7C00);  /* inf, NaN: fp32's all-ones exponent */
    return (vf)(sign | (special & ((em << 13) | 0x7F800000)) | (~special & finite));
#endif
}

/* e4m3fn `s eeee mmm` as fp16 bits `s 0eeee mmm0000000`: the same value times 2^-8, subnormals
   included (kv_quant.dequantize's trick); its NaN codes (s 1111 111) get fp16's all-ones exponent. */
static inline vuh e4m3_to_half(vuh h) {  /* h: the codes sign-extended to 16 bits */
    h = (h << 7) & 0xBFFF;
    return h | ((vuh)((h & 0x3F80) == 0x3F80) & 0x7C00);
}

/* 16 consecutive elements of type `type` at `p`, as fp32 (e4m3: times 2^-8). `type` is a constant at
   every call site, so the switch folds away. */
static inline __attribute__((always_inline)) vf load16(const int type, const char *p) {
#if defined(__AVX512F__)
    switch (type) {
    case DT_BF16:
        return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    case DT_F16:
        return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    case DT_I8:
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    case DT_E5M2:
        return (vf)_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
    case DT_E4M3: {
        const __m256i m = _mm256_set1_epi16(0x3F80);
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
        h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, m), m),
                                                _mm256_set1_epi16(0x7C00)));
        return (vf)_mm512_cvtph_ps(h);
    }
    default:
        break;
    }
#endif
    vuh h;
    vb b;
    vf v;
    switch (type) {
    case DT_BF16: __builtin_memcpy(&h, p, sizeof h); return (vf)(__builtin_convertvector(h, vu) << 16);
    case DT_F16: __builtin_memcpy(&h, p, sizeof h); return half_to_float(h);
    case DT_I8: __builtin_memcpy(&b, p, sizeof b); return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
    case DT_E5M2: __builtin_memcpy(&b, p, sizeof b); return half_to_float((vuh)__builtin_convertvector(b, vh) << 8);
    case DT_E4M3:
        __builtin_memcpy(&b, p, sizeof b);
        return half_to_float(e4m3_to_half((vuh)__builtin_convertvector(b, vh)));
    default: __builtin_memcpy(&v, p, sizeof v); return v;
    }
}

/* A query row's 16 elements (fp32, bf16 or fp16: a runtime type, read once per row and block). */
static inline vf load_query(int type, const char *p) {
    return type == DT_BF16 ? load16(DT_BF16, p) : type == DT_F16 ? load16(DT_F16, p) : load16(DT_F32, p);
}

/* fp32 -> fp16 bits, rounded to nearest even (inf past 65504, NaN stays NaN). */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
    if (ax > 0x7F800000) return sign | 0x7E00;
    if (ax >= 0x477FF000) return sign | 0x7C00;  /* 65520 and up round to inf */
    if (ax < 0x38800000) {  /* below 2^-14: a subnormal half, round(|f| * 2^24) of its units */
        float a;
        __builtin_memcpy(&a, &ax, sizeof a);
        return sign | (uint16_t)lrintf(a * 0x1p24f);
    }
    return sign | ((ax + 0xC8000FFF + ((ax >> 13) & 1)) >> 13);  /* rebias by -112, round the 13 bits dropped */
}

/* Store 16 fp32 values at `p` as `type` (fp32, bf16 or fp16), each rounded once to nearest even. */
static inline void store16(int type, char *p, vf v) {
    if (type == DT_BF16) {
        const vu u = (vu)v;
        const vu nan = (vu)((u & 0x7FFFFFFF) > 0x7F800000);
        const vu r = (nan & ((u >> 16) | 0x40)) | (~nan & ((u + 0x7FFF + ((u >> 16) & 1)) >> 16));
        const vuh h = __builtin_convertvector(r, vuh);
        __builtin_memcpy(p, &h, sizeof h);
    } else if (type == DT_F16) {
#if defined(__AVX512F__)
        const __m256i h = _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __builtin_memcpy(p, &h, sizeof h);
#else
        uint16_t h[W];
        for (int i = 0; i < W; i++) h[i] = float_to_half(v[i]);
        __builtin_memcpy(p, h, sizeof h);
#endif
    } else {
        __builtin_memcpy(p, &v, sizeof v);
    }
}

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


/* The lane sums of token accumulators, one level of a tree at a time (two-source shuffles and an add
   each): comb1(a, b) = [a's 16 lanes folded to 8 | b's 8]; comb2 of two of those = 4 tokens x 4 lanes;
   comb3 = 8 x 2; comb4 = 16 x 1, the tokens' sums in order. 15 combines for 16 dot products, where a
   sum per token takes four levels of shuffles and adds each. */
#define LO1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI2 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI3 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI4 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
static inline vf comb1(vf a, vf b) { return __builtin_shufflevector(a, b, LO1) + __builtin_shufflevector(a, b, HI1); }
static inline vf comb2(vf a, vf b) { return __builtin_shufflevector(a, b, LO2) + __builtin_shufflevector(a, b, HI2); }
static inline vf comb3(vf a, vf b) { return __builtin_shufflevector(a, b, LO3) + __builtin_shufflevector(a, b, HI3); }
static inline vf comb4(vf a, vf b) { return __builtin_shufflevector(a, b, LO4) + __builtin_shufflevector(a, b, HI4); }

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }  /* b where either is NaN */

/* Lanes 0..3: the lane sums (is_max 0) or maxima (1) of a, b, c, d, by the same tree. */
static inline vf reduce4(vf a, vf b, vf c, vf d, int is_max) {
    if (is_max) {
        const vf x = vmax(__builtin_shufflevector(a, b, LO1), __builtin_shufflevector(a, b, HI1));
        const vf y = vmax(__builtin_shufflevector(c, d, LO1), __builtin_shufflevector(c, d, HI1));
        const vf z = vmax(__builtin_shufflevector(x, y, LO2), __builtin_shufflevector(x, y, HI2));
        const vf w = vmax(__builtin_shufflevector(z, z, LO3), __builtin_shufflevector(z, z, HI3));
        return vmax(__builtin_shufflevector(w, w, LO4), __builtin_shufflevector(w, w, HI4));
    }
    const vf z = comb2(comb1(a, b), comb1(c, d)), w = comb3(z, z);
    return comb4(w, w);
}

/* a[j] = q_j * k lanewise, summed over the row's `cd` chunks (its sum is q_j . k). */
static inline __attribute__((always_inline)) void dots(
    const int nr, const int cd, const int kvt, const vf (*qv)[MAXC], const char *k, vf *a)
{
    const int es = dtype_size(kvt);
    const vf k0 = load16(kvt, k);
    for (int j = 0; j < nr; j++) a[j] = qv[j][0] * k0;
    for (int c = 1; c < cd; c++) {
        const vf kv = load16(kvt, k + c * W * es);
        for (int j = 0; j < nr; j++) a[j] += qv[j][c] * kv;
    }
}

/* sc[j][t0 + u] = q_j . k_(t0 + u) for u < n (n = 16 or 4, a constant), each row's sums reduced by the
   comb tree; tokens past `last` score `last`'s row again (written past the range, masked later). Token
   t's row is kp[t] + ko (`kn`: the next span's rows, prefetched a token at a time meanwhile, or NULL). */
static inline __attribute__((always_inline)) void scores(
    const int nr, const int cd, const int kvt, const int n, const vf (*qv)[MAXC], const char *const *kp,
    const char *const *kn, int64_t ko, int t0, int last, float *sc)
{
    const int es = dtype_size(kvt);
    vf l1[RMAX] = {0}, l2[RMAX] = {0}, l3[RMAX] = {0};  /* the tree's pending levels */
    for (int u = 0; u < n; u += 2) {
        const int ta = t0 + u < last ? t0 + u : last, tb = t0 + u + 1 < last ? t0 + u + 1 : last;
        if (kn)
            for (int c = 0; c < cd * W * es; c += 64) {
                __builtin_prefetch(kn[ta] + ko + c, 0, 1);
                __builtin_prefetch(kn[tb] + ko + c, 0, 1);
            }
        vf a0[RMAX], a1[RMAX];
        dots(nr, cd, kvt, qv, kp[ta] + ko, a0);
        dots(nr, cd, kvt, qv, kp[tb] + ko, a1);
        for (int j = 0; j < nr; j++) {
            const vf c1 = comb1(a0[j], a1[j]);
            if (u % 4 == 0) {
                l1[j] = c1;
                continue;
            }
            const vf c2 = comb2(l1[j], c1);  /* tokens u - 2 .. u + 1 */
            if (n == 4) {
                const vf c3 = comb3(c2, c2);
                vstore(sc + j * (MAXBS + W) + t0, comb4(c3, c3));  /* lanes 0..3; the rest past them */
            } else if (u % 8 == 2) {
                l2[j] = c2;
            } else if (u == 6) {
                l3[j] = comb3(l2[j], c2);
            } else if (u == 14) {
                vstore(sc + j * (MAXBS + W) + t0, comb4(l3[j], comb3(l2[j], c2)));
            }
        }
    }
}

/* A span: up to MAXBS consecutive tokens of a sequence, whole blocks of `bs` tokens: each token's K
   and V row (of head 0: a head adds its offset), and each block's K and V scales (quantised). */
struct span {
    const char *kp[MAXBS], *vp[MAXBS];
    const float *ks[MAXBS], *vs[MAXBS];
    int bs, s_st;  /* tokens per block; floats between a block's tokens' scales */
};

/* `nr` query rows that share one KV head, over a span's visible tokens [lo, hi). `nr`, `cd`, `cv` and
   `kvt` are constants at every call site, so the loops unroll, the vectors stay in registers and the
   loads convert without a branch. Offsets are in bytes (ko, vo) or floats (so). */
static inline __attribute__((always_inline)) void rows(
    const int nr, const int cd, const int cv, const int kvt, int qt,
    const char *qq, int64_t q_sh,            /* the first row's query (type qt); the next rows are q_sh further */
    const struct span *sp, const struct span *next,
    int64_t ko, int64_t vo, int64_t so,      /* this head's offsets in a token's K row, V row, scales */
    int s_ch,                                /* quantised: 2 where a token's scale is followed by its offset */
    int lo, int hi, float scale, float softcap,
    float *sc,                               /* [RMAX][MAXBS + W] scratch */
    float *m, float *l, float *acc, int Dv)  /* the rows' running max, denominator, [nr, Dv] output */
{
    const int es = dtype_size(kvt), qes = dtype_size(qt);
    const int quant = kvt >= DT_I8, offsets = quant && s_ch == 2;
    const float unit = kvt == DT_E4M3 ? 256.f : 1.f;  /* e4m3 loads as its value times 2^-8 */
    vf qv[RMAX][MAXC];
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < cd; c++) qv[j][c] = load_query(qt, qq + j * q_sh + c * W * qes) * vsplat(scale);
    float qsum[RMAX] = {0};  /* sum(q): what a token's offset adds to its dot product, per unit */
    for (int j = 0; j < nr && offsets; j++) {
        vf s = qv[j][0];
        for (int c = 1; c < cd; c++) s += qv[j][c];
        qsum[j] = vsum(s);
    }
    /* Quantised: the tokens' scales (and offsets) side by side, 0 outside [lo, hi); read first, so that
       their loads overlap the dot products. */
    const int t_lo = lo / W * W, t_hi = (hi + W - 1) / W * W;
    float kscale[MAXBS + W], vscale[MAXBS + W], koff[MAXBS + W], voff[MAXBS + W];
#if defined(__AVX512F__)
    if (quant && sp->bs % W == 0) {  /* 16 tokens of one block at a time: a gather each, lanes outside 0 */
        const int bs = sp->bs, s_st = sp->s_st;
        const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(s_st));
        for (int u = t_lo; u < t_hi; u += W) {
            const int b = u / bs, from = lo > u ? lo - u : 0, to = hi - u < W ? hi - u : W;
            const __mmask16 in = (__mmask16)(((1u << to) - 1) & ~((1u << from) - 1));
            const float *kb = sp->ks[b] + so + (int64_t)(u - b * bs) * s_st;
            const float *vb = sp->vs[b] + so + (int64_t)(u - b * bs) * s_st;
            const __m512 zero = _mm512_setzero_ps();
            vstore(kscale + u, (vf)_mm512_mask_i32gather_ps(zero, in, idx, kb, 4) * vsplat(unit));
            vstore(vscale + u, (vf)_mm512_mask_i32gather_ps(zero, in, idx, vb, 4) * vsplat(unit));
            if (offsets) {
                vstore(koff + u, (vf)_mm512_mask_i32gather_ps(zero, in, idx, kb + 1, 4));
                vstore(voff + u, (vf)_mm512_mask_i32gather_ps(zero, in, idx, vb + 1, 4));
            }
        }
    } else
#endif
    if (quant) {
        for (int u = t_lo; u < lo; u++) kscale[u] = vscale[u] = koff[u] = voff[u] = 0.f;
        for (int u = hi; u < t_hi; u++) kscale[u] = vscale[u] = koff[u] = voff[u] = 0.f;
        const int bs = sp->bs, s_st = sp->s_st;
        for (int b = lo / bs; b * bs < hi; b++) {  /* each block's run of tokens in [lo, hi) */
            const int from = lo > b * bs ? lo : b * bs, to = hi < (b + 1) * bs ? hi : (b + 1) * bs;
            const float *ksb = sp->ks[b] + so - (int64_t)b * bs * s_st, *vsb = sp->vs[b] + so - (int64_t)b * bs * s_st;
            for (int u = from; u < to; u++) {
                kscale[u] = ksb[u * s_st] * unit;
                vscale[u] = vsb[u * s_st] * unit;
                if (offsets) {
                    koff[u] = ksb[u * s_st + 1];
                    voff[u] = vsb[u * s_st + 1];
                }
            }
        }
    }
    /* Dot products, raw: 16 tokens at a time while more than 4 are left, then 4. */
    const char *const *kn = next ? next->kp : NULL;
    int t = lo;
    for (; hi - t > 4; t += 16) scores(nr, cd, kvt, 16, (const vf (*)[MAXC])qv, sp->kp, kn, ko, t, hi - 1, sc);
    for (; t < hi; t += 4) scores(nr, cd, kvt, 4, (const vf (*)[MAXC])qv, sp->kp, kn, ko, t, hi - 1, sc);
    /* Per row: scale, mask (-inf outside [lo, hi)) and softcap the scores, and their maximum; the rows'
       maxima, rescale factors and sums are reduced together (lane j: row j). */
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf mx[RMAX];
    for (int j = 0; j < nr; j++) {
        float *row = sc + j * (MAXBS + W);
        mx[j] = vsplat(-INFINITY);
        for (int u = t_lo; u < t_hi; u += W) {
            vf x = vload(row + u);
            if (quant) {
                const vf s = vload(kscale + u);
                x = x * s + (s - s);  /* + NaN where a scale is NaN or infinite */
                if (offsets) x += vload(koff + u) * vsplat(qsum[j]);
            }
            const vi pos = lane + u;
            x = vselect((pos >= lo) & (pos < hi), x, vsplat(-INFINITY));
            if (softcap > 0.f) {
                for (int e = 0; e < W; e++)
                    if (u + e >= lo && u + e < hi) x[e] = softcap * tanhf(x[e] / softcap);
            }
            vstore(row + u, x);
            mx[j] = vmax(x, mx[j]);  /* a NaN score is not a maximum: it makes its weight NaN below */
        }
    }
    const vf bm = reduce4(mx[0], mx[nr > 1], mx[nr > 2 ? 2 : 0], mx[nr > 3 ? 3 : 0], 1);
    vf nm = vsplat(0.f), shift = vsplat(0.f);
    for (int j = 0; j < nr; j++) {
        nm[j] = bm[j] > m[j] ? bm[j] : m[j];
        shift[j] = m[j] == -INFINITY ? -INFINITY : m[j] - nm[j];
    }
    const vf alpha = vexp(shift);  /* 0 for a row that saw nothing yet */
    vf psum[RMAX], osv[RMAX];
    for (int j = 0; j < nr; j++) {
        float *row = sc + j * (MAXBS + W);
        psum[j] = osv[j] = vsplat(0.f);
        for (int u = t_lo; u < t_hi; u += W) {
            const vf p = vexp(vload(row + u) - vsplat(nm[j]));
            psum[j] += p;
            if (offsets) osv[j] += p * vload(voff + u);
            vstore(row + u, quant ? p * vload(vscale + u) : p);  /* the tokens' weights of V's payload */
        }
    }
    const vf sums = reduce4(psum[0], psum[nr > 1], psum[nr > 2 ? 2 : 0], psum[nr > 3 ? 3 : 0], 0);
    vf osum = vsplat(0.f);
    if (offsets) osum = reduce4(osv[0], osv[nr > 1], osv[nr > 2 ? 2 : 0], osv[nr > 3 ? 3 : 0], 0);
    for (int j = 0; j < nr; j++) {
        l[j] = l[j] * alpha[j] + sums[j];
        m[j] = nm[j];
    }
    vf o[RMAX][MAXC];
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < cv; c++) o[j][c] = vsplat(0.f);
    for (int u = lo; u < hi; u++) {
        const char *v = sp->vp[u] + vo;
        if (next)
            for (int c = 0; c < cv * W * es; c += 64) __builtin_prefetch(next->vp[u] + vo + c, 0, 1);
        vf p[RMAX];
        for (int j = 0; j < nr; j++) p[j] = vsplat(sc[j * (MAXBS + W) + u]);
        for (int c = 0; c < cv; c++) {
            const vf vv = load16(kvt, v + c * W * es);
            for (int j = 0; j < nr; j++) o[j][c] += p[j] * vv;
        }
    }
    for (int j = 0; j < nr; j++) {
        float *a = acc + (int64_t)j * Dv;
        const vf al = vsplat(alpha[j]), off = vsplat(osum[j]);
        for (int c = 0; c < cv; c++) vstore(a + c * W, vload(a + c * W) * al + (offsets ? o[j][c] + off : o[j][c]));
    }
}

/* One call's arguments (`hf_paged_attention`'s), in bytes where a pointer or stride is typed by `qt`/`kvt`. */
struct call {
    const char *q; int64_t q_st, q_sh; int qt;
    const char *kc, *vc; int64_t k_bst, v_bst, k_st, v_st;
    const float *ks, *vs; int64_t s_bst; int s_st, s_hst, s_ch;
    const int32_t *bt; int64_t bt_stride; const int32_t *seq_lens, *cu_q;
    int Hq, Hkv, D, Dv, BS;
    float scale; int window, chunk; float softcap;
    int nsplit, max_rows; float *part_ml, *part_acc;
};

/* Blocks [b0, b1) of the sequence whose block table is `table`: a line of every 4 KiB page their K, V
   (and scales) lie on, prefetched. `item` asks this for the span after next: a block is a few KiB at
   a random place in the pool, so its pages are new to the TLB, and a page walk met by the row
   prefetches one span ahead (or by the loads) left them waiting; done here, the walks overlap the
   work of two spans (int8 K/V on 4 KiB pages, 64 x 4k decode, one thread: about 10% faster). */
static inline void warm_pages(const struct call *a, const int32_t *table, int b0, int b1, int quant) {
    const int64_t kn = a->BS * a->k_st, vn = a->BS * a->v_st, sn = (int64_t)a->BS * a->s_st * 4;
    for (int b = b0; b < b1; b++) {
        const int64_t phys = table[b];
        const char *kb = a->kc + phys * a->k_bst, *vb = a->vc + phys * a->v_bst;
        for (int64_t off = 0; off < kn; off += 4096) __builtin_prefetch(kb + off, 0, 1);
        for (int64_t off = 0; off < vn; off += 4096) __builtin_prefetch(vb + off, 0, 1);
        __builtin_prefetch(kb + kn - 1, 0, 1);
        __builtin_prefetch(vb + vn - 1, 0, 1);
        if (quant) {
            __builtin_prefetch(a->ks + phys * a->s_bst, 0, 1);
            __builtin_prefetch(a->vs + phys * a->s_bst, 0, 1);
            __builtin_prefetch((const char *)(a->ks + phys * a->s_bst) + sn - 1, 0, 1);
            __builtin_prefetch((const char *)(a->vs + phys * a->s_bst) + sn - 1, 0, 1);
        }
    }
}

/* Span `sp`: tokens [t0, t0 + n) of the sequence whose block table is `table`, t0 a block's first. */
static inline void fill_span(struct span *sp, const struct call *a, const int32_t *table, int t0, int n, int quant) {
    sp->bs = a->BS;
    sp->s_st = a->s_st;
    for (int t = 0, b = 0; t < n; b++) {
        const int64_t phys = table[t0 / a->BS + b];
        const char *kb = a->kc + phys * a->k_bst, *vb = a->vc + phys * a->v_bst;
        if (quant) {
            sp->ks[b] = a->ks + phys * a->s_bst;
            sp->vs[b] = a->vs + phys * a->s_bst;
        }
        for (int r = 0; r < a->BS && t < n; r++, t++) {
            sp->kp[t] = kb + r * a->k_st;
            sp->vp[t] = vb + r * a->v_st;
        }
    }
}

#define ROWS(NR, CD, CV, J) rows(NR, CD, CV, kvt, a->qt, qrow + (hq + (J)) * a->q_sh, a->q_sh, cur, (J) ? NULL : next, \
                                 (int64_t)h * D * es, (int64_t)h * Dv * es, (int64_t)h * a->s_hst, a->s_ch, lo, hi, \
                                 scale, softcap, sc, m + r + (J), l + r + (J), acc + (int64_t)(r + (J)) * Dv, Dv)

/* Work item (sequence s, key split sp) over K/V of type `kvt` (a constant at each call site: one copy
   per type). Its keys are taken a span (MAXBS tokens, whole blocks) at a time, so a row's softmax
   bookkeeping is paid once per span rather than per block. */
static inline __attribute__((always_inline)) void item(const int kvt, const struct call *a, int s, int sp) {
    const int Hq = a->Hq, Hkv = a->Hkv, D = a->D, Dv = a->Dv, BS = a->BS, max_rows = a->max_rows;
    const int nsplit = a->nsplit, window = a->window, chunk = a->chunk, G = Hq / Hkv;
    const float scale = a->scale, softcap = a->softcap;
    const int es = dtype_size(kvt), quant = kvt >= DT_I8;
    const int q0 = a->cu_q[s], ql = a->cu_q[s + 1] - a->cu_q[s], L = a->seq_lens[s], R = ql * Hq;
    float *m = a->part_ml + ((int64_t)s * nsplit + sp) * 2 * max_rows, *l = m + max_rows;
    float *acc = a->part_acc + ((int64_t)s * nsplit + sp) * max_rows * Dv;
    for (int r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    for (int64_t e = 0; e < (int64_t)R * Dv; e++) acc[e] = 0.f;
    if (ql <= 0 || L < ql) return;
    const int first_pos = L - ql;
    int kstart = 0;
    if (window > 0) { kstart = first_pos - window + 1; if (kstart < 0) kstart = 0; }
    if (chunk > 0 && first_pos / chunk * chunk > kstart) kstart = first_pos / chunk * chunk;
    const int nblk = (L + BS - 1) / BS, b0 = kstart / BS;
    const int per = (nblk - b0 + nsplit - 1) / nsplit;
    const int bs = b0 + sp * per;
    const int be = bs + per < nblk ? bs + per : nblk;
    if (bs >= be) return;
    const int32_t *table = a->bt + (int64_t)s * a->bt_stride;
    /* Tokens [bs * BS, end) in spans of whole blocks, up to MAXBS tokens each; the next span's rows are
       prefetched a row at a time as this one's are read, so the memory system always has work and the
       core never waits on a burst of prefetches; its scales (a few lines per block) all at once. */
    const int span_len = MAXBS / BS * BS, end = be * BS < L ? be * BS : L;
    struct span spans[2];
    float sc[RMAX * (MAXBS + W)];
    fill_span(&spans[0], a, table, bs * BS, end - bs * BS < span_len ? end - bs * BS : span_len, quant);
    for (int t0 = bs * BS, which = 0; t0 < end; t0 += span_len, which ^= 1) {
        const int nt = end - t0 < span_len ? end - t0 : span_len;
        const struct span *cur = &spans[which], *ahead = NULL;
        if (t0 + nt < end) {
            const int nn = end - t0 - nt < span_len ? end - t0 - nt : span_len;
            fill_span(&spans[which ^ 1], a, table, t0 + nt, nn, quant);
            if (nn == nt) ahead = &spans[which ^ 1];  /* (a shorter last span: its rows are not prefetched) */
            const int w0 = t0 + 2 * span_len, w1 = t0 + 3 * span_len < end ? t0 + 3 * span_len : end;
            if (w0 < w1) warm_pages(a, table, w0 / BS, (w1 + BS - 1) / BS, quant);
            if (quant)
                for (int b = 0; b * BS < nn; b++)
                    for (int64_t off = 0; off < (int64_t)BS * a->s_st * 4; off += 64) {
                        __builtin_prefetch((const char *)spans[which ^ 1].ks[b] + off, 0, 1);
                        __builtin_prefetch((const char *)spans[which ^ 1].vs[b] + off, 0, 1);
                    }
        }
        for (int i = 0; i < ql; i++) {
            const int qp = first_pos + i;
            int lo = window > 0 ? qp - window + 1 - t0 : 0;
            if (chunk > 0 && qp / chunk * chunk - t0 > lo) lo = qp / chunk * chunk - t0;
            if (lo < 0) lo = 0;
            const int hi = qp + 1 - t0 < nt ? qp + 1 - t0 : nt;
            if (hi <= lo) continue;
            const char *qrow = a->q + (int64_t)(q0 + i) * a->q_st;
            for (int h = 0; h < Hkv; h++) {
                for (int g = 0; g < G; g += RMAX) {
                    const int n = G - g < RMAX ? G - g : RMAX, hq = h * G + g, r = i * Hq + hq;
                    /* each head's rows ahead are prefetched once: by the first query's first rows */
                    const struct span *next = i == 0 && g == 0 ? ahead : NULL;
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

/* One function per K/V type built (GCC compiles six of these faster than one six times their size). */
#define ITEM(NAME, KVT) \
    static __attribute__((noinline)) void NAME(const struct call *a, int s, int sp) { item(KVT, a, s, sp); }
#if KV_BUILT(DT_F32)
ITEM(item_f32, DT_F32)
#endif
#if KV_BUILT(DT_BF16)
ITEM(item_bf16, DT_BF16)
#endif
#if KV_BUILT(DT_F16)
ITEM(item_f16, DT_F16)
#endif
#if KV_BUILT(DT_I8)
ITEM(item_i8, DT_I8)
#endif
#if KV_BUILT(DT_E4M3)
ITEM(item_e4m3, DT_E4M3)
#endif
#if KV_BUILT(DT_E5M2)
ITEM(item_e5m2, DT_E5M2)
#endif

static void run_item(int kv_type, const struct call *a, int s, int sp) {
    switch (kv_type) {
#if KV_BUILT(DT_F32)
    case DT_F32: item_f32(a, s, sp); break;
#endif
#if KV_BUILT(DT_BF16)
    case DT_BF16: item_bf16(a, s, sp); break;
#endif
#if KV_BUILT(DT_F16)
    case DT_F16: item_f16(a, s, sp); break;
#endif
#if KV_BUILT(DT_I8)
    case DT_I8: item_i8(a, s, sp); break;
#endif
#if KV_BUILT(DT_E4M3)
    case DT_E4M3: item_e4m3(a, s, sp); break;
#endif
#if KV_BUILT(DT_E5M2)
    case DT_E5M2: item_e5m2(a, s, sp); break;
#endif
    default: break;
    }
}

/* Returns 0, or -1 for what it does not take (head widths not multiples of 16 or above 256, block
   sizes above 64, Hq not a multiple of Hkv, a block stride below a block, unknown dtype codes, a K/V
   type this build lacks, a quantised type without scales); the caller checks them first
   (`cpu_kernel.can_run`). */
int hf_paged_attention(
    const void *q, int64_t q_st, int64_t q_sh, int q_type,     /* [T, Hq, D], strides in elements, last 1 */
    const void *kc, const void *vc, int64_t k_bst, int64_t v_bst,  /* [NB, BS, Hkv, D], [NB, BS, Hkv, Dv]: block */
    int kv_type,                                                /* strides in elements, each block contiguous */
    const float *ks, const float *vs,                           /* quantised: [NB, BS, G, C] scales (G = Hkv or 1, */
    int64_t s_bst, int s_st, int s_hst, int s_ch,               /* C = 1 or 2); strides per block, token, head (0: */
                                                                /* one group), in floats; C; else NULL, ignored */
    const int32_t *bt, int64_t bt_stride,                       /* [S, max_blocks] */
    const int32_t *seq_lens, const int32_t *cu_q,               /* [S], [S + 1]: query run s is q[cu_q[s]:cu_q[s+1]] */
    int S, int Hq, int Hkv, int D, int Dv, int BS,
    float scale, int window, int chunk,                         /* window, chunk <= 0: none */
    float softcap, const float *sinks,                          /* softcap <= 0: none; sinks [Hq] fp32 or NULL */
    int nsplit, int max_rows,                                   /* key splits per sequence; >= every q_len * Hq */
    float *part_ml, float *part_acc,                            /* scratch: [S, nsplit, 2, max_rows], */
                                                                /* [S, nsplit, max_rows, Dv] */
    void *out, int out_type, int nthreads)                      /* [T, Hq, Dv] contiguous, of out_type */
{
    if (D % W || Dv % W || D > MAXC * W || Dv > MAXC * W || BS < 1 || BS > MAXBS || Hkv < 1 || Hq % Hkv || nsplit < 1)
        return -1;
    if (q_type < DT_F32 || q_type > DT_F16 || out_type < DT_F32 || out_type > DT_F16 || kv_type < DT_F32
        || kv_type > DT_E5M2 || !KV_BUILT(kv_type) || k_bst < (int64_t)BS * Hkv * D || v_bst < (int64_t)BS * Hkv * Dv)
        return -1;
    if (kv_type >= DT_I8
        && (!ks || !vs || s_ch < 1 || s_ch > 2 || s_st < s_ch || s_hst < 0 || s_bst < (int64_t)BS * s_st))
        return -1;
    const int es = dtype_size(kv_type), qes = dtype_size(q_type), oes = dtype_size(out_type);
    const struct call a = {
        (const char *)q, q_st * qes, q_sh * qes, q_type,
        (const char *)kc, (const char *)vc, k_bst * es, v_bst * es, (int64_t)Hkv * D * es, (int64_t)Hkv * Dv * es,
        ks, vs, s_bst, s_st, s_hst, s_ch,
        bt, bt_stride, seq_lens, cu_q,
        Hq, Hkv, D, Dv, BS, scale, window, chunk, softcap, nsplit, max_rows, part_ml, part_acc,
    };
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int s = 0; s < S; s++)
    for (int sp = 0; sp < nsplit; sp++) run_item(kv_type, &a, s, sp);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int s = 0; s < S; s++) {
        const int q0 = cu_q[s], ql = cu_q[s + 1] - cu_q[s];
        float row[MAXC * W];
        for (int r = 0; r < ql * Hq; r++) {
            const int hq = r % Hq;
            float M = -INFINITY;
            for (int sp = 0; sp < nsplit; sp++) {
                const float mm = part_ml[((int64_t)s * nsplit + sp) * 2 * max_rows + r];
                M = mm > M ? mm : M;
            }
            if (sinks && sinks[hq] > M) M = sinks[hq];
            float den = sinks ? expf(sinks[hq] - M) : 0.f;
            float *dst = out_type == DT_F32 ? (float *)out + ((int64_t)q0 * Hq + r) * Dv : row;
            for (int e = 0; e < Dv; e++) dst[e] = 0.f;
            for (int sp = 0; sp < nsplit; sp++) {
                const float *mp = part_ml + ((int64_t)s * nsplit + sp) * 2 * max_rows;
                if (mp[r] == -INFINITY && mp[max_rows + r] == 0.f) continue;  /* nothing seen (a NaN is merged) */
                const float w = expf(mp[r] - M);
                den += mp[max_rows + r] * w;
                const float *acc = part_acc + (((int64_t)s * nsplit + sp) * max_rows + r) * Dv;
                for (int e = 0; e < Dv; e += W) vstore(dst + e, vload(dst + e) + vsplat(w) * vload(acc + e));
            }
            const vf inv = vsplat(den > 0.f ? 1.f / den : 0.f);
            char *o = (char *)out + ((int64_t)q0 * Hq + r) * Dv * oes;
            for (int e = 0; e < Dv; e += W) store16(out_type, o + e * oes, vload(dst + e) * inv);
        }
    }
    return 0;
}

/* The fp32 entry (fp32 queries, output and contiguous K/V: `hf_paged_attention`'s first case, with
   fewer arguments for ctypes to convert per call). */
int hf_paged_attention_f32(
    const float *q, int64_t q_st, int64_t q_sh, const float *kc, const float *vc, const int32_t *bt,
    int64_t bt_stride, const int32_t *seq_lens, const int32_t *cu_q, int S, int Hq, int Hkv, int D, int Dv, int BS,
    float scale, int window, int chunk, float softcap, const float *sinks, int nsplit, int max_rows,
    float *part_ml, float *part_acc, float *out, int nthreads)
{
    return hf_paged_attention(q, q_st, q_sh, DT_F32, kc, vc, (int64_t)BS * Hkv * D, (int64_t)BS * Hkv * Dv, DT_F32,
                              NULL, NULL, 0, 0, 0, 0, bt, bt_stride, seq_lens, cu_q, S, Hq, Hkv, D, Dv, BS, scale,
                              window, chunk, softcap, sinks, nsplit, max_rows, part_ml, part_acc, out, DT_F32,
                              nthreads);
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
