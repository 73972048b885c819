//! The compute layout of packed 4/8-bit weights and 8-bit activations, shared by the kernel
//! drivers of [`crate::cpu::matmul`] (which describes the layout) and the SIMD kernels of
//! `cpu::x86`: data only, below both.

use half::f16;

use crate::quant::QK;

/// Rows per interleaved group (the lanes of one 512-bit register of int32).
pub(crate) const GROUP: usize = 16;
/// Activation rows (tokens) per kernel tile (AVX2).
pub(crate) const TILE_COLS: usize = 4;
/// Activation rows (tokens) per AVX-512 kernel tile.
pub(crate) const TILE_COLS_512: usize = 8;

/// How a packed 4/8-bit format's per-block offset enters the dot product:
/// `dot = sum_b (d_w d_a isum_b + c_b sa_b)`, with `sa_b = d_a * sum(q_a)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offset {
    /// Q4_1: `c_b = m_b` (the stored minimum).
    Min,
    /// Q4_0: nibbles are stored with +8, `c_b = -8 d_b`.
    Minus8,
    /// Q8_0: stored as `q ^ 0x80` (unsigned), `c_b = -128 d_b`.
    Minus128,
    /// Q5_K: 8-bit values 0..=31, `c_b = m_b` (the sub-block's `-dmin * m`), one scale
    /// (`d * sc`) per block.
    Min8,
    /// Q6_K: 6-bit values 0..=63 (low nibbles as the 4-bit layouts store them, then the high
    /// two bits: see [`slot`]) with two scales per block, one per 16 elements (`d * sc`),
    /// and `c = -32 d_half` per half: `dot = sum_h (d_h d_a isum_h - 32 d_h sh_h)`, with
    /// `sh_h = d_a * sum(q_a over the half)`.
    Minus32Halves,
}

impl Offset {
    /// A number for the offset, so kernels can be compiled once per offset (a const generic).
    pub(crate) const fn id(self) -> u8 {
        self as u8
    }

    /// The offset numbered `id` ([`Offset::id`]); out of range, the last.
    pub(crate) const fn from_id(id: u8) -> Offset {
        match id {
            0 => Offset::Min,
            1 => Offset::Minus8,
            2 => Offset::Minus128,
            3 => Offset::Min8,
            _ => Offset::Minus32Halves,
        }
    }

    /// Whether values take a byte each (else a nibble, and for Q6_K two more bits).
    pub(crate) fn eight_bit(self) -> bool {
        matches!(self, Offset::Minus128 | Offset::Min8)
    }

    /// Whether a per-block minimum is stored.
    pub(crate) fn has_min(self) -> bool {
        matches!(self, Offset::Min | Offset::Min8)
    }

    /// Scales per (row, block).
    pub(crate) fn scales(self) -> usize {
        if self == Offset::Minus32Halves { 2 } else { 1 }
    }
}

/// Bytes of one (group, block): 16 rows x 32 elements at 4, 6 or 8 bits.
pub(crate) fn group_block_bytes(offset: Offset) -> usize {
    match offset {
        Offset::Minus128 | Offset::Min8 => GROUP * QK,
        Offset::Minus32Halves => GROUP * QK * 3 / 4,
        Offset::Min | Offset::Minus8 => GROUP * QK / 2,
    }
}

/// Where element `i` of row lane `l` sits in a (group, block) and, for 4-bit values,
/// whether it is the high nibble. Quads 0-3 are the low nibbles of the four 64-byte chunks
/// and quads 4-7 the high nibbles, so one shift and one mask unpack two quads. For Q6_K
/// these are the low four bits; [`high_bits_slot`] has the other two.
pub(crate) fn slot(offset: Offset, l: usize, i: usize) -> (usize, bool) {
    let (k, e) = (i / 4, i % 4);
    if offset.eight_bit() {
        (k * 64 + l * 4 + e, false)
    } else {
        ((k % 4) * 64 + l * 4 + e, k >= 4)
    }
}

