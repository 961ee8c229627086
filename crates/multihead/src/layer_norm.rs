//! `torch.nn.LayerNorm` over the last dimension, composed from candle primitives so that its
//! gradients reach the input, the weight and the bias (candle 0.11's `LayerNorm` module drops
//! them on contiguous input).

use candle_core::{DType, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::error::{Error, Result};
use crate::state_dict::{get_param, NamedParameters};

/// Layer normalisation over the last dimension with a learned elementwise affine transform:
/// `y = (x - mean) / sqrt(var + eps) * weight + bias` (biased variance, as PyTorch).
///
/// Keys: `weight` `(d,)` (initialised to 1) and `bias` `(d,)` (initialised to 0, absent when
/// `bias = false`).
///
/// The input's dtype is the parameters', or bf16/f16 with f32 parameters (PyTorch's CPU
/// "mixed type": computed in f32, the output in the input's dtype).
///
/// # Shapes
/// * input `(*, d)`, output `(*, d)`.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::LayerNorm;
///
/// let vm = VarMap::new();
/// let ln = LayerNorm::new(4, 1e-5, true, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
/// let y = ln.forward(&Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu)?)?;
/// let mean = y.mean_all()?.to_scalar::<f32>()?;
/// assert!(mean.abs() < 1e-6);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    eps: f64,
}

impl LayerNorm {
    /// `nn.LayerNorm(d, eps, bias=bias)` under `vb`'s `weight` and `bias` keys.
    pub fn new(d: usize, eps: f64, bias: bool, vb: VarBuilder) -> Result<Self> {
        check_eps(eps, "LayerNorm", "eps")?;
        crate::alloc::expect_float("LayerNorm", "dtype", vb.dtype())?;
        let weight = get_param(&vb, &[d], "weight", Init::Const(1.0))?;
        let bias = if bias { Some(get_param(&vb, &[d], "bias", Init::Const(0.0))?) } else { None };
        Ok(Self { weight, bias, eps })
    }

