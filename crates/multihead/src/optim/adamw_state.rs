//! [`AdamW`]'s state as PyTorch's `optimizer.state_dict()`, flattened into named tensors:
//! saved to resume training, loaded from a saved state or from PyTorch's (converted by
//! `tools/optim_state.py`).
//!
//! Keys (docs/pytorch-behaviour.md §7.9):
//! * `state.{key}.step` (a 0-dim f32, PyTorch's dtype), `state.{key}.exp_avg`,
//!   `state.{key}.exp_avg_sq` and, with `amsgrad`, `state.{key}.max_exp_avg_sq` (the
//!   parameter's shape and dtype), for each parameter that has taken a step; `{key}` is the
//!   parameter's position (`Optimizer::new`) or name (`AdamW::from_varmap`);
//! * `param_groups.0.lr`, `.betas` (2 values), `.eps`, `.weight_decay` (f64) and `.amsgrad`,
//!   `.maximize`, `.decoupled_weight_decay` (u8, 0 or 1).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor, WithDType};
use candle_nn::ParamsAdamW;

use super::adamw::{step_of, AdamW, Arrays, Flags, Moments};
use crate::error::{fmt_shape, Error, Result};

/// The per-parameter entries, `max_exp_avg_sq` first so that no suffix test can take it for
/// `exp_avg_sq`.
const ENTRIES: [&str; 4] = ["max_exp_avg_sq", "exp_avg_sq", "exp_avg", "step"];
/// The group's entries.
const GROUP: [&str; 7] =
    ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"];
const GROUP_PREFIX: &str = "param_groups.0.";

/// `values` (a parameter's moment) as a tensor of `dims`, copied into memory that is checked
/// before it is taken.
fn tensor_of<T: WithDType>(values: &[T], dims: &[usize]) -> Result<Tensor> {
    let mut out = crate::alloc::try_empty(values.len(), "AdamW state")?;
    out.extend_from_slice(values);
    Ok(Tensor::from_vec(out, dims, &Device::Cpu)?)
}

/// A parameter's moments (and running maximum) as tensors of its shape.
fn moment_tensors<T: WithDType>(
    a: &Arrays<T>,
    dims: &[usize],
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let vmax = a.vmax.as_deref().map(|w| tensor_of(w, dims)).transpose()?;
    Ok((tensor_of(&a.m, dims)?, tensor_of(&a.v, dims)?, vmax))
}

/// One parameter's entries found in a loaded state, by entry name.
type Found<'a> = BTreeMap<&'static str, &'a Tensor>;

