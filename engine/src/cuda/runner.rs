//! The forward pass on the GPU: the same contract as the CPU [`Runner`](crate::forward::Runner)
//! (a batch of [`SeqInput`]s, each with its own positions and block table, prefill chunks and
//! decode steps mixed; the wanted logits back in batch order), over weights dequantized to
//! bf16 once at upload, a paged bf16 KV cache on the device, our kernels and cuBLAS bf16 GEMMs
//! (f32 accumulation).
//!
//! A pass allocates nothing: its inputs and activations live in a [`Workspace`] the cache
//! keeps (grown when a larger batch comes). A batch of decode steps only (one token and its
//! logits per sequence, at most [`GRAPH_BUCKETS`]'s largest) runs as a CUDA graph captured
//! once per batch-size bucket and cache, padded to the bucket with rows that write no K/V:
//! one launch per step instead of a dozen per layer.
//!
//! Attention runs the prefill rows through a tensor-core kernel in tiles of up to 64 rows of one
//! sequence (head sizes 64 and 128) and the decode rows one by one, a row's context split into
//! parts run side by side when the rows alone are too few to fill the device
//! ([`decode_splits`]).
//!
//! Status: written on a machine without a GPU. Every kernel passes its checks under the CPU
//! emulation of CUDA (`engine/tests/kernel_emu.rs`), and this runner passes the parity checks
//! against the CPU backend through an emulated driver and cuBLAS
//! (`engine/tests/cuda_emulated.rs`); the device tests (`engine/tests/cuda_device.rs`) have not
//! run on a GPU yet.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, CudaView, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

use super::{CudaError, KERNELS, compile, compile_with, probe};
use crate::cpu::matmul::PackedWeight;
use crate::forward::{LogitsWanted, SeqInput};
use crate::forward::{PassTimes, Pick, StepOutput};
use crate::lora::{LoraAdapter, Target};
use crate::model::{LlamaConfig, LlamaWeights, RopeStyle};
use crate::quant::{GgmlType, QK};

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

/// Batches of up to this many rows can go through our matrix-vector kernels (kernels/gemv.cu)
/// rather than cuBLAS: a decode step at such a batch is a stream over the weights.
const GEMV_MAX_ROWS: usize = 4;
/// ... and up to this many do by default: on the H200 (4 warps x 2 loads), an 8B-shaped step
/// at one row was 1.10x faster through them than through cuBLAS, at two rows 1.04x, at four
/// 0.70x (their arithmetic per weight byte grows with the rows; cuBLAS's tensor-core kernels
/// do not care).
const GEMV_DEFAULT_ROWS: usize = 2;
/// Warps per matrix-vector block (`GEMV_WARPS`) and loads in flight per lane (`GEMV_UNROLL`),
/// as kernels/gemv.cu sets them unless told otherwise. On the H200, an 8B-shaped decode step
/// at batch 1 took 4.33 ms with 4 x 2, 4.35 with 8 x 2, 4.59 with 4 x 4 and 5.2-5.9 with 8 or
/// 16 loads (kernels/NOTES.md).
const GEMV_WARPS: usize = 4;
const GEMV_UNROLL: usize = 2;
/// Rounds of keys a step of the wide decode attention kernels loads before using them
/// (`ATTN_ROUNDS`), and whether a step first brings the next one's keys and values into L2
/// (`ATTN_PREFETCH`), as kernels/attention.cu sets them unless told otherwise.
const ATTN_ROUNDS: usize = 2;
const ATTN_PREFETCH: bool = false;

/// The NVRTC options that build kernels/gemv.cu with `warps` warps a block (1, 2, 4, 8 or 16)
/// and `unroll` loads in flight a lane (1..=16, at most 128 / warps): the shapes
/// [`CudaRunner::set_gemv_shape`] takes.
pub fn gemv_options((warps, unroll): (usize, usize)) -> Result<Vec<String>, CudaError> {
    if ![1, 2, 4, 8, 16].contains(&warps) || !(1..=16).contains(&unroll) || warps * unroll > 128 {
        return Err(CudaError::Invalid(format!(
            "matrix-vector shape of {warps} warps and {unroll} loads: want 1, 2, 4, 8 or 16 \
             warps and 1..=16 loads, at most 128 in all"
        )));
    }
    Ok(vec![format!("-DGEMV_WARPS={warps}"), format!("-DGEMV_UNROLL={unroll}")])
}

/// The NVRTC options that build kernels/attention.cu's wide decode kernels with `rounds`
/// rounds of keys a step (1..=8), each step first bringing the next one's keys and values into
/// L2 or not (`prefetch`): the shapes [`CudaRunner::set_attention_shape`] takes.
pub fn attention_options((rounds, prefetch): (usize, bool)) -> Result<Vec<String>, CudaError> {
    if !(1..=8).contains(&rounds) {
        return Err(CudaError::Invalid(format!(
            "decode attention of {rounds} rounds of keys a step: want 1..=8"
        )));
    }
    Ok(vec![format!("-DATTN_ROUNDS={rounds}"), format!("-DATTN_PREFETCH={}", u8::from(prefetch))])
}

/// The matrix-vector kernels as compiled for one shape: `gemv1..4`, `gemv_norm1..4` and
/// `gemv_rope1..4`, by rows - 1.
struct GemvKernels {
    warps: usize,
    unroll: usize,
    plain: [CudaFunction; GEMV_MAX_ROWS],
    norm: [CudaFunction; GEMV_MAX_ROWS],
    rope: [CudaFunction; GEMV_MAX_ROWS],
}

impl GemvKernels {
    fn load(
        module: &Arc<cudarc::driver::CudaModule>,
        (warps, unroll): (usize, usize),
    ) -> Result<Self, CudaError> {
        let f = |name: String| module.load_function(&name).map_err(run_err);
        Ok(GemvKernels {
            warps,
            unroll,
            plain: every([1, 2, 3, 4].map(|r| f(format!("gemv{r}"))))?,
            norm: every([1, 2, 3, 4].map(|r| f(format!("gemv_norm{r}"))))?,
            rope: every([1, 2, 3, 4].map(|r| f(format!("gemv_rope{r}"))))?,
        })
    }
}

/// Parts a matrix-vector kernel splits each output's row into (1, 2 or 4, one warp each): the
/// fewest that give each of the device's multiprocessors 16 warps, so a narrow matrix still
/// keeps the device's memory busy. (An 8B model's matrices are all wide enough for 1 on an
/// H200; there, splitting them 4 ways was slower: each warp's part too short.)
fn gemv_splits(out: usize, sms: usize) -> usize {
    [1, 2, 4].into_iter().find(|s| out * s >= 16 * sms).unwrap_or(4)
}

/// What a matrix-vector kernel does with its product (`GEMV_*` in kernels/gemv.cu).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Gemv {
    /// Store it, bf16.
    Bf16 = 0,
    /// Store it, f32 (the logits).
    F32 = 1,
    /// Add it (rounded to bf16) to the bf16 output: the residual stream.
    Add = 2,
    /// The weights are [gate; up]: store silu(gate) * up, bf16.
    Silu = 3,
}

fn run_err(e: impl std::fmt::Display) -> CudaError {
    CudaError::Run(e.to_string())
}

/// A size as a kernel's or cuBLAS's `int`.
fn dim(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| run_err("dimension over i32"))
}

/// A pointer to a kernel parameter's value, as cuLaunchKernel(Ex) takes each.
fn param<T>(v: &T) -> *mut std::ffi::c_void {
    (v as *const T).cast_mut().cast()
}

/// All of `v`, or its first error.
fn every<T, const N: usize>(v: [Result<T, CudaError>; N]) -> Result<[T; N], CudaError> {
    let v = v.into_iter().collect::<Result<Vec<T>, _>>()?;
    v.try_into().map_err(|_| run_err("a kernel array of the wrong length"))
}

struct Kernels {
    gather: CudaFunction,
    rmsnorm: CudaFunction,
    add_rmsnorm: CudaFunction,
    rope_kv: CudaFunction,
    silu_mul: CudaFunction,
    add_bias: CudaFunction,
    argmax: CudaFunction,
    sample: CudaFunction,
    /// The tensor-core prefill attention, by head size.
    prefill: [(usize, CudaFunction); 2],
    fill: CudaFunction,
    dequant_q4_0: CudaFunction,
    dequant_q4_1: CudaFunction,
    dequant_q8_0: CudaFunction,
    lora_shrink: CudaFunction,
    lora_expand: CudaFunction,
}

/// The tenant adapters of the passes since the set last changed, on the device: their
/// updates in one bf16 arena (each `A` as `[rank][in]`, each `B` as `[out][rank]`, the values
/// the CPU serves: f16 under their powers of two, whose scale comes with each update), each
/// update's place and scale by (slot, layer x 7 + projection), each slot's rank; and a pass's
/// rows' slots and `u` (kernels/lora.cu).
struct LoraDevice {
    /// The adapters' revisions, by slot.
    digests: Vec<[u8; 32]>,
    arena: CudaSlice<bf16>,
    a_off: CudaSlice<i64>,
    b_off: CudaSlice<i64>,
    scale: CudaSlice<f32>,
    rank: CudaSlice<i32>,
    max_rank: usize,
    /// Updates per slot: layers x 7.
    pairs: usize,
    /// Each row's slot (-1: the bare base), for up to `rows` rows.
    row_slot: CudaSlice<i32>,
    u: CudaSlice<f32>,
    rows: usize,
}

/// The decode attention kernels as compiled for one shape: `paged_attention` for any head size,
/// and built for one head size (the wide kernels, whose shape is `rounds` and `prefetch`).
struct DecodeAttention {
    rounds: usize,
    prefetch: bool,
    any: CudaFunction,
    by_head: [(usize, CudaFunction); 2],
}

impl DecodeAttention {
    fn load(
        module: &Arc<cudarc::driver::CudaModule>,
        (rounds, prefetch): (usize, bool),
    ) -> Result<Self, CudaError> {
        let f = |name: &str| module.load_function(name).map_err(run_err);
        Ok(DecodeAttention {
            rounds,
            prefetch,
            any: f("paged_attention")?,
            by_head: [(64, f("paged_attention_64")?), (128, f("paged_attention_128")?)],
        })
    }
}

/// One layer's weights; the projections that read the same input are stacked into one matrix
/// (one GEMM each): Q, K and V rows in `wqkv` (and their biases), gate and up rows in
/// `w_gate_up`.
struct DeviceLayer {
    attn_norm: CudaSlice<bf16>,
    wqkv: CudaSlice<bf16>,
    bias: Option<CudaSlice<bf16>>,
    wo: CudaSlice<bf16>,
    ffn_norm: CudaSlice<bf16>,
    w_gate_up: CudaSlice<bf16>,
    w_down: CudaSlice<bf16>,
}

/// Decode batch sizes that get a CUDA graph: a batch of `n` decode steps runs in the graph of
/// the smallest bucket >= n.
pub const GRAPH_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// cuBLAS workspace, set once so GEMMs never allocate (required inside a graph capture).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// Ids of models and runners, so graphs captured over one's weights, kernels and cuBLAS
/// workspace are never replayed with another's.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A model's weights on the device, bf16.
pub struct CudaModel {
    /// Distinguishes models, so a graph captured over one model's weights is never replayed
    /// with another's.
    id: u64,
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
/// for V; with the workspace of eager passes and the decode graphs captured over it.
pub struct CudaKvCache {
    k: Vec<CudaSlice<bf16>>,
    v: Vec<CudaSlice<bf16>>,
    block_size: usize,
    num_blocks: usize,
    /// Block-table entries per sequence in a graph (the context length in blocks).
    graph_table: usize,
    /// The eager passes' workspace, with the model it was sized for.
    eager: Option<(u64, Workspace)>,
    /// The decode graphs' workspace, as many rows as the largest bucket, shared by every
    /// bucket's graph (they replay one after another on one stream).
    graph_ws: Option<Workspace>,
    /// Captured decode steps by bucket.
    graphs: HashMap<usize, Captured>,
    /// The runner and model the graphs and their workspace belong to.
    graph_owner: (u64, u64),
    use_graphs: bool,
}

impl CudaKvCache {
    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Turns the decode graphs on (the default) or off (every pass eager: for comparison).
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
    }

