//! The CUDA backend's foundation (issue 7): our kernels (`kernels/*.cu`, CUDA C compiled at
//! run time by NVRTC for the device's compute capability) and the probing of driver and
//! device. cudarc loads libcuda and libnvrtc dynamically, so building needs no CUDA; without
//! them these functions return [`CudaError::NoDriver`] / [`CudaError::NoNvrtc`] (they never
//! reach cudarc's own loader, which panics on a missing library).

use std::ffi::CString;

mod runner;

pub use runner::{
    CudaKvCache, CudaModel, CudaRunner, PendingPicks, attention_options, gemv_options,
};

/// Declarations every kernel source starts with (bf16 and f16 bit-pattern conversions,
/// reductions); NVRTC then needs no CUDA headers.
pub const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");

/// Kernel sources by module name.
pub const KERNELS: &[(&str, &str)] = &[
    ("elementwise", include_str!("../../../kernels/elementwise.cu")),
    ("dequant", include_str!("../../../kernels/dequant.cu")),
    ("attention", include_str!("../../../kernels/attention.cu")),
    ("sampling", include_str!("../../../kernels/sampling.cu")),
    ("gemv", include_str!("../../../kernels/gemv.cu")),
    ("lora", include_str!("../../../kernels/lora.cu")),
];

/// The names of the kernels `src` declares (`extern "C" __global__ [__launch_bounds__(..)] void
/// NAME(`), in order.
pub fn kernel_names(src: &str) -> Vec<&str> {
    src.split("extern \"C\" __global__ ")
        .skip(1)
        .filter_map(|d| {
            // An optional `__launch_bounds__(...)` before the return type.
            let d = match d.strip_prefix("__launch_bounds__(") {
                Some(rest) => rest.split_once(')')?.1.trim_start(),
                None => d,
            };
            d.strip_prefix("void ")?.split('(').next()
        })
        .map(str::trim)
        .collect()
}

/// The architectures CI compiles every kernel for (A100, H100/H200).
pub const CI_ARCHS: &[&str] = &["sm_80", "sm_90"];

/// What can go wrong before a kernel runs.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libnvrtc could not be loaded.
    #[error(
        "NVRTC (libnvrtc.so.12) was not found: install the CUDA toolkit or the PyPI package \
         nvidia-cuda-nvrtc-cu12 and put its lib directory on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// libcuda could not be loaded.
    #[error(
        "no NVIDIA driver found (libcuda.so could not be loaded): run on a machine with an \
         NVIDIA GPU and driver, or use the CPU backend"
    )]
    NoDriver,
    /// The driver is there but has no usable device.
    #[error("CUDA device {ordinal}: {message}")]
    Device {
        /// Device ordinal asked for.
        ordinal: usize,
        /// The driver's error.
        message: String,
    },
    /// A launch, copy or cuBLAS call failed on the device.
    #[error("CUDA: {0}")]
    Run(String),
    /// The batch asked for something the model or cache cannot hold.
    #[error("{0}")]
    Invalid(String),
    /// A kernel failed to compile, or compiled with warnings.
    #[error("kernel {module} for {arch}: {log}")]
    Compile {
        /// Kernel module (file) name.
        module: String,
        /// Target architecture.
        arch: String,
        /// NVRTC's log.
        log: String,
    },
}

/// One compiled kernel module.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// Module name (`kernels/<name>.cu`).
    pub module: &'static str,
    /// Target architecture (`sm_90`).
    pub arch: String,
    /// The PTX.
    pub ptx: String,
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library; nothing is called through it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether libcuda (the driver) can be loaded.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library; nothing is called through it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; both pointers are valid for the call.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    Ok((major, minor))
}

/// Compiles one kernel module for `arch` (`sm_80`, `sm_90`, ...) to PTX. Any warning in
/// NVRTC's log is an error: kernels must compile clean.
pub fn compile(module: &'static str, source: &str, arch: &str) -> Result<Compiled, CudaError> {
    compile_with(module, source, arch, &[])
}

/// [`compile`] with more NVRTC options (`-DNAME=VALUE`: a kernel's tunable constants).
pub fn compile_with(
    module: &'static str,
    source: &str,
    arch: &str,
    options: &[&str],
) -> Result<Compiled, CudaError> {
    let virtual_arch = arch.replace("sm_", "compute_");
    let arch_option = format!("--gpu-architecture={virtual_arch}");
    let all: Vec<&str> =
        std::iter::once(arch_option.as_str()).chain(options.iter().copied()).collect();
    let (log, ptx) = nvrtc(module, source, arch, &all)?;
    if log.to_ascii_lowercase().contains("warning") {
        return Err(CudaError::Compile { module: module.to_owned(), arch: arch.to_owned(), log });
    }
    let ptx = ptx.ok_or_else(|| CudaError::Compile {
        module: module.to_owned(),
        arch: arch.to_owned(),
        log: "NVRTC returned no PTX".into(),
    })?;
    Ok(Compiled { module, arch: arch.to_owned(), ptx })
}

/// What ptxas reports for one kernel compiled for a real architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// Kernel (entry function) name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_stores: u32,
    /// Static shared memory, bytes.
    pub shared_bytes: u32,
}

