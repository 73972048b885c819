//! Every kernel of `kernels/` run on the CPU through the emulation of CUDA in
//! `tests/emu/cuda_emu.h`, against the checks of `tests/kernel_checks` (the same checks the GPU
//! machine runs in tests/cuda_device.rs). The kernel sources are the ones NVRTC compiles (the
//! prelude, then each module), built with the system's C++ compiler into a shared library that
//! this test loads. Each buffer is copied into memory fenced by guard words on both sides; a
//! kernel writing outside its buffer fails the launch.
#![cfg(feature = "cuda")]

mod emu;
mod kernel_checks;

use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, bail, ensure};
use kernel_checks::{Arg, Dev};

type Launch = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    *mut *mut c_void,
    *const u32,
    u32,
    *mut c_char,
    usize,
) -> i32;

struct Emu {
    _dir: tempfile::TempDir,
    _lib: libloading::Library,
    launch: Launch,
}

/// Guard words around each buffer (16-byte words: buffers start 16-byte aligned, as the
/// kernels' vector loads need; cudaMalloc gives 256).
const GUARD: usize = 32;
const GUARD_WORD: u128 = 0xA5A5_5A5A_DEAD_BEEF_0123_4567_89AB_CDEF;
const WORD: usize = 16;

fn build() -> anyhow::Result<Emu> {
    // Under the target directory: a /tmp mounted noexec cannot hold libraries to load.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    let lib = dir.path().join("libkernels_emu.so");
    emu::shared_library(&emu::kernels_source()?, &lib, None, &[])?;
    // SAFETY: the library was just built from our sources; its initializers only set globals.
    let lib = unsafe { libloading::Library::new(&lib) }?;
    // SAFETY: `emu_launch` is defined by `kernels_source` with exactly the `Launch` signature.
    let launch = *unsafe { lib.get::<Launch>(b"emu_launch\0") }?;
    Ok(Emu { _dir: dir, _lib: lib, launch })
}

/// The emulation is one set of globals: one launch at a time.
fn emu() -> anyhow::Result<&'static Mutex<Emu>> {
    static EMU: OnceLock<Result<Mutex<Emu>, String>> = OnceLock::new();
    match EMU.get_or_init(|| build().map(Mutex::new).map_err(|e| format!("{e:#}"))) {
        Ok(e) => Ok(e),
        Err(e) => bail!("{e}"),
    }
}

struct Emulated;

/// `b` in fresh memory, 8-byte aligned, between GUARD guard words on each side (the last
/// word's spare bytes hold the guard's bytes too).
fn fenced(b: &[u8]) -> Vec<u128> {
    let mut v = vec![GUARD_WORD; 2 * GUARD + b.len().div_ceil(WORD)];
    kernel_checks::bytes_mut(&mut v[GUARD..])[..b.len()].copy_from_slice(b);
    v
}

/// The bytes of a fenced buffer of `len`, or an error when a guard byte changed.
fn unfenced<'v>(v: &'v [u128], len: usize, what: &str) -> anyhow::Result<&'v [u8]> {
    let words = len.div_ceil(WORD);
    let data = kernel_checks::bytes(&v[GUARD..GUARD + words]);
    let guard = GUARD_WORD.to_le_bytes();
    let spare_ok = (len..words * WORD).all(|i| data[i] == guard[i % WORD]);
    let words_ok = v[..GUARD].iter().chain(&v[GUARD + words..]).all(|w| *w == GUARD_WORD);
    ensure!(spare_ok && words_ok, "{what}: written outside its buffer");
    Ok(&data[..len])
}

