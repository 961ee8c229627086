//! [`AdamW`]: `torch.optim.AdamW` in one pass per parameter.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW, VarMap};
use half::bf16;
use half::slice::HalfFloatSliceExt;
use multihead_kernels::optim::{adamw, adamw_bf16, adamw_f64, AdamWStep};

use crate::error::{fmt_shape, Error};

const OP: &str = "AdamW";

/// `torch.optim.AdamW(params, lr, betas, eps, weight_decay, amsgrad, maximize)` over f32, f64
/// or bf16 CPU [`Var`]s (bf16 ones with bf16 moments, each operation rounded to bf16 as
/// PyTorch rounds it), a drop-in for `candle_nn::AdamW`: build it with [`Optimizer::new`] from a
/// `VarMap`'s variables (or with [`AdamW::from_varmap`], which keys each parameter's state by
/// its name) and a [`ParamsAdamW`] (whose defaults are PyTorch's: lr 1e-3, betas (0.9, 0.999),
/// eps 1e-8, weight_decay 1e-2), then call [`Optimizer::backward_step`] or
/// [`Optimizer::step`]. [`AdamW::amsgrad`] and [`AdamW::maximize`] are PyTorch's options of
/// those names; [`AdamW::decoupled_weight_decay`]`(false)` makes it `torch.optim.Adam` (the
/// weight decay added to the gradient).
///
/// Each parameter keeps its own step count and is skipped on a step where the gradients hold
/// none for it, as PyTorch skips a parameter whose `.grad` is `None`. The numbers are
/// PyTorch's to about an ulp per step (its CPU build takes tensor square roots from MKL, which
/// is not always correctly rounded; every other operation is the same, fused multiply-adds
/// included). Training resumes where it stopped: [`AdamW::save_state`] and
/// [`AdamW::load_state`] write and read the state as PyTorch's `optimizer.state_dict()` holds
/// it, and `tools/optim_state.py` converts PyTorch's (docs/pytorch-behaviour.md §7.9).
///
/// # Shapes
/// * Any parameter shape; its gradient has the same shape and dtype.
///
/// # Errors
/// [`Optimizer::new`] refuses a variable passed twice, an f16 variable (keep f32 master
/// weights, as mixed-precision training does), one on another device, or not contiguous, and
/// parameters out of PyTorch's ranges; [`Optimizer::step`] refuses a gradient whose shape or
/// dtype is not its parameter's, a gradient that shares its storage with a parameter (a view
/// of one), and a learning rate set out of range, before it writes any parameter. The errors
/// are [`Error`]s inside candle's (`candle_core::Error::Wrapped`).
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_nn::{Optimizer, ParamsAdamW, VarMap};
/// use multihead::optim::AdamW;
///
/// let w = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &Device::Cpu)?)?;
/// let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW { lr: 0.1, ..Default::default() })?;
/// // Minimise sum(w²): every step moves each weight by about lr towards 0.
/// for _ in 0..5 {
///     opt.backward_step(&w.as_tensor().sqr()?.sum_all()?)?;
/// }
/// let w = w.as_tensor().to_vec1::<f32>()?;
/// assert!(w[0] < 0.55 && w[1] > -1.55);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct AdamW {
    pub(super) vars: Vec<VarState>,
    pub(super) params: ParamsAdamW,
    pub(super) flags: Flags,
}

/// The options `ParamsAdamW` has no field for (PyTorch's `amsgrad`, `maximize` and
/// `decoupled_weight_decay`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Flags {
    pub(super) amsgrad: bool,
    pub(super) maximize: bool,
    pub(super) decoupled: bool,
}

/// One parameter, the key its state is saved under, its moments and its step count.
#[derive(Debug)]
pub(super) struct VarState {
    pub(super) key: String,
    pub(super) var: Var,
    pub(super) moments: Moments,
    pub(super) step: u64,
    /// Whether PyTorch would hold a state for it: after its first step, or a loaded entry
    /// (which may have step 0).
    pub(super) stored: bool,
}

/// PyTorch's `exp_avg`, `exp_avg_sq` and, with `amsgrad`, `max_exp_avg_sq` (made at the first
/// step that needs it), in the parameter's dtype.
#[derive(Debug)]
pub(super) struct Arrays<T> {
    pub(super) m: Vec<T>,
    pub(super) v: Vec<T>,
    pub(super) vmax: Option<Vec<T>>,
}

/// A parameter's moments, in its dtype.
#[derive(Debug)]
pub(super) enum Moments {
    F32(Arrays<f32>),
    F64(Arrays<f64>),
    BF16(Arrays<bf16>),
}

