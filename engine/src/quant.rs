//! Tensor element types and their block layouts (the GGML formats), with reference
//! dequantization and quantization.
//!
//! Layouts follow ggml's `ggml-common.h`: Q4_0 is 18 bytes per 32 weights, Q4_1 20 bytes,
//! Q5_0 22 bytes, Q8_0 34 bytes, the K-quants use 256-weight super-blocks. Quantizers here are simple
//! round-to-nearest ones used to write test models; the engine never re-quantizes weights.

use half::{bf16, f16};

pub use sluice_text::ggml::{GgmlType, QK, QK_K};

/// The little-endian f16 at byte `i` of `b`, as f32.
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one row. `src` holds exactly `dst.len()` elements of type `ty`; callers
/// validate sizes (see [`GgmlType::row_bytes`]).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (y, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (yi, &q) in y.iter_mut().zip(&b[2..34]) {
                    *yi = f32::from(q as i8) * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (y, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..18].iter().enumerate() {
                    y[j] = (f32::from(q & 0xF) - 8.0) * d;
                    y[j + 16] = (f32::from(q >> 4) - 8.0) * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (y, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for (j, &q) in b[4..20].iter().enumerate() {
                    y[j] = f32::from(q & 0xF) * d + m;
                    y[j + 16] = f32::from(q >> 4) * d + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (y, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(22)) {
                let d = f16_at(b, 0);
                let (lo, hi) = q5_0_values(b);
                for j in 0..16 {
                    y[j] = f32::from(lo[j]) * d;
                    y[j + 16] = f32::from(hi[j]) * d;
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            for (y, b) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(ty.block_bytes())) {
                dequantize_q45k_block(ty, b, y);
            }
        }
        GgmlType::Q6K => {
            for (y, b) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(210)) {
                dequantize_q6k_block(b, y);
            }
        }
    }
}

/// The signed values (-16..=15) of a Q5_0 block's first and second halves: four bits each
/// from `qs`, the fifth from the 32-bit `qh` (bit `j` for element `j`).
pub fn q5_0_values(b: &[u8]) -> ([i8; 16], [i8; 16]) {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let (mut lo, mut hi) = ([0i8; 16], [0i8; 16]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        lo[j] = ((q & 0xF) | (h0 << 4)) as i8 - 16;
        hi[j] = ((q >> 4) | (h1 << 4)) as i8 - 16;
    }
    (lo, hi)
}

/// Unpacks the 6-bit scale and minimum of sub-block `j` of a Q4_K or Q5_K super-block.
fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// A K-quant super-block unpacked: element `i` is `scale[i / 32 or i / 16] * q[i] + min[i / 32]`
/// (Q4_K, Q5_K: `d * sc` and `-dmin * m` per 32 elements, computed in f32 as ggml does), or
/// `scale[i / 16] * (q[i] - 32)` (Q6_K: `d * sc` per 16 elements, `min` unused).
pub struct SuperBlock {
    /// Per sub-block scales: 8 used by Q4_K and Q5_K, 16 by Q6_K.
    pub scale: [f32; 16],
    /// Per 32-element sub-block offsets (Q4_K, Q5_K).
    pub min: [f32; 8],
    /// The unsigned stored values: 0..=15 (Q4_K), 0..=31 (Q5_K), 0..=63 (Q6_K).
    pub q: [u8; QK_K],
}

/// Unpacks one Q4_K (144 bytes) or Q5_K (176 bytes) super-block.
pub fn q45k_super_block(ty: GgmlType, b: &[u8]) -> SuperBlock {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let mut out = SuperBlock { scale: [0.0; 16], min: [0.0; 8], q: [0; QK_K] };
    for j in 0..8 {
        let (sc, m) = q4k_scale_min(j, scales);
        out.scale[j] = d * f32::from(sc);
        out.min[j] = -(dmin * f32::from(m));
    }
    // Q5_K: the fifth bits of element 64 c + l (and + 32) are bits 2c (and 2c + 1) of qh[l].
    let (qh, qs) =
        if ty == GgmlType::Q5K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
    for (c, q) in qs.chunks_exact(32).enumerate() {
        for l in 0..32 {
            let (hi0, hi1) = qh.map_or((0, 0), |h| {
                (((h[l] >> (2 * c)) & 1) << 4, ((h[l] >> (2 * c + 1)) & 1) << 4)
            });
            out.q[64 * c + l] = (q[l] & 0xF) | hi0;
            out.q[64 * c + 32 + l] = (q[l] >> 4) | hi1;
        }
    }
    out
}

