//! Attention over the paged KV cache on the CPU.
//!
//! Per row (a new token) and KV head, the query heads sharing that KV head are computed
//! together, so each block of keys and values is read once for all of them, at every batch
//! size. A row's positions are cut into splits of [`SPLIT_POSITIONS`] (whole blocks, counted
//! from position 0). Each split gives, per query head, its largest score, the sum of
//! `exp(score - max)` and the so weighted sum of values; the splits are then merged in order
//! (flash-decoding). The splits depend only on the row's position, so a row's result is the
//! same whatever batch it is in and however the work is shared out: with many rows, one thread
//! takes a row's splits in turn; with few (small decode batches, long contexts), every split is
//! an item of its own, so one long request keeps every core busy.
//!
//! The cache holds f16 (the default) or f32. On x86-64 with AVX-512 F, or AVX2 and F16C, the
//! kernels read either directly (f16 widened as it is loaded), 16 or 8 lanes at a time, with
//! scores and value sums in registers and four query heads per load; elsewhere a portable
//! path widens each block first. All compute the same bits: every sum in the same order, a
//! product then a sum (never fused), and one softmax code for all.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::cpu::matmul::Isa;
use crate::cpu::pool::{SharedOut, ThreadPool};

/// Positions per split (rounded down to whole blocks, at least one).
pub(crate) const SPLIT_POSITIONS: usize = 128;

/// An element type of the KV cache.
pub(crate) trait KvElem: Copy + Default + Send + Sync + 'static {
    /// The nearest value of this type.
    fn from_f32(x: f32) -> Self;
    /// `dst` becomes `src` widened to f32.
    fn widen(src: &[Self], dst: &mut Vec<f32>);
    /// Eight elements from `p`, widened.
    ///
    /// # Safety
    /// The CPU supports AVX and F16C, and 8 elements are readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen elements from `p`, widened.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F, and 16 elements are readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }

    fn widen(src: &[Self], dst: &mut Vec<f32>) {
        dst.clear();
        dst.extend_from_slice(src);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl KvElem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }

    fn widen(src: &[Self], dst: &mut Vec<f32>) {
        dst.clear();
        dst.resize(src.len(), 0.0);
        src.convert_to_f32_slice(dst);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; 8 f16 are 16 bytes.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; 16 f16 are 32 bytes.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())) }
    }
}

/// The shape of one attention call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    /// Query heads.
    pub heads: usize,
    /// KV heads (dividing `heads`).
    pub kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// Positions per cache block.
    pub block_size: usize,
    /// Factor on the scores.
    pub scale: f32,
    /// `cap * tanh(score / cap)` on each scaled score, when set (Gemma 2).
    pub softcap: Option<f32>,
}

impl Shape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Floats of one split's result: per query head of a group, max, sum and `head_dim` sums.
    fn part_len(&self) -> usize {
        self.group() * (self.head_dim + 2)
    }

    fn split_blocks(&self) -> usize {
        (SPLIT_POSITIONS / self.block_size).max(1)
    }
}

/// One row: a new token's place in its sequence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row<'a> {
    /// Its sequence's blocks, in order.
    pub table: &'a [u32],
    /// Its position; it attends to `first..=pos`.
    pub pos: usize,
    /// The oldest position attended to (0 but in a sliding-window layer).
    pub first: usize,
}

impl Row<'_> {
    /// The first position attended to, and one past the last.
    fn span(&self) -> (usize, usize) {
        (self.first.min(self.pos), self.pos + 1)
    }

    /// The splits holding any position the row attends to.
    fn splits(&self, s: &Shape) -> Range<usize> {
        let (lo, n) = self.span();
        let per = s.split_blocks() * s.block_size;
        lo / per..(n - 1) / per + 1
    }
}

/// One layer of the cache: block `b` of it starts at `offset + b * block_stride` in `k` and in
/// `v`; within a block, K is `[kv_head][dim][slot]` and V `[kv_head][slot][dim]`.
pub(crate) struct LayerKv<'a, T> {
    /// Keys of every layer.
    pub k: &'a [T],
    /// Values of every layer.
    pub v: &'a [T],
    /// Where this layer's block 0 starts.
    pub offset: usize,
    /// Elements per block (all KV heads).
    pub block_stride: usize,
}

