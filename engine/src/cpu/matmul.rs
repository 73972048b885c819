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

use crate::cpu::layout::{BlockView, GROUP, group_block_bytes, high_bits_slot, slot};
pub use crate::cpu::layout::{Offset, QuantizedActs};
use crate::cpu::pool::{SharedOut, ThreadPool, split_range};
use crate::quant::{GgmlType, QK, QK_K, dequantize_row, f16_at};

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
    /// How the activations it multiplies are quantized.
    acts: ActFormat,
    data: PackedData,
}

#[derive(Debug)]
enum PackedData {
    /// Q4_0, Q4_1, Q8_0 and the K-quants: groups of 16 rows, per group and block
    /// `group_block_bytes` of interleaved values (see the module docs), then 16 scales (two
    /// runs of 16 for Q6_K's halves) and minima per group and block (see `BlockView`). Rows
    /// past the end of the matrix are zero with zero scales.
    Blocks { offset: Offset, qs: Vec<u8>, d: Vec<f16>, m: Vec<f16> },
    /// F32, F16, BF16 (and a K-quant whose scales overflow f16): rows as stored in the
    /// file, dequantized on the fly.
    Raw { bytes: Vec<u8>, row_bytes: usize },
}

impl PackedWeight {
    /// Repacks `rows` rows of `cols` elements of type `ty` (validated sizes).
    pub fn new(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> PackedWeight {
        if ty == GgmlType::Q5_0 {
            return PackedWeight::new(GgmlType::Q8_0, rows, cols, &q5_0_as_q8_0(bytes));
        }
        let row_bytes = ty.row_bytes(cols).unwrap_or(0);
        let raw = || PackedData::Raw { bytes: bytes.to_vec(), row_bytes };
        let data = match packed_offset(ty) {
            Some(offset) => {
                let rows_of = (0..rows).map(|r| &bytes[r * row_bytes..(r + 1) * row_bytes]);
                repack(offset, ty, rows, cols, rows_of).unwrap_or_else(raw)
            }
            None => raw(),
        };
        PackedWeight { rows, cols, ty, acts: ActFormat::Blocks32, data }
    }

    /// Quantizes this weight's activations as `acts` says (for the packed types).
    pub fn set_activations(&mut self, acts: ActFormat) {
        self.acts = acts;
    }

    /// What computes products with this weight: its layout and its activations' format.
    pub fn kernel(&self) -> String {
        let PackedData::Blocks { offset, .. } = &self.data else {
            return match self.ty {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                    "widened to f32 in registers (AVX-512/AVX2), f32 multiply-adds".into()
                }
                _ => "dequantized a row at a time, f32 dot products".into(),
            };
        };
        let layout = match offset {
            Offset::Min => "packed 4-bit with minimum",
            Offset::Minus8 => "packed 4-bit",
            Offset::Minus128 => "packed 8-bit",
            Offset::Min8 => "packed 8-bit with minimum",
            Offset::Minus32Halves => "packed 6-bit, a scale per 16",
        };
        let acts = match self.acts {
            ActFormat::Blocks32 => "8-bit activations",
            ActFormat::Split => "split 8+8-bit activations",
        };
        format!("{layout} x {acts}")
    }

    /// Bytes held in memory.
    pub fn memory_bytes(&self) -> usize {
        match &self.data {
            PackedData::Blocks { qs, d, m, .. } => qs.len() + 2 * (d.len() + m.len()),
            PackedData::Raw { bytes, .. } => bytes.len(),
        }
    }

    /// The rows as the file stored them, for the types kept that way (F32, F16, BF16); `None`
    /// for the repacked block types ([`PackedWeight::file_blocks`]).
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
        if !matches!(self.ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
            return None;
        }
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
                    Offset::Min8 | Offset::Minus32Halves => unreachable!("K-quant layouts"),
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
                for b in 0..v.nb {
                    for (i, yi) in out[b * QK..(b + 1) * QK].iter_mut().enumerate() {
                        let q = v.stored(r, b, i);
                        let h = i / 16 * (offset.scales() - 1);
                        let db = v.scale(r, b, h);
                        *yi = match offset {
                            Offset::Min | Offset::Min8 => db * q as f32 + v.offset_term(r, b, 0),
                            Offset::Minus8 => db * (q - 8) as f32,
                            Offset::Minus128 => db * (q - 128) as f32,
                            Offset::Minus32Halves => db * (q - 32) as f32,
                        };
                    }
                }
            }
        }
    }
}

