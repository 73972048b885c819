//! Adapters' low-rank updates on the CPU, batched as S-LoRA and Punica batch them: the base
//! product runs once for every row of the pass, and each adapter's rows then take its
//! `scale · B (A x)`, with the adapter's weights read once per group of rows, not once per row.
//!
//! The updates run inside the base product's own parallel region, as [`RegionWork`] in two
//! halves: before its share of the product each thread computes its pieces of `u = scale · A
//! x` (the shrinking half: four ranks of some rows of one update a piece, dealt out longest
//! first, nothing computed twice); after its share, once every thread's `u` is done (a
//! counter, not a region: the product usually hides the wait), it adds `B u` to the output
//! rows it has just computed itself (the expanding half, split as the product is). A decode
//! step thus pays no parallel region of its own for its adapters (seven regions a layer had
//! cost more than their arithmetic at one stream), and no output is touched by two threads.
//!
//! A row's result does not depend on its batch or its thread: each `u` element is a 16-lane
//! dot product summed in one fixed tree, each update element a chain of fused multiply-adds
//! in rank order from zero, added to the output once, on every instruction set (the AVX-512,
//! AVX2 and portable code compute the same bits).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::f16;

use crate::cpu::matmul::{Isa, RegionWork, product_rows};
use crate::cpu::pool::SharedOut;
use crate::lora::{LoraAdapter, LoraPair, Target};
use crate::model::LlamaConfig;

/// Lanes of the dot products.
const LANES: usize = 16;

/// What a cut depends on: the projections, which of them each group updates, the threads.
type CutKey = (Vec<Target>, Vec<bool>, usize);

/// The rows of a pass grouped by the adapter they run under (rows on the bare base model in
/// no group).
#[derive(Default)]
pub struct AdapterRows<'a> {
    /// Each adapter with its rows, in order of first appearance.
    groups: Vec<(&'a LoraAdapter, Vec<usize>)>,
    /// The cuts made so far in this pass, by projections, by which of them each group
    /// updates and by threads: every layer of a model takes the same ones.
    cuts: RefCell<Vec<(CutKey, Arc<Cut>)>>,
}

