//! x86-64 kernels: packed 4/8-bit weights times 8-bit activations, over the 16-row
//! interleaved layout described in [`crate::cpu::matmul`], and F32/F16/BF16 weights widened
//! in registers times f32 activations (`raw_rows_*`, summed by `matmul::reduce16`'s tree)
//! (attention's kernels are in [`crate::cpu::attention`]).
//!
//! Per (group of 16 rows, block, token): eight integer products of a quad of all 16 rows
//! with the token's 4 activation bytes broadcast give the block's exact sums in 16 int32
//! lanes, one lane per row; one conversion and two multiply-adds fold them, with the
//! block's scales and offset term, into 16 float accumulators. Tiles of up to 8 tokens
//! (AVX-512; 4 with AVX2's 16 registers) reuse each unpacked weight register; AVX2 takes a
//! group's two 8-row halves one after the other, except for one or two tokens (decode),
//! where both go in one pass so every line of weights is used whole. Each kernel
//! is compiled once per offset kind, so no test of the format is left in its loops.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::cpu::layout::{
    BlockView, GROUP, Offset, QuantizedActs, TILE_COLS, TILE_COLS_512, group_block_bytes,
};
use crate::quant::QK;

/// Computes output rows `range` (whole groups, except at the end of the matrix) for every
/// token.
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
    // SAFETY: forwarded contract.
    unsafe {
        match v.offset {
            Offset::Min => rows512::<{ Offset::Min.id() }>(v, acts, range, out),
            Offset::Minus8 => rows512::<{ Offset::Minus8.id() }>(v, acts, range, out),
            Offset::Minus128 => rows512::<{ Offset::Minus128.id() }>(v, acts, range, out),
            Offset::Min8 => rows512::<{ Offset::Min8.id() }>(v, acts, range, out),
            Offset::Minus32Halves => rows512::<{ Offset::Minus32Halves.id() }>(v, acts, range, out),
        }
    }
}

/// [`block_rows_avx512`] compiled for one offset (`OFF`, [`Offset::id`], which must be
/// `v.offset`'s), so no test of the format is left in the loops.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn rows512<const OFF: u8>(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    range: Range<usize>,
    out: *mut f32,
) {
    debug_assert_eq!(v.offset, Offset::from_id(OFF));
    for g in range.start / GROUP..range.end.div_ceil(GROUP) {
        let mut t = 0;
        while t < acts.rows {
            // Eight tokens a tile: 32 registers hold their sums and a block's weights.
            let tn = (acts.rows - t).min(TILE_COLS_512);
            // SAFETY: forwarded contract; group g and tokens t..t+tn are in bounds.
            unsafe {
                match tn {
                    8 => tile512::<8, OFF>(v, acts, g, t, out),
                    7 => tile512::<7, OFF>(v, acts, g, t, out),
                    6 => tile512::<6, OFF>(v, acts, g, t, out),
                    5 => tile512::<5, OFF>(v, acts, g, t, out),
                    4 => tile512::<4, OFF>(v, acts, g, t, out),
                    3 => tile512::<3, OFF>(v, acts, g, t, out),
                    2 => tile512::<2, OFF>(v, acts, g, t, out),
                    _ => tile512::<1, OFF>(v, acts, g, t, out),
                }
            }
            t += tn;
        }
    }
}

/// Mask of the group's lanes that are real rows.
fn lane_mask(rows: usize, g: usize) -> u16 {
    let n = (rows - g * GROUP).min(GROUP);
    if n == GROUP { u16::MAX } else { (1u16 << n) - 1 }
}

