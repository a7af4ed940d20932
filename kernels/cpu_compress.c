/* The three passes of the compressed allreduce on the CPU, one pass over the data each.
 *
 * Same operations in the same order as the torch reference (onebit_plugin/compression.py), so
 * the results are equal bit for bit: c*c (or |c|) rounded to fp32, the block sum by halving the
 * zero-padded power-of-two tile, fp32 division by the count, the RMS root correctly rounded
 * (sqrt in fp64), bit i of byte k = value 8k+i >= 0. Built without fused multiply-add
 * (-ffp-contract=off) and without -ffast-math, which would reorder the sums; the one place
 * that fuses, the fold of a gradient into the momentum, calls fmaf explicitly, as torch's
 * lerp rounds (fold_part below).
 *
 * One block at a time: its values and terms stay in a per-thread scratch of `tile` floats
 * (at most 128 KiB), so each value is read and written once. Blocks are split across OpenMP
 * threads when `threads` > 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* SIGNS[byte][i]: +1 where bit i of byte is set, else -1. Decoding is then a multiply by the
 * scale, exact (+-scale), and a loop of 8 that compilers vectorise. */
static float SIGNS[256][8];
static int signs_ready;

static void init_signs(void) {
    if (signs_ready) return;
    for (int b = 0; b < 256; b++)
        for (int i = 0; i < 8; i++) SIGNS[b][i] = (b >> i) & 1 ? 1.0f : -1.0f;
    signs_ready = 1;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The reference's block sum of terms[0..block): padded with zeros to `tile` (a power of two,
 * tile / 2 <= block), the upper half added onto the lower half until one value is left.
 * Overwrites terms. */
static float tree_sum(float *restrict terms, int64_t block, int64_t tile) {
    int64_t half = tile / 2;
    for (int64_t i = 0; i < block - half; i++) terms[i] += terms[i + half];
    while (half > 1) {
        half /= 2;
        for (int64_t i = 0; i < half; i++) terms[i] += terms[i + half];
    }
    return terms[0];
}

/* terms = c*c (rms) or |c|, then the scale: sum / count in fp32, the root correctly rounded. */
static float block_scale(const float *restrict c, float *restrict terms, int64_t block,
                         int64_t tile, float count, int rms) {
    if (rms)
        for (int64_t i = 0; i < block; i++) terms[i] = c[i] * c[i];
    else
        for (int64_t i = 0; i < block; i++) terms[i] = fabsf(c[i]);
    float mean = tree_sum(terms, block, tile) / count;
    return rms ? (float)sqrt((double)mean) : mean;
}

/* Byte k of packed: bit i set where c[8k+i] >= 0 (so -0.0 too); err = c - decode, 0 where
 * masked. One loop over the block's bytes. */
static void encode(const float *restrict c, const uint8_t *restrict keep, float scale,
                   int64_t block, uint8_t *restrict packed, float *restrict err) {
    int64_t k = 0;
#ifdef __AVX2__
    const __m256 zero = _mm256_setzero_ps();
    const __m256 pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
    for (; k < block / 8; k++) {
        __m256 v = _mm256_loadu_ps(c + 8 * k);
        __m256 ge = _mm256_cmp_ps(v, zero, _CMP_GE_OQ);
        packed[k] = (uint8_t)_mm256_movemask_ps(ge);
        __m256 left = _mm256_sub_ps(v, _mm256_blendv_ps(neg, pos, ge));
        int64_t k8;
        memcpy(&k8, keep + 8 * k, sizeof k8);
        __m256i kept = _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(k8)),
                                          _mm256_setzero_si256());
        _mm256_storeu_ps(err + 8 * k, _mm256_and_ps(left, _mm256_castsi256_ps(kept)));
    }
#endif
    for (; k < block / 8; k++) {
        unsigned byte = 0;
        for (int i = 0; i < 8; i++) {
            float v = c[8 * k + i];
            byte |= (unsigned)(v >= 0.0f) << i;
            float left = v - (v >= 0.0f ? scale : -scale);
            err[8 * k + i] = keep[8 * k + i] ? left : 0.0f;
        }
        packed[k] = (uint8_t)byte;
    }
}