    /// Decode graphs captured so far, by batch-size bucket.
    pub fn graph_buckets(&self) -> Vec<usize> {
        let mut b: Vec<usize> = self.graphs.keys().copied().collect();
        b.sort_unstable();
        b
    }
}

/// Device buffers of a pass: the inputs (uploaded before each pass, in one copy) and every
/// activation, for up to `rows` token rows, `wanted` logit rows and `table` block-table
/// entries.
struct Workspace {
    rows: usize,
    wanted: usize,
    table: usize,
    /// Every integer input, one after another ([`Workspace::input`]), and its host staging.
    inputs: CudaSlice<i32>,
    staging: Vec<i32>,
    x: CudaSlice<bf16>,
    xn: CudaSlice<bf16>,
    /// Each row's Q, K and V projections, one after another.
    qkv: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    /// Each row's gate and up projections, one after another.
    gate_up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    picked: CudaSlice<bf16>,
    logits: CudaSlice<f32>,
    /// Split-K decode attention: the parts' partial states, and a count per (row, head group)
    /// ([`decode_splits`]).
    part: CudaSlice<f32>,
    counters: CudaSlice<i32>,
}

/// The integer inputs of a pass, in their order in [`Workspace::inputs`].
#[derive(Clone, Copy)]
enum Input {
    Ids,
    Pos,
    QSeq,
    CtxLen,
    Slots,
    Singles,
    /// Two ints per tile.
    Tiles,
    Wanted,
    /// Last: a pass copies the inputs up to the end of its tables only.
    Tables,
}

impl Workspace {
    /// Where input `i` starts in `inputs`, and its capacity.
    fn input_range(&self, i: Input) -> (usize, usize) {
        let r = self.rows;
        match i {
            Input::Ids => (0, r),
            Input::Pos => (r, r),
            Input::QSeq => (2 * r, r),
            Input::CtxLen => (3 * r, r),
            Input::Slots => (4 * r, r),
            Input::Singles => (5 * r, r),
            Input::Tiles => (6 * r, 2 * r),
            Input::Wanted => (8 * r, self.wanted),
            Input::Tables => (8 * r + self.wanted, self.table),
        }
    }

    /// The device memory its buffers hold, as allocated.
    fn bytes(&self) -> usize {
        let halves = [
            &self.x,
            &self.xn,
            &self.qkv,
            &self.attn,
            &self.o,
            &self.gate_up,
            &self.act,
            &self.picked,
        ];
        let ints = self.inputs.len() * size_of::<i32>();
        ints + self.counters.len() * size_of::<i32>()
            + halves.iter().map(|b| b.len() * size_of::<bf16>()).sum::<usize>()
            + (self.logits.len() + self.part.len()) * size_of::<f32>()
    }

    /// Input `i`'s place in `inputs` (its whole capacity; a pass reads what its plan holds).
    fn span(&self, i: Input) -> std::ops::Range<usize> {
        let (at, len) = self.input_range(i);
        at..at + len
    }
}

/// A CUDA graph that may move to another thread.
struct Captured(CudaGraph);

// SAFETY: CUDA graph handles are not tied to the thread that made them; the driver only
// forbids using one graph from two threads at once, and a `Captured` is reached only through
// `&mut CudaKvCache`.
unsafe impl Send for Captured {}

/// The host side of one pass, checked: per token row its id, position, sequence, context
/// length and cache slot (-1: write no K/V); the block tables, `max_blocks` entries per
/// sequence; the rows whose logits are wanted; how attention runs: the prefill rows in tiles
/// of up to [`PREFILL_TILE`] rows of one sequence (first row, count) for the tensor-core
/// kernel, the other rows (decode steps, and every row when the head size has no tiled
/// kernel) one by one.
struct Plan {
    ids: Vec<i32>,
    pos: Vec<i32>,
    q_seq: Vec<i32>,
    ctx_len: Vec<i32>,
    slots: Vec<i32>,
    tables: Vec<i32>,
    max_blocks: usize,
    wanted: Vec<i32>,
    tiles: Vec<i32>,
    singles: Vec<i32>,
}

/// Rows per tile of `prefill_attention_*` (FA_ROWS in kernels/attention.cu).
const PREFILL_TILE: usize = 64;

/// Query heads per block of `paged_attention` (ATTN_GROUP in kernels/attention.cu).
const ATTN_GROUP: usize = 4;

/// The most parts a decode row's context is split into (split-K attention).
const MAX_SPLITS: usize = 64;

/// Head sizes with a `prefill_attention_<head_dim>` kernel.
const TILED_HEAD_DIMS: [usize; 2] = [64, 128];

/// The sizes of a pass over a loaded workspace.
#[derive(Clone, Copy)]
struct Pass {
    /// Token rows.
    rows: usize,
    /// Block-table entries per sequence.
    max_blocks: usize,
    /// Rows whose logits are wanted.
    wanted: usize,
    /// Prefill tiles (tensor-core attention).
    tiles: usize,
    /// Rows attended one by one.
    singles: usize,
}

impl Plan {
    fn pass(&self) -> Pass {
        Pass {
            rows: self.ids.len(),
            max_blocks: self.max_blocks,
            wanted: self.wanted.len(),
            tiles: self.tiles.len() / 2,
            singles: self.singles.len(),
        }
    }
}

/// Runs forward passes on one device.
pub struct CudaRunner {
    id: u64,
    /// Not `Sync`: one thread at a time may queue work on the stream (a capture on it would
    /// take in another thread's launches).
    _one_thread: std::marker::PhantomData<std::cell::Cell<()>>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace, kept alive with the handle.
    _blas_workspace: CudaSlice<u8>,
    k: Kernels,
    /// The device's multiprocessors (how many attention blocks fill it).
    sms: usize,
    /// The most parts decode attention splits a context into ([`MAX_SPLITS`] unless set).
    max_splits: std::cell::Cell<usize>,
    /// Batches of up to this many rows take the matrix-vector kernels (at most
    /// [`GEMV_MAX_ROWS`]; 0: cuBLAS always, for comparison).
    gemv_rows: std::cell::Cell<usize>,
    /// Whether the matrix-vector kernels are launched with programmatic stream serialization
    /// ([`CudaRunner::set_pdl`]).
    pdl: std::cell::Cell<bool>,
    /// The matrix-vector kernels in use ([`CudaRunner::set_gemv_shape`]).
    gemv: std::cell::RefCell<GemvKernels>,
    /// The decode attention kernels in use ([`CudaRunner::set_attention_shape`]).
    attention: std::cell::RefCell<DecodeAttention>,
    /// The device's architecture (`sm_90`), for kernels compiled again.
    arch: String,
    /// While [`CudaRunner::profile`] runs a pass: an event recorded after each phase.
    marks: std::cell::RefCell<Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>>,
    /// The serving passes' device time ([`CudaRunner::take_pass_times`]).
    passes: std::cell::RefCell<PassClock>,
    /// Where the pending pass's picked ids are made and copied back.
    pick_slot: std::cell::RefCell<Option<PickSlot>>,
    /// While a serving pass is launched: where its first copy up records its start.
    pass_start: std::cell::RefCell<Option<Option<cudarc::driver::CudaEvent>>>,
    /// The tenant adapters on the device.
    lora: std::cell::RefCell<Option<LoraDevice>>,
}

/// One pass's picked ids: on the device, and the page-locked host memory they are copied to
/// (as long as each other: a copy's length is its destination's).
struct PickSlot {
    dev: CudaSlice<i32>,
    host: cudarc::driver::PinnedHostSlice<i32>,
}

/// A pass [launched](CudaRunner::launch_picking) and not yet collected.
pub struct PendingPicks {
    /// The logits copied back already, and a pick per sequence (filled at collection).
    out: StepOutput,
    /// Whether ids were picked (they are in the runner's pick slot).
    picked: bool,
    /// The pass's wanted rows ([`wanted_rows`](crate::forward::wanted_rows)).
    rows: Vec<Option<usize>>,
    /// Whether collecting waits for the pass (one that wants no logits is left queued).
    wait: bool,
}

/// The serving passes' device time, from an event recorded on the stream before each pass's
/// first work and one after its last: how long the device ran them, and how long it sat idle
/// between one pass's end and the next one's start (the host's scheduling, sampling and
/// launching, when nothing overlaps them).
#[derive(Default)]
struct PassClock {
    /// Start and end events of passes whose times are not read yet, in order.
    recorded: Vec<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    /// The end of the last pass read, while the next pass's gap counts.
    last_end: Option<cudarc::driver::CudaEvent>,
    /// Read so far and not yet taken.
    times: PassTimes,
}

impl std::fmt::Debug for CudaRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRunner").field("ordinal", &self.ctx.ordinal()).finish()
    }
}

fn grid(x: usize, y: usize, block: u32) -> LaunchConfig {
    grid3(x, y, 1, block)
}