/// Compiles one module to machine code for `arch` (no GPU needed) and returns ptxas's report per
/// kernel: registers, spills and shared memory (a kernel that spills, or needs so many
/// registers that few blocks fit, shows here before it runs anywhere).
pub fn resources(
    module: &'static str,
    source: &str,
    arch: &str,
) -> Result<Vec<KernelResources>, CudaError> {
    let (log, _) =
        nvrtc(module, source, arch, &[&format!("--gpu-architecture={arch}"), "-Xptxas=-v"])?;
    let number = |line: &str, before: &str| -> u32 {
        line.split(before)
            .next()
            .and_then(|head| head.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or_default().to_owned();
            out.push(KernelResources { kernel, registers: 0, spill_stores: 0, shared_bytes: 0 });
        } else if let Some(k) = out.last_mut() {
            if line.contains("spill stores") {
                k.spill_stores = number(line, " bytes spill stores");
            } else if line.contains("registers") {
                k.registers = number(line, " registers");
                if line.contains("bytes smem") {
                    k.shared_bytes = number(line, " bytes smem");
                }
            }
        }
    }
    Ok(out)
}

/// Runs NVRTC on the prelude and `source` with the common options and `arch_options`; returns
/// its log, and the PTX when it made some (a virtual architecture).
fn nvrtc(
    module: &'static str,
    source: &str,
    arch: &str,
    arch_options: &[&str],
) -> Result<(String, Option<String>), CudaError> {
    use cudarc::nvrtc::result;
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let fail =
        |log: String| CudaError::Compile { module: module.to_owned(), arch: arch.to_owned(), log };
    let text = CString::new(format!("{PRELUDE}\n#line 1 \"{module}.cu\"\n{source}"))
        .map_err(|_| fail("the source holds a NUL byte".into()))?;
    let name = CString::new(format!("{module}.cu")).map_err(|_| fail("bad name".into()))?;
    let prog = result::create_program(&text, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let mut options: Vec<String> = arch_options.iter().map(|o| (*o).to_owned()).collect();
    options
        .extend(["--std=c++17", "--fmad=true", "--extra-device-vectorization"].map(str::to_owned));
    // SAFETY: `prog` is a live program; the options outlive the call.
    let compiled = unsafe { result::compile_program(prog, &options) };
    // SAFETY: `prog` is live; the log is copied out before the program is destroyed.
    let log = unsafe { result::get_program_log(prog) }
        .map(|raw| {
            let bytes: Vec<u8> = raw.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
            String::from_utf8_lossy(&bytes).trim().to_owned()
        })
        .unwrap_or_default();
    let ptx = match compiled {
        Ok(()) if !arch_options.iter().any(|o| o.starts_with("--gpu-architecture=sm_")) => {
            // SAFETY: compilation succeeded; `prog` is live.
            unsafe { result::get_ptx(prog) }
                .map(|raw| {
                    let bytes: Vec<u8> =
                        raw.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
                    Some(String::from_utf8_lossy(&bytes).into_owned())
                })
                .map_err(|e| format!("{e:?}"))
        }
        Ok(()) => Ok(None),
        Err(e) => Err(if log.is_empty() { format!("{e:?}") } else { log.clone() }),
    };
    // SAFETY: `prog` is destroyed once, after its last use.
    let _ = unsafe { result::destroy_program(prog) };
    Ok((log, ptx.map_err(fail)?))
}

/// Every kernel module compiled for `arch`.
pub fn compile_all(arch: &str) -> Result<Vec<Compiled>, CudaError> {
    KERNELS.iter().map(|(m, src)| compile(m, src, arch)).collect()
}

/// What the driver says about one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Devices the driver sees.
    pub count: i32,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
}

impl DeviceInfo {
    /// The NVRTC architecture for this device (`sm_90` for 9.0).
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// Opens device `ordinal` and reads its compute capability.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    if !driver_available() {
        return Err(CudaError::NoDriver);
    }
    let device =
        |e: cudarc::driver::DriverError| CudaError::Device { ordinal, message: e.to_string() };
    let count = cudarc::driver::CudaContext::device_count().map_err(device)?;
    if usize::try_from(count).unwrap_or(0) <= ordinal {
        return Err(CudaError::Device {
            ordinal,
            message: format!("the driver sees {count} device(s)"),
        });
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(device)?;
    let compute_capability = ctx.compute_capability().map_err(device)?;
    Ok(DeviceInfo { ordinal, count, compute_capability })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_gets_the_prelude_and_names_its_kernels() {
        for (name, src) in KERNELS {
            assert!(src.contains("extern \"C\" __global__"), "{name} defines no kernel");
        }
        assert!(PRELUDE.contains("f32_to_bf16") && PRELUDE.contains("block_sum"));
    }

    #[test]
    fn missing_libraries_are_errors_not_panics() -> Result<(), String> {
        match probe(0) {
            Err(CudaError::NoDriver) => assert!(!driver_available()),
            Ok(info) => assert!(driver_available() && info.count >= 1),
            Err(CudaError::Device { .. }) => assert!(driver_available()),
            Err(other) => return Err(format!("unexpected: {other}")),
        }
        if !nvrtc_available() {
            assert!(matches!(compile("x", "", "sm_90"), Err(CudaError::NoNvrtc)));
        }
        Ok(())
    }
}