/// The four activation bytes of quad `k` of token `t`'s block `b`, as one int32.
///
/// # Safety
/// Token `t` and block `b` must exist in `acts`.
#[inline(always)]
unsafe fn quad(acts: &QuantizedActs, t: usize, b: usize, k: usize) -> i32 {
    // SAFETY: the block's 32 bytes lie inside `acts.qs` (caller's contract).
    unsafe {
        acts.qs.as_ptr().add((t * acts.nb_pad + b) * QK + 4 * k).cast::<i32>().read_unaligned()
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn tile512<const C: usize, const OFF: u8>(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    g: usize,
    t0: usize,
    out: *mut f32,
) {
    let offset = Offset::from_id(OFF);
    let nb = v.nb;
    let gbb = group_block_bytes(offset);
    let mut acc = [_mm512_setzero_ps(); C];
    let zero = _mm512_setzero_si512();
    let nibble = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let gb = g * nb + b;
        // SAFETY: group g and block b exist, so their bytes, scales and minima lie inside
        // the packed buffers; tokens t0..t0+C exist (caller).
        unsafe {
            let base = v.qs.as_ptr().add(gb * gbb);
            // The first tile of tokens streams in the next group's block while this one is
            // computed (the later tiles find the group in cache).
            if t0 == 0 {
                let next = base.wrapping_add(nb * gbb);
                for line in (0..gbb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line).cast());
                }
            }
            let mut w = [zero; 8];
            if offset.eight_bit() {
                for (k, wk) in w.iter_mut().enumerate() {
                    *wk = _mm512_loadu_si512(base.add(64 * k).cast());
                }
            } else {
                for c in 0..4 {
                    let x = _mm512_loadu_si512(base.add(64 * c).cast());
                    w[c] = _mm512_and_si512(x, nibble);
                    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(x), nibble);
                }
            }
            let halves = offset == Offset::Minus32Halves;
            if halves {
                // Q6_K's top two bits: chunk k / 4 holds quad k's at bit 2 (k % 4); shifted
                // to bits 4-5 of each byte (16-bit shifts: the mask drops what crossed bytes).
                let top = _mm512_set1_epi8(0x30);
                for (h, quads) in w.chunks_exact_mut(4).enumerate() {
                    let x = _mm512_loadu_si512(base.add(GROUP * QK / 2 + 64 * h).cast());
                    let bits = [
                        _mm512_slli_epi16::<4>(x),
                        _mm512_slli_epi16::<2>(x),
                        x,
                        _mm512_srli_epi16::<2>(x),
                    ];
                    for (q, b) in quads.iter_mut().zip(bits) {
                        *q = _mm512_or_si512(*q, _mm512_and_si512(b, top));
                    }
                }
            }
            let sp = v.d.as_ptr().add(gb * offset.scales() * GROUP);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(sp.cast()));
            // The second half's scale (Q6_K only).
            let dw1 = if halves {
                _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(GROUP).cast()))
            } else {
                _mm512_setzero_ps()
            };
            let cw = match offset {
                Offset::Min | Offset::Min8 => {
                    _mm512_cvtph_ps(_mm256_loadu_si256(v.m.as_ptr().add(gb * GROUP).cast()))
                }
                Offset::Minus8 => _mm512_mul_ps(dw, _mm512_set1_ps(-8.0)),
                Offset::Minus128 => _mm512_mul_ps(dw, _mm512_set1_ps(-128.0)),
                Offset::Minus32Halves => _mm512_mul_ps(dw, _mm512_set1_ps(-32.0)),
            };
            let cw1 = _mm512_mul_ps(dw1, _mm512_set1_ps(-32.0));
            for (j, a) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                // Two chains of four products (integer sums are exact in any order).
                let mut s0 = zero;
                let mut s1 = zero;
                for k in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, w[k], _mm512_set1_epi32(quad(acts, t, b, k)));
                    s1 = _mm512_dpbusd_epi32(
                        s1,
                        w[k + 4],
                        _mm512_set1_epi32(quad(acts, t, b, k + 4)),
                    );
                }
                let da = _mm512_set1_ps(*acts.d.get_unchecked(t * nb + b));
                if halves {
                    // Quads 0-3 are the first 16 elements, 4-7 the second.
                    let sh = acts.sh.as_ptr().add((t * nb + b) * 2);
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(dw, da), *a);
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(dw1, da), *a);
                    *a = _mm512_fmadd_ps(cw, _mm512_set1_ps(*sh), *a);
                    *a = _mm512_fmadd_ps(cw1, _mm512_set1_ps(*sh.add(1)), *a);
                } else {
                    let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    *a = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, da), *a);
                    let sa = _mm512_set1_ps(*acts.sa.get_unchecked(t * nb + b));
                    *a = _mm512_fmadd_ps(cw, sa, *a);
                }
            }
        }
    }
    let mask = lane_mask(v.rows, g);
    for (j, a) in acc.iter().enumerate() {
        // SAFETY: the masked lanes are rows g*16.. of token t0 + j, inside `out`, and this
        // thread's.
        unsafe { _mm512_mask_storeu_ps(out.add((t0 + j) * v.rows + g * GROUP), mask, *a) };
    }
}