fn grid3(x: usize, y: usize, z: usize, block: u32) -> LaunchConfig {
    let dim = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    LaunchConfig {
        grid_dim: (dim(x), dim(y), dim(z)),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Blocks of decode attention that keep the device busy: four per multiprocessor (as many as
/// fit one at once, by their registers).
fn attention_target(sms: usize) -> usize {
    4 * sms.max(1)
}

/// How many parts `paged_attention` may split each of `rows` rows' context into, with
/// `groups` blocks per row: enough for [`attention_target`] blocks in all when the rows alone
/// are fewer, at most `max` and [`MAX_SPLITS`] (the kernel gives a part at least SPLIT_MIN_KEYS keys, so
/// short contexts use fewer). Whenever this is above 1, `rows * groups < target` and
/// `rows * groups * splits < 2 * target`, which bounds the partial states
/// ([`split_capacity`]).
fn decode_splits(rows: usize, groups: usize, sms: usize, max: usize) -> usize {
    let target = attention_target(sms);
    let blocks = rows * groups;
    if blocks == 0 || blocks >= target {
        return 1;
    }
    target.div_ceil(blocks).clamp(1, max.clamp(1, MAX_SPLITS))
}

/// Sizes of the split-K buffers for `c`: partial-state floats (each query head's part: its
/// max, sum and head_dim weighted values) and counters (one per row and head group).
fn split_capacity(c: &LlamaConfig, sms: usize) -> (usize, usize) {
    let target = attention_target(sms);
    // Query heads per head group are at most ATTN_GROUP.
    (2 * target * ATTN_GROUP * (c.head_dim + 2), target)
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
        // SAFETY: all of this runner's work (uploads, kernels, GEMMs, copies back) goes
        // through its one stream, so stream order alone orders every use of a buffer; no
        // events are needed, and none may be recorded while a graph is captured.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().map_err(device)?;
        let blas = CudaBlas::new(stream.clone()).map_err(run_err)?;
        let mut blas_workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE).map_err(device)?;
        {
            use cudarc::driver::DevicePtrMut;
            let (ws, _guard) = blas_workspace.device_ptr_mut(&stream);
            // SAFETY: the handle is live; the buffer holds CUBLAS_WORKSPACE bytes and lives as
            // long as the runner (and so the handle).
            let status = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ws as *mut std::ffi::c_void,
                    CUBLAS_WORKSPACE,
                )
            };
            if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(run_err(format!("cublasSetWorkspace: {status:?}")));
            }
        }
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
        let module = |name: &str| {
            let m = modules.iter().find(|(n, _)| *n == name).map(|(_, m)| m);
            m.ok_or_else(|| run_err(format!("no module {name}")))
        };
        let gemv = GemvKernels::load(module("gemv")?, (GEMV_WARPS, GEMV_UNROLL))?;
        let attention = DecodeAttention::load(module("attention")?, (ATTN_ROUNDS, ATTN_PREFETCH))?;
        let k = Kernels {
            gather: f("elementwise", "embedding_gather")?,
            rmsnorm: f("elementwise", "rmsnorm")?,
            add_rmsnorm: f("elementwise", "add_rmsnorm")?,
            rope_kv: f("elementwise", "rope_kv")?,
            silu_mul: f("elementwise", "silu_mul")?,
            add_bias: f("elementwise", "add_bias")?,
            argmax: f("sampling", "argmax_rows")?,
            sample: f("sampling", "sample_rows")?,
            prefill: [
                (64, f("attention", "prefill_attention_64")?),
                (128, f("attention", "prefill_attention_128")?),
            ],
            fill: f("elementwise", "fill_random")?,
            dequant_q4_0: f("dequant", "dequant_q4_0")?,
            dequant_q4_1: f("dequant", "dequant_q4_1")?,
            dequant_q8_0: f("dequant", "dequant_q8_0")?,
            lora_shrink: f("lora", "lora_shrink")?,
            lora_expand: f("lora", "lora_expand")?,
        };
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(device)?;
        Ok(CudaRunner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            _one_thread: std::marker::PhantomData,
            ctx,
            stream,
            blas,
            _blas_workspace: blas_workspace,
            k,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            max_splits: std::cell::Cell::new(MAX_SPLITS),
            gemv_rows: std::cell::Cell::new(GEMV_DEFAULT_ROWS),
            gemv: std::cell::RefCell::new(gemv),
            attention: std::cell::RefCell::new(attention),
            pdl: std::cell::Cell::new(false),
            arch,
            marks: std::cell::RefCell::new(None),
            passes: std::cell::RefCell::default(),
            pick_slot: std::cell::RefCell::new(None),
            pass_start: std::cell::RefCell::new(None),
            lora: std::cell::RefCell::new(None),
        })
    }

    fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<bf16>, CudaError> {
        let b: Vec<bf16> = v.iter().map(|x| bf16::from_f32(*x)).collect();
        self.stream.clone_htod(&b).map_err(run_err)
    }

    /// A weight to bf16 on the device: Q4_0, Q4_1 and Q8_0 go up as the file's blocks and are
    /// dequantized there (a quarter to a half of bf16's bytes over the bus, no host pass over
    /// every element), BF16 as stored; other types are dequantized here.
    fn upload_weight(&self, w: &PackedWeight) -> Result<CudaSlice<bf16>, CudaError> {
        let kernel = match w.ty {
            GgmlType::Q4_0 => Some(&self.k.dequant_q4_0),
            GgmlType::Q4_1 => Some(&self.k.dequant_q4_1),
            GgmlType::Q8_0 => Some(&self.k.dequant_q8_0),
            _ => None,
        };
        if let (Some(kernel), Some(blocks)) = (kernel, w.file_blocks()) {
            let n = w.rows * w.cols;
            let src = self.stream.clone_htod(&blocks).map_err(run_err)?;
            let mut out = self.stream.alloc_zeros::<bf16>(n).map_err(run_err)?;
            let nblocks = (n / QK) as i64;
            let mut b = self.stream.launch_builder(kernel);
            b.arg(&src).arg(&mut out).arg(&nblocks);
            // SAFETY: arguments match the `dequant_*` kernels: `src` holds `nblocks` blocks of
            // the weight's type (rows x cols / 32, cols a multiple of 32), `out` 32 bf16 each.
            unsafe { b.launch(flat(n / QK)) }.map_err(run_err)?;
            return Ok(out);
        }
        // bf16 goes up as stored (little-endian on both sides).
        if let (GgmlType::BF16, Some(bytes)) = (w.ty, w.raw_rows())
            && bytes.len() == w.rows * w.cols * 2
        {
            let all: Vec<bf16> =
                bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect();
            return self.stream.clone_htod(&all).map_err(run_err);
        }
        let mut row = vec![0f32; w.cols];
        let mut all = Vec::with_capacity(w.rows * w.cols);
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            all.extend(row.iter().map(|x| bf16::from_f32(*x)));
        }
        self.stream.clone_htod(&all).map_err(run_err)
    }

    /// The matrices `parts` (row-major, the same columns) stacked into one: their rows one
    /// after another.
    fn stack(&self, parts: &[CudaSlice<bf16>]) -> Result<CudaSlice<bf16>, CudaError> {
        let total = parts.iter().map(CudaSlice::len).sum();
        let mut out = self.stream.alloc_zeros::<bf16>(total).map_err(run_err)?;
        let mut at = 0;
        for p in parts {
            self.stream.memcpy_dtod(p, &mut out.slice_mut(at..at + p.len())).map_err(run_err)?;
            at += p.len();
        }
        Ok(out)
    }

    /// Copies `w` to the device as bf16 (dequantized once, here).
    pub fn upload(&self, w: &LlamaWeights) -> Result<CudaModel, CudaError> {
        let c = &w.config;
        if matches!(c.rope_scaling, Some(crate::model::RopeScaling::LongRope { .. })) {
            return Err(CudaError::Invalid(format!(
                "the CUDA backend scales attention by 1/sqrt(head_dim); {} with LongRoPE's \
                 attention factor runs on the CPU backend",
                c.arch
            )));
        }
        if c.gemma.is_some() || w.layers.iter().any(|l| l.q_norm.is_some()) {
            return Err(CudaError::Invalid(format!(
                "the CUDA backend runs Llama-family blocks; {} (per-head Q/K norms, or Gemma's \
                 norms, GELU, sliding-window layers and capped scores) runs on the CPU backend",
                c.arch
            )));
        }
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
                (Some(q), Some(k), Some(v)) => Some(self.upload_f32(&[&q[..], k, v].concat())?),
                _ => None,
            };
            // The matrices read from the same input, uploaded and stacked into one.
            let stacked = |ws: &[&PackedWeight]| -> Result<CudaSlice<bf16>, CudaError> {
                let parts: Vec<_> =
                    ws.iter().map(|w| self.upload_weight(w)).collect::<Result<_, _>>()?;
                self.stack(&parts)
            };
            layers.push(DeviceLayer {
                attn_norm: self.upload_f32(&l.attn_norm)?,
                wqkv: stacked(&[&l.wq, &l.wk, &l.wv])?,
                bias,
                wo: self.upload_weight(&l.wo)?,
                ffn_norm: self.upload_f32(&l.ffn_norm)?,
                w_gate_up: stacked(&[&l.w_gate, &l.w_up])?,
                w_down: self.upload_weight(&l.w_down)?,
            });
        }
        Ok(CudaModel {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
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
        self.fill_random(&mut out, seed, scale, offset)?;
        Ok(out)
    }

    /// Every element of `out` uniform in offset +- scale (`fill_random`, seeded).
    fn fill_random(
        &self,
        out: &mut CudaSlice<bf16>,
        seed: u64,
        scale: f32,
        offset: f32,
    ) -> Result<(), CudaError> {
        let n = out.len();
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(&self.k.fill);
        b.arg(out).arg(&n_i).arg(&seed).arg(&scale).arg(&offset);
        // SAFETY: arguments match `fill_random`.
        unsafe { b.launch(flat(n)) }.map_err(run_err)?;
        Ok(())
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
                wqkv: w(q + 2 * kv, h)?,
                bias: None,
                wo: w(h, q)?,
                ffn_norm: self.random(h, 0, 0.0, 1.0)?,
                w_gate_up: w(2 * ff, h)?,
                w_down: w(h, ff)?,
            });
        }
        let inv_freq = c.inv_freq(None);
        Ok(CudaModel {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            config: c.clone(),
            embed: w(c.vocab_size, h)?,
            lm_head: if c.tied_embeddings { None } else { Some(w(c.vocab_size, h)?) },
            norm: self.random(h, 0, 0.0, 1.0)?,
            layers,
            inv_freq: self.stream.clone_htod(&inv_freq).map_err(run_err)?,
        })
    }

    /// The device's name, as its driver gives it (`NVIDIA H100 80GB HBM3`).
    pub fn device_name(&self) -> Result<String, CudaError> {
        self.ctx.name().map_err(run_err)
    }

    /// The device's peak memory bandwidth in bytes per second, from its own memory clock and
    /// bus width (double data rate): what its decode steps are bounded by.
    pub fn memory_bandwidth(&self) -> Result<f64, CudaError> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attr = |a| self.ctx.attribute(a).map_err(run_err);
        let khz = attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?;
        let bits = attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?;
        Ok(2.0 * f64::from(khz) * 1e3 * f64::from(bits) / 8.0)
    }

    /// Waits for everything queued on the device.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(run_err)
    }

    /// [`CudaRunner::kv_cache`] with every key and value uniform in +-1 (seeded): a cache that
    /// looks as if earlier tokens had filled it, for benchmarks whose attention should see
    /// scores that differ.
    pub fn random_kv_cache(
        &self,
        m: &CudaModel,
        block_size: usize,
        num_blocks: usize,
        seed: u64,
    ) -> Result<CudaKvCache, CudaError> {
        let mut cache = self.kv_cache(m, block_size, num_blocks)?;
        for (i, t) in cache.k.iter_mut().chain(cache.v.iter_mut()).enumerate() {
            self.fill_random(t, seed.wrapping_add(i as u64), 1.0, 0.0)?;
        }
        Ok(cache)
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
        Ok(CudaKvCache {
            k,
            v,
            block_size,
            num_blocks,
            graph_table: m.config.context_length.div_ceil(block_size).max(1),
            eager: None,
            graph_ws: None,
            graphs: HashMap::new(),
            graph_owner: (0, 0),
            use_graphs: true,
        })
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
        y: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::{result, sys};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        if x.len() < n * inp || y.len() < n * out || w.len() < out * inp {
            return Err(run_err("GEMM operands smaller than their shapes"));
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        {
            let (a, _ra) = w.device_ptr(&self.stream);
            let (b, _rb) = x.device_ptr(&self.stream);
            let (c, _rc) = y.device_ptr_mut(&self.stream);
            // Column-major view: Y^T [out, n] = (W [out, in] as stored) x X^T [in, n]. The
            // buffers hold at least out*in, n*in and n*out elements (checked); the pointers
            // stay valid while the guards live.
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
        Ok(())
    }

    /// `y[rows, out] = x[rows, in] W[out, in]^T` for 1..=[`GEMV_MAX_ROWS`] rows through the
    /// matrix-vector kernels, with x first through RMSNorm by `norm` (weight, eps) and the
    /// product put into `y` as `mode` says (for [`Gemv::Silu`], W holds 2 `out` rows).
    #[expect(clippy::too_many_arguments, reason = "the kernel's operands")]
    fn gemv<T: GemmOut>(
        &self,
        x: &CudaSlice<bf16>,
        norm: Option<(&CudaSlice<bf16>, f32)>,
        rows: usize,
        w: &CudaSlice<bf16>,
        out: usize,
        inp: usize,
        mode: Gemv,
        y: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        let w_rows = if mode == Gemv::Silu { 2 * out } else { out };
        if !(1..=GEMV_MAX_ROWS).contains(&rows)
            || !inp.is_multiple_of(8)
            || x.len() < rows * inp
            || w.len() < w_rows * inp
            || y.len() < rows * out
            || norm.is_some_and(|(nw, _)| nw.len() < inp)
            || (mode == Gemv::F32)
                != (T::CUDA_TYPE == cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F)
        {
            return Err(run_err("matrix-vector operands do not fit their shapes"));
        }
        let splits = gemv_splits(out, self.sms);
        let (out_i, inp_i, mode_i, splits_i) = (dim(out)?, dim(inp)?, mode as i32, splits as i32);
        let eps = norm.map_or(0.0, |(_, e)| e);
        let kernels = self.gemv.borrow();
        let f = match norm {
            Some(_) => &kernels.norm[rows - 1],
            None => &kernels.plain[rows - 1],
        };
        // The operands by hand (cuLaunchKernelEx takes launch attributes; cudarc's builder
        // does not): a pointer to each parameter's value, in the kernel's order.
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (xp, _x) = x.device_ptr(&self.stream);
        let (wp, _w) = w.device_ptr(&self.stream);
        let (yp, _y) = y.device_ptr_mut(&self.stream);
        let norm_w = norm.map(|(nw, _)| nw.device_ptr(&self.stream));
        let mut params = vec![param(&xp)];
        if let Some((nwp, _)) = &norm_w {
            params.extend([param(nwp), param(&eps)]);
        }
        params.extend([param(&wp), param(&yp), param(&out_i), param(&inp_i)]);
        params.extend([param(&mode_i), param(&splits_i)]);
        let blocks = (out * splits).div_ceil(kernels.warps);
        // SAFETY: `params` holds one pointer per parameter of `gemv<rows>` / `gemv_norm<rows>`
        // in kernels/gemv.cu, in order, each to a live value of the parameter's type (device
        // pointers from buffers whose guards live to the end of this function); the buffers
        // hold their shapes and in is a multiple of 8 (checked above); cudaMalloc'd buffers
        // are 16-byte aligned and so are rows of a multiple of 8 bf16.
        unsafe { self.launch_gemv(f, blocks, kernels.warps, &mut params) }
    }

    /// Launches matrix-vector kernel `f` over `blocks` blocks of `warps` warps through
    /// cuLaunchKernelEx, with programmatic stream serialization when [`CudaRunner::set_pdl`]
    /// says so (the kernels read and write nothing of the kernel before them until their
    /// `pdl_wait`).
    ///
    /// # Safety
    /// `params` holds a pointer to a live value of each of `f`'s parameters, in order, and
    /// the launch stays inside the buffers it names.
    unsafe fn launch_gemv(
        &self,
        f: &CudaFunction,
        blocks: usize,
        warps: usize,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        let mut pdl = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: u32::try_from(blocks).map_err(|_| run_err("too many blocks"))?,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: warps as u32 * 32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.stream.cu_stream(),
            attrs: &raw mut pdl,
            numAttrs: u32::from(self.pdl.get()),
        };
        self.ctx.bind_to_thread().map_err(run_err)?;
        // SAFETY: the caller's promise; the configuration and attribute live through the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(run_err)
    }

    /// The stacked Q/K/V projection of 1..=[`GEMV_MAX_ROWS`] rows of the residual stream `x`
    /// with the attention norm before it and RoPE and the K/V cache write after it
    /// (`gemv_rope<rows>`): the rotated queries into `qkv`, keys and values into `kc`/`vc` at
    /// `slots` (for a layer without Q/K/V biases, which go between the product and RoPE).
    #[expect(clippy::too_many_arguments, reason = "the kernel's operands")]
    fn gemv_rope(
        &self,
        m: &CudaModel,
        l: &DeviceLayer,
        x: &CudaSlice<bf16>,
        rows: usize,
        (pos, slots): (&CudaView<'_, i32>, &CudaView<'_, i32>),
        qkv: &mut CudaSlice<bf16>,
        (kc, vc): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
    ) -> Result<(), CudaError> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let c = &m.config;
        let (hd, rd, hidden) = (c.head_dim, c.rope_dims, c.hidden);
        let qkv_dim = (c.heads + 2 * c.kv_heads) * hd;
        if !(1..=GEMV_MAX_ROWS).contains(&rows)
            || !hidden.is_multiple_of(8)
            || x.len() < rows * hidden
            || qkv.len() < rows * qkv_dim
            || l.wqkv.len() < qkv_dim * hidden
            || pos.len() < rows
            || slots.len() < rows
            || rd % 2 != 0
            || rd > hd
        {
            return Err(run_err("fused projection operands do not fit their shapes"));
        }
        let [heads, kv_heads, hd_i, rd_i] = every([c.heads, c.kv_heads, hd, rd].map(dim))?;
        let interleaved = i32::from(c.rope_style == RopeStyle::Interleaved);
        let (hidden_i, eps) = (dim(hidden)?, c.rms_eps);
        let kernels = self.gemv.borrow();
        let (xp, _x) = x.device_ptr(&self.stream);
        let (np, _n) = l.attn_norm.device_ptr(&self.stream);
        let (wp, _w) = l.wqkv.device_ptr(&self.stream);
        let (qp, _q) = qkv.device_ptr_mut(&self.stream);
        let (kp, _k) = kc.device_ptr_mut(&self.stream);
        let (vp, _v) = vc.device_ptr_mut(&self.stream);
        let (pp, _p) = pos.device_ptr(&self.stream);
        let (sp, _s) = slots.device_ptr(&self.stream);
        let (fp, _f) = m.inv_freq.device_ptr(&self.stream);
        let mut params = vec![param(&xp), param(&np), param(&eps), param(&wp), param(&qp)];
        params.extend([param(&kp), param(&vp), param(&pp), param(&sp), param(&fp)]);
        params.extend([param(&heads), param(&kv_heads), param(&hd_i), param(&rd_i)]);
        params.extend([param(&interleaved), param(&hidden_i)]);
        let rotated = c.heads + c.kv_heads;
        let items = rotated * (rd / 2) + rotated * (hd - rd) + c.kv_heads * hd;
        let blocks = items.div_ceil(kernels.warps);
        // SAFETY: `params` holds one pointer per parameter of `gemv_rope<rows>` in
        // kernels/gemv.cu, in order, each to a live value of its type (device pointers from
        // buffers whose guards live to the end of this function); the buffers hold their
        // shapes (checked above), every slot is inside the cache or -1 (checked by `plan`).
        unsafe { self.launch_gemv(&kernels.rope[rows - 1], blocks, kernels.warps, &mut params) }
    }

    /// `out = rmsnorm(x) * w` over `rows` rows of `dim`; with `residual`, `x += residual`
    /// first (in place: the residual stream), in the same kernel.
    #[expect(clippy::too_many_arguments, reason = "the kernel's operands")]
    fn rmsnorm(
        &self,
        x: &mut CudaSlice<bf16>,
        residual: Option<&CudaSlice<bf16>>,
        w: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let d = dim as i32;
        let mut b = match residual {
            Some(y) => {
                let mut b = self.stream.launch_builder(&self.k.add_rmsnorm);
                b.arg(x).arg(y);
                b
            }
            None => {
                let mut b = self.stream.launch_builder(&self.k.rmsnorm);
                b.arg(&*x);
                b
            }
        };
        b.arg(w).arg(out).arg(&d).arg(&eps);
        // SAFETY: arguments match `rmsnorm` or `add_rmsnorm` in kernels/elementwise.cu; x, out
        // and the residual hold `rows` rows of `dim`.
        unsafe { b.launch(grid(rows, 1, 256)) }.map_err(run_err)?;
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

    /// Runs the batch; `rows` lists its wanted logit rows in order
    /// ([`wanted_rows`](crate::forward::wanted_rows)): for a `Some(i)` row the token is chosen
    /// on the device as `picks[i]` says (argmax, or a draw) and only the token comes back (as
    /// sequence `i`'s pick); the other rows' logits come back.
    pub fn forward_picking(
        &self,
        m: &CudaModel,
        cache: &mut CudaKvCache,
        batch: &[SeqInput<'_>],
        rows: &[Option<usize>],
        picks: &[Pick],
    ) -> Result<StepOutput, CudaError> {
        let pending = self.launch_picking(m, cache, batch, rows.to_vec(), picks)?;
        self.collect_picks(pending)
    }

    /// As [`CudaRunner::forward_picking`], returning once the pass is queued: the picked ids
    /// come back by a copy into page-locked memory queued behind it, which
    /// [`CudaRunner::collect_picks`] waits for. (Rows whose logits come back are copied
    /// before this returns, so a pass with any waits for its end here.) One pass may be
    /// pending at a time: the next reuses its buffers.
    pub fn launch_picking(
        &self,
        m: &CudaModel,
        cache: &mut CudaKvCache,
        batch: &[SeqInput<'_>],
        rows: Vec<Option<usize>>,
        picks: &[Pick],
    ) -> Result<PendingPicks, CudaError> {
        let vocab = m.config.vocab_size;
        let mut out = StepOutput { logits: Vec::new(), picked: vec![None; batch.len()] };
        // The pass starts at its first copy up (`load`); the host's planning before is not
        // the device's time.
        *self.pass_start.borrow_mut() = Some(None);
        let logits = self.forward_device(m, cache, batch);
        let start = match self.pass_start.borrow_mut().take().flatten() {
            Some(e) => e,
            None => self.timing_event()?,
        };
        let Some(logits) = logits? else {
            // Queued, not waited for: its times are read after a later pass.
            let end = self.timing_event()?;
            self.passes.borrow_mut().recorded.push((start, end));
            return Ok(PendingPicks { out, picked: false, rows, wait: false });
        };
        if logits.len() != rows.len() * vocab {
            return Err(run_err("the pass left other logit rows than wanted"));
        }
        let pick_of = |row: &Option<usize>| row.map(|i| picks.get(i).copied().unwrap_or_default());
        let picked = rows.iter().any(Option::is_some);
        if picked {
            let mut slot = self.pick_slot.borrow_mut();
            if slot.as_ref().is_none_or(|s| s.dev.len() < rows.len()) {
                // Grown with headroom; the old buffers go first.
                *slot = None;
                let cap = rows.len().next_power_of_two().max(64);
                let dev = self.stream.alloc_zeros::<i32>(cap).map_err(run_err)?;
                // SAFETY: read only where a copy from the device wrote it (`collect_picks`
                // reads the first rows.len() ids after the copy of all `cap` ends). Not
                // write-combined: the host reads it.
                let host =
                    unsafe { self.ctx.alloc_pinned_with_flags::<i32>(cap, 0) }.map_err(run_err)?;
                *slot = Some(PickSlot { dev, host });
            }
            let Some(PickSlot { dev: ids, host }) = slot.as_mut() else {
                return Err(run_err("no pick buffers"));
            };
            let vocab_i = vocab as i32;
            if rows.iter().any(|r| matches!(pick_of(r), Some(Pick::Draw { .. }))) {
                // Per row: temperature (0: argmax, also for rows whose logits go back), top-k,
                // top-p, uniform.
                let n = rows.len();
                let (mut t, mut k, mut p, mut u) =
                    (vec![0f32; n], vec![0i32; n], vec![1f32; n], vec![0f32; n]);
                for (r, row) in rows.iter().enumerate() {
                    if let Some(Pick::Draw { temperature, top_k, top_p, uniform }) = pick_of(row) {
                        (t[r], p[r], u[r]) = (temperature, top_p, uniform);
                        k[r] = i32::try_from(top_k).unwrap_or(i32::MAX);
                    }
                }
                let up = |v: &[f32]| self.stream.clone_htod(v).map_err(run_err);
                let (t, p, u) = (up(&t)?, up(&p)?, up(&u)?);
                let k = self.stream.clone_htod(&k).map_err(run_err)?;
                let mut b = self.stream.launch_builder(&self.k.sample);
                b.arg(&logits).arg(&t).arg(&k).arg(&p).arg(&u).arg(&mut *ids).arg(&vocab_i);
                // SAFETY: arguments match `sample_rows`; `logits` holds rows x vocab floats,
                // each per-row array one value per row and `ids` at least one int per row.
                unsafe { b.launch(grid(n, 1, 1024)) }.map_err(run_err)?;
            } else {
                let mut b = self.stream.launch_builder(&self.k.argmax);
                b.arg(&logits).arg(&mut *ids).arg(&vocab_i);
                // SAFETY: arguments match `argmax_rows`; `logits` holds rows x vocab floats and
                // `ids` at least one int per row.
                unsafe { b.launch(grid(rows.len(), 1, 1024)) }.map_err(run_err)?;
            }
            // The whole buffer: a copy into page-locked memory is as long as its destination.
            self.stream.memcpy_dtoh(&*ids, host).map_err(run_err)?;
        }
        // The other rows' logits, a run of consecutive rows per copy.
        let mut r = 0;
        while r < rows.len() {
            if rows[r].is_some() {
                r += 1;
                continue;
            }
            let end = (r..rows.len()).find(|&e| rows[e].is_some()).unwrap_or(rows.len());
            let at = out.logits.len();
            out.logits.resize(at + (end - r) * vocab, 0.0);
            self.stream
                .memcpy_dtoh(&logits.slice(r * vocab..end * vocab), &mut out.logits[at..])
                .map_err(run_err)?;
            r = end;
        }
        let end = self.timing_event()?;
        self.passes.borrow_mut().recorded.push((start, end));
        Ok(PendingPicks { out, picked, rows, wait: true })
    }

    /// Waits for a pass [launched](CudaRunner::launch_picking) on this runner and gives its
    /// output.
    pub fn collect_picks(&self, pending: PendingPicks) -> Result<StepOutput, CudaError> {
        let PendingPicks { mut out, picked, rows, wait } = pending;
        if !wait {
            return Ok(out);
        }
        self.stream.synchronize().map_err(run_err)?;
        if picked {
            let slot = self.pick_slot.borrow();
            let Some(PickSlot { host, .. }) = slot.as_ref() else {
                return Err(run_err("the pass's pick buffers are gone"));
            };
            let ids = host.as_slice().map_err(run_err)?;
            for (row, pick) in rows.iter().enumerate() {
                if let (Some(i), Some(&id)) = (pick, ids.get(row))
                    && let Some(p) = out.picked.get_mut(*i)
                {
                    *p = Some(id as u32);
                }
            }
        }
        self.read_pass_times()?;
        Ok(out)
    }

    /// An event with timing, recorded on the stream now.
    fn timing_event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        let timed = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        self.stream.record_event(Some(timed)).map_err(run_err)
    }

    /// Reads the recorded passes' times (the stream is synchronized: every event is done).
    fn read_pass_times(&self) -> Result<(), CudaError> {
        let mut clock = self.passes.borrow_mut();
        let PassClock { recorded, last_end, times } = &mut *clock;
        for (start, end) in recorded.drain(..) {
            let seconds = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| {
                a.elapsed_ms(b).map(|ms| f64::from(ms.max(0.0)) / 1e3).map_err(run_err)
            };
            let gap = last_end.as_ref().map(|prev| seconds(prev, &start)).transpose()?;
            times.record(gap, seconds(&start, &end)?);
            *last_end = Some(end);
        }
        Ok(())
    }

    /// The device time of the serving passes ([`CudaRunner::forward_picking`]) read since the
    /// last call. A pass queued without waiting (no logits wanted) is read after the next
    /// pass that waits.
    pub fn take_pass_times(&self) -> PassTimes {
        std::mem::take(&mut self.passes.borrow_mut().times)
    }

    /// The device goes idle for want of work, not for the host: the gap before the next pass
    /// is not counted. (Passes still queued are waited for and read first.)
    pub fn pass_break(&self) -> Result<(), CudaError> {
        if !self.passes.borrow().recorded.is_empty() {
            self.stream.synchronize().map_err(run_err)?;
            self.read_pass_times()?;
        }
        self.passes.borrow_mut().last_end = None;
        Ok(())
    }

    /// As [`CudaRunner::forward`], leaving the logits on the device, in the cache's workspace
    /// until the next pass (`None` when none are wanted); the work is queued, not waited for.
    pub fn forward_device<'c>(
        &self,
        m: &CudaModel,
        cache: &'c mut CudaKvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<Option<CudaView<'c, f32>>, CudaError> {
        // A batch with tenant adapters runs eagerly (the graphs hold no adapter updates).
        let decode_only = batch
            .iter()
            .all(|s| s.tokens.len() == 1 && s.logits == LogitsWanted::Last && s.adapter.is_none());
        let bucket = GRAPH_BUCKETS.iter().copied().find(|&b| b >= batch.len());
        if let (true, true, false, Some(bucket)) =
            (cache.use_graphs, decode_only, batch.is_empty(), bucket)
        {
            match self.decode_graph(m, cache, batch, bucket) {
                Ok(()) => {
                    let rows = batch.len() * m.config.vocab_size;
                    return Ok(cache.graph_ws.as_ref().map(|w| w.logits.slice(..rows)));
                }
                Err(e @ CudaError::Invalid(_)) => return Err(e),
                Err(e) => {
                    // Serving goes on without graphs rather than failing every decode step.
                    tracing::warn!(error = %e, "CUDA graph capture failed; this cache runs eagerly");
                    cache.use_graphs = false;
                    cache.graphs.clear();
                    cache.graph_ws = None;
                }
            }
        }
        self.eager(m, cache, batch)
    }

    /// The pass without a graph, in the cache's eager workspace (grown when the batch needs).
    fn eager<'c>(
        &self,
        m: &CudaModel,
        cache: &'c mut CudaKvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<Option<CudaView<'c, f32>>, CudaError> {
        let plan = plan(&m.config, (cache.block_size, cache.num_blocks), batch, None)?;
        let (n, wanted) = (plan.ids.len(), plan.wanted.len());
        if n == 0 {
            return Ok(None);
        }
        let (rows, want, table) = match &cache.eager {
            Some((id, w)) if *id == m.id => (w.rows, w.wanted, w.table),
            _ => (0, 0, 0),
        };
        if rows < n || want < wanted || table < plan.tables.len() {
            // Each short dimension grows with headroom (a run of slowly growing batches
            // reallocates rarely); the old buffers go first.
            let grow = |need: usize, had: usize| if need <= had { had } else { need.max(2 * had) };
            let (rows, want, table) =
                (grow(n, rows), grow(wanted, want), grow(plan.tables.len(), table));
            cache.eager = None;
            cache.eager = Some((m.id, self.workspace(&m.config, rows, want, table)?));
        }
        let CudaKvCache { k, v, block_size, eager, .. } = cache;
        let Some((_, ws)) = eager.as_mut() else {
            return Err(run_err("no workspace"));
        };
        let adapted = batch.iter().any(|s| s.adapter.is_some());
        if adapted {
            self.load_adapters(&m.config, batch, &plan.q_seq)?;
        }
        self.load(ws, &plan)?;
        let lora = self.lora.borrow();
        let lora = lora.as_ref().filter(|_| adapted);
        self.encode(m, k, v, *block_size, ws, plan.pass(), lora)?;
        if wanted == 0 {
            return Ok(None);
        }
        Ok(Some(ws.logits.slice(..wanted * m.config.vocab_size)))
    }

    /// A batch of decode steps padded to `bucket` rows, through that bucket's graph. The first
    /// step of a bucket runs eagerly (its own result; cuBLAS's and the kernels' lazy set-up
    /// for that row count happen outside any capture), then the same work is captured for
    /// the steps after it. The logits are left in the graph workspace.
    fn decode_graph(
        &self,
        m: &CudaModel,
        cache: &mut CudaKvCache,
        batch: &[SeqInput<'_>],
        bucket: usize,
    ) -> Result<(), CudaError> {
        let plan = plan(
            &m.config,
            (cache.block_size, cache.num_blocks),
            batch,
            Some((bucket, cache.graph_table)),
        )?;
        self.graph_workspace(m, cache)?;
        let CudaKvCache { k, v, block_size, graph_ws, graphs, .. } = cache;
        let Some(ws) = graph_ws.as_mut() else {
            return Err(run_err("no graph workspace"));
        };
        self.load(ws, &plan)?;
        if let Some(g) = graphs.get(&bucket) {
            return g.0.launch().map_err(run_err);
        }
        let (bs, pass) = (*block_size, plan.pass());
        self.encode(m, k, v, bs, ws, pass, None)?;
        self.stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(run_err)?;
        if let Err(e) = self.encode(m, k, v, bs, ws, pass, None) {
            // End the capture directly (cudarc's end_capture checks the context's error state
            // first and could leave the stream capturing), and drop what was captured.
            // SAFETY: the stream is live and capturing; a returned graph is ours to destroy.
            unsafe {
                if let Ok(g) = cudarc::driver::result::stream::end_capture(self.stream.cu_stream())
                    && !g.is_null()
                {
                    let _ = cudarc::driver::result::graph::destroy(g);
                }
            }
            return Err(e);
        }
        let graph = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(run_err)?
            .ok_or_else(|| run_err("the decode capture was empty"))?;
        graph.upload().map_err(run_err)?;
        graphs.insert(bucket, Captured(graph));
        Ok(())
    }

    /// Allocates the eager pass buffers for batches of up to `rows` token rows over `seqs`
    /// sequences (their last logits wanted, tables reaching the whole context), and the
    /// decode graphs' shared buffers, now rather than at the first batch that needs them.
    /// Returns the bytes the cache's pass buffers hold. A larger batch (a prompt-logprobs
    /// pass wanting every row's logits) still grows them later.
    pub fn reserve(
        &self,
        m: &CudaModel,
        cache: &mut CudaKvCache,
        rows: usize,
        seqs: usize,
    ) -> Result<usize, CudaError> {
        let c = &m.config;
        let table = seqs * c.context_length.div_ceil(cache.block_size).max(1);
        cache.eager = None;
        cache.eager = Some((m.id, self.workspace(c, rows, seqs, table)?));
        if cache.use_graphs {
            self.graph_workspace(m, cache)?;
        }
        let held = |w: Option<&Workspace>| w.map_or(0, Workspace::bytes);
        Ok(held(cache.eager.as_ref().map(|(_, w)| w)) + held(cache.graph_ws.as_ref()))
    }

    /// Caps the parts decode attention splits a context into (1: never split; for comparison).
    /// Decode graphs captured before keep the split they were captured with.
    pub fn set_max_splits(&self, max: usize) {
        self.max_splits.set(max.clamp(1, MAX_SPLITS));
    }

    /// Batches of up to `rows` rows (at most 4; 2 by default) take our matrix-vector kernels,
    /// larger ones cuBLAS (0: cuBLAS always; for comparison). Decode graphs captured before
    /// keep the kernels they were captured with.
    pub fn set_gemv_rows(&self, rows: usize) {
        self.gemv_rows.set(rows.min(GEMV_MAX_ROWS));
    }

    /// The most rows a batch may have to take the matrix-vector kernels.
    pub fn gemv_rows(&self) -> usize {
        self.gemv_rows.get()
    }

    /// Launches the matrix-vector kernels with programmatic dependent launch (`true`; sm_90
    /// and newer, else refused): each may start its blocks, and their weights' way into L2,
    /// while the kernel before it finishes, and reads that kernel's results only once it has.
    /// Off by default: on the H200 a graph step at batch 1 was 0.98-0.99x as fast with it (the
    /// device bench compares). Decode graphs captured before keep how they were launched.
    pub fn set_pdl(&self, on: bool) -> Result<(), CudaError> {
        let cc: u32 = self.arch.trim_start_matches("sm_").parse().unwrap_or(0);
        if on && cc < 90 {
            return Err(CudaError::Invalid(format!(
                "programmatic dependent launch needs compute capability 9.0 or newer; this \
                 device is {}",
                self.arch
            )));
        }
        self.pdl.set(on);
        Ok(())
    }

    /// Compiles the matrix-vector kernels again with `warps` warps a block (1, 2, 4, 8 or 16)
    /// and `unroll` loads in flight a lane (1..=16, at most 128 / warps), and uses them from
    /// now on; `None` goes back to the defaults ([`CudaRunner::gemv_shape`] on a new runner).
    /// For the device bench's comparison of shapes. Decode graphs captured before keep the
    /// kernels they were captured with.
    pub fn set_gemv_shape(&self, shape: Option<(usize, usize)>) -> Result<(), CudaError> {
        let shape = shape.unwrap_or((GEMV_WARPS, GEMV_UNROLL));
        let module = self.recompile("gemv", &gemv_options(shape)?)?;
        *self.gemv.borrow_mut() = GemvKernels::load(&module, shape)?;
        Ok(())
    }

    /// The matrix-vector kernels' shape in use: warps a block, loads in flight a lane.
    pub fn gemv_shape(&self) -> (usize, usize) {
        let k = self.gemv.borrow();
        (k.warps, k.unroll)
    }

    /// Compiles the decode attention kernels again with `rounds` rounds of keys loaded a step
    /// (1..=8), each step first bringing the next one's into L2 or not (`prefetch`), and uses
    /// them from now on; `None` goes back to the defaults ([`CudaRunner::attention_shape`]
    /// on a new runner). For the device bench's comparison. Decode graphs captured before
    /// keep the kernels they were captured with.
    pub fn set_attention_shape(&self, shape: Option<(usize, bool)>) -> Result<(), CudaError> {
        let shape = shape.unwrap_or((ATTN_ROUNDS, ATTN_PREFETCH));
        let module = self.recompile("attention", &attention_options(shape)?)?;
        *self.attention.borrow_mut() = DecodeAttention::load(&module, shape)?;
        Ok(())
    }

    /// The decode attention kernels' shape in use: rounds of keys a step, and whether a step
    /// prefetches the next.
    pub fn attention_shape(&self) -> (usize, bool) {
        let k = self.attention.borrow();
        (k.rounds, k.prefetch)
    }

    /// Kernel module `name` compiled again for this device with NVRTC `options`, loaded.
    fn recompile(
        &self,
        name: &str,
        options: &[String],
    ) -> Result<Arc<cudarc::driver::CudaModule>, CudaError> {
        let (module, src) = KERNELS
            .iter()
            .find(|(m, _)| *m == name)
            .map(|&(m, s)| (m, s))
            .ok_or_else(|| run_err(format!("no module {name}")))?;
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        let compiled = compile_with(module, src, &self.arch, &options)?;
        self.ctx.load_module(Ptx::from_src(compiled.ptx)).map_err(run_err)
    }

    /// Runs `batch` once eagerly with an event after each phase of the pass and returns the
    /// device time of each phase, summed over the layers, in the order the phases first ran
    /// (milliseconds). For finding where a pass's time goes; the cache's K/V are written as by
    /// any pass.
    pub fn profile(
        &self,
        m: &CudaModel,
        cache: &mut CudaKvCache,
        batch: &[SeqInput<'_>],
    ) -> Result<Vec<(&'static str, f64)>, CudaError> {
        *self.marks.borrow_mut() = Some(Vec::new());
        self.mark("start")?;
        let ran = self.eager(m, cache, batch).map(|_| ());
        let marks = self.marks.borrow_mut().take().unwrap_or_default();
        ran?;
        self.stream.synchronize().map_err(run_err)?;
        let mut phases: Vec<(&'static str, f64)> = Vec::new();
        for pair in marks.windows(2) {
            let ms = f64::from(pair[0].1.elapsed_ms(&pair[1].1).map_err(run_err)?);
            match phases.iter_mut().find(|(name, _)| *name == pair[1].0) {
                Some((_, total)) => *total += ms,
                None => phases.push((pair[1].0, ms)),
            }
        }
        Ok(phases)
    }

    /// Records the end of phase `label` while [`CudaRunner::profile`] runs (else nothing).
    fn mark(&self, label: &'static str) -> Result<(), CudaError> {
        if let Some(marks) = self.marks.borrow_mut().as_mut() {
            let timed = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
            marks.push((label, self.stream.record_event(Some(timed)).map_err(run_err)?));
        }
        Ok(())
    }

    /// The device's free and total memory, bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(run_err)
    }

    /// Makes sure `cache` holds the decode graphs' shared workspace for this runner and `m`
    /// (graphs made by another runner or for another model are dropped with theirs).
    fn graph_workspace(&self, m: &CudaModel, cache: &mut CudaKvCache) -> Result<(), CudaError> {
        if cache.graph_owner != (self.id, m.id) {
            cache.graphs.clear();
            cache.graph_ws = None;
            cache.graph_owner = (self.id, m.id);
        }
        if cache.graph_ws.is_none() {
            let rows = GRAPH_BUCKETS[GRAPH_BUCKETS.len() - 1];
            cache.graph_ws =
                Some(self.workspace(&m.config, rows, rows, rows * cache.graph_table)?);
        }
        Ok(())
    }

    /// Device buffers for up to `rows` token rows, `wanted` logit rows and `table` block-table
    /// entries of `c`'s model ([`Workspace::bytes`] in all).
    fn workspace(
        &self,
        c: &LlamaConfig,
        rows: usize,
        wanted: usize,
        table: usize,
    ) -> Result<Workspace, CudaError> {
        let h = |n: usize| self.stream.alloc_zeros::<bf16>(n.max(1)).map_err(run_err);
        // Each input at least one int, so every view is non-empty.
        let ints = 8 * rows.max(1) + wanted.max(1) + table.max(1);
        let (part, counters) = split_capacity(c, self.sms);
        Ok(Workspace {
            rows: rows.max(1),
            wanted: wanted.max(1),
            table: table.max(1),
            inputs: self.stream.alloc_zeros::<i32>(ints).map_err(run_err)?,
            staging: vec![0; ints],
            x: h(rows * c.hidden)?,
            xn: h(rows * c.hidden)?,
            qkv: h(rows * (c.q_dim() + 2 * c.kv_dim()))?,
            attn: h(rows * c.q_dim())?,
            o: h(rows * c.hidden)?,
            gate_up: h(rows * 2 * c.intermediate)?,
            act: h(rows * c.intermediate)?,
            picked: h(wanted * c.hidden)?,
            logits: self
                .stream
                .alloc_zeros::<f32>((wanted * c.vocab_size).max(1))
                .map_err(run_err)?,
            part: self.stream.alloc_zeros::<f32>(part).map_err(run_err)?,
            // Zero: the kernel counts up and the last block of a row resets its count.
            counters: self.stream.alloc_zeros::<i32>(counters).map_err(run_err)?,
        })
    }

    /// Puts `batch`'s adapters on the device (the set is built again, with this batch's
    /// adapters only, when one of them is missing) and each row's slot (rows by sequence,
    /// `q_seq`).
    fn load_adapters(
        &self,
        c: &LlamaConfig,
        batch: &[SeqInput<'_>],
        q_seq: &[i32],
    ) -> Result<(), CudaError> {
        let mut lora = self.lora.borrow_mut();
        let missing = |d: &LoraDevice| {
            batch.iter().filter_map(|s| s.adapter).any(|a| !d.digests.contains(&a.digest))
        };
        if lora.as_ref().is_none_or(missing) {
            *lora = None;
            let mut adapters: Vec<&LoraAdapter> = Vec::new();
            for a in batch.iter().filter_map(|s| s.adapter) {
                if !adapters.iter().any(|b| b.digest == a.digest) {
                    adapters.push(a);
                }
            }
            *lora = Some(self.lora_device(c, &adapters, q_seq.len())?);
        }
        let Some(d) = lora.as_mut() else { return Err(run_err("no adapters on the device")) };
        if d.rows < q_seq.len() {
            d.rows = q_seq.len().max(2 * d.rows);
            d.row_slot = self.stream.alloc_zeros::<i32>(d.rows).map_err(run_err)?;
            d.u = self.stream.alloc_zeros::<f32>(d.rows * d.max_rank).map_err(run_err)?;
        }
        let slot_of = |s: &SeqInput<'_>| -> i32 {
            s.adapter
                .and_then(|a| d.digests.iter().position(|x| *x == a.digest))
                .map_or(-1, |p| p as i32)
        };
        let slots: Vec<i32> = q_seq
            .iter()
            .map(|&q| usize::try_from(q).ok().and_then(|q| batch.get(q)).map_or(-1, slot_of))
            .collect();
        let mut dst = d.row_slot.slice_mut(..slots.len());
        self.stream.memcpy_htod(&slots, &mut dst).map_err(run_err)
    }

    /// `adapters` on the device, with room for `rows` rows.
    fn lora_device(
        &self,
        c: &LlamaConfig,
        adapters: &[&LoraAdapter],
        rows: usize,
    ) -> Result<LoraDevice, CudaError> {
        use crate::cpu::adapter::{a_index, b_index};
        let pairs = c.layers * Target::ALL.len();
        let slots = adapters.len();
        let f = |bits: u16| bf16::from_f32(half::f16::from_bits(bits).to_f32());
        let (mut arena, mut a_off, mut b_off) =
            (Vec::new(), vec![-1i64; slots * pairs], vec![-1i64; slots * pairs]);
        let mut scale = vec![0f32; slots * pairs];
        for (s, a) in adapters.iter().enumerate() {
            if !a.fits(c) {
                return Err(CudaError::Invalid(format!(
                    "adapter {} was checked against another base model",
                    a.revision
                )));
            }
            for layer in 0..c.layers {
                for target in Target::ALL {
                    let Some(p) = a.pair(layer, target) else { continue };
                    let (input, output) = target.dims(c);
                    let at = s * pairs + layer * Target::ALL.len() + target.index();
                    a_off[at] = arena.len() as i64;
                    for k in 0..p.rank {
                        arena.extend((0..input).map(|i| f(p.a[a_index(input, k, i)])));
                    }
                    b_off[at] = arena.len() as i64;
                    for o in 0..output {
                        arena.extend((0..p.rank).map(|k| f(p.bt[b_index(p.rank, k, o)])));
                    }
                    scale[at] = p.u_scale;
                }
            }
        }
        let max_rank = adapters.iter().map(|a| a.rank).max().unwrap_or(1).max(1);
        let ranks: Vec<i32> = adapters.iter().map(|a| a.rank as i32).collect();
        let up = |e| run_err(e);
        Ok(LoraDevice {
            digests: adapters.iter().map(|a| a.digest).collect(),
            arena: self.stream.clone_htod(&arena).map_err(up)?,
            a_off: self.stream.clone_htod(&a_off).map_err(up)?,
            b_off: self.stream.clone_htod(&b_off).map_err(up)?,
            scale: self.stream.clone_htod(&scale).map_err(up)?,
            rank: self.stream.clone_htod(&ranks).map_err(up)?,
            max_rank,
            pairs,
            row_slot: self.stream.alloc_zeros::<i32>(rows.max(1)).map_err(up)?,
            u: self.stream.alloc_zeros::<f32>(rows.max(1) * max_rank).map_err(up)?,
            rows: rows.max(1),
        })
    }

    /// Each adapted row's updates of `parts` (projection, first column in `y`) of `layer`:
    /// `u` from `x` (`n` rows of the projections' input), then `B u` added to `y` (`n` rows of
    /// `width`).
    #[expect(clippy::too_many_arguments, reason = "one launch pair's buffers and shapes")]
    fn lora_update(
        &self,
        lo: &LoraDevice,
        c: &LlamaConfig,
        n: usize,
        layer: usize,
        parts: &[(Target, usize)],
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<bf16>,
        width: usize,
    ) -> Result<(), CudaError> {
        let (pairs, max_rank) = (dim(lo.pairs)?, dim(lo.max_rank)?);
        for &(target, col) in parts {
            let (input, output) = target.dims(c);
            if col + output > width {
                return Err(run_err("an adapter update outside its output rows"));
            }
            let pair = dim(layer * Target::ALL.len() + target.index())?;
            let (in_i, out_i, w_i, col_i) = (dim(input)?, dim(output)?, dim(width)?, dim(col)?);
            let mut b = self.stream.launch_builder(&self.k.lora_shrink);
            b.arg(x).arg(&in_i).arg(&lo.arena).arg(&lo.row_slot).arg(&lo.a_off).arg(&lo.rank);
            b.arg(&lo.scale).arg(&pairs).arg(&pair).arg(&lo.u).arg(&max_rank);
            // SAFETY: arguments match `lora_shrink`; x holds n rows of `input`, every slot
            // is -1 or below the slots the tables were built for, every offset and rank
            // inside the arena, u holds n x max_rank floats (`load_adapters`).
            unsafe { b.launch(grid(n, lo.max_rank.div_ceil(4), 128)) }.map_err(run_err)?;
            let mut b = self.stream.launch_builder(&self.k.lora_expand);
            b.arg(&lo.u).arg(&max_rank).arg(&lo.arena).arg(&lo.row_slot).arg(&lo.b_off);
            b.arg(&lo.rank).arg(&pairs).arg(&pair).arg(&mut *y).arg(&out_i).arg(&w_i);
            b.arg(&col_i);
            // SAFETY: arguments match `lora_expand`; y holds n rows of `width`, and
            // col + output <= width.
            unsafe { b.launch(grid(output.div_ceil(128), n, 128)) }.map_err(run_err)?;
        }
        Ok(())
    }

    /// Copies `p`'s inputs into `ws` in one host-to-device copy (queued before the pass that
    /// reads them): each input into its place in the staging buffer, then the staging buffer
    /// up to the end of the block tables.
    fn load(&self, ws: &mut Workspace, p: &Plan) -> Result<(), CudaError> {
        if let Some(slot) = self.pass_start.borrow_mut().as_mut()
            && slot.is_none()
        {
            *slot = Some(self.timing_event()?);
        }
        let mut end = 0;
        for (input, src) in [
            (Input::Ids, &p.ids),
            (Input::Pos, &p.pos),
            (Input::QSeq, &p.q_seq),
            (Input::CtxLen, &p.ctx_len),
            (Input::Slots, &p.slots),
            (Input::Singles, &p.singles),
            (Input::Tiles, &p.tiles),
            (Input::Wanted, &p.wanted),
            (Input::Tables, &p.tables),
        ] {
            let (at, cap) = ws.input_range(input);
            if src.len() > cap {
                return Err(run_err("the batch does not fit the workspace"));
            }
            ws.staging[at..at + src.len()].copy_from_slice(src);
            end = at + src.len();
        }
        let mut dst = ws.inputs.slice_mut(..end.max(1));
        self.stream.memcpy_htod(&ws.staging[..end.max(1)], &mut dst).map_err(run_err)
    }

    /// Queues one pass over the rows of `ws` (inputs loaded), writing K/V into the cache and
    /// the logits of the wanted rows into `ws.logits`. Allocates nothing, so it can be
    /// captured.
    #[expect(clippy::too_many_arguments, reason = "a pass's model, cache, workspace and adapters")]
    fn encode(
        &self,
        m: &CudaModel,
        k_cache: &mut [CudaSlice<bf16>],
        v_cache: &mut [CudaSlice<bf16>],
        block_size: usize,
        ws: &mut Workspace,
        pass: Pass,
        lora: Option<&LoraDevice>,
    ) -> Result<(), CudaError> {
        let Pass { rows: n, max_blocks, wanted, tiles, singles } = pass;
        let c = &m.config;
        let prefill = self.k.prefill.iter().find(|(hd, _)| *hd == c.head_dim).map(|(_, f)| f);
        if tiles > 0 && prefill.is_none() {
            return Err(run_err(format!("no tiled prefill kernel for head size {}", c.head_dim)));
        }
        let (hidden, q_dim, kv_dim, hd) = (c.hidden, c.q_dim(), c.kv_dim(), c.head_dim);
        let h_i = hidden as i32;
        let mut b = self.stream.launch_builder(&self.k.gather);
        // The inputs, as views of the one input buffer (only that field of `ws` is borrowed).
        let spans =
            [Input::Ids, Input::Pos, Input::QSeq, Input::CtxLen, Input::Slots].map(|i| ws.span(i));
        let [ids, pos, q_seq, ctx_len, slots] = spans.map(|r| ws.inputs.slice(r));
        let [singles_in, tiles_in, want, tables] =
            [Input::Singles, Input::Tiles, Input::Wanted, Input::Tables]
                .map(|i| ws.span(i))
                .map(|r| ws.inputs.slice(r));
        b.arg(&m.embed).arg(&ids).arg(&mut ws.x).arg(&h_i);
        // SAFETY: arguments match `embedding_gather`; every id is below the vocabulary.
        unsafe { b.launch(grid(n, 1, 256)) }.map_err(run_err)?;
        self.mark("embedding")?;

        let (heads, kv_heads) = (c.heads as i32, c.kv_heads as i32);
        let (hd_i, rd_i) = (hd as i32, c.rope_dims as i32);
        let qkv_dim = q_dim + 2 * kv_dim;
        let interleaved = i32::from(c.rope_style == RopeStyle::Interleaved);
        let (bs_i, mb_i) = (block_size as i32, max_blocks as i32);
        let scale = 1.0 / (hd as f32).sqrt();
        // Decode attention: one block per row and KV head (per ATTN_GROUP of its query heads),
        // and per part of the context when those are too few for the device.
        let groups = c.kv_heads * (c.heads / c.kv_heads).div_ceil(ATTN_GROUP);
        let splits = decode_splits(singles, groups, self.sms, self.max_splits.get());
        if splits > 1
            && (singles * c.heads * splits * (hd + 2) > ws.part.len()
                || singles * groups > ws.counters.len())
        {
            return Err(run_err("the split-K buffers are too small for the pass"));
        }
        let splits_i = splits as i32;
        // A few rows (decode at small batches) take the matrix-vector kernels, which fuse
        // the norms before the QKV and gate/up products, SiLU after gate/up, the residual
        // adds after the O and down products and (without Q/K/V biases) RoPE and the K/V
        // write: 5 launches a layer instead of 9.
        // (Not with adapters: their updates go between a product and what the matrix-vector
        // kernels fuse after it.)
        let small = lora.is_none()
            && n <= self.gemv_rows.get()
            && [hidden, q_dim, c.intermediate].iter().all(|d| d.is_multiple_of(8));
        let eps = c.rms_eps;
        // Otherwise each norm after the first comes with the residual add before it
        // (add_rmsnorm): the attention norm of layer i + 1 (or the final norm) after layer i's
        // FFN.
        if !small {
            let first_norm = m.layers.first().map_or(&m.norm, |l| &l.attn_norm);
            self.rmsnorm(&mut ws.x, None, first_norm, n, hidden, eps, &mut ws.xn)?;
            self.mark("RMSNorm")?;
        }
        let layers = m.layers.iter().zip(k_cache.iter_mut()).zip(v_cache.iter_mut()).enumerate();
        for (i, ((l, kc), vc)) in layers {
            // RoPE and the K/V write fused into the projection (not with biases, which come
            // between).
            let fused_rope = small && l.bias.is_none();
            if fused_rope {
                let cache = (&mut *kc, &mut *vc);
                self.gemv_rope(m, l, &ws.x, n, (&pos, &slots), &mut ws.qkv, cache)?;
                self.mark("QKV GEMV + norm, RoPE")?;
            } else if small {
                let norm = Some((&l.attn_norm, eps));
                self.gemv(&ws.x, norm, n, &l.wqkv, qkv_dim, hidden, Gemv::Bf16, &mut ws.qkv)?;
                self.mark("QKV GEMV + norm")?;
            } else {
                self.linear(&ws.xn, n, &l.wqkv, qkv_dim, hidden, &mut ws.qkv)?;
                self.mark("QKV GEMM")?;
                if let Some(lo) = lora {
                    let parts = [(Target::Q, 0), (Target::K, q_dim), (Target::V, q_dim + kv_dim)];
                    self.lora_update(lo, c, n, i, &parts, &ws.xn, &mut ws.qkv, qkv_dim)?;
                    self.mark("QKV adapters")?;
                }
            }
            if let Some(bias) = &l.bias {
                self.add_bias(&mut ws.qkv, bias, n, qkv_dim)?;
                self.mark("QKV bias")?;
            }
            if !fused_rope {
                let mut b = self.stream.launch_builder(&self.k.rope_kv);
                b.arg(&mut ws.qkv).arg(&mut *kc).arg(&mut *vc).arg(&pos).arg(&slots);
                b.arg(&m.inv_freq).arg(&heads).arg(&kv_heads).arg(&hd_i).arg(&rd_i);
                b.arg(&interleaved);
                // SAFETY: arguments match `rope_kv`; qkv holds n rows of (heads + 2 kv_heads)
                // head_dim; every slot is inside the cache or -1 (checked by `plan`).
                // 1024 threads: at small batches the kernel is a chain of loads, and each
                // thread then has few of them.
                unsafe { b.launch(grid(n, 1, 1024)) }.map_err(run_err)?;
                self.mark("RoPE + K/V write")?;
            }
            if singles > 0 {
                let k = self.attention.borrow();
                let f = k.by_head.iter().find(|(d, _)| *d == c.head_dim);
                let mut b = self.stream.launch_builder(f.map_or(&k.any, |(_, f)| f));
                b.arg(&ws.qkv).arg(&*kc).arg(&*vc).arg(&tables).arg(&q_seq);
                b.arg(&ctx_len).arg(&singles_in).arg(&mut ws.attn);
                b.arg(&heads).arg(&kv_heads).arg(&hd_i).arg(&bs_i).arg(&mb_i).arg(&scale);
                b.arg(&splits_i).arg(&mut ws.part).arg(&mut ws.counters);
                // SAFETY: arguments match `paged_attention`; head_dim is a multiple of 32 up to
                // 256; every listed row is below n; every table entry a row reaches names a
                // block of the cache; with splits > 1 the partial states and counters fit
                // (checked above) and the counters are zero between launches.
                unsafe { b.launch(grid3(singles, groups, splits, 128)) }.map_err(run_err)?;
                self.mark("decode attention")?;
            }
            if let (true, Some(f)) = (tiles > 0, prefill) {
                let mut b = self.stream.launch_builder(f);
                b.arg(&ws.qkv).arg(&*kc).arg(&*vc).arg(&tables).arg(&q_seq);
                b.arg(&ctx_len).arg(&tiles_in).arg(&mut ws.attn);
                b.arg(&heads).arg(&kv_heads).arg(&bs_i).arg(&mb_i).arg(&scale);
                // SAFETY: arguments match `prefill_attention_<head_dim>`; each tile holds 1..64
                // consecutive rows of one sequence at consecutive positions (`plan`).
                unsafe { b.launch(grid(tiles, c.heads, 128)) }.map_err(run_err)?;
                self.mark("prefill attention")?;
            }
            let inter = c.intermediate;
            if small {
                self.gemv(&ws.attn, None, n, &l.wo, hidden, q_dim, Gemv::Add, &mut ws.x)?;
                self.mark("O GEMV + add")?;
                let norm = Some((&l.ffn_norm, eps));
                self.gemv(&ws.x, norm, n, &l.w_gate_up, inter, hidden, Gemv::Silu, &mut ws.act)?;
                self.mark("gate/up GEMV + norm, SiLU")?;
                self.gemv(&ws.act, None, n, &l.w_down, hidden, inter, Gemv::Add, &mut ws.x)?;
                self.mark("down GEMV + add")?;
                continue;
            }
            self.linear(&ws.attn, n, &l.wo, hidden, q_dim, &mut ws.o)?;
            self.mark("O GEMM")?;
            if let Some(lo) = lora {
                self.lora_update(lo, c, n, i, &[(Target::O, 0)], &ws.attn, &mut ws.o, hidden)?;
                self.mark("O adapters")?;
            }
            self.rmsnorm(&mut ws.x, Some(&ws.o), &l.ffn_norm, n, hidden, eps, &mut ws.xn)?;
            self.mark("add + RMSNorm")?;
            self.linear(&ws.xn, n, &l.w_gate_up, 2 * c.intermediate, hidden, &mut ws.gate_up)?;
            self.mark("gate/up GEMM")?;
            if let Some(lo) = lora {
                let (parts, width) = ([(Target::Gate, 0), (Target::Up, inter)], 2 * inter);
                self.lora_update(lo, c, n, i, &parts, &ws.xn, &mut ws.gate_up, width)?;
                self.mark("gate/up adapters")?;
            }
            let (ni, inter) = ((n * c.intermediate) as i64, c.intermediate as i32);
            let mut b = self.stream.launch_builder(&self.k.silu_mul);
            b.arg(&ws.gate_up).arg(&mut ws.act).arg(&ni).arg(&inter);
            // SAFETY: arguments match `silu_mul`; gate_up holds n rows of 2 * intermediate.
            // A thread per 8 outputs (the kernel's 16-byte path; any grid is right).
            unsafe { b.launch(flat((n * c.intermediate).div_ceil(8))) }.map_err(run_err)?;
            self.mark("SiLU x up")?;
            self.linear(&ws.act, n, &l.w_down, hidden, c.intermediate, &mut ws.o)?;
            self.mark("down GEMM")?;
            if let Some(lo) = lora {
                self.lora_update(lo, c, n, i, &[(Target::Down, 0)], &ws.act, &mut ws.o, hidden)?;
                self.mark("down adapters")?;
            }
            let next = m.layers.get(i + 1).map_or(&m.norm, |l| &l.attn_norm);
            self.rmsnorm(&mut ws.x, Some(&ws.o), next, n, hidden, eps, &mut ws.xn)?;
            self.mark("add + RMSNorm")?;
        }
        if wanted == 0 {
            return Ok(());
        }
        // The wanted rows of the final norm, gathered with the embedding kernel (a row
        // gather; the residual stream's rows with the matrix-vector kernels, which norm them).
        let mut b = self.stream.launch_builder(&self.k.gather);
        b.arg(if small { &ws.x } else { &ws.xn }).arg(&want).arg(&mut ws.picked).arg(&h_i);
        // SAFETY: arguments match `embedding_gather`; every index is below n.
        unsafe { b.launch(grid(wanted, 1, 256)) }.map_err(run_err)?;
        let head = m.lm_head.as_ref().unwrap_or(&m.embed);
        let vocab = c.vocab_size;
        if small {
            let norm = Some((&m.norm, eps));
            self.gemv(&ws.picked, norm, wanted, head, vocab, hidden, Gemv::F32, &mut ws.logits)?;
        } else {
            self.linear(&ws.picked, wanted, head, vocab, hidden, &mut ws.logits)?;
        }
        self.mark("LM head")
    }
}

/// Checks `batch` against the model and cache and lays out its rows. With `pad`
/// `(rows, max_blocks)` (a decode graph's shape), the rows are padded to `rows` with rows
/// that write no K/V and attend to one position of block 0, every sequence's logits are
/// wanted (padding's too), and each table has `max_blocks` entries.
fn plan(
    c: &LlamaConfig,
    (bs, num_blocks): (usize, usize),
    batch: &[SeqInput<'_>],
    pad: Option<(usize, usize)>,
) -> Result<Plan, CudaError> {
    // Only the blocks a sequence's positions reach are read (its table may hold more).
    let used = |s: &SeqInput<'_>| (s.start_pos + s.tokens.len()).div_ceil(bs);
    let longest = batch.iter().map(used).max().unwrap_or(0).max(1);
    let max_blocks = pad.map_or(longest, |(_, mb)| mb);
    let rows = pad.map_or(batch.len(), |(r, _)| r.max(batch.len()));
    let tiled = TILED_HEAD_DIMS.contains(&c.head_dim);
    let mut tiles = Vec::new();
    let mut p = Plan {
        ids: Vec::new(),
        pos: Vec::new(),
        q_seq: Vec::new(),
        ctx_len: Vec::new(),
        slots: Vec::new(),
        tables: vec![0i32; rows * max_blocks],
        max_blocks,
        wanted: Vec::new(),
        tiles: Vec::new(),
        singles: Vec::new(),
    };
    for (s, seq) in batch.iter().enumerate() {
        let end = seq.start_pos + seq.tokens.len();
        if end > c.context_length || seq.block_table.len() * bs < end || used(seq) > max_blocks {
            return Err(CudaError::Invalid(format!(
                "sequence {s}: {end} tokens do not fit the context or its block table"
            )));
        }
        for (j, &b) in seq.block_table.iter().take(used(seq)).enumerate() {
            if b as usize >= num_blocks {
                return Err(CudaError::Invalid(format!("block {b} out of range")));
            }
            p.tables[s * max_blocks + j] = b as i32;
        }
        let first = p.ids.len();
        if tiled && seq.tokens.len() > 1 {
            for t in (0..seq.tokens.len()).step_by(PREFILL_TILE) {
                let count = (seq.tokens.len() - t).min(PREFILL_TILE);
                // (keys its last row sees, first row, rows)
                tiles.push((seq.start_pos + t + count, first + t, count));
            }
        } else {
            p.singles.extend((first..first + seq.tokens.len()).map(|r| r as i32));
        }
        for (i, &tok) in seq.tokens.iter().enumerate() {
            if tok as usize >= c.vocab_size {
                return Err(CudaError::Invalid(format!("token id {tok} outside the vocabulary")));
            }
            let at = seq.start_pos + i;
            let last = i + 1 == seq.tokens.len();
            if seq.logits == LogitsWanted::All || (seq.logits == LogitsWanted::Last && last) {
                p.wanted.push(p.ids.len() as i32);
            }
            p.ids.push(tok as i32);
            p.pos.push(at as i32);
            p.q_seq.push(s as i32);
            p.ctx_len.push(at as i32 + 1);
            p.slots.push((seq.block_table[at / bs] as usize * bs + at % bs) as i32);
        }
    }
    // The tiles that see the most keys first, so the longest blocks do not start last.
    tiles.sort_by_key(|&(keys, first, _)| (std::cmp::Reverse(keys), first));
    p.tiles = tiles.iter().flat_map(|&(_, first, count)| [first as i32, count as i32]).collect();
    if pad.is_some() {
        for r in p.ids.len()..rows {
            p.singles.push(r as i32);
            p.wanted.push(r as i32);
            p.ids.push(0);
            p.pos.push(0);
            p.q_seq.push(r as i32);
            p.ctx_len.push(1);
            p.slots.push(-1);
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::SynthSpec;

    fn seq<'a>(tokens: &'a [u32], start_pos: usize, table: &'a [u32]) -> SeqInput<'a> {
        SeqInput {
            tokens,
            start_pos,
            block_table: table,
            logits: LogitsWanted::Last,
            adapter: None,
        }
    }

    #[test]
    fn prefill_rows_go_in_tiles_of_one_sequence_and_decode_rows_alone() -> Result<(), CudaError> {
        let mut c = SynthSpec::tiny().config();
        c.head_dim = 64;
        let long: Vec<u32> = (0..150).collect();
        let table: Vec<u32> = (0..10).collect();
        let other = [3u32];
        let t2 = [10u32];
        let batch = [seq(&other, 7, &t2), seq(&long, 10, &table), seq(&other, 0, &t2)];
        let p = plan(&c, (16, 11), &batch, None)?;
        // Row 0 decodes; rows 1..151 are the 150-token chunk; row 151 is a one-token prompt.
        assert_eq!(p.singles, vec![0, 151]);
        // Longest first: rows 129..151 see 160 keys, 65..129 138, 1..65 74.
        assert_eq!(p.tiles, vec![129, 22, 65, 64, 1, 64]);
        assert_eq!(p.ctx_len[1], 11);
        assert_eq!(p.ctx_len[150], 160);
        assert_eq!(p.pass().tiles, 3);
        // A head size without a tiled kernel: every row alone.
        c.head_dim = 96;
        let p = plan(&c, (16, 11), &batch, None)?;
        assert!(p.tiles.is_empty());
        assert_eq!(p.singles, (0..152).collect::<Vec<i32>>());
        Ok(())
    }

    #[test]
    fn decode_splits_fill_the_device_within_the_split_buffers() {
        let c = SynthSpec::tiny().config();
        for sms in [1usize, 4, 132] {
            let target = attention_target(sms);
            let (part, counters) = split_capacity(&c, sms);
            for groups in [1usize, 2, 3, 8, 16] {
                for rows in 0..600 {
                    let z = decode_splits(rows, groups, sms, MAX_SPLITS);
                    assert!((1..=MAX_SPLITS).contains(&z), "{rows} rows: {z} splits");
                    if z > 1 {
                        // What encode checks before a launch, for the most query heads a
                        // group may hold.
                        assert!(rows * groups * ATTN_GROUP * z * (c.head_dim + 2) <= part);
                        assert!(rows * groups <= counters);
                    }
                    if rows * groups >= target {
                        assert_eq!(z, 1, "{rows} rows x {groups} groups fill {sms} SMs");
                    } else if rows > 0 && z < MAX_SPLITS {
                        assert!(rows * groups * z >= target, "{rows} x {groups} x {z} < {target}");
                    }
                }
            }
        }
        // An 8B model (8 KV heads of 4 query heads) decoding on an H200 (132 SMs): one
        // sequence's context in up to 64 parts, 8 sequences' in 9; 128 fill the device alone.
        assert_eq!(decode_splits(1, 8, 132, MAX_SPLITS), 64);
        assert_eq!(decode_splits(8, 8, 132, MAX_SPLITS), 9);
        assert_eq!(decode_splits(64, 8, 132, MAX_SPLITS), 2);
        assert_eq!(decode_splits(128, 8, 132, MAX_SPLITS), 1);
        assert_eq!(decode_splits(1, 8, 132, 1), 1);
        assert_eq!(decode_splits(1, 8, 132, 8), 8);
    }

    #[test]
    fn a_padded_decode_batch_lists_every_row_including_padding() -> Result<(), CudaError> {
        let c = SynthSpec::tiny().config();
        let (a, b) = ([1u32], [2u32]);
        let (ta, tb) = ([0u32], [1u32]);
        let p = plan(&c, (16, 4), &[seq(&a, 3, &ta), seq(&b, 5, &tb)], Some((4, 2)))?;
        assert_eq!(p.singles, vec![0, 1, 2, 3]);
        assert!(p.tiles.is_empty());
        assert_eq!(p.slots, vec![3, 16 + 5, -1, -1]);
        assert_eq!(p.tables.len(), 4 * 2);
        Ok(())
    }

    #[test]
    fn blocks_and_tokens_out_of_range_are_refused() {
        let c = SynthSpec::tiny().config();
        let t = [1u32];
        assert!(matches!(plan(&c, (16, 4), &[seq(&t, 0, &[9])], None), Err(CudaError::Invalid(_))));
        let big = [u32::MAX];
        assert!(matches!(
            plan(&c, (16, 4), &[seq(&big, 0, &[0])], None),
            Err(CudaError::Invalid(_))
        ));
        assert!(matches!(
            plan(&c, (16, 4), &[seq(&t, 16, &[0])], None),
            Err(CudaError::Invalid(_))
        ));
    }
}
