//! `torch.nn.utils.clip_grad_norm_` and `clip_grad_value_` over a candle [`GradStore`].
//!
//! PyTorch keeps a gradient in each parameter's `.grad`; candle returns them all in a
//! [`GradStore`] from `loss.backward()`. These functions clip the gradients of the given
//! variables there, before the optimiser's `step(&grads)`, in place as PyTorch does (a clone
//! of a gradient tensor taken before sees the change, as a reference to `.grad` does in
//! PyTorch), except where that would change something else: a gradient whose storage another
//! entry of the store holds too (candle stores the gradient of an add as the gradient of both
//! its inputs and of itself), a broadcast or sliced view, a gradient that is a view of a
//! parameter, and f16 gradients, are replaced in the store by clipped copies with the same
//! values.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor, Var};
use half::slice::HalfFloatSliceExt;
use multihead_kernels::clip::{clamp_bf16, clamp_f32, clamp_f64, scale_bf16, scale_f32, scale_f64};
use multihead_kernels::convert::f32_to_bf16_bits;
use multihead_kernels::vector_norm::{vector_norm_bf16, vector_norm_f32, vector_norm_f64, NormOrd};

use super::storage_addr;
use crate::error::{fmt_shape, Error, Result};
use crate::fused::convert::{bits, from_bits};

const NORM_OP: &str = "clip_grad_norm_";
const VALUE_OP: &str = "clip_grad_value_";

/// `torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)` with
/// its options: build it with [`ClipGradNorm::new`], set the others, then [`clip`](Self::clip).
/// [`clip_grad_norm`] is the call with PyTorch's defaults.
///
/// The total norm is the `norm_type`-norm of the gradients' own norms (as if all gradients
/// were one vector); every gradient is multiplied by `min(max_norm / (total + 1e-6), 1)`.
/// The arithmetic is PyTorch's: each gradient's norm in its dtype (summed in f32 for f32, bf16
/// and f16, in f64 for f64), the total in the widest of their dtypes, the factor computed in
/// that dtype as PyTorch computes it (`(total + 1e-6).reciprocal() * max_norm`, then clamped),
/// and each gradient multiplied by it in f32 (f64 for f64 gradients) and rounded to its dtype.
/// The f32 norms agree with PyTorch's to f32's rounding of a sum (the order of the additions
/// differs), the f64 ones to f64's.
///
/// # Shapes
/// * `vars`: any shapes; a variable's gradient in `grads` has its shape and dtype.
///
/// # Errors
/// A negative or NaN `max_norm`, a NaN `norm_type`, a variable passed twice, a gradient whose
/// shape or dtype is not its variable's, a gradient off the CPU, and (with
/// `error_if_nonfinite`) a non-finite total norm, as PyTorch's message says. Nothing is
/// changed when an error is returned.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use multihead::optim::ClipGradNorm;
///
/// let w = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &Device::Cpu)?)?;
/// // The gradient of sum(3·w) is (3, 3), of 2-norm 4.24; clipped to norm 1.
/// let mut grads = (w.as_tensor() * 3.0)?.sum_all()?.backward()?;
/// let total = ClipGradNorm::new(1.0).clip(&[w.clone()], &mut grads)?;
/// assert!((total - 18f64.sqrt()).abs() < 1e-6);
/// let g = grads.get(w.as_tensor()).expect("a gradient").to_vec1::<f32>()?;
/// assert!((g[0] - 1.0 / 2f32.sqrt()).abs() < 1e-6);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct ClipGradNorm {
    /// The largest total norm left as it is (`max_norm`); `f64::INFINITY` only measures.
    pub max_norm: f64,
    /// The order of the norms (`norm_type`, default 2): any number, or ±infinity.
    pub norm_type: f64,
    /// Refuse a total norm that is NaN or infinite instead of scaling by it (default false).
    pub error_if_nonfinite: bool,
}

impl ClipGradNorm {
    /// Clipping to total norm `max_norm`, with PyTorch's defaults for the rest.
    pub fn new(max_norm: f64) -> Self {
        Self { max_norm, norm_type: 2.0, error_if_nonfinite: false }
    }

    /// The order of the norms (`norm_type`).
    pub fn norm_type(mut self, norm_type: f64) -> Self {
        self.norm_type = norm_type;
        self
    }