impl<'a> AdapterRows<'a> {
    /// Groups `per_row` (each row's adapter, in row order).
    pub fn new(per_row: impl IntoIterator<Item = Option<&'a LoraAdapter>>) -> AdapterRows<'a> {
        let mut groups: Vec<(&'a LoraAdapter, Vec<usize>)> = Vec::new();
        for (row, a) in per_row.into_iter().enumerate() {
            let Some(a) = a else { continue };
            match groups.iter_mut().find(|(b, _)| std::ptr::eq(*b, a)) {
                Some((_, rows)) => rows.push(row),
                None => groups.push((a, vec![row])),
            }
        }
        AdapterRows { groups, cuts: RefCell::default() }
    }

    /// Whether no row has an adapter.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The updates of `targets` (projections of one input) in `layer`, for `threads`
    /// threads; `None` when no row's adapter updates any of them.
    pub fn plan(
        &self,
        base: &LlamaConfig,
        layer: usize,
        targets: &[Target],
        threads: usize,
    ) -> Option<UpdatePlan<'_>> {
        let present: Vec<bool> = self
            .groups
            .iter()
            .flat_map(|(a, _)| targets.iter().map(move |&t| a.pair(layer, t).is_some()))
            .collect();
        if !present.contains(&true) {
            return None;
        }
        let threads = threads.max(1);
        let known = self
            .cuts
            .borrow()
            .iter()
            .find(|((t, p, n), _)| t == targets && *p == present && *n == threads)
            .map(|(_, c)| Arc::clone(c));
        let cut = match known {
            Some(c) => c,
            None => {
                let c = Arc::new(self.cut(base, targets, &present, threads));
                self.cuts.borrow_mut().push(((targets.to_vec(), present, threads), Arc::clone(&c)));
                c
            }
        };
        let mut updates = Vec::with_capacity(cut.updates.len());
        for &(g, slot, u_at) in &cut.updates {
            let (adapter, rows) = &self.groups[g];
            let (input, output) = targets[slot].dims(base);
            let pair = adapter.pair(layer, targets[slot])?;
            updates.push(Update { pair, slot, rows, input, output, u_at });
        }
        Some(UpdatePlan { updates, cut, shrunk: AtomicUsize::new(0) })
    }

    /// Cuts the shrinking half of the updates `present` says (group-major over `targets`)
    /// into pieces (four ranks of some rows of one update) and deals them out, costliest
    /// first to the least busy thread. Nothing is computed twice.
    fn cut(&self, base: &LlamaConfig, targets: &[Target], present: &[bool], threads: usize) -> Cut {
        let (mut updates, mut pieces, mut u_len) = (Vec::new(), Vec::new(), 0);
        for (g, (adapter, rows)) in self.groups.iter().enumerate() {
            for (slot, &t) in targets.iter().enumerate() {
                if !present[g * targets.len() + slot] {
                    continue;
                }
                let j = updates.len();
                updates.push((g, slot, u_len));
                u_len += rows.len() * adapter.rank;
                let input = t.dims(base).0;
                for k in (0..adapter.rank).step_by(RANKS) {
                    let ranks = k..(k + RANKS).min(adapter.rank);
                    for r in (0..rows.len()).step_by(PIECE_ROWS) {
                        let rows = r..(r + PIECE_ROWS).min(rows.len());
                        let cost = (ranks.len() * input * (rows.len() + 2)) as f64;
                        pieces.push(Piece { update: j, ranks: ranks.clone(), rows, cost });
                    }
                }
            }
        }
        let mut order: Vec<usize> = (0..pieces.len()).collect();
        order.sort_by(|&a, &b| pieces[b].cost.total_cmp(&pieces[a].cost).then(a.cmp(&b)));
        let mut load = vec![0f64; threads];
        let mut owner = vec![0; pieces.len()];
        for i in order {
            let t = (0..threads).min_by(|&a, &b| load[a].total_cmp(&load[b])).unwrap_or(0);
            load[t] += pieces[i].cost;
            owner[i] = t;
        }
        let mut order: Vec<usize> = (0..pieces.len()).collect();
        order.sort_by_key(|&i| (owner[i], i));
        let mut starts = vec![0; threads + 1];
        for &i in &order {
            starts[owner[i] + 1] += 1;
        }
        for t in 0..threads {
            starts[t + 1] += starts[t];
        }
        let pieces = order.into_iter().map(|i| pieces[i].clone()).collect();
        Cut { updates, pieces, starts, u_len }
    }
}

/// Rows of one update a piece of the shrinking half takes at most.
const PIECE_ROWS: usize = 32;

/// A call's updates and the shrinking half's pieces, thread by thread.
struct Cut {
    /// (group, slot, where its `u` rows start in the call's `u`), in group-major order.
    updates: Vec<(usize, usize, usize)>,
    pieces: Vec<Piece>,
    /// Thread `i` takes `pieces[starts[i]..starts[i + 1]]`.
    starts: Vec<usize>,
    /// Floats of `u` the call needs.
    u_len: usize,
}

/// Four ranks (at most) of some rows (indices into the group's rows) of one update.
#[derive(Clone)]
struct Piece {
    update: usize,
    ranks: Range<usize>,
    rows: Range<usize>,
    cost: f64,
}

/// One adapter's update of one projection, for its group's rows.
struct Update<'a> {
    pair: &'a LoraPair,
    /// Which of the call's projections (and so which output).
    slot: usize,
    rows: &'a [usize],
    input: usize,
    output: usize,
    /// Where its `u` (`rank` floats a row) starts.
    u_at: usize,
}