    /// `eps`.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// The scale, `(d,)` (PyTorch's `norm.weight`).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift, `(d,)`, when built with one (PyTorch's `norm.bias`).
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Normalises over the last dimension.
    // Mirrors torch.nn.LayerNorm.forward (torch.nn.functional.layer_norm).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mixed = self.check_dtype(x)?;
        self.check_last_dim(x)?;
        // The composed form holds about four input-sized tensors.
        crate::alloc::ensure("layer_norm", "input", x.dims(), x.dtype(), 4, "use a smaller input")?;
        if mixed {
            // The f32 norm of the widened input, rounded once: PyTorch's numbers to one bf16
            // ulp (its weight and bias gradients are summed in bf16 on that path; these are
            // f32 sums, closer to the exact ones: docs/pytorch-behaviour.md).
            return self.forward_as(x, None, x.dtype());
        }
        let (w, b) = (&self.weight, self.bias.as_ref());
        if crate::precision::is_reduced(x.dtype()) {
            // bf16/f16: statistics and normalisation in f32, rounded once.
            use crate::precision::{widen, widen_opt};
            let y = self.run(&widen(x)?, &widen(w)?, widen_opt(b)?.as_ref())?;
            return crate::precision::narrow(&y, x.dtype());
        }
        self.run(x, w, b)
    }

    /// Checks the input's dtype against the parameters'; returns whether it is PyTorch's CPU
    /// "mixed type" (a bf16/f16 input with f32 parameters: statistics and affine in f32, the
    /// output in the input's dtype), which `layer_norm` takes.
    fn check_dtype(&self, x: &Tensor) -> Result<bool> {
        crate::alloc::expect_float("layer_norm", "input", x.dtype())?;
        let mixed = crate::precision::is_reduced(x.dtype()) && self.weight.dtype() == DType::F32;
        if x.dtype() != self.weight.dtype() && !mixed {
            return Err(Error::DType {
                op: "layer_norm",
                arg: "input",
                msg: format!(
                    "input dtype {:?} does not match the weight dtype {:?}; convert the input to \
                     the weight's dtype (a bf16 or f16 input with f32 parameters is taken, as \
                     PyTorch takes it)",
                    x.dtype(),
                    self.weight.dtype()
                ),
            });
        }
        Ok(mixed)
    }

    /// `norm(x + residual)`: a Transformer layer's residual connection and post-norm. On the
    /// fused path the sum and the norm are one op (one pass, and no gradient tensor for the
    /// sum); otherwise, and for bf16/f16, it is `forward(&(x + residual)?)`. The numbers are
    /// the same either way.
    ///
    /// # Shapes
    /// * `x` and `residual` `(*, d)`, of one shape; output `(*, d)`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::LayerNorm;
    ///
    /// let vm = VarMap::new();
    /// let dev = Device::Cpu;
    /// let ln = LayerNorm::new(4, 1e-5, true, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
    /// let x = Tensor::new(&[[1f32, 2., 3., 4.]], &dev)?;
    /// let r = Tensor::new(&[[0.5f32, -1., 0., 2.]], &dev)?;
    /// let y = ln.forward_residual(&x, &r)?;
    /// let want = ln.forward(&(&x + &r)?)?;
    /// assert_eq!(y.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.LayerNorm.forward applied to `x + residual`.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        if x.dims() != residual.dims() {
            return Err(Error::Shape {
                op: "layer_norm",
                arg: "residual",
                msg: format!(
                    "the residual must have the input's shape {:?}, got {:?}; broadcast it to the \
                     input's shape first",
                    x.dims(),
                    residual.dims()
                ),
            });
        }
        if x.dtype() != residual.dtype() {
            return Err(Error::DType {
                op: "layer_norm",
                arg: "residual",
                msg: format!(
                    "residual dtype {:?} does not match the input dtype {:?}",
                    residual.dtype(),
                    x.dtype()
                ),
            });
        }
        // `forward`'s checks on the sum, before a path is chosen (and before the composed path
        // makes the sum): its dtype and shape, and that it and the norm's temporaries fit in
        // memory.
        self.check_dtype(x)?;
        self.check_last_dim(x)?;
        crate::alloc::ensure("layer_norm", "input", x.dims(), x.dtype(), 5, "use a smaller input")?;
        // A bf16/f16 sum goes to `forward`, which widens it and makes its own choice of path
        // (so a forced `Backend::Fused` takes it here as it takes `forward(&(x + residual))`).
        let reduced = crate::precision::is_reduced(x.dtype());
        let plan = match reduced {
            true => None,
            false => Some(crate::fused::dispatch::decide(
                "layer_norm",
                crate::mode::Backend::Auto,
                crate::fused::dispatch::dtype_device_blocker(x)
                    .or_else(|| crate::fused::dispatch::dtype_device_blocker(residual)),
            )?),
        };
        if x.elem_count() == 0 {
            // Kept in the graph: candle's ops on empty tensors drop gradients (its sum of two
            // empty tensors is the first one, which would leave the residual out).
            let mut inputs = vec![x, residual, &self.weight];
            inputs.extend(self.bias.as_ref());
            return crate::fused::zeros::zeros_of(x.dims(), x.dtype(), &inputs);
        }
        let fused = plan.is_some_and(|p| p.path == crate::fused::dispatch::Path::Fused)
            && x.dtype() == self.weight.dtype();
        if !fused {
            return self.forward(&(x + residual)?);
        }
        let (x, r) = (crate::mode::graph_input(x), crate::mode::graph_input(residual));
        let weight = crate::mode::graph_input(&self.weight);
        let bias = self.bias.as_ref().map(crate::mode::graph_input);
        crate::fused::norm::add_layer_norm(&x, &r, &weight, bias.as_ref(), self.eps)
    }

    /// A bf16 layer's norm in its f32 twin's arithmetic: [`forward`](Self::forward) (or
    /// [`forward_residual`](Self::forward_residual) with `residual`) of `x` widened to f32,
    /// the result converted to `out`; in one pass where
    /// [`forward_mixed`](Self::forward_mixed) applies, with the same bits.
    // Mirrors torch.nn.LayerNorm.forward (applied to `x + residual`).
    pub(crate) fn forward_as(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        out: DType,
    ) -> Result<Tensor> {
        if let Some(y) = self.forward_mixed(x, residual, out)? {
            return Ok(y);
        }
        let x = crate::precision::widen(x)?;
        let y = match residual {
            Some(r) => self.forward_residual(&x, r)?,
            None => self.forward(&x)?,
        };
        crate::precision::narrow(&y, out)
    }

    /// [`forward`](Self::forward) (or [`forward_residual`](Self::forward_residual) with an f32
    /// `residual`) of a bf16 (or f32) `x` with f32 parameters, the result in `out` (f32 or
    /// bf16): the bits of widening `x`, the f32 norm and rounding the result, in one pass
    /// without the widened input or the f32 output in memory (a bf16 layer's norms in
    /// inference). `None` where that pass does not apply (a gradient recorded, another dtype
    /// or device, shapes that the f32 norm would reject, an empty input, a composed backend):
    /// the caller takes the widened way, whose checks report what is wrong.
    // Mirrors torch.nn.LayerNorm.forward (applied to `x + residual`).
    fn forward_mixed(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        out: DType,
    ) -> Result<Option<Tensor>> {
        let residual_fits =
            |r: &Tensor| r.device().is_cpu() && r.dtype() == DType::F32 && r.dims() == x.dims();
        let applies = x.device().is_cpu()
            && matches!(x.dtype(), DType::F32 | DType::BF16)
            && matches!(out, DType::F32 | DType::BF16)
            && residual.is_none_or(residual_fits)
            && self.weight.dtype() == DType::F32
            && self.bias.as_ref().is_none_or(|b| b.dtype() == DType::F32)
            && x.elem_count() > 0
            && self.check_last_dim(x).is_ok()
            && !self.records_grad(&[Some(x), residual])
            && self.takes_fused_path()
            && crate::alloc::ensure("layer_norm", "input", x.dims(), DType::F32, 5, "").is_ok();
        if !applies {
            return Ok(None);
        }
        let params = (&self.weight, self.bias.as_ref());
        crate::fused::norm::layer_norm_mixed(x, residual, params, self.eps, out).map(Some)
    }

    /// Whether the f32 norm would run fused here (not under a composed backend, which
    /// [`forward`](Self::forward) and [`forward_residual`](Self::forward_residual) honour with
    /// candle's operations and their own bits): the one-pass forms give the fused path's bits.
    fn takes_fused_path(&self) -> bool {
        use crate::fused::dispatch::{decide, Path};
        let plan = decide("layer_norm", crate::mode::Backend::Auto, None);
        plan.is_ok_and(|p| p.path == Path::Fused)
    }

    /// Whether a call on `inputs` would record a gradient: gradients enabled (outside
    /// [`no_grad`](crate::no_grad)) and an input or a parameter tracked by candle.
    fn records_grad(&self, inputs: &[Option<&Tensor>]) -> bool {
        crate::mode::grad_enabled()
            && (inputs.iter().flatten().any(|t| t.track_op())
                || self.weight.track_op()
                || self.bias.as_ref().is_some_and(Tensor::track_op))
    }

    /// `x`'s last dimension must be the normalised size.
    fn check_last_dim(&self, x: &Tensor) -> Result<()> {
        let d = self.weight.dim(0)?;
        if x.dims().last() != Some(&d) {
            return Err(Error::Shape {
                op: "layer_norm",
                arg: "input",
                msg: format!(
                    "expected the last dimension to be {d}, got input of shape {:?}",
                    x.dims()
                ),
            });
        }
        Ok(())
    }

    /// The normalisation of `x` (checked) with `weight` and `bias` of its dtype.
    fn run(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let plan = crate::fused::dispatch::decide(
            "layer_norm",
            crate::mode::Backend::Auto,
            crate::fused::dispatch::dtype_device_blocker(x),
        )?;
        let x = &crate::mode::graph_input(x);
        let weight = crate::mode::graph_input(weight);
        let bias = bias.map(crate::mode::graph_input);
        if x.elem_count() == 0 {
            // Kept in the graph: candle's ops on empty tensors drop gradients.
            let mut inputs = vec![x, &weight];
            inputs.extend(bias.as_ref());
            return crate::fused::zeros::zeros_of(x.dims(), x.dtype(), &inputs);
        }
        if plan.path == crate::fused::dispatch::Path::Fused {
            return crate::fused::norm::layer_norm(x, &weight, bias.as_ref(), self.eps);
        }
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let rstd = (var + self.eps)?.sqrt()?.recip()?;
        let y = xc.broadcast_mul(&rstd)?.broadcast_mul(&weight)?;
        Ok(match &bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

impl NamedParameters for LayerNorm {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }
}

/// `eps` must be finite and `>= 0` (a negative one gives NaN for constant rows; PyTorch does not
/// check).
pub(crate) fn check_eps(eps: f64, op: &'static str, arg: &'static str) -> Result<()> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(crate::Error::Config {
            op,
            arg,
            msg: format!("{arg} must be finite and >= 0, got {eps}; PyTorch's default is 1e-5"),
        })
    }
}

impl crate::precision::CastParams for LayerNorm {
    fn map_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            weight: f(&self.weight)?,
            bias: self.bias.as_ref().map(f).transpose()?,
            eps: self.eps,
        })
    }
}