    /// Whether a non-finite total norm is an error (`error_if_nonfinite`).
    pub fn error_if_nonfinite(mut self, yes: bool) -> Self {
        self.error_if_nonfinite = yes;
        self
    }

    // Mirrors torch.nn.utils.clip_grad_norm_ (get_total_norm, then clip_grads_with_norm_).
    /// Clips the gradients of `vars` in `grads` and returns the total norm before clipping
    /// (PyTorch's return value, as a number). Variables without a gradient are skipped; with
    /// none at all, the total is 0 and nothing changes.
    pub fn clip(&self, vars: &[Var], grads: &mut GradStore) -> Result<f64> {
        let ord = self.check()?;
        let found = gradients(NORM_OP, vars, grads)?;
        let Some(total_dtype) = widest(&found) else { return Ok(0.0) };
        let mut norms = Vec::with_capacity(found.len());
        for (_, g) in &found {
            norms.push(norm_of(g, ord)?);
        }
        let total = total_norm(&norms, total_dtype, ord)?;
        if self.error_if_nonfinite && !total.is_finite() {
            let msg = format!(
                "the total norm of order {} for gradients from `parameters` is non-finite ({total}), so it cannot be clipped; to scale the gradients by the non-finite norm anyway, set error_if_nonfinite to false",
                self.norm_type
            );
            return Err(Error::Config { op: NORM_OP, arg: "parameters", msg });
        }
        let coef = clip_coef(total, self.max_norm, total_dtype);
        // x·1 is x for every number, so PyTorch's multiplication by a factor clamped to 1
        // changes nothing and is left out.
        if coef != 1.0 {
            write(NORM_OP, grads, found, &Write::Scale(coef))?;
        }
        Ok(total)
    }

    fn check(&self) -> Result<NormOrd> {
        if self.max_norm.is_nan() || self.max_norm < 0.0 {
            let msg = format!(
                "must be at least 0, got {}; PyTorch would scale the gradients by a negative or NaN factor (pass f64::INFINITY to measure without clipping)",
                self.max_norm
            );
            return Err(Error::Config { op: NORM_OP, arg: "max_norm", msg });
        }
        NormOrd::new(self.norm_type).map_err(|_| Error::Config {
            op: NORM_OP,
            arg: "norm_type",
            msg: "is NaN; pass a number or infinity (2.0 is the Euclidean norm)".into(),
        })
    }
}

/// `torch.nn.utils.clip_grad_norm_(parameters, max_norm)`: clips the 2-norm of the gradients
/// of `vars` in `grads` to `max_norm` and returns the norm before clipping
/// ([`ClipGradNorm`] has the other options and the details).
///
/// # Shapes
/// * `vars`: any shapes; a variable's gradient in `grads` has its shape and dtype.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use multihead::optim::clip_grad_norm;
///
/// let w = Var::from_tensor(&Tensor::new(&[[1.0f32, 2.0]], &Device::Cpu)?)?;
/// let mut grads = w.as_tensor().sqr()?.sum_all()?.backward()?; // gradient (2, 4)
/// let norm = clip_grad_norm(&[w.clone()], &mut grads, 100.0)?; // under 100: unchanged
/// assert!((norm - 20f64.sqrt()).abs() < 1e-6);
/// assert_eq!(grads.get(w.as_tensor()).expect("a gradient").to_vec2::<f32>()?, [[2.0, 4.0]]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn clip_grad_norm(vars: &[Var], grads: &mut GradStore, max_norm: f64) -> Result<f64> {
    ClipGradNorm::new(max_norm).clip(vars, grads)
}