/// The updates of one call, in two halves around the base products: before its share of
/// them, each thread computes its pieces of `u = scale · A x` (the shrinking half, dealt
/// out); after its share, once every thread's `u` is done, it adds `B u` to the output
/// columns it has just computed (the expanding half, cut as the products are), so no output
/// element is touched by two threads and nothing waits for a region of its own.
pub struct UpdatePlan<'a> {
    updates: Vec<Update<'a>>,
    cut: Arc<Cut>,
    /// Threads done with the shrinking half.
    shrunk: AtomicUsize,
}

impl UpdatePlan<'_> {
    /// Floats of `u` the plan needs.
    pub fn u_len(&self) -> usize {
        self.cut.u_len
    }

    /// The work of one parallel region: the plan with its input, its `u` and the instruction
    /// set.
    ///
    /// # Safety
    /// `x` must hold every row the plan was made for (of the input width), `u` point at
    /// [`UpdatePlan::u_len`] floats that nothing else touches while the region runs, and
    /// the region must run [`RegionWork::before`] then [`RegionWork::after`] on every
    /// thread index in `0..threads` (the threads the plan was made for), on as many threads
    /// at once; `after`'s outputs must hold every row of the projections' output widths.
    pub unsafe fn work<'p>(&'p self, isa: Isa, x: &'p [f32], u: SharedOut) -> PlanWork<'p> {
        PlanWork { plan: self, isa, x, u }
    }

    /// Every (update, row, rank) the shrinking half covers (for tests).
    #[cfg(test)]
    fn cover(&self) -> Vec<(usize, usize, usize)> {
        let mut v = Vec::new();
        for p in &self.cut.pieces {
            for r in p.rows.clone() {
                v.extend(p.ranks.clone().map(|k| (p.update, r, k)));
            }
        }
        v.sort_unstable();
        v
    }
}

/// An [`UpdatePlan`] ready to run in a region ([`UpdatePlan::work`]).
pub struct PlanWork<'p> {
    plan: &'p UpdatePlan<'p>,
    isa: Isa,
    x: &'p [f32],
    u: SharedOut,
}

impl RegionWork for PlanWork<'_> {
    fn before(&self, i: usize) {
        let (plan, cut) = (self.plan, &*self.plan.cut);
        let Some(range) = cut.starts.get(i..i + 2).map(|s| s[0]..s[1]) else { return };
        for p in &cut.pieces[range] {
            let up = &plan.updates[p.update];
            for ri in p.rows.clone() {
                let row = up.rows[ri];
                let xr = &self.x[row * up.input..(row + 1) * up.input];
                // SAFETY: `work`'s caller gave u_len floats; this piece's ranks of this row
                // are inside its update's rows x rank, and pieces are disjoint.
                let u = unsafe {
                    std::slice::from_raw_parts_mut(
                        self.u.get().add(up.u_at + ri * up.pair.rank + p.ranks.start),
                        p.ranks.len(),
                    )
                };
                dots(self.isa, &up.pair.a, up.input, xr, p.ranks.start / RANKS, u);
                for v in u.iter_mut() {
                    *v *= up.pair.u_scale;
                }
            }
        }
        plan.shrunk.fetch_add(1, Ordering::Release);
    }

    fn after(&self, i: usize, outs: &[SharedOut]) {
        let plan = self.plan;
        let mut spins = 0u32;
        let threads = plan.cut.starts.len() - 1;
        while plan.shrunk.load(Ordering::Acquire) < threads {
            // Another thread's `u` is late (rare: its share of the products came between).
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        for up in &plan.updates {
            let cols = product_rows(up.output, threads, i);
            if cols.is_empty() {
                continue;
            }
            for (ri, &row) in up.rows.iter().enumerate() {
                // SAFETY: every thread's `u` is written (the count above, with Acquire); this
                // thread writes only its own columns of the output, which hold `row`.
                let (u, d) = unsafe {
                    (
                        std::slice::from_raw_parts(
                            self.u.get().add(up.u_at + ri * up.pair.rank),
                            up.pair.rank,
                        ),
                        std::slice::from_raw_parts_mut(
                            outs[up.slot].get().add(row * up.output + cols.start),
                            cols.len(),
                        ),
                    )
                };
                update(self.isa, &up.pair.bt, up.output, cols.clone(), u, d);
            }
        }
    }
}