impl Dev for Emulated {
    fn launch3(
        &self,
        _module: &'static str,
        kernel: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut [Arg<'_>],
    ) -> anyhow::Result<()> {
        // Each buffer fenced; each scalar in an 8-byte slot of its own.
        let mut buffers: Vec<Vec<u128>> = Vec::new();
        let mut scalars: Vec<u64> = Vec::new();
        for a in args.iter() {
            match a {
                Arg::In(b) => buffers.push(fenced(b)),
                Arg::Out(b) => buffers.push(fenced(b)),
                Arg::I32(v) => scalars.push(u64::from(*v as u32)),
                Arg::I64(v) => scalars.push(*v as u64),
                Arg::U64(v) => scalars.push(*v),
                Arg::F32(v) => scalars.push(u64::from(v.to_bits())),
            }
        }
        let mut ptrs: Vec<*mut c_void> =
            buffers.iter_mut().map(|v| v[GUARD..].as_mut_ptr().cast::<c_void>()).collect();
        let (mut pi, mut si) = (0, 0);
        let mut params: Vec<*mut c_void> = Vec::new();
        let mut sizes: Vec<u32> = Vec::new();
        for a in args.iter() {
            if matches!(a, Arg::In(_) | Arg::Out(_)) {
                params.push((&raw mut ptrs[pi]).cast());
                pi += 1;
            } else {
                // Little-endian: a 4-byte scalar is the low half of its slot.
                params.push((&raw mut scalars[si]).cast());
                si += 1;
            }
            sizes.push(match a {
                Arg::In(_) | Arg::Out(_) => size_of::<*mut c_void>() as u32,
                Arg::I32(_) | Arg::F32(_) => 4,
                Arg::I64(_) | Arg::U64(_) => 8,
            });
        }
        let name = CString::new(kernel)?;
        let mut err = vec![0 as c_char; 512];
        let rc = {
            let emu = emu()?.lock().map_err(|_| anyhow::anyhow!("an emulated launch panicked"))?;
            // SAFETY: one pointer per kernel parameter, each to a value of the parameter's
            // type (buffers: pointers into `buffers`, alive and unaliased for the call).
            unsafe {
                (emu.launch)(
                    name.as_ptr(),
                    [grid.0, grid.1, grid.2].as_ptr(),
                    [block, 1, 1].as_ptr(),
                    params.as_mut_ptr(),
                    sizes.as_ptr(),
                    sizes.len() as u32,
                    err.as_mut_ptr(),
                    err.len(),
                )
            }
        };
        if rc != 0 {
            // SAFETY: the launcher wrote a NUL-terminated message into `err`.
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) };
            bail!("{}", msg.to_string_lossy());
        }
        let mut bufs = buffers.iter();
        for (i, a) in args.iter_mut().enumerate() {
            let what = format!("{kernel} parameter {i}");
            match a {
                Arg::In(b) => {
                    let v = bufs.next().context("buffer")?;
                    ensure!(unfenced(v, b.len(), &what)? == *b, "{what}: an input was written");
                }
                Arg::Out(b) => {
                    let v = bufs.next().context("buffer")?;
                    b.copy_from_slice(unfenced(v, b.len(), &what)?);
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn emulated(&self) -> bool {
        true
    }
}

#[test]
fn elementwise_kernels_match_their_definitions() -> anyhow::Result<()> {
    kernel_checks::elementwise(&Emulated)
}

#[test]
fn dequantization_matches_the_cpu_backend() -> anyhow::Result<()> {
    kernel_checks::dequantization(&Emulated)
}

#[test]
fn paged_and_prefill_attention_match_softmax_attention() -> anyhow::Result<()> {
    kernel_checks::attention(&Emulated)
}

#[test]
fn matrix_vector_products_match_their_definitions() -> anyhow::Result<()> {
    kernel_checks::gemv(&Emulated)
}

#[test]
fn the_fused_projection_matches_the_kernels_it_fuses() -> anyhow::Result<()> {
    kernel_checks::gemv_rope(&Emulated)
}

#[test]
fn argmax_takes_the_lowest_index_among_equals() -> anyhow::Result<()> {
    kernel_checks::argmax(&Emulated)
}

#[test]
fn lora_updates_rows_of_mixed_adapters_and_leaves_the_rest() -> anyhow::Result<()> {
    kernel_checks::lora(&Emulated)
}

#[test]
fn sampling_follows_temperature_top_k_and_top_p() -> anyhow::Result<()> {
    kernel_checks::sampling(&Emulated)
}

/// The emulation itself: a kernel whose threads wait at different barriers is an error, not
/// a hang, and so is a launch of a kernel that does not exist.
#[test]
fn the_emulation_reports_divergent_barriers_and_unknown_kernels() -> anyhow::Result<()> {
    let mut out = vec![0u16; 64];
    // rmsnorm with 48 threads: the second warp has 16 lanes, its shuffles miss lanes.
    let e = Emulated
        .launch(
            "elementwise",
            "rmsnorm",
            (1, 1),
            48,
            &mut [
                Arg::In(kernel_checks::bytes(&[0u16; 64])),
                Arg::In(kernel_checks::bytes(&[0u16; 64])),
                Arg::Out(kernel_checks::bytes_mut(&mut out)),
                Arg::I32(64),
                Arg::F32(1e-5),
            ],
        )
        .err()
        .context("a partial warp's shuffle went unnoticed")?;
    ensure!(e.to_string().contains("warp 1"), "{e}");
    let e = Emulated
        .launch("elementwise", "no_such_kernel", (1, 1), 32, &mut [])
        .err()
        .context("an unknown kernel launched")?;
    ensure!(e.to_string().contains("no kernel named no_such_kernel"), "{e}");
    // silu_mul's count is a long long: a 4-byte int there is refused.
    let mut o = vec![0u16; 4];
    let e = Emulated
        .launch(
            "elementwise",
            "silu_mul",
            (1, 1),
            32,
            &mut [
                Arg::In(kernel_checks::bytes(&[0u16; 8])),
                Arg::Out(kernel_checks::bytes_mut(&mut o)),
                Arg::I32(4),
                Arg::I32(4),
            ],
        )
        .err()
        .context("a 4-byte argument for an 8-byte parameter went unnoticed")?;
    ensure!(e.to_string().contains("parameter 2 is 8 bytes, given 4"), "{e}");
    Ok(())
}
