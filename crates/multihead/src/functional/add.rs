//! `a + b` for residual connections.

use candle_core::Tensor;

use crate::error::{fmt_shape, Error, Result};

/// `a + b` of two tensors of one shape (a residual connection, `x + self.attn(...)`), as candle's
/// `a + b` computes it, bit for bit, with its backward. Contiguous f32 CPU tensors are added on
/// rayon's threads (or the calling one, when small), like this crate's other ops; candle's own
/// add runs on candle's thread pool, whose worker keeps spinning for a while after each call
/// and slows the next op on a machine with few cores (a hand-written pre-norm ViT block at
/// batch 64, sequence 17, width 64 on 2 cores: see docs/performance.md). Other dtypes and
/// devices take candle's add.
///
/// # Shapes
/// * `a`, `b`: any shape, the same for both (no broadcasting: use candle's `broadcast_add`)
/// * output: that shape
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
///
/// let x = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu)?;
/// let y = Tensor::new(&[[0.5f32, 0.5], [0.5, 0.5]], &Device::Cpu)?;
/// let sum = multihead::functional::add(&x, &y)?;
/// assert_eq!(sum.to_vec2::<f32>()?, [[1.5, 2.5], [3.5, 4.5]]);
/// # Ok::<(), multihead::Error>(())
/// ```
// Mirrors torch.add(a, b) (the `a + b` of a residual connection).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() {
        return Err(Error::Shape {
            op: "add",
            arg: "b",
            msg: format!(
                "a has shape {} and b {}: they must be the same (use broadcast_add to broadcast)",
                fmt_shape(a.dims()),
                fmt_shape(b.dims())
            ),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DType {
            op: "add",
            arg: "b",
            msg: format!("a is {:?} and b {:?}: they must be the same", a.dtype(), b.dtype()),
        });
    }
    // A broadcast view can stand for more elements than memory holds: an error, not an abort.
    crate::alloc::ensure("add", "output", a.dims(), a.dtype(), 1, "use smaller tensors")?;
    crate::fused::zeros::residual(a, b)
}
