//! Matrix products `out[t][r] = dot(W[r], x[t])` for the forward pass.
//!
//! 4-bit and 8-bit weights are repacked once at load time into a layout the SIMD kernels
//! read directly (still quantized, same size as in the file), and activations are quantized
//! per 32-element block to 8 bits, as llama.cpp does. Q5_0 weights are widened to Q8_0 blocks
//! on the way (exact: a 5-bit value is an 8-bit one with the same scale), so they take the
//! 8-bit kernels.
//!
//! The layout interleaves groups of 16 rows: for each group and block, the 32 elements of
//! the 16 rows are stored as 8 "quads" of 4 consecutive elements, each quad as 16 rows x 4
//! bytes, so one 512-bit register holds one quad of all 16 rows. Multiplying it by the
//! token's 4 activation bytes broadcast to every lane (`vpdpbusd`) gives 16 rows' partial
//! sums at once; 8 such products make a block's exact integer sums, which need only one
//! conversion and scaling per block for 16 outputs. The lanes are the output rows, so no
//! horizontal sums are needed, and each output element accumulates its blocks in order
//! with the same operations whatever the batch size, tile shape or thread split: a row's
//! result never depends on what else is in the batch (greedy decoding is batch invariant).

use half::f16;

use crate::cpu::layout::{BlockView, GROUP, group_block_bytes, slot};
pub use crate::cpu::layout::{Offset, QuantizedActs};
use crate::cpu::pool::{SharedOut, ThreadPool, split_range};
use crate::quant::{GgmlType, QK, dequantize_row};

/// Instruction set chosen once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable code.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 VNNI (and BW, VL).
    Avx512Vnni,
}

/// The best instruction set this CPU supports, capped by `SLUICE_ISA` (`scalar`, `avx2`)
/// when set: a diagnostic override to measure or test the other kernels on one machine.
pub fn detect_isa() -> Isa {
    let cap = std::env::var("SLUICE_ISA").unwrap_or_default();
    #[cfg(target_arch = "x86_64")]
    {
        if cap.is_empty()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx512Vnni;
        }
        if cap != "scalar"
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2;
        }
    }
    let _ = cap;
    Isa::Scalar
}

/// A weight matrix in its compute layout.
#[derive(Debug)]
pub struct PackedWeight {
    /// Output rows.
    pub rows: usize,
    /// Input columns (the dot-product length).
    pub cols: usize,
    /// The file's element type.
    pub ty: GgmlType,
    data: PackedData,
}

#[derive(Debug)]
enum PackedData {
    /// Q4_0, Q4_1, Q8_0: groups of 16 rows, per group and block `group_block_bytes` of
    /// interleaved values (see the module docs), then 16 scales (and minima) per group and
    /// block. Rows past the end of the matrix are zero with zero scales.
    Blocks { offset: Offset, qs: Vec<u8>, d: Vec<f16>, m: Vec<f16> },
    /// Everything else: rows as stored in the file, dequantized on the fly.
    Raw { bytes: Vec<u8>, row_bytes: usize },
}