/// Q6_K: the byte holding the top two bits of element `i` of row lane `l`, and their shift.
/// After the 256 bytes of low nibbles, two 64-byte chunks: chunk `k / 4` holds quad `k`'s
/// bits at `2 (k % 4)`, so a 16-bit shift and a mask put them at bits 4-5 of each byte.
pub(crate) fn high_bits_slot(l: usize, i: usize) -> (usize, u32) {
    let (k, e) = (i / 4, i % 4);
    (GROUP * QK / 2 + (k / 4) * 64 + l * 4 + e, 2 * (k % 4) as u32)
}

/// Activations quantized to 8 bits per 32-element block.
#[derive(Debug, Default)]
pub struct QuantizedActs {
    /// Rows (tokens).
    pub rows: usize,
    /// Blocks per row (unpadded).
    pub nb: usize,
    /// Blocks per row in `qs`, padded to pairs.
    pub(crate) nb_pad: usize,
    /// Quantized values, `rows x nb_pad x 32`.
    pub(crate) qs: Vec<i8>,
    /// Per-block scales, `rows x nb`.
    pub(crate) d: Vec<f32>,
    /// Per-block `d * sum(q)`, `rows x nb`.
    pub(crate) sa: Vec<f32>,
    /// Per half-block `d * sum(q over 16 elements)`, `rows x nb x 2` (for Q6_K's scales).
    pub(crate) sh: Vec<f32>,
}

/// Borrowed view of a packed 4/8-bit weight for the kernels. Per group and block: `qs` as
/// described above, then `offset.scales()` runs of 16 scales in `d` (one per half for
/// `Minus32Halves`) and, where `offset.has_min()`, 16 minima in `m`.
pub(crate) struct BlockView<'a> {
    pub(crate) rows: usize,
    pub(crate) nb: usize,
    pub(crate) offset: Offset,
    pub(crate) qs: &'a [u8],
    pub(crate) d: &'a [f16],
    pub(crate) m: &'a [f16],
}

impl BlockView<'_> {
    /// Scale `h` (0, or 1 for a block's second half with two scales) of row `r`'s block `b`.
    pub(crate) fn scale(&self, r: usize, b: usize, h: usize) -> f32 {
        let gb = (r / GROUP) * self.nb + b;
        self.d[(gb * self.offset.scales() + h) * GROUP + r % GROUP].to_f32()
    }

    /// Row `r`'s block `b`'s offset term per unit of activation sum, `c_b` (for one half
    /// `h` with `Minus32Halves`).
    pub(crate) fn offset_term(&self, r: usize, b: usize, h: usize) -> f32 {
        let gb = (r / GROUP) * self.nb + b;
        match self.offset {
            Offset::Min | Offset::Min8 => self.m[gb * GROUP + r % GROUP].to_f32(),
            Offset::Minus8 => -8.0 * self.scale(r, b, 0),
            Offset::Minus128 => -128.0 * self.scale(r, b, 0),
            Offset::Minus32Halves => -32.0 * self.scale(r, b, h),
        }
    }

    /// The stored (unsigned, offset) value of element `i` of block `b` of row `r`.
    pub(crate) fn stored(&self, r: usize, b: usize, i: usize) -> i32 {
        let gbb = group_block_bytes(self.offset);
        let (at, high) = slot(self.offset, r % GROUP, i);
        let base = ((r / GROUP) * self.nb + b) * gbb;
        let byte = self.qs[base + at];
        let low = i32::from(if self.offset.eight_bit() {
            byte
        } else if high {
            byte >> 4
        } else {
            byte & 0xF
        });
        if self.offset != Offset::Minus32Halves {
            return low;
        }
        let (at, shift) = high_bits_slot(r % GROUP, i);
        low | i32::from((self.qs[base + at] >> shift) & 3) << 4
    }
}

#[cfg(test)]
mod tests {
    use super::Offset;

    #[test]
    fn every_offset_comes_back_from_its_id() {
        let all =
            [Offset::Min, Offset::Minus8, Offset::Minus128, Offset::Min8, Offset::Minus32Halves];
        for o in all {
            assert_eq!(Offset::from_id(o.id()), o);
        }
    }
}
