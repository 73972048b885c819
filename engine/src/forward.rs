//! The CPU forward pass over a batch of sequences with a paged KV cache.
//!
//! A batch mixes sequences at different stages: each brings its new tokens, the position of
//! the first, and its block table. New keys and values are written into their blocks, then
//! each new token attends over every cached position of its own sequence up to its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use half::f16;

use crate::cpu::adapter::AdapterRows;
use crate::cpu::attention::{Kernels, KvElem, LayerKv, Row, Shape, attention};
use crate::cpu::matmul::{
    Isa, MatmulScratch, PackedWeight, RegionWork, detect_isa, dot_f32, matmul, matmul_many_with,
};
use crate::cpu::pool::{SharedOut, ThreadPool, split_range};
use crate::cpu::vmath::{Gate, gated};
use crate::error::{EngineError, Result};
use crate::interrupt::Interrupt;
use crate::lora::{LoraAdapter, Target};
use crate::model::{LlamaConfig, LlamaWeights, RopeStyle};
use crate::sampler::argmax;

/// What the CPU KV cache stores its keys and values as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// Half precision: half the bytes attention reads (llama.cpp's default too).
    #[default]
    F16,
    /// Single precision.
    F32,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        })
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            other => Err(format!("unknown KV cache dtype {other:?} (expected f16 or f32)")),
        }
    }
}

/// The cache's keys and values, in its dtype.
#[derive(Debug)]
enum KvStore {
    F16 { k: Vec<f16>, v: Vec<f16> },
    F32 { k: Vec<f32>, v: Vec<f32> },
}

/// The KV cache as fixed-size blocks. Per layer and block, K is stored transposed,
/// `[kv_head][dim][slot]`, so the scores of a whole block are one vector product per
/// dimension; V is `[kv_head][slot][dim]`, so accumulating a weighted row is contiguous.
#[derive(Debug)]
pub struct KvCache {
    layers: usize,
    block_size: usize,
    num_blocks: usize,
    kv_dim: usize,
    store: KvStore,
}

impl KvCache {
    /// Allocates `num_blocks` blocks of `block_size` tokens for `weights`' shape, in f16.
    pub fn new(weights: &LlamaWeights, block_size: usize, num_blocks: usize) -> KvCache {
        KvCache::with_dtype(weights, block_size, num_blocks, KvDtype::default())
    }

