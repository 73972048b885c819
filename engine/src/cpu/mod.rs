//! CPU compute: the thread pool, the packed layout and the matrix-product kernels.

pub mod adapter;
pub(crate) mod attention;
mod layout;
pub mod matmul;
pub mod pool;
pub(crate) mod vmath;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;
