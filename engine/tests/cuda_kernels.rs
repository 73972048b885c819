//! Every kernel in `kernels/` compiles clean (no error, no warning) with NVRTC for the
//! architectures we deploy on, sm_80 and sm_90, on any machine: NVRTC needs no GPU. CI installs
//! NVRTC from PyPI and sets SLUICE_REQUIRE_NVRTC=1, so a missing NVRTC fails there.
#![cfg(feature = "cuda")]

mod kernel_checks;

use anyhow::{Context, bail, ensure};
use sluice_engine::cuda::{
    CI_ARCHS, KERNELS, attention_options, compile_all, compile_with, gemv_options, kernel_names,
    nvrtc_available, nvrtc_version, resources,
};

/// Whether NVRTC can be loaded; an error when CI requires it (SLUICE_REQUIRE_NVRTC=1) and it
/// cannot.
fn nvrtc_here() -> anyhow::Result<bool> {
    if nvrtc_available() {
        return Ok(true);
    }
    if std::env::var("SLUICE_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
        bail!("SLUICE_REQUIRE_NVRTC=1 but libnvrtc could not be loaded (LD_LIBRARY_PATH?)");
    }
    eprintln!("NVRTC not found: kernels not compiled here");
    Ok(false)
}

#[test]
fn every_kernel_compiles_clean_for_sm80_and_sm90() -> anyhow::Result<()> {
    if !nvrtc_here()? {
        return Ok(());
    }
    let (major, minor) = nvrtc_version()?;
    ensure!(major >= 12, "NVRTC {major}.{minor}: CUDA 12 or newer is needed");
    for arch in CI_ARCHS {
        let modules = compile_all(arch)?;
        ensure!(modules.len() == KERNELS.len());
        for (m, (_, src)) in modules.iter().zip(KERNELS) {
            // Every kernel the source declares is an entry of the PTX.
            for name in kernel_names(src) {
                ensure!(
                    m.ptx.contains(&format!(".entry {name}(")),
                    "{arch}: {name} missing from the PTX of {}",
                    m.module
                );
            }
            ensure!(m.ptx.contains(&format!(".target {arch}")), "{arch}: {}", m.module);
        }
    }
    Ok(())
}

/// The other shapes of the matrix-vector and decode attention kernels the device bench
/// compiles and times (kernel_checks::BenchShape::ISSUE) compile clean too: a warning there
/// would end the bench on the device, whose time is short.
#[test]
fn every_shape_the_bench_compares_compiles_clean() -> anyhow::Result<()> {
    if !nvrtc_here()? {
        return Ok(());
    }
    let shape = kernel_checks::BenchShape::ISSUE;
    let builds = shape
        .gemv_shapes
        .iter()
        .map(|&s| ("gemv", gemv_options(s)))
        .chain(shape.attention_shapes.iter().map(|&s| ("attention", attention_options(s))));
    for (module, options) in builds {
        let options = options?;
        let src = KERNELS.iter().find(|(m, _)| *m == module).map(|(_, s)| *s);
        let src = src.with_context(|| format!("no module {module}"))?;
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        for arch in CI_ARCHS {
            compile_with(module, src, arch, &options)
                .with_context(|| format!("{module} with {options:?} for {arch}"))?;
        }
    }
    Ok(())
}

/// Every kernel compiled to machine code for sm_80 and sm_90 (ptxas, through NVRTC, no GPU
/// needed) spills no registers to local memory and fits the static shared-memory limit: a
/// spill in an attention kernel costs more than anything else in it.
#[test]
fn no_kernel_spills_registers() -> anyhow::Result<()> {
    if !nvrtc_here()? {
        return Ok(());
    }
    for arch in CI_ARCHS {
        for (module, src) in KERNELS {
            let report = resources(module, src, arch)?;
            for name in kernel_names(src) {
                let k = report
                    .iter()
                    .find(|k| k.kernel == name)
                    .with_context(|| format!("{arch}: ptxas reported nothing for {name}"))?;
                eprintln!(
                    "{arch} {name}: {} registers, {} bytes shared, {} bytes spilled",
                    k.registers, k.shared_bytes, k.spill_stores
                );
                ensure!(k.registers > 0, "{arch} {name}: no register count in the report");
                ensure!(k.spill_stores == 0, "{arch} {name} spills {} bytes", k.spill_stores);
                ensure!(
                    k.shared_bytes <= 48 * 1024,
                    "{arch} {name}: {} bytes shared",
                    k.shared_bytes
                );
                // A block's registers come from one SM's 64K: the runner launches the token
                // choosers with 1024 threads, the rest with at most 256.
                let threads = if name.ends_with("_rows") { 1024 } else { 256 };
                ensure!(
                    k.registers * threads <= 65_536,
                    "{arch} {name}: {} registers x {threads} threads do not fit an SM",
                    k.registers
                );
            }
        }
    }
    Ok(())
}