impl AdamW {
    /// The optimiser's state as PyTorch's `optimizer.state_dict()` holds it, flattened into
    /// named tensors (the module's keys above): the step count and moments of every parameter
    /// that has taken a step, and the hyper-parameters. Load it with
    /// [`AdamW::load_state_dict`]; write it with [`AdamW::save_state`].
    ///
    /// # Shapes
    /// * `state.{key}.exp_avg`, `.exp_avg_sq`, `.max_exp_avg_sq`: the parameter's shape.
    /// * `state.{key}.step`, `param_groups.0.*`: 0-dim, but `betas`: `(2,)`.
    ///
    /// # Errors
    /// [`Error::Alloc`]-like candle errors when the copies cannot be allocated.
    ///
    /// # Example
    /// ```
    /// use candle_core::{Device, Tensor, Var};
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// use multihead::optim::AdamW;
    ///
    /// let w = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &Device::Cpu)?)?;
    /// let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    /// opt.backward_step(&w.as_tensor().sqr()?.sum_all()?)?;
    /// let state: std::collections::HashMap<_, _> = opt.state_dict()?.into_iter().collect();
    /// assert_eq!(state["state.0.step"].to_scalar::<f32>()?, 1.0);
    /// assert_eq!(state["state.0.exp_avg"].dims(), &[2]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for s in self.vars.iter().filter(|s| s.stored) {
            let dims = s.var.dims();
            let k = |e: &str| format!("state.{}.{e}", s.key);
            // PyTorch keeps the step as an f32 tensor (exact to 2^24 steps).
            out.push((k("step"), Tensor::new(s.step as f32, &Device::Cpu)?));
            let (m, v, vmax) = match &s.moments {
                Moments::F32(a) => moment_tensors(a, dims)?,
                Moments::F64(a) => moment_tensors(a, dims)?,
                Moments::BF16(a) => moment_tensors(a, dims)?,
            };
            out.push((k("exp_avg"), m));
            out.push((k("exp_avg_sq"), v));
            if let Some(w) = vmax {
                out.push((k("max_exp_avg_sq"), w));
            }
        }
        let p = &self.params;
        let dev = &Device::Cpu;
        let g = |e: &str| format!("{GROUP_PREFIX}{e}");
        out.push((g("lr"), Tensor::new(p.lr, dev)?));
        out.push((g("betas"), Tensor::new(&[p.beta1, p.beta2], dev)?));
        out.push((g("eps"), Tensor::new(p.eps, dev)?));
        out.push((g("weight_decay"), Tensor::new(p.weight_decay, dev)?));
        let f = self.flags;
        out.push((g("amsgrad"), Tensor::new(u8::from(f.amsgrad), dev)?));
        out.push((g("maximize"), Tensor::new(u8::from(f.maximize), dev)?));
        out.push((g("decoupled_weight_decay"), Tensor::new(u8::from(f.decoupled), dev)?));
        Ok(out)
    }

    /// Writes [`AdamW::state_dict`] to a safetensors file (as
    /// [`state_dict::save_safetensors`](crate::state_dict::save_safetensors) writes).
    ///
    /// # Shapes
    /// As [`AdamW::state_dict`].
    ///
    /// # Example
    /// ```
    /// use candle_core::{Device, Tensor, Var};
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// use multihead::optim::AdamW;
    ///
    /// let w = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &Device::Cpu)?)?;
    /// let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?.amsgrad(true);
    /// opt.backward_step(&w.as_tensor().sqr()?.sum_all()?)?;
    /// let path = std::env::temp_dir().join("multihead_adamw_state_doc.safetensors");
    /// opt.save_state(&path)?;
    /// // A new optimiser (say, in the next process) takes the state and the options.
    /// let mut resumed = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    /// resumed.load_state(&path)?;
    /// assert_eq!(resumed.state_dict()?.len(), opt.state_dict()?.len());
    /// # Ok::<(), multihead::Error>(())
    /// ```
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let state = self.state_dict()?;
        crate::state_dict::save_safetensors(state.iter().map(|(k, t)| (k.as_str(), t)), path)
    }

    /// Reads a state that [`AdamW::save_state`] (or `tools/optim_state.py`) wrote and loads it
    /// with [`AdamW::load_state_dict`] (example at [`AdamW::save_state`]).
    ///
    /// # Shapes
    /// As [`AdamW::state_dict`].
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let state = crate::state_dict::load_safetensors(path, &Device::Cpu)?;
        self.load_state_dict(&state)
    }

    /// Replaces the optimiser's state with `state` (PyTorch's
    /// `optimizer.load_state_dict`): each parameter's step count and moments, and the
    /// hyper-parameters where `state` has them (`param_groups.0.*`: `lr`, `betas`, `eps` and
    /// `weight_decay` together; each flag alone). A parameter that `state` has no entry for
    /// starts again from zero moments, as PyTorch's does. Moments of another float dtype are
    /// converted to the parameter's, as PyTorch converts them.
    ///
    /// # Shapes
    /// As [`AdamW::state_dict`] writes them.
    ///
    /// # Errors
    /// [`Error::StateDictMismatch`] listing every problem at once: keys that are not this
    /// optimiser's (another parameter's key, another optimiser's entry), a parameter's entry
    /// without its `step`, `exp_avg` or `exp_avg_sq`, a moment of the wrong shape or not a
    /// float, a step that is not a whole number, hyper-parameters out of PyTorch's ranges.
    /// Nothing is changed when it fails.
    ///
    /// # Example
    /// ```
    /// use std::collections::HashMap;
    /// use candle_core::{Device, Tensor, Var};
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// use multihead::optim::AdamW;
    ///
    /// let w = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &Device::Cpu)?)?;
    /// let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    /// opt.backward_step(&w.as_tensor().sqr()?.sum_all()?)?;
    /// let mut state: HashMap<String, Tensor> = opt.state_dict()?.into_iter().collect();
    /// // Another parameter's entry is refused, naming it; nothing changes.
    /// state.insert("state.1.exp_avg".into(), Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)?);
    /// let err = opt.load_state_dict(&state).unwrap_err().to_string();
    /// assert!(err.contains("unexpected keys") && err.contains("state.1.exp_avg"));
    /// # Ok::<(), multihead::Error>(())
    /// ```
    pub fn load_state_dict(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let mut problems = Problems::default();
        let (found, group) = self.sort_keys(state, &mut problems);
        let (params, flags) = self.read_group(&group, &mut problems);
        let mut fresh = Vec::with_capacity(self.vars.len());
        for s in &self.vars {
            fresh.push(match found.get(s.key.as_str()) {
                Some(f) => read_entry(&s.key, s.var.dims(), s.var.dtype(), f, &mut problems),
                None => None,
            });
        }
        if let Err(e) = step_of(&params, flags, 1) {
            problems.bad.push((GROUP_PREFIX.trim_end_matches('.').into(), plain(e)));
        }
        problems.into_result()?;
        // Checked: now nothing can fail but an allocation of the zeros of a parameter whose
        // state is reset, made before anything is replaced.
        let mut reset = Vec::with_capacity(self.vars.len());
        for (s, f) in self.vars.iter().zip(&fresh) {
            reset.push(match (f, s.var.dtype()) {
                (Some(_), _) => None,
                (None, DType::F64) => Some(Moments::F64(Arrays::zeros(s.var.elem_count())?)),
                (None, DType::BF16) => Some(Moments::BF16(Arrays::zeros(s.var.elem_count())?)),
                (None, _) => Some(Moments::F32(Arrays::zeros(s.var.elem_count())?)),
            });
        }
        for ((s, f), r) in self.vars.iter_mut().zip(fresh).zip(reset) {
            match (f, r) {
                (Some((step, moments)), _) => (s.step, s.moments, s.stored) = (step, moments, true),
                (None, Some(moments)) => (s.step, s.moments, s.stored) = (0, moments, false),
                (None, None) => {}
            }
        }
        (self.params, self.flags) = (params, flags);
        Ok(())
    }

    /// Sorts `state`'s keys into the parameters' entries and the group's, noting the others.
    fn sort_keys<'a>(
        &self,
        state: &'a HashMap<String, Tensor>,
        problems: &mut Problems,
    ) -> (HashMap<&'a str, Found<'a>>, BTreeMap<&'static str, &'a Tensor>) {
        let keys: std::collections::HashSet<&str> =
            self.vars.iter().map(|s| s.key.as_str()).collect();
        let mut found: HashMap<&str, Found> = HashMap::new();
        let mut group = BTreeMap::new();
        for (name, t) in state {
            if let Some(field) = name.strip_prefix(GROUP_PREFIX) {
                if let Some(f) = GROUP.iter().find(|f| **f == field) {
                    group.insert(*f, t);
                    continue;
                }
            } else if let Some(rest) = name.strip_prefix("state.") {
                let hit = ENTRIES.iter().find_map(|e| {
                    let key = rest.strip_suffix(e)?.strip_suffix('.')?;
                    keys.contains(key).then_some((key, *e))
                });
                if let Some((key, entry)) = hit {
                    found.entry(key).or_default().insert(entry, t);
                    continue;
                }
            }
            problems.unexpected.push(name.clone());
        }
        (found, group)
    }

    /// The hyper-parameters `group` sets, over the optimiser's own.
    fn read_group(
        &self,
        group: &BTreeMap<&'static str, &Tensor>,
        problems: &mut Problems,
    ) -> (ParamsAdamW, Flags) {
        let (mut p, mut f) = (self.params.clone(), self.flags);
        let key = |e: &str| format!("{GROUP_PREFIX}{e}");
        let numbers = ["lr", "betas", "eps", "weight_decay"];
        let given = numbers.iter().filter(|e| group.contains_key(*e)).count();
        if given > 0 && given < numbers.len() {
            for e in numbers.iter().filter(|e| !group.contains_key(*e)) {
                problems.missing.push(key(e));
            }
        }
        let read = |e: &'static str, n: usize, problems: &mut Problems| -> Option<Vec<f64>> {
            let t = group.get(e)?;
            match scalars(t, n) {
                Ok(v) => Some(v),
                Err(msg) => {
                    problems.bad.push((key(e), msg));
                    None
                }
            }
        };
        if given == numbers.len() {
            let got = (
                read("lr", 1, problems),
                read("betas", 2, problems),
                read("eps", 1, problems),
                read("weight_decay", 1, problems),
            );
            if let (Some(lr), Some(b), Some(eps), Some(wd)) = got {
                p = ParamsAdamW {
                    lr: lr[0],
                    beta1: b[0],
                    beta2: b[1],
                    eps: eps[0],
                    weight_decay: wd[0],
                };
            }
        }
        for (e, flag) in [
            ("amsgrad", &mut f.amsgrad),
            ("maximize", &mut f.maximize),
            ("decoupled_weight_decay", &mut f.decoupled),
        ] {
            match read(e, 1, problems).map(|v| v[0]) {
                Some(x) if x == 0.0 || x == 1.0 => *flag = x == 1.0,
                Some(x) => problems.bad.push((key(e), format!("must be 0 or 1, got {x}"))),
                None => {}
            }
        }
        (p, f)
    }
}