fn config(arg: &'static str, msg: String) -> candle_core::Error {
    Error::Config { op: OP, arg, msg }.into()
}

/// PyTorch's checks of the hyper-parameters, as a kernel step of them makes them.
pub(super) fn step_of(p: &ParamsAdamW, f: Flags, step: u64) -> candle_core::Result<AdamWStep> {
    let s = AdamWStep::new(p.lr, (p.beta1, p.beta2), p.eps, p.weight_decay, step).map_err(|e| {
        let msg = format!(
            "{e}; PyTorch's AdamW takes 0 <= lr, 0 <= eps, 0 <= beta < 1 and 0 <= weight_decay"
        );
        config("params", msg)
    })?;
    let s = if f.decoupled { s } else { s.l2_weight_decay(p.weight_decay) };
    Ok(s.maximize(f.maximize))
}

impl<T: Copy + Default + Send + Sync> Arrays<T> {
    pub(super) fn zeros(n: usize) -> candle_core::Result<Self> {
        Ok(Self {
            m: crate::alloc::try_zeros(n, "AdamW exp_avg")?,
            v: crate::alloc::try_zeros(n, "AdamW exp_avg_sq")?,
            vmax: None,
        })
    }

    /// Makes the running maximum (zeros) at the first `amsgrad` step.
    fn make_vmax(&mut self) -> candle_core::Result<()> {
        if self.vmax.is_none() {
            self.vmax = Some(crate::alloc::try_zeros(self.m.len(), "AdamW max_exp_avg_sq")?);
        }
        Ok(())
    }

    /// The moments and, with `amsgrad`, the running maximum (made by `make_vmax`).
    fn split(&mut self, amsgrad: bool) -> (&mut [T], &mut [T], Option<&mut [T]>) {
        let vmax = if amsgrad { self.vmax.as_deref_mut() } else { None };
        (&mut self.m, &mut self.v, vmax)
    }
}

impl VarState {
    pub(super) fn new(key: String, var: Var) -> candle_core::Result<Self> {
        let dims = var.dims().to_vec();
        if !matches!(var.device(), Device::Cpu) {
            let msg = format!(
                "a variable of shape {} is not on the CPU; use candle_nn::AdamW on other devices",
                fmt_shape(&dims)
            );
            return Err(config("vars", msg));
        }
        if !var.as_tensor().is_contiguous() {
            let msg = format!("a variable of shape {} is not contiguous, and candle cannot set such a variable; make it from a contiguous tensor", fmt_shape(&dims));
            return Err(config("vars", msg));
        }
        let n = var.elem_count();
        let moments = match var.dtype() {
            DType::F32 => Moments::F32(Arrays::zeros(n)?),
            DType::F64 => Moments::F64(Arrays::zeros(n)?),
            DType::BF16 => Moments::BF16(Arrays::zeros(n)?),
            dt => {
                let msg = format!(
                    "a variable of shape {} is {dt:?}; this AdamW updates f32, f64 or bf16 parameters (keep f32 master weights for f16 training), or use candle_nn::AdamW",
                    fmt_shape(&dims)
                );
                return Err(config("vars", msg));
            }
        };
        Ok(Self { key, var, moments, step: 0, stored: false })
    }

    /// Checks gradient `g` against the parameter and returns the step's scalars.
    fn check(&self, g: &Tensor, params: &ParamsAdamW, f: Flags) -> candle_core::Result<AdamWStep> {
        let t = self.var.as_tensor();
        if let Some(msg) = super::grad_mismatch(g, t) {
            return Err(config("grads", msg));
        }
        step_of(params, f, self.step + 1)
    }

    /// One step with the checked gradient `g` and scalars `s`, written into the variable's
    /// own storage (candle's in-place op: no copy of the parameter out and back).
    /// `g` is contiguous (made so while the step was planned).
    fn update(&mut self, g: &Tensor, s: &AdamWStep, amsgrad: bool) -> candle_core::Result<()> {
        if amsgrad {
            // Made here, before the in-place op, so that its allocation can fail cleanly.
            match &mut self.moments {
                Moments::F32(a) => a.make_vmax()?,
                Moments::F64(a) => a.make_vmax()?,
                Moments::BF16(a) => a.make_vmax()?,
            }
        }
        if self.var.elem_count() == 0 {
            // Nothing to write (and candle refuses an in-place op on an empty tensor whose
            // shape gives it a zero stride); PyTorch counts the step.
            (self.step, self.stored) = (self.step + 1, true);
            return Ok(());
        }
        let op = InPlace { moments: std::cell::RefCell::new(&mut self.moments), step: *s, amsgrad };
        self.var.as_tensor().inplace_op2(g, &op).map_err(|e| match e {
            // Ours, from `cpu_fwd`.
            e @ candle_core::Error::Wrapped(_) => e,
            // candle's own refusals (`step` refuses a gradient sharing a parameter's storage
            // before this), without the backtrace candle attaches.
            e => match Error::from(e) {
                Error::Candle(c) => {
                    config("grads", format!("the in-place update was refused ({c})"))
                }
                other => other.into(),
            },
        })?;
        (self.step, self.stored) = (self.step + 1, true);
        Ok(())
    }
}

