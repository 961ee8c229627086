//! `multihead::optim::AdamW` against `torch.optim.AdamW` and `Adam` (`tools/adamw_golden.py`):
//! four steps of five configurations (`amsgrad`, `maximize` and Adam's L2 decay among them) in
//! f32, f64 and bf16, with a parameter skipped on one step and the learning rate changed; its state
//! against PyTorch's `optimizer.state_dict()`, training resumed from PyTorch's state and from
//! its own; and its refusals.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW, VarMap};
use multihead::optim::AdamW;

fn golden() -> (HashMap<String, Tensor>, HashMap<String, String>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/optim/adamw.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    (tensors, meta)
}

/// A gradient store holding no variable's gradient (candle makes them only in a backward).
fn empty_grads() -> GradStore {
    Tensor::new(0f32, &Device::Cpu).unwrap().backward().unwrap()
}

/// Largest |a − b| / (|b| + floor) over the elements.
fn worst(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs() / (y.abs() + floor)).fold(0.0, f64::max)
}

/// The golden gradients of step `s` for `vars` (none for a parameter the step skips).
fn grads_at(t: &HashMap<String, Tensor>, prefix: &str, vars: &[Var], s: usize) -> GradStore {
    let mut grads = empty_grads();
    for (i, v) in vars.iter().enumerate() {
        if let Some(g) = t.get(&format!("{prefix}.p{i}.grad{s}")) {
            grads.insert(v.as_tensor(), g.clone());
        }
    }
    grads
}

/// The three golden parameters as PyTorch had them at `when` (`init`, `after2`, ...).
fn vars_at(t: &HashMap<String, Tensor>, prefix: &str, when: &str) -> Vec<Var> {
    (0..3).map(|i| Var::from_tensor(&t[&format!("{prefix}.p{i}.{when}")]).unwrap()).collect()
}

/// Replays one configuration's steps with the optimiser `make` builds over the parameters, and
/// returns the worst relative difference to PyTorch's parameters after any step.
fn replay<O: Optimizer>(
    t: &HashMap<String, Tensor>,
    prefix: &str,
    make: impl FnOnce(Vec<Var>) -> O,
    lr_at_3: f64,
    floor: f64,
) -> f64 {
    let vars = vars_at(t, prefix, "init");
    let mut opt = make(vars.clone());
    let lr = opt.learning_rate();
    let mut worst_seen: f64 = 0.0;
    for s in 1..=4 {
        if s == 3 {
            opt.set_learning_rate(lr * lr_at_3);
        }
        opt.step(&grads_at(t, prefix, &vars, s)).unwrap();
        for (i, v) in vars.iter().enumerate() {
            let want = &t[&format!("{prefix}.p{i}.after{s}")];
            worst_seen = worst_seen.max(worst(v.as_tensor(), want, floor));
        }
    }
    worst_seen
}

/// One configuration of the golden file: its hyper-parameters, options, and parameter names
/// (for the configuration whose state is keyed by name).
#[derive(Clone)]
struct Config {
    name: String,
    params: ParamsAdamW,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    names: Option<Vec<String>>,
}

fn configs(meta: &HashMap<String, String>) -> Vec<Config> {
    let configs: serde_json::Value = serde_json::from_str(&meta["configs"]).unwrap();
    let names: serde_json::Value = serde_json::from_str(&meta["names"]).unwrap();
    let mut out = Vec::new();
    for (name, cfg) in configs.as_object().unwrap() {
        let f = |k: &str| cfg[k].as_f64().unwrap();
        let flag = |k: &str, default: bool| cfg.get(k).and_then(|v| v.as_bool()).unwrap_or(default);
        out.push(Config {
            name: name.clone(),
            params: ParamsAdamW {
                lr: f("lr"),
                beta1: cfg["betas"][0].as_f64().unwrap(),
                beta2: cfg["betas"][1].as_f64().unwrap(),
                eps: f("eps"),
                weight_decay: f("weight_decay"),
            },
            amsgrad: flag("amsgrad", false),
            maximize: flag("maximize", false),
            decoupled: flag("decoupled_weight_decay", true),
            names: names.get(name).map(|n| {
                n.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
            }),
        });
    }
    assert_eq!(out.len(), 5, "the golden file's configurations");
    out
}