/// The packed layout a file type takes, if any (Q5_0 is widened to Q8_0 before).
fn packed_offset(ty: GgmlType) -> Option<Offset> {
    Some(match ty {
        GgmlType::Q4_1 | GgmlType::Q4K => Offset::Min,
        GgmlType::Q4_0 => Offset::Minus8,
        GgmlType::Q8_0 => Offset::Minus128,
        GgmlType::Q5K => Offset::Min8,
        GgmlType::Q6K => Offset::Minus32Halves,
        _ => return None,
    })
}

/// One 32-element block as the packed layout keeps it: its scales (the second only for
/// `Minus32Halves`), minimum and stored values.
struct Block {
    d: [f32; 2],
    m: f32,
    q: [u8; QK],
}

/// A row of the file's type `ty` as blocks of `offset`'s layout. K-quant super-blocks become
/// 32-element blocks whose scales are the products `d * sc` (and `-dmin * m`) that ggml
/// computes in f32.
fn unpack_row(ty: GgmlType, src: &[u8], out: &mut Vec<Block>) {
    out.clear();
    match ty {
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
            for sb in src.chunks_exact(ty.block_bytes()) {
                let sb = if ty == GgmlType::Q6K {
                    crate::quant::q6k_super_block(sb)
                } else {
                    crate::quant::q45k_super_block(ty, sb)
                };
                for j in 0..QK_K / QK {
                    let mut q = [0u8; QK];
                    q.copy_from_slice(&sb.q[j * QK..(j + 1) * QK]);
                    let d = if ty == GgmlType::Q6K {
                        [sb.scale[2 * j], sb.scale[2 * j + 1]]
                    } else {
                        [sb.scale[j], 0.0]
                    };
                    out.push(Block { d, m: sb.min[j], q });
                }
            }
        }
        _ => {
            for blk in src.chunks_exact(ty.block_bytes()) {
                let mut b = Block { d: [f16_at(blk, 0), 0.0], m: 0.0, q: [0; QK] };
                for (i, q) in b.q.iter_mut().enumerate() {
                    *q = match ty {
                        GgmlType::Q4_1 => (blk[4 + i % 16] >> (4 * (i / 16))) & 0xF,
                        GgmlType::Q4_0 => (blk[2 + i % 16] >> (4 * (i / 16))) & 0xF,
                        _ => blk[2 + i] ^ 0x80,
                    };
                }
                if ty == GgmlType::Q4_1 {
                    b.m = f16_at(blk, 2);
                }
                out.push(b);
            }
        }
    }
}

/// Rows of the file's type `ty` in the packed layout of `offset`; `None` when a K-quant's
/// scale products do not fit in f16 (those weights stay as stored).
///
/// Scales are kept at f16, as the 32-element formats store them; for the K-quants that
/// rounds each sub-block's `d * sc` (relative error at most 2^-11, far below the 8-bit
/// activations' own rounding), which is the one place the packed product can differ from
/// ggml's arithmetic on the same file.
fn repack<'a>(
    offset: Offset,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    src_rows: impl Iterator<Item = &'a [u8]>,
) -> Option<PackedData> {
    let nb = cols / QK;
    let groups = rows.div_ceil(GROUP);
    let gbb = group_block_bytes(offset);
    let ns = offset.scales();
    let mut qs = vec![0u8; groups * nb * gbb];
    let mut d = vec![f16::ZERO; groups * nb * GROUP * ns];
    let mut m = vec![f16::ZERO; if offset.has_min() { groups * nb * GROUP } else { 0 }];
    let half = |x: f32| Some(f16::from_f32(x)).filter(|h| h.is_finite());
    let mut blocks = Vec::with_capacity(nb);
    for (r, src) in src_rows.enumerate() {
        let (g, l) = (r / GROUP, r % GROUP);
        unpack_row(ty, src, &mut blocks);
        for (b, blk) in blocks.iter().enumerate() {
            let gb = g * nb + b;
            for (h, &s) in blk.d[..ns].iter().enumerate() {
                d[(gb * ns + h) * GROUP + l] = half(s)?;
            }
            if offset.has_min() {
                m[gb * GROUP + l] = half(blk.m)?;
            }
            let dst = &mut qs[gb * gbb..(gb + 1) * gbb];
            for (i, &q) in blk.q.iter().enumerate() {
                let (at, high) = slot(offset, l, i);
                let low = if offset == Offset::Minus32Halves { q & 0xF } else { q };
                dst[at] |= if high { low << 4 } else { low };
                if offset == Offset::Minus32Halves {
                    let (at, shift) = high_bits_slot(l, i);
                    dst[at] |= (q >> 4) << shift;
                }
            }
        }
    }
    Some(PackedData::Blocks { offset, qs, d, m })
}