/// The update as candle's in-place op on the parameter, reading the gradient.
struct InPlace<'a> {
    moments: std::cell::RefCell<&'a mut Moments>,
    step: AdamWStep,
    amsgrad: bool,
}

impl candle_core::InplaceOp2 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(
        &self,
        p: &mut candle_core::CpuStorage,
        pl: &candle_core::Layout,
        g: &candle_core::CpuStorage,
        gl: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage as S;
        let range = |l: &candle_core::Layout| {
            l.contiguous_offsets().ok_or_else(|| config("grads", "not contiguous".to_string()))
        };
        let ((p0, p1), (g0, g1)) = (range(pl)?, range(gl)?);
        let mut moments = self.moments.borrow_mut();
        let done = match (p, g, &mut **moments) {
            (S::F32(p), S::F32(g), Moments::F32(a)) => {
                let (m, v, vmax) = a.split(self.amsgrad);
                adamw(&mut p[p0..p1], &g[g0..g1], m, v, vmax, &self.step)
            }
            (S::F64(p), S::F64(g), Moments::F64(a)) => {
                let (m, v, vmax) = a.split(self.amsgrad);
                adamw_f64(&mut p[p0..p1], &g[g0..g1], m, v, vmax, &self.step)
            }
            (S::BF16(p), S::BF16(g), Moments::BF16(a)) => {
                let (m, v, vmax) = a.split(self.amsgrad);
                let (p, g) = (p[p0..p1].reinterpret_cast_mut(), g[g0..g1].reinterpret_cast());
                let vmax = vmax.map(|w| w.reinterpret_cast_mut());
                adamw_bf16(
                    p,
                    g,
                    m.reinterpret_cast_mut(),
                    v.reinterpret_cast_mut(),
                    vmax,
                    &self.step,
                )
            }
            _ => return Err(config("grads", "the gradient's dtype is not its parameter's".into())),
        };
        done.map_err(|e| config("grads", e.to_string()))
    }
}