/* +-s per bit of bytes[0..nbytes) into out (add: onto out), in rank order as the reference. */
static void decode_add(const uint8_t *restrict bytes, float s, int64_t nbytes,
                       float *restrict out, int add) {
    int64_t j = 0;
#ifdef __AVX2__
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
    for (; j < nbytes; j++) {
        __m256i bits = _mm256_and_si256(_mm256_set1_epi32(bytes[j]), lane_bit);
        __m256 d = _mm256_blendv_ps(
            neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane_bit)));
        if (add) d = _mm256_add_ps(_mm256_loadu_ps(out + 8 * j), d);
        _mm256_storeu_ps(out + 8 * j, d);
    }
#endif
    for (; j < nbytes; j++) {
        const float *restrict sign = SIGNS[bytes[j]];
        for (int i = 0; i < 8; i++) {
            float d = sign[i] * s;
            out[8 * j + i] = add ? out[8 * j + i] + d : d;
        }
    }
}

static int pick_threads(int threads, int64_t blocks) {
    if (threads < 1) threads = 1;
    return blocks < threads ? (int)(blocks > 0 ? blocks : 1) : threads;
}

/* A momentum unit's fold, described (onebit_plugin.update.Fold): parameter k holds values
 * [offsets[k], offsets[k+1]) of the unit; its gradient grads[k] (NULL: none; bf16 where
 * bf16[k]), its fp32 parameter params[k] (read for coupled weight decay only), and hypers[3k..]
 * = beta1, 1 - beta1, coupled weight decay. */
typedef struct {
    const float *momentum;
    const int64_t *offsets;
    int64_t parts;
    const int64_t *grads, *params;
    const int32_t *bf16;
    const double *hypers;
} fold_table;

/* c[0..len) = the fold of values [at, at + len) of part k: torch.lerp(m, g + wd * p, 1 - b1)
 * with torch's rounding on a CPU with FMA (its AVX2, AVX-512 and NEON kernels round lerp and
 * add(alpha=) once each: fma(wd, p, g), then fma(w, g' - m, m) for w < 0.5, else
 * fma(w - 1, g' - m, g')); no gradient: m * b1. The fmaf calls are explicit; -ffp-contract=off
 * fuses nothing else. */
static void fold_part(const fold_table *t, int64_t k, int64_t at, int64_t len, float *restrict c,
                      float *restrict g32) {
    const float *restrict m = t->momentum + at;
    const double *h = t->hypers + 3 * k;
    const float b = (float)h[0], w = (float)h[1], a = (float)h[2];
    int64_t from = at - t->offsets[k];
    if (t->grads[k] == 0) {
        for (int64_t i = 0; i < len; i++) c[i] = m[i] * b;
        return;
    }
    const float *g = (const float *)(intptr_t)t->grads[k] + from;
    if (t->bf16[k]) {
        const uint16_t *restrict gb = (const uint16_t *)(intptr_t)t->grads[k] + from;
        for (int64_t i = 0; i < len; i++) g32[i] = bf16_to_float(gb[i]);
        g = g32;
    }
    if (a != 0.0f) {
        const float *restrict p = (const float *)(intptr_t)t->params[k] + from;
        for (int64_t i = 0; i < len; i++) g32[i] = fmaf(p[i], a, g[i]);
        g = g32;
    }
    if (fabsf(w) < 0.5f)
        for (int64_t i = 0; i < len; i++) c[i] = fmaf(w, g[i] - m[i], m[i]);
    else
        for (int64_t i = 0; i < len; i++) c[i] = fmaf(w - 1.0f, g[i] - m[i], g[i]);
}

/* c[0..len) = the fold of the unit's values [start, start + len), part by part. */
static void fold_values(const fold_table *t, int64_t start, int64_t len, float *restrict c,
                        float *restrict g32) {
    int64_t lo = 0, hi = t->parts - 1; /* the last part starting at or before start */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (t->offsets[mid] <= start) lo = mid; else hi = mid - 1;
    }
    for (int64_t k = lo, at = start, end = start + len; at < end; k++) {
        int64_t stop = t->offsets[k + 1] < end ? t->offsets[k + 1] : end;
        if (stop > at) fold_part(t, k, at, stop - at, c + (at - start), g32 + (at - start));
        at = stop > at ? stop : at;
    }
}

