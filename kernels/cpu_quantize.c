/* The three passes of the int8 two-phase allreduce on the CPU (warmup_bits=8).
 *
 * Same operations in the same order as the torch reference (onebit_plugin/wire/quantize.py), so
 * the results are equal bit for bit: the block's largest |x| (a NaN or an infinity makes the
 * block "bad": scale NaN, q = 0), inv = 127 / max (0 where that overflows), y = x * inv, the
 * integer by adding and subtracting 1.5 * 2**23 (round half to even), scale = max / 127; the
 * owner sums the senders' q * scale in rank order and divides by W. Built without fused
 * multiply-add (-ffp-contract=off) and without -ffast-math, which would fold the rounding
 * trick away and reorder the sums. One block at a time, blocks split across OpenMP threads
 * when `threads` > 1.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const float QMAX = 127.0f, ROUNDER = 12582912.0f;

static int quantize_threads(int threads, int64_t blocks) {
    if (threads < 1) threads = 1;
    return blocks < threads ? (int)(blocks > 0 ? blocks : 1) : threads;
}

static void quantize_block(const float *restrict x, int64_t block, int8_t *restrict q,
                           float *restrict scale) {
    /* LANES independent maxima in one vector (GCC's vector extension), so that the loop runs
     * as vector compares without reordering anything that rounds (max is exact in any order):
     * `a > m ? a : m` skips a NaN (the comparison is false) and takes an infinity; a NaN is
     * counted apart (a != a). Either makes the block bad. A single running maximum is a
     * dependency chain that gcc 12 leaves scalar, and a plain array of lanes it reloads from
     * memory every round: both were 5x slower than the quantize loop below. */
    enum { LANES = 16 };
    typedef float lanes_f __attribute__((vector_size(LANES * sizeof(float))));
    typedef int32_t lanes_i __attribute__((vector_size(LANES * sizeof(int32_t))));
    lanes_f lane_max = {0.0f};
    lanes_i lane_nan = {0}, abs_mask;
    for (int j = 0; j < LANES; j++) abs_mask[j] = INT32_MAX;
    int64_t body = block - block % LANES;
    for (int64_t i = 0; i < body; i += LANES) {
        lanes_f v;
        memcpy(&v, x + i, sizeof v);
        lanes_f a = (lanes_f)((lanes_i)v & abs_mask);
        lanes_i bigger = a > lane_max;
        lane_max = (lanes_f)(((lanes_i)a & bigger) | ((lanes_i)lane_max & ~bigger));
        lane_nan |= a != a;
    }
    float m = 0.0f;
    int nan = 0;
    for (int j = 0; j < LANES; j++) {
        m = lane_max[j] > m ? lane_max[j] : m;
        nan |= lane_nan[j] != 0;
    }
    for (int64_t i = body; i < block; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
        nan |= a != a;
    }
    if (nan || !(m <= FLT_MAX)) {
        memset(q, 0, (size_t)block);
        *scale = NAN;
        return;
    }
    float inv = QMAX / m;
    if (!(inv <= FLT_MAX)) inv = 0.0f; /* m == 0, or so small that 127 / m overflows */
    for (int64_t i = 0; i < block; i++) {
        float y = x[i] * inv;
        float r = (y + ROUNDER) - ROUNDER;
        r = r > QMAX ? QMAX : (r < -QMAX ? -QMAX : r);
        q[i] = (int8_t)r;
    }
    *scale = m / QMAX;
}

/* x[0..blocks*block) to q and one scale per block. */
void onebit_quantize(const float *x, int8_t *q, float *scales, int64_t blocks, int64_t block,
                     int threads) {
#pragma omp parallel for num_threads(quantize_threads(threads, blocks)) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        quantize_block(x + b * block, block, q + b * block, scales + b);
}

/* The owner's pass: recv_q holds `world` rows of a chunk of `per` blocks, recv_scales their
 * scales; the decoded rows summed in rank order, divided by world, quantized into q/scales.
 * Returns -1 when the scratch cannot be had. */
int onebit_average_quantize(const int8_t *recv_q, const float *recv_scales, int64_t world,
                            int64_t per, int64_t block, int8_t *q, float *scales, int threads) {
    int failed = 0;
    int64_t chunk = per * block;
#pragma omp parallel num_threads(quantize_threads(threads, per)) reduction(| : failed)
    {
        float *total = malloc((size_t)block * sizeof(float));
        if (total == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < per; b++) {
            if (total == NULL) continue;
            for (int64_t i = 0; i < block; i++) total[i] = 0.0f;
            for (int64_t k = 0; k < world; k++) {
                const int8_t *restrict row = recv_q + k * chunk + b * block;
                float s = recv_scales[k * per + b];
                for (int64_t i = 0; i < block; i++) total[i] += (float)row[i] * s;
            }
            float w = (float)world;
            for (int64_t i = 0; i < block; i++) total[i] = total[i] / w;
            quantize_block(total, block, q + b * block, scales + b);
        }
        free(total);
    }
    return failed ? -1 : 0;
}

/* out[0..blocks*block) = q * the scale of its block. */
void onebit_dequantize(const int8_t *q, const float *scales, float *out, int64_t blocks,
                       int64_t block, int threads) {
#pragma omp parallel for num_threads(quantize_threads(threads, blocks)) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float s = scales[b];
        const int8_t *restrict qb = q + b * block;
        float *restrict ob = out + b * block;
        for (int64_t i = 0; i < block; i++) ob[i] = (float)qb[i] * s;
    }
}