// Mirrors torch.nn.utils.clip_grad_value_.
/// `torch.nn.utils.clip_grad_value_(parameters, clip_value)`: clamps every element of the
/// gradients of `vars` in `grads` to `[-clip_value, clip_value]` (a NaN stays NaN; the bounds
/// are rounded to each gradient's dtype first, as PyTorch rounds them).
///
/// # Shapes
/// * `vars`: any shapes; a variable's gradient in `grads` has its shape and dtype.
///
/// # Errors
/// A negative or NaN `clip_value` (PyTorch would set every element to it), a variable passed
/// twice, a gradient whose shape or dtype is not its variable's, a gradient off the CPU.
/// Nothing is changed when an error is returned.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use multihead::optim::clip_grad_value;
///
/// let w = Var::from_tensor(&Tensor::new(&[1.0f32, -3.0, 0.25], &Device::Cpu)?)?;
/// let mut grads = w.as_tensor().sqr()?.sum_all()?.backward()?; // gradient (2, -6, 0.5)
/// clip_grad_value(&[w.clone()], &mut grads, 1.0)?;
/// assert_eq!(grads.get(w.as_tensor()).expect("a gradient").to_vec1::<f32>()?, [1.0, -1.0, 0.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn clip_grad_value(vars: &[Var], grads: &mut GradStore, clip_value: f64) -> Result<()> {
    if clip_value.is_nan() || clip_value < 0.0 {
        let msg = format!(
            "must be at least 0, got {clip_value}; PyTorch would set every element to a negative bound"
        );
        return Err(Error::Config { op: VALUE_OP, arg: "clip_value", msg });
    }
    let found = gradients(VALUE_OP, vars, grads)?;
    for (_, g) in &found {
        let max = match g.dtype() {
            DType::F32 => f32::MAX as f64,
            DType::BF16 => half::bf16::MAX.to_f64(),
            DType::F16 => half::f16::MAX.to_f64(),
            _ => f64::MAX,
        };
        // PyTorch converts the bound to the gradient's dtype with an overflow check.
        if clip_value.is_finite() && clip_value > max {
            let msg = format!(
                "{clip_value} cannot be converted to the {:?} of a gradient of shape {} without overflow (its largest value is {max}); pass a smaller value, or infinity to clip nothing",
                g.dtype(),
                fmt_shape(g.dims())
            );
            return Err(Error::Config { op: VALUE_OP, arg: "clip_value", msg });
        }
    }
    write(VALUE_OP, grads, found, &Write::Clamp(clip_value))
}

/// What clipping writes into a gradient.
#[derive(Clone, Copy)]
enum Write {
    /// `g · coef` ([`scale`]).
    Scale(f64),
    /// `g` clamped to `[-v, v]` ([`clamp`]).
    Clamp(f64),
}

impl candle_core::InplaceOp1 for Write {
    fn name(&self) -> &'static str {
        "clip-grad"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b, _) = dense(l).ok_or_else(|| candle_core::Error::Msg("not dense".into()))?;
        match (s, *self) {
            (CpuStorage::F32(v), Write::Scale(c)) => scale_f32(&mut v[a..b], c as f32),
            (CpuStorage::F64(v), Write::Scale(c)) => scale_f64(&mut v[a..b], c),
            (CpuStorage::BF16(v), Write::Scale(c)) => {
                scale_bf16(v[a..b].reinterpret_cast_mut(), c as f32)
            }
            (CpuStorage::F32(v), Write::Clamp(c)) => clamp_f32(&mut v[a..b], -(c as f32), c as f32),
            (CpuStorage::F64(v), Write::Clamp(c)) => clamp_f64(&mut v[a..b], -c, c),
            (CpuStorage::BF16(v), Write::Clamp(c)) => {
                let (lo, hi) = (f32_to_bf16_bits(-(c as f32)), f32_to_bf16_bits(c as f32));
                clamp_bf16(v[a..b].reinterpret_cast_mut(), lo, hi)
            }
            _ => candle_core::bail!("clip-grad: not an f32, f64 or bf16 gradient"),
        }
        Ok(())
    }
}

