//! Checks of every kernel of `kernels/` against references written here from the definitions
//! (and, for dequantization, the CPU backend's own `dequantize_row`), run on a [`Dev`]: the GPU
//! (tests/cuda_device.rs, on a GPU machine) or the CPU emulation of CUDA
//! (tests/kernel_emu.rs, everywhere). The same checks in both places, so a kernel that passes
//! under emulation and fails on the device points at what the emulation does not model.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use anyhow::ensure;
use half::bf16;
use sluice_engine::cuda::CudaRunner;
use sluice_engine::forward::{KvCache, LogitsWanted, Runner, SeqInput};
use sluice_engine::model::load_gguf_weights;
use sluice_engine::quant::{GgmlType, dequantize_row, quantize_row};
use sluice_engine::synth::{SynthSpec, write_gguf};
use sluice_text::gguf::GgufFile;

/// One kernel parameter: a buffer (host memory, copied in, and back out for `Out`) or a scalar.
pub enum Arg<'a> {
    In(&'a [u8]),
    Out(&'a mut [u8]),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

/// Where the kernels run.
pub trait Dev {
    /// Runs `kernel` of `module` over a grid of `grid` blocks of `block` threads.
    fn launch3(
        &self,
        module: &'static str,
        kernel: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut [Arg<'_>],
    ) -> anyhow::Result<()>;

    /// [`Dev::launch3`] over a two-dimensional grid.
    fn launch(
        &self,
        module: &'static str,
        kernel: &str,
        grid: (u32, u32),
        block: u32,
        args: &mut [Arg<'_>],
    ) -> anyhow::Result<()> {
        self.launch3(module, kernel, (grid.0, grid.1, 1), block, args)
    }

    /// Whether this is the emulation (thousands of times slower: the heavy checks shrink).
    fn emulated(&self) -> bool;
}

/// Element types a buffer may hold (no padding, any bit pattern valid).
pub trait Plain: Copy {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for i32 {}
impl Plain for i64 {}
impl Plain for f32 {}
impl Plain for u64 {}
impl Plain for u128 {}

pub fn bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `Plain` types have no padding; u8 has alignment 1; the length is the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

pub fn bytes_mut<T: Plain>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes`, and every bit pattern is a valid `T`.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Deterministic values in [-1, 1).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|x| bf16::from_f32(*x).to_bits()).collect()
}

pub fn from_bf16(v: &[u16]) -> Vec<f32> {
    v.iter().map(|b| bf16::from_bits(*b).to_f32()).collect()
}

/// Inputs as the device sees them (rounded to bf16).
pub fn rounded(v: &[f32]) -> Vec<f32> {
    from_bf16(&to_bf16(v))
}

/// The largest absolute difference; infinite where either side is NaN (`f32::max` would drop
/// it) or the lengths differ.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) })
}

/// RMSNorm alone and after the residual add, RoPE with the K/V cache write in both pair
/// layouts, SiLU-and-multiply, Q/K/V bias, the embedding gather and the device's random fill.
pub fn elementwise(d: &dyn Dev) -> anyhow::Result<()> {
    // Rows of whole 16-byte chunks (the kernels' vector path) and not.
    for dim in [576, 100] {
        norms(d, dim)?;
    }
    rope_kv(d)?;
    // SiLU-and-multiply over 2 rows of fused gate/up projections (inter + inter), on the vector
    // path and off it, then a bias on every row.
    for inter in [512, 500] {
        silu_bias(d, inter)?;
    }
    gather_and_fill(d)
}

/// RMSNorm alone and after the residual add, over 3 rows of `dim`.
fn norms(d: &dyn Dev, dim: usize) -> anyhow::Result<()> {
    use Arg::*;
    let (rows, eps) = (3usize, 1e-5f32);
    let x = rounded(&values(rows * dim, 1));
    let w = rounded(&values(dim, 2));
    let mut out = vec![0u16; rows * dim];
    d.launch(
        "elementwise",
        "rmsnorm",
        (rows as u32, 1),
        256,
        &mut [
            In(bytes(&to_bf16(&x))),
            In(bytes(&to_bf16(&w))),
            Out(bytes_mut(&mut out)),
            I32(dim as i32),
            F32(eps),
        ],
    )?;
    // Each row of `x` normalized, times w.
    let normed = |x: &[f32]| -> Vec<f32> {
        x.chunks(dim)
            .flat_map(|row| {
                let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
                let scale = 1.0 / (ms + eps).sqrt();
                row.iter().zip(&w).map(move |(v, w)| v * scale * w)
            })
            .collect()
    };
    let diff = max_diff(&from_bf16(&out), &normed(&x));
    ensure!(diff < 2e-2, "rmsnorm ({dim}) differs by {diff}");

    // The residual add with the norm after it: x += y in place (rounded to bf16 as the sum is
    // everywhere), then the norm of the sum.
    let y = rounded(&values(rows * dim, 3));
    let mut x_b = to_bf16(&x);
    let mut out = vec![0u16; rows * dim];
    d.launch(
        "elementwise",
        "add_rmsnorm",
        (rows as u32, 1),
        256,
        &mut [
            Out(bytes_mut(&mut x_b)),
            In(bytes(&to_bf16(&y))),
            In(bytes(&to_bf16(&w))),
            Out(bytes_mut(&mut out)),
            I32(dim as i32),
            F32(eps),
        ],
    )?;
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    ensure!(x_b == to_bf16(&sum), "add_rmsnorm's sum ({dim}) is not x + y rounded to bf16");
    let diff = max_diff(&from_bf16(&out), &normed(&rounded(&sum)));
    ensure!(diff < 2e-2, "add_rmsnorm ({dim}) differs by {diff}");
    Ok(())
}

/// RoPE with the K/V cache write.
fn rope_kv(d: &dyn Dev) -> anyhow::Result<()> {
    use Arg::*;

    // RoPE with the cache write, both pair layouts, on all 64 dimensions of a head and on the
    // first 32: 3 tokens of fused rows (3 query heads, 1 KV head of 64), the third padding
    // (slot -1: nothing written). Query heads rotate in place; the rotated key and the value
    // land in the token's slot of a 4-slot cache that starts as NaN, the other slots untouched.
    for (interleaved, rope_dims) in [(1i32, 64usize), (0, 64), (1, 32), (0, 32)] {
        let (heads, kv_heads, hd) = (3usize, 1usize, 64usize);
        let width = (heads + 2 * kv_heads) * hd;
        let qkv = rounded(&values(3 * width, 3));
        let pos = [5i32, 17, 9];
        let slots = [2i32, 0, -1];
        let inv_freq: Vec<f32> = (0..rope_dims / 2)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / rope_dims as f32))
            .collect();
        let mut qkv_b = to_bf16(&qkv);
        let (mut kc, mut vc) = (vec![0x7fc0u16; 4 * hd], vec![0x7fc0u16; 4 * hd]);
        d.launch(
            "elementwise",
            "rope_kv",
            (3, 1),
            128,
            &mut [
                Out(bytes_mut(&mut qkv_b)),
                Out(bytes_mut(&mut kc)),
                Out(bytes_mut(&mut vc)),
                In(bytes(&pos)),
                In(bytes(&slots)),
                In(bytes(&inv_freq)),
                I32(heads as i32),
                I32(kv_heads as i32),
                I32(hd as i32),
                I32(rope_dims as i32),
                I32(interleaved),
            ],
        )?;
        let rotate = |x: &[f32], t: usize| {
            let mut x = x.to_vec();
            for (i, freq) in inv_freq.iter().enumerate() {
                let (a, b) =
                    if interleaved == 1 { (2 * i, 2 * i + 1) } else { (i, i + rope_dims / 2) };
                let (sn, cs) = (pos[t] as f32 * freq).sin_cos();
                let (x0, x1) = (x[a], x[b]);
                x[a] = x0 * cs - x1 * sn;
                x[b] = x0 * sn + x1 * cs;
            }
            x
        };
        let got = from_bf16(&qkv_b);
        let what = format!("rope_kv (interleaved {interleaved}, {rope_dims} dims)");
        for t in 0..3 {
            let row = &qkv[t * width..][..width];
            for h in 0..heads {
                let dq =
                    max_diff(&got[t * width + h * hd..][..hd], &rotate(&row[h * hd..][..hd], t));
                ensure!(dq < 2e-2, "{what}: token {t} query head {h} differs by {dq}");
            }
            ensure!(
                got[t * width + heads * hd..][..2 * hd] == row[heads * hd..][..2 * hd],
                "{what}: token {t}'s K/V projections changed in place"
            );
            let Ok(slot) = usize::try_from(slots[t]) else { continue };
            let dk =
                max_diff(&from_bf16(&kc[slot * hd..][..hd]), &rotate(&row[heads * hd..][..hd], t));
            ensure!(dk < 2e-2, "{what}: token {t}'s cached key differs by {dk}");
            ensure!(
                from_bf16(&vc[slot * hd..][..hd]) == row[(heads + 1) * hd..][..hd],
                "{what}: token {t}'s cached value"
            );
        }
        for slot in [1usize, 3] {
            ensure!(
                kc[slot * hd..][..hd].iter().chain(&vc[slot * hd..][..hd]).all(|&b| b == 0x7fc0),
                "{what}: slot {slot}, no token's, was written"
            );
        }
    }

    Ok(())
}

/// SiLU-and-multiply over 2 rows of fused gate/up projections (inter + inter), then a bias on
/// every row.
fn silu_bias(d: &dyn Dev, inter: usize) -> anyhow::Result<()> {
    use Arg::*;
    let n = 2 * inter;
    let gate_up = rounded(&values(2 * n, 5));
    let mut o = vec![0u16; n];
    d.launch(
        "elementwise",
        "silu_mul",
        (4, 1),
        256,
        &mut [
            In(bytes(&to_bf16(&gate_up))),
            Out(bytes_mut(&mut o)),
            I64(n as i64),
            I32(inter as i32),
        ],
    )?;
    let got = from_bf16(&o);
    let want: Vec<f32> = (0..n)
        .map(|i| {
            let (g, u) = (
                gate_up[i / inter * 2 * inter + i % inter],
                gate_up[i / inter * 2 * inter + inter + i % inter],
            );
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    let diff = max_diff(&got, &want);
    ensure!(diff < 1e-2, "silu_mul ({inter}) differs by {diff}");
    let bias = rounded(&values(inter, 8));
    d.launch(
        "elementwise",
        "add_bias",
        (2, 1),
        128,
        &mut [Out(bytes_mut(&mut o)), In(bytes(&to_bf16(&bias))), I32(inter as i32)],
    )?;
    let biased = from_bf16(&o);
    let want: Vec<f32> = got.iter().enumerate().map(|(i, v)| v + bias[i % inter]).collect();
    ensure!(max_diff(&biased, &want) < 2e-2, "add_bias differs");
    Ok(())
}

/// The embedding gather and the device's random fill.
fn gather_and_fill(d: &dyn Dev) -> anyhow::Result<()> {
    use Arg::*;
    // The embedding gather: rows 7, 0, 7, 3 of a 10 x 96 table, exactly.
    let table = to_bf16(&values(10 * 96, 9));
    let ids = [7i32, 0, 7, 3];
    let mut out = vec![0u16; 4 * 96];
    d.launch(
        "elementwise",
        "embedding_gather",
        (4, 1),
        256,
        &mut [In(bytes(&table)), In(bytes(&ids)), Out(bytes_mut(&mut out)), I32(96)],
    )?;
    for (t, id) in ids.iter().enumerate() {
        ensure!(out[t * 96..][..96] == table[*id as usize * 96..][..96], "gather row {t}");
    }

    // Random fill: offset + scale * u, u in [-1, 1), mean near the offset, seeds differ.
    let fill = |seed: u64| -> anyhow::Result<Vec<f32>> {
        let mut out = vec![0u16; 4096];
        d.launch(
            "elementwise",
            "fill_random",
            (4, 1),
            256,
            &mut [Out(bytes_mut(&mut out)), I64(4096), U64(seed), F32(0.5), F32(2.0)],
        )?;
        Ok(from_bf16(&out))
    };
    let (a, b) = (fill(1)?, fill(2)?);
    ensure!(a.iter().all(|v| (1.5..=2.5).contains(v)), "fill_random out of range");
    let mean = a.iter().sum::<f32>() / a.len() as f32;
    ensure!((mean - 2.0).abs() < 0.03, "fill_random mean {mean}");
    ensure!(a != b, "fill_random ignores its seed");
    Ok(())
}

/// Q4_0, Q4_1 and Q8_0 blocks to bf16 against the CPU backend's dequantization.
pub fn dequantization(d: &dyn Dev) -> anyhow::Result<()> {
    let src = values(32 * 64, 7).iter().map(|v| v * 3.0).collect::<Vec<f32>>();
    for (ty, kernel) in [
        (GgmlType::Q4_0, "dequant_q4_0"),
        (GgmlType::Q4_1, "dequant_q4_1"),
        (GgmlType::Q8_0, "dequant_q8_0"),
    ] {
        let blocks = quantize_row(ty, &src);
        let mut want = vec![0f32; src.len()];
        dequantize_row(ty, &blocks, &mut want);
        let mut out = vec![0u16; src.len()];
        d.launch(
            "dequant",
            kernel,
            (1, 1),
            64,
            &mut [
                Arg::In(&blocks),
                Arg::Out(bytes_mut(&mut out)),
                Arg::I64((src.len() / 32) as i64),
            ],
        )?;
        // bf16 keeps 8 bits of mantissa: within half an ulp of the CPU's f32.
        for (i, (a, w)) in from_bf16(&out).iter().zip(&want).enumerate() {
            ensure!((a - w).abs() <= w.abs() / 256.0 + 1e-6, "{kernel}[{i}]: {a} vs {w}");
        }
    }
    Ok(())
}

/// K/V written into scattered paged blocks, then attention for a batch mixing a prefill chunk
/// after a cached prefix (sequence 0: positions 30..37), a decode row (sequence 1, 5 keys) and
/// a long prefill (sequence 2: positions 10..100 after 10 cached, two row tiles and several
/// key steps) and a fresh prompt shorter than one key step (sequence 3: positions 0..10, so
/// most of the step's shared K/V rows hold no key), with grouped-query heads: every row through `paged_attention`, then the
/// prefill rows through `prefill_attention_<head_dim>` on tiles and the decode row through
/// `paged_attention` alone, as the runner splits them. Checked against softmax(q K^T) V
/// computed here for each head size with a tensor-core prefill, with 2 query heads per KV
/// head, and with 9 (SmolLM2's 3 is in between: more than one block of 4 per KV head).
pub fn attention(d: &dyn Dev) -> anyhow::Result<()> {
    for (hd, heads, kv_heads) in [(64usize, 4usize, 2usize), (128, 4, 2), (64, 9, 1)] {
        attention_for(d, hd, heads, kv_heads)?;
    }
    Ok(())
}

fn attention_for(d: &dyn Dev, hd: usize, heads: usize, kv_heads: usize) -> anyhow::Result<()> {
    use Arg::*;
    let block_size = 16usize;
    let kv_dim = kv_heads * hd;
    let max_blocks = 7usize;
    let mut tables = vec![-1i32; 4 * max_blocks];
    let all_blocks = [vec![3, 0, 5], vec![1], vec![6, 8, 2, 4, 7, 9, 10], vec![11]];
    for (seq, blocks) in all_blocks.iter().enumerate() {
        tables[seq * max_blocks..][..blocks.len()].copy_from_slice(blocks);
    }
    let lens = [37usize, 5, 100, 10];
    let n_slots = 12 * block_size;
    let slot_of = |seq: usize, j: usize| {
        tables[seq * max_blocks + j / block_size] as usize * block_size + j % block_size
    };
    let (mut k_rows, mut v_rows, mut slots, mut start) = (vec![], vec![], vec![], vec![]);
    for (seq, &len) in lens.iter().enumerate() {
        start.push(slots.len());
        for j in 0..len {
            k_rows.extend(rounded(&values(kv_dim, 100 + (seq * 128 + j) as u64)));
            v_rows.extend(rounded(&values(kv_dim, 900 + (seq * 128 + j) as u64)));
            slots.push(slot_of(seq, j) as i32);
        }
    }
    // The cache starts as NaN: keys a kernel should not read must not reach the output. The
    // keys and values go in as the forward pass writes them, by rope_kv from fused Q/K/V rows
    // (no rotation here: rope_dims 0).
    let mut kc = vec![0x7fc0u16; n_slots * kv_dim];
    let mut vc = kc.clone();
    let width = (heads + 2 * kv_heads) * hd;
    let mut kv_in = vec![0u16; slots.len() * width];
    for t in 0..slots.len() {
        let row = &mut kv_in[t * width + heads * hd..][..2 * kv_dim];
        row[..kv_dim].copy_from_slice(&to_bf16(&k_rows[t * kv_dim..][..kv_dim]));
        row[kv_dim..].copy_from_slice(&to_bf16(&v_rows[t * kv_dim..][..kv_dim]));
    }
    d.launch(
        "elementwise",
        "rope_kv",
        (slots.len() as u32, 1),
        128,
        &mut [
            Out(bytes_mut(&mut kv_in)),
            Out(bytes_mut(&mut kc)),
            Out(bytes_mut(&mut vc)),
            In(bytes(&vec![0i32; slots.len()])),
            In(bytes(&slots)),
            In(bytes(&[1f32])),
            I32(heads as i32),
            I32(kv_heads as i32),
            I32(hd as i32),
            I32(0),
            I32(0),
        ],
    )?;
    // Rows: sequence 0 at 30..37, sequence 1 decoding at position 4, sequence 2 at 10..100.
    let (mut q_seq, mut ctx) = (vec![], vec![]);
    for (seq, range) in [(0i32, 30..37), (1, 4..5), (2, 10..100), (3, 0..10)] {
        for p in range {
            q_seq.push(seq);
            ctx.push(p + 1);
        }
    }
    let rows = q_seq.len();
    let q = rounded(&values(rows * heads * hd, 77 + hd as u64));
    // The kernels read the query heads of fused Q/K/V rows; the K/V parts here are NaN (they
    // read the cache, never these).
    let mut q_b = vec![0x7fc0u16; rows * width];
    for r in 0..rows {
        q_b[r * width..][..heads * hd]
            .copy_from_slice(&to_bf16(&q[r * heads * hd..][..heads * hd]));
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let mut want = vec![0f32; rows * heads * hd];
    for r in 0..rows {
        let (seq, n) = (q_seq[r] as usize, ctx[r] as usize);
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let qh = &q[(r * heads + h) * hd..][..hd];
            let scores: Vec<f32> = (0..n)
                .map(|j| {
                    let k = &k_rows[(start[seq] + j) * kv_dim + kvh * hd..][..hd];
                    qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
                })
                .collect();
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for dd in 0..hd {
                want[(r * heads + h) * hd + dd] = (0..n)
                    .map(|j| e[j] / z * v_rows[(start[seq] + j) * kv_dim + kvh * hd + dd])
                    .sum();
            }
        }
    }
    let check = |got: &[u16], what: &str| -> anyhow::Result<()> {
        for (i, (g, w)) in from_bf16(got).iter().zip(&want).enumerate() {
            let (r, h, dd) = (i / (heads * hd), i / hd % heads, i % hd);
            ensure!(
                (g - w).abs() < 1e-2,
                "{what}, head_dim {hd}, {heads}/{kv_heads} heads: row {r} head {h} dim {dd}: \
                 {g} vs {w}"
            );
        }
        Ok(())
    };
    // `splits`: the most parts a row's context is cut into (split-K); the partial states
    // start as NaN (a part read before it was written shows), the counters at 0 and must end
    // there (the next launch relies on it).
    let groups = kv_heads * (heads / kv_heads).div_ceil(4);
    let paged = |kernel: &str, row_ids: &[i32], out: &mut [u16], splits: usize| {
        let mut part = vec![f32::NAN; row_ids.len() * heads * splits * (hd + 2)];
        let mut counters = vec![0i32; row_ids.len() * groups];
        d.launch3(
            "attention",
            kernel,
            (row_ids.len() as u32, groups as u32, splits as u32),
            128,
            &mut [
                In(bytes(&q_b)),
                In(bytes(&kc)),
                In(bytes(&vc)),
                In(bytes(&tables)),
                In(bytes(&q_seq)),
                In(bytes(&ctx)),
                In(bytes(row_ids)),
                Out(bytes_mut(out)),
                I32(heads as i32),
                I32(kv_heads as i32),
                I32(hd as i32),
                I32(block_size as i32),
                I32(max_blocks as i32),
                F32(scale),
                I32(splits as i32),
                Out(bytes_mut(&mut part)),
                Out(bytes_mut(&mut counters)),
            ],
        )?;
        ensure!(
            counters.iter().all(|&c| c == 0),
            "{kernel}, {splits} splits: counters left {counters:?}"
        );
        anyhow::Ok(())
    };
    // Every row through the per-row kernels (any head size, and this head size's), listed
    // backwards (the list is what they run); whole, and with contexts split in up to 3 parts
    // (uneven) and up to 16 (parts of at least 32 keys: 2 for 37 keys, 4 for 100).
    let all: Vec<i32> = (0..rows as i32).rev().collect();
    let sized = format!("paged_attention_{hd}");
    for kernel in ["paged_attention", sized.as_str()] {
        for splits in [1, 3, 16] {
            let mut out = vec![0u16; rows * heads * hd];
            paged(kernel, &all, &mut out, splits)?;
            check(&out, &format!("{kernel}, {splits} splits"))?;
        }
    }

    // The runner's split: prefill tiles of up to 64 rows, the decode row alone.
    let tiles = [0i32, 7, 8, 64, 72, 26, 98, 10];
    let mut out = vec![0u16; rows * heads * hd];
    d.launch(
        "attention",
        &format!("prefill_attention_{hd}"),
        ((tiles.len() / 2) as u32, heads as u32),
        128,
        &mut [
            In(bytes(&q_b)),
            In(bytes(&kc)),
            In(bytes(&vc)),
            In(bytes(&tables)),
            In(bytes(&q_seq)),
            In(bytes(&ctx)),
            In(bytes(&tiles)),
            Out(bytes_mut(&mut out)),
            I32(heads as i32),
            I32(kv_heads as i32),
            I32(block_size as i32),
            I32(max_blocks as i32),
            F32(scale),
        ],
    )?;
    paged(&sized, &[7], &mut out, 1)?;
    check(&out, "prefill_attention + paged_attention")
}

/// Argmax per row, the lowest index among equal maxima (as on the CPU).
/// The matrix-vector kernels (kernels/gemv.cu) for 1..4 rows, with and without the RMSNorm
/// before, in each epilogue, each row split in 1, 2 and 4 parts, at row lengths under and over
/// one step of the warps' loads and an output count that leaves a block part-empty; every
/// output written (the poison is NaN).
pub fn gemv(d: &dyn Dev) -> anyhow::Result<()> {
    use Arg::*;
    let (out_dim, eps) = (19usize, 1e-5f32);
    let round = |v: f64| bf16::from_f64(v).to_f64();
    for in_dim in [328usize, 1096] {
        for rows in 1..=4usize {
            for (mode, name) in ["bf16", "f32", "add", "silu"].into_iter().enumerate() {
                for (norm, splits) in
                    [false, true].into_iter().flat_map(|n| [(n, 1), (n, 2), (n, 4)])
                {
                    let seed = (in_dim * 100 + rows * 10 + mode) as u64 + u64::from(norm);
                    let w_rows = if name == "silu" { 2 * out_dim } else { out_dim };
                    let x = rounded(&values(rows * in_dim, seed));
                    let w = rounded(&values(w_rows * in_dim, seed + 1));
                    let g = rounded(&values(in_dim, seed + 2));
                    let start = rounded(&values(rows * out_dim, seed + 3));
                    // What the product reads: x, or its rows normalized (in f32: the kernel
                    // does not round them to bf16).
                    let xs: Vec<f64> =
                        x.chunks(in_dim)
                            .flat_map(|row| {
                                let ss: f64 = row.iter().map(|v| f64::from(*v).powi(2)).sum();
                                let scale =
                                    (1.0 / (ss / in_dim as f64 + f64::from(eps)).sqrt()) as f32;
                                row.iter()
                                    .zip(&g)
                                    .map(|(v, g)| {
                                        if norm { f64::from(v * scale * g) } else { f64::from(*v) }
                                    })
                                    .collect::<Vec<_>>()
                            })
                            .collect();
                    let dot = |r: usize, o: usize| -> f64 {
                        let wr = &w[o * in_dim..][..in_dim];
                        xs[r * in_dim..][..in_dim]
                            .iter()
                            .zip(wr)
                            .map(|(a, b)| a * f64::from(*b))
                            .sum()
                    };
                    let want: Vec<f64> = (0..rows * out_dim)
                        .map(|i| {
                            let (r, o) = (i / out_dim, i % out_dim);
                            match name {
                                "bf16" => round(dot(r, o)),
                                "f32" => dot(r, o),
                                "add" => round(f64::from(start[i]) + round(dot(r, o))),
                                _ => {
                                    let (gate, up) = (round(dot(r, o)), round(dot(r, o + out_dim)));
                                    round(gate / (1.0 + (-gate).exp()) * up)
                                }
                            }
                        })
                        .collect();
                    let mut out_b: Vec<u16> =
                        if name == "add" { to_bf16(&start) } else { vec![0x7fc0; rows * out_dim] };
                    let mut out_f = vec![f32::NAN; rows * out_dim];
                    let out = if name == "f32" {
                        Out(bytes_mut(&mut out_f))
                    } else {
                        Out(bytes_mut(&mut out_b))
                    };
                    let (xb, wb, gb) = (to_bf16(&x), to_bf16(&w), to_bf16(&g));
                    let mut args = vec![In(bytes(&xb))];
                    if norm {
                        args.extend([In(bytes(&gb)), F32(eps)]);
                    }
                    args.extend([In(bytes(&wb)), out]);
                    args.extend([I32(out_dim as i32), I32(in_dim as i32), I32(mode as i32)]);
                    args.push(I32(splits as i32));
                    let kernel = format!("{}{rows}", if norm { "gemv_norm" } else { "gemv" });
                    let blocks = (out_dim * splits).div_ceil(4) as u32;
                    d.launch("gemv", &kernel, (blocks, 1), 128, &mut args)?;
                    drop(args);
                    let got = if name == "f32" { out_f } else { from_bf16(&out_b) };
                    let big = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                        // Two bf16 steps of the value (a rounding the other side of a tie
                        // after another summation order), and f32 summation's error.
                        let tol = want.abs() / 64.0 + big * 1e-3;
                        ensure!(
                            (f64::from(*got) - want).abs() <= tol,
                            "{kernel} ({name}, {in_dim} columns, {splits} parts): output {i} is \
                             {got}, not {want}"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// `gemv_rope` (the Q/K/V projection with the norm before and RoPE with the K/V write after)
/// against `gemv_norm` then `rope_kv`, the kernels it fuses, for 1..4 rows, both pair layouts,
/// all or half of each head rotated: the same rotated queries and cache contents (within one
/// bf16 step: the rotation's multiply-adds may contract differently), the untouched slots and
/// the padding row's (slot -1) left alone.
pub fn gemv_rope(d: &dyn Dev) -> anyhow::Result<()> {
    use Arg::*;
    let (heads, kv_heads, hd, in_dim, eps) = (3usize, 1usize, 64usize, 328usize, 1e-5f32);
    let (qkv_dim, kv_dim) = ((heads + 2 * kv_heads) * hd, kv_heads * hd);
    let pos = [5i32, 17, 9, 3];
    let slots = [2i32, 0, -1, 3];
    let nan = 0x7fc0u16;
    for (rows, (interleaved, rope_dims)) in
        (1..=4usize).flat_map(|r| [(1i32, 64usize), (0, 64), (1, 32), (0, 32)].map(|p| (r, p)))
    {
        let seed = (rows * 10 + rope_dims) as u64 + interleaved as u64;
        let x = to_bf16(&values(rows * in_dim, seed));
        let g = to_bf16(&values(in_dim, seed + 1));
        let w = to_bf16(&values(qkv_dim * in_dim, seed + 2));
        let inv_freq: Vec<f32> = (0..rope_dims / 2)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / rope_dims as f32))
            .collect();
        // The reference: the product (as gemv_norm computes it), then rope_kv.
        let mut qkv_ref = vec![nan; rows * qkv_dim];
        let ints = |v: &[usize]| v.iter().map(|&i| I32(i as i32)).collect::<Vec<_>>();
        let mut args = vec![In(bytes(&x)), In(bytes(&g)), F32(eps), In(bytes(&w))];
        args.push(Out(bytes_mut(&mut qkv_ref)));
        args.extend(ints(&[qkv_dim, in_dim, 0, 1]));
        d.launch(
            "gemv",
            &format!("gemv_norm{rows}"),
            (qkv_dim.div_ceil(4) as u32, 1),
            128,
            &mut args,
        )?;
        drop(args);
        let (mut kc_ref, mut vc_ref) = (vec![nan; 4 * kv_dim], vec![nan; 4 * kv_dim]);
        let mut args = vec![Out(bytes_mut(&mut qkv_ref)), Out(bytes_mut(&mut kc_ref))];
        args.extend([
            Out(bytes_mut(&mut vc_ref)),
            In(bytes(&pos[..rows])),
            In(bytes(&slots[..rows])),
        ]);
        args.push(In(bytes(&inv_freq)));
        args.extend(ints(&[heads, kv_heads, hd, rope_dims]));
        args.push(I32(interleaved));
        d.launch("elementwise", "rope_kv", (rows as u32, 1), 128, &mut args)?;
        drop(args);
        // Fused.
        let mut qkv = vec![nan; rows * qkv_dim];
        let (mut kc, mut vc) = (vec![nan; 4 * kv_dim], vec![nan; 4 * kv_dim]);
        let mut args = vec![In(bytes(&x)), In(bytes(&g)), F32(eps), In(bytes(&w))];
        args.extend([Out(bytes_mut(&mut qkv)), Out(bytes_mut(&mut kc)), Out(bytes_mut(&mut vc))]);
        args.extend([In(bytes(&pos[..rows])), In(bytes(&slots[..rows])), In(bytes(&inv_freq))]);
        args.extend(ints(&[heads, kv_heads, hd, rope_dims]));
        args.extend([I32(interleaved), I32(in_dim as i32)]);
        let items = (heads + kv_heads) * hd + kv_heads * hd - (heads + kv_heads) * rope_dims / 2;
        d.launch(
            "gemv",
            &format!("gemv_rope{rows}"),
            (items.div_ceil(4) as u32, 1),
            128,
            &mut args,
        )?;
        drop(args);
        let what = format!("gemv_rope{rows} (interleaved {interleaved}, {rope_dims} dims)");
        let close = |got: &[u16], want: &[u16], part: &str| -> anyhow::Result<()> {
            for (i, (a, b)) in from_bf16(got).iter().zip(from_bf16(want)).enumerate() {
                ensure!(
                    a.is_nan() == b.is_nan()
                        && (a.is_nan() || (a - b).abs() <= b.abs() / 128.0 + 1e-6),
                    "{what}: {part} element {i} is {a}, not {b}"
                );
            }
            Ok(())
        };
        for r in 0..rows {
            let q = |v: &[u16]| v[r * qkv_dim..][..heads * hd].to_vec();
            close(&q(&qkv), &q(&qkv_ref), &format!("row {r}'s queries"))?;
        }
        close(&kc, &kc_ref, "the key cache")?;
        close(&vc, &vc_ref, "the value cache")?;
    }
    Ok(())
}

/// The tenant LoRA kernels over a batch mixing two adapters of different ranks with rows on
/// the bare base, each adapter's updates of two projections in an arena (the second adapter
/// without the first projection): `lora_shrink`'s `u` against f64 sums of the bf16 inputs (the
/// bare rows', the missing projection's and the ranks past each adapter's own left alone),
/// `lora_expand`'s outputs against the bf16 rounding of the output plus `B u` (the kernel's
/// `u`), in a slice of a wider buffer whose other columns and untouched rows stay as they were.
pub fn lora(d: &dyn Dev) -> anyhow::Result<()> {
    use Arg::*;
    let (out_dim, stride, col, max_rank, pairs) = (40usize, 51usize, 7usize, 8usize, 2usize);
    // Each slot's rank and each of its projections' scale (0: not updated).
    let slots = [(3usize, [0.5f32, 1.5]), (8, [0.0, 2.0])];
    let row_slot = [0i32, -1, 1, 0, 1];
    let rows = row_slot.len();
    for in_dim in [100usize, 576] {
        let mut arena: Vec<f32> = Vec::new();
        let (mut a_off, mut b_off, mut scales) = (vec![-1i64; 4], vec![-1i64; 4], vec![0f32; 4]);
        for (s, (rank, sc)) in slots.iter().enumerate() {
            for (p, &scale) in sc.iter().enumerate() {
                if scale == 0.0 {
                    continue;
                }
                let seed = (10 * s + p) as u64;
                a_off[s * pairs + p] = arena.len() as i64;
                arena.extend(values(rank * in_dim, 40 + seed));
                b_off[s * pairs + p] = arena.len() as i64;
                arena.extend(values(out_dim * rank, 60 + seed).iter().map(|v| v * 0.1));
                scales[s * pairs + p] = scale;
            }
        }
        let ranks: Vec<i32> = slots.iter().map(|s| s.0 as i32).collect();
        let arena = rounded(&arena);
        let x = rounded(&values(rows * in_dim, in_dim as u64));
        let (xb, arena_b) = (to_bf16(&x), to_bf16(&arena));
        for pair in 0..pairs {
            let mut u = vec![f32::NAN; rows * max_rank];
            let mut args = vec![
                In(bytes(&xb)),
                I32(in_dim as i32),
                In(bytes(&arena_b)),
                In(bytes(&row_slot)),
                In(bytes(&a_off)),
                In(bytes(&ranks)),
                In(bytes(&scales)),
                I32(pairs as i32),
                I32(pair as i32),
                Out(bytes_mut(&mut u)),
                I32(max_rank as i32),
            ];
            let grid = (rows as u32, max_rank.div_ceil(4) as u32);
            d.launch("lora", "lora_shrink", grid, 128, &mut args)?;
            drop(args);
            // Each row's update, when it has one: (slot, rank, where A and B start).
            let update = |r: usize| -> Option<(usize, usize, usize, usize)> {
                let s = usize::try_from(row_slot[r]).ok()?;
                let at = s * pairs + pair;
                Some((s, slots[s].0, usize::try_from(a_off[at]).ok()?, b_off[at] as usize))
            };
            for r in 0..rows {
                for k in 0..max_rank {
                    let got = u[r * max_rank + k];
                    let Some((s, _, a_at, _)) = update(r).filter(|u| k < u.1) else {
                        ensure!(got.is_nan(), "lora_shrink wrote u[{r}][{k}] = {got}");
                        continue;
                    };
                    let a = &arena[a_at + k * in_dim..][..in_dim];
                    let dot: f64 = a
                        .iter()
                        .zip(&x[r * in_dim..][..in_dim])
                        .map(|(a, x)| f64::from(*a) * f64::from(*x))
                        .sum();
                    let want = dot * f64::from(scales[s * pairs + pair]);
                    ensure!(
                        (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "lora_shrink ({in_dim} inputs, projection {pair}): u[{r}][{k}] is \
                         {got}, not {want}"
                    );
                }
            }
            let start = to_bf16(&values(rows * stride, 70 + pair as u64));
            let mut y = start.clone();
            let mut args = vec![
                In(bytes(&u)),
                I32(max_rank as i32),
                In(bytes(&arena_b)),
                In(bytes(&row_slot)),
                In(bytes(&b_off)),
                In(bytes(&ranks)),
                I32(pairs as i32),
                I32(pair as i32),
                Out(bytes_mut(&mut y)),
                I32(out_dim as i32),
                I32(stride as i32),
                I32(col as i32),
            ];
            let grid = (out_dim.div_ceil(32) as u32, rows as u32);
            d.launch("lora", "lora_expand", grid, 32, &mut args)?;
            drop(args);
            for r in 0..rows {
                for c in 0..stride {
                    let (got, was) = (y[r * stride + c], start[r * stride + c]);
                    let inside = (col..col + out_dim).contains(&c);
                    let Some((_, rank, _, b_at)) = update(r).filter(|_| inside) else {
                        ensure!(got == was, "lora_expand changed row {r} column {c}");
                        continue;
                    };
                    let o = c - col;
                    let b = &arena[b_at + o * rank..][..rank];
                    let sum: f64 = b
                        .iter()
                        .zip(&u[r * max_rank..])
                        .map(|(b, u)| f64::from(*b) * f64::from(*u))
                        .sum();
                    let want = f64::from(bf16::from_bits(was).to_f32()) + sum;
                    let got = f64::from(bf16::from_bits(got).to_f32());
                    // One bf16 step of the result, and f32 summation's error.
                    ensure!(
                        (got - want).abs() <= want.abs() / 128.0 + 1e-5,
                        "lora_expand ({in_dim} inputs, projection {pair}): row {r} output {o} \
                         is {got}, not {want}"
                    );
                }
            }
        }
    }
    Ok(())
}

pub fn argmax(d: &dyn Dev) -> anyhow::Result<()> {
    let vocab = 49_152usize;
    let mut logits = values(2 * vocab, 9);
    logits[1234] = 5.0;
    logits[40_000] = 5.0;
    logits[vocab + 77] = 3.0;
    let mut out = [0i32; 2];
    d.launch(
        "sampling",
        "argmax_rows",
        (2, 1),
        1024,
        &mut [Arg::In(bytes(&logits)), Arg::Out(bytes_mut(&mut out)), Arg::I32(vocab as i32)],
    )?;
    ensure!(out == [1234, 77], "argmax: {out:?}");
    Ok(())
}

/// Sampling with temperature, top-k and top-p from given uniforms: greedy, top-k 1, top-p
/// 0.75 at two uniforms, then evenly spaced draws that must split exactly by probability.
pub fn sampling(d: &dyn Dev) -> anyhow::Result<()> {
    let vocab = 3000usize;
    // Probabilities 0.5 at token 10, 0.3 at 2000, 0.2 at 5; the rest negligible.
    let mut base = vec![-60f32; vocab];
    base[10] = 0.5f32.ln();
    base[2000] = 0.3f32.ln();
    base[5] = 0.2f32.ln();
    let draws = if d.emulated() { 100 } else { 1000 };
    let mut temps = vec![0.0f32, 1.0, 1.0, 1.0];
    let mut ks = vec![0i32, 1, 0, 0];
    let mut ps = vec![1.0f32, 1.0, 0.75, 0.75];
    let mut us = vec![0.5f32, 0.99, 0.7, 0.3];
    for i in 0..draws {
        temps.push(1.0);
        ks.push(0);
        ps.push(1.0);
        us.push((i as f32 + 0.5) / draws as f32);
    }
    let logits: Vec<f32> = (0..temps.len()).flat_map(|_| base.iter().copied()).collect();
    let got = sample_rows(d, &logits, &temps, &ks, &ps, &us)?;
    ensure!(got[..4] == [10, 10, 2000, 10], "{:?}", &got[..4]);
    let count = |t: i32| got[4..].iter().filter(|x| **x == t).count();
    // In index order: token 5 takes u in [0, 0.2), 10 [0.2, 0.7), 2000 [0.7, 1.0).
    let want = (draws / 5, draws / 2, draws * 3 / 10);
    ensure!(
        (count(5), count(10), count(2000)) == want,
        "{} {} {}",
        count(5),
        count(10),
        count(2000)
    );
    sampling_cuts(d)
}

/// `sample_rows` over the rows of `logits` (one per entry of the other arguments), as the
/// runner launches it (1024 threads a row).
fn sample_rows(
    d: &dyn Dev,
    logits: &[f32],
    temps: &[f32],
    ks: &[i32],
    ps: &[f32],
    us: &[f32],
) -> anyhow::Result<Vec<i32>> {
    use Arg::*;
    let rows = temps.len();
    let mut got = vec![0i32; rows];
    d.launch(
        "sampling",
        "sample_rows",
        (rows as u32, 1),
        1024,
        &mut [
            In(bytes(logits)),
            In(bytes(temps)),
            In(bytes(ks)),
            In(bytes(ps)),
            In(bytes(us)),
            Out(bytes_mut(&mut got)),
            I32((logits.len() / rows.max(1)) as i32),
        ],
    )?;
    Ok(got)
}

/// Draws under top-k and top-p on rows of random logits, each against the draw computed here
/// (in f64) from the definition: the kept set (the k largest, then the smallest set of the
/// largest holding p of their mass), walked in index order to u of its mass. The top-p cuts
/// sit halfway between two tokens' cumulative mass and the u's away from every boundary, so
/// f32 sums cannot tip a draw. The 60 largest logits, at scattered indices, are 1e-4 apart,
/// so the cuts among them fall between near-equal tokens: a threshold off by more than that
/// keeps a token of about a 60th of the mass too many or too few, and changes many draws.
fn sampling_cuts(d: &dyn Dev) -> anyhow::Result<()> {
    let (vocab, t) = (3000usize, 0.7f32);
    let draws = if d.emulated() { 12 } else { 40 };
    let (mut logits, mut ks, mut ps, mut us, mut want) = (vec![], vec![], vec![], vec![], vec![]);
    for (case, (k, p_near)) in
        [(7usize, 1.0f64), (0, 0.6), (50, 0.8), (2999, 0.95)].into_iter().enumerate()
    {
        let mut row: Vec<f32> = values(vocab, 300 + case as u64).iter().map(|v| v * 4.0).collect();
        for j in 0..60 {
            row[(j * 37 + case * 11) % vocab] = 4.5 - j as f32 * 1e-4;
        }
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mass = |i: usize| (f64::from(row[i] - m) / f64::from(t)).exp();
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
        let top = if k == 0 { vocab } else { k };
        let kept_k = &order[..top];
        let total_k: f64 = kept_k.iter().map(|&i| mass(i)).sum();
        // The cut: halfway between the cumulative fractions around p_near.
        let (mut cum, mut n, mut p) = (0.0, top, 1.0f64);
        if p_near < 1.0 {
            for (j, &i) in kept_k.iter().enumerate() {
                let before = cum / total_k;
                cum += mass(i);
                if cum / total_k >= p_near {
                    n = j + 1;
                    p = (before + cum / total_k) / 2.0;
                    // Keeps the same n: the mass before j is below p, through j is above.
                    break;
                }
            }
        }
        let kept: Vec<usize> = {
            let mut v = kept_k[..n].to_vec();
            v.sort_unstable();
            v
        };
        let total: f64 = kept.iter().map(|&i| mass(i)).sum();
        let bounds: Vec<f64> = kept
            .iter()
            .scan(0.0, |acc, &i| {
                *acc += mass(i) / total;
                Some(*acc)
            })
            .collect();
        for j in 0..draws {
            let mut u = (j as f64 + 0.5) / draws as f64;
            // Away from every boundary between tokens.
            while bounds.iter().any(|b| (b - u).abs() < 1e-4) {
                u += 3e-4;
            }
            let at = bounds.iter().position(|b| u < *b).unwrap_or(kept.len() - 1);
            logits.extend_from_slice(&row);
            ks.push(k as i32);
            ps.push(p as f32);
            us.push(u as f32);
            want.push((kept[at] as i32, case, kept.len()));
        }
    }
    let got = sample_rows(d, &logits, &vec![t; want.len()], &ks, &ps, &us)?;
    for (r, (g, (w, case, kept))) in got.iter().zip(&want).enumerate() {
        ensure!(g == w, "sample_rows case {case} ({kept} kept), u {}: token {g}, want {w}", us[r]);
    }
    Ok(())
}

/// Logits of a prefill of two sequences (all positions) then one decode step of each, from
/// `run` given a batch: the CPU runner or the CUDA one.
pub fn two_sequences(
    vocab: u32,
    mut run: impl FnMut(&[SeqInput<'_>]) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<Vec<f32>> {
    let a: Vec<u32> = (0..7).map(|i| (i * 37 + 5) % vocab).collect();
    let b: Vec<u32> = (0..40).map(|i| (i * 53 + 11) % vocab).collect();
    let (ta, tb) = ([0u32, 1], [2u32, 3, 4]);
    let seq = |tokens, start_pos, block_table, logits| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits,
        adapter: None,
    };
    let mut out = run(&[
        seq(&a[..], 0, &ta[..], LogitsWanted::All),
        seq(&b[..], 0, &tb[..], LogitsWanted::All),
    ])?;
    out.extend(run(&[
        seq(&[9], a.len(), &ta[..], LogitsWanted::Last),
        seq(&[10], b.len(), &tb[..], LogitsWanted::Last),
    ])?);
    Ok(out)
}

/// The synthetic model of the parity tests, written with weights of type `ty`.
pub fn synthetic(ty: GgmlType) -> anyhow::Result<sluice_engine::model::LlamaWeights> {
    let spec =
        SynthSpec { hidden: 128, intermediate: 256, heads: 4, kv_heads: 2, ..SynthSpec::tiny() };
    written(&spec, ty)
}

/// `spec`'s model with `ty` weights, through our GGUF writer and loader.
fn written(spec: &SynthSpec, ty: GgmlType) -> anyhow::Result<sluice_engine::model::LlamaWeights> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("m.gguf");
    write_gguf(spec, ty, &path)?;
    Ok(load_gguf_weights(&GgufFile::open(&path)?)?)
}

/// A synthetic F32 model whose head size (64) has the tensor-core prefill, 4 query heads on 2
/// KV heads, 512 positions.
pub fn tiled_model() -> anyhow::Result<sluice_engine::model::LlamaWeights> {
    let spec = SynthSpec {
        hidden: 256,
        intermediate: 384,
        heads: 4,
        kv_heads: 2,
        context: 512,
        ..SynthSpec::tiny()
    };
    let w = written(&spec, GgmlType::F32)?;
    ensure!(w.config.head_dim == 64, "head_dim {}", w.config.head_dim);
    Ok(w)
}

/// Checks GPU logits `got` against the CPU's `want`, row by row, and returns the largest
/// difference as a fraction of the row's range. Tolerance: bf16 weights and activations on
/// the GPU against f32 (with 8-bit activation products) on the CPU: within 3% of each
/// position's logit range; the same top token wherever the CPU's top two are more than 5% of
/// the range apart.
/// `prompt` as one sequence (blocks `table`), then 3 decode steps of it through `forward`:
/// the steps' logits.
fn prompt_then_steps(
    prompt: &[u32],
    table: &[u32],
    vocab: usize,
    forward: &mut dyn FnMut(&[SeqInput<'_>]) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<Vec<f32>> {
    fn at<'a>(tokens: &'a [u32], start_pos: usize, block_table: &'a [u32]) -> SeqInput<'a> {
        SeqInput { tokens, start_pos, block_table, logits: LogitsWanted::Last, adapter: None }
    }
    forward(&[at(prompt, 0, table)])?;
    let mut out = Vec::new();
    for step in 0..3u32 {
        let tok = [(step * 11 + 4) % vocab as u32];
        out.extend(forward(&[at(&tok[..], prompt.len() + step as usize, table)])?);
    }
    Ok(out)
}

/// The largest difference between rows of logits, as a share of each `want` row's range.
fn worst_of_range(got: &[f32], want: &[f32], vocab: usize) -> f32 {
    let mut worst = 0f32;
    for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
        let hi = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lo = w.iter().copied().fold(f32::INFINITY, f32::min);
        worst = worst.max(max_diff(g, w) / (hi - lo).max(1e-6));
    }
    worst
}

pub fn compare_logits(got: &[f32], want: &[f32], vocab: usize) -> anyhow::Result<f32> {
    ensure!(got.len() == want.len(), "{} logits vs {}", got.len(), want.len());
    let mut worst = 0f32;
    for (pos, (g_row, c_row)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let hi = c_row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lo = c_row.iter().copied().fold(f32::INFINITY, f32::min);
        let range = (hi - lo).max(1e-6);
        let d = max_diff(g_row, c_row) / range;
        worst = worst.max(d);
        ensure!(d < 0.03, "position {pos}: logits differ by {d} of the range");
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|x, y| c_row[*y].total_cmp(&c_row[*x]));
        let gpu_top = (0..vocab).max_by(|x, y| g_row[*x].total_cmp(&g_row[*y])).unwrap_or(0);
        if c_row[order[0]] - c_row[order[1]] > 0.05 * range {
            ensure!(gpu_top == order[0], "position {pos}: top token {gpu_top} vs {}", order[0]);
        }
    }
    Ok(worst)
}

/// The CUDA runner against the CPU backend on a synthetic F32 model: a prefill of two
/// sequences and a decode step (logits within 3% of each row's range, the same top token away
/// from near-ties), a mixed prefill + decode batch against each alone, and decode steps
/// through CUDA graphs against the same steps run eagerly.
pub fn forward_parity() -> anyhow::Result<()> {
    let w = synthetic(GgmlType::F32)?;
    let vocab = w.config.vocab_size;

    let mut cpu = Runner::new(2);
    let mut cpu_cache = KvCache::new(&w, 16, 8);
    let want = two_sequences(vocab as u32, |b| Ok(cpu.forward(&w, &mut cpu_cache, b)?))?;

    let gpu_runner = CudaRunner::new(0)?;
    let model = gpu_runner.upload(&w)?;
    let mut cache = gpu_runner.kv_cache(&model, 16, 8)?;
    let got = two_sequences(vocab as u32, |b| Ok(gpu_runner.forward(&model, &mut cache, b)?))?;
    ensure!(want.len() == (7 + 40 + 2) * vocab, "{}", want.len());
    let worst = compare_logits(&got, &want, vocab)?;
    eprintln!("CUDA vs CPU logits: max difference {worst:.4} of the range");

    // A mixed batch (one sequence decoding beside another prefilling) equals each alone.
    let c: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % vocab as u32).collect();
    let tc = [5u32, 6];
    let seq = |tokens, start_pos, block_table, logits| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits,
        adapter: None,
    };
    let a_next = [11u32];
    let ta = [0u32, 1];
    let mixed = gpu_runner.forward(
        &model,
        &mut cache,
        &[
            seq(&a_next[..], 8, &ta[..], LogitsWanted::Last),
            seq(&c[..], 0, &tc[..], LogitsWanted::Last),
        ],
    )?;
    let mut fresh = gpu_runner.kv_cache(&model, 16, 8)?;
    let alone_c =
        gpu_runner.forward(&model, &mut fresh, &[seq(&c[..], 0, &tc[..], LogitsWanted::Last)])?;
    let d = max_diff(&mixed[vocab..], &alone_c);
    ensure!(d < 1e-2, "prefill in a mixed batch differs from alone by {d}");

    // Decode steps of 3 sequences (the graph of bucket 4, one padding row) equal the same
    // steps run eagerly, and each graph is captured once.
    let mut graphed = gpu_runner.kv_cache(&model, 16, 8)?;
    let mut eager = gpu_runner.kv_cache(&model, 16, 8)?;
    eager.set_graphs(false);
    let tables = [[0u32, 1], [2, 3], [4, 5]];
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|s| (0..5 + 3 * s).map(|i| (i * 13 + s) % vocab as u32).collect()).collect();
    let mut steps = Vec::new();
    for cache in [&mut graphed, &mut eager] {
        let prefill: Vec<SeqInput<'_>> =
            (0..3).map(|s| seq(&prompts[s][..], 0, &tables[s][..], LogitsWanted::Last)).collect();
        gpu_runner.forward(&model, cache, &prefill)?;
        let mut out = Vec::new();
        for step in 0..4u32 {
            let toks: Vec<[u32; 1]> = (0..3u32).map(|s| [(step * 7 + s) % vocab as u32]).collect();
            let b: Vec<SeqInput<'_>> = (0..3)
                .map(|s| SeqInput {
                    tokens: &toks[s][..],
                    start_pos: prompts[s].len() + step as usize,
                    block_table: &tables[s][..],
                    logits: LogitsWanted::Last,
                    adapter: None,
                })
                .collect();
            out.extend(gpu_runner.forward(&model, cache, &b)?);
        }
        steps.push(out);
    }
    ensure!(graphed.graph_buckets() == vec![4], "graphs: {:?}", graphed.graph_buckets());
    ensure!(eager.graph_buckets().is_empty(), "eager cache captured graphs");
    // cuBLAS may choose other kernels for 4 rows than for 3: the same within 0.5% of each
    // row's range (the CPU comparison allows 3%).
    let worst = worst_of_range(&steps[0], &steps[1], vocab);
    eprintln!(
        "decode graph vs eager: max difference {worst:.2e} of the range, 4 steps x 3 sequences"
    );
    ensure!(worst < 0.005, "the decode graph differs from the eager pass by {worst} of the range");

    // One sequence's decode steps through the matrix-vector kernels (launched plainly and with
    // programmatic dependent launch) and through cuBLAS: they differ in summation order and in
    // the norm's rounding (the fused norm does not round x to bf16 before the product: up to
    // 2^-9 of each element, 0.53% of the range in the emulation), and agree within 1% of each
    // row's range, and with the CPU backend.
    let default_rows = gpu_runner.gemv_rows();
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 5 + 2) % vocab as u32).collect();
    let table = [0u32, 1];
    let mut paths = Vec::new();
    for (rows, pdl) in [(1, false), (0, false), (1, true)] {
        gpu_runner.set_gemv_rows(rows);
        gpu_runner.set_pdl(pdl)?;
        let mut cache = gpu_runner.kv_cache(&model, 16, 8)?;
        paths.push(prompt_then_steps(&prompt, &table, vocab, &mut |b| {
            Ok(gpu_runner.forward(&model, &mut cache, b)?)
        })?);
    }
    gpu_runner.set_gemv_rows(default_rows);
    gpu_runner.set_pdl(false)?;
    // Launched with programmatic dependent launch, the same kernels compute the same
    // numbers: a kernel reading its input before the one before it finished would not.
    ensure!(paths[2] == paths[0], "the matrix-vector path differs with programmatic launch");
    let mut cpu_cache = KvCache::new(&w, 16, 8);
    let want = prompt_then_steps(&prompt, &table, vocab, &mut |b| {
        Ok(cpu.forward(&w, &mut cpu_cache, b)?)
    })?;
    let worst = worst_of_range(&paths[0], &paths[1], vocab);
    eprintln!("decode through the matrix-vector kernels vs cuBLAS: {worst:.2e} of the range");
    ensure!(worst < 0.01, "the matrix-vector path differs from cuBLAS by {worst} of the range");
    let vs_cpu = compare_logits(&paths[0], &want, vocab)?;
    eprintln!("decode through the matrix-vector kernels vs CPU: {vs_cpu:.4} of the range");
    Ok(())
}

/// Tenant adapters on the device: a batch mixing two adapters (one of every projection, one of
/// Q and V only, of another rank) and a sequence on the bare base, prefilled then one decode
/// step each, against the CPU backend (the same tolerance as the bare forward pass); and the
/// adapters matter (the bare base's logits are far from the adapted ones).
pub fn adapter_parity() -> anyhow::Result<()> {
    use sluice_engine::lora::{LoraAdapter, Target};
    use sluice_engine::synth::SynthLora;
    let w = synthetic(GgmlType::F32)?;
    let (c, vocab) = (&w.config, w.config.vocab_size);
    let dir = tempfile::tempdir()?;
    let mut adapters = Vec::new();
    for (seed, rank, targets) in [(5, 8, Target::ALL.to_vec()), (6, 4, vec![Target::Q, Target::V])]
    {
        let path = dir.path().join(format!("a{seed}"));
        SynthLora { rank, targets, b_std: 0.2, ..SynthLora::new(seed) }.write_peft(
            c,
            GgmlType::F32,
            &path,
        )?;
        adapters.push(LoraAdapter::load(&path, c)?);
    }
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..6 + 5 * s).map(|i| (i * 29 + 7 * s + 3) % vocab as u32).collect())
        .collect();
    let tables = [[0u32, 1], [2, 3], [4, 5]];
    let which = [Some(&adapters[0]), None, Some(&adapters[1])];
    let run = |forward: &mut dyn FnMut(&[SeqInput<'_>]) -> anyhow::Result<Vec<f32>>,
               which: [Option<&LoraAdapter>; 3]|
     -> anyhow::Result<Vec<f32>> {
        let seq = |s: usize, tokens, start_pos, logits| SeqInput {
            tokens,
            start_pos,
            block_table: &tables[s][..],
            logits,
            adapter: which[s],
        };
        let prefill: Vec<SeqInput<'_>> =
            (0..3).map(|s| seq(s, &prompts[s][..], 0, LogitsWanted::All)).collect();
        let mut out = forward(&prefill)?;
        let next: Vec<[u32; 1]> = (0..3u32).map(|s| [(s * 17 + 2) % vocab as u32]).collect();
        let steps: Vec<SeqInput<'_>> =
            (0..3).map(|s| seq(s, &next[s][..], prompts[s].len(), LogitsWanted::Last)).collect();
        out.extend(forward(&steps)?);
        Ok(out)
    };
    let mut cpu = Runner::new(2);
    let mut cpu_cache = KvCache::new(&w, 16, 8);
    let want = run(&mut |b| Ok(cpu.forward(&w, &mut cpu_cache, b)?), which)?;
    let mut cpu_cache = KvCache::new(&w, 16, 8);
    let bare = run(&mut |b| Ok(cpu.forward(&w, &mut cpu_cache, b)?), [None; 3])?;

    let gpu = CudaRunner::new(0)?;
    let model = gpu.upload(&w)?;
    let mut cache = gpu.kv_cache(&model, 16, 8)?;
    let got = run(&mut |b| Ok(gpu.forward(&model, &mut cache, b)?), which)?;
    let worst = compare_logits(&got, &want, vocab)?;
    // The rows under an adapter, against the bare base: the adapters move them well past
    // the agreement measured.
    let rows: usize = prompts.iter().map(Vec::len).sum::<usize>() + 3;
    ensure!(want.len() == rows * vocab, "{} logits", want.len());
    let moved =
        worst_of_range(&want[..prompts[0].len() * vocab], &bare[..prompts[0].len() * vocab], vocab);
    ensure!(
        moved > 5.0 * worst,
        "the adapter moves the logits by {moved}, the device differs by {worst}"
    );
    eprintln!(
        "CUDA vs CPU with adapters: max difference {worst:.4} of the range (adapter moves {moved:.3})"
    );
    Ok(())
}

/// Q8_0, Q4_0 and Q4_1 weights uploaded as the file's blocks and dequantized by our kernels,
/// and BF16 weights uploaded as stored, against the CPU backend.
pub fn quantized_parity() -> anyhow::Result<()> {
    let gpu_runner = CudaRunner::new(0)?;
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::BF16] {
        let w = synthetic(ty)?;
        let vocab = w.config.vocab_size;
        let mut cpu = Runner::new(2);
        let mut cpu_cache = KvCache::new(&w, 16, 8);
        let want = two_sequences(vocab as u32, |b| Ok(cpu.forward(&w, &mut cpu_cache, b)?))?;
        // Uploaded as the file's blocks, dequantized by our kernels.
        let model = gpu_runner.upload(&w)?;
        let mut cache = gpu_runner.kv_cache(&model, 16, 8)?;
        let got = two_sequences(vocab as u32, |b| Ok(gpu_runner.forward(&model, &mut cache, b)?))?;
        let worst = compare_logits(&got, &want, vocab)?;
        eprintln!("{ty:?} weights, CUDA vs CPU logits: max difference {worst:.4} of the range");
    }
    Ok(())
}

/// The sizes of [`bench_llama`]: a prompt of `prompt` tokens (a multiple of 64); decode steps
/// over `decode_ctx` tokens of context at batch 1 (eager and graph) and each of `batches`;
/// decode over `long_ctx` tokens at each of `long_batches`, split and unsplit; phase profiles
/// of the prompt and of decode at each of `profile_batches`; `reps` timed repetitions of a
/// decode step (a third of that for the prompt).
pub struct BenchShape {
    pub prompt: usize,
    pub decode_ctx: usize,
    pub batches: &'static [usize],
    pub long_ctx: usize,
    pub long_batches: &'static [usize],
    /// Batches timed with the matrix-vector kernels and with cuBLAS.
    pub gemv_batches: &'static [usize],
    /// Shapes of the matrix-vector kernels (warps a block, loads in flight a lane) timed at
    /// batch 1 against the default (none under the emulation, whose kernels are built once
    /// with the defaults).
    pub gemv_shapes: &'static [(usize, usize)],
    /// Shapes of the wide decode attention kernels (rounds of keys a step, whether a step
    /// prefetches the next into L2) timed at each of `batches` against the default (under the
    /// emulation, the default's own).
    pub attention_shapes: &'static [(usize, bool)],
    pub profile_batches: &'static [usize],
    pub reps: usize,
}

impl BenchShape {
    /// Issue 7's figures.
    pub const ISSUE: BenchShape = BenchShape {
        prompt: 2048,
        decode_ctx: 128,
        batches: &[64, 256],
        long_ctx: 8000,
        long_batches: &[1, 8],
        gemv_batches: &[1, 2, 3, 4],
        gemv_shapes: &[(4, 4), (4, 1), (8, 1)],
        attention_shapes: &[(1, true), (2, true), (4, true), (1, false)],
        profile_batches: &[1, 4, 256],
        reps: 10,
    };
}

/// Dense bf16 tensor peaks (FLOP/s) from the vendor's data sheets, by a part of the device's
/// name (the first that matches): no device reports its own.
const PEAK_BF16: [(&str, f64); 6] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
];

/// What the figures are set against on `r`'s device: its memory bandwidth from its own clock
/// and bus width, its bf16 peak from [`PEAK_BF16`] (`None` for a device not in it), and a line
/// saying which were used.
fn device_bounds(r: &CudaRunner) -> anyhow::Result<(f64, Option<f64>, String)> {
    let name = r.device_name()?;
    let bandwidth = r.memory_bandwidth()?;
    let peak = PEAK_BF16.iter().find(|(part, _)| name.contains(part)).map(|&(_, p)| p);
    let peak_text = match peak {
        Some(p) => format!("bf16 peak {:.0} TFLOP/s (data sheet)", p / 1e12),
        None => "bf16 peak unknown (not in the data-sheet table: no fraction printed)".into(),
    };
    let line = format!(
        "device {name}: memory {:.2} TB/s (its clock and bus width), {peak_text}",
        bandwidth / 1e12
    );
    Ok((bandwidth, peak, line))
}

/// Issue 7's speed figures for a model of shape `c` with random bf16 weights made on the
/// device: prefill throughput on one prompt against the bf16 peak (and attention's share of
/// it), decode step time at batch 1 against the memory bound (weight bytes / the device's own
/// bandwidth, see [`device_bounds`]) eager and
/// through the graph, our matrix-vector kernels against cuBLAS at small batches, decode
/// throughput at larger batches with tokens picked on the device
/// against logits copied to the host, long-context decode with attention split and unsplit,
/// and phase profiles. Prints the figures (logits stay on the device).
pub fn bench_llama(
    r: &CudaRunner,
    c: &sluice_engine::model::LlamaConfig,
    shape: &BenchShape,
) -> anyhow::Result<()> {
    ensure!(shape.prompt.is_multiple_of(64) && shape.prompt > 0, "the prompt is whole tiles of 64");
    ensure!(shape.long_ctx < c.context_length, "the long context fits the model's");
    let vocab = c.vocab_size as u32;
    let params = c.vocab_size * c.hidden * 2
        + c.layers
            * (c.hidden * (c.q_dim() + 2 * c.kv_dim())
                + c.q_dim() * c.hidden
                + 3 * c.hidden * c.intermediate);
    let (bandwidth, peak_flops, device) = device_bounds(r)?;
    println!("{device}");
    let bound_ms = params as f64 * 2.0 / bandwidth * 1e3;
    let model = r.random_model(c, 7)?;
    let block = 16usize;
    let time = |f: &mut dyn FnMut() -> anyhow::Result<()>, reps: usize| -> anyhow::Result<f64> {
        f()?;
        r.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            f()?;
        }
        r.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    };
    // `batch` sequences of one token each after `ctx` tokens, a cache to hold them, and the
    // tables and tokens the steps read.
    struct Decode {
        ctx: usize,
        tables: Vec<Vec<u32>>,
        toks: Vec<[u32; 1]>,
    }
    impl Decode {
        fn new(batch: usize, ctx: usize, block: usize, vocab: u32) -> Decode {
            let per_seq = ctx / block + 1;
            let tables = (0..batch)
                .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
                .collect();
            let toks = (0..batch).map(|s| [(s as u32 * 31) % vocab]).collect();
            Decode { ctx, tables, toks }
        }
        fn blocks(&self) -> usize {
            self.tables.iter().map(Vec::len).sum()
        }
        fn step(&self) -> Vec<SeqInput<'_>> {
            self.tables
                .iter()
                .zip(&self.toks)
                .map(|(table, tok)| SeqInput {
                    tokens: tok,
                    start_pos: self.ctx,
                    block_table: table,
                    logits: LogitsWanted::Last,
                    adapter: None,
                })
                .collect()
        }
    }

    // Prefill: one prompt.
    let n = shape.prompt;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % vocab).collect();
    let table: Vec<u32> = (0..n.div_ceil(block) as u32).collect();
    let mut cache = r.kv_cache(&model, block, table.len())?;
    let whole = [SeqInput {
        tokens: &prompt,
        start_pos: 0,
        block_table: &table,
        logits: LogitsWanted::Last,
        adapter: None,
    }];
    let prompt_reps = shape.reps.div_ceil(3);
    let secs = time(
        &mut || {
            r.forward_device(&model, &mut cache, &whole)?;
            Ok(())
        },
        prompt_reps,
    )?;
    let t = n as f64;
    // The products the pass does: every layer's weights for each token, the LM head for the
    // last token only (the embedding is a gather), and attention's QK^T and PV (the causal
    // half of 4 T^2 d per layer).
    let layer_params = params - 2 * c.vocab_size * c.hidden;
    let attn_flops = 2.0 * c.layers as f64 * t * t * c.q_dim() as f64;
    let flops = 2.0 * layer_params as f64 * t + 2.0 * (c.vocab_size * c.hidden) as f64 + attn_flops;
    let of_peak = peak_flops.map_or(String::new(), |p| {
        format!(" ({:.2} of the {:.0} peak)", flops / secs / p, p / 1e12)
    });
    eprintln!(
        "prefill {n} tokens: {:.1} ms, {:.0} TFLOP/s{of_peak}",
        secs * 1e3,
        flops / secs / 1e12
    );
    // Where the time goes: the same rows as prompts of 64 tokens do the same GEMMs and
    // elementwise work but 64 / n of the attention, so the difference is about attention's.
    let pieces = n / 64;
    let short = time(
        &mut || {
            let b: Vec<SeqInput<'_>> = (0..pieces)
                .map(|s| SeqInput {
                    tokens: &prompt[s * 64..(s + 1) * 64],
                    start_pos: 0,
                    block_table: &table[s * 64 / block..(s + 1) * 64 / block],
                    logits: LogitsWanted::Last,
                    adapter: None,
                })
                .collect();
            r.forward_device(&model, &mut cache, &b)?;
            Ok(())
        },
        prompt_reps,
    )?;
    eprintln!(
        "prefill as {pieces} prompts of 64 tokens: {:.1} ms; attention of the {n}-token prompt \
         about {:.1} ms ({:.0} TFLOP/s), the rest {:.1} ms ({:.0} TFLOP/s)",
        short * 1e3,
        (secs - short) * 1e3,
        attn_flops * (1.0 - 1.0 / pieces as f64) / (secs - short) / 1e12,
        short * 1e3,
        (flops - attn_flops) / short / 1e12
    );

    // Decode; batch 1 eagerly too, to show what the graph saves.
    // Decode steps of `d` on `cache` (logits left on the device): seconds a step.
    let steps = |d: &Decode, cache: &mut sluice_engine::cuda::CudaKvCache| -> anyhow::Result<f64> {
        time(
            &mut || {
                r.forward_device(&model, cache, &d.step())?;
                Ok(())
            },
            shape.reps,
        )
    };
    let runs =
        [(1usize, false), (1, true)].into_iter().chain(shape.batches.iter().map(|&b| (b, true)));
    for (batch, graphs) in runs {
        let d = Decode::new(batch, shape.decode_ctx, block, vocab);
        let mut cache = r.kv_cache(&model, block, d.blocks())?;
        cache.set_graphs(graphs);
        let secs = steps(&d, &mut cache)?;
        eprintln!(
            "decode batch {batch} at {} tokens of context ({}): {:.2} ms/step, {:.0} tok/s{}",
            d.ctx,
            if graphs { "CUDA graph" } else { "eager" },
            secs * 1e3,
            batch as f64 / secs,
            if batch == 1 {
                format!(" (memory bound {bound_ms:.2} ms: {:.2} of it)", bound_ms / (secs * 1e3))
            } else {
                String::new()
            }
        );
        if !graphs {
            continue;
        }
        // The serving path: the step with its tokens chosen, greedy on the device (ids back)
        // against the logits copied back for the host to choose, and drawn on the device with
        // a temperature, top-k and top-p (sample_rows' threshold searches pass over each row
        // of logits many times).
        use sluice_engine::backend::Pick;
        let rows: Vec<Option<usize>> = (0..batch).map(Some).collect();
        let greedy = vec![Pick::Argmax; batch];
        let draw = Pick::Draw { temperature: 0.8, top_k: 50, top_p: 0.9, uniform: 0.5 };
        let draws = vec![draw; batch];
        let mut step = |picks: Option<&[Pick]>| -> anyhow::Result<f64> {
            time(
                &mut || {
                    let b = d.step();
                    if let Some(picks) = picks {
                        r.forward_picking(&model, &mut cache, &b, &rows, picks)?;
                    } else {
                        let logits = r.forward(&model, &mut cache, &b)?;
                        let ids: Vec<u32> = logits
                            .chunks(c.vocab_size)
                            .map(sluice_engine::sampler::argmax)
                            .collect();
                        std::hint::black_box(ids);
                    }
                    Ok(())
                },
                shape.reps,
            )
        };
        let (device_pick, host_pick) = (step(Some(&greedy))?, step(None)?);
        let device_draw = step(Some(&draws))?;
        eprintln!(
            "decode batch {batch}, tokens chosen: greedy on the device {:.2} ms/step, logits to \
             the host {:.2} ms/step ({:.2}x); drawn on the device (T 0.8, top-k 50, top-p 0.9) \
             {:.2} ms/step",
            device_pick * 1e3,
            host_pick * 1e3,
            host_pick / device_pick,
            device_draw * 1e3
        );
    }

    // One decode step of `d` on a fresh cache (its graph captured anew), in ms.
    let step_ms = |d: &Decode| -> anyhow::Result<f64> {
        Ok(steps(d, &mut r.kv_cache(&model, block, d.blocks())?)? * 1e3)
    };

    // Small batches' products through our matrix-vector kernels (the default) against cuBLAS.
    let default_rows = r.gemv_rows();
    for &batch in shape.gemv_batches {
        let d = Decode::new(batch, shape.decode_ctx, block, vocab);
        let mut ms = Vec::new();
        for gemv_rows in [0, batch] {
            r.set_gemv_rows(gemv_rows);
            ms.push(step_ms(&d)?);
        }
        r.set_gemv_rows(default_rows);
        eprintln!(
            "decode batch {batch} at {} tokens of context (CUDA graph): {:.2} ms/step with the \
             matrix-vector kernels, {:.2} ms/step with cuBLAS ({:.2}x)",
            d.ctx,
            ms[1],
            ms[0],
            ms[0] / ms[1]
        );
    }

    // For comparing kernel shapes: one decode step of `d` on a fresh cache of random keys and
    // values (in a zeroed one every earlier key scores the same, and the order of a softmax's
    // sums would not show), its logits and then its time, in ms.
    let logits_and_ms = |d: &Decode| -> anyhow::Result<(f64, Vec<f32>)> {
        let mut cache = r.random_kv_cache(&model, block, d.blocks(), 7)?;
        let logits = r.forward(&model, &mut cache, &d.step())?;
        Ok((steps(d, &mut cache)? * 1e3, logits))
    };

    // The matrix-vector kernels' shapes at batch 1, each also checked against the default's
    // logits for the same step.
    if !shape.gemv_shapes.is_empty() {
        let d = Decode::new(1, shape.decode_ctx, block, vocab);
        let run = |gemv: Option<(usize, usize)>| -> anyhow::Result<(f64, Vec<f32>)> {
            r.set_gemv_shape(gemv)?;
            logits_and_ms(&d)
        };
        let (base, want) = run(None)?;
        r.set_pdl(true)?;
        let (pdl, got) = run(None)?;
        r.set_pdl(false)?;
        eprintln!(
            "decode batch 1 (CUDA graph), matrix-vector kernels with programmatic dependent \
             launch: {pdl:.2} ms/step against {base:.2} without ({:.2}x; logits {})",
            base / pdl,
            if got == want { "the same" } else { "DIFFERENT" }
        );
        ensure!(got == want, "programmatic dependent launch changed the logits");
        let (dw, du) = r.gemv_shape();
        for &(warps, unroll) in shape.gemv_shapes {
            let (ms, got) = run(Some((warps, unroll)))?;
            let diff = worst_of_range(&got, &want, c.vocab_size);
            eprintln!(
                "decode batch 1 (CUDA graph), matrix-vector kernels of {warps} warps x {unroll} \
                 loads: {ms:.2} ms/step against {base:.2} with {dw} x {du} ({:.2}x; logits \
                 within {diff:.1e} of the range)",
                base / ms
            );
            ensure!(diff < 0.01, "{warps} x {unroll} matrix-vector kernels: logits off by {diff}");
        }
        r.set_gemv_shape(None)?;
    }

    // The wide decode attention kernels' shapes at the larger batches, each also checked
    // against the default's logits for the same step.
    if !shape.attention_shapes.is_empty() {
        let (dr, dp) = r.attention_shape();
        let prefetch = |on: bool| if on { "the next step prefetched" } else { "no prefetch" };
        for &batch in shape.batches {
            let d = Decode::new(batch, shape.decode_ctx, block, vocab);
            let run = |attn: Option<(usize, bool)>| -> anyhow::Result<(f64, Vec<f32>)> {
                r.set_attention_shape(attn)?;
                logits_and_ms(&d)
            };
            let (base, want) = run(None)?;
            for &(rounds, on) in shape.attention_shapes {
                let (ms, got) = run(Some((rounds, on)))?;
                let diff = worst_of_range(&got, &want, c.vocab_size);
                eprintln!(
                    "decode batch {batch} (CUDA graph), attention of {rounds} rounds of keys, {}: \
                     {ms:.2} ms/step against {base:.2} with {dr}, {} ({:.2}x; logits within \
                     {diff:.1e} of the range)",
                    prefetch(on),
                    prefetch(dp),
                    base / ms
                );
                ensure!(diff < 0.01, "attention of {rounds} rounds: logits off by {diff}");
            }
        }
        r.set_attention_shape(None)?;
    }

    // Attention split into parts across the device (the default) against one block per row
    // and head group (max splits 1): at batch 1 over the short context, and long contexts.
    let split_runs = std::iter::once((1, shape.decode_ctx))
        .chain(shape.long_batches.iter().map(|&b| (b, shape.long_ctx)));
    for (batch, ctx) in split_runs {
        let d = Decode::new(batch, ctx, block, vocab);
        let mut ms = Vec::new();
        for max_splits in [1usize, 64] {
            r.set_max_splits(max_splits);
            ms.push(step_ms(&d)?);
        }
        eprintln!(
            "decode batch {batch} at {} tokens of context (CUDA graph): {:.2} ms/step split, \
             {:.2} ms/step unsplit ({:.2}x)",
            d.ctx,
            ms[1],
            ms[0],
            ms[0] / ms[1]
        );
    }

    // Where the time goes, phase by phase (events between launches, one eager pass each; last,
    // so the figures above are out even if this fails).
    let gemm_flops = |phase: &str, rows: f64| -> Option<f64> {
        let (h, q, kv, ff) =
            (c.hidden as f64, c.q_dim() as f64, c.kv_dim() as f64, c.intermediate as f64);
        // "QKV GEMM", or "QKV GEMV + norm" where the matrix-vector kernels fuse more in.
        let (product, kind) = phase.split_once(' ')?;
        if !kind.starts_with("GEM") {
            return None;
        }
        let per_row = match product {
            "QKV" => h * (q + 2.0 * kv),
            "O" => q * h,
            "gate/up" => 2.0 * h * ff,
            "down" => ff * h,
            _ => return None,
        };
        Some(2.0 * per_row * rows * c.layers as f64)
    };
    let show = |title: &str, phases: &[(&str, f64)], rows: f64| {
        let total: f64 = phases.iter().map(|(_, ms)| ms).sum();
        eprintln!("profile, {title}: {total:.2} ms in all");
        for (phase, ms) in phases {
            let rate = match (gemm_flops(phase, rows), *phase) {
                (Some(f), _) if rows > 1.0 => format!(", {:.0} TFLOP/s", f / ms / 1e9),
                // One row: a GEMM reads its weights once (bf16).
                (Some(f), _) => format!(", {:.2} TB/s of weights", f / rows / ms / 1e9),
                (None, "prefill attention") => format!(", {:.0} TFLOP/s", attn_flops / ms / 1e9),
                _ => String::new(),
            };
            eprintln!("  {phase:<26} {ms:>8.3} ms {:>5.1}%{rate}", 100.0 * ms / total);
        }
    };
    show(&format!("prefill {n} tokens"), &r.profile(&model, &mut cache, &whole)?, t);
    for &batch in shape.profile_batches {
        let d = Decode::new(batch, shape.decode_ctx, block, vocab);
        let mut cache = r.kv_cache(&model, block, d.blocks())?;
        r.profile(&model, &mut cache, &d.step())?; // the first pass sets cuBLAS up
        let phases = r.profile(&model, &mut cache, &d.step())?;
        show(&format!("decode batch {batch}, eager"), &phases, batch as f64);
    }
    Ok(())
}
