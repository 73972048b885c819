//! AVX-512 VNNI kernels for packed 4/8-bit weights times 8-bit activations.
//!
//! One 512-bit register holds a pair of 32-element blocks. `vpdpbusd` multiplies the
//! unsigned weight bytes by the signed activation bytes and sums groups of four into 16
//! int32 lanes (lanes 0-7 belong to the first block, 8-15 to the second); those are scaled
//! by `d_w * d_a` of their block and accumulated in float, in block order, per output
//! element. Tiles of up to 4 weight rows x 4 tokens reuse each unpacked weight register.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::cpu::matmul::{BlockView, Offset, QuantizedActs, TILE_COLS, TILE_ROWS, offset_term};
use crate::quant::QK;

/// Computes output rows `range` for every token.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI and F16C; `out` must point to
/// `acts.rows * v.rows` floats of which no other thread writes rows in `range`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
pub(crate) unsafe fn block_rows_avx512(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    range: Range<usize>,
    out: *mut f32,
) {
    let mut r = range.start;
    while r < range.end {
        let rn = (range.end - r).min(TILE_ROWS);
        let mut t = 0;
        while t < acts.rows {
            let tn = (acts.rows - t).min(TILE_COLS);
            // SAFETY: forwarded contract; r..r+rn and t..t+tn are in bounds.
            unsafe {
                match (rn, tn) {
                    (4, 4) => tile::<4, 4>(v, acts, r, t, out),
                    (4, 3) => tile::<4, 3>(v, acts, r, t, out),
                    (4, 2) => tile::<4, 2>(v, acts, r, t, out),
                    (4, 1) => tile::<4, 1>(v, acts, r, t, out),
                    (3, 4) => tile::<3, 4>(v, acts, r, t, out),
                    (3, 3) => tile::<3, 3>(v, acts, r, t, out),
                    (3, 2) => tile::<3, 2>(v, acts, r, t, out),
                    (3, 1) => tile::<3, 1>(v, acts, r, t, out),
                    (2, 4) => tile::<2, 4>(v, acts, r, t, out),
                    (2, 3) => tile::<2, 3>(v, acts, r, t, out),
                    (2, 2) => tile::<2, 2>(v, acts, r, t, out),
                    (2, 1) => tile::<2, 1>(v, acts, r, t, out),
                    (1, 4) => tile::<1, 4>(v, acts, r, t, out),
                    (1, 3) => tile::<1, 3>(v, acts, r, t, out),
                    (1, 2) => tile::<1, 2>(v, acts, r, t, out),
                    _ => tile::<1, 1>(v, acts, r, t, out),
                }
            }
            t += tn;
        }
        r += rn;
    }
}