impl PackedWeight {
    /// Repacks `rows` rows of `cols` elements of type `ty` (validated sizes).
    pub fn new(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> PackedWeight {
        if ty == GgmlType::Q5_0 {
            return PackedWeight::new(GgmlType::Q8_0, rows, cols, &q5_0_as_q8_0(bytes));
        }
        let row_bytes = ty.row_bytes(cols).unwrap_or(0);
        let nb = cols / QK;
        let groups = rows.div_ceil(GROUP);
        let data = match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
                let offset = match ty {
                    GgmlType::Q4_1 => Offset::Min,
                    GgmlType::Q4_0 => Offset::Minus8,
                    _ => Offset::Minus128,
                };
                let gbb = group_block_bytes(offset);
                let mut qs = vec![0u8; groups * nb * gbb];
                let mut d = vec![f16::ZERO; groups * nb * GROUP];
                let mut m =
                    vec![f16::ZERO; if offset == Offset::Min { groups * nb * GROUP } else { 0 }];
                let bb = ty.block_bytes();
                for r in 0..rows {
                    let (g, l) = (r / GROUP, r % GROUP);
                    let src = &bytes[r * row_bytes..(r + 1) * row_bytes];
                    for b in 0..nb {
                        let blk = &src[b * bb..(b + 1) * bb];
                        let gb = g * nb + b;
                        d[gb * GROUP + l] = f16::from_le_bytes([blk[0], blk[1]]);
                        let dst = &mut qs[gb * gbb..(gb + 1) * gbb];
                        for i in 0..QK {
                            let q = match offset {
                                Offset::Min => {
                                    m[gb * GROUP + l] = f16::from_le_bytes([blk[2], blk[3]]);
                                    (blk[4 + i % 16] >> (4 * (i / 16))) & 0xF
                                }
                                Offset::Minus8 => (blk[2 + i % 16] >> (4 * (i / 16))) & 0xF,
                                Offset::Minus128 => blk[2 + i] ^ 0x80,
                            };
                            let (at, high) = slot(offset, l, i);
                            dst[at] |= if high { q << 4 } else { q };
                        }
                    }
                }
                PackedData::Blocks { offset, qs, d, m }
            }
            _ => PackedData::Raw { bytes: bytes.to_vec(), row_bytes },
        };
        PackedWeight { rows, cols, ty, data }
    }

    /// Bytes held in memory.
    pub fn memory_bytes(&self) -> usize {
        match &self.data {
            PackedData::Blocks { qs, d, m, .. } => qs.len() + 2 * (d.len() + m.len()),
            PackedData::Raw { bytes, .. } => bytes.len(),
        }
    }

    /// The rows as the file stored them, for the types kept that way (F32, F16, BF16 and the
    /// K-quants); `None` for the repacked block types ([`PackedWeight::file_blocks`]).
    pub fn raw_rows(&self) -> Option<&[u8]> {
        match &self.data {
            PackedData::Raw { bytes, .. } => Some(bytes),
            PackedData::Blocks { .. } => None,
        }
    }

    /// The weight as the file stored it (GGML blocks, row after row) for the 4- and 8-bit
    /// block types, rebuilt from the packed layout; `None` for the other types. For a device
    /// that dequantizes on its own: it takes the quantized bytes, not four-byte floats.
    pub fn file_blocks(&self) -> Option<Vec<u8>> {
        let PackedData::Blocks { offset, qs, d, m } = &self.data else {
            return None;
        };
        let v = BlockView { rows: self.rows, nb: self.cols / QK, offset: *offset, qs, d, m };
        let mut out = Vec::with_capacity(self.rows * v.nb * self.ty.block_bytes());
        for r in 0..self.rows {
            let l = r % GROUP;
            for b in 0..v.nb {
                let gb = (r / GROUP) * v.nb + b;
                out.extend_from_slice(&v.d[gb * GROUP + l].to_le_bytes());
                // `stored` gives each element as packed: a byte (8-bit) or a nibble (4-bit).
                let q = |i: usize| v.stored(r, b, i) as u8;
                match offset {
                    Offset::Minus128 => out.extend((0..QK).map(|i| q(i) ^ 0x80)),
                    Offset::Min | Offset::Minus8 => {
                        if *offset == Offset::Min {
                            out.extend_from_slice(&v.m[gb * GROUP + l].to_le_bytes());
                        }
                        out.extend((0..QK / 2).map(|i| q(i) | (q(i + QK / 2) << 4)));
                    }
                }
            }
        }
        Some(out)
    }

    /// Dequantizes row `r` into `out` (embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match &self.data {
            PackedData::Raw { bytes, row_bytes } => {
                dequantize_row(self.ty, &bytes[r * row_bytes..(r + 1) * row_bytes], out)
            }
            PackedData::Blocks { offset, qs, d, m } => {
                let v =
                    BlockView { rows: self.rows, nb: self.cols / QK, offset: *offset, qs, d, m };
                let l = r % GROUP;
                for b in 0..v.nb {
                    let gb = (r / GROUP) * v.nb + b;
                    let db = v.d[gb * GROUP + l].to_f32();
                    for (i, yi) in out[b * QK..(b + 1) * QK].iter_mut().enumerate() {
                        let q = v.stored(r, b, i);
                        *yi = match offset {
                            Offset::Min => db * q as f32 + v.m[gb * GROUP + l].to_f32(),
                            Offset::Minus8 => db * (q - 8) as f32,
                            Offset::Minus128 => db * (q - 128) as f32,
                        };
                    }
                }
            }
        }
    }
}