impl Config {
    /// The optimiser over `vars`, keyed by name (through a `VarMap`) where the configuration
    /// has names.
    fn build(&self, vars: Vec<Var>) -> AdamW {
        let opt = match &self.names {
            Some(names) => {
                let map = VarMap::new();
                let mut data = map.data().lock().unwrap();
                for (n, v) in names.iter().zip(&vars) {
                    data.insert(n.clone(), v.clone());
                }
                drop(data);
                AdamW::from_varmap(&map, self.params.clone()).unwrap()
            }
            None => AdamW::new(vars, self.params.clone()).unwrap(),
        };
        opt.amsgrad(self.amsgrad).maximize(self.maximize).decoupled_weight_decay(self.decoupled)
    }

    /// The key of parameter `i`'s state.
    fn key(&self, i: usize) -> String {
        self.names.as_ref().map_or(i.to_string(), |n| n[i].clone())
    }
}

/// Largest |a − b| (in f64).
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Largest |b|.
fn max_abs(b: &Tensor) -> f64 {
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    b.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// The golden file's state after step `s` (`{prefix}.state{s}.*`), its prefix taken off.
fn state_at(t: &HashMap<String, Tensor>, prefix: &str, s: usize) -> HashMap<String, Tensor> {
    let p = format!("{prefix}.state{s}.");
    t.iter().filter_map(|(k, v)| Some((k.strip_prefix(&p)?.to_string(), v.clone()))).collect()
}

// PyTorch's MKL square root is an ulp off for about one f32 element in six and one f64 element
// in seventy. f32: a few ulps of the parameter after four steps (measured: up to 2.0e-7). f64:
// PyTorch's bits in four configurations, an ulp in the fifth (measured: 3.1e-16). bf16: each
// operation rounded to bf16 as PyTorch rounds it, its bits (measured: 0).
const TOLS: [(&str, f64); 3] = [("f32", 5e-7), ("f64", 5e-16), ("bf16", 0.0)];

#[test]
fn adamw_follows_torch_optim_adamw_step_by_step() {
    let (t, meta) = golden();
    let lr_at_3: f64 = meta["lr_at_3"].parse().unwrap();
    for cfg in configs(&meta) {
        for (dtype, tol) in TOLS {
            let got = replay(&t, &format!("{}.{dtype}", cfg.name), |v| cfg.build(v), lr_at_3, 1e-3);
            assert!(
                got <= tol,
                "{} {dtype}: worst relative difference {got:e} > {tol:e}",
                cfg.name
            );
        }
    }
}

/// After four steps the saved state is PyTorch's `optimizer.state_dict()` (as
/// `tools/optim_state.py` writes it): the same keys, step counts and hyper-parameters, and the
/// moments within the parameters' tolerance.
#[test]
fn adamw_state_dict_is_pytorchs() {
    let (t, meta) = golden();
    let lr_at_3: f64 = meta["lr_at_3"].parse().unwrap();
    for cfg in configs(&meta) {
        for (dtype, tol) in TOLS {
            let prefix = format!("{}.{dtype}", cfg.name);
            let vars = vars_at(&t, &prefix, "init");
            let mut opt = cfg.build(vars.clone());
            for s in 1..=4 {
                if s == 3 {
                    opt.set_learning_rate(cfg.params.lr * lr_at_3);
                }
                opt.step(&grads_at(&t, &prefix, &vars, s)).unwrap();
            }
            let ours: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
            let want = state_at(&t, &prefix, 4);
            let mut keys: Vec<_> = ours.keys().collect();
            let mut want_keys: Vec<_> = want.keys().collect();
            keys.sort();
            want_keys.sort();
            assert_eq!(keys, want_keys, "{prefix}");
            for (k, w) in &want {
                let o = &ours[k];
                assert_eq!((o.dims(), o.dtype()), (w.dims(), w.dtype()), "{prefix} {k}");
                // The moments: their relative difference, floored at a thousandth of the
                // largest (the same few ulps as the parameters).
                let scale = w.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
                let floor = scale.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap() * 1e-3;
                let d = worst(o, w, floor.max(f64::MIN_POSITIVE));
                let tol =
                    if k.contains("param_groups") || k.ends_with(".step") { 0.0 } else { tol };
                if dtype == "bf16" && cfg.name == "adam_l2" && !k.starts_with("param_groups") {
                    // Adam's L2 sum on the elements of PyTorch's scalar remainder loop (up to
                    // 31 at the end of each thread's range, here most of the two small
                    // parameters) rounds its product to bf16 first (kernels' optim/bf16.rs):
                    // a bf16 ulp of that gradient, carried into the moments, where a small
                    // moment beside a large gradient reads it as several of its own ulps. So
                    // against the tensor's largest value: within a few bf16 ulps of it
                    // (measured: 2^-7.2).
                    let u = max_diff(o, w) / max_abs(w);
                    assert!(u <= 2f64.powi(-6), "{prefix} {k}: {u:e} of the largest value");
                } else {
                    assert!(d <= tol, "{prefix} {k}: {d:e} > {tol:e}");
                }
            }
            // The key of the parameter the second step skipped counts one step less.
            let step = ours[&format!("state.{}.step", cfg.key(1))].to_scalar::<f32>().unwrap();
            assert_eq!(step, 3.0, "{prefix}");
        }
    }
}

/// PyTorch's state after two steps, loaded into a new optimiser over PyTorch's parameters of
/// that moment, takes steps three and four as PyTorch took them.
#[test]
fn adamw_resumes_from_pytorchs_state() {
    let (t, meta) = golden();
    let lr_at_3: f64 = meta["lr_at_3"].parse().unwrap();
    for cfg in configs(&meta) {
        for (dtype, tol) in TOLS {
            let prefix = format!("{}.{dtype}", cfg.name);
            let vars = vars_at(&t, &prefix, "after2");
            // Built with the defaults: the loaded state brings the hyper-parameters and flags.
            let fresh = Config {
                params: ParamsAdamW::default(),
                amsgrad: false,
                maximize: false,
                decoupled: true,
                ..cfg.clone()
            };
            let mut opt = fresh.build(vars.clone());
            opt.load_state_dict(&state_at(&t, &prefix, 2)).unwrap();
            assert_eq!(opt.learning_rate(), cfg.params.lr, "{prefix}");
            let mut seen: f64 = 0.0;
            for s in 3..=4 {
                if s == 3 {
                    opt.set_learning_rate(cfg.params.lr * lr_at_3);
                }
                opt.step(&grads_at(&t, &prefix, &vars, s)).unwrap();
                for (i, v) in vars.iter().enumerate() {
                    let want = &t[&format!("{prefix}.p{i}.after{s}")];
                    seen = seen.max(worst(v.as_tensor(), want, 1e-3));
                }
            }
            assert!(seen <= tol, "{prefix}: resumed {seen:e} > {tol:e}");
        }
    }
}

/// Two steps, a save to a file, a new optimiser loading it, two more steps: the bits of four
/// steps in one optimiser, in f32, f64 and bf16, with `amsgrad`.
#[test]
fn adamw_saved_state_resumes_bit_for_bit() {
    let (t, meta) = golden();
    let cfg = configs(&meta).into_iter().find(|c| c.name == "amsgrad_maximize").unwrap();
    let dir = tempfile::tempdir().unwrap();
    for dtype in ["f32", "f64", "bf16"] {
        let prefix = format!("{}.{dtype}", cfg.name);
        let straight = vars_at(&t, &prefix, "init");
        let mut opt = cfg.build(straight.clone());
        for s in 1..=4 {
            opt.step(&grads_at(&t, &prefix, &straight, s)).unwrap();
        }
        let resumed = vars_at(&t, &prefix, "init");
        let mut first = cfg.build(resumed.clone());
        for s in 1..=2 {
            first.step(&grads_at(&t, &prefix, &resumed, s)).unwrap();
        }
        let path = dir.path().join(format!("{dtype}.safetensors"));
        first.save_state(&path).unwrap();
        drop(first);
        let mut second = AdamW::new(resumed.clone(), ParamsAdamW::default()).unwrap();
        second.load_state(&path).unwrap();
        for s in 3..=4 {
            second.step(&grads_at(&t, &prefix, &resumed, s)).unwrap();
        }
        for (a, b) in straight.iter().zip(&resumed) {
            let bits = |v: &Var| {
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            };
            assert_eq!(bits(a), bits(b), "{dtype}");
        }
    }
}

/// A state that is not this optimiser's is refused with every problem named, and nothing is
/// changed.
#[test]
fn adamw_load_state_refuses_what_does_not_fit() {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::new(&[0.5f32, -0.5], &dev).unwrap()).unwrap();
    let mut opt = AdamW::new(vec![w.clone(), b.clone()], ParamsAdamW::default()).unwrap();
    opt.backward_step(
        &(w.as_tensor().sum_all().unwrap() + b.as_tensor().sqr().unwrap().sum_all().unwrap())
            .unwrap(),
    )
    .unwrap();
    let good: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    let before = good.clone();
    let check = |state: HashMap<String, Tensor>, wants: &[&str], opt: &mut AdamW| {
        let err = opt.load_state_dict(&state).unwrap_err().to_string();
        for want in wants {
            assert!(err.contains(want), "{want:?} not in {err}");
        }
        assert!(err.starts_with("load_state_dict:") && err.contains("AdamW::save_state"), "{err}");
        // Unchanged: the state, and the hyper-parameters.
        let now: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
        for (k, v) in &before {
            let same = now[k]
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
                == v.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            assert!(same, "{k} changed by a refused load");
        }
    };
    let with = |k: &str, t: Tensor| {
        let mut s = good.clone();
        s.insert(k.to_string(), t);
        s
    };
    let without = |k: &str| {
        let mut s = good.clone();
        s.remove(k);
        s
    };
    let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev).unwrap();
    // Another parameter's key, and an entry PyTorch's Adam does not have.
    check(with("state.2.exp_avg", z(&[2])), &["unexpected keys", "state.2.exp_avg"], &mut opt);
    check(with("state.0.momentum_buffer", z(&[2, 2])), &["state.0.momentum_buffer"], &mut opt);
    // An incomplete entry; a wrong shape; an integer moment.
    check(without("state.1.exp_avg_sq"), &["missing keys", "state.1.exp_avg_sq"], &mut opt);
    check(
        with("state.0.exp_avg", z(&[4])),
        &["state.0.exp_avg: is (4,) F32 but its parameter (2, 2) F32"],
        &mut opt,
    );
    let ints = Tensor::zeros((2, 2), DType::U8, &dev).unwrap();
    check(with("state.0.exp_avg_sq", ints), &["state.0.exp_avg_sq", "U8"], &mut opt);
    // Steps that are not whole numbers of steps.
    for bad in [-1.0f32, 2.5, f32::NAN] {
        check(
            with("state.1.step", Tensor::new(bad, &dev).unwrap()),
            &["state.1.step: must be a whole number"],
            &mut opt,
        );
    }
    check(with("state.1.step", z(&[3])), &["state.1.step: must be a 0-dim tensor"], &mut opt);
    // Hyper-parameters: out of range, incomplete, a flag that is not 0 or 1.
    let betas = Tensor::new(&[0.9f64, 1.5], &dev).unwrap();
    check(with("param_groups.0.betas", betas), &["beta2", "[0, 1)"], &mut opt);
    check(without("param_groups.0.eps"), &["missing keys", "param_groups.0.eps"], &mut opt);
    check(
        with("param_groups.0.amsgrad", Tensor::new(2u8, &dev).unwrap()),
        &["param_groups.0.amsgrad: must be 0 or 1"],
        &mut opt,
    );

    // What does fit: f64 moments converted to the f32 parameter's dtype; a parameter without
    // an entry starts again.
    let mut ok = without("state.1.step");
    ok.remove("state.1.exp_avg");
    ok.remove("state.1.exp_avg_sq");
    ok.insert("state.0.exp_avg".into(), good["state.0.exp_avg"].to_dtype(DType::F64).unwrap());
    opt.load_state_dict(&ok).unwrap();
    let now: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    assert!(!now.contains_key("state.1.step"), "parameter 1's state was not reset");
    assert_eq!(now["state.0.exp_avg"].dtype(), DType::F32);
}
/// candle's own AdamW differs from PyTorch's (one step count for all parameters, the moments
/// scaled before the square root): on the step a parameter skips, by far more than ours.
#[test]
fn candles_adamw_is_further_from_pytorch_than_this_one() {
    let (t, meta) = golden();
    let lr_at_3: f64 = meta["lr_at_3"].parse().unwrap();
    let params = ParamsAdamW { lr: 2e-3, weight_decay: 1e-2, ..Default::default() };
    let ours = |vars| AdamW::new(vars, params.clone()).unwrap();
    let ours = replay(&t, "default.f64", ours, lr_at_3, 1e-3);
    let theirs = |vars| candle_nn::AdamW::new(vars, params.clone()).unwrap();
    let worst_seen = replay(&t, "default.f64", theirs, lr_at_3, 1e-3);
    assert!(worst_seen > 1e3 * ours.max(1e-16), "candle {worst_seen:e}, ours {ours:e}");
}

