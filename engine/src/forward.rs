//! The CPU forward pass over a batch of sequences with a paged KV cache.
//!
//! A batch mixes sequences at different stages: each brings its new tokens, the position of
//! the first, and its block table. New keys and values are written into their blocks, then
//! each new token attends over every cached position of its own sequence up to its own.

use std::sync::Arc;

use crate::cpu::matmul::{
    Isa, MatmulScratch, PackedWeight, detect_isa, dot_f32, matmul, matmul_many,
};
use crate::cpu::pool::{SharedOut, ThreadPool};
use crate::error::{EngineError, Result};
use crate::interrupt::Interrupt;
use crate::model::{LlamaWeights, RopeStyle};

/// The KV cache as fixed-size blocks. Per layer and block, K is stored transposed,
/// `[kv_head][dim][slot]`, so the scores of a whole block are one vector product per
/// dimension; V is `[kv_head][slot][dim]`, so accumulating a weighted row is contiguous.
#[derive(Debug)]
pub struct KvCache {
    layers: usize,
    block_size: usize,
    num_blocks: usize,
    kv_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    /// Allocates `num_blocks` blocks of `block_size` tokens for `weights`' shape.
    pub fn new(weights: &LlamaWeights, block_size: usize, num_blocks: usize) -> KvCache {
        let c = &weights.config;
        let n = c.layers * num_blocks * block_size * c.kv_dim();
        KvCache {
            layers: c.layers,
            block_size,
            num_blocks,
            kv_dim: c.kv_dim(),
            k: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    /// Bytes one block takes (K and V, all layers).
    pub fn bytes_per_block(weights: &LlamaWeights, block_size: usize) -> usize {
        2 * weights.config.layers
            * block_size
            * weights.config.kv_dim()
            * std::mem::size_of::<f32>()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Start of one layer's block (K or V).
    fn block_offset(&self, layer: usize, block: usize) -> usize {
        (layer * self.num_blocks + block) * self.block_size * self.kv_dim
    }

    fn write(
        &mut self,
        layer: usize,
        block: usize,
        slot: usize,
        head_dim: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let bs = self.block_size;
        let base = self.block_offset(layer, block);
        for (h, (kh, vh)) in k.chunks_exact(head_dim).zip(v.chunks_exact(head_dim)).enumerate() {
            let kb = &mut self.k[base + h * head_dim * bs..][..head_dim * bs];
            for (d, &x) in kh.iter().enumerate() {
                kb[d * bs + slot] = x;
            }
            self.v[base + (h * bs + slot) * head_dim..][..head_dim].copy_from_slice(vh);
        }
    }
}

/// Which logits a sequence wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// For the last new token only.
    Last,
    /// For every new token (teacher forcing, prompt log-probabilities).
    All,
}

/// One sequence's part of a batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// New tokens to process.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `0..start_pos` are already in the cache.
    pub start_pos: usize,
    /// Cache blocks holding positions `0..start_pos + tokens.len()`, in order.
    pub block_table: &'a [u32],
    /// Logits to return.
    pub logits: LogitsWanted,
}

/// What [`Backend::forward_picking`](crate::backend::Backend::forward_picking) gives back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    /// The logits of the wanted rows whose token was not picked, `vocab` floats each, in
    /// batch order.
    pub logits: Vec<f32>,
    /// Per sequence of the batch, the token picked for it.
    pub picked: Vec<Option<u32>>,
}

/// How the backend may choose a sequence's next token.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Pick {
    /// It does not: the logits go back.
    #[default]
    Logits,
    /// The largest logit (the lowest id among equals).
    Argmax,
    /// A draw from softmax(logits / temperature), cut to the `top_k` largest (0: all) and then
    /// to the smallest set of the largest whose probability reaches `top_p`, walking tokens in
    /// id order to `uniform` (in [0, 1)) of the kept mass (kernels/sampling.cu).
    Draw {
        /// Above 0.
        temperature: f32,
        /// 0: no cut.
        top_k: u32,
        /// 1: no cut.
        top_p: f32,
        /// From the request's seeded generator.
        uniform: f32,
    },
}