/// Ranks of `A` laid out together.
const RANKS: usize = 4;

/// Where `A[k][i]` lies in its panels: for every four ranks, the input in chunks of 16, each
/// chunk holding the four ranks' 16 values (64 f16, one cache line... two), so that a rank
/// group's dot products read one contiguous stream. Lanes past the input and ranks past the
/// rank are zero.
pub(crate) fn a_index(input: usize, k: usize, i: usize) -> usize {
    ((k / RANKS) * input.div_ceil(LANES) + i / LANES) * RANKS * LANES
        + (k % RANKS) * LANES
        + i % LANES
}

/// Where `Bᵀ[k][o]` lies in its panels: the output in chunks of 16, each holding every rank's
/// 16 values, so that a chunk's chain of updates reads one contiguous stream.
pub(crate) fn b_index(rank: usize, k: usize, o: usize) -> usize {
    (o / LANES) * rank * LANES + k * LANES + o % LANES
}

/// `A` (`rank x input`, row-major, f16 bits) in its panels ([`a_index`]).
pub(crate) fn a_panels(a: &[u16], rank: usize, input: usize) -> Vec<u16> {
    let mut out = vec![0u16; rank.div_ceil(RANKS) * input.div_ceil(LANES) * RANKS * LANES];
    for (k, row) in a.chunks_exact(input).enumerate().take(rank) {
        for (c, chunk) in row.chunks(LANES).enumerate() {
            let at = a_index(input, k, c * LANES);
            out[at..at + chunk.len()].copy_from_slice(chunk);
        }
    }
    out
}

/// `Bᵀ` (`rank x output`, row-major, f16 bits) in its panels ([`b_index`]).
pub(crate) fn b_panels(bt: &[u16], rank: usize, output: usize) -> Vec<u16> {
    let mut out = vec![0u16; output.div_ceil(LANES) * rank * LANES];
    for (k, row) in bt.chunks_exact(output).enumerate().take(rank) {
        for (c, chunk) in row.chunks(LANES).enumerate() {
            let at = b_index(rank, k, c * LANES);
            out[at..at + chunk.len()].copy_from_slice(chunk);
        }
    }
    out
}

/// `u[k] = Σ_i A'[first + k][i] x[i]` for the ranks from `first = 4 · group` on (`a`:
/// [`a_panels`]).
fn dots(isa: Isa, a: &[u16], input: usize, x: &[f32], group: usize, u: &mut [f32]) {
    assert!(
        a.len() >= (group + u.len().div_ceil(RANKS)) * input.div_ceil(LANES) * RANKS * LANES
            && x.len() >= input,
        "adapter dot out of bounds"
    );
    match isa {
        // SAFETY: the ISA was detected with AVX-512F and F16C; the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { x86::dots_avx512(a, input, x, group, u) },
        // SAFETY: the ISA was detected with AVX2, FMA and F16C; lengths as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dots_avx2(a, input, x, group, u) },
        _ => dots_portable(a, input, x, group, u),
    }
}

/// `d[j] += Σ_k u[k] B'[k][cols.start + j]`, the sum a chain of fused multiply-adds from
/// zero in rank order (`bt`: [`b_panels`] of `u.len()` ranks; `cols` starts on a chunk).
fn update(isa: Isa, bt: &[u16], output: usize, cols: Range<usize>, u: &[f32], d: &mut [f32]) {
    assert!(
        cols.end <= output
            && cols.start.is_multiple_of(LANES)
            && bt.len() >= output.div_ceil(LANES) * u.len() * LANES
            && d.len() == cols.len(),
        "adapter update out of bounds"
    );
    match isa {
        // SAFETY: as in `dots`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { x86::update_avx512(bt, cols, u, d) },
        // SAFETY: as in `dots`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::update_avx2(bt, cols, u, d) },
        _ => update_portable(bt, cols, u, d),
    }
}

