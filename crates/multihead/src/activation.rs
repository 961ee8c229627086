//! Activations and dropout for the Transformer layers, with PyTorch's exact gradients.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::random::{next_dropout_key, DropoutKey};

/// The feed-forward activation of the Transformer layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// `F.relu` (PyTorch's default). The gradient at exactly 0 is 0, as in PyTorch.
    #[default]
    Relu,
    /// `F.gelu`, the exact erf form: `x · Φ(x)`.
    Gelu,
    /// `nn.GELU(approximate="tanh")`.
    GeluTanh,
}

impl Activation {
    /// Parses PyTorch's activation strings (`"relu"`, `"gelu"`); anything else is the error
    /// PyTorch raises.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "relu" => Ok(Self::Relu),
            "gelu" => Ok(Self::Gelu),
            "gelu_tanh" => Ok(Self::GeluTanh),
            other => Err(Error::Config {
                op: "TransformerEncoderLayer",
                arg: "activation",
                msg: format!("activation should be relu/gelu, not {other}"),
            }),
        }
    }

    /// Applies the activation element-wise.
    ///
    /// # Shapes
    /// * x: any shape; output alike.
    ///
    /// # Example
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use multihead::Activation;
    ///
    /// let x = Tensor::new(&[-1.0f32, 0.0, 2.0], &Device::Cpu)?;
    /// assert_eq!(Activation::Relu.forward(&x)?.to_vec1::<f32>()?, [0.0, 0.0, 2.0]);
    /// let g = Activation::Gelu.forward(&x)?.to_vec1::<f32>()?; // x·Φ(x)
    /// assert!((g[0] + 0.158_655_25).abs() < 1e-6 && (g[2] - 1.954_499_7).abs() < 1e-6);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.functional.relu / torch.nn.functional.gelu.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::alloc::expect_float("activation", "input", x.dtype())?;
        // Both paths hold a few input-sized tensors (a broadcast view costs its full size).
        crate::alloc::ensure("activation", "input", x.dims(), x.dtype(), 3, "use a smaller input")?;
        if crate::precision::is_reduced(x.dtype()) && *self != Self::Relu {
            // bf16/f16: the GELU of the f32 value, rounded once.
            let y = self.forward(&crate::precision::widen(x)?)?;
            return crate::precision::narrow(&y, x.dtype());
        }
        Ok(match self {
            // One fused pass on f32 CPU tensors, its gradient selected by the output like
            // PyTorch's threshold_backward.
            Self::Relu if fused_activation("relu", x)? => crate::fused::activation::relu(x)?,
            // where(x <= 0, 0, x): NaN kept, -inf gives 0 (a product with a mask would give
            // NaN), and the gradient is selected (0 where x <= 0, even for an infinite grad).
            Self::Relu => x.le(0f64)?.where_cond(&x.zeros_like()?, x)?,
            // One fused pass on f32 CPU tensors (the erf approximation PyTorch's vectorised
            // kernel uses); composed elsewhere, with candle's exact erf and its gradient.
            Self::Gelu if fused_activation("gelu", x)? => crate::fused::activation::gelu(x)?,
            // 0.5 x (1 + erf(x / sqrt 2)), composed so that candle's exact erf gradient is used.
            Self::Gelu => {
                let cdf = ((x / std::f64::consts::SQRT_2)?.erf()? + 1.0)?;
                (x.mul(&cdf)? * 0.5)?
            }
            Self::GeluTanh => {
                let inner =
                    ((x + (x.powf(3.0)? * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
                (x.mul(&(inner.tanh()? + 1.0)?)? * 0.5)?
            }
        })
    }
}

/// Whether an activation runs as its fused op on `x`.
fn fused_activation(op: &'static str, x: &Tensor) -> Result<bool> {
    let plan = crate::fused::dispatch::decide(
        op,
        crate::mode::Backend::Auto,
        crate::fused::dispatch::dtype_device_blocker(x),
    )?;
    Ok(plan.path == crate::fused::dispatch::Path::Fused && x.elem_count() > 0)
}

/// Dropout on any tensor (`F.dropout(x, p, training)`): in training, zeroes each element with
/// probability `p` and scales the rest by `1/(1-p)`; the identity otherwise. Draws the next
/// key from the global generator ([`manual_seed`](crate::manual_seed)).
///
/// # Shapes
/// * x: any shape; output alike.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
///
/// multihead::manual_seed(7);
/// let x = Tensor::ones(1000, candle_core::DType::F32, &Device::Cpu)?;
/// let y = multihead::activation::dropout(&x, 0.25, true)?.to_vec1::<f32>()?;
/// // Each element is dropped (0) or kept and scaled by 1 / (1 - p).
/// assert!(y.iter().all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
/// let kept = y.iter().filter(|&&v| v != 0.0).count();
/// assert!((650..850).contains(&kept), "{kept}");
/// # Ok::<(), multihead::Error>(())
/// ```
// Mirrors torch.nn.functional.dropout.
pub fn dropout(x: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::Config {
            op: "dropout",
            arg: "p",
            msg: format!("dropout probability has to be in [0, 1), got {p}"),
        });
    }
    if !training || p == 0.0 {
        return Ok(x.clone());
    }
    dropout_with_key(x, p, next_dropout_key())
}

/// [`dropout`] with an explicit key; element `i` of the flattened tensor uses counter `(0, 0, i)`.
///
/// # Shapes
/// * x: any shape; output alike.
pub fn dropout_with_key(x: &Tensor, p: f64, key: DropoutKey) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::Config {
            op: "dropout",
            arg: "p",
            msg: format!("dropout probability has to be in [0, 1), got {p}"),
        });
    }
    crate::alloc::ensure("dropout", "input", x.dims(), DType::F64, 1, "use a smaller input")?;
    let n = x.elem_count();
    let mut data = crate::alloc::try_zeros::<f64>(n, "dropout mask")?;
    multihead_kernels::dropout::fill_scale_mask(key, p, 1, 1, n, &mut data)
        .map_err(|e| Error::Config { op: "dropout", arg: "p", msg: e.to_string() })?;
    let mask = Tensor::from_vec(data, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok(x.mul(&mask)?)
}