#[test]
fn adamw_refuses_what_it_cannot_update() {
    let dev = Device::Cpu;
    let f16 = Var::zeros(4, DType::F16, &dev).unwrap();
    let err = AdamW::new(vec![f16], ParamsAdamW::default()).unwrap_err().to_string();
    assert!(err.contains("AdamW: vars:") && err.contains("F16") && err.contains("f32"), "{err}");

    let w = Var::zeros(3, DType::F32, &dev).unwrap();
    let err = AdamW::new(vec![w.clone(), w], ParamsAdamW::default()).unwrap_err().to_string();
    assert!(err.contains("appears twice") && err.contains("(3,)"), "{err}");

    let bad = ParamsAdamW { beta1: 1.0, ..Default::default() };
    let err = AdamW::new(vec![], bad).unwrap_err().to_string();
    assert!(err.contains("beta1") && err.contains("[0, 1)"), "{err}");

    // A good gradient for `u` and a wrong one for `w`: the step is refused as a whole.
    let u = Var::zeros(4, DType::F32, &dev).unwrap();
    let w = Var::zeros((2, 3), DType::F32, &dev).unwrap();
    let mut opt = AdamW::new(vec![u.clone(), w.clone()], ParamsAdamW::default()).unwrap();
    let mut grads = empty_grads();
    grads.insert(u.as_tensor(), Tensor::ones(4, DType::F32, &dev).unwrap());
    grads.insert(w.as_tensor(), Tensor::zeros(6, DType::F32, &dev).unwrap());
    let err = opt.step(&grads).unwrap_err().to_string();
    assert!(
        err.contains("AdamW: grads:") && err.contains("(6,)") && err.contains("(2, 3)"),
        "{err}"
    );

    // A gradient that is its parameter, or a view of another parameter: refused before any
    // parameter is written (u's good gradient comes first and stays unapplied).
    let a = Var::zeros(6, DType::F32, &dev).unwrap();
    let mut opt2 =
        AdamW::new(vec![u.clone(), a.clone(), w.clone()], ParamsAdamW::default()).unwrap();
    for alias in [w.as_tensor().clone(), a.as_tensor().reshape((2, 3)).unwrap()] {
        let mut grads = empty_grads();
        grads.insert(u.as_tensor(), Tensor::ones(4, DType::F32, &dev).unwrap());
        grads.insert(w.as_tensor(), alias);
        let err = opt2.step(&grads).unwrap_err().to_string();
        let named = err.contains("shares its storage") && err.contains("(2, 3)");
        assert!(err.starts_with("AdamW: grads:") && named, "{err}");
    }

    opt.set_learning_rate(f64::NAN);
    let mut grads = empty_grads();
    grads.insert(w.as_tensor(), Tensor::zeros((2, 3), DType::F32, &dev).unwrap());
    let err = opt.step(&grads).unwrap_err().to_string();
    assert!(err.contains("lr"), "{err}");
    // Nothing was written by the refused steps.
    assert_eq!(u.as_tensor().to_vec1::<f32>().unwrap(), vec![0.0; 4]);
    assert_eq!(w.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 6]);
}