fn f(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// The lanes' sum in the one order every path uses: halves, then quarters, to one.
#[inline(always)]
fn reduce(mut acc: [f32; LANES]) -> f32 {
    for w in [8, 4, 2, 1] {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// Rank `k`'s elements past the last whole chunk into their lanes, then the sum.
#[inline(always)]
fn finish_dot(mut acc: [f32; LANES], a: &[u16], input: usize, k: usize, x: &[f32]) -> f32 {
    let full = input / LANES * LANES;
    for (l, &v) in x[full..input].iter().enumerate() {
        acc[l] = f(a[a_index(input, k, full + l)]).mul_add(v, acc[l]);
    }
    reduce(acc)
}

fn dots_portable(a: &[u16], input: usize, x: &[f32], group: usize, u: &mut [f32]) {
    let full = input / LANES * LANES;
    for (k, uk) in u.iter_mut().enumerate() {
        let k = group * RANKS + k;
        let mut acc = [0f32; LANES];
        for i in 0..full {
            acc[i % LANES] = f(a[a_index(input, k, i)]).mul_add(x[i], acc[i % LANES]);
        }
        *uk = finish_dot(acc, a, input, k, x);
    }
}

fn update_portable(bt: &[u16], cols: Range<usize>, u: &[f32], d: &mut [f32]) {
    for (dj, c) in d.iter_mut().zip(cols) {
        let mut acc = 0f32;
        for (k, &uk) in u.iter().enumerate() {
            acc = uk.mul_add(f(bt[b_index(u.len(), k, c)]), acc);
        }
        *dj += acc;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{LANES, RANKS, finish_dot, update_portable};

    /// How far ahead of its stream a kernel asks for the weights, in f16 values (8 KiB: a
    /// few hundred cycles of work, what a read from memory takes).
    const AHEAD: usize = 4096;

    /// Asks for the cache lines of `n` f16 values from `p` on (a prefetch never faults).
    #[inline(always)]
    fn prefetch(p: *const u16, n: usize) {
        let mut at = 0;
        while at < n {
            // SAFETY: a prefetch of any address is harmless.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at).cast()) };
            at += 32;
        }
    }

    /// A rank group's four dot products over its one stream of panels; every rank's lanes
    /// add in the portable order.
    #[target_feature(enable = "avx512f,f16c,fma")]
    pub(super) unsafe fn dots_avx512(
        a: &[u16],
        input: usize,
        x: &[f32],
        group: usize,
        u: &mut [f32],
    ) {
        let (full, chunks) = (input / LANES, input.div_ceil(LANES));
        for (g, ug) in u.chunks_mut(RANKS).enumerate() {
            let g = group + g;
            let panel = a[g * chunks * RANKS * LANES..].as_ptr();
            let mut acc = [_mm512_setzero_ps(); RANKS];
            for c in 0..full {
                let p = panel.wrapping_add(c * RANKS * LANES);
                prefetch(p.wrapping_add(AHEAD), RANKS * LANES);
                // SAFETY: chunk c < full of this group's panel is inside `a` (checked by the
                // caller), and x holds c * 16 + 16 <= input floats.
                unsafe {
                    let xv = _mm512_loadu_ps(x.as_ptr().add(c * LANES));
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let w = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(j * LANES).cast()));
                        *acc = _mm512_fmadd_ps(w, xv, *acc);
                    }
                }
            }
            for (j, (uk, acc)) in ug.iter_mut().zip(&acc).enumerate() {
                let mut lanes = [0f32; LANES];
                // SAFETY: 16 floats into a 16-float array.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc) };
                *uk = finish_dot(lanes, a, input, g * RANKS + j, x);
            }
        }
    }

    /// As [`dots_avx512`], the 16 lanes as two 8-lane halves.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn dots_avx2(
        a: &[u16],
        input: usize,
        x: &[f32],
        group: usize,
        u: &mut [f32],
    ) {
        let (full, chunks) = (input / LANES, input.div_ceil(LANES));
        for (g, ug) in u.chunks_mut(RANKS).enumerate() {
            let g = group + g;
            let panel = a[g * chunks * RANKS * LANES..].as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 2]; RANKS];
            for c in 0..full {
                let p = panel.wrapping_add(c * RANKS * LANES);
                prefetch(p.wrapping_add(AHEAD), RANKS * LANES);
                // SAFETY: as in `dots_avx512`.
                unsafe {
                    let x0 = _mm256_loadu_ps(x.as_ptr().add(c * LANES));
                    let x1 = _mm256_loadu_ps(x.as_ptr().add(c * LANES + 8));
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let q = p.add(j * LANES);
                        let w0 = _mm256_cvtph_ps(_mm_loadu_si128(q.cast()));
                        let w1 = _mm256_cvtph_ps(_mm_loadu_si128(q.add(8).cast()));
                        acc[0] = _mm256_fmadd_ps(w0, x0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(w1, x1, acc[1]);
                    }
                }
            }
            for (j, (uk, acc)) in ug.iter_mut().zip(&acc).enumerate() {
                let mut lanes = [0f32; LANES];
                // SAFETY: two times 8 floats into a 16-float array.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
                }
                *uk = finish_dot(lanes, a, input, g * RANKS + j, x);
            }
        }
    }

    /// Four chunks at a time (one contiguous stream of their panels) keep four chains in
    /// flight; the rest one chunk at a time, then the portable code for a last part-chunk.
    #[target_feature(enable = "avx512f,f16c,fma")]
    pub(super) unsafe fn update_avx512(bt: &[u16], cols: Range<usize>, u: &[f32], d: &mut [f32]) {
        let rank = u.len();
        let mut c = cols.start;
        for width in [4, 1] {
            while c + width * LANES <= cols.end {
                let mut acc = [_mm512_setzero_ps(); 4];
                let panel = bt[c / LANES * rank * LANES..].as_ptr();
                prefetch(panel.wrapping_add(AHEAD), width * rank * LANES);
                for (k, &uk) in u.iter().enumerate() {
                    let uv = _mm512_set1_ps(uk);
                    for (j, acc) in acc.iter_mut().enumerate().take(width) {
                        // SAFETY: chunk c / 16 + j ends at or before cols.end <= output,
                        // inside `bt` (checked by the caller).
                        let w = unsafe {
                            let q = panel.add((j * rank + k) * LANES);
                            _mm512_cvtph_ps(_mm256_loadu_si256(q.cast()))
                        };
                        *acc = _mm512_fmadd_ps(uv, w, *acc);
                    }
                }
                for (j, acc) in acc.iter().enumerate().take(width) {
                    // SAFETY: d holds cols.len() floats and c + 16 * (j + 1) <= cols.end.
                    unsafe {
                        let o = d.as_mut_ptr().add(c - cols.start + LANES * j);
                        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), *acc));
                    }
                }
                c += width * LANES;
            }
        }
        update_portable(bt, c..cols.end, u, &mut d[c - cols.start..]);
    }

    /// As [`update_avx512`], each chunk as two 8-lane halves, two chunks at a time.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn update_avx2(bt: &[u16], cols: Range<usize>, u: &[f32], d: &mut [f32]) {
        let rank = u.len();
        let mut c = cols.start;
        for width in [2, 1] {
            while c + width * LANES <= cols.end {
                let mut acc = [[_mm256_setzero_ps(); 2]; 2];
                let panel = bt[c / LANES * rank * LANES..].as_ptr();
                prefetch(panel.wrapping_add(AHEAD), width * rank * LANES);
                for (k, &uk) in u.iter().enumerate() {
                    let uv = _mm256_set1_ps(uk);
                    for (j, acc) in acc.iter_mut().enumerate().take(width) {
                        // SAFETY: as in `update_avx512`.
                        let (w0, w1) = unsafe {
                            let q = panel.add((j * rank + k) * LANES);
                            (
                                _mm256_cvtph_ps(_mm_loadu_si128(q.cast())),
                                _mm256_cvtph_ps(_mm_loadu_si128(q.add(8).cast())),
                            )
                        };
                        acc[0] = _mm256_fmadd_ps(uv, w0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(uv, w1, acc[1]);
                    }
                }
                for (j, acc) in acc.iter().enumerate().take(width) {
                    // SAFETY: d holds cols.len() floats and c + 16 * (j + 1) <= cols.end.
                    unsafe {
                        let o = d.as_mut_ptr().add(c - cols.start + LANES * j);
                        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[0]));
                        _mm256_storeu_ps(
                            o.add(8),
                            _mm256_add_ps(_mm256_loadu_ps(o.add(8)), acc[1]),
                        );
                    }
                }
                c += width * LANES;
            }
        }
        update_portable(bt, c..cols.end, u, &mut d[c - cols.start..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761).rotate_left(13);
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        let best = crate::cpu::matmul::detect_isa();
        if best != Isa::Scalar {
            v.push(Isa::Avx2);
        }
        if best == Isa::Avx512Vnni {
            v.push(Isa::Avx512Vnni);
        }
        v
    }

    /// Odd widths (tails of every kind), a rank that is not a multiple of four, rank groups
    /// from the second on and column ranges of every kind: every instruction set gives the
    /// portable code's bits, and the results are the sums they stand for.
    #[test]
    fn every_path_gives_the_portable_bits() {
        let (rank, input, output) = (7, 16 * 5 + 9, 16 * 9 + 5);
        let a: Vec<u16> =
            values(rank * input, 1).iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let bt: Vec<u16> =
            values(rank * output, 2).iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let (ap, bp) = (a_panels(&a, rank, input), b_panels(&bt, rank, output));
        let x = values(input, 3);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let ranges = [0..output, 16..output, 32..96, 48..64, 128..output];
        let mut reference: Option<(Vec<f32>, Vec<Vec<f32>>)> = None;
        for isa in isas() {
            let mut u = vec![0f32; rank];
            dots(isa, &ap, input, &x, 0, &mut u);
            let mut later = vec![0f32; rank - RANKS];
            dots(isa, &ap, input, &x, 1, &mut later);
            assert_eq!(bits(&later), bits(&u[RANKS..]), "{isa:?}: the second rank group");
            let ds: Vec<Vec<f32>> = ranges
                .iter()
                .map(|r| {
                    let mut d = values(r.len(), 4);
                    update(isa, &bp, output, r.clone(), &u, &mut d);
                    d
                })
                .collect();
            match &reference {
                None => reference = Some((u, ds)),
                Some((ru, rds)) => {
                    assert_eq!(bits(ru), bits(&u), "{isa:?}: u");
                    for (r, (rd, d)) in ranges.iter().zip(rds.iter().zip(&ds)) {
                        assert_eq!(bits(rd), bits(d), "{isa:?}: update of {r:?}");
                    }
                }
            }
        }
        let Some((u, ds)) = reference else { return };
        for (k, &uk) in u.iter().enumerate() {
            let exact: f64 =
                (0..input).map(|i| f64::from(f(a[k * input + i])) * f64::from(x[i])).sum();
            assert!((f64::from(uk) - exact).abs() < 1e-4, "u[{k}] = {uk}, exactly {exact}");
        }
        for (r, d) in ranges.iter().zip(&ds) {
            let before = values(r.len(), 4);
            for (j, &dj) in d.iter().enumerate() {
                let c = r.start + j;
                let exact: f64 = f64::from(before[j])
                    + (0..rank)
                        .map(|k| f64::from(u[k]) * f64::from(f(bt[k * output + c])))
                        .sum::<f64>();
                assert!((f64::from(dj) - exact).abs() < 1e-4, "d[{c}] = {dj}, exactly {exact}");
            }
        }
    }

    /// Runs `plan`'s two halves as a region of `threads` would, one thread after another.
    fn run_region(plan: &UpdatePlan<'_>, threads: usize, x: &[f32], outs: &mut [&mut [f32]]) {
        let mut u = vec![f32::NAN; plan.u_len()];
        let outs: Vec<SharedOut> = outs.iter_mut().map(|o| SharedOut(o.as_mut_ptr())).collect();
        // SAFETY: x and the outputs hold every row; the halves run on every index, all the
        // first halves before any second.
        let work =
            unsafe { plan.work(crate::cpu::matmul::detect_isa(), x, SharedOut(u.as_mut_ptr())) };
        for i in 0..threads {
            work.before(i);
        }
        for i in 0..threads {
            work.after(i, &outs);
        }
    }

    /// However the work is dealt out, every (update, row, rank) of the first half is computed
    /// once, and what the plan adds to the outputs is the dense update times the input, on
    /// the adapted rows only.
    #[test]
    fn a_plan_computes_each_update_once_and_adds_the_dense_update() -> anyhow::Result<()> {
        use crate::synth::{SynthLora, SynthSpec};
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("m.gguf");
        crate::synth::write_gguf(&SynthSpec::tiny(), crate::quant::GgmlType::F32, &path)?;
        let w = crate::model::load_gguf_weights(&sluice_text::gguf::GgufFile::open(&path)?)?;
        let c = &w.config;
        let mut adapters = Vec::new();
        for (seed, rank, targets) in
            [(1, 8, vec![Target::Q, Target::V]), (2, 6, Target::ALL.to_vec())]
        {
            let p = dir.path().join(format!("a{seed}"));
            SynthLora { rank, targets, ..SynthLora::new(seed) }.write_peft(
                c,
                crate::quant::GgmlType::F32,
                &p,
            )?;
            adapters.push(LoraAdapter::load(&p, c)?);
        }
        let targets = [Target::Q, Target::K, Target::V];
        for per_row in [vec![Some(0)], vec![Some(1), None, Some(0), Some(1)], vec![Some(1); 70]] {
            let rows = AdapterRows::new(per_row.iter().map(|r| r.map(|i| &adapters[i])));
            for threads in [1, 2, 3, 8] {
                let plan = rows
                    .plan(c, 0, &targets, threads)
                    .ok_or_else(|| anyhow::anyhow!("no plan for {per_row:?}"))?;
                let mut want = Vec::new();
                for (j, up) in plan.updates.iter().enumerate() {
                    for r in 0..up.rows.len() {
                        want.extend((0..up.pair.rank).map(|k| (j, r, k)));
                    }
                }
                want.sort_unstable();
                assert_eq!(plan.cover(), want, "{per_row:?} on {threads} threads");
                let updated: usize = per_row
                    .iter()
                    .flatten()
                    .map(|&i| targets.iter().filter(|&&t| adapters[i].pair(0, t).is_some()).count())
                    .sum();
                let rows_in_plan: usize = plan.updates.iter().map(|u| u.rows.len()).sum();
                assert_eq!(rows_in_plan, updated, "{per_row:?}");
            }
        }
        let rows = AdapterRows::new([Some(&adapters[1]), None, Some(&adapters[1])]);
        for t in Target::ALL {
            let (input, output) = t.dims(c);
            let x = values(3 * input, 9);
            for threads in [1, 2, 3] {
                let plan =
                    rows.plan(c, 1, &[t], threads).ok_or_else(|| anyhow::anyhow!("no plan"))?;
                let mut out = vec![1f32; 3 * output];
                run_region(&plan, threads, &x, &mut [&mut out]);
                let delta =
                    adapters[1].delta(1, t, c).ok_or_else(|| anyhow::anyhow!("no delta"))?;
                for row in 0..3 {
                    for o in 0..output {
                        let want = if row == 1 {
                            1.0
                        } else {
                            1.0 + (0..input)
                                .map(|i| {
                                    f64::from(delta[o * input + i]) * f64::from(x[row * input + i])
                                })
                                .sum::<f64>()
                        };
                        let got = f64::from(out[row * output + o]);
                        assert!(
                            (got - want).abs() < 1e-5,
                            "{t:?} on {threads} threads, row {row} col {o}: {got} vs {want}"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