/// `w` applied to the f32, f64 or bf16 gradient `g`, whose layout is [`dense`], into a new
/// tensor of the same layout (one pass in storage order, the new buffer not zeroed first).
fn written(g: &Tensor, w: &Write) -> candle_core::Result<Tensor> {
    use multihead_kernels::clip::{
        clamp_bf16_to, clamp_f32_to, clamp_f64_to, scale_bf16_to, scale_f32_to, scale_f64_to,
    };
    use std::mem::MaybeUninit;
    let (s, l) = g.storage_and_layout();
    let Storage::Cpu(s) = &*s else { candle_core::bail!("clip-grad: not on the CPU") };
    let (a, b, order) = dense(l).ok_or_else(|| candle_core::Error::Msg("not dense".into()))?;
    let kernel =
        |e: multihead_kernels::attention::KernelError| candle_core::Error::Msg(e.to_string());
    let n = b - a;
    // The new buffer keeps the storage order: a tensor of the dimensions in that order,
    // permuted back to the gradient's.
    let shape: Vec<usize> = order.iter().map(|&d| g.dims()[d]).collect();
    let mut back = vec![0; order.len()];
    for (j, &d) in order.iter().enumerate() {
        back[d] = j;
    }
    let dev = g.device().clone();
    let new = match (s, *w) {
        (CpuStorage::F32(v), w) => {
            let write = |d: &mut [MaybeUninit<f32>]| match w {
                Write::Scale(c) => scale_f32_to(&v[a..b], c as f32, d).map_err(kernel),
                Write::Clamp(c) => clamp_f32_to(&v[a..b], -(c as f32), c as f32, d).map_err(kernel),
            };
            // SAFETY: on `Ok` the `_to` kernels wrote all `n` elements.
            let out = unsafe { crate::alloc::try_written(n, "clipped gradient", write) }?;
            Tensor::from_vec(out, shape, &dev)
        }
        (CpuStorage::F64(v), w) => {
            let write = |d: &mut [MaybeUninit<f64>]| match w {
                Write::Scale(c) => scale_f64_to(&v[a..b], c, d).map_err(kernel),
                Write::Clamp(c) => clamp_f64_to(&v[a..b], -c, c, d).map_err(kernel),
            };
            // SAFETY: on `Ok` the `_to` kernels wrote all `n` elements.
            let out = unsafe { crate::alloc::try_written(n, "clipped gradient", write) }?;
            Tensor::from_vec(out, shape, &dev)
        }
        (CpuStorage::BF16(v), w) => {
            let src = bits(&v[a..b]);
            let write = |d: &mut [MaybeUninit<u16>]| match w {
                Write::Scale(c) => scale_bf16_to(src, c as f32, d).map_err(kernel),
                Write::Clamp(c) => {
                    let (lo, hi) = (f32_to_bf16_bits(-(c as f32)), f32_to_bf16_bits(c as f32));
                    clamp_bf16_to(src, lo, hi, d).map_err(kernel)
                }
            };
            // SAFETY: on `Ok` the `_to` kernels wrote all `n` elements.
            let out = unsafe { crate::alloc::try_written(n, "clipped gradient", write) }?;
            Tensor::from_vec(from_bits(out), shape, &dev)
        }
        _ => candle_core::bail!("clip-grad: not an f32, f64 or bf16 gradient"),
    }?;
    new.permute(back)
}

/// Where a layout's elements lie when they fill a storage range exactly once, in some order of
/// the dimensions (contiguous, or a transpose or permutation of a contiguous tensor): the range,
/// and the dimensions from the outermost in storage to the innermost. An element-wise write or
/// a norm can then run over the range in storage order, as ATen's iterators run over a permuted
/// tensor.
fn dense(l: &Layout) -> Option<(usize, usize, Vec<usize>)> {
    let (dims, strides) = (l.dims(), l.stride());
    let mut order: Vec<usize> = (0..dims.len()).collect();
    if l.shape().elem_count() == 0 {
        return Some((l.start_offset(), l.start_offset(), order));
    }
    order.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    let mut expected = 1usize;
    for &d in order.iter().rev() {
        if dims[d] == 1 {
            continue;
        }
        if strides[d] != expected {
            return None;
        }
        expected = expected.checked_mul(dims[d])?;
    }
    let start = l.start_offset();
    Some((start, start.checked_add(l.shape().elem_count())?, order))
}

