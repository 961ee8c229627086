//! `multihead::optim::AdamW` against `torch.optim.AdamW` (`tools/adamw_golden.py`): four steps
//! of two configurations in f32 and f64, with a parameter skipped on one step and the learning
//! rate changed; and its refusals.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
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

/// Replays one configuration's steps with the optimiser `make` builds over the parameters, and
/// returns the worst relative difference to PyTorch's parameters after any step.
fn replay<O: Optimizer>(
    t: &HashMap<String, Tensor>,
    prefix: &str,
    make: impl FnOnce(Vec<Var>) -> O,
    lr_at_3: f64,
    floor: f64,
) -> f64 {
    let vars: Vec<Var> =
        (0..3).map(|i| Var::from_tensor(&t[&format!("{prefix}.p{i}.init")]).unwrap()).collect();
    let mut opt = make(vars.clone());
    let lr = opt.learning_rate();
    let mut worst_seen: f64 = 0.0;
    for s in 1..=4 {
        if s == 3 {
            opt.set_learning_rate(lr * lr_at_3);
        }
        let mut grads = empty_grads();
        for (i, v) in vars.iter().enumerate() {
            if let Some(g) = t.get(&format!("{prefix}.p{i}.grad{s}")) {
                grads.insert(v.as_tensor(), g.clone());
            }
        }
        opt.step(&grads).unwrap();
        for (i, v) in vars.iter().enumerate() {
            let want = &t[&format!("{prefix}.p{i}.after{s}")];
            worst_seen = worst_seen.max(worst(v.as_tensor(), want, floor));
        }
    }
    worst_seen
}

#[test]
fn adamw_follows_torch_optim_adamw_step_by_step() {
    let (t, meta) = golden();
    let configs: serde_json::Value = serde_json::from_str(&meta["configs"]).unwrap();
    let lr_at_3: f64 = meta["lr_at_3"].parse().unwrap();
    for (name, cfg) in configs.as_object().unwrap() {
        let f = |k: &str| cfg[k].as_f64().unwrap();
        let params = ParamsAdamW {
            lr: f("lr"),
            beta1: cfg["betas"][0].as_f64().unwrap(),
            beta2: cfg["betas"][1].as_f64().unwrap(),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
        };
        // f64: PyTorch's bits (measured: 0). f32: PyTorch's MKL square root is an ulp off for
        // about one element in six, so a few ulps of the parameter after four steps (measured:
        // 1.8e-7 and 3.0e-7).
        for (dtype, tol) in [("f32", 5e-7), ("f64", 0.0)] {
            let make = |vars| AdamW::new(vars, params.clone()).unwrap();
            let got = replay(&t, &format!("{name}.{dtype}"), make, lr_at_3, 1e-3);
            assert!(got <= tol, "{name} {dtype}: worst relative difference {got:e} > {tol:e}");
        }
    }
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
    let bf16 = Var::zeros(4, DType::BF16, &dev).unwrap();
    let err = AdamW::new(vec![bf16], ParamsAdamW::default()).unwrap_err().to_string();
    assert!(err.contains("AdamW: vars:") && err.contains("BF16") && err.contains("f32"), "{err}");

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