/// Computes output rows `range` for every token with AVX2 (machines without AVX-512
/// VNNI): the same scheme with two 8-row halves per group and `maddubs` products.
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
    // SAFETY: forwarded contract.
    unsafe {
        match v.offset {
            Offset::Min => rows256::<{ Offset::Min.id() }>(v, acts, range, out),
            Offset::Minus8 => rows256::<{ Offset::Minus8.id() }>(v, acts, range, out),
            Offset::Minus128 => rows256::<{ Offset::Minus128.id() }>(v, acts, range, out),
            Offset::Min8 => rows256::<{ Offset::Min8.id() }>(v, acts, range, out),
            Offset::Minus32Halves => rows256::<{ Offset::Minus32Halves.id() }>(v, acts, range, out),
        }
    }
}

/// [`block_rows_avx2`] compiled for one offset, as [`rows512`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows256<const OFF: u8>(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    range: Range<usize>,
    out: *mut f32,
) {
    debug_assert_eq!(v.offset, Offset::from_id(OFF));
    if acts.rows == 0 {
        // No tokens (a pass that wants no logits): nothing to read, nothing to write. The
        // decode tiles below assume at least one.
        return;
    }
    for g in range.start / GROUP..range.end.div_ceil(GROUP) {
        if acts.rows <= 2 {
            // One or two tokens (decode): both halves in one pass over the group, so each
            // line of weights is used whole when it arrives.
            // SAFETY: forwarded contract; group g and tokens 0..rows are in bounds.
            unsafe {
                match acts.rows {
                    2 => tile256::<2, OFF, true>(v, acts, g, 0, 0, out),
                    _ => tile256::<1, OFF, true>(v, acts, g, 0, 0, out),
                }
            }
            continue;
        }
        for half in 0..2 {
            let mut t = 0;
            while t < acts.rows {
                let tn = (acts.rows - t).min(TILE_COLS);
                // SAFETY: forwarded contract; group g and tokens t..t+tn are in bounds.
                unsafe {
                    match tn {
                        4 => tile256::<4, OFF, false>(v, acts, g, half, t, out),
                        3 => tile256::<3, OFF, false>(v, acts, g, half, t, out),
                        2 => tile256::<2, OFF, false>(v, acts, g, half, t, out),
                        _ => tile256::<1, OFF, false>(v, acts, g, half, t, out),
                    }
                }
                t += tn;
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile256<const C: usize, const OFF: u8, const BOTH: bool>(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    g: usize,
    half: usize,
    t0: usize,
    out: *mut f32,
) {
    // Held in registers: the halves are constants of each call.
    let mut acc0 = [_mm256_setzero_ps(); C];
    let mut acc1 = [_mm256_setzero_ps(); C];
    for b in 0..v.nb {
        // SAFETY: forwarded contract.
        unsafe {
            if BOTH {
                half_block::<C, OFF>(v, acts, g, b, 0, t0, &mut acc0);
                half_block::<C, OFF>(v, acts, g, b, 1, t0, &mut acc1);
            } else {
                half_block::<C, OFF>(v, acts, g, b, half, t0, &mut acc0);
            }
        }
    }
    let rows = (v.rows - g * GROUP).min(GROUP);
    let done = [(if BOTH { 0 } else { half }, acc0), (1, acc1)];
    for &(half, acc) in &done[..1 + usize::from(BOTH)] {
        let n = rows.saturating_sub(8 * half).min(8);
        for (j, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
            for (l, &x) in lanes[..n].iter().enumerate() {
                // SAFETY: row g*16 + 8*half + l < v.rows of token t0 + j is inside `out` and
                // this thread's.
                unsafe { *out.add((t0 + j) * v.rows + g * GROUP + 8 * half + l) = x };
            }
        }
    }
}

/// Adds block `b` of half `half` (8 rows) of group `g` to tokens `t0..t0 + C`'s sums.
///
/// # Safety
/// As [`block_rows_avx2`]; group g, block b and tokens t0..t0+C exist.
#[inline(always)]
unsafe fn half_block<const C: usize, const OFF: u8>(
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    g: usize,
    b: usize,
    half: usize,
    t0: usize,
    acc: &mut [__m256; C],
) {
    let offset = Offset::from_id(OFF);
    let nb = v.nb;
    let gbb = group_block_bytes(offset);
    // Q8_0's signed bytes, Q5_K's unsigned ones, or Q6_K's 6-bit values.
    let signed8 = offset == Offset::Minus128;
    let unsigned8 = offset.eight_bit() && !signed8;
    let halves = offset == Offset::Minus32Halves;
    let gb = g * nb + b;
    // SAFETY: as in `tile512`; this half's 32 bytes of each 64-byte chunk, and its 8
    // scales, lie inside the group-block.
    unsafe {
        let zero = _mm256_setzero_si256();
        let ones = _mm256_set1_epi16(1);
        let nibble = _mm256_set1_epi8(0x0F);
        let base = v.qs.as_ptr().add(gb * gbb + 32 * half);
        // The first pass over the group streams in the next group's block while this
        // one is computed (as in `tile512`).
        if t0 == 0 && half == 0 {
            let next = base.wrapping_add(nb * gbb);
            for line in (0..gbb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line).cast());
            }
        }
        let mut w = [zero; 8];
        if signed8 {
            // Stored as q ^ 0x80: recover the signed value and use |q| * sign(a, q),
            // which `maddubs` cannot overflow (unlike the unsigned form).
            for (k, wk) in w.iter_mut().enumerate() {
                let x = _mm256_loadu_si256(base.add(64 * k).cast());
                *wk = _mm256_xor_si256(x, _mm256_set1_epi8(-128));
            }
        } else if unsigned8 {
            for (k, wk) in w.iter_mut().enumerate() {
                *wk = _mm256_loadu_si256(base.add(64 * k).cast());
            }
        } else {
            for c in 0..4 {
                let x = _mm256_loadu_si256(base.add(64 * c).cast());
                w[c] = _mm256_and_si256(x, nibble);
                w[c + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble);
            }
        }
        if halves {
            // Q6_K's top two bits, as in `tile512`.
            let top = _mm256_set1_epi8(0x30);
            for (h, quads) in w.chunks_exact_mut(4).enumerate() {
                let x = _mm256_loadu_si256(base.add(GROUP * QK / 2 + 64 * h).cast());
                let bits = [
                    _mm256_slli_epi16::<4>(x),
                    _mm256_slli_epi16::<2>(x),
                    x,
                    _mm256_srli_epi16::<2>(x),
                ];
                for (q, b) in quads.iter_mut().zip(bits) {
                    *q = _mm256_or_si256(*q, _mm256_and_si256(b, top));
                }
            }
        }
        let sp = v.d.as_ptr().add(gb * offset.scales() * GROUP + 8 * half);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(sp.cast()));
        // The second half's scale (Q6_K only).
        let dw1 = if halves {
            _mm256_cvtph_ps(_mm_loadu_si128(sp.add(GROUP).cast()))
        } else {
            _mm256_setzero_ps()
        };
        let cw = match offset {
            Offset::Min | Offset::Min8 => {
                let mp = v.m.as_ptr().add(gb * GROUP + 8 * half);
                _mm256_cvtph_ps(_mm_loadu_si128(mp.cast()))
            }
            Offset::Minus8 => _mm256_mul_ps(dw, _mm256_set1_ps(-8.0)),
            // The signed products need no offset term.
            Offset::Minus128 => _mm256_setzero_ps(),
            Offset::Minus32Halves => _mm256_mul_ps(dw, _mm256_set1_ps(-32.0)),
        };
        let cw1 = _mm256_mul_ps(dw1, _mm256_set1_ps(-32.0));
        for (j, a) in acc.iter_mut().enumerate() {
            let t = t0 + j;
            if unsigned8 || halves {
                // Values up to 63 times activations in -127..=127: a pair of products is
                // at most 16,002, so two quads' 16-bit sums (at most 32,004) cannot
                // overflow and widen together; quads 0-3 are the first 16 elements, 4-7
                // the second.
                let mut sums = [zero; 2];
                for k in (0..8).step_by(2) {
                    let x0 = _mm256_set1_epi32(quad(acts, t, b, k));
                    let x1 = _mm256_set1_epi32(quad(acts, t, b, k + 1));
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[k], x0),
                        _mm256_maddubs_epi16(w[k + 1], x1),
                    );
                    sums[k / 4] = _mm256_add_epi32(sums[k / 4], _mm256_madd_epi16(p, ones));
                }
                let da = _mm256_set1_ps(*acts.d.get_unchecked(t * nb + b));
                if halves {
                    let sh = acts.sh.as_ptr().add((t * nb + b) * 2);
                    let (s0, s1) = (_mm256_cvtepi32_ps(sums[0]), _mm256_cvtepi32_ps(sums[1]));
                    *a = _mm256_fmadd_ps(s0, _mm256_mul_ps(dw, da), *a);
                    *a = _mm256_fmadd_ps(s1, _mm256_mul_ps(dw1, da), *a);
                    *a = _mm256_fmadd_ps(cw, _mm256_set1_ps(*sh), *a);
                    *a = _mm256_fmadd_ps(cw1, _mm256_set1_ps(*sh.add(1)), *a);
                } else {
                    let isum = _mm256_cvtepi32_ps(_mm256_add_epi32(sums[0], sums[1]));
                    *a = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, da), *a);
                    let sa = _mm256_set1_ps(*acts.sa.get_unchecked(t * nb + b));
                    *a = _mm256_fmadd_ps(cw, sa, *a);
                }
                continue;
            }
            let isum = if signed8 {
                let mut isum = zero;
                for (k, wk) in w.iter().enumerate() {
                    let x = _mm256_set1_epi32(quad(acts, t, b, k));
                    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(*wk), _mm256_sign_epi8(x, *wk));
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
                }
                isum
            } else {
                // 4-bit weights (0..15) times activations in -127..=127: a pair of
                // products is at most 3,810, so the eight quads' 16-bit sums (at most
                // 30,480) cannot overflow, and one widening per block does.
                let mut s16 = zero;
                for (k, wk) in w.iter().enumerate() {
                    let x = _mm256_set1_epi32(quad(acts, t, b, k));
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*wk, x));
                }
                _mm256_madd_epi16(s16, ones)
            };
            let s = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(t * nb + b)));
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, *a);
            if !signed8 {
                let sa = _mm256_set1_ps(*acts.sa.get_unchecked(t * nb + b));
                *a = _mm256_fmadd_ps(cw, sa, *a);
            }
        }
    }
}

