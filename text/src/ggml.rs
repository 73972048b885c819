//! Element types of stored tensors (the GGML formats) and their block sizes, numbered as in
//! GGUF. The arithmetic on blocks (dequantization, quantization) lives in the engine.

/// Weights per block of the 32-element formats.
pub const QK: usize = 32;
/// Weights per super-block of the K-quants.
pub const QK_K: usize = 256;

/// Element type of a stored tensor, numbered as in GGUF.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit symmetric, 32 per block.
    Q8_0,
    /// 4-bit symmetric, 32 per block.
    Q4_0,
    /// 4-bit with minimum, 32 per block.
    Q4_1,
    /// 5-bit symmetric, 32 per block (the fifth bits of a block packed in one word).
    Q5_0,
    /// 4-bit K-quant, 256 per super-block.
    Q4K,
    /// 5-bit K-quant, 256 per super-block.
    Q5K,
    /// 6-bit K-quant, 256 per super-block.
    Q6K,
}

impl GgmlType {
    /// All supported types.
    pub const ALL: [GgmlType; 10] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The type for a GGUF type id, or `None` when unsupported.
    pub fn from_gguf_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// The GGUF type id.
    pub fn gguf_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// A name for messages, as ggml spells it.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 => QK,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Bytes taken by a row of `n` elements, or `None` when `n` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }
}