/// Writes `w` into each gradient: in place where the gradient is contiguous, f32, f64 or
/// bf16, and its storage is held by no other entry of the store and by no parameter here; as a
/// new tensor in the store otherwise.
fn write(
    op: &'static str,
    grads: &mut GradStore,
    found: Vec<(Var, Tensor)>,
    w: &Write,
) -> Result<()> {
    // How many entries of the whole store hold each storage: the gradient of a variable not
    // passed here, or of an intermediate tensor, can share one with a variable's (candle
    // stores one tensor as the gradient of both inputs of an add).
    let mut holders = std::collections::HashMap::<usize, usize>::new();
    for id in grads.get_ids() {
        if let Some(a) = grads.get_id(*id).and_then(storage_addr) {
            *holders.entry(a).or_default() += 1;
        }
    }
    let params: Vec<Option<usize>> = found.iter().map(|(v, _)| storage_addr(v)).collect();
    for (var, g) in found.iter() {
        let addr = storage_addr(g);
        // Held by another entry too, or a parameter's own storage (a gradient that is a view
        // of one): written in place, it would clip another gradient or change the parameter.
        let shared = addr.is_none_or(|a| holders.get(&a).copied().unwrap_or(0) != 1)
            || params.contains(&addr);
        let is_dense = dense(g.layout()).is_some();
        let in_place =
            !shared && is_dense && matches!(g.dtype(), DType::F32 | DType::F64 | DType::BF16);
        let err = |e| candle_err(op, e);
        if in_place {
            g.inplace_op1(w).map_err(err)?;
        } else if is_dense && matches!(g.dtype(), DType::F32 | DType::F64 | DType::BF16) {
            // Read where it lies, written into a fresh buffer in one pass.
            grads.insert(var.as_tensor(), written(g, w).map_err(err)?);
        } else if matches!(g.dtype(), DType::F32 | DType::F64 | DType::BF16) {
            // A broadcast or sliced view: a contiguous copy of our own, then written in place.
            let fresh = g.contiguous().map_err(err)?;
            fresh.inplace_op1(w).map_err(err)?;
            grads.insert(var.as_tensor(), fresh);
        } else {
            let new = match *w {
                Write::Scale(c) => scale(g, c),
                Write::Clamp(v) => clamp(g, v),
            };
            grads.insert(var.as_tensor(), new.map_err(err)?);
        }
    }
    Ok(())
}

fn candle_err(op: &'static str, e: candle_core::Error) -> Error {
    Error::Config { op, arg: "parameters", msg: e.to_string() }
}

/// The gradients of `vars` in `grads` (variables without one left out), each checked against
/// its variable.
fn gradients(op: &'static str, vars: &[Var], grads: &GradStore) -> Result<Vec<(Var, Tensor)>> {
    let mut seen = std::collections::HashSet::new();
    let mut found = Vec::new();
    for var in vars {
        let t = var.as_tensor();
        if !seen.insert(t.id()) {
            let msg = format!(
                "a variable of shape {} appears twice; pass each parameter once (PyTorch would count and scale its gradient twice)",
                fmt_shape(t.dims())
            );
            return Err(Error::Config { op, arg: "parameters", msg });
        }
        let Some(g) = grads.get(t) else { continue };
        if let Some(msg) = super::grad_mismatch(g, t) {
            return Err(Error::Shape { op, arg: "grads", msg });
        }
        if !matches!(g.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
            let msg = format!(
                "a gradient of shape {} is {:?}; clipping takes f32, f64, bf16 and f16 gradients",
                fmt_shape(g.dims()),
                g.dtype()
            );
            return Err(Error::DType { op, arg: "grads", msg });
        }
        if !matches!(g.device(), Device::Cpu) {
            let msg = format!(
                "a gradient of shape {} is not on the CPU; clip on the CPU",
                fmt_shape(g.dims())
            );
            return Err(Error::Config { op, arg: "grads", msg });
        }
        found.push((var.clone(), g.clone()));
    }
    Ok(found)
}

/// The dtype of PyTorch's stacked norms: the widest gradient dtype (bf16 with f16 gives f32).
fn widest(found: &[(Var, Tensor)]) -> Option<DType> {
    let mut dtypes = found.iter().map(|(_, g)| g.dtype());
    let first = dtypes.next()?;
    Some(dtypes.fold(first, |a, b| match (a, b) {
        (a, b) if a == b => a,
        (DType::F64, _) | (_, DType::F64) => DType::F64,
        _ => DType::F32,
    }))
}

/// `x` rounded to `dtype` (f32 values for bf16, f16 and f32).
fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        DType::F16 => half::f16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