/// A gradient given as a strided or broadcast view updates its parameter as its contiguous
/// copy does; a NaN in a gradient reaches that element only (PyTorch's arithmetic: the update
/// is element-wise).
#[test]
fn adamw_takes_views_and_keeps_nan_to_its_element() {
    let dev = Device::Cpu;
    let init = Tensor::new(&[[1.0f32, -2.0, 3.0], [0.5, 0.25, -4.0]], &dev).unwrap();
    let run = |g: &Tensor| {
        let w = Var::from_tensor(&init).unwrap();
        let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default()).unwrap();
        let mut grads = empty_grads();
        grads.insert(w.as_tensor(), g.clone());
        opt.step(&grads).unwrap();
        w.as_tensor().to_vec2::<f32>().unwrap()
    };
    // Strided: the transpose of a (3, 2) tensor.
    let t = Tensor::new(&[[0.1f32, -0.4], [0.2, 0.5], [-0.3, 0.6]], &dev).unwrap().t().unwrap();
    assert!(!t.is_contiguous());
    assert_eq!(run(&t), run(&t.contiguous().unwrap()));
    // Broadcast: one row seen twice (stride 0).
    let b = Tensor::new(&[[0.7f32, -0.1, 0.2]], &dev).unwrap().broadcast_as((2, 3)).unwrap();
    assert_eq!(run(&b), run(&b.contiguous().unwrap()));
    assert_ne!(run(&b), init.to_vec2::<f32>().unwrap(), "the step moved nothing");

    let nan = Tensor::new(&[[f32::NAN, 1.0, 1.0], [1.0, 1.0, 1.0]], &dev).unwrap();
    let got = run(&nan);
    assert!(got[0][0].is_nan());
    assert!(got.iter().flatten().skip(1).all(|x| x.is_finite()), "{got:?}");
}

