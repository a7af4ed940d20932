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

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The reference's block sum of terms[0..block): padded with zeros to `tile` (a power of two,
 * tile / 2 <= block), the upper half added onto the lower half until one value is left.
 * Overwrites terms. */
static float tree_sum(float *terms, int64_t block, int64_t tile) {
    int64_t half = tile / 2;
    for (int64_t i = 0; i < block - half; i++) terms[i] += terms[i + half];
    while (half > 1) {
        half /= 2;
        for (int64_t i = 0; i < half; i++) terms[i] += terms[i + half];
    }
    return terms[0];
}

static float block_scale(float *terms, int64_t block, int64_t tile, float count, int rms) {
    float mean = tree_sum(terms, block, tile) / count;
    return rms ? (float)sqrt((double)mean) : mean;
}

/* Signs of c[0..block) into packed, the block's scale, and the new error c - decode (0 where
 * masked) into err. */
static void encode(const float *c, const uint8_t *keep, float scale, int64_t block,
                   uint8_t *packed, float *err) {
    for (int64_t k = 0; k < block / 8; k++) {
        unsigned byte = 0;
        for (int i = 0; i < 8; i++) byte |= (unsigned)(c[8 * k + i] >= 0.0f) << i;
        packed[k] = (uint8_t)byte;
    }
    for (int64_t i = 0; i < block; i++) {
        float decoded = c[i] >= 0.0f ? scale : -scale;
        err[i] = keep[i] ? c[i] - decoded : 0.0f;
    }
}

static int pick_threads(int threads, int64_t blocks) {
    if (threads < 1) threads = 1;
    return blocks < threads ? (int)(blocks > 0 ? blocks : 1) : threads;
}

/* Worker pass: c = (x + err) where kept, else 0; x has n values (dtype 0: fp32, 1: bf16), err
 * and keep blocks * block. Returns 0, or -1 when scratch could not be allocated. */
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
                const uint8_t *kb = keep + start;
                float *eb = err + start;
                for (int64_t i = 0; i < block; i++) {
                    int64_t at = start + i;
                    float xv = 0.0f;
                    if (at < n)
                        xv = x_bf16 ? bf16_to_float(((const uint16_t *)x)[at])
                                    : ((const float *)x)[at];
                    float v = kb[i] ? eb[i] + xv : 0.0f;
                    c[i] = v;
                    terms[i] = rms ? v * v : fabsf(v);
                }
                float scale = block_scale(terms, block, tile, counts[b], rms);
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
                    for (int64_t j = 0; j < block / 8; j++) {
                        unsigned byte = bytes[j];
                        for (int i = 0; i < 8; i++) {
                            float d = (byte >> i) & 1u ? s : -s;
                            c[8 * j + i] = k == 0 ? d : c[8 * j + i] + d;
                        }
                    }
                }
                const uint8_t *kb = keep + start;
                float *eb = err + start;
                float w = (float)world;
                for (int64_t i = 0; i < block; i++) {
                    float v = eb[i] + (kb[i] ? c[i] / w : 0.0f);
                    c[i] = v;
                    terms[i] = rms ? v * v : fabsf(v);
                }
                float scale = block_scale(terms, block, tile, counts[b], rms);
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
#pragma omp parallel for num_threads(pick_threads(threads, blocks)) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float s = scales[b];
        int64_t start = b * block;
        int64_t end = start + block < n ? start + block : n;
        for (int64_t at = start; at < end; at++) {
            float d = (packed[at / 8] >> (at % 8)) & 1u ? s : -s;
            out[at] = keep[at] ? d : 0.0f;
        }
    }
}
