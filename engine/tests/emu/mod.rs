//! Builds the CPU emulation of CUDA (`cuda_emu.h`) with our kernels into shared libraries: the
//! kernels alone (tests/kernel_emu.rs), or with an emulated driver and cuBLAS that cudarc
//! loads in place of NVIDIA's (tests/cuda_emulated.rs).

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use sluice_engine::cuda::{KERNELS, PRELUDE, kernel_names};

/// This folder (the headers and C++ sources of the emulation).
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emu")
}

/// `src` with `EMU_POISON(name);` after each one-line `__shared__` declaration: the emulation
/// fills the variable with 0xFF bytes (NaN as a float, -1 as an int) when the block's first
/// thread reaches it, so a read of shared memory no thread of the block wrote shows.
fn poison_shared(src: &str) -> anyhow::Result<String> {
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        out.push_str(line);
        if line.contains("__shared__") {
            let decl = line.trim_end();
            ensure!(decl.ends_with(';'), "a __shared__ declaration on one line: {line}");
            let head = decl.trim_end_matches(';');
            let head = head.split('[').next().unwrap_or(head);
            let name = head.split_whitespace().last().unwrap_or_default();
            ensure!(
                !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_'),
                "no variable name in: {line}"
            );
            out.push_str(&format!(" EMU_POISON({name});"));
        }
        out.push('\n');
    }
    Ok(out)
}

/// C++ source of every kernel over the emulation: the prelude and each module as NVRTC gets
/// them (line for line; shared variables poisoned per block), then `kEntries` (every kernel by
/// name) and `emu_launch(name, grid, block, args, sizes, nargs, err, errlen)`.
pub fn kernels_source() -> anyhow::Result<String> {
    let header = dir().join("cuda_emu.h");
    let mut cpp = format!("#include \"{}\"\n{}\n", header.display(), poison_shared(PRELUDE)?);
    let mut entries = Vec::new();
    for (module, src) in KERNELS {
        cpp.push_str(&format!("#line 1 \"{module}.cu\"\n{}\n", poison_shared(src)?));
        entries.extend(kernel_names(src).into_iter().map(|k| format!("EMU_KERNEL({k})")));
    }
    ensure!(entries.len() >= 15, "only {} kernels found", entries.len());
    cpp.push_str(&format!(
        "static const emu::Entry kEntries[] = {{{}}};\n\
         extern \"C\" int emu_launch(const char* name, const unsigned* grid, \
         const unsigned* block, void** args, const unsigned* sizes, unsigned nargs, char* err, \
         size_t errlen) {{\n\
         return emu::launch(kEntries, sizeof kEntries / sizeof *kEntries, name, grid, block, \
         args, sizes, nargs, err, errlen);\n}}\n",
        entries.join(", ")
    ));
    Ok(cpp)
}

/// Compiles C++ `source` into shared library `out` (with `soname` when given), linking
/// `libs` (paths of other shared libraries); the C++ compiler is `$CXX` or `c++`.
pub fn shared_library(
    source: &str,
    out: &Path,
    soname: Option<&str>,
    libs: &[&Path],
) -> anyhow::Result<()> {
    let src = out.with_extension("cpp");
    std::fs::write(&src, source)?;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut cmd = std::process::Command::new(&cxx);
    cmd.args(["-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Wno-unknown-pragmas"])
        // The kernels read bf16 pairs through 32-bit pointers, as CUDA code does.
        .arg("-fno-strict-aliasing")
        .arg("-o")
        .arg(out)
        .arg(&src);
    if let Some(name) = soname {
        cmd.arg(format!("-Wl,-soname,{name}"));
    }
    cmd.args(libs);
    let done = cmd
        .output()
        .with_context(|| format!("running the C++ compiler `{cxx}` (install g++, or set CXX)"))?;
    if !done.status.success() {
        bail!("{cxx} failed on {}:\n{}", src.display(), String::from_utf8_lossy(&done.stderr));
    }
    Ok(())
}
