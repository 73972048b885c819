//! Vectorized elementwise math of the forward pass: `exp` (for attention's softmax) and the
//! gated activations of the feed-forward block, spread over the compute threads.
//!
//! Every element's arithmetic depends only on its value and its place in its row, never on
//! how many rows the batch has or which thread takes them, so results stay batch-invariant.

use crate::cpu::matmul::Isa;
use crate::cpu::pool::{SharedOut, ThreadPool, split_range};

/// The feed-forward block's gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// `silu(g) * u` (Llama).
    Silu,
    /// `gelu_tanh(g) * u` (Gemma).
    GeluTanh,
}

/// `gate[i] = act(gate[i]) * up[i]`, rows of `width` spread over the threads (vectorized
/// unless `isa` is [`Isa::Scalar`]).
pub(crate) fn gated(
    pool: &ThreadPool,
    isa: Isa,
    act: Gate,
    gate: &mut [f32],
    up: &[f32],
    width: usize,
) {
    let rows = gate.len() / width.max(1);
    let threads = pool.threads();
    #[cfg(target_arch = "x86_64")]
    let simd = isa != Isa::Scalar && avx2::usable();
    #[cfg(not(target_arch = "x86_64"))]
    let simd = {
        let _ = isa;
        false
    };
    let out = SharedOut(gate.as_mut_ptr());
    pool.run(&|ti| {
        let range = split_range(rows, threads, ti, 1);
        if range.is_empty() {
            return;
        }
        // SAFETY: the threads' row ranges are disjoint and lie inside `gate`.
        let g = unsafe {
            std::slice::from_raw_parts_mut(out.get().add(range.start * width), range.len() * width)
        };
        let u = &up[range.start * width..range.end * width];
        for (g, u) in g.chunks_exact_mut(width).zip(u.chunks_exact(width)) {
            gated_row(simd, act, g, u);
        }
    });
}

/// One row; `simd`: AVX2 and FMA were detected.
fn gated_row(simd: bool, act: Gate, g: &mut [f32], u: &[f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: AVX2 and FMA are available (`simd`, checked by the caller).
        done = unsafe {
            match act {
                Gate::Silu => avx2::gate_mul::<false>(g, u),
                Gate::GeluTanh => avx2::gate_mul::<true>(g, u),
            }
        };
    }
    for (g, u) in g[done..].iter_mut().zip(&u[done..]) {
        *g = match act {
            Gate::Silu => *g / (1.0 + (-*g).exp()) * u,
            Gate::GeluTanh => gelu_tanh(*g) * u,
        };
    }
}

/// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`, ggml's `gelu`).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// Whether this CPU runs these kernels.
    pub(crate) fn usable() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    /// `exp(x)`, inputs clamped to [-87, 88] (Cephes' polynomial, relative error about 2e-7).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_set1_ps(88.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        // 2^n for n in [-126, 127], built in the exponent field.
        let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e)))
    }

    /// `g = silu(g) * u`, or with `GELU` `g = gelu_tanh(g) * u`, over whole groups of 8;
    /// returns how many elements were done. Both are `x / (1 + exp(-z)) * u`: silu's `z` is
    /// `x`, and GELU's `0.5 * (1 + tanh(y))` is the sigmoid of `z = 2y`.
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn gate_mul<const GELU: bool>(g: &mut [f32], u: &[f32]) -> usize {
        let n = g.len().min(u.len()) / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        // 2 * sqrt(2 / pi), and that times GELU's cubic coefficient.
        let (c1, c3) = (_mm256_set1_ps(1.595_769_2), _mm256_set1_ps(1.595_769_2 * 0.044_715));
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n, inside both slices.
            unsafe {
                let x = _mm256_loadu_ps(g.as_ptr().add(i));
                let z = if GELU {
                    _mm256_mul_ps(x, _mm256_fmadd_ps(c3, _mm256_mul_ps(x, x), c1))
                } else {
                    x
                };
                let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), z));
                let y = _mm256_mul_ps(
                    _mm256_div_ps(x, _mm256_add_ps(one, e)),
                    _mm256_loadu_ps(u.as_ptr().add(i)),
                );
                _mm256_storeu_ps(g.as_mut_ptr().add(i), y);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gates_match_their_definitions_whatever_the_threads() {
        let width = 37;
        let g: Vec<f32> = (0..5 * width).map(|i| (i as f32 * 0.37).sin() * 12.0 - 1.0).collect();
        let u: Vec<f32> = (0..5 * width).map(|i| (i as f32 * 0.11).cos()).collect();
        for act in [Gate::Silu, Gate::GeluTanh] {
            let mut one = g.clone();
            gated(&ThreadPool::new(1), Isa::Avx2, act, &mut one, &u, width);
            let mut two = g.clone();
            gated(&ThreadPool::new(2), Isa::Avx2, act, &mut two, &u, width);
            assert_eq!(one, two, "{act:?}: threads changed the bits");
            for ((o, &x), &u) in one.iter().zip(&g).zip(&u) {
                let want = match act {
                    Gate::Silu => (f64::from(x) / (1.0 + (-f64::from(x)).exp())) * f64::from(u),
                    Gate::GeluTanh => f64::from(gelu_tanh(x) * u),
                };
                assert!(
                    (f64::from(*o) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{act:?} {x}: {o} vs {want}"
                );
            }
        }
        // The vector exp over its whole range.
        #[cfg(target_arch = "x86_64")]
        if avx2::usable() {
            for i in -988..=1000 {
                let x = i as f32 * 0.088;
                let mut got = [0f32; 8];
                // SAFETY: AVX2 and FMA are available (checked).
                unsafe {
                    let v = avx2::exp(std::arch::x86_64::_mm256_set1_ps(x));
                    std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), v);
                }
                let want = f64::from(x).exp();
                assert!(
                    ((f64::from(got[0]) - want) / want).abs() < 1e-6,
                    "exp({x}) = {} vs {want}",
                    got[0]
                );
            }
        }
    }
}