/// One parameter's step count and moments from its entries, or `None` with its problems noted.
fn read_entry(
    key: &str,
    dims: &[usize],
    dtype: DType,
    f: &Found,
    problems: &mut Problems,
) -> Option<(u64, Moments)> {
    let name = |e: &str| format!("state.{key}.{e}");
    for e in ["step", "exp_avg", "exp_avg_sq"] {
        if !f.contains_key(e) {
            problems.missing.push(name(e));
        }
    }
    let step = f.get("step").and_then(|t| match scalars(t, 1) {
        Ok(v) if v[0] >= 0.0 && v[0] <= 9.007_199_254_740_992e15 && v[0].fract() == 0.0 => {
            Some(v[0] as u64)
        }
        Ok(v) => {
            let msg = format!("must be a whole number of steps, got {}", v[0]);
            problems.bad.push((name("step"), msg));
            None
        }
        Err(msg) => {
            problems.bad.push((name("step"), msg));
            None
        }
    });
    let mut moment = |e: &str| -> Option<Tensor> {
        let t = f.get(e)?;
        if t.dims() != dims || !t.dtype().is_float() {
            let msg = format!(
                "is {} {:?} but its parameter {} {dtype:?}; pass the state of this parameter",
                fmt_shape(t.dims()),
                t.dtype(),
                fmt_shape(dims)
            );
            problems.bad.push((name(e), msg));
            return None;
        }
        // The library's conversion: f64 to bf16 through f32, as PyTorch's cast goes (candle's
        // direct conversion can round a value just below a tie the other way).
        match crate::fused::convert::to_dtype(t, dtype).and_then(|t| t.flatten_all()) {
            Ok(t) => Some(t),
            Err(c) => {
                problems.bad.push((name(e), plain(c)));
                None
            }
        }
    };
    let (m, v) = (moment("exp_avg"), moment("exp_avg_sq"));
    let w = f.contains_key("max_exp_avg_sq").then(|| moment("max_exp_avg_sq"));
    let (step, m, v) = (step?, m?, v?);
    let w = match w {
        Some(None) => return None,
        Some(Some(w)) => Some(w),
        None => None,
    };
    let moments = match dtype {
        DType::F64 => arrays(&m, &v, w.as_ref()).map(Moments::F64),
        DType::BF16 => arrays(&m, &v, w.as_ref()).map(Moments::BF16),
        _ => arrays(&m, &v, w.as_ref()).map(Moments::F32),
    };
    match moments {
        Ok(moments) => Some((step, moments)),
        Err(c) => {
            problems.bad.push((name("exp_avg"), plain(c)));
            None
        }
    }
}