/// Loads a pair of weight blocks as 64 unsigned bytes in element order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn load_pair(p: *const u8, eight_bit: bool) -> __m512i {
    // SAFETY: the caller passes a pointer to a whole pair (32 or 64 bytes).
    unsafe {
        if eight_bit {
            _mm512_loadu_si512(p.cast())
        } else {
            let q = _mm256_loadu_si256(p.cast());
            let m = _mm256_set1_epi8(0x0F);
            let lo = _mm256_and_si256(q, m);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m);
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn tile<const R: usize, const C: usize>(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    r0: usize,
    t0: usize,
    out: *mut f32,
) {
    let nb = v.nb;
    let pairs = nb.div_ceil(2);
    let eight_bit = v.offset == Offset::Minus128;
    let pb = v.pair_bytes;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let zero = _mm512_setzero_si512();
    let mut b0 = 0;
    while b0 < nb {
        let nblk = (nb - b0).min(16);
        let mask: __mmask16 = if nblk == 16 { 0xFFFF } else { (1u16 << nblk) - 1 };
        // SAFETY: every pointer below stays inside its row: rows r0..r0+R and tokens
        // t0..t0+C exist (caller), masked loads touch only the nblk valid scales, and pair
        // p < pairs lies inside the packed row.
        unsafe {
            let mut dw = [_mm512_setzero_ps(); R];
            for (i, d) in dw.iter_mut().enumerate() {
                let p = v.d.as_ptr().add((r0 + i) * nb + b0).cast::<i16>();
                *d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
            }
            let mut da = [_mm512_setzero_ps(); C];
            for (j, d) in da.iter_mut().enumerate() {
                *d = _mm512_maskz_loadu_ps(mask, acts.d.as_ptr().add((t0 + j) * nb + b0));
            }
            // The offset term sum_b c_b sa_b, one lane per block, joins the same accumulator
            // (everything is summed at the end).
            for (i, row) in acc.iter_mut().enumerate() {
                let c = match v.offset {
                    Offset::Min => {
                        let p = v.m.as_ptr().add((r0 + i) * nb + b0).cast::<i16>();
                        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p))
                    }
                    Offset::Minus8 => _mm512_mul_ps(dw[i], _mm512_set1_ps(-8.0)),
                    Offset::Minus128 => _mm512_mul_ps(dw[i], _mm512_set1_ps(-128.0)),
                };
                for (j, a) in row.iter_mut().enumerate() {
                    let sa = _mm512_maskz_loadu_ps(mask, acts.sa.as_ptr().add((t0 + j) * nb + b0));
                    *a = _mm512_fmadd_ps(c, sa, *a);
                }
            }
            let p_first = b0 / 2;
            let p_end = (p_first + 8).min(pairs);
            for p in p_first..p_end {
                let k = (2 * (p - p_first)) as i32;
                let idx = _mm512_set_epi32(
                    k + 1,
                    k + 1,
                    k + 1,
                    k + 1,
                    k + 1,
                    k + 1,
                    k + 1,
                    k + 1,
                    k,
                    k,
                    k,
                    k,
                    k,
                    k,
                    k,
                    k,
                );
                let mut w = [zero; R];
                let mut sw = [_mm512_setzero_ps(); R];
                for i in 0..R {
                    let wp = v.qs.as_ptr().add(((r0 + i) * pairs + p) * pb);
                    // The next row group streams in while this one is computed (the
                    // hardware prefetcher alone leaves decode well short of bandwidth).
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(2 * R * pairs * pb).cast());
                    w[i] = load_pair(wp, eight_bit);
                    sw[i] = _mm512_permutexvar_ps(idx, dw[i]);
                }
                for j in 0..C {
                    let ap = acts.qs.as_ptr().add(((t0 + j) * acts.nb_pad + 2 * p) * QK);
                    let a = _mm512_loadu_si512(ap.cast());
                    let sa = _mm512_permutexvar_ps(idx, da[j]);
                    for i in 0..R {
                        let isum = _mm512_dpbusd_epi32(zero, w[i], a);
                        let s = _mm512_mul_ps(sw[i], sa);
                        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[i][j]);
                    }
                }
            }
        }
        b0 += 16;
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            let val = _mm512_reduce_add_ps(*a);
            // SAFETY: (t0 + j, r0 + i) is inside `out` and row r0 + i is this thread's.
            unsafe { *out.add((t0 + j) * v.rows + r0 + i) = val };
        }
    }
}

/// Computes output rows `range` for every token with AVX2 (machines without AVX-512 VNNI):
/// one (row, token) dot product at a time, blocks accumulated in order.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `out` as for [`block_rows_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block_rows_avx2(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    range: Range<usize>,
    out: *mut f32,
) {
    for r in range {
        for t in 0..acts.rows {
            // SAFETY: forwarded contract; (t, r) is inside `out`.
            unsafe { *out.add(t * v.rows + r) = dot_avx2(v, acts, r, t) };
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(v: &BlockView<'_>, acts: &QuantizedActs, r: usize, t: usize) -> f32 {
    let nb = v.nb;
    let pairs = nb.div_ceil(2);
    let ones = _mm256_set1_epi16(1);
    let nibble = _mm_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: block b of row r and of token t lie inside their packed buffers.
        let (prod, dw) = unsafe {
            let pair = v.qs.as_ptr().add((r * pairs + b / 2) * v.pair_bytes);
            let a = _mm256_loadu_si256(acts.qs.as_ptr().add((t * acts.nb_pad + b) * QK).cast());
            let prod = if v.offset == Offset::Minus128 {
                // Stored as q ^ 0x80: recover the signed value and use |q| * sign(a, q),
                // which `maddubs` cannot overflow (unlike the unsigned form).
                let q = _mm256_xor_si256(
                    _mm256_loadu_si256(pair.add(32 * (b % 2)).cast()),
                    _mm256_set1_epi8(-128),
                );
                _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(a, q))
            } else {
                let lo = _mm_loadu_si128(pair.cast());
                let hi = _mm_loadu_si128(pair.add(16).cast());
                let (lo, hi) = if b % 2 == 0 {
                    (_mm_and_si128(lo, nibble), _mm_and_si128(hi, nibble))
                } else {
                    (
                        _mm_and_si128(_mm_srli_epi16::<4>(lo), nibble),
                        _mm_and_si128(_mm_srli_epi16::<4>(hi), nibble),
                    )
                };
                _mm256_maddubs_epi16(_mm256_set_m128i(hi, lo), a)
            };
            let bits = v.d[r * nb + b].to_bits();
            let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))));
            (prod, dw)
        };
        let s32 = _mm256_madd_epi16(prod, ones);
        let scale = _mm256_set1_ps(dw * acts.d[t * nb + b]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, acc);
    }
    let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
    let offset = if v.offset == Offset::Minus128 { 0.0 } else { offset_term(v, acts, r, t) };
    _mm_cvtss_f32(h) + offset
}