impl QuantizedActs {
    /// Quantizes `x` (rows x cols, row-major) in place of the previous contents, spreading
    /// rows over the pool's threads.
    pub fn quantize(&mut self, pool: &ThreadPool, isa: Isa, x: &[f32], cols: usize) {
        let nb = cols / QK;
        let nb_pad = nb.div_ceil(2) * 2;
        let rows = x.len() / cols;
        self.rows = rows;
        self.nb = nb;
        self.nb_pad = nb_pad;
        self.qs.clear();
        self.qs.resize(rows * nb_pad * QK, 0);
        self.d.clear();
        self.d.resize(rows * nb, 0.0);
        self.sa.clear();
        self.sa.resize(rows * nb, 0.0);
        let qs = SharedOut(self.qs.as_mut_ptr().cast());
        let d = SharedOut(self.d.as_mut_ptr());
        let sa = SharedOut(self.sa.as_mut_ptr());
        let rows_of = |range: std::ops::Range<usize>| {
            for t in range {
                // SAFETY: row t's slices of the three buffers (sized above) are written by
                // exactly one thread.
                let (q, dd, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(
                            qs.get().cast::<i8>().add(t * nb_pad * QK),
                            nb * QK,
                        ),
                        std::slice::from_raw_parts_mut(d.get().add(t * nb), nb),
                        std::slice::from_raw_parts_mut(sa.get().add(t * nb), nb),
                    )
                };
                quantize_row_q8(isa, &x[t * cols..(t + 1) * cols], q, dd, s);
            }
        };
        if rows < 8 {
            rows_of(0..rows);
        } else {
            let threads = pool.threads();
            pool.run(&|i| rows_of(split_range(rows, threads, i, 1)));
        }
    }
}

fn quantize_row_q8(isa: Isa, x: &[f32], qs: &mut [i8], d: &mut [f32], sa: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni {
        // SAFETY: AVX-512 was detected; the function only enables codegen for it.
        unsafe { quantize_row_q8_avx512(x, qs, d, sa) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected; the function only enables codegen for them.
        unsafe { quantize_row_q8_avx2(x, qs, d, sa) };
        return;
    }
    let _ = isa;
    quantize_row_q8_generic(x, qs, d, sa);
}

/// The generic code compiled with AVX-512 enabled (same arithmetic, vector instructions).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn quantize_row_q8_avx512(x: &[f32], qs: &mut [i8], d: &mut [f32], sa: &mut [f32]) {
    quantize_row_q8_generic(x, qs, d, sa)
}

/// The generic code compiled with AVX2 enabled.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_q8_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], sa: &mut [f32]) {
    quantize_row_q8_generic(x, qs, d, sa)
}

#[inline(always)]
fn quantize_row_q8_generic(x: &[f32], qs: &mut [i8], d: &mut [f32], sa: &mut [f32]) {
    for (b, (src, dst)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in dst.iter_mut().zip(src) {
            let qi = (v * id).round_ties_even() as i32;
            *q = qi as i8;
            sum += qi;
        }
        // The scale is kept at f16 precision, as llama.cpp's Q8 blocks store it, so products
        // match the reference implementation closely. `sa` stays exact for that scale: the
        // Q8_0 kernels subtract 128 * d_w * sa, which must cancel exactly.
        let dh = f16::from_f32(db).to_f32();
        d[b] = dh;
        sa[b] = dh * sum as f32;
    }
}

/// Scratch buffers reused across calls.
#[derive(Debug, Default)]
pub struct MatmulScratch {
    acts: QuantizedActs,
}

/// `out[t * w.rows + r] = dot(W[r], x[t])` for every token row `t` of `x`.
pub fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    w: &PackedWeight,
    x: &[f32],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_many(pool, isa, &[w], x, &mut [out], scratch);
}

