//! The forward pass on the GPU: the same contract as the CPU [`Runner`](crate::forward::Runner)
//! (a batch of [`SeqInput`]s, each with its own positions and block table, prefill chunks and
//! decode steps mixed; the wanted logits back in batch order), over weights dequantized to
//! bf16 once at upload, a paged bf16 KV cache on the device, our kernels and cuBLAS bf16 GEMMs
//! (f32 accumulation).
//!
//! Status: written and compiled on a machine without a GPU; the parity test
//! (`engine/tests/cuda_device.rs`) has not run yet.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

use super::{CudaError, KERNELS, compile, probe};
use crate::cpu::matmul::PackedWeight;
use crate::forward::{LogitsWanted, SeqInput};
use crate::model::{LlamaConfig, LlamaWeights, RopeStyle};

/// Element types a GEMM may write, with their CUDA type.
trait GemmOut: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t;
}

impl GemmOut for bf16 {
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t =
        cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
}

impl GemmOut for f32 {
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t =
        cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
}

fn run_err(e: impl std::fmt::Display) -> CudaError {
    CudaError::Run(e.to_string())
}

struct Kernels {
    gather: CudaFunction,
    rmsnorm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    add: CudaFunction,
    add_bias: CudaFunction,
    kv_write: CudaFunction,
    attention: CudaFunction,
    fill: CudaFunction,
}

struct DeviceLayer {
    attn_norm: CudaSlice<bf16>,
    wq: CudaSlice<bf16>,
    wk: CudaSlice<bf16>,
    wv: CudaSlice<bf16>,
    bias: Option<[CudaSlice<bf16>; 3]>,
    wo: CudaSlice<bf16>,
    ffn_norm: CudaSlice<bf16>,
    w_gate: CudaSlice<bf16>,
    w_up: CudaSlice<bf16>,
    w_down: CudaSlice<bf16>,
}

/// A model's weights on the device, bf16.
pub struct CudaModel {
    config: LlamaConfig,
    embed: CudaSlice<bf16>,
    lm_head: Option<CudaSlice<bf16>>,
    norm: CudaSlice<bf16>,
    layers: Vec<DeviceLayer>,
    inv_freq: CudaSlice<f32>,
}

impl CudaModel {
    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
}

/// The paged KV cache on the device: per layer, `[blocks * block_size, kv_dim]` bf16 for K and
/// for V.
pub struct CudaKvCache {
    k: Vec<CudaSlice<bf16>>,
    v: Vec<CudaSlice<bf16>>,
    block_size: usize,
    num_blocks: usize,
}

/// Runs forward passes on one device.
pub struct CudaRunner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
}

impl std::fmt::Debug for CudaRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRunner").field("ordinal", &self.ctx.ordinal()).finish()
    }
}