/// Parameters without elements, `(0,)` and `(2, 0)`, beside one with elements: the step
/// updates the other as it would alone and counts the step for all three, as PyTorch does
/// (before 2026-12-08 every empty storage looked shared with every other, and the `(2, 0)`
/// one, whose shape gives it a zero stride, was refused by candle after the others were
/// written).
#[test]
fn adamw_steps_past_parameters_without_elements() {
    let dev = Device::Cpu;
    let w0 = Tensor::new(&[1.0f32, -2.0, 3.0], &dev).unwrap();
    let alone = Var::from_tensor(&w0).unwrap();
    let mut opt = AdamW::new(vec![alone.clone()], ParamsAdamW::default()).unwrap().amsgrad(true);
    opt.backward_step(&alone.as_tensor().sqr().unwrap().sum_all().unwrap()).unwrap();

    let w = Var::from_tensor(&w0).unwrap();
    let e = Var::zeros(0, DType::F32, &dev).unwrap();
    let z = Var::zeros((2, 0), DType::F32, &dev).unwrap();
    let mut opt = AdamW::new(vec![e.clone(), w.clone(), z.clone()], ParamsAdamW::default())
        .unwrap()
        .amsgrad(true);
    let loss = (w.as_tensor().sqr().unwrap().sum_all().unwrap()
        + z.as_tensor().sum_all().unwrap()
        + e.as_tensor().sum_all().unwrap())
    .unwrap();
    opt.backward_step(&loss).unwrap();
    assert_eq!(
        w.as_tensor().to_vec1::<f32>().unwrap(),
        alone.as_tensor().to_vec1::<f32>().unwrap()
    );
    let state: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    for i in 0..3 {
        assert_eq!(state[&format!("state.{i}.step")].to_scalar::<f32>().unwrap(), 1.0, "{i}");
    }
    assert_eq!(state["state.2.max_exp_avg_sq"].dims(), &[2, 0]);
}

