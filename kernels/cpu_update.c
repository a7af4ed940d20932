/* The compression stage's parameter update on the CPU, one pass over each parameter.
 *
 * The torch passes of onebit_plugin.update.frozen_update_ do, one operation each over the
 * whole tensor: m_state = m (the averaged momentum becomes the optimizer's), p *= decay
 * (decoupled weight decay), r = m / d, r = clamp(r, -bound, bound) (bounded steps), r *= scale,
 * p += r: six reads and five writes of the tensor's size. Here each value is read once (p, m,
 * d) and written once (p, m_state), with the same fp32 operations in the same order, each
 * rounded once: built without fused multiply-add (-ffp-contract=off), the results are the
 * torch passes' bit for bit. The clamp keeps NaN, as torch's does. The multipliers arrive as
 * doubles and are rounded to fp32 here, as torch rounds a Python scalar for an fp32 tensor.
 * A parameter group's parameters go in one call (onebit_frozen_update_many).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* One loop per case, each simple enough to vectorise: the compiler specialises the inline
 * body for the constant flags. */
static inline void update_range(float *restrict p, const float *restrict m,
                                const float *restrict d, float *restrict m_state, int64_t n,
                                float k, float s, float lo, float hi, int bounded, int decays,
                                int copies) {
    for (int64_t i = 0; i < n; i++) {
        float r = m[i] / d[i];
        if (bounded) {
            r = r < lo ? lo : r;
            r = r > hi ? hi : r;
        }
        float x = decays ? p[i] * k : p[i];
        p[i] = x + r * s;
        if (copies) m_state[i] = m[i];
    }
}

static void update_cases(float *restrict p, const float *restrict m, const float *restrict d,
                         float *restrict m_state, int64_t n, float k, float s, float lo,
                         float hi, int bounded, int decays) {
    const int copies = m_state != NULL;
    if (bounded && decays && copies)
        update_range(p, m, d, m_state, n, k, s, lo, hi, 1, 1, 1);
    else if (bounded && decays)
        update_range(p, m, d, m_state, n, k, s, lo, hi, 1, 1, 0);
    else if (bounded && copies)
        update_range(p, m, d, m_state, n, k, s, lo, hi, 1, 0, 1);
    else if (bounded)
        update_range(p, m, d, m_state, n, k, s, lo, hi, 1, 0, 0);
    else if (decays && copies)
        update_range(p, m, d, m_state, n, k, s, lo, hi, 0, 1, 1);
    else if (decays)
        update_range(p, m, d, m_state, n, k, s, lo, hi, 0, 1, 0);
    else if (copies)
        update_range(p, m, d, m_state, n, k, s, lo, hi, 0, 0, 1);
    else
        update_range(p, m, d, m_state, n, k, s, lo, hi, 0, 0, 0);
}

void onebit_decode_range(const uint8_t *packed, const float *scales, const uint8_t *keep,
                         float *out, int64_t g0, int64_t n, int64_t block); /* cpu_compress.c */

/* Values per turn of the update below: 16 KiB of fp32, which stays in L1 (the decoded
 * average's buffer), and the unit the threads share the work in. */
#define TILE 4096

/* One row of the table below: what the update of one parameter reads and writes. */
enum { P, M, D, M_STATE, N, PACKED, SCALES, KEEP, OFFSET, BLOCK, COLUMNS };
/* Its multipliers: scale, bound, bounded (0 or 1). */
enum { SCALE, BOUND, BOUNDED, COEFS };

/* Tile t of a row: values [from, from + len) of its parameter. With the averaged momentum m
 * as fp32 (row[M] != 0) it is read where it lies; else it is still as the compressed allreduce
 * left it (packed signs, one scale per block, the mask; row[OFFSET] its first value in that
 * layout), and a tile at a time is decoded (onebit_decode_range, the final decode's own code)
 * into a buffer that stays in cache and updated from there: the fp32 average is never written
 * to memory and read back, the same bits as the decode followed by the update. */
static void update_tile(const int64_t *row, const double *coef, float k, int decays,
                        int64_t from, int64_t len) {
    float *p = (float *)(intptr_t)row[P] + from;
    const float *d = (const float *)(intptr_t)row[D] + from;
    float *m_state = row[M_STATE] ? (float *)(intptr_t)row[M_STATE] + from : NULL;
    const float s = (float)coef[SCALE], hi = (float)coef[BOUND], lo = -(float)coef[BOUND];
    const int bounded = coef[BOUNDED] != 0.0;
    if (row[M]) {
        update_cases(p, (const float *)(intptr_t)row[M] + from, d, m_state, len, k, s, lo, hi,
                     bounded, decays);
        return;
    }
    float m[TILE];
    onebit_decode_range((const uint8_t *)(intptr_t)row[PACKED],
                        (const float *)(intptr_t)row[SCALES], (const uint8_t *)(intptr_t)row[KEEP],
                        m, row[OFFSET] + from, len, row[BLOCK]);
    update_cases(p, m, d, m_state, len, k, s, lo, hi, bounded, decays);
}

/* The update of `rows` parameters in one call (a parameter group's, from Python, which would
 * otherwise pay a call per parameter: some 100 per step for a 6.5M-parameter GPT): row i of
 * `table` (COLUMNS int64: addresses, sizes, the encoded average's place) and of `coefs` (COEFS
 * doubles); `decay` the group's. The rows' tiles are shared among `threads` threads; m_state
 * (0: none) receives the averaged momentum, the optimizer's from then on. Returns 0, or -1
 * when the tile index could not be allocated. */
int onebit_frozen_update_many(const int64_t *table, const double *coefs, int64_t rows,
                              double decay, int threads) {
    const float k = (float)decay;
    const int decays = decay != 1.0;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(rows + 1)); /* each row's first tile */
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t *row = table + i * COLUMNS;
        first[i + 1] = first[i] + (row[N] + TILE - 1) / TILE;
        if (!row[M] && row[N] > 0) { /* the first decode fills the sign table, before the threads */
            float one;
            onebit_decode_range((const uint8_t *)(intptr_t)row[PACKED],
                                (const float *)(intptr_t)row[SCALES],
                                (const uint8_t *)(intptr_t)row[KEEP], &one, row[OFFSET], 1,
                                row[BLOCK]);
        }
    }
    const int64_t tiles = first[rows];
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t lo = 0, hi = rows - 1; /* the row holding tile t: the last first <= t */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= t) lo = mid; else hi = mid - 1;
        }
        const int64_t *row = table + lo * COLUMNS;
        int64_t from = (t - first[lo]) * TILE;
        int64_t len = row[N] - from < TILE ? row[N] - from : TILE;
        update_tile(row, coefs + lo * COEFS, k, decays, from, len);
    }
    free(first);
    return 0;
}