/// Which kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernels {
    /// Widen each block, then plain loops.
    Portable,
    /// AVX2 with FMA and F16C (block size a multiple of 8, head size of 16).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F (block size and head size multiples of 16): the AVX2 kernels' arithmetic,
    /// 16 lanes at a time.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernels {
    /// The fastest this CPU runs for `s`; only the portable ones when `isa` is
    /// [`Isa::Scalar`] (`SLUICE_ISA=scalar`, for diagnosis).
    pub(crate) fn detect(s: &Shape, isa: Isa) -> Kernels {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512Vnni
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("f16c")
            && s.block_size.is_multiple_of(16)
            && s.head_dim.is_multiple_of(16)
        {
            return Kernels::Avx512;
        }
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Scalar
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
            && s.block_size.is_multiple_of(8)
            && s.head_dim.is_multiple_of(16)
        {
            return Kernels::Avx2;
        }
        let _ = s;
        Kernels::Portable
    }
}

/// Per-thread buffers.
#[derive(Default)]
struct Scratch {
    /// Scores, then probabilities: one row of the split's positions per query head.
    scores: Vec<f32>,
    /// A widened block of keys or values (portable kernels).
    block: Vec<f32>,
}

/// `out[row * heads * head_dim..]` gets each row's attention over its cache, for every query
/// head; `q` holds the rows' queries in the same layout.
pub(crate) fn attention<T: KvElem>(
    pool: &ThreadPool,
    kernels: Kernels,
    kv: &LayerKv<'_, T>,
    s: &Shape,
    rows: &[Row<'_>],
    q: &[f32],
    out: &mut [f32],
) {
    let (hd, group, kvh) = (s.head_dim, s.group(), s.kv_heads);
    let (q_dim, part_len) = (s.heads * hd, s.part_len());
    let threads = pool.threads();
    let out_ptr = SharedOut(out.as_mut_ptr());
    if rows.len() * kvh >= 4 * threads {
        // Enough (row, KV head) items for every thread: each takes a row's splits in turn.
        let items = rows.len() * kvh;
        pool.run(&|ti| {
            let mut scratch = Scratch::default();
            let mut parts = Vec::new();
            // Interleaved assignment balances causal prefill, where later rows cost more.
            for item in (ti..items).step_by(threads) {
                let (r, g) = (item / kvh, item % kvh);
                let row = &rows[r];
                let first = r * q_dim + g * group * hd;
                let qg = &q[first..first + group * hd];
                let splits = row.splits(s);
                parts.clear();
                parts.resize(splits.len() * part_len, 0.0);
                for (part, j) in parts.chunks_exact_mut(part_len).zip(splits) {
                    split(kernels, kv, s, row, g, qg, j, &mut scratch, part);
                }
                // SAFETY: each item is handled by exactly one thread, and its slice
                // [first, first + group * hd) lies inside `out`.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(first), group * hd) };
                merge(&parts, group, hd, dst);
            }
        });
        return;
    }
    // Few rows: one item per split, merged afterwards.
    let mut index = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        for g in 0..kvh {
            index.extend(row.splits(s).map(|j| (r, g, j)));
        }
    }
    let mut parts = vec![0f32; index.len() * part_len];
    let parts_ptr = SharedOut(parts.as_mut_ptr());
    pool.run(&|ti| {
        let mut scratch = Scratch::default();
        for (item, &(r, g, j)) in index.iter().enumerate().skip(ti).step_by(threads) {
            let first = r * q_dim + g * group * hd;
            let qg = &q[first..first + group * hd];
            // SAFETY: item `item` is handled by exactly one thread and owns its part.
            let part = unsafe {
                std::slice::from_raw_parts_mut(parts_ptr.get().add(item * part_len), part_len)
            };
            split(kernels, kv, s, &rows[r], g, qg, j, &mut scratch, part);
        }
    });
    let mut at = 0;
    for (r, row) in rows.iter().enumerate() {
        for g in 0..kvh {
            let n = row.splits(s).len();
            let first = r * q_dim + g * group * hd;
            merge(
                &parts[at * part_len..(at + n) * part_len],
                group,
                hd,
                &mut out[first..][..group * hd],
            );
            at += n;
        }
    }
}