/* Worker pass: c = (x + err) where kept, else 0; x has n values (fp32, or bf16 when x_bf16),
 * or with fold != NULL is the fold of the unit's gradients, computed here (x unused): the
 * local momentum is never written, and each of its inputs read once. err and keep hold
 * blocks * block values. Returns 0, or -1 when scratch could not be allocated. */
static int worker_pass(const void *x, int x_bf16, const fold_table *fold, int64_t n, float *err,
                       const uint8_t *keep, const float *counts, uint8_t *packed, float *scales,
                       int64_t blocks, int64_t block, int64_t tile, int rms, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(pick_threads(threads, blocks)) reduction(| : failed)
    {
        float *c = malloc(sizeof(float) * (size_t)(2 * block + tile));
        if (c == NULL) {
            failed = 1;
        } else {
            float *terms = c + block, *g32 = terms + tile;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                int64_t start = b * block;
                int64_t inside = n - start < block ? (n - start > 0 ? n - start : 0) : block;
                const uint8_t *restrict kb = keep + start;
                float *restrict eb = err + start;
                /* Loads outside the selects, so that the loops vectorise. */
                if (fold != NULL) {
                    fold_values(fold, start, inside, c, g32);
                    for (int64_t i = 0; i < inside; i++) {
                        float v = eb[i] + c[i];
                        c[i] = kb[i] ? v : 0.0f;
                    }
                } else if (x_bf16) {
                    const uint16_t *restrict xb = (const uint16_t *)x + start;
                    for (int64_t i = 0; i < inside; i++) {
                        float v = eb[i] + bf16_to_float(xb[i]);
                        c[i] = kb[i] ? v : 0.0f;
                    }
                } else {
                    const float *restrict xf = (const float *)x + start;
                    for (int64_t i = 0; i < inside; i++) {
                        float v = eb[i] + xf[i];
                        c[i] = kb[i] ? v : 0.0f;
                    }
                }
                for (int64_t i = inside; i < block; i++) {
                    float v = eb[i];
                    c[i] = kb[i] ? v : 0.0f;
                }
                float scale = block_scale(c, terms, block, tile, counts[b], rms);
                scales[b] = scale;
                encode(c, kb, scale, block, packed + start / 8, eb);
            }
            free(c);
        }
    }
    return failed ? -1 : 0;
}

int onebit_worker_compress(const void *x, int x_bf16, int64_t n, float *err, const uint8_t *keep,
                           const float *counts, uint8_t *packed, float *scales, int64_t blocks,
                           int64_t block, int64_t tile, int rms, int threads) {
    return worker_pass(x, x_bf16, NULL, n, err, keep, counts, packed, scales, blocks, block, tile,
                       rms, threads);
}

/* The worker pass over a momentum unit's fold (fold_table above): offsets has parts + 1
 * entries, the last = n. */
int onebit_worker_compress_fold(const float *momentum, const int64_t *offsets, int64_t parts,
                                const int64_t *grads, const int32_t *bf16, const int64_t *params,
                                const double *hypers, int64_t n, float *err, const uint8_t *keep,
                                const float *counts, uint8_t *packed, float *scales,
                                int64_t blocks, int64_t block, int64_t tile, int rms,
                                int threads) {
    fold_table t = {momentum, offsets, parts, grads, params, bf16, hypers};
    return worker_pass(NULL, 0, &t, n, err, keep, counts, packed, scales, blocks, block, tile,
                       rms, threads);
}

/* Server pass over one chunk of blocks_per_chunk blocks: decode the world senders' copies
 * (row k of recv_packed / recv_scales), sum them in rank order, divide by world, add to err
 * where kept, and compress again. */