/// The batch's wanted logit rows in order: `Some(i)` for the last row of sequence `i` when its
/// token is picked, `None` for a row whose logits go back.
pub fn wanted_rows(batch: &[SeqInput<'_>], picks: &[Pick]) -> Vec<Option<usize>> {
    let mut rows = Vec::new();
    for (i, s) in batch.iter().enumerate() {
        match s.logits {
            LogitsWanted::None => {}
            LogitsWanted::Last => {
                let pick = picks.get(i).copied().unwrap_or_default();
                rows.push((pick != Pick::Logits).then_some(i));
            }
            LogitsWanted::All => rows.extend(std::iter::repeat_n(None, s.tokens.len())),
        }
    }
    rows
}

/// Runs forward passes; owns the compute threads and scratch space.
pub struct Runner {
    pool: ThreadPool,
    isa: Isa,
    scratch: MatmulScratch,
    /// Looked at between layers: a higher-priority arrival stops the pass.
    interrupt: Option<Arc<Interrupt>>,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("threads", &self.pool.threads())
            .field("isa", &self.isa)
            .finish()
    }
}

struct TokenMeta {
    seq: usize,
    pos: usize,
}

impl Runner {
    /// A runner with `threads` compute threads (0: all available).
    pub fn new(threads: usize) -> Runner {
        let pool = if threads == 0 {
            ThreadPool::with_available_parallelism()
        } else {
            ThreadPool::new(threads)
        };
        Runner { pool, isa: detect_isa(), scratch: MatmulScratch::default(), interrupt: None }
    }

    /// Passes from now on stop between layers when `interrupt` says so
    /// ([`EngineError::Interrupted`]).
    pub fn set_interrupt(&mut self, interrupt: Arc<Interrupt>) {
        self.interrupt = Some(interrupt);
    }