/// Unpacks one Q6_K super-block (210 bytes).
pub fn q6k_super_block(b: &[u8]) -> SuperBlock {
    let (ql_all, rest) = b.split_at(128);
    let (qh_all, rest) = rest.split_at(64);
    let (sc_all, dbytes) = rest.split_at(16);
    let d = f16_at(dbytes, 0);
    let mut out = SuperBlock { scale: [0.0; 16], min: [0.0; 8], q: [0; QK_K] };
    for (s, &sc) in out.scale.iter_mut().zip(sc_all) {
        *s = d * f32::from(sc as i8);
    }
    for half in 0..2 {
        let ql = &ql_all[64 * half..];
        let qh = &qh_all[32 * half..];
        let q = &mut out.q[128 * half..];
        for l in 0..32 {
            q[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    out
}

fn dequantize_q45k_block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    let sb = q45k_super_block(ty, b);
    for (i, yi) in y.iter_mut().enumerate() {
        *yi = sb.scale[i / 32] * f32::from(sb.q[i]) + sb.min[i / 32];
    }
}

fn dequantize_q6k_block(b: &[u8], y: &mut [f32]) {
    let sb = q6k_super_block(b);
    for (i, yi) in y.iter_mut().enumerate() {
        *yi = sb.scale[i / 16] * (i32::from(sb.q[i]) - 32) as f32;
    }
}

/// Quantizes one row (length a multiple of the block size) with simple round-to-nearest.
/// Used to write test models and to check the loaders; never on the serving path.
pub fn quantize_row(ty: GgmlType, src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.row_bytes(src.len()).unwrap_or(0));
    match ty {
        GgmlType::F32 => src.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        GgmlType::F16 => {
            src.iter().for_each(|x| out.extend_from_slice(&f16::from_f32(*x).to_le_bytes()))
        }
        GgmlType::BF16 => {
            src.iter().for_each(|x| out.extend_from_slice(&bf16::from_f32(*x).to_le_bytes()))
        }
        GgmlType::Q8_0 => {
            for x in src.chunks_exact(QK) {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        GgmlType::Q4_0 => {
            for x in src.chunks_exact(QK) {
                let max = x.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
            }
        }
        GgmlType::Q4_1 => {
            for x in src.chunks_exact(QK) {
                let min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
            }
        }
        GgmlType::Q5_0 => {
            for x in src.chunks_exact(QK) {
                let max = x.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 16.5) as i32).clamp(0, 31) as u32;
                let qh = (0..16).fold(0u32, |h, j| {
                    h | ((q(x[j]) >> 4) << j) | ((q(x[j + 16]) >> 4) << (j + 16))
                });
                out.extend_from_slice(&qh.to_le_bytes());
                out.extend(
                    (0..16).map(|j| (q(x[j]) & 0xF) as u8 | (((q(x[j + 16]) & 0xF) as u8) << 4)),
                );
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            src.chunks_exact(QK_K).for_each(|x| quantize_q45k_block(ty, x, &mut out))
        }
        GgmlType::Q6K => src.chunks_exact(QK_K).for_each(|x| quantize_q6k_block(x, &mut out)),
    }
    out
}

/// Q4_K (`ty` Q4K, 15 levels) or Q5_K (31 levels) by round-to-nearest.
fn quantize_q45k_block(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) {
    let levels = if ty == GgmlType::Q5K { 31.0 } else { 15.0 };
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let min = sub.iter().fold(0f32, |a, &v| a.min(v));
        let max = sub.iter().fold(0f32, |a, &v| a.max(v));
        scales[j] = (max - min) / levels;
        mins[j] = -min;
    }
    let max_scale = scales.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let q6 = |v: f32, s: f32| if s > 0.0 { ((v / s).round() as i32).clamp(0, 63) as u8 } else { 0 };
    let ls: Vec<u8> = scales.iter().map(|&s| q6(s, df)).collect();
    let lm: Vec<u8> = mins.iter().map(|&m| q6(m, dminf)).collect();
    let mut packed = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            packed[j] = ls[j];
            packed[j + 4] = lm[j];
        } else {
            packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            packed[j - 4] |= (ls[j] >> 4) << 6;
            packed[j] |= (lm[j] >> 4) << 6;
        }
    }
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    out.extend_from_slice(&packed);
    let mut q = [0u8; QK_K];
    for j in 0..8 {
        let s = df * f32::from(ls[j]);
        let m = dminf * f32::from(lm[j]);
        for l in 0..32 {
            let v = x[32 * j + l];
            q[32 * j + l] = if s > 0.0 {
                (((v + m) / s).round() as i32).clamp(0, levels as i32) as u8
            } else {
                0
            };
        }
    }
    if ty == GgmlType::Q5K {
        let mut qh = [0u8; 32];
        for (i, &v) in q.iter().enumerate() {
            let (c, within) = (i / 64, i % 64);
            qh[within % 32] |= ((v >> 4) & 1) << (2 * c + within / 32);
        }
        out.extend_from_slice(&qh);
    }
    for chunk in 0..4 {
        for l in 0..32 {
            out.push((q[64 * chunk + l] & 0xF) | ((q[64 * chunk + 32 + l] & 0xF) << 4));
        }
    }
}