/// Several products of the same input (Q, K and V; gate and up): the activations are
/// quantized once and every matrix is computed in one parallel region.
pub fn matmul_many(
    pool: &ThreadPool,
    isa: Isa,
    ws: &[&PackedWeight],
    x: &[f32],
    outs: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    let Some(cols) = ws.first().map(|w| w.cols) else { return };
    let t_rows = x.len() / cols;
    let threads = pool.threads();
    let ptrs: Vec<SharedOut> = outs.iter_mut().map(|o| SharedOut(o.as_mut_ptr())).collect();
    let all_blocks =
        ws.iter().all(|w| w.cols == cols && matches!(w.data, PackedData::Blocks { .. }));
    if all_blocks {
        scratch.acts.quantize(pool, isa, x, cols);
        let acts = &scratch.acts;
        let views: Vec<BlockView<'_>> = ws
            .iter()
            .filter_map(|w| match &w.data {
                PackedData::Blocks { offset, qs, d, m } => {
                    Some(BlockView { rows: w.rows, nb: w.cols / QK, offset: *offset, qs, d, m })
                }
                PackedData::Raw { .. } => None,
            })
            .collect();
        pool.run(&|i| {
            for (view, out) in views.iter().zip(&ptrs) {
                let range = split_range(view.rows, threads, i, GROUP);
                // SAFETY: threads write disjoint row ranges (whole groups) of every token's
                // output row, and each output holds t_rows * rows floats (checked by the
                // caller's sizing).
                unsafe { block_rows(isa, view, acts, range, *out) };
            }
        });
        return;
    }
    for (w, out) in ws.iter().zip(&ptrs) {
        let out = *out;
        match &w.data {
            PackedData::Blocks { .. } => {
                // SAFETY: `out` came from a distinct `&mut [f32]` of t_rows * w.rows floats.
                let o = unsafe { std::slice::from_raw_parts_mut(out.get(), t_rows * w.rows) };
                matmul_many(pool, isa, &[*w], x, &mut [o], scratch);
            }
            PackedData::Raw { bytes, row_bytes } => {
                pool.run(&|i| {
                    let range = split_range(w.rows, threads, i, 1);
                    let mut deq = vec![0f32; w.cols];
                    for r in range {
                        dequantize_row(w.ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut deq);
                        for t in 0..t_rows {
                            let v = dot_f32(&deq, &x[t * w.cols..(t + 1) * w.cols]);
                            // SAFETY: element (t, r) belongs to this thread's row range only.
                            unsafe { *out.get().add(t * w.rows + r) = v };
                        }
                    }
                });
            }
        }
    }
}

/// Q5_0 blocks rewritten as Q8_0 blocks of the same values and scales.
fn q5_0_as_q8_0(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() / 22 * 34);
    for b in bytes.chunks_exact(22) {
        out.extend_from_slice(&b[..2]);
        let (lo, hi) = crate::quant::q5_0_values(b);
        out.extend(lo.iter().chain(&hi).map(|&v| v as u8));
    }
    out
}

/// Sums 16 lanes with a fixed reduction tree.
fn reduce16(mut acc: [f32; 16]) -> f32 {
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// Fixed-order f32 dot product (16 independent lanes, then a fixed reduction tree).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    reduce16(acc)
}

