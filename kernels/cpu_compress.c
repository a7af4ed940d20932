/* The three passes of the compressed allreduce on the CPU, one pass over the data each.
 *
 * Same operations in the same order as the torch reference (onebit_plugin/compression.py), so
 * the results are equal bit for bit: c*c (or |c|) rounded to fp32, the block sum by halving the
 * zero-padded power-of-two tile, fp32 division by the count, the RMS root correctly rounded
 * (sqrt in fp64), bit i of byte k = value 8k+i >= 0. Built without fused multiply-add
 * (-ffp-contract=off) and without -ffast-math, which would reorder the sums.
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

/* Worker pass: c = (x + err) where kept, else 0; x has n values (fp32, or bf16 when x_bf16),
 * err and keep blocks * block. Returns 0, or -1 when scratch could not be allocated. */
int onebit_worker_compress(const void *x, int x_bf16, int64_t n, float *err, const uint8_t *keep,
                           const float *counts, uint8_t *packed, float *scales, int64_t blocks,
                           int64_t block, int64_t tile, int rms, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(pick_threads(threads, blocks)) reduction(| : failed)
    {
        float *c = malloc(sizeof(float) * (size_t)(block + tile));
        if (c == NULL) {
            failed = 1;
        } else {
            float *terms = c + block;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                int64_t start = b * block;
                int64_t inside = n - start < block ? (n - start > 0 ? n - start : 0) : block;
                const uint8_t *restrict kb = keep + start;
                float *restrict eb = err + start;
                /* Loads outside the selects, so that the loops vectorise. */
                if (x_bf16) {
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

/* Final decode into fp32 out[0..n): +-scale where kept, else 0. */
void onebit_decompress(const uint8_t *packed, const float *scales, const uint8_t *keep,
                       float *out, int64_t n, int64_t blocks, int64_t block, int threads) {
    init_signs();
#pragma omp parallel for num_threads(pick_threads(threads, blocks)) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float s = scales[b];
        int64_t start = b * block;
        int64_t end = start + block < n ? start + block : n;
        int64_t at = start;
#ifdef __AVX2__
        /* Bit i of the byte to lane i, +-s by a blend, masked lanes to +0.0 by an and. */
        const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
        for (; at + 8 <= end; at += 8) {
            __m256i bits = _mm256_and_si256(_mm256_set1_epi32(packed[at / 8]), lane_bit);
            __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane_bit));
            __m256 d = _mm256_blendv_ps(neg, pos, set);
            int64_t k8;
            memcpy(&k8, keep + at, sizeof k8);
            __m256i kept = _mm256_cmpgt_epi32(
                _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(k8)), _mm256_setzero_si256());
            _mm256_storeu_ps(out + at, _mm256_and_ps(d, _mm256_castsi256_ps(kept)));
        }
#endif
        for (; at + 8 <= end; at += 8) {
            const float *restrict sign = SIGNS[packed[at / 8]];
            const uint8_t *restrict kb = keep + at;
            float *restrict o = out + at;
            for (int i = 0; i < 8; i++) {
                float d = sign[i] * s;
                o[i] = kb[i] ? d : 0.0f;
            }
        }
        for (; at < end; at++) {
            float d = (packed[at / 8] >> (at % 8)) & 1u ? s : -s;
            out[at] = keep[at] ? d : 0.0f;
        }
    }
}