fn arrays<T: WithDType>(
    m: &Tensor,
    v: &Tensor,
    w: Option<&Tensor>,
) -> candle_core::Result<Arrays<T>> {
    Ok(Arrays { m: m.to_vec1()?, v: v.to_vec1()?, vmax: w.map(|w| w.to_vec1()).transpose()? })
}

/// The `n` values of a small tensor of any dtype, as f64.
fn scalars(t: &Tensor, n: usize) -> std::result::Result<Vec<f64>, String> {
    if t.elem_count() != n || t.rank() > 1 {
        let want = if n == 1 { "a 0-dim tensor".to_string() } else { format!("{n} values") };
        return Err(format!("must be {want}, got shape {}", fmt_shape(t.dims())));
    }
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .map_err(|e| e.to_string())
}

/// A candle error's message without candle's wrapping.
fn plain(e: candle_core::Error) -> String {
    match Error::from(e) {
        Error::Candle(candle_core::Error::Wrapped(w)) => w.to_string(),
        other => other.to_string(),
    }
}

/// Every problem a load found, reported at once.
#[derive(Default)]
struct Problems {
    missing: Vec<String>,
    unexpected: Vec<String>,
    bad: Vec<(String, String)>,
}

impl Problems {
    fn into_result(mut self) -> Result<()> {
        if self.missing.is_empty() && self.unexpected.is_empty() && self.bad.is_empty() {
            return Ok(());
        }
        self.missing.sort();
        self.unexpected.sort();
        self.bad.sort();
        let hint = "an AdamW state holds state.{key}.step, .exp_avg, .exp_avg_sq and \
                    .max_exp_avg_sq for each parameter key (its position in the variables \
                    given to AdamW::new, or its name with AdamW::from_varmap), and \
                    param_groups.0.*; save it with AdamW::save_state or convert PyTorch's \
                    with tools/optim_state.py"
            .to_string();
        Err(Error::StateDictMismatch {
            missing: self.missing,
            unexpected: self.unexpected,
            mismatched: self.bad,
            hint,
        })
    }
}