/// A loaded entry with step 0 is a state PyTorch would keep: it is used by the next step and
/// saved again until then.
#[test]
fn adamw_keeps_a_loaded_entry_at_step_zero() {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &dev).unwrap()).unwrap();
    let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default()).unwrap();
    let mut state = HashMap::new();
    state.insert("state.0.step".to_string(), Tensor::new(0f32, &dev).unwrap());
    state.insert("state.0.exp_avg".to_string(), Tensor::new(&[7.0f32, 7.0], &dev).unwrap());
    state.insert("state.0.exp_avg_sq".to_string(), Tensor::new(&[1.0f32, 1.0], &dev).unwrap());
    opt.load_state_dict(&state).unwrap();
    let saved: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    assert_eq!(saved["state.0.exp_avg"].to_vec1::<f32>().unwrap(), vec![7.0, 7.0]);
    assert_eq!(saved["state.0.step"].to_scalar::<f32>().unwrap(), 0.0);
    // The next step is step 1 from those moments: m = 0.9·7 + 0.1·g.
    opt.backward_step(&w.as_tensor().sum_all().unwrap()).unwrap();
    let saved: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    let m = saved["state.0.exp_avg"].to_vec1::<f32>().unwrap();
    assert!((m[0] - 6.4).abs() < 1e-6, "{m:?}");
    assert_eq!(saved["state.0.step"].to_scalar::<f32>().unwrap(), 1.0);
}

