//! CPU compute: the thread pool and the matrix-product kernels.

pub mod matmul;
pub mod pool;
#[cfg(target_arch = "x86_64")]
mod x86;