/// How a row of floats is stored: F32, F16 or BF16 (see [`raw_rows_avx512`]).
pub(crate) const RAW_F32: u8 = 0;
pub(crate) const RAW_F16: u8 = 1;
pub(crate) const RAW_BF16: u8 = 2;

/// Output rows `range` of a matrix stored as floats (`TY`: [`RAW_F32`], [`RAW_F16`] or
/// [`RAW_BF16`], rows of `cols` elements at `w`), for every token row of `x`: each weight is
/// widened exactly to f32 in registers and multiplied-added into 16 lanes, which the fixed
/// tree of `reduce16` sums, so a product's bits depend on neither the batch nor the thread
/// (and equal [`raw_rows_avx2`]'s). Tiles of up to 4 rows by 4 tokens reuse each load.
///
/// # Safety
/// The CPU must support AVX-512 F/BW and F16C; `cols` a multiple of 16; `w` must hold the
/// rows in `range`, `x` whole rows of `cols` floats; `out` must point to
/// `x.len() / cols * rows` floats of which no other thread writes rows in `range`.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
pub(crate) unsafe fn raw_rows_avx512<const TY: u8>(
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    range: Range<usize>,
    out: *mut f32,
) {
    raw_tiles(range, x.len() / cols, cols, 4, |r, t, rn, tn| {
        // SAFETY: forwarded contract; rows r..r+rn and tokens t..t+tn are in bounds.
        unsafe {
            match (rn, tn) {
                (4, 4) => raw_tile512::<TY, 4, 4>(w, rows, cols, x, r, t, out),
                (4, 3) => raw_tile512::<TY, 4, 3>(w, rows, cols, x, r, t, out),
                (4, 2) => raw_tile512::<TY, 4, 2>(w, rows, cols, x, r, t, out),
                (4, _) => raw_tile512::<TY, 4, 1>(w, rows, cols, x, r, t, out),
                (_, 4) => raw_tile512::<TY, 1, 4>(w, rows, cols, x, r, t, out),
                (_, 3) => raw_tile512::<TY, 1, 3>(w, rows, cols, x, r, t, out),
                (_, 2) => raw_tile512::<TY, 1, 2>(w, rows, cols, x, r, t, out),
                _ => raw_tile512::<TY, 1, 1>(w, rows, cols, x, r, t, out),
            }
        }
        // A tail of fewer than 4 rows goes one row at a time.
        if rn == 4 { 4 } else { 1 }
    });
}