/// A real training run resumed from files: a `TransformerEncoderLayer` trained six steps
/// (AdamW keyed by name, `amsgrad`, a learning-rate schedule) ends with the same bits as one
/// trained three steps, saved (`VarMap::save` and `AdamW::save_state`), rebuilt in a fresh
/// `VarMap` (whose hash map lists the variables in another order), loaded and trained three
/// more.
#[test]
fn a_layer_resumes_training_from_its_saved_weights_and_optimiser_state() {
    use multihead::transformer::{LayerConfig, TransformerEncoderLayer};

    let dir = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let build = |weights: &std::path::Path| {
        let mut vm = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let cfg = LayerConfig::new(16, 2)
            .with_dim_feedforward(24)
            .with_dropout(0.0)
            .with_batch_first(true);
        let layer = TransformerEncoderLayer::new(cfg, vb.pp("layer")).unwrap();
        vm.load(weights).unwrap();
        (vm, layer)
    };
    let det = |salt: f64| {
        let data: Vec<f32> =
            (0..2 * 5 * 16).map(|i| ((i as f64 * 0.7311 + salt * 13.17).sin()) as f32).collect();
        Tensor::from_vec(data, (2, 5, 16), &dev).unwrap()
    };
    let train = |vm: &VarMap,
                 layer: &TransformerEncoderLayer,
                 opt: &mut AdamW,
                 steps: std::ops::Range<usize>| {
        for s in steps {
            opt.set_learning_rate(1e-2 * (1.0 - s as f64 / 8.0));
            let y = layer.forward(&det(s as f64), None, None, false).unwrap();
            let loss = y.mul(&det(100.0 + s as f64)).unwrap().sum_all().unwrap();
            opt.backward_step(&loss).unwrap();
        }
        let mut all: Vec<(String, Vec<u32>)> = vm
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let bits = v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                (k.clone(), bits.iter().map(|x| x.to_bits()).collect())
            })
            .collect();
        all.sort();
        all
    };
    // The initial weights, from one random initialisation.
    let w0 = dir.path().join("w0.safetensors");
    {
        let vm = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let cfg = LayerConfig::new(16, 2)
            .with_dim_feedforward(24)
            .with_dropout(0.0)
            .with_batch_first(true);
        TransformerEncoderLayer::new(cfg, vb.pp("layer")).unwrap();
        vm.save(&w0).unwrap();
    }
    let params = ParamsAdamW { lr: 1e-2, weight_decay: 0.05, ..Default::default() };
    let (vm, layer) = build(&w0);
    let mut opt = AdamW::from_varmap(&vm, params.clone()).unwrap().amsgrad(true);
    let straight = train(&vm, &layer, &mut opt, 0..6);

    let (w3, s3) = (dir.path().join("w3.safetensors"), dir.path().join("s3.safetensors"));
    {
        let (vm, layer) = build(&w0);
        let mut opt = AdamW::from_varmap(&vm, params.clone()).unwrap().amsgrad(true);
        train(&vm, &layer, &mut opt, 0..3);
        vm.save(&w3).unwrap();
        opt.save_state(&s3).unwrap();
    }
    let (vm, layer) = build(&w3);
    // Built without amsgrad: the state file brings it back.
    let mut opt = AdamW::from_varmap(&vm, ParamsAdamW::default()).unwrap();
    opt.load_state(&s3).unwrap();
    let resumed = train(&vm, &layer, &mut opt, 3..6);
    assert_eq!(straight.len(), 12, "the layer's parameters");
    assert_eq!(straight, resumed);
    let (vm0, layer0) = build(&w0);
    assert_ne!(straight, train(&vm0, &layer0, &mut opt, 0..0), "nothing trained");
}