fn grid(x: usize, y: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(x).unwrap_or(u32::MAX), u32::try_from(y).unwrap_or(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn flat(n: usize) -> LaunchConfig {
    grid(n.div_ceil(256).clamp(1, 65_535), 1, 256)
}

impl CudaRunner {
    /// Opens device `ordinal`, compiles the kernels for it and creates the cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<CudaRunner, CudaError> {
        let info = probe(ordinal)?;
        let device =
            |e: cudarc::driver::DriverError| CudaError::Device { ordinal, message: e.to_string() };
        let ctx = CudaContext::new(ordinal).map_err(device)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(run_err)?;
        let arch = info.arch();
        let mut modules = Vec::new();
        for (name, src) in KERNELS {
            let compiled = compile(name, src, &arch)?;
            modules.push((*name, ctx.load_module(Ptx::from_src(compiled.ptx)).map_err(device)?));
        }
        let f = |module: &str, name: &str| -> Result<CudaFunction, CudaError> {
            let m = modules.iter().find(|(n, _)| *n == module).map(|(_, m)| m);
            m.ok_or_else(|| run_err(format!("no module {module}")))?
                .load_function(name)
                .map_err(run_err)
        };
        let k = Kernels {
            gather: f("elementwise", "embedding_gather")?,
            rmsnorm: f("elementwise", "rmsnorm")?,
            rope: f("elementwise", "rope")?,
            silu_mul: f("elementwise", "silu_mul")?,
            add: f("elementwise", "add_inplace")?,
            add_bias: f("elementwise", "add_bias")?,
            kv_write: f("attention", "kv_write")?,
            attention: f("attention", "paged_attention")?,
            fill: f("elementwise", "fill_random")?,
        };
        Ok(CudaRunner { ctx, stream, blas, k })
    }

    fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<bf16>, CudaError> {
        let b: Vec<bf16> = v.iter().map(|x| bf16::from_f32(*x)).collect();
        self.stream.clone_htod(&b).map_err(run_err)
    }

    fn upload_weight(&self, w: &PackedWeight) -> Result<CudaSlice<bf16>, CudaError> {
        let mut row = vec![0f32; w.cols];
        let mut all = Vec::with_capacity(w.rows * w.cols);
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            all.extend(row.iter().map(|x| bf16::from_f32(*x)));
        }
        self.stream.clone_htod(&all).map_err(run_err)
    }

    /// Copies `w` to the device as bf16 (dequantized once, here).
    pub fn upload(&self, w: &LlamaWeights) -> Result<CudaModel, CudaError> {
        let c = &w.config;
        if !c.head_dim.is_multiple_of(32)
            || c.head_dim > 256
            || c.kv_heads == 0
            || !c.heads.is_multiple_of(c.kv_heads)
        {
            return Err(CudaError::Invalid(format!(
                "the CUDA attention kernel takes head dims that are multiples of 32 up to 256 \
                 and whole query groups; this model has head_dim {}, {} heads, {} KV heads",
                c.head_dim, c.heads, c.kv_heads
            )));
        }
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let bias = match (&l.bq, &l.bk, &l.bv) {
                (Some(q), Some(k), Some(v)) => {
                    Some([self.upload_f32(q)?, self.upload_f32(k)?, self.upload_f32(v)?])
                }
                _ => None,
            };
            layers.push(DeviceLayer {
                attn_norm: self.upload_f32(&l.attn_norm)?,
                wq: self.upload_weight(&l.wq)?,
                wk: self.upload_weight(&l.wk)?,
                wv: self.upload_weight(&l.wv)?,
                bias,
                wo: self.upload_weight(&l.wo)?,
                ffn_norm: self.upload_f32(&l.ffn_norm)?,
                w_gate: self.upload_weight(&l.w_gate)?,
                w_up: self.upload_weight(&l.w_up)?,
                w_down: self.upload_weight(&l.w_down)?,
            });
        }
        Ok(CudaModel {
            config: w.config.clone(),
            embed: self.upload_weight(&w.embed)?,
            lm_head: w.output.as_ref().map(|o| self.upload_weight(o)).transpose()?,
            norm: self.upload_f32(&w.norm)?,
            layers,
            inv_freq: self.stream.clone_htod(&w.inv_freq).map_err(run_err)?,
        })
    }

    fn random(
        &self,
        n: usize,
        seed: u64,
        scale: f32,
        offset: f32,
    ) -> Result<CudaSlice<bf16>, CudaError> {
        let mut out = self.stream.alloc_zeros::<bf16>(n).map_err(run_err)?;
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(&self.k.fill);
        b.arg(&mut out).arg(&n_i).arg(&seed).arg(&scale).arg(&offset);
        // SAFETY: arguments match `fill_random`.
        unsafe { b.launch(flat(n)) }.map_err(run_err)?;
        Ok(out)
    }

    /// A model of `config`'s shape with random bf16 weights made on the device (uniform in
    /// +-1/sqrt(fan-in), norms 1): for benchmarks of shapes too large to build on the host.
    pub fn random_model(&self, config: &LlamaConfig, seed: u64) -> Result<CudaModel, CudaError> {
        let c = config;
        let (h, q, kv, ff) = (c.hidden, c.q_dim(), c.kv_dim(), c.intermediate);
        let mut next = seed;
        let mut w = |rows: usize, cols: usize| {
            next = next.wrapping_add(0x9E37_79B9);
            self.random(rows * cols, next, 1.0 / (cols as f32).sqrt(), 0.0)
        };
        let mut layers = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            layers.push(DeviceLayer {
                attn_norm: self.random(h, 0, 0.0, 1.0)?,
                wq: w(q, h)?,
                wk: w(kv, h)?,
                wv: w(kv, h)?,
                bias: None,
                wo: w(h, q)?,
                ffn_norm: self.random(h, 0, 0.0, 1.0)?,
                w_gate: w(ff, h)?,
                w_up: w(ff, h)?,
                w_down: w(h, ff)?,
            });
        }
        let inv_freq = c.inv_freq(None);
        Ok(CudaModel {
            config: c.clone(),
            embed: w(c.vocab_size, h)?,
            lm_head: if c.tied_embeddings { None } else { Some(w(c.vocab_size, h)?) },
            norm: self.random(h, 0, 0.0, 1.0)?,
            layers,
            inv_freq: self.stream.clone_htod(&inv_freq).map_err(run_err)?,
        })
    }

    /// Waits for everything queued on the device.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(run_err)
    }

    /// A zeroed cache of `num_blocks` blocks of `block_size` positions for `m`.
    pub fn kv_cache(
        &self,
        m: &CudaModel,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<CudaKvCache, CudaError> {
        let n = block_size * num_blocks * m.config.kv_dim();
        let mut k = Vec::with_capacity(m.config.layers);
        let mut v = Vec::with_capacity(m.config.layers);
        for _ in 0..m.config.layers {
            k.push(self.stream.alloc_zeros::<bf16>(n).map_err(run_err)?);
            v.push(self.stream.alloc_zeros::<bf16>(n).map_err(run_err)?);
        }
        Ok(CudaKvCache { k, v, block_size, num_blocks })
    }

    /// `y[n, out] = x[n, in] W[out, in]^T` (row-major) through cublasGemmEx: bf16 inputs, f32
    /// compute, a bf16 or f32 result (the logits are kept in f32: bf16's 8 mantissa bits would
    /// blur near-ties).
    fn linear<T: GemmOut>(
        &self,
        x: &CudaSlice<bf16>,
        n: usize,
        w: &CudaSlice<bf16>,
        out: usize,
        inp: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        use cudarc::cublas::{result, sys};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let mut y = self.stream.alloc_zeros::<T>(n * out).map_err(run_err)?;
        let dim = |v: usize| i32::try_from(v).map_err(|_| run_err("dimension over i32"));
        let (alpha, beta) = (1.0f32, 0.0f32);
        {
            let (a, _ra) = w.device_ptr(&self.stream);
            let (b, _rb) = x.device_ptr(&self.stream);
            let (c, _rc) = y.device_ptr_mut(&self.stream);
            // Column-major view: Y^T [out, n] = (W [out, in] as stored) x X^T [in, n]. The
            // buffers hold out*in, n*in and n*out elements; the pointers stay valid while the
            // guards live.
            // SAFETY: as above; A and B are bf16, C is T.
            unsafe {
                result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    dim(out)?,
                    dim(n)?,
                    dim(inp)?,
                    (&alpha) as *const f32 as *const _,
                    a as *const _,
                    sys::cudaDataType_t::CUDA_R_16BF,
                    dim(inp)?,
                    b as *const _,
                    sys::cudaDataType_t::CUDA_R_16BF,
                    dim(inp)?,
                    (&beta) as *const f32 as *const _,
                    c as *mut _,
                    T::CUDA_TYPE,
                    dim(out)?,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(run_err)?;
        }
        Ok(y)
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<CudaSlice<bf16>, CudaError> {
        let mut out = self.stream.alloc_zeros::<bf16>(rows * dim).map_err(run_err)?;
        let d = dim as i32;
        let mut b = self.stream.launch_builder(&self.k.rmsnorm);
        b.arg(x).arg(w).arg(&mut out).arg(&d).arg(&eps);
        // SAFETY: arguments match `rmsnorm` in kernels/elementwise.cu.
        unsafe { b.launch(grid(rows, 1, 256)) }.map_err(run_err)?;
        Ok(out)
    }

    fn add(&self, x: &mut CudaSlice<bf16>, y: &CudaSlice<bf16>, n: usize) -> Result<(), CudaError> {
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(&self.k.add);
        b.arg(x).arg(y).arg(&n_i);
        // SAFETY: arguments match `add_inplace`.
        unsafe { b.launch(flat(n)) }.map_err(run_err)?;
        Ok(())
    }

    fn add_bias(
        &self,
        x: &mut CudaSlice<bf16>,
        bias: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
    ) -> Result<(), CudaError> {
        let d = dim as i32;
        let mut b = self.stream.launch_builder(&self.k.add_bias);
        b.arg(x).arg(bias).arg(&d);
        // SAFETY: arguments match `add_bias`.
        unsafe { b.launch(grid(rows, 1, 256)) }.map_err(run_err)?;
        Ok(())
    }

    /// Runs the batch and returns the wanted logits, `vocab` floats per wanted token, in batch
    /// order (the CPU runner's contract).
    pub fn forward(
        &self,
        m: &CudaModel,
        cache: &mut CudaKvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<Vec<f32>, CudaError> {
        match self.forward_device(m, cache, batch)? {
            Some(logits) => self.stream.clone_dtoh(&logits).map_err(run_err),
            None => Ok(Vec::new()),
        }
    }

    /// As [`CudaRunner::forward`], leaving the logits on the device (`None` when none are
    /// wanted); the work is queued, not waited for.
    pub fn forward_device(
        &self,
        m: &CudaModel,
        cache: &mut CudaKvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<Option<CudaSlice<f32>>, CudaError> {
        let c = &m.config;
        let (hidden, q_dim, kv_dim, hd) = (c.hidden, c.q_dim(), c.kv_dim(), c.head_dim);
        let bs = cache.block_size;
        let max_blocks = batch.iter().map(|s| s.block_table.len()).max().unwrap_or(0).max(1);
        let (mut ids, mut pos, mut q_seq, mut ctx_len, mut slots) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut tables = vec![0i32; batch.len() * max_blocks];
        let mut wanted = Vec::new();
        for (s, seq) in batch.iter().enumerate() {
            let end = seq.start_pos + seq.tokens.len();
            if end > c.context_length || seq.block_table.len() * bs < end {
                return Err(CudaError::Invalid(format!(
                    "sequence {s}: {end} tokens do not fit the context or its block table"
                )));
            }
            for (j, &b) in seq.block_table.iter().enumerate() {
                if b as usize >= cache.num_blocks {
                    return Err(CudaError::Invalid(format!("block {b} out of range")));
                }
                tables[s * max_blocks + j] = b as i32;
            }
            for (i, &tok) in seq.tokens.iter().enumerate() {
                if tok as usize >= c.vocab_size {
                    return Err(CudaError::Invalid(format!(
                        "token id {tok} outside the vocabulary"
                    )));
                }
                let p = seq.start_pos + i;
                let last = i + 1 == seq.tokens.len();
                if seq.logits == LogitsWanted::All || (seq.logits == LogitsWanted::Last && last) {
                    wanted.push(ids.len() as i32);
                }
                ids.push(tok as i32);
                pos.push(p as i32);
                q_seq.push(s as i32);
                ctx_len.push(p as i32 + 1);
                slots.push((seq.block_table[p / bs] as usize * bs + p % bs) as i32);
            }
        }
        let n = ids.len();
        if n == 0 {
            return Ok(None);
        }
        let up = |v: &[i32]| self.stream.clone_htod(v).map_err(run_err);
        let (ids_d, pos_d, seq_d, ctx_d, slots_d, tables_d) =
            (up(&ids)?, up(&pos)?, up(&q_seq)?, up(&ctx_len)?, up(&slots)?, up(&tables)?);

        let mut x = self.stream.alloc_zeros::<bf16>(n * hidden).map_err(run_err)?;
        let h_i = hidden as i32;
        let mut b = self.stream.launch_builder(&self.k.gather);
        b.arg(&m.embed).arg(&ids_d).arg(&mut x).arg(&h_i);
        // SAFETY: arguments match `embedding_gather`.
        unsafe { b.launch(grid(n, 1, 256)) }.map_err(run_err)?;

        let (heads, kv_heads) = (c.heads as i32, c.kv_heads as i32);
        let (hd_i, rd_i, kvd_i) = (hd as i32, c.rope_dims as i32, kv_dim as i32);
        let interleaved = i32::from(c.rope_style == RopeStyle::Interleaved);
        let (bs_i, mb_i) = (bs as i32, max_blocks as i32);
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, l) in m.layers.iter().enumerate() {
            let xn = self.rmsnorm(&x, &l.attn_norm, n, hidden, c.rms_eps)?;
            let mut q = self.linear::<bf16>(&xn, n, &l.wq, q_dim, hidden)?;
            let mut k = self.linear::<bf16>(&xn, n, &l.wk, kv_dim, hidden)?;
            let mut v = self.linear::<bf16>(&xn, n, &l.wv, kv_dim, hidden)?;
            if let Some([bq, bk, bv]) = &l.bias {
                self.add_bias(&mut q, bq, n, q_dim)?;
                self.add_bias(&mut k, bk, n, kv_dim)?;
                self.add_bias(&mut v, bv, n, kv_dim)?;
            }
            let mut b = self.stream.launch_builder(&self.k.rope);
            b.arg(&mut q).arg(&mut k).arg(&pos_d).arg(&m.inv_freq);
            b.arg(&heads).arg(&kv_heads).arg(&hd_i).arg(&rd_i).arg(&interleaved);
            // SAFETY: arguments match `rope`.
            unsafe { b.launch(grid(n, 1, 128)) }.map_err(run_err)?;
            let (kc, vc) = (&mut cache.k[li], &mut cache.v[li]);
            let mut b = self.stream.launch_builder(&self.k.kv_write);
            b.arg(&k).arg(&v).arg(&mut *kc).arg(&mut *vc).arg(&slots_d).arg(&kvd_i);
            // SAFETY: arguments match `kv_write`; every slot is inside the cache (checked).
            unsafe { b.launch(grid(n, 1, 128)) }.map_err(run_err)?;
            let mut attn = self.stream.alloc_zeros::<bf16>(n * q_dim).map_err(run_err)?;
            let mut b = self.stream.launch_builder(&self.k.attention);
            b.arg(&q).arg(&*kc).arg(&*vc).arg(&tables_d).arg(&seq_d).arg(&ctx_d).arg(&mut attn);
            b.arg(&heads).arg(&kv_heads).arg(&hd_i).arg(&bs_i).arg(&mb_i).arg(&scale);
            // SAFETY: arguments match `paged_attention`; head_dim is a multiple of 32 up to 256.
            unsafe { b.launch(grid(n, c.heads, 128)) }.map_err(run_err)?;
            let o = self.linear::<bf16>(&attn, n, &l.wo, hidden, q_dim)?;
            self.add(&mut x, &o, n * hidden)?;
            let xn = self.rmsnorm(&x, &l.ffn_norm, n, hidden, c.rms_eps)?;
            let gate = self.linear::<bf16>(&xn, n, &l.w_gate, c.intermediate, hidden)?;
            let upv = self.linear::<bf16>(&xn, n, &l.w_up, c.intermediate, hidden)?;
            let mut act = self.stream.alloc_zeros::<bf16>(n * c.intermediate).map_err(run_err)?;
            let ni = (n * c.intermediate) as i64;
            let mut b = self.stream.launch_builder(&self.k.silu_mul);
            b.arg(&gate).arg(&upv).arg(&mut act).arg(&ni);
            // SAFETY: arguments match `silu_mul`.
            unsafe { b.launch(flat(n * c.intermediate)) }.map_err(run_err)?;
            let down = self.linear::<bf16>(&act, n, &l.w_down, hidden, c.intermediate)?;
            self.add(&mut x, &down, n * hidden)?;
        }
        if wanted.is_empty() {
            return Ok(None);
        }
        let xn = self.rmsnorm(&x, &m.norm, n, hidden, c.rms_eps)?;
        // The wanted rows, gathered with the embedding kernel (a row gather).
        let w_d = up(&wanted)?;
        let mut rows = self.stream.alloc_zeros::<bf16>(wanted.len() * hidden).map_err(run_err)?;
        let mut b = self.stream.launch_builder(&self.k.gather);
        b.arg(&xn).arg(&w_d).arg(&mut rows).arg(&h_i);
        // SAFETY: arguments match `embedding_gather`; every index is below n.
        unsafe { b.launch(grid(wanted.len(), 1, 256)) }.map_err(run_err)?;
        let head = m.lm_head.as_ref().unwrap_or(&m.embed);
        self.linear::<f32>(&rows, wanted.len(), head, c.vocab_size, hidden).map(Some)
    }
}