/// The norm of one gradient, summed in f32 (f64 for f64) and rounded to its dtype.
fn norm_of(g: &Tensor, ord: NormOrd) -> Result<f64> {
    let err = |e: candle_core::Error| candle_err(NORM_OP, e);
    let kernel = |e: multihead_kernels::attention::KernelError| Error::Config {
        op: NORM_OP,
        arg: "norm_type",
        msg: e.to_string(),
    };
    let dtype = g.dtype();
    let widened;
    let g = match dtype {
        DType::F16 => {
            widened = g.to_dtype(DType::F32).map_err(err)?;
            &widened
        }
        _ => g,
    };
    // A transposed or permuted gradient is read in storage order, as ATen reads it; any other
    // view (a broadcast, a strided slice) is copied first.
    let g = if dense(g.layout()).is_some() { g.clone() } else { g.contiguous().map_err(err)? };
    let (s, l) = g.storage_and_layout();
    let Storage::Cpu(s) = &*s else {
        return Err(candle_err(NORM_OP, candle_core::Error::Msg("not on the CPU".into())));
    };
    let (a, b, _) =
        dense(l).ok_or_else(|| candle_err(NORM_OP, candle_core::Error::Msg("not dense".into())))?;
    let n = match s {
        CpuStorage::F32(v) => vector_norm_f32(&v[a..b], ord).map_err(kernel)? as f64,
        CpuStorage::F64(v) => vector_norm_f64(&v[a..b], ord).map_err(kernel)?,
        CpuStorage::BF16(v) => vector_norm_bf16(bits(&v[a..b]), ord).map_err(kernel)? as f64,
        _ => return Err(candle_err(NORM_OP, candle_core::Error::Msg("not a float".into()))),
    };
    Ok(round_to(n, dtype))
}

/// The norm of the gradients' norms, in `dtype` (PyTorch's `vector_norm(stack(norms))`).
fn total_norm(norms: &[f64], dtype: DType, ord: NormOrd) -> Result<f64> {
    let kernel = |e: multihead_kernels::attention::KernelError| Error::Config {
        op: NORM_OP,
        arg: "norm_type",
        msg: e.to_string(),
    };
    Ok(match dtype {
        DType::F64 => vector_norm_f64(norms, ord).map_err(kernel)?,
        _ => {
            let n32: Vec<f32> = norms.iter().map(|&n| n as f32).collect();
            round_to(vector_norm_f32(&n32, ord).map_err(kernel)? as f64, dtype)
        }
    })
}

/// PyTorch's `clamp(max_norm / (total + 1e-6), max=1)` in `dtype`: `total + 1e-6`, its
/// reciprocal and the product with `max_norm` each computed in f32 (f64 for f64) and rounded
/// to `dtype` (`x / tensor` is `tensor.reciprocal() * x` in PyTorch).
fn clip_coef(total: f64, max_norm: f64, dtype: DType) -> f64 {
    let coef = if dtype == DType::F64 {
        (1.0 / (total + 1e-6)) * max_norm
    } else {
        let t1 = round_to((total as f32 + 1e-6f32) as f64, dtype) as f32;
        let t2 = round_to((1.0f32 / t1) as f64, dtype) as f32;
        round_to((t2 * max_norm as f32) as f64, dtype)
    };
    // clamp(max=1) keeps a NaN.
    if coef > 1.0 {
        1.0
    } else {
        coef
    }
}

/// `g · coef`: in f64 for f64 gradients, else in f32 (`coef` read as f32, as PyTorch reads a
/// 0-dim factor for its opmath), rounded to `g`'s dtype.
fn scale(g: &Tensor, coef: f64) -> candle_core::Result<Tensor> {
    let dtype = g.dtype();
    if dtype == DType::F64 {
        return g.broadcast_mul(&Tensor::new(coef, g.device())?);
    }
    let c = Tensor::new(coef as f32, g.device())?;
    match dtype {
        DType::F32 => g.broadcast_mul(&c),
        _ => g.to_dtype(DType::F32)?.broadcast_mul(&c)?.to_dtype(dtype),
    }
}

/// `g` clamped to `[-v, v]`, the bounds rounded to `g`'s dtype (through f32, as PyTorch's
/// `Scalar::to` rounds them); a NaN element stays NaN.
fn clamp(g: &Tensor, v: f64) -> candle_core::Result<Tensor> {
    let bound = |x: f64| -> candle_core::Result<Tensor> {
        let t = match g.dtype() {
            DType::F64 => Tensor::new(x, g.device())?,
            dt => Tensor::new(x as f32, g.device())?.to_dtype(dt)?,
        };
        Ok(t)
    };
    // candle's maximum/minimum return their first operand when the comparison is false: a
    // NaN element stays NaN, as in PyTorch's clamp.
    g.broadcast_maximum(&bound(-v)?)?.broadcast_minimum(&bound(v)?)
}
