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
        float *ps = p + from, *ms = copies ? m_state + from : NULL;
        const float *mm = m + from, *dd = d + from;
        if (bounded && decays && copies)
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 1, 1, 1);
        else if (bounded && decays)
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 1, 1, 0);
        else if (bounded && copies)
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 1, 0, 1);
        else if (bounded)
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 1, 0, 0);
        else if (decays && copies)
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 0, 1, 1);
        else if (decays)
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 0, 1, 0);
        else if (copies)
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 0, 0, 1);
        else
            update_range(ps, mm, dd, ms, len, k, s, lo, hi, 0, 0, 0);
    }
}