/// Computes output rows `range` for all tokens.
///
/// # Safety
/// `out` must point to `acts.rows * v.rows` floats, and no other thread may write the
/// elements of rows in `range`.
unsafe fn block_rows(
    isa: Isa,
    v: &BlockView<'_>,
    acts: &QuantizedActs,
    range: std::ops::Range<usize>,
    out: SharedOut,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni {
        // SAFETY: `isa` is only `Avx512Vnni` when detection found every feature used, and
        // the caller's contract on `out` is passed on unchanged.
        unsafe { crate::cpu::x86::block_rows_avx512(v, acts, range, out.get()) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: `isa` is only `Avx2` when AVX2, FMA and F16C were detected.
        unsafe { crate::cpu::x86::block_rows_avx2(v, acts, range, out.get()) };
        return;
    }
    let _ = isa;
    for r in range {
        for t in 0..acts.rows {
            let val = scalar_dot(v, acts, r, t);
            // SAFETY: (t, r) lies inside `out` and row r is ours (caller's contract).
            unsafe { *out.get().add(t * v.rows + r) = val };
        }
    }
}

/// Portable reference: the same integer sums per block and the same float operations per
/// block as the SIMD kernels (which fuse the multiply-adds).
fn scalar_dot(v: &BlockView<'_>, acts: &QuantizedActs, r: usize, t: usize) -> f32 {
    let nb = v.nb;
    let l = r % GROUP;
    let mut acc = 0f32;
    for b in 0..nb {
        let gb = (r / GROUP) * nb + b;
        let a = &acts.qs[(t * acts.nb_pad + b) * QK..][..QK];
        let isum: i32 = (0..QK).map(|i| v.stored(r, b, i) * i32::from(a[i])).sum();
        let dw = v.d[gb * GROUP + l].to_f32();
        let c = match v.offset {
            Offset::Min => v.m[gb * GROUP + l].to_f32(),
            Offset::Minus8 => -8.0 * dw,
            Offset::Minus128 => -128.0 * dw,
        };
        acc += isum as f32 * (dw * acts.d[t * nb + b]);
        acc += c * acts.sa[t * nb + b];
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    #[test]
    fn file_blocks_give_back_the_files_bytes() {
        // 37 rows: the last group of 16 is partial.
        let (rows, cols) = (37, 96);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let bytes: Vec<u8> =
                (0..rows).flat_map(|r| quantize_row(ty, &data(cols, r as u32 + 7))).collect();
            let w = PackedWeight::new(ty, rows, cols, &bytes);
            assert_eq!(w.file_blocks().as_deref(), Some(&bytes[..]), "{ty:?}");
        }
        let f16_bytes: Vec<u8> =
            data(4 * 32, 3).iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect();
        assert!(PackedWeight::new(GgmlType::F16, 4, 32, &f16_bytes).file_blocks().is_none());
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Every kernel this CPU can run (the portable one always).
    fn available_isas() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2);
            }
        }
        if detect_isa() == Isa::Avx512Vnni {
            v.push(Isa::Avx512Vnni);
        }
        v
    }

    fn reference(w: &PackedWeight, x: &[f32]) -> Vec<f32> {
        let mut row = vec![0f32; w.cols];
        let t_rows = x.len() / w.cols;
        let mut out = vec![0f32; t_rows * w.rows];
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            for t in 0..t_rows {
                let xs = &x[t * w.cols..(t + 1) * w.cols];
                out[t * w.rows + r] = row.iter().zip(xs).map(|(a, b)| a * b).sum();
            }
        }
        out
    }

    #[test]
    fn every_type_matches_the_dequantized_reference() {
        let pool = ThreadPool::new(2);
        for ty in GgmlType::ALL {
            for (rows, cols) in [(7, 256), (9, 96), (16, 512)] {
                if cols % ty.block_elems() != 0 {
                    continue;
                }
                let wf = data(rows * cols, 1);
                let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
                let w = PackedWeight::new(ty, rows, cols, &bytes);
                let x = data(5 * cols, 2);
                let want = reference(&w, &x);
                for isa in available_isas() {
                    let mut got = vec![0f32; want.len()];
                    matmul(&pool, isa, &w, &x, &mut got, &mut MatmulScratch::default());
                    for (g, e) in got.iter().zip(&want) {
                        // 8-bit activations: error grows with sqrt(cols).
                        assert!(
                            (g - e).abs() < 0.02 * (cols as f32).sqrt(),
                            "{} {isa:?}: {g} vs {e}",
                            ty.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn repacking_keeps_every_value() {
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0] {
            let (rows, cols) = (21, 96);
            let wf = data(rows * cols, 9);
            let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let w = PackedWeight::new(ty, rows, cols, &bytes);
            let row_bytes = bytes.len() / rows;
            let (mut got, mut want) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                w.dequantize_row(r, &mut got);
                dequantize_row(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut want);
                assert_eq!(got, want, "{} row {r}", ty.name());
            }
        }
    }

    #[test]
    fn simd_kernels_agree_with_the_portable_one() {
        let pool = ThreadPool::new(2);
        let (rows, cols) = (24, 576);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0] {
            let wf = data(rows * cols, 5);
            let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let w = PackedWeight::new(ty, rows, cols, &bytes);
            let x = data(3 * cols, 6);
            let mut want = vec![0f32; 3 * rows];
            matmul(&pool, Isa::Scalar, &w, &x, &mut want, &mut MatmulScratch::default());
            for isa in available_isas() {
                let mut got = vec![0f32; want.len()];
                matmul(&pool, isa, &w, &x, &mut got, &mut MatmulScratch::default());
                for (g, e) in got.iter().zip(&want) {
                    assert!(
                        (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                        "{} {isa:?}: {g} vs {e}",
                        ty.name()
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_is_the_same_alone_and_in_a_batch() {
        let pool = ThreadPool::new(2);
        let (rows, cols) = (37, 576);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F16] {
            let wf = data(rows * cols, 3);
            let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let w = PackedWeight::new(ty, rows, cols, &bytes);
            let x = data(11 * cols, 4);
            for isa in available_isas() {
                let mut batch = vec![0f32; 11 * rows];
                matmul(&pool, isa, &w, &x, &mut batch, &mut MatmulScratch::default());
                for t in 0..11 {
                    let mut alone = vec![0f32; rows];
                    let xt = &x[t * cols..(t + 1) * cols];
                    matmul(&pool, isa, &w, xt, &mut alone, &mut MatmulScratch::default());
                    let (b, n) = (&batch[t * rows..(t + 1) * rows], ty.name());
                    assert_eq!(b, &alone[..], "{n} {isa:?} token {t}");
                }
            }
        }
    }
}