    /// As [`KvCache::new`], storing `dtype`.
    pub fn with_dtype(
        weights: &LlamaWeights,
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> KvCache {
        let c = &weights.config;
        let n = c.layers * num_blocks * block_size * c.kv_dim();
        let store = match dtype {
            KvDtype::F16 => KvStore::F16 { k: vec![f16::ZERO; n], v: vec![f16::ZERO; n] },
            KvDtype::F32 => KvStore::F32 { k: vec![0.0; n], v: vec![0.0; n] },
        };
        KvCache { layers: c.layers, block_size, num_blocks, kv_dim: c.kv_dim(), store }
    }

    /// Bytes one block takes (K and V, all layers) in `dtype`.
    pub fn bytes_per_block(weights: &LlamaWeights, block_size: usize, dtype: KvDtype) -> usize {
        2 * weights.config.layers * block_size * weights.config.kv_dim() * dtype.size()
    }

    /// What the cache stores.
    pub fn dtype(&self) -> KvDtype {
        match self.store {
            KvStore::F16 { .. } => KvDtype::F16,
            KvStore::F32 { .. } => KvDtype::F32,
        }
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
        let (bs, base) = (self.block_size, self.block_offset(layer, block));
        match &mut self.store {
            KvStore::F16 { k: kc, v: vc } => write_kv(kc, vc, base, bs, slot, head_dim, k, v),
            KvStore::F32 { k: kc, v: vc } => write_kv(kc, vc, base, bs, slot, head_dim, k, v),
        }
    }

    /// Each row's attention over its cache in `layer`, into `out`.
    #[expect(clippy::too_many_arguments, reason = "one call site; the pieces are distinct")]
    fn attend(
        &self,
        pool: &ThreadPool,
        isa: Isa,
        layer: usize,
        shape: &Shape,
        rows: &[Row<'_>],
        q: &[f32],
        out: &mut [f32],
    ) {
        let kernels = Kernels::detect(shape, isa);
        let offset = self.block_offset(layer, 0);
        let block_stride = self.block_size * self.kv_dim;
        match &self.store {
            KvStore::F16 { k, v } => {
                let kv = LayerKv { k, v, offset, block_stride };
                attention(pool, kernels, &kv, shape, rows, q, out);
            }
            KvStore::F32 { k, v } => {
                let kv = LayerKv { k, v, offset, block_stride };
                attention(pool, kernels, &kv, shape, rows, q, out);
            }
        }
    }
}

/// One position's keys and values into the block at `base` (see [`KvCache`]'s layout).
#[expect(clippy::too_many_arguments, reason = "the pieces of one write, all distinct")]
fn write_kv<T: KvElem>(
    kc: &mut [T],
    vc: &mut [T],
    base: usize,
    bs: usize,
    slot: usize,
    head_dim: usize,
    k: &[f32],
    v: &[f32],
) {
    for (h, (kh, vh)) in k.chunks_exact(head_dim).zip(v.chunks_exact(head_dim)).enumerate() {
        let kb = &mut kc[base + h * head_dim * bs..][..head_dim * bs];
        for (d, &x) in kh.iter().enumerate() {
            kb[d * bs + slot] = T::from_f32(x);
        }
        let vb = &mut vc[base + (h * bs + slot) * head_dim..][..head_dim];
        for (o, &x) in vb.iter_mut().zip(vh) {
            *o = T::from_f32(x);
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
    /// The tenant adapter its rows run under, if any (checked against the model by the pass).
    pub adapter: Option<&'a LoraAdapter>,
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

/// How long the device ran a backend's serving passes and sat idle between them (seconds),
/// since they were last taken ([`crate::backend::Backend::take_pass_times`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassTimes {
    /// Passes.
    pub passes: u64,
    /// From each pass's start to its end.
    pub busy: f64,
    /// Idle gaps between a pass and the one after it (not across a break for want of work).
    pub gaps: u64,
    /// Their total.
    pub gap: f64,
}

impl PassTimes {
    /// Counts one pass of `busy` seconds, after an idle `gap` from the pass before (none
    /// after a break for want of work).
    pub fn record(&mut self, gap: Option<f64>, busy: f64) {
        if let Some(gap) = gap {
            self.gap += gap;
            self.gaps += 1;
        }
        self.busy += busy;
        self.passes += 1;
    }

    /// Adds `other`'s figures to these.
    pub fn add(&mut self, other: PassTimes) {
        self.passes += other.passes;
        self.busy += other.busy;
        self.gaps += other.gaps;
        self.gap += other.gap;
    }
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
    /// Where the passes' time went, since the start.
    profile: ForwardProfile,
    /// The last pass's wanted logits, kept between passes: at 32 rows of a 262k vocabulary
    /// that is 33 MB, which a fresh allocation would fault in and zero on every step.
    logits: Vec<f32>,
    /// The pass's activations, kept between passes for the same reason (a 512-token
    /// prefill's feed-forward rows alone are megabytes).
    bufs: PassBuffers,
    /// The adapters' `u = scale · A x` of one call, kept between calls.
    lora_u: Vec<f32>,
}

/// The activations of a pass ([`Runner::forward_logits`]); each is sized, and where it is
/// not overwritten whole, cleared, by the pass that uses it.
#[derive(Default)]
struct PassBuffers {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

/// Where the forward passes' time went, summed over passes (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ForwardProfile {
    /// Whole passes run.
    pub passes: u64,
    /// Their wall time.
    pub total: f64,
    /// Attention over the KV cache (the cache writes and RoPE are under `other`).
    pub attention: f64,
    /// The layers' matrix products (Q/K/V, output, gate/up, down).
    pub matmul: f64,
    /// The final norm and the LM head, for the rows whose logits are wanted.
    pub lm_head: f64,
}

impl ForwardProfile {
    /// What the named parts leave: embedding, norms, RoPE, cache writes, activations.
    pub fn other(&self) -> f64 {
        (self.total - self.attention - self.matmul - self.lm_head).max(0.0)
    }

    /// `self - earlier`, part by part.
    pub fn since(&self, earlier: &ForwardProfile) -> ForwardProfile {
        ForwardProfile {
            passes: self.passes - earlier.passes,
            total: self.total - earlier.total,
            attention: self.attention - earlier.attention,
            matmul: self.matmul - earlier.matmul,
            lm_head: self.lm_head - earlier.lm_head,
        }
    }
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
        Runner {
            pool,
            isa: detect_isa(),
            scratch: MatmulScratch::default(),
            interrupt: None,
            profile: ForwardProfile::default(),
            logits: Vec::new(),
            bufs: PassBuffers::default(),
            lora_u: Vec::new(),
        }
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

    /// Where the passes' time went so far.
    pub fn profile(&self) -> ForwardProfile {
        self.profile
    }

    fn mm(&mut self, w: &PackedWeight, x: &[f32], out: &mut Vec<f32>) {
        let t = x.len() / w.cols;
        // Every element is written by the product: only a longer output is zeroed first.
        out.resize(t * w.rows, 0.0);
        matmul(&self.pool, self.isa, w, x, out, &mut self.scratch);
    }

    fn mm_many<const N: usize>(
        &mut self,
        ws: &[&PackedWeight; N],
        x: &[f32],
        outs: [&mut Vec<f32>; N],
    ) {
        self.mm_with(ws, x, outs, None);
    }

    /// [`Runner::mm_many`] of the projections `targets` of `layer`, each adapted row then
    /// taking its adapter's update, in the products' own parallel region.
    #[expect(clippy::too_many_arguments, reason = "the products' arguments and the adapters'")]
    fn mm_adapted<const N: usize>(
        &mut self,
        c: &LlamaConfig,
        lora: &AdapterRows<'_>,
        layer: usize,
        targets: [Target; N],
        ws: &[&PackedWeight; N],
        x: &[f32],
        outs: [&mut Vec<f32>; N],
    ) {
        let Some(plan) = lora.plan(c, layer, &targets, self.pool.threads()) else {
            return self.mm_many(ws, x, outs);
        };
        // Every element the plan reads is written first, in the same region: no zeroing.
        self.lora_u.resize(plan.u_len(), 0.0);
        // SAFETY: `x` holds the rows the plan was made for, `lora_u` its u_len floats and is
        // not touched until the region is over, and `matmul_many_with` runs both halves on
        // every thread of the pool the plan was made for, at once.
        let work = unsafe { plan.work(self.isa, x, SharedOut(self.lora_u.as_mut_ptr())) };
        self.mm_with(ws, x, outs, Some(&work));
    }

    /// The products of `ws` into `outs` (each sized to its rows first), with `extra` in their
    /// region.
    fn mm_with<const N: usize>(
        &mut self,
        ws: &[&PackedWeight; N],
        x: &[f32],
        outs: [&mut Vec<f32>; N],
        extra: Option<&dyn RegionWork>,
    ) {
        let t = x.len() / ws[0].cols;
        let mut slices: Vec<&mut [f32]> = Vec::with_capacity(N);
        for (w, o) in ws.iter().zip(outs) {
            o.resize(t * w.rows, 0.0);
            slices.push(o.as_mut_slice());
        }
        matmul_many_with(&self.pool, self.isa, ws, x, &mut slices, &mut self.scratch, extra);
    }

    /// Runs the batch and returns the wanted logits, `vocab` floats per wanted token, in
    /// batch order.
    pub fn forward(
        &mut self,
        w: &LlamaWeights,
        cache: &mut KvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<Vec<f32>> {
        self.forward_logits(w, cache, batch).map(<[f32]>::to_vec)
    }

    /// [`Runner::forward`] into the runner's own buffer, which the next pass reuses.
    pub fn forward_logits(
        &mut self,
        w: &LlamaWeights,
        cache: &mut KvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<&[f32]> {
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
            if let Some(a) = seq.adapter
                && !a.fits(c)
            {
                return Err(EngineError::InvalidRequest(format!(
                    "adapter {} was built for another base model's shape",
                    a.revision
                )));
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
            self.logits.clear();
            return Ok(&self.logits);
        }
        let began = Instant::now();
        let shape = Shape {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: hd,
            block_size: cache.block_size,
            scale: c.attention_scale(),
            softcap: c.attention_softcap(),
        };
        let (mut matmul_s, mut attn_s) = (0f64, 0f64);
        // Each row's place for attention; only the window's start changes with the layer.
        let mut rows: Vec<Row<'_>> = meta
            .iter()
            .map(|m| Row { table: batch[m.seq].block_table, pos: m.pos, first: 0 })
            .collect();
        let tokens: Vec<u32> = batch.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let lora = AdapterRows::new(meta.iter().map(|m| batch[m.seq].adapter));
        // Taken for the pass and given back at its end, or when it is interrupted.
        let PassBuffers {
            mut x,
            mut xn,
            mut q,
            mut k,
            mut v,
            mut attn,
            mut o,
            mut gate,
            mut up,
            mut down,
        } = std::mem::take(&mut self.bufs);
        // Every element is written below: the embeddings, the norms and the products.
        x.resize(n * hidden, 0.0);
        xn.resize(n * hidden, 0.0);
        attn.clear();
        attn.resize(n * q_dim, 0.0);
        for (t, &tok) in tokens.iter().enumerate() {
            w.embed.dequantize_row(tok as usize, &mut x[t * hidden..(t + 1) * hidden]);
        }
        if c.gemma.is_some() {
            let scale = (hidden as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let global = rope_tables(&w.inv_freq, &meta);
        let local = w.local_inv_freq.as_ref().map(|f| rope_tables(f, &meta));

        for (li, l) in w.layers.iter().enumerate() {
            if self.interrupt.as_ref().is_some_and(|i| i.stops(li, w.layers.len())) {
                self.bufs = PassBuffers { x, xn, q, k, v, attn, o, gate, up, down };
                return Err(EngineError::Interrupted);
            }
            rms_norm(&x, &l.attn_norm, c.rms_eps, &mut xn);
            let t = Instant::now();
            self.mm_adapted(
                c,
                &lora,
                li,
                [Target::Q, Target::K, Target::V],
                &[&l.wq, &l.wk, &l.wv],
                &xn,
                [&mut q, &mut k, &mut v],
            );
            matmul_s += t.elapsed().as_secs_f64();
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
            let t_attn = Instant::now();
            for (r, m) in rows.iter_mut().zip(&meta) {
                r.first = c.first_visible(li, m.pos);
            }
            cache.attend(&self.pool, self.isa, li, &shape, &rows, &q, &mut attn);
            attn_s += t_attn.elapsed().as_secs_f64();
            let t = Instant::now();
            self.mm_adapted(c, &lora, li, [Target::O], &[&l.wo], &attn, [&mut o]);
            matmul_s += t.elapsed().as_secs_f64();
            if let Some(pn) = &l.post_attn_norm {
                rms_norm_in_place(&mut o, pn, c.rms_eps);
            }
            for (xi, oi) in x.iter_mut().zip(&o) {
                *xi += oi;
            }
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut xn);
            let t = Instant::now();
            let gate_up = [Target::Gate, Target::Up];
            self.mm_adapted(
                c,
                &lora,
                li,
                gate_up,
                &[&l.w_gate, &l.w_up],
                &xn,
                [&mut gate, &mut up],
            );
            matmul_s += t.elapsed().as_secs_f64();
            let act = if c.gemma.is_some() { Gate::GeluTanh } else { Gate::Silu };
            gated(&self.pool, self.isa, act, &mut gate, &up, c.intermediate);
            let t = Instant::now();
            self.mm_adapted(c, &lora, li, [Target::Down], &[&l.w_down], &gate, [&mut down]);
            matmul_s += t.elapsed().as_secs_f64();
            if let Some(pn) = &l.post_ffn_norm {
                rms_norm_in_place(&mut down, pn, c.rms_eps);
            }
            for (xi, di) in x.iter_mut().zip(&down) {
                *xi += di;
            }
        }
        let t_head = Instant::now();
        let mut last = vec![0f32; wanted.len() * hidden];
        for (j, &t) in wanted.iter().enumerate() {
            last[j * hidden..(j + 1) * hidden].copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
        let mut normed = vec![0f32; last.len()];
        rms_norm(&last, &w.norm, c.rms_eps, &mut normed);
        let mut logits = std::mem::take(&mut self.logits);
        self.mm(w.lm_head(), &normed, &mut logits);
        if let Some(cap) = c.gemma.as_ref().and_then(|g| g.final_softcap) {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        self.logits = logits;
        self.bufs = PassBuffers { x, xn, q, k, v, attn, o, gate, up, down };
        let p = &mut self.profile;
        p.passes += 1;
        p.lm_head += t_head.elapsed().as_secs_f64();
        p.matmul += matmul_s;
        p.attention += attn_s;
        p.total += began.elapsed().as_secs_f64();
        Ok(&self.logits)
    }

    /// The last pass's wanted logits ([`Runner::forward_logits`]).
    pub fn last_logits(&self) -> &[f32] {
        &self.logits
    }

    /// The argmax of each of `rows` of the last pass's logits (`vocab` floats a row), the
    /// rows shared out among the compute threads.
    pub fn argmax_rows(&self, vocab: usize, rows: &[usize]) -> Vec<u32> {
        let logits = &self.logits;
        let picked: Vec<AtomicU32> = rows.iter().map(|_| AtomicU32::new(0)).collect();
        let parts = self.pool.threads().min(rows.len());
        if parts <= 1 {
            return rows.iter().map(|&r| argmax(&logits[r * vocab..(r + 1) * vocab])).collect();
        }
        self.pool.run(&|i| {
            if i < parts {
                for j in split_range(rows.len(), parts, i, 1) {
                    let r = rows[j];
                    picked[j].store(argmax(&logits[r * vocab..(r + 1) * vocab]), Ordering::Relaxed);
                }
            }
        });
        picked.into_iter().map(AtomicU32::into_inner).collect()
    }
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