/// The splits' results of one row and KV head, merged in order into each query head's output.
fn merge(parts: &[f32], group: usize, hd: usize, out: &mut [f32]) {
    let stride = group * (hd + 2);
    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
        let head = |p: &[f32]| -> (f32, f32) { (p[h * (hd + 2)], p[h * (hd + 2) + 1]) };
        let max = parts.chunks_exact(stride).fold(f32::NEG_INFINITY, |m, p| m.max(head(p).0));
        o.fill(0.0);
        let mut sum = 0f32;
        for p in parts.chunks_exact(stride) {
            let (m, l) = head(p);
            let w = (m - max).exp();
            sum += w * l;
            for (o, a) in o.iter_mut().zip(&p[h * (hd + 2) + 2..][..hd]) {
                *o += w * a;
            }
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Split `j` of `row` for the query heads `q` of KV head `g`: per head, into `part`, the
/// largest scaled score, the sum of the exponentials and the weighted sum of values.
#[expect(clippy::too_many_arguments, reason = "the pieces of one item, all distinct")]
fn split<T: KvElem>(
    kernels: Kernels,
    kv: &LayerKv<'_, T>,
    s: &Shape,
    row: &Row<'_>,
    g: usize,
    q: &[f32],
    j: usize,
    scratch: &mut Scratch,
    part: &mut [f32],
) {
    let bs = s.block_size;
    let (lo, n) = row.span();
    let sb = s.split_blocks();
    let blocks = (j * sb).max(lo / bs)..((j + 1) * sb).min(n.div_ceil(bs));
    let start = blocks.start * bs;
    let len = blocks.len() * bs;
    // The valid positions, relative to `start`.
    let valid = lo.max(start) - start..n.min(start + len) - start;
    let job = Split { kv, s, table: row.table, g, q, blocks, len, valid };
    match kernels {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels::Avx2` is only detected on CPUs with AVX2, F16C and FMA, for block
        // sizes that are multiples of 8 and head sizes that are multiples of 16.
        Kernels::Avx2 => unsafe { avx2::split_avx2(&job, scratch, part) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels::Avx512` is only detected on CPUs with AVX-512 F and F16C, for
        // block and head sizes that are multiples of 16.
        Kernels::Avx512 => unsafe { avx512::split_avx512(&job, scratch, part) },
        Kernels::Portable => split_portable(&job, scratch, part),
    }
}

/// What one split computes over.
struct Split<'a, 'b, T> {
    kv: &'b LayerKv<'a, T>,
    s: &'b Shape,
    table: &'b [u32],
    /// The KV head.
    g: usize,
    /// Its group's queries, `head_dim` floats each.
    q: &'b [f32],
    /// The split's blocks (indexes into `table`).
    blocks: Range<usize>,
    /// Positions the blocks hold.
    len: usize,
    /// Positions attended to, relative to the first block's first.
    valid: Range<usize>,
}

impl<T> Split<'_, '_, T> {
    /// Where block `bi`'s keys (or values) of this KV head start.
    fn base(&self, bi: usize) -> usize {
        let (bs, hd) = (self.s.block_size, self.s.head_dim);
        self.kv.offset + self.table[bi] as usize * self.kv.block_stride + self.g * hd * bs
    }

    /// The valid slots of block `bi` (of the split's), as slots of that block.
    fn slots(&self, i: usize) -> Range<usize> {
        let bs = self.s.block_size;
        let (a, b) = (self.valid.start.max(i * bs), self.valid.end.min((i + 1) * bs));
        if a < b { a - i * bs..b - i * bs } else { 0..0 }
    }
}

/// A split's scores of one head become `exp(score * scale - max)` (the scaled score capped
/// first when the shape says so) over `valid` and zeros elsewhere; returns the max and the
/// sum. Shared by every kernel, so the bits agree.
fn softmax_part(row: &mut [f32], valid: &Range<usize>, s: &Shape) -> (f32, f32) {
    let mut max = f32::NEG_INFINITY;
    for x in &mut row[valid.clone()] {
        *x *= s.scale;
        if let Some(cap) = s.softcap {
            *x = cap * (*x / cap).tanh();
        }
        max = max.max(*x);
    }
    let mut sum = 0f32;
    for x in &mut row[valid.clone()] {
        *x = (*x - max).exp();
        sum += *x;
    }
    row[..valid.start].fill(0.0);
    row[valid.end..].fill(0.0);
    (max, sum)
}

fn split_portable<T: KvElem>(job: &Split<'_, '_, T>, scratch: &mut Scratch, part: &mut [f32]) {
    let s = job.s;
    let (bs, hd, group) = (s.block_size, s.head_dim, s.group());
    let len = job.len;
    let scores = &mut scratch.scores;
    scores.clear();
    scores.resize(group * len, 0.0);
    for (i, bi) in job.blocks.clone().enumerate() {
        let base = job.base(bi);
        T::widen(&job.kv.k[base..base + hd * bs], &mut scratch.block);
        let kb = &scratch.block;
        for h in 0..group {
            let q = &job.q[h * hd..(h + 1) * hd];
            let dst = &mut scores[h * len + i * bs..][..bs];
            for (d, &qd) in q.iter().enumerate() {
                for (a, k) in dst.iter_mut().zip(&kb[d * bs..(d + 1) * bs]) {
                    *a += qd * k;
                }
            }
        }
    }
    for h in 0..group {
        let (max, sum) = softmax_part(&mut scores[h * len..(h + 1) * len], &job.valid, s);
        part[h * (hd + 2)] = max;
        part[h * (hd + 2) + 1] = sum;
        part[h * (hd + 2) + 2..(h + 1) * (hd + 2)].fill(0.0);
    }
    for (i, bi) in job.blocks.clone().enumerate() {
        let base = job.base(bi);
        T::widen(&job.kv.v[base..base + hd * bs], &mut scratch.block);
        let vb = &scratch.block;
        for h in 0..group {
            let acc = &mut part[h * (hd + 2) + 2..(h + 1) * (hd + 2)];
            for slot in job.slots(i) {
                let p = scores[h * len + i * bs + slot];
                for (a, v) in acc.iter_mut().zip(&vb[slot * hd..(slot + 1) * hd]) {
                    *a += p * v;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{KvElem, Scratch, Split};

    /// # Safety
    /// AVX2, F16C and FMA; block size a multiple of 8, head size of 16.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn split_avx2<T: KvElem>(
        job: &Split<'_, '_, T>,
        scratch: &mut Scratch,
        part: &mut [f32],
    ) {
        let group = job.s.group();
        let mut h = 0;
        // Query heads up to four at a time share each load of a key or value.
        while h < group {
            let n = (group - h).min(4);
            // SAFETY: forwarded contract.
            unsafe {
                match n {
                    4 => heads::<T, 4>(job, h, scratch, part),
                    3 => heads::<T, 3>(job, h, scratch, part),
                    2 => heads::<T, 2>(job, h, scratch, part),
                    _ => heads::<T, 1>(job, h, scratch, part),
                }
            }
            h += n;
        }
    }

    /// Query heads `h0..h0 + H` of the group.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn heads<T: KvElem, const H: usize>(
        job: &Split<'_, '_, T>,
        h0: usize,
        scratch: &mut Scratch,
        part: &mut [f32],
    ) {
        let s = job.s;
        let (bs, hd, len) = (s.block_size, s.head_dim, job.len);
        let scores = &mut scratch.scores;
        scores.clear();
        scores.resize(H * len, 0.0);
        let (k, v) = (job.kv.k.as_ptr(), job.kv.v.as_ptr());
        let q = &job.q[h0 * hd..(h0 + H) * hd];
        // Scores: 16 (or 8) slots of H heads at a time, each summed over the dimensions in order,
        // a product then a sum, as the portable kernels do (the same bits).
        for (i, bi) in job.blocks.clone().enumerate() {
            // SAFETY: block bi's keys of this KV head, hd * bs elements, lie inside `k`.
            let kb = unsafe { k.add(job.base(bi)) };
            // Sixteen slots a pass where the block has them: each score is still one chain
            // of sums over the dimensions in order, but twice as many chains run side by side
            // (with few heads a group, one add's latency, not the adds' rate, set the pace).
            let mut slot = 0;
            while slot < bs {
                let w = if slot + 16 <= bs { 2 } else { 1 };
                // SAFETY: slots slot..slot + 8w of block bi (forwarded contract).
                let acc = unsafe {
                    if w == 2 {
                        slot_scores::<T, H, 2>(kb.add(slot), bs, hd, q)
                    } else {
                        slot_scores::<T, H, 1>(kb.add(slot), bs, hd, q)
                    }
                };
                for (hh, a) in acc.iter().enumerate() {
                    let dst = &mut scores[hh * len + i * bs + slot..][..8 * w];
                    for (c, v) in a[..w].iter().enumerate() {
                        // SAFETY: `dst` holds 8 * w floats.
                        unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(8 * c), *v) };
                    }
                }
                slot += 8 * w;
            }
        }
        for hh in 0..H {
            let at = (h0 + hh) * (hd + 2);
            let row = &mut scores[hh * len..(hh + 1) * len];
            (part[at], part[at + 1]) = super::softmax_part(row, &job.valid, s);
        }
        // Values: 16 dimensions at a time, H heads' sums in registers over the split.
        for dc in (0..hd).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; H];
            for (i, bi) in job.blocks.clone().enumerate() {
                // SAFETY: block bi's values of this KV head, bs * hd elements, lie in `v`.
                let vb = unsafe { v.add(job.base(bi)) };
                for slot in job.slots(i) {
                    // SAFETY: slot < bs and dc + 16 <= hd.
                    let (r0, r1) = unsafe {
                        (T::load8(vb.add(slot * hd + dc)), T::load8(vb.add(slot * hd + dc + 8)))
                    };
                    for (hh, a) in acc.iter_mut().enumerate() {
                        let pr = _mm256_set1_ps(scores[hh * len + i * bs + slot]);
                        a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(pr, r0));
                        a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(pr, r1));
                    }
                }
            }
            for (hh, a) in acc.iter().enumerate() {
                let dst = &mut part[(h0 + hh) * (hd + 2) + 2 + dc..][..16];
                // SAFETY: `dst` holds 16 floats.
                unsafe {
                    _mm256_storeu_ps(dst.as_mut_ptr(), a[0]);
                    _mm256_storeu_ps(dst.as_mut_ptr().add(8), a[1]);
                }
            }
        }
    }

    /// The scores of heads `q` (H heads of `hd` dimensions) against `8 * W` slots of a
    /// block's keys from `kb` (dimension-major, `bs` slots a row): each score one chain of
    /// sums over the dimensions in order, a product then a sum.
    ///
    /// # Safety
    /// AVX2, F16C; `hd` rows of `bs` elements from `kb`, `8 * W` of each readable.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn slot_scores<T: KvElem, const H: usize, const W: usize>(
        kb: *const T,
        bs: usize,
        hd: usize,
        q: &[f32],
    ) -> [[__m256; 2]; H] {
        let mut acc = [[_mm256_setzero_ps(); 2]; H];
        for d in 0..hd {
            let mut kd = [_mm256_setzero_ps(); 2];
            for (c, k) in kd[..W].iter_mut().enumerate() {
                // SAFETY: row d, 8 slots from 8c (caller's contract).
                *k = unsafe { T::load8(kb.add(d * bs + 8 * c)) };
            }
            for (hh, a) in acc.iter_mut().enumerate() {
                let qd = _mm256_set1_ps(q[hh * hd + d]);
                for (x, k) in a[..W].iter_mut().zip(&kd) {
                    *x = _mm256_add_ps(*x, _mm256_mul_ps(qd, *k));
                }
            }
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{KvElem, Scratch, Split};

    /// # Safety
    /// AVX-512 F and F16C; block size and head size multiples of 16.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn split_avx512<T: KvElem>(
        job: &Split<'_, '_, T>,
        scratch: &mut Scratch,
        part: &mut [f32],
    ) {
        let group = job.s.group();
        let mut h = 0;
        // Query heads up to four at a time share each load of a key or value.
        while h < group {
            let n = (group - h).min(4);
            // SAFETY: forwarded contract.
            unsafe {
                match n {
                    4 => heads::<T, 4>(job, h, scratch, part),
                    3 => heads::<T, 3>(job, h, scratch, part),
                    2 => heads::<T, 2>(job, h, scratch, part),
                    _ => heads::<T, 1>(job, h, scratch, part),
                }
            }
            h += n;
        }
    }

    /// Query heads `h0..h0 + H` of the group: `avx2::heads`' sums, each lane's in the same
    /// order (a product then a sum), so the same bits.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn heads<T: KvElem, const H: usize>(
        job: &Split<'_, '_, T>,
        h0: usize,
        scratch: &mut Scratch,
        part: &mut [f32],
    ) {
        let s = job.s;
        let (bs, hd, len) = (s.block_size, s.head_dim, job.len);
        let scores = &mut scratch.scores;
        scores.clear();
        scores.resize(H * len, 0.0);
        let (k, v) = (job.kv.k.as_ptr(), job.kv.v.as_ptr());
        let q = &job.q[h0 * hd..(h0 + H) * hd];
        // Scores: 16 slots of H heads at a time, two such chunks together (twice the
        // independent sums in flight). Chunk `c` is the split's slots 16c..16c + 16: its
        // place in a head's scores, and its keys in block 16c / bs of the split.
        let chunks = len / 16;
        let key = |c: usize| {
            let (i, slot) = (16 * c / bs, 16 * c % bs);
            // SAFETY: that block's keys of this KV head, hd * bs elements, lie inside `k`.
            unsafe { k.add(job.base(job.blocks.start + i) + slot) }
        };
        for c in (0..chunks - chunks % 2).step_by(2) {
            let (ka, kb) = (key(c), key(c + 1));
            let mut acc = [[_mm512_setzero_ps(); 2]; H];
            for d in 0..hd {
                // SAFETY: row d of each block, 16 slots from the chunk's first.
                let (xa, xb) = unsafe { (T::load16(ka.add(d * bs)), T::load16(kb.add(d * bs))) };
                for (hh, a) in acc.iter_mut().enumerate() {
                    let qd = _mm512_set1_ps(q[hh * hd + d]);
                    a[0] = _mm512_add_ps(a[0], _mm512_mul_ps(qd, xa));
                    a[1] = _mm512_add_ps(a[1], _mm512_mul_ps(qd, xb));
                }
            }
            for (hh, a) in acc.iter().enumerate() {
                for (j, r) in a.iter().enumerate() {
                    let dst = &mut scores[hh * len + 16 * (c + j)..][..16];
                    // SAFETY: `dst` holds 16 floats.
                    unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), *r) };
                }
            }
        }
        if chunks % 2 == 1 {
            let c = chunks - 1;
            let kc = key(c);
            let mut acc = [_mm512_setzero_ps(); H];
            for d in 0..hd {
                // SAFETY: row d of the block, 16 slots from the chunk's first.
                let x = unsafe { T::load16(kc.add(d * bs)) };
                for (hh, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(_mm512_set1_ps(q[hh * hd + d]), x));
                }
            }
            for (hh, a) in acc.iter().enumerate() {
                let dst = &mut scores[hh * len + 16 * c..][..16];
                // SAFETY: `dst` holds 16 floats.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), *a) };
            }
        }
        for hh in 0..H {
            let at = (h0 + hh) * (hd + 2);
            let row = &mut scores[hh * len..(hh + 1) * len];
            (part[at], part[at + 1]) = super::softmax_part(row, &job.valid, s);
        }
        // Values: 32 dimensions at a time (16 for a last odd chunk), H heads' sums in
        // registers over the split.
        let mut dc = 0;
        while dc < hd {
            let wide = hd - dc >= 32;
            let mut acc = [[_mm512_setzero_ps(); 2]; H];
            for (i, bi) in job.blocks.clone().enumerate() {
                // SAFETY: block bi's values of this KV head, bs * hd elements, lie in `v`.
                let vb = unsafe { v.add(job.base(bi)) };
                for slot in job.slots(i) {
                    // SAFETY: slot < bs and dc + 16 (+ 16 when wide) <= hd.
                    let r0 = unsafe { T::load16(vb.add(slot * hd + dc)) };
                    let r1 = if wide {
                        // SAFETY: as above.
                        unsafe { T::load16(vb.add(slot * hd + dc + 16)) }
                    } else {
                        _mm512_setzero_ps()
                    };
                    for (hh, a) in acc.iter_mut().enumerate() {
                        let pr = _mm512_set1_ps(scores[hh * len + i * bs + slot]);
                        a[0] = _mm512_add_ps(a[0], _mm512_mul_ps(pr, r0));
                        if wide {
                            a[1] = _mm512_add_ps(a[1], _mm512_mul_ps(pr, r1));
                        }
                    }
                }
            }
            let width = if wide { 32 } else { 16 };
            for (hh, a) in acc.iter().enumerate() {
                let dst = &mut part[(h0 + hh) * (hd + 2) + 2 + dc..][..width];
                // SAFETY: `dst` holds `width` floats.
                unsafe {
                    _mm512_storeu_ps(dst.as_mut_ptr(), a[0]);
                    if wide {
                        _mm512_storeu_ps(dst.as_mut_ptr().add(16), a[1]);
                    }
                }
            }
            dc += width;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of `blocks` blocks with seeded values in +-2, its shape, and the f64 reference
    /// of one row's attention.
    struct Case {
        s: Shape,
        k: Vec<f32>,
        v: Vec<f32>,
        stride: usize,
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed =
            seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }

    impl Case {
        fn new(
            heads: usize,
            kv_heads: usize,
            head_dim: usize,
            block_size: usize,
            blocks: usize,
            softcap: Option<f32>,
        ) -> Case {
            let s = Shape { heads, kv_heads, head_dim, block_size, scale: 0.3, softcap };
            let stride = kv_heads * head_dim * block_size;
            let mut seed = 7;
            let k = (0..blocks * stride).map(|_| lcg(&mut seed)).collect();
            let v = (0..blocks * stride).map(|_| lcg(&mut seed)).collect();
            Case { s, k, v, stride }
        }

        /// Row `row`'s output, every head, in f64 from the f32 cache.
        fn reference(&self, row: &Row<'_>, q: &[f32]) -> Vec<f32> {
            let (bs, hd, group) = (self.s.block_size, self.s.head_dim, self.s.group());
            let (lo, n) = row.span();
            let mut out = Vec::new();
            for h in 0..self.s.heads {
                let g = h / group;
                let key = |p: usize, d: usize| {
                    self.k[row.table[p / bs] as usize * self.stride + g * hd * bs + d * bs + p % bs]
                };
                let val = |p: usize, d: usize| {
                    self.v
                        [row.table[p / bs] as usize * self.stride + g * hd * bs + (p % bs) * hd + d]
                };
                let sc: Vec<f64> = (lo..n)
                    .map(|p| {
                        (0..hd)
                            .map(|d| f64::from(q[h * hd + d]) * f64::from(key(p, d)))
                            .sum::<f64>()
                            * f64::from(self.s.scale)
                    })
                    .map(|x| match self.s.softcap {
                        Some(cap) => f64::from(cap) * (x / f64::from(cap)).tanh(),
                        None => x,
                    })
                    .collect();
                let m = sc.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 = (lo..n).zip(&e).map(|(p, w)| w * f64::from(val(p, d))).sum();
                    out.push((o / z) as f32);
                }
            }
            out
        }
    }

    fn run<T: KvElem>(
        case: &Case,
        kernels: Kernels,
        threads: usize,
        rows: &[Row<'_>],
        q: &[f32],
    ) -> Vec<f32> {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for x in &case.k {
            k.push(T::from_f32(*x));
        }
        for x in &case.v {
            v.push(T::from_f32(*x));
        }
        let kv = LayerKv { k: &k, v: &v, offset: 0, block_stride: case.stride };
        let pool = ThreadPool::new(threads);
        let mut out = vec![0f32; rows.len() * case.s.heads * case.s.head_dim];
        attention(&pool, kernels, &kv, &case.s, rows, q, &mut out);
        out
    }

    fn max_err(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    #[test]
    fn every_kernel_and_split_matches_the_reference() {
        let mut kernels = vec![Kernels::Portable];
        // What this CPU runs for the tests' block size and every head size below.
        let shape = Shape {
            heads: 1,
            kv_heads: 1,
            head_dim: 16,
            block_size: 16,
            scale: 1.0,
            softcap: None,
        };
        for isa in [Isa::Avx2, Isa::Avx512Vnni] {
            let best = Kernels::detect(&shape, isa);
            if !kernels.contains(&best) {
                kernels.push(best);
            }
        }
        // (heads, kv heads, head size, cap on scores): SmolLM2's group of 3, Gemma's 4 with 256
        // dims, 7, MHA, and Gemma 2's capped scores (a cap low enough to change every score).
        for (heads, kv_heads, hd, softcap) in [
            (9, 3, 64, None),
            (4, 1, 256, None),
            (7, 1, 32, None),
            (2, 2, 16, None),
            (8, 2, 64, Some(0.5)),
        ] {
            let blocks = 40;
            let case = Case::new(heads, kv_heads, hd, 16, blocks, softcap);
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            let mut seed = 99;
            // Positions across split edges; one row in a sliding window.
            let rows: Vec<Row<'_>> = [0, 15, 16, 127, 128, 300, 639]
                .iter()
                .map(|&pos| Row { table: &table, pos, first: 0 })
                .chain([Row { table: &table, pos: 500, first: 203 }])
                .collect();
            let q: Vec<f32> = (0..rows.len() * heads * hd).map(|_| lcg(&mut seed)).collect();
            let want: Vec<f32> = rows
                .iter()
                .enumerate()
                .flat_map(|(r, row)| case.reference(row, &q[r * heads * hd..(r + 1) * heads * hd]))
                .collect();
            for &kn in &kernels {
                let one = run::<f32>(&case, kn, 1, &rows, &q);
                assert!(
                    max_err(&one, &want) < 1e-4,
                    "{kn:?} f32 {heads}/{kv_heads}x{hd}: {}",
                    max_err(&one, &want)
                );
                let half = run::<f16>(&case, kn, 1, &rows, &q);
                let portable = run::<f16>(&case, Kernels::Portable, 1, &rows, &q);
                assert_eq!(half, portable, "{kn:?} f16 {heads}/{kv_heads}x{hd}: not the same bits");
                assert!(
                    max_err(&half, &want) < 2e-2,
                    "{kn:?} f16 {heads}/{kv_heads}x{hd}: {}",
                    max_err(&half, &want)
                );
                // Split per item (one row at a time over two threads) or per row (all rows):
                // the same bits.
                for (r, row) in rows.iter().enumerate() {
                    let alone = run::<f16>(
                        &case,
                        kn,
                        2,
                        std::slice::from_ref(row),
                        &q[r * heads * hd..(r + 1) * heads * hd],
                    );
                    assert_eq!(alone, half[r * heads * hd..(r + 1) * heads * hd], "{kn:?} row {r}");
                }
            }
        }
    }
}