/// How activations are quantized for a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// Per 32 elements, scale `amax / 127` kept at f16 (as ggml's Q8_0 and Q8_1 blocks).
    Blocks32,
    /// [`ActFormat::Blocks32`] and, as a second set of rows, what it left out (the
    /// residual `x - d q`, quantized the same way): two integer products over the same
    /// loaded weights give the activations to about 16 bits. The loader asks for it where
    /// 8 bits lose too much: Gemma 3's attention-output and FFN-down inputs have outliers
    /// that 8 bits alone (ours per 32, or ggml's Q8_K per 256) round far enough to move
    /// log-probabilities past the golden tests' bound.
    Split,
}

impl QuantizedActs {
    /// Quantizes `x` (rows x cols, row-major) in place of the previous contents, spreading
    /// rows over the pool's threads. [`ActFormat::Split`] gives twice the rows: `x`'s, then
    /// their residuals.
    pub fn quantize(
        &mut self,
        pool: &ThreadPool,
        isa: Isa,
        format: ActFormat,
        x: &[f32],
        cols: usize,
    ) {
        let nb = cols / QK;
        let nb_pad = nb.div_ceil(2) * 2;
        let inputs = x.len() / cols;
        let split = format == ActFormat::Split;
        let rows = if split { 2 * inputs } else { inputs };
        self.rows = rows;
        self.nb = nb;
        self.nb_pad = nb_pad;
        self.qs.clear();
        self.qs.resize(rows * nb_pad * QK, 0);
        self.d.clear();
        self.d.resize(rows * nb, 0.0);
        self.sa.clear();
        self.sa.resize(rows * nb, 0.0);
        self.sh.clear();
        self.sh.resize(rows * nb * 2, 0.0);
        let qs = SharedOut(self.qs.as_mut_ptr().cast());
        let d = SharedOut(self.d.as_mut_ptr());
        let sa = SharedOut(self.sa.as_mut_ptr());
        let sh = SharedOut(self.sh.as_mut_ptr());
        // SAFETY: row t's slices of the four buffers (sized above); each row is written by
        // exactly one thread.
        let row = |t: usize| unsafe {
            (
                std::slice::from_raw_parts_mut(qs.get().cast::<i8>().add(t * nb_pad * QK), nb * QK),
                Sums {
                    d: std::slice::from_raw_parts_mut(d.get().add(t * nb), nb),
                    sa: std::slice::from_raw_parts_mut(sa.get().add(t * nb), nb),
                    sh: std::slice::from_raw_parts_mut(sh.get().add(t * nb * 2), nb * 2),
                },
            )
        };
        let rows_of = |range: std::ops::Range<usize>| {
            let mut residual = Vec::new();
            for t in range {
                let xt = &x[t * cols..(t + 1) * cols];
                let (q, mut sums) = row(t);
                quantize_row_q8(isa, xt, q, &mut sums);
                if split {
                    // What the 8-bit values left out, exactly as the kernels will read them.
                    residual.clear();
                    residual.extend(
                        xt.iter().enumerate().map(|(i, &v)| v - sums.d[i / QK] * f32::from(q[i])),
                    );
                    let (q2, mut sums2) = row(inputs + t);
                    quantize_row_q8(isa, &residual, q2, &mut sums2);
                }
            }
        };
        if inputs < 8 {
            rows_of(0..inputs);
        } else {
            let threads = pool.threads();
            pool.run(&|i| rows_of(split_range(inputs, threads, i, 1)));
        }
    }
}

/// A row's per-block outputs besides the values (see [`QuantizedActs`]).
struct Sums<'a> {
    d: &'a mut [f32],
    sa: &'a mut [f32],
    sh: &'a mut [f32],
}

