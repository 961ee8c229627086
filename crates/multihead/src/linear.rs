//! `torch.nn.Linear` with PyTorch's weight layout `[out_features, in_features]`.

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::error::{fmt_shape, Error, Result};
use crate::state_dict::NamedParameters;

/// A linear layer `y = x Wᵀ + b`, stored as PyTorch stores it (`weight` is `[out, in]`), so a
/// PyTorch state_dict loads unchanged.
///
/// # Shapes
/// * input `(*, in_features)`
/// * output `(*, out_features)`
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::Linear;
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let lin = Linear::new(4, 3, true, vb)?;
/// let y = lin.forward(&Tensor::zeros((2, 5, 4), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), &[2, 5, 3]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Builds a layer under the keys `weight` and `bias` of `vb`. Fresh parameters follow
    /// PyTorch's `nn.Linear` initialisation: weight and bias uniform in `±1/√in_features`.
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let bound = if in_features > 0 { 1.0 / (in_features as f64).sqrt() } else { 0.0 };
        let init = Init::Uniform { lo: -bound, up: bound };
        let weight =
            crate::state_dict::get_param(&vb, &[out_features, in_features], "weight", init)?;
        let bias = if bias {
            Some(crate::state_dict::get_param(&vb, &[out_features], "bias", init)?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    /// Wraps existing tensors: `weight` is `[out, in]`, `bias` is `[out]`.
    pub fn from_weights(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// The weight, `[out_features, in_features]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out_features]`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Applies the layer.
    // Mirrors torch.nn.Linear.forward.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.weight, self.bias.as_ref(), "linear", "input")
    }
}

impl NamedParameters for Linear {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }
}

impl candle_core::Module for Linear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Linear::forward(self, xs).map_err(candle_core::Error::wrap)
    }
}

/// `F.linear(x, weight, bias)` over any leading dimensions.
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    op: &'static str,
    arg: &'static str,
) -> Result<Tensor> {
    let (out_f, in_f) = weight.dims2()?;
    let dims = x.dims();
    let Some((&last, lead)) = dims.split_last() else {
        return Err(Error::Shape {
            op,
            arg,
            msg: "expected at least a 1-D input, got a 0-D tensor".into(),
        });
    };
    if last != in_f {
        return Err(Error::Shape {
            op,
            arg,
            msg: format!(
                "input of shape {} cannot be multiplied by a weight of shape {} (expected {in_f} input features, got {last})",
                fmt_shape(dims),
                fmt_shape(weight.dims())
            ),
        });
    }
    if x.dtype() != weight.dtype() {
        return Err(Error::DType {
            op,
            arg,
            msg: format!(
                "input dtype {:?} does not match the weight dtype {:?}",
                x.dtype(),
                weight.dtype()
            ),
        });
    }
    let m: usize = lead.iter().product();
    let mut out_dims = lead.to_vec();
    out_dims.push(out_f);
    if m == 0 || in_f == 0 {
        // gemm has nothing to multiply; the product is zero (plus the bias).
        let zeros = Tensor::zeros(out_dims.as_slice(), x.dtype(), x.device())?;
        return Ok(match bias {
            Some(b) if m > 0 => zeros.broadcast_add(b)?,
            _ => zeros,
        });
    }
    let x2 = x.reshape((m, in_f))?;
    let mut y = x2.matmul(&weight.t()?)?;
    if let Some(b) = bias {
        y = y.broadcast_add(b)?;
    }
    Ok(y.reshape(out_dims)?)
}
