/* The compression stage's parameter update on the CPU, one pass over each parameter.
 *
 * The torch passes of onebit_plugin.update.frozen_update_ do, one operation each over the
 * whole tensor: p *= decay (decoupled weight decay), r = m / d, r = clamp(r, -bound, bound)
 * (bounded steps), r *= scale, p += r: five reads and four writes of the tensor's size, and
 * a scratch tensor. Here each value is read once (p, m, d) and written once (p), with the same
 * fp32 operations in the same order, each rounded once: built without fused multiply-add
 * (-ffp-contract=off), the results are the torch passes' bit for bit. The clamp keeps NaN, as
 * torch's does. The multipliers arrive as doubles and are rounded to fp32 here, as torch rounds
 * a Python scalar for an fp32 tensor.
 */
#include <stdint.h>

void onebit_frozen_update(float *restrict p, const float *restrict m, const float *restrict d,
                          int64_t n, double decay, double scale, double bound, int bounded,
                          int threads) {
    const float k = (float)decay, s = (float)scale, hi = (float)bound, lo = -(float)bound;
    /* Four loops rather than tests inside one: each vectorises. */
    if (bounded && decay != 1.0) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            float r = m[i] / d[i];
            r = r < lo ? lo : r;
            r = r > hi ? hi : r;
            float x = p[i] * k;
            p[i] = x + r * s;
        }
    } else if (bounded) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            float r = m[i] / d[i];
            r = r < lo ? lo : r;
            r = r > hi ? hi : r;
            p[i] = p[i] + r * s;
        }
    } else if (decay != 1.0) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            float x = p[i] * k;
            p[i] = x + (m[i] / d[i]) * s;
        }
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) p[i] = p[i] + (m[i] / d[i]) * s;
    }
}