fn quantize_q6k_block(x: &[f32], out: &mut Vec<u8>) {
    let mut scales = [0f32; 16];
    for (j, sub) in x.chunks_exact(16).enumerate() {
        let amax = sub.iter().fold(0f32, |a, v| a.max(v.abs()));
        scales[j] = amax / 31.0;
    }
    let max_scale = scales.iter().fold(0f32, |a, &v| a.max(v));
    let d = f16::from_f32(max_scale / 127.0);
    let df = d.to_f32();
    let sc: Vec<i8> = scales
        .iter()
        .map(|&s| if df > 0.0 { ((s / df).round() as i32).clamp(-128, 127) as i8 } else { 0 })
        .collect();
    let mut q = [0u8; QK_K];
    for (i, v) in x.iter().enumerate() {
        let s = df * f32::from(sc[i / 16]);
        q[i] = if s != 0.0 { ((v / s).round() as i32).clamp(-32, 31) + 32 } else { 32 } as u8;
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let qq = &q[128 * half..];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (qq[l], qq[l + 32], qq[l + 64], qq[l + 96]);
            ql[64 * half + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[64 * half + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[32 * half + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&d.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect()
    }

    #[test]
    fn round_trip_error_is_bounded_for_every_type() {
        let x = ramp(512);
        for ty in GgmlType::ALL {
            let bytes = quantize_row(ty, &x);
            assert_eq!(Some(bytes.len()), ty.row_bytes(x.len()), "{}", ty.name());
            let mut y = vec![0f32; x.len()];
            dequantize_row(ty, &bytes, &mut y);
            let max_err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let bound = match ty {
                GgmlType::F32 => 0.0,
                GgmlType::F16 => 1e-3,
                GgmlType::BF16 => 1e-2,
                GgmlType::Q8_0 => 0.02,
                GgmlType::Q6K => 0.08,
                // One step (max |x| / 16): the largest value of the sign opposite to the
                // extreme one clamps at 15 steps, as in ggml.
                GgmlType::Q5_0 | GgmlType::Q5K => 0.13,
                GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => 0.25,
            };
            assert!(max_err <= bound, "{}: max error {max_err} > {bound}", ty.name());
        }
    }

    #[test]
    fn known_q4_1_block() {
        // d = 0.5, m = -1.0; nibbles: low = j % 16, high = 15 - j % 16.
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b.extend((0u8..16).map(|j| j | ((15 - j) << 4)));
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q4_1, &b, &mut y);
        assert_eq!(y[0], -1.0);
        assert_eq!(y[3], 0.5);
        assert_eq!(y[16], 6.5);
        assert_eq!(y[31], -1.0);
    }

    #[test]
    fn known_q4_0_and_q8_0_blocks() {
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b.extend((0u8..16).map(|j| j | (8 << 4)));
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q4_0, &b, &mut y);
        assert_eq!(&y[..3], &[-16.0, -14.0, -12.0]);
        assert!(y[16..].iter().all(|&v| v == 0.0));

        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.25).to_le_bytes());
        b.extend((0..32).map(|j: i32| (j - 16) as i8 as u8));
        dequantize_row(GgmlType::Q8_0, &b, &mut y);
        assert_eq!(y[0], -4.0);
        assert_eq!(y[31], 3.75);
    }

    #[test]
    fn known_q5_0_block() {
        // d = 0.5; element j's low nibble j % 16, fifth bit set for elements 1 and 17.
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&((1u32 << 1) | (1u32 << 17)).to_le_bytes());
        b.extend((0u8..16).map(|j| j | (j << 4)));
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q5_0, &b, &mut y);
        assert_eq!(y[0], -8.0); // (0 - 16) * 0.5
        assert_eq!(y[1], 0.5); // (1 + 16 - 16) * 0.5
        assert_eq!(y[15], -0.5);
        assert_eq!(y[17], 0.5);
        assert_eq!(y[16], -8.0);
    }

    #[test]
    fn known_q4k_block() {
        // d = 1, dmin = 0.5; sub-block 0: scale 2, min 4 -> y = 2 q - 2; sub-block 5: scale
        // 33 (needs the high bits), min 1 -> y = 33 q - 0.5.
        let mut scales = [0u8; 12];
        scales[0] = 2;
        scales[4] = 4;
        // j = 5: low nibbles in scales[9], high bits in scales[1] (scale) and scales[5] (min).
        scales[9] = (33 & 0xF) | ((1 & 0xF) << 4);
        scales[1] |= (33 >> 4) << 6;
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&scales);
        let mut qs = [0u8; 128];
        qs[0] = 3; // element 0 (sub-block 0): q = 3
        qs[64 + 1] = 2 << 4; // element 2*64 + 32 + 1 = 161 (sub-block 5): q = 2
        b.extend_from_slice(&qs);
        let mut y = [0f32; 256];
        dequantize_row(GgmlType::Q4K, &b, &mut y);
        assert_eq!(y[0], 4.0);
        assert_eq!(y[1], -2.0);
        assert_eq!(y[161], 65.5);
        assert_eq!(y[160], -0.5);
    }

    #[test]
    fn known_q5k_block() {
        // d = 1, dmin = 0.5; sub-block 0: scale 2, min 4 -> y = 2 q - 2; sub-block 3
        // (elements 96..128, the high nibbles of bytes 32..64, fifth bits at bit 3 of qh):
        // scale 1, min 0.
        let mut scales = [0u8; 12];
        scales[0] = 2;
        scales[4] = 4;
        scales[3] = 1;
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&scales);
        let mut qh = [0u8; 32];
        qh[0] = 1; // element 0: fifth bit
        qh[5] = 1 << 3; // element 96 + 5: fifth bit
        b.extend_from_slice(&qh);
        let mut qs = [0u8; 128];
        qs[0] = 3; // element 0: low bits 3 -> q = 19
        qs[32 + 5] = 7 << 4; // element 96 + 5: low bits 7 -> q = 23
        b.extend_from_slice(&qs);
        assert_eq!(b.len(), GgmlType::Q5K.block_bytes());
        let mut y = [0f32; 256];
        dequantize_row(GgmlType::Q5K, &b, &mut y);
        assert_eq!(y[0], 36.0);
        assert_eq!(y[1], -2.0);
        assert_eq!(y[101], 23.0);
        assert_eq!(y[100], 0.0);
    }

    #[test]
    fn known_q6k_block() {
        // d = 0.5, scale of sub-block 0 = 3, sub-block 9 = -2.
        let mut b = vec![0u8; 210];
        b[0] = 0x5; // element 0: low 4 bits 5
        b[128] = 0x2; // element 0: high 2 bits 2 -> q = 37 - 32 = 5
        b[192] = 3;
        b[192 + 9] = (-2i8) as u8;
        // element 128 + 16 (second half, l = 16 -> is = 1, q1 scale index 8 + 1 = 9)
        b[64 + 16] = 0x0;
        b[128 + 32 + 16] = 0x0; // q = 0 - 32
        b[208..210].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        let mut y = [0f32; 256];
        dequantize_row(GgmlType::Q6K, &b, &mut y);
        assert_eq!(y[0], 0.5 * 3.0 * 5.0);
        assert_eq!(y[144], 0.5 * -2.0 * -32.0);
    }
}