/// f64 moments loaded into a bf16 parameter's state round as PyTorch's cast does, through f32:
/// a value just below a bf16 tie rounds to f32's tie, which goes to the even bf16 above.
#[test]
fn adamw_loads_f64_moments_into_bf16_through_f32() {
    let dev = Device::Cpu;
    let w = Var::zeros(1, DType::BF16, &dev).unwrap();
    let mut opt = AdamW::new(vec![w], ParamsAdamW::default()).unwrap();
    // 1 + 2^-7 is a bf16 value with an odd last bit; 1 + 2^-7 + 2^-8 is the tie above it.
    let below_tie = 1.0 + 2f64.powi(-7) + 2f64.powi(-8) - 2f64.powi(-40);
    let mut state = HashMap::new();
    state.insert("state.0.step".to_string(), Tensor::new(1f32, &dev).unwrap());
    state.insert("state.0.exp_avg".to_string(), Tensor::new(&[below_tie], &dev).unwrap());
    state.insert("state.0.exp_avg_sq".to_string(), Tensor::new(&[below_tie], &dev).unwrap());
    opt.load_state_dict(&state).unwrap();
    let saved: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    let m = saved["state.0.exp_avg"].to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
    // torch.tensor([below_tie], dtype=torch.float64).to(torch.bfloat16) gives 1.015625.
    assert_eq!(m, vec![1.0 + 2f64.powi(-6)]);
}