    /// Instruction set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Compute threads in use.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn mm(&mut self, w: &PackedWeight, x: &[f32], out: &mut Vec<f32>) {
        let t = x.len() / w.cols;
        out.clear();
        out.resize(t * w.rows, 0.0);
        matmul(&self.pool, self.isa, w, x, out, &mut self.scratch);
    }

    fn mm_many<const N: usize>(
        &mut self,
        ws: &[&PackedWeight; N],
        x: &[f32],
        outs: [&mut Vec<f32>; N],
    ) {
        let t = x.len() / ws[0].cols;
        let mut slices: Vec<&mut [f32]> = Vec::with_capacity(N);
        for (w, o) in ws.iter().zip(outs) {
            o.clear();
            o.resize(t * w.rows, 0.0);
            slices.push(o.as_mut_slice());
        }
        matmul_many(&self.pool, self.isa, ws, x, &mut slices, &mut self.scratch);
    }

    /// Runs the batch and returns the wanted logits, `vocab` floats per wanted token, in
    /// batch order.
    pub fn forward(
        &mut self,
        w: &LlamaWeights,
        cache: &mut KvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<Vec<f32>> {
        let c = &w.config;
        let (hidden, q_dim, kv_dim, hd) = (c.hidden, c.q_dim(), c.kv_dim(), c.head_dim);
        if cache.layers != c.layers || cache.kv_dim != kv_dim {
            return Err(EngineError::InvalidRequest(
                "KV cache shape does not match the model".into(),
            ));
        }
        let mut meta = Vec::new();
        let mut wanted = Vec::new();
        for (s, seq) in batch.iter().enumerate() {
            let end = seq.start_pos + seq.tokens.len();
            if end > c.context_length {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence of {end} tokens exceeds the context length {}",
                    c.context_length
                )));
            }
            if seq.block_table.len() * cache.block_size < end {
                return Err(EngineError::InvalidRequest(format!(
                    "block table of {} blocks cannot hold {end} tokens",
                    seq.block_table.len()
                )));
            }
            if let Some(b) = seq.block_table.iter().find(|&&b| b as usize >= cache.num_blocks) {
                return Err(EngineError::InvalidRequest(format!("block {b} out of range")));
            }
            for (i, &tok) in seq.tokens.iter().enumerate() {
                if tok as usize >= c.vocab_size {
                    return Err(EngineError::InvalidRequest(format!(
                        "token id {tok} is outside the vocabulary ({})",
                        c.vocab_size
                    )));
                }
                let last = i + 1 == seq.tokens.len();
                if seq.logits == LogitsWanted::All || (seq.logits == LogitsWanted::Last && last) {
                    wanted.push(meta.len());
                }
                meta.push(TokenMeta { seq: s, pos: seq.start_pos + i });
            }
        }
        let n = meta.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let tokens: Vec<u32> = batch.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let mut x = vec![0f32; n * hidden];
        for (t, &tok) in tokens.iter().enumerate() {
            w.embed.dequantize_row(tok as usize, &mut x[t * hidden..(t + 1) * hidden]);
        }
        if c.gemma.is_some() {
            let scale = (hidden as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let global = rope_tables(&w.inv_freq, &meta);
        let local = w.local_inv_freq.as_ref().map(|f| rope_tables(f, &meta));

        let mut xn = vec![0f32; n * hidden];
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let mut attn = vec![0f32; n * q_dim];
        let (mut o, mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (li, l) in w.layers.iter().enumerate() {
            if self.interrupt.as_ref().is_some_and(|i| i.stops(li, w.layers.len())) {
                return Err(EngineError::Interrupted);
            }
            rms_norm(&x, &l.attn_norm, c.rms_eps, &mut xn);
            self.mm_many(&[&l.wq, &l.wk, &l.wv], &xn, [&mut q, &mut k, &mut v]);
            add_bias(&mut q, l.bq.as_deref());
            add_bias(&mut k, l.bk.as_deref());
            add_bias(&mut v, l.bv.as_deref());
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rms_norm_in_place(&mut q, qn, c.rms_eps);
                rms_norm_in_place(&mut k, kn, c.rms_eps);
            }
            let (cos, sin) = match (&local, c.gemma.as_ref()) {
                (Some(t), Some(g)) if g.slides(li) => t,
                _ => &global,
            };
            let half = c.rope_dims / 2;
            for t in 0..n {
                let (ct, st) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
                for h in 0..c.heads {
                    rope(&mut q[t * q_dim + h * hd..][..hd], ct, st, c.rope_style);
                }
                for h in 0..c.kv_heads {
                    rope(&mut k[t * kv_dim + h * hd..][..hd], ct, st, c.rope_style);
                }
                let seq = &batch[meta[t].seq];
                let pos = meta[t].pos;
                let block = seq.block_table[pos / cache.block_size] as usize;
                let (kt, vt) = (&k[t * kv_dim..(t + 1) * kv_dim], &v[t * kv_dim..(t + 1) * kv_dim]);
                cache.write(li, block, pos % cache.block_size, hd, kt, vt);
            }
            attention(&self.pool, c, cache, li, batch, &meta, &q, &mut attn);
            self.mm(&l.wo, &attn, &mut o);
            if let Some(pn) = &l.post_attn_norm {
                rms_norm_in_place(&mut o, pn, c.rms_eps);
            }
            for (xi, oi) in x.iter_mut().zip(&o) {
                *xi += oi;
            }
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut xn);
            self.mm_many(&[&l.w_gate, &l.w_up], &xn, [&mut gate, &mut up]);
            if c.gemma.is_some() {
                for (g, u) in gate.iter_mut().zip(&up) {
                    *g = gelu_tanh(*g) * u;
                }
            } else {
                for (g, u) in gate.iter_mut().zip(&up) {
                    *g = *g / (1.0 + (-*g).exp()) * u;
                }
            }
            self.mm(&l.w_down, &gate, &mut down);
            if let Some(pn) = &l.post_ffn_norm {
                rms_norm_in_place(&mut down, pn, c.rms_eps);
            }
            for (xi, di) in x.iter_mut().zip(&down) {
                *xi += di;
            }
        }
        let mut last = vec![0f32; wanted.len() * hidden];
        for (j, &t) in wanted.iter().enumerate() {
            last[j * hidden..(j + 1) * hidden].copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
        let mut normed = vec![0f32; last.len()];
        rms_norm(&last, &w.norm, c.rms_eps, &mut normed);
        let mut logits = Vec::new();
        self.mm(w.lm_head(), &normed, &mut logits);
        if let Some(cap) = c.gemma.as_ref().and_then(|g| g.final_softcap) {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        Ok(logits)
    }
}

/// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`, ggml's `gelu`).
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

/// RMSNorm of each `w.len()`-wide piece of `x` (per-head query and key norms).
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_exact_mut(n) {
        let scale = 1.0 / (dot_f32(row, row) / n as f32 + eps).sqrt();
        for (xi, wi) in row.iter_mut().zip(w) {
            *xi *= scale * wi;
        }
    }
}

fn add_bias(x: &mut [f32], b: Option<&[f32]>) {
    if let Some(b) = b {
        for row in x.chunks_exact_mut(b.len()) {
            for (xi, bi) in row.iter_mut().zip(b) {
                *xi += bi;
            }
        }
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss = dot_f32(row, row);
        let scale = 1.0 / (ss / n as f32 + eps).sqrt();
        for ((oi, xi), wi) in o.iter_mut().zip(row).zip(w) {
            *oi = xi * scale * wi;
        }
    }
}

fn rope_tables(inv_freq: &[f32], meta: &[TokenMeta]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0f32; meta.len() * half];
    let mut sin = vec![0f32; meta.len() * half];
    for (t, m) in meta.iter().enumerate() {
        for (i, f) in inv_freq.iter().enumerate() {
            let theta = m.pos as f32 * f;
            let (s, c) = theta.sin_cos();
            cos[t * half + i] = c;
            sin[t * half + i] = s;
        }
    }
    (cos, sin)
}

fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = match style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::Halves => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos[i] - x1 * sin[i];
        x[b] = x0 * sin[i] + x1 * cos[i];
    }
}

#[expect(clippy::too_many_arguments, reason = "one call site; the pieces are distinct")]
fn attention(
    pool: &ThreadPool,
    c: &crate::model::LlamaConfig,
    cache: &KvCache,
    layer: usize,
    batch: &[SeqInput<'_>],
    meta: &[TokenMeta],
    q: &[f32],
    out: &mut [f32],
) {
    let (hd, q_dim, group) = (c.head_dim, c.q_dim(), c.heads / c.kv_heads);
    // One item per (token, KV head): the query heads sharing that KV head are computed
    // together, so each block of keys and values is read once for all of them. With too few
    // items to keep every thread busy (small decode batches), one item per query head.
    let threads = pool.threads();
    let per = if meta.len() * c.kv_heads >= 4 * threads { group } else { 1 };
    let items_per_token = c.heads / per;
    let items = meta.len() * items_per_token;
    let out_ptr = SharedOut(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    let avx512 = is_x86_feature_detected!("avx512f");
    #[cfg(target_arch = "x86_64")]
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    pool.run(&|ti| {
        let mut scratch = AttendScratch::default();
        // Interleaved assignment balances causal prefill, where later tokens cost more.
        for item in (ti..items).step_by(threads) {
            let (t, head) = (item / items_per_token, item % items_per_token * per);
            let TokenMeta { seq, pos } = meta[t];
            let first = t * q_dim + head * hd;
            let job = HeadJob {
                cache,
                layer,
                table: batch[seq].block_table,
                kv_head: head / group,
                head_dim: hd,
                pos,
                first: c.first_visible(layer, pos),
                scale: c.attention_scale(),
                q: &q[first..first + per * hd],
                #[cfg(target_arch = "x86_64")]
                avx512,
                #[cfg(not(target_arch = "x86_64"))]
                avx512: false,
            };
            // SAFETY: each item is handled by exactly one thread, and its slice
            // [first, first + per * hd) lies inside `out`.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(first), per * hd) };
            #[cfg(target_arch = "x86_64")]
            if avx512 {
                // SAFETY: the CPU supports AVX-512F (checked above).
                unsafe { attend_avx512(&job, &mut scratch, dst) };
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU supports AVX2 and FMA (checked above).
                unsafe { attend_avx2(&job, &mut scratch, dst) };
                continue;
            }
            attend(&job, &mut scratch, dst);
        }
    });
}

/// `a[..v.len()] += p * v`, vectorized when `v` is a full 64-wide chunk.
#[inline(always)]
fn axpy_dims(a: &mut [f32; 64], p: f32, v: &[f32]) {
    if let Ok(v) = <&[f32; 64]>::try_from(v) {
        for i in 0..64 {
            a[i] += p * v[i];
        }
    } else {
        for (a, x) in a.iter_mut().zip(v) {
            *a += p * x;
        }
    }
}

/// The query heads of one token that share a KV head, attending over its sequence's cache.
struct HeadJob<'a> {
    cache: &'a KvCache,
    layer: usize,
    table: &'a [u32],
    kv_head: usize,
    head_dim: usize,
    pos: usize,
    /// The oldest position attended to (0 but in a sliding-window layer).
    first: usize,
    /// Factor on the scores.
    scale: f32,
    /// The group's queries, `head_dim` floats each.
    q: &'a [f32],
    /// Whether the AVX-512 score kernel may be used.
    avx512: bool,
}

/// Per-thread buffers for [`attend`].
#[derive(Default)]
struct AttendScratch {
    /// Scores, one padded row per query head.
    scores: Vec<f32>,
    /// Output partial sums, even and odd positions, per query head.
    acc: Vec<[f32; 64]>,
    /// Per query head: the largest score, then the softmax normalizer.
    max: Vec<f32>,
    inv: Vec<f32>,
}

/// The same code compiled for AVX-512 (Rust never fuses multiply-add on its own, so both
/// versions compute bit-identical results).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,fma")]
unsafe fn attend_avx512(job: &HeadJob<'_>, scratch: &mut AttendScratch, out: &mut [f32]) {
    attend(job, scratch, out)
}

/// The same code compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(job: &HeadJob<'_>, scratch: &mut AttendScratch, out: &mut [f32]) {
    attend(job, scratch, out)
}

