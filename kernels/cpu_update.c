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
 */
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>

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

/* m_state: where the averaged momentum m is copied (NULL: nowhere). */
void onebit_frozen_update(float *restrict p, const float *restrict m, const float *restrict d,
                          float *restrict m_state, int64_t n, double decay, double scale,
                          double bound, int bounded, int threads) {
    const float k = (float)decay, s = (float)scale, hi = (float)bound, lo = -(float)bound;
    const int decays = decay != 1.0, copies = m_state != NULL;
#pragma omp parallel num_threads(threads)
    {
        /* This thread's share, as schedule(static) would cut it. */
        int64_t team = 1, me = 0;
#ifdef _OPENMP
        team = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        int64_t per = (n + team - 1) / team, from = me * per;
        int64_t len = from >= n ? 0 : (n - from < per ? n - from : per);
        update_cases(p + from, m + from, d + from, copies ? m_state + from : NULL, len, k, s,
                     lo, hi, bounded, decays);
    }
}

void onebit_decode_range(const uint8_t *packed, const float *scales, const uint8_t *keep,
                         float *out, int64_t g0, int64_t n, int64_t block); /* cpu_compress.c */

/* Values decoded per turn of the update below: 16 KiB of fp32, which stays in L1. */
#define DECODED_TILE 4096

/* onebit_frozen_update with the averaged momentum still as the compressed allreduce left it:
 * packed signs, one scale per block and the mask, for values offset..offset+n of the layout.
 * A tile at a time is decoded (onebit_decode_range, the final decode's own code) into a
 * buffer that stays in cache and updated from there, so the fp32 average is never written to
 * memory and read back: the same bits as the decode followed by the update. The average is
 * copied into m_state, the optimizer's momentum. */
void onebit_frozen_update_packed(float *restrict p, const uint8_t *packed, const float *scales,
                                 const uint8_t *keep, int64_t offset, int64_t block,
                                 const float *restrict d, float *restrict m_state, int64_t n,
                                 double decay, double scale, double bound, int bounded,
                                 int threads) {
    const float k = (float)decay, s = (float)scale, hi = (float)bound, lo = -(float)bound;
    const int decays = decay != 1.0;
    const int64_t tiles = (n + DECODED_TILE - 1) / DECODED_TILE;
    /* The first decode fills the sign table; before the threads, which only read it. */
    float first[8];
    if (n > 0) onebit_decode_range(packed, scales, keep, first, offset, 1, block);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float m[DECODED_TILE];
        int64_t from = t * DECODED_TILE;
        int64_t len = n - from < DECODED_TILE ? n - from : DECODED_TILE;
        onebit_decode_range(packed, scales, keep, m, offset + from, len, block);
        update_cases(p + from, m, d + from, m_state + from, len, k, s, lo, hi, bounded, decays);
    }
}