/// The float kernels' loop: token blocks (see [`raw_token_blocks`]), then tiles of up to
/// `max` rows by `max` tokens; `tile(r, t, rn, tn)` computes one and returns the rows it
/// took.
#[inline(always)]
fn raw_tiles(
    range: Range<usize>,
    tokens: usize,
    cols: usize,
    max: usize,
    mut tile: impl FnMut(usize, usize, usize, usize) -> usize,
) {
    for block in raw_token_blocks(tokens, cols) {
        let mut r = range.start;
        while r < range.end {
            let rn = (range.end - r).min(max);
            let mut taken = rn;
            let mut t = block.start;
            while t < block.end {
                let tn = (block.end - t).min(max);
                taken = tile(r, t, rn, tn);
                t += tn;
            }
            r += taken;
        }
    }
}

/// Token rows in blocks whose activations (about 512 KiB) stay in cache while every weight
/// row of the range passes over them.
fn raw_token_blocks(tokens: usize, cols: usize) -> impl Iterator<Item = Range<usize>> {
    let block = ((512 << 10) / (4 * cols.max(1))).max(4) / 4 * 4;
    (0..tokens).step_by(block).map(move |t| t..(t + block).min(tokens))
}

/// 16 weights of row `r` from element `k`, widened to f32.
#[inline(always)]
unsafe fn raw_load512<const TY: u8>(w: &[u8], cols: usize, r: usize, k: usize) -> __m512 {
    // SAFETY: the caller keeps r and k + 16 inside the matrix.
    unsafe {
        match TY {
            RAW_F32 => _mm512_loadu_ps(w.as_ptr().cast::<f32>().add(r * cols + k)),
            RAW_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(
                w.as_ptr().cast::<u16>().add(r * cols + k).cast(),
            )),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(w.as_ptr().cast::<u16>().add(r * cols + k).cast()),
            ))),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