fn quantize_row_q8(isa: Isa, x: &[f32], qs: &mut [i8], sums: &mut Sums<'_>) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni {
        // SAFETY: AVX-512 was detected; the function only enables codegen for it.
        unsafe { quantize_row_q8_avx512(x, qs, sums) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected; the function only enables codegen for them.
        unsafe { quantize_row_q8_avx2(x, qs, sums) };
        return;
    }
    let _ = isa;
    quantize_row_q8_generic(x, qs, sums);
}

/// [`quantize_row_q8_generic`] with AVX-512: the same operations in the same order (the block's
/// largest magnitude, one multiply by its inverse scale, rounding to nearest even under the
/// default MXCSR), so the same bits for finite inputs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn quantize_row_q8_avx512(x: &[f32], qs: &mut [i8], sums: &mut Sums<'_>) {
    use std::arch::x86_64::*;
    for (b, (src, dst)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        // SAFETY: `src` holds 32 floats and `dst` 32 bytes (QK = 32).
        let (h0, h1, db) = unsafe {
            let v0 = _mm512_loadu_ps(src.as_ptr());
            let v1 = _mm512_loadu_ps(src.as_ptr().add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let db = amax / 127.0;
            let id = _mm512_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
            let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
            let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
            _mm_storeu_si128(dst.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(dst.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(q1));
            (_mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1), db)
        };
        write_sums(sums, b, db, [h0, h1]);
    }
}

/// [`quantize_row_q8_generic`] with AVX2, the same bits for finite inputs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_q8_avx2(x: &[f32], qs: &mut [i8], sums: &mut Sums<'_>) {
    use std::arch::x86_64::*;
    for (b, (src, dst)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        // SAFETY: `src` holds 32 floats and `dst` 32 bytes (QK = 32).
        let (h0, h1, db) = unsafe {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(src.as_ptr().add(8 * i)));
            let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            let m =
                v.iter().fold(_mm256_setzero_ps(), |m, &x| _mm256_max_ps(m, _mm256_and_ps(x, abs)));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let db = amax / 127.0;
            let id = _mm256_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
            let q = v.map(|x| _mm256_cvtps_epi32(_mm256_mul_ps(x, id)));
            // Pack to bytes (saturation never bites: |q| <= 127), then undo the lanes' interleave.
            let packed =
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            let packed =
                _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(dst.as_mut_ptr().cast(), packed);
            let sum = |a: __m256i, b: __m256i| {
                let s = _mm256_add_epi32(a, b);
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
            };
            (sum(q[0], q[1]), sum(q[2], q[3]), db)
        };
        write_sums(sums, b, db, [h0, h1]);
    }
}

/// Block `b`'s scale and sums from its largest magnitude over 127 (`db`) and its halves' sums
/// of 8-bit values.
#[inline(always)]
fn write_sums(sums: &mut Sums<'_>, b: usize, db: f32, half: [i32; 2]) {
    // The scale is kept at f16 precision, as llama.cpp's Q8 blocks store it, so products
    // match the reference implementation closely. `sa` stays exact for that scale: the
    // Q8_0 kernels subtract 128 * d_w * sa, which must cancel exactly.
    let dh = f16::from_f32(db).to_f32();
    sums.d[b] = dh;
    sums.sa[b] = dh * (half[0] + half[1]) as f32;
    sums.sh[2 * b] = dh * half[0] as f32;
    sums.sh[2 * b + 1] = dh * half[1] as f32;
}

#[inline(always)]
fn quantize_row_q8_generic(x: &[f32], qs: &mut [i8], sums: &mut Sums<'_>) {
    for (b, (src, dst)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let mut half = [0i32; 2];
        for (i, (q, &v)) in dst.iter_mut().zip(src).enumerate() {
            let qi = (v * id).round_ties_even() as i32;
            *q = qi as i8;
            half[i / 16] += qi;
        }
        write_sums(sums, b, db, half);
    }
}

/// Scratch buffers reused across calls.
#[derive(Debug, Default)]
pub struct MatmulScratch {
    /// The activations in each [`ActFormat`] (indexed by `ActFormat as usize`).
    acts: [QuantizedActs; 2],
    /// Both halves of the split products.
    split_out: Vec<f32>,
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
    matmul_many_with(pool, isa, ws, x, outs, scratch, None);
}