int onebit_server_compress(const uint8_t *recv_packed, const float *recv_scales, float *err,
                           const uint8_t *keep, const float *counts, uint8_t *packed,
                           float *scales, int64_t world, int64_t blocks_per_chunk, int64_t block,
                           int64_t tile, int rms, int threads) {
    init_signs();
    int failed = 0;
    int64_t chunk_bytes = blocks_per_chunk * (block / 8);
#pragma omp parallel num_threads(pick_threads(threads, blocks_per_chunk)) reduction(| : failed)
    {
        float *c = malloc(sizeof(float) * (size_t)(block + tile));
        if (c == NULL) {
            failed = 1;
        } else {
            float *terms = c + block;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks_per_chunk; b++) {
                int64_t start = b * block;
                for (int64_t k = 0; k < world; k++) {
                    const uint8_t *bytes = recv_packed + k * chunk_bytes + start / 8;
                    float s = recv_scales[k * blocks_per_chunk + b];
                    decode_add(bytes, s, block / 8, c, k > 0);
                }
                const uint8_t *restrict kb = keep + start;
                float *restrict eb = err + start;
                float w = (float)world;
                for (int64_t i = 0; i < block; i++) {
                    float mean = c[i] / w;
                    c[i] = eb[i] + (kb[i] ? mean : 0.0f);
                }
                float scale = block_scale(c, terms, block, tile, counts[b], rms);
                scales[b] = scale;
                encode(c, kb, scale, block, packed + start / 8, eb);
            }
            free(c);
        }
    }
    return failed ? -1 : 0;
}

/* Decode of values [g0, g0 + n) of the layout into out[0..n): +-scale of the value's block
 * where kept, else +0.0. The final decode and the update's pass (cpu_update.c) share it. */
void onebit_decode_range(const uint8_t *restrict packed, const float *restrict scales,
                         const uint8_t *restrict keep, float *restrict out, int64_t g0,
                         int64_t n, int64_t block) {
    init_signs();
    int64_t g = g0, end = g0 + n;
    while (g < end) {
        int64_t b = g / block;
        float s = scales[b];
        int64_t stop = (b + 1) * block < end ? (b + 1) * block : end;
        for (; g < stop && (g & 7); g++) { /* up to a byte boundary (blocks start on one) */
            float d = (packed[g >> 3] >> (g & 7)) & 1u ? s : -s;
            out[g - g0] = keep[g] ? d : 0.0f;
        }
#ifdef __AVX2__
        /* Bit i of the byte to lane i, +-s by a blend, masked lanes to +0.0 by an and. */
        const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
        for (; g + 8 <= stop; g += 8) {
            __m256i bits = _mm256_and_si256(_mm256_set1_epi32(packed[g >> 3]), lane_bit);
            __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane_bit));
            __m256 d = _mm256_blendv_ps(neg, pos, set);
            int64_t k8;
            memcpy(&k8, keep + g, sizeof k8);
            __m256i kept = _mm256_cmpgt_epi32(
                _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(k8)), _mm256_setzero_si256());
            _mm256_storeu_ps(out + (g - g0), _mm256_and_ps(d, _mm256_castsi256_ps(kept)));
        }
#endif
        for (; g + 8 <= stop; g += 8) {
            const float *restrict sign = SIGNS[packed[g >> 3]];
            const uint8_t *restrict kb = keep + g;
            float *restrict o = out + (g - g0);
            for (int i = 0; i < 8; i++) {
                float d = sign[i] * s;
                o[i] = kb[i] ? d : 0.0f;
            }
        }
        for (; g < stop; g++) {
            float d = (packed[g >> 3] >> (g & 7)) & 1u ? s : -s;
            out[g - g0] = keep[g] ? d : 0.0f;
        }
    }
}

/* Final decode into fp32 out[0..n): +-scale where kept, else 0. */
void onebit_decompress(const uint8_t *packed, const float *scales, const uint8_t *keep,
                       float *out, int64_t n, int64_t blocks, int64_t block, int threads) {
    init_signs(); /* before the threads: it writes the table */
#pragma omp parallel for num_threads(pick_threads(threads, blocks)) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * block;
        if (start < n)
            onebit_decode_range(packed, scales, keep, out + start, start,
                                start + block < n ? block : n - start, block);
    }
}