unsafe fn raw_tile512<const TY: u8, const R: usize, const T: usize>(
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    r: usize,
    t: usize,
    out: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for k in (0..cols).step_by(16) {
        // SAFETY: rows r..r+R and tokens t..t+T exist (caller), k + 16 <= cols.
        unsafe {
            let xs: [__m512; T] =
                std::array::from_fn(|j| _mm512_loadu_ps(x.as_ptr().add((t + j) * cols + k)));
            for (i, acc) in acc.iter_mut().enumerate() {
                let wv = raw_load512::<TY>(w, cols, r + i, k);
                for (a, xv) in acc.iter_mut().zip(&xs) {
                    *a = _mm512_fmadd_ps(wv, *xv, *a);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (j, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; 16];
            // SAFETY: 16 floats into `lanes`; element (t + j, r + i) is this thread's.
            unsafe {
                _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
                *out.add((t + j) * rows + r + i) = crate::cpu::matmul::reduce16(lanes);
            }
        }
    }
}

/// [`raw_rows_avx512`] with AVX2: each 16 lanes as two registers of 8, the same operations
/// in the same order, so the same bits. Tiles of up to 2 rows by 2 tokens.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; otherwise as [`raw_rows_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn raw_rows_avx2<const TY: u8>(
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    range: Range<usize>,
    out: *mut f32,
) {
    raw_tiles(range, x.len() / cols, cols, 2, |r, t, rn, tn| {
        // SAFETY: forwarded contract; rows r..r+rn and tokens t..t+tn are in bounds.
        unsafe {
            match (rn, tn) {
                (2, 2) => raw_tile256::<TY, 2, 2>(w, rows, cols, x, r, t, out),
                (2, _) => raw_tile256::<TY, 2, 1>(w, rows, cols, x, r, t, out),
                (_, 2) => raw_tile256::<TY, 1, 2>(w, rows, cols, x, r, t, out),
                _ => raw_tile256::<TY, 1, 1>(w, rows, cols, x, r, t, out),
            }
        }
        rn
    });
}

/// 8 weights of row `r` from element `k`, widened to f32.
#[inline(always)]
unsafe fn raw_load256<const TY: u8>(w: &[u8], cols: usize, r: usize, k: usize) -> __m256 {
    // SAFETY: the caller keeps r and k + 8 inside the matrix.
    unsafe {
        match TY {
            RAW_F32 => _mm256_loadu_ps(w.as_ptr().cast::<f32>().add(r * cols + k)),
            RAW_F16 => {
                _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().cast::<u16>().add(r * cols + k).cast()))
            }
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(w.as_ptr().cast::<u16>().add(r * cols + k).cast()),
            ))),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn raw_tile256<const TY: u8, const R: usize, const T: usize>(
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    r: usize,
    t: usize,
    out: *mut f32,
) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
    for k in (0..cols).step_by(16) {
        // SAFETY: rows r..r+R and tokens t..t+T exist (caller), k + 16 <= cols.
        unsafe {
            let xs: [[__m256; 2]; T] = std::array::from_fn(|j| {
                let p = x.as_ptr().add((t + j) * cols + k);
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
            });
            for (i, acc) in acc.iter_mut().enumerate() {
                let wv = [
                    raw_load256::<TY>(w, cols, r + i, k),
                    raw_load256::<TY>(w, cols, r + i, k + 8),
                ];
                for (a, xv) in acc.iter_mut().zip(&xs) {
                    a[0] = _mm256_fmadd_ps(wv[0], xv[0], a[0]);
                    a[1] = _mm256_fmadd_ps(wv[1], xv[1], a[1]);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (j, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; 16];
            // SAFETY: 16 floats into `lanes`; element (t + j, r + i) is this thread's.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a[1]);
                *out.add((t + j) * rows + r + i) = crate::cpu::matmul::reduce16(lanes);
            }
        }
    }
}