/// Work a caller adds to the products' parallel region (the adapters' updates): every
/// thread `i` runs `before(i)`, its share of the products, then `after(i, outs)`.
pub trait RegionWork: Sync {
    /// Before thread `i`'s share of the products.
    fn before(&self, i: usize);
    /// After thread `i`'s share: the output rows [`product_rows`] gives it (of every token,
    /// in every output) are final, and only this thread touches them until the region ends.
    fn after(&self, i: usize, outs: &[SharedOut]);
}

/// Thread `i`'s share of a product's `rows` output rows, of `threads` (whole groups).
pub fn product_rows(rows: usize, threads: usize, i: usize) -> std::ops::Range<usize> {
    split_range(rows, threads, i, GROUP)
}

/// [`matmul_many`], with `extra` in the products' parallel region (in a region of its own
/// after them where the products take more than one; every thread runs `before` and `after`
/// there, all of them at once, as in one region).
pub fn matmul_many_with(
    pool: &ThreadPool,
    isa: Isa,
    ws: &[&PackedWeight],
    x: &[f32],
    outs: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
    extra: Option<&dyn RegionWork>,
) {
    let ptrs: Vec<SharedOut> = outs.iter_mut().map(|o| SharedOut(o.as_mut_ptr())).collect();
    let apart = |e: &dyn RegionWork| {
        pool.run(&|i| {
            e.before(i);
            e.after(i, &ptrs);
        })
    };
    let Some(cols) = ws.first().map(|w| w.cols) else {
        if let Some(e) = extra {
            apart(e);
        }
        return;
    };
    let t_rows = x.len() / cols;
    let threads = pool.threads();
    let all_blocks =
        ws.iter().all(|w| w.cols == cols && matches!(w.data, PackedData::Blocks { .. }));
    if all_blocks {
        // Each format the weights need, once.
        for format in [ActFormat::Blocks32, ActFormat::Split] {
            if ws.iter().any(|w| w.acts == format) {
                scratch.acts[format as usize].quantize(pool, isa, format, x, cols);
            }
        }
        // A split product's two sets of rows go to a scratch buffer, then add up.
        let mut at = 0;
        let mut split_at = Vec::with_capacity(ws.len());
        for w in ws {
            split_at.push(at);
            if w.acts == ActFormat::Split {
                at += 2 * t_rows * w.rows;
            }
        }
        scratch.split_out.resize(at, 0.0);
        let split_out = SharedOut(scratch.split_out.as_mut_ptr());
        let views: Vec<(BlockView<'_>, &QuantizedActs)> = ws
            .iter()
            .filter_map(|w| match &w.data {
                PackedData::Blocks { offset, qs, d, m } => Some((
                    BlockView { rows: w.rows, nb: w.cols / QK, offset: *offset, qs, d, m },
                    &scratch.acts[w.acts as usize],
                )),
                PackedData::Raw { .. } => None,
            })
            .collect();
        pool.run(&|i| {
            if let Some(e) = extra {
                e.before(i);
            }
            for (((view, acts), out), &at) in views.iter().zip(&ptrs).zip(&split_at) {
                let range = product_rows(view.rows, threads, i);
                if acts.rows == t_rows {
                    // SAFETY: threads write disjoint row ranges (whole groups) of every
                    // token's output row, and each output holds t_rows * rows floats
                    // (checked by the caller's sizing).
                    unsafe { block_rows(isa, view, acts, range, *out) };
                    continue;
                }
                // SAFETY: this view's 2 * t_rows * rows floats of `split_out` start at `at`;
                // threads write disjoint row ranges of them, then add up the same ranges.
                unsafe {
                    let tmp = SharedOut(split_out.get().add(at));
                    block_rows(isa, view, acts, range.clone(), tmp);
                    let (tmp, n) = (tmp.get(), t_rows * view.rows);
                    for t in 0..t_rows {
                        for r in range.clone() {
                            let e = t * view.rows + r;
                            *out.get().add(e) = *tmp.add(e) + *tmp.add(n + e);
                        }
                    }
                }
            }
            if let Some(e) = extra {
                e.after(i, &ptrs);
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
                #[cfg(target_arch = "x86_64")]
                if raw_rows_simd(pool, isa, w, bytes, x, out) {
                    continue;
                }
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
    if let Some(e) = extra {
        apart(e);
    }
}

/// A float-weight kernel: (weights, rows, cols, activations, output rows, output).
#[cfg(target_arch = "x86_64")]
type RawKernel = unsafe fn(&[u8], usize, usize, &[f32], std::ops::Range<usize>, *mut f32);

/// F32, F16 and BF16 weights with the vector kernels of `isa` (`false`: another type, or no
/// vector kernel, and nothing was done). Each product is the weights widened exactly to f32
/// times the activations, summed in 16 lanes by fused multiply-adds and then by
/// [`reduce16`]'s tree: the same bits on AVX-512 and AVX2, whatever the batch or threads.
#[cfg(target_arch = "x86_64")]
fn raw_rows_simd(
    pool: &ThreadPool,
    isa: Isa,
    w: &PackedWeight,
    bytes: &[u8],
    x: &[f32],
    out: SharedOut,
) -> bool {
    use crate::cpu::x86::{RAW_BF16, RAW_F16, RAW_F32, raw_rows_avx2, raw_rows_avx512};
    if isa == Isa::Scalar || !w.cols.is_multiple_of(16) {
        return false;
    }
    let (rows, cols, threads) = (w.rows, w.cols, pool.threads());
    let run = |kernel: RawKernel| {
        pool.run(&|i| {
            let range = split_range(rows, threads, i, 4);
            // SAFETY: `isa` was detected with every feature these kernels use; `bytes`
            // holds rows x cols elements of the type, `x` whole rows of `cols`, `out` room
            // for every token's row, and threads write disjoint row ranges.
            unsafe { kernel(bytes, rows, cols, x, range, out.get()) };
        });
        true
    };
    match (isa, w.ty) {
        (Isa::Avx512Vnni, GgmlType::F32) => run(raw_rows_avx512::<RAW_F32>),
        (Isa::Avx512Vnni, GgmlType::F16) => run(raw_rows_avx512::<RAW_F16>),
        (Isa::Avx512Vnni, GgmlType::BF16) => run(raw_rows_avx512::<RAW_BF16>),
        (Isa::Avx2, GgmlType::F32) => run(raw_rows_avx2::<RAW_F32>),
        (Isa::Avx2, GgmlType::F16) => run(raw_rows_avx2::<RAW_F16>),
        (Isa::Avx2, GgmlType::BF16) => run(raw_rows_avx2::<RAW_BF16>),
        _ => false,
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
pub(crate) fn reduce16(mut acc: [f32; 16]) -> f32 {
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// Fixed-order f32 dot product (16 independent lanes, then a fixed reduction tree). Inlined,
/// so callers compiled for wider vectors get them.
#[inline(always)]
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
    let mut acc = 0f32;
    for b in 0..nb {
        let a = &acts.qs[(t * acts.nb_pad + b) * QK..][..QK];
        let isum = |range: std::ops::Range<usize>| -> i32 {
            range.map(|i| v.stored(r, b, i) * i32::from(a[i])).sum()
        };
        let da = acts.d[t * nb + b];
        if v.offset == Offset::Minus32Halves {
            for h in 0..2 {
                acc += isum(16 * h..16 * (h + 1)) as f32 * (v.scale(r, b, h) * da);
            }
            for h in 0..2 {
                acc += v.offset_term(r, b, h) * acts.sh[(t * nb + b) * 2 + h];
            }
        } else {
            acc += isum(0..QK) as f32 * (v.scale(r, b, 0) * da);
            acc += v.offset_term(r, b, 0) * acts.sa[t * nb + b];
        }
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

    /// The products in f64 of the file's weights, dequantized by the reference code, and
    /// the unquantized activations.
    fn reference(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        let mut row = vec![0f32; cols];
        let t_rows = x.len() / cols;
        let row_bytes = bytes.len() / rows;
        let mut out = vec![0f32; t_rows * rows];
        for r in 0..rows {
            dequantize_row(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
            for t in 0..t_rows {
                let xs = &x[t * cols..(t + 1) * cols];
                let dot: f64 = row.iter().zip(xs).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                out[t * rows + r] = dot as f32;
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
                let want = reference(ty, &bytes, rows, cols, &x);
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

    /// With the activations as the kernels see them (8-bit values times their block's
    /// scale), every kernel's product is the exact sum of the file's dequantized weights
    /// times those activations, but for float rounding and, for the K-quants, the f16
    /// rounding of their scales (2^-11 of each term at most): a wrong half, scale or offset
    /// term in any layout is far outside that.
    #[test]
    fn products_are_the_exact_sums_of_the_dequantized_operands() {
        let pool = ThreadPool::new(2);
        let (rows, cols) = (19, 768);
        let types = GgmlType::ALL
            .into_iter()
            .filter(|t| packed_offset(*t).is_some() || *t == GgmlType::Q5_0);
        for (ty, format) in types.flat_map(|t| [(t, ActFormat::Blocks32), (t, ActFormat::Split)]) {
            // Skewed data: halves and blocks of different magnitudes and signs.
            let wf: Vec<f32> = data(rows * cols, 11)
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v * (1.0 + (i / 16 % 5) as f32) + if i / 16 % 3 == 0 { 0.7 } else { 0.0 }
                })
                .collect();
            let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let mut w = PackedWeight::new(ty, rows, cols, &bytes);
            w.set_activations(format);
            let x: Vec<f32> = data(3 * cols, 12)
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v * (1.0 + (i / 16 % 7) as f32) + if i / 16 % 2 == 0 { 0.5 } else { -0.2 }
                })
                .collect();
            let mut acts = QuantizedActs::default();
            acts.quantize(&pool, Isa::Scalar, format, &x, cols);
            let value = |t: usize, c: usize| {
                f64::from(acts.qs[(t * acts.nb_pad + c / QK) * QK + c % QK])
                    * f64::from(acts.d[t * acts.nb + c / QK])
            };
            // Split activations: each row's 8-bit values plus its residual's.
            let split = acts.rows == 6;
            let xq: Vec<f64> = (0..3 * cols)
                .map(|i| {
                    let (t, c) = (i / cols, i % cols);
                    value(t, c) + if split { value(3 + t, c) } else { 0.0 }
                })
                .collect();
            if split {
                // Half a step of the residual's scale, itself at most half a step of the
                // first: within max|x| / 127^2.
                let worst =
                    x.iter().zip(&xq).map(|(a, b)| (f64::from(*a) - b).abs()).fold(0.0, f64::max);
                let top = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                assert!(
                    worst <= f64::from(top) / 127.0 / 127.0,
                    "{}: split activations off by {worst}",
                    ty.name()
                );
            }
            let row_bytes = bytes.len() / rows;
            let mut row = vec![0f32; cols];
            for isa in available_isas() {
                let mut got = vec![0f32; 3 * rows];
                matmul(&pool, isa, &w, &x, &mut got, &mut MatmulScratch::default());
                for r in 0..rows {
                    dequantize_row(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
                    for t in 0..3 {
                        let xs = &xq[t * cols..(t + 1) * cols];
                        let exact: f64 = row.iter().zip(xs).map(|(a, b)| f64::from(*a) * b).sum();
                        let scale: f64 =
                            row.iter().zip(xs).map(|(a, b)| f64::from(a.abs()) * b.abs()).sum();
                        let g = f64::from(got[t * rows + r]);
                        assert!(
                            (g - exact).abs() <= 2e-3 * scale / 2.0 + 1e-4,
                            "{} {isa:?} row {r} token {t}: {g} vs {exact} (scale {scale})",
                            ty.name()
                        );
                    }
                }
            }
        }
    }

    /// The K-quants' scales are products rounded to f16 (see `repack`): within 2^-11 of each
    /// term; every other type's values are kept exactly.
    #[test]
    fn repacking_keeps_every_value() {
        let k_quants = [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0]
            .into_iter()
            .chain(k_quants)
        {
            let (rows, cols) = (21, 512);
            let wf = data(rows * cols, 9);
            let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let w = PackedWeight::new(ty, rows, cols, &bytes);
            let row_bytes = bytes.len() / rows;
            let (mut got, mut want) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                w.dequantize_row(r, &mut got);
                dequantize_row(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut want);
                if k_quants.contains(&ty) {
                    assert!(w.raw_rows().is_none(), "{} was not repacked", ty.name());
                    // |scale * q| and |min| are each at most the row's largest |value| plus
                    // its largest minimum (2 here: the data lie in -1..=1).
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - e).abs() <= 2.0 * 2.0 / 2048.0,
                            "{} row {r} [{i}]: {g} vs {e}",
                            ty.name()
                        );
                    }
                } else {
                    assert_eq!(got, want, "{} row {r}", ty.name());
                }
            }
        }
    }

    #[test]
    fn activations_quantize_to_the_same_bits_on_every_path() {
        let cols = 256;
        // Wide and narrow blocks, an all-zero one, values on rounding ties (k + 0.5 steps of
        // the scale), negative ones and a block of one outlier.
        let mut x = data(7 * cols, 9);
        x[cols..2 * cols].iter_mut().enumerate().for_each(|(i, v)| *v *= 1e-3 * i as f32);
        x[2 * cols..2 * cols + 32].fill(0.0);
        for (i, v) in x[3 * cols..3 * cols + 32].iter_mut().enumerate() {
            *v = if i == 0 { 127.0 } else { i as f32 - 15.5 };
        }
        x[4 * cols + 40] = -300.0;
        let quantized = |isa: Isa, format: ActFormat| {
            let mut a = QuantizedActs::default();
            a.quantize(&ThreadPool::new(2), isa, format, &x, cols);
            (a.qs.clone(), a.d.clone(), a.sa.clone(), a.sh.clone())
        };
        for format in [ActFormat::Blocks32, ActFormat::Split] {
            let want = quantized(Isa::Scalar, format);
            assert!(want.0.iter().any(|&q| q != 0) && want.1.contains(&0.0));
            for isa in available_isas() {
                assert!(quantized(isa, format) == want, "{isa:?} {format:?}: other bits");
            }
        }
    }

    /// Every type with a kernel, as 24 x 768 weights of random values.
    fn weights_of_every_type() -> impl Iterator<Item = (GgmlType, PackedWeight)> {
        let (rows, cols) = (24, 768);
        [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4K, GgmlType::Q5K]
            .into_iter()
            .chain([GgmlType::Q6K, GgmlType::F32, GgmlType::F16, GgmlType::BF16])
            .map(move |ty| {
                let wf = data(rows * cols, 5);
                let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
                (ty, PackedWeight::new(ty, rows, cols, &bytes))
            })
    }

    #[test]
    fn simd_kernels_agree_with_the_portable_one() {
        let pool = ThreadPool::new(2);
        for (ty, w) in weights_of_every_type() {
            let (rows, cols) = (w.rows, w.cols);
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
    fn a_product_of_no_tokens_reads_and_writes_nothing() {
        // A pass may want no logits at all (a chunk of a long prompt): the LM head's product
        // then has no token rows. The AVX2 decode tiles once read token 0 of it regardless
        // (out of bounds: caught here by the engine's debug assertions).
        let pool = ThreadPool::new(2);
        for (ty, w) in weights_of_every_type() {
            for isa in [Isa::Scalar].into_iter().chain(available_isas()) {
                let mut out: Vec<f32> = Vec::new();
                matmul(&pool, isa, &w, &[], &mut out, &mut MatmulScratch::default());
                assert!(out.is_empty(), "{} {isa:?}", ty.name());
            }
        }
    }

    #[test]
    fn float_weights_give_the_same_bits_on_every_vector_path() {
        // The vector kernels widen F32/F16/BF16 weights and sum in the same 16 lanes and tree
        // on AVX-512 and AVX2; 13 tokens cross tiles of 4 and 2, 37 rows leave a tail.
        let pool = ThreadPool::new(2);
        let (rows, cols) = (37, 2048);
        let vector: Vec<Isa> = available_isas().into_iter().filter(|&i| i != Isa::Scalar).collect();
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            let wf = data(rows * cols, 8);
            let bytes: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let w = PackedWeight::new(ty, rows, cols, &bytes);
            let x = data(13 * cols, 9);
            let outs: Vec<Vec<f32>> = vector
                .iter()
                .map(|&isa| {
                    let mut out = vec![0f32; 13 * rows];
                    matmul(&pool, isa, &w, &x, &mut out, &mut MatmulScratch::default());
                    out
                })
                .collect();
            for (isa, out) in vector.iter().zip(&outs) {
                assert_eq!(out, &outs[0], "{} {isa:?}: other bits", ty.name());
            }
        }
    }

    #[test]
    fn a_row_is_the_same_alone_and_in_a_batch() {
        let pool = ThreadPool::new(2);
        let (rows, cols) = (37, 768);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F16, GgmlType::F32]
            .into_iter()
            .chain([GgmlType::BF16, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K])
        {
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