#[inline(always)]
fn attend(job: &HeadJob<'_>, scratch: &mut AttendScratch, out: &mut [f32]) {
    // Accumulators live in registers: scores 16 slots at a time, the output 64 dimensions at
    // a time. The order of every sum is fixed (dimension by dimension, position by
    // position), whatever the sequence, batch or grouping. Blocks are the outer loop, so a
    // block of keys or values is loaded once and reused from L1 by every head of the group.
    const SLOTS: usize = 16;
    const DIMS: usize = 64;
    let cache = job.cache;
    let (bs, hd) = (cache.block_size, job.head_dim);
    let heads = job.q.len() / hd;
    let scale = job.scale;
    let n = job.pos + 1;
    // Blocks wholly before the window are skipped; positions of the first block before it
    // are left out of the softmax (their scores are zeroed like the padding's).
    let (lo, first_block) = (job.first.min(job.pos), job.first.min(job.pos) / bs);
    let padded = n.div_ceil(bs) * bs;
    let scores = &mut scratch.scores;
    scores.clear();
    scores.resize(heads * padded, 0.0);
    let max = &mut scratch.max;
    max.clear();
    max.resize(heads, f32::NEG_INFINITY);
    for bi in first_block..padded / bs {
        let base = cache.block_offset(job.layer, job.table[bi] as usize);
        let kb = &cache.k[base + job.kv_head * hd * bs..][..hd * bs];
        let valid = (n - bi * bs).min(bs);
        let skip = lo.saturating_sub(bi * bs);
        for h in 0..heads {
            let q = &job.q[h * hd..(h + 1) * hd];
            let chunk = &mut scores[h * padded + bi * bs..][..bs];
            let mut g = 0;
            while g < bs {
                let w = (bs - g).min(SLOTS);
                #[cfg(target_arch = "x86_64")]
                if job.avx512 && w == SLOTS && hd % 4 == 0 {
                    // SAFETY: AVX-512F was detected (`job.avx512`); the kernel reads hd rows
                    // of 16 floats at stride bs starting at kb[g], all inside `kb`.
                    let s16 =
                        unsafe { crate::cpu::x86::attention_scores16(q, kb[g..].as_ptr(), bs) };
                    chunk[g..g + w].copy_from_slice(&s16);
                    g += w;
                    continue;
                }
                let mut acc = [0f32; SLOTS];
                for (d, &qd) in q.iter().enumerate() {
                    for (a, k) in acc.iter_mut().zip(&kb[d * bs + g..d * bs + g + w]) {
                        *a += qd * k;
                    }
                }
                chunk[g..g + w].copy_from_slice(&acc[..w]);
                g += w;
            }
            let m = &mut max[h];
            for s in &mut chunk[skip..valid] {
                *s *= scale;
                *m = m.max(*s);
            }
        }
    }
    let inv = &mut scratch.inv;
    inv.clear();
    for (h, &m) in max.iter().enumerate() {
        let mut sum = 0f32;
        for s in &mut scores[h * padded + lo..h * padded + n] {
            *s = (*s - m).exp();
            sum += *s;
        }
        scores[h * padded..h * padded + lo].fill(0.0);
        scores[h * padded + n..(h + 1) * padded].fill(0.0);
        inv.push(1.0 / sum);
    }
    let acc = &mut scratch.acc;
    let mut dc = 0;
    while dc < hd {
        let w = (hd - dc).min(DIMS);
        // Two partial sums per head (even and odd positions) for the same reason.
        acc.clear();
        acc.resize(2 * heads, [0f32; DIMS]);
        for bi in first_block..padded / bs {
            let base = cache.block_offset(job.layer, job.table[bi] as usize);
            let vb = &cache.v[base + job.kv_head * bs * hd..][..bs * hd];
            let rows_here = (n - bi * bs).min(bs);
            for (h, pair) in acc.chunks_exact_mut(2).enumerate() {
                let [even, odd] = pair else { continue };
                let chunk = &scores[h * padded + bi * bs..][..rows_here];
                let mut rows = chunk.iter().zip(vb.chunks_exact(hd));
                while let Some((&p0, v0)) = rows.next() {
                    axpy_dims(even, p0, &v0[dc..dc + w]);
                    if let Some((&p1, v1)) = rows.next() {
                        axpy_dims(odd, p1, &v1[dc..dc + w]);
                    }
                }
            }
        }
        for (h, pair) in acc.chunks_exact(2).enumerate() {
            let i = inv[h];
            let o = &mut out[h * hd + dc..h * hd + dc + w];
            for (l, o) in o.iter_mut().enumerate() {
                *o = (pair[0][l] + pair[1][l]) * i;
            }
        }
        dc += w;
    }
}