impl AdamW {
    /// The optimiser over the float variables of `varmap`, each keyed by its name (so that a
    /// saved state, [`AdamW::save_state`], finds its parameters again whatever order the map
    /// lists them in: `VarMap::all_vars` follows a hash map's order, which differs from one
    /// process to the next). Errors as [`Optimizer::new`].
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device};
    /// use candle_nn::{Init, ParamsAdamW, VarMap};
    /// use multihead::optim::AdamW;
    ///
    /// let varmap = VarMap::new();
    /// varmap.get(3, "layer.bias", Init::Const(0.5), DType::F32, &Device::Cpu)?;
    /// let opt = AdamW::from_varmap(&varmap, ParamsAdamW::default())?;
    /// // No step taken yet: the hyper-parameters, and no parameter's state.
    /// assert!(opt.state_dict()?.iter().all(|(k, _)| k.starts_with("param_groups.0.")));
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn from_varmap(varmap: &VarMap, params: ParamsAdamW) -> candle_core::Result<Self> {
        let mut named: Vec<(String, Var)> = match varmap.data().lock() {
            Ok(map) => map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => {
                return Err(config(
                    "varmap",
                    "its lock is poisoned (a thread panicked while holding it)".into(),
                ))
            }
        };
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Self::from_named(named, params)
    }

    fn from_named(vars: Vec<(String, Var)>, params: ParamsAdamW) -> candle_core::Result<Self> {
        let flags = Flags { amsgrad: false, maximize: false, decoupled: true };
        step_of(&params, flags, 1)?;
        let mut seen = std::collections::HashSet::new();
        if let Some((_, v)) = vars.iter().find(|(_, v)| !seen.insert(v.as_tensor().id())) {
            // Two states for one parameter would update it twice a step.
            let msg = format!(
                "a variable of shape {} appears twice; pass each parameter once (a VarMap's all_vars does)",
                fmt_shape(v.dims())
            );
            return Err(config("vars", msg));
        }
        let vars = vars
            .into_iter()
            .filter(|(_, v)| v.dtype().is_float())
            .map(|(k, v)| VarState::new(k, v))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { vars, params, flags })
    }

    /// PyTorch's `amsgrad=True`: the denominator takes the running maximum of the second
    /// moment (`max_exp_avg_sq`, zeros at the first step that uses it).
    ///
    /// # Example
    /// ```
    /// use candle_core::{Device, Tensor, Var};
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// use multihead::optim::AdamW;
    ///
    /// let w = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &Device::Cpu)?)?;
    /// // torch.optim.Adam(params, lr=0.1, weight_decay=0.01, amsgrad=True)
    /// let params = ParamsAdamW { lr: 0.1, weight_decay: 0.01, ..Default::default() };
    /// let mut opt = AdamW::new(vec![w.clone()], params)?
    ///     .amsgrad(true)
    ///     .decoupled_weight_decay(false);
    /// opt.backward_step(&w.as_tensor().sqr()?.sum_all()?)?;
    /// assert!(w.as_tensor().to_vec1::<f32>()?[0] < 1.0);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn amsgrad(mut self, on: bool) -> Self {
        self.flags.amsgrad = on;
        self
    }

    /// PyTorch's `maximize=True`: steps up the gradient instead of down.
    ///
    /// # Example
    /// ```
    /// use candle_core::{Device, Tensor, Var};
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// use multihead::optim::AdamW;
    ///
    /// let w = Var::from_tensor(&Tensor::new(&[1.0f32], &Device::Cpu)?)?;
    /// let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?.maximize(true);
    /// opt.backward_step(&w.as_tensor().sum_all()?)?; // d/dw = 1: w grows
    /// assert!(w.as_tensor().to_vec1::<f32>()?[0] > 1.0);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn maximize(mut self, on: bool) -> Self {
        self.flags.maximize = on;
        self
    }

    /// PyTorch's `decoupled_weight_decay` (true here, as in `torch.optim.AdamW`): `false` gives
    /// `torch.optim.Adam`, whose weight decay is added to the gradient (`g + weight_decay·p`)
    /// instead of shrinking the parameter (example at [`AdamW::amsgrad`]).
    pub fn decoupled_weight_decay(mut self, on: bool) -> Self {
        self.flags.decoupled = on;
        self
    }

    /// The hyper-parameters ([`ParamsAdamW`]'s fields; set the learning rate with
    /// [`Optimizer::set_learning_rate`]); a loaded state may have changed them.
    ///
    /// # Example
    /// ```
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// use multihead::optim::AdamW;
    ///
    /// let opt = AdamW::new(vec![], ParamsAdamW { eps: 1e-6, ..Default::default() })?;
    /// assert_eq!(opt.params().eps, 1e-6);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    /// The optimiser over the float variables among `vars` (others are left out, as
    /// `candle_nn::AdamW` leaves them), with zeroed moments.
    /// Each variable's state is saved under its position in `vars` (`state.0.exp_avg`, ...:
    /// PyTorch's `optimizer.state_dict()` keys); [`AdamW::from_varmap`] keys it by name.
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        let keyed = vars.into_iter().enumerate().map(|(i, v)| (i.to_string(), v)).collect();
        Self::from_named(keyed, params)
    }

    // Mirrors torch.optim.AdamW.step (foreach=False, the path PyTorch takes for CPU tensors).
    // Every gradient is checked before any parameter is written (its shape and dtype, and that
    // it is not a view of a parameter), so a refused step changes nothing.
    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let mut planned = Vec::with_capacity(self.vars.len());
        for (i, state) in self.vars.iter().enumerate() {
            if let Some(g) = grads.get(state.var.as_tensor()) {
                let s = state.check(g, &self.params, self.flags)?;
                // A strided or broadcast gradient is copied now, so that an allocation that
                // fails does so before any parameter is written.
                planned.push((i, g, g.contiguous()?, s));
            }
        }
        // A gradient sharing its elements with a parameter would be read while it is written
        // (its own) or after it was (another's, updated earlier in this loop).
        let params: std::collections::HashSet<usize> =
            self.vars.iter().filter_map(|s| super::storage_addr(s.var.as_tensor())).collect();
        for (i, g, _, _) in &planned {
            if super::storage_addr(g).is_some_and(|a| params.contains(&a)) {
                let msg = format!(
                    "the gradient of the parameter of shape {} shares its storage with a parameter (a view of one); pass a gradient that is not a view of a parameter",
                    fmt_shape(self.vars[*i].var.dims())
                );
                return Err(config("grads", msg));
            }
        }
        for (i, _, g, s) in planned {
            self.vars[i].update(&g, &s, self.flags.amsgrad)?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }
}
