//! `multihead::optim::{ClipGradNorm, clip_grad_value}` against PyTorch's `clip_grad_norm_` and
//! `clip_grad_value_` (`tools/clip_golden.py`): every norm order, f32, f64, bf16, f16 and mixed
//! dtypes, a NaN gradient, a parameter without a gradient; and the refusals.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use multihead::optim::{clip_grad_norm, clip_grad_value, ClipGradNorm};

fn golden() -> (HashMap<String, Tensor>, serde_json::Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/optim/clip.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let cases = meta.metadata().as_ref().unwrap()["cases"].clone();
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    (tensors, serde_json::from_str(&cases).unwrap())
}

/// A gradient store holding no variable's gradient (candle makes them only in a backward).
fn empty_grads() -> GradStore {
    Tensor::new(0f32, &Device::Cpu).unwrap().backward().unwrap()
}

fn dtype(name: &str) -> DType {
    match name {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => panic!("dtype {other}"),
    }
}

/// Relative tolerance per dtype: f32 and f64 norms summed in another order than PyTorch's
/// (measured on the fixture: up to 4.8e-7 in f32 and 3.2e-16 in f64, totals and clipped
/// gradients alike); bf16 and f16 one step of their rounding (a norm that rounds the other way
/// near a tie moves every scaled gradient by one step; measured: none, every bf16, f16 and
/// mixed case has PyTorch's bits, as have the ±inf, order-0, NaN and value cases).
fn tolerance(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-14,
        DType::F32 => 2e-6,
        DType::BF16 => 1.0 / 128.0,
        _ => 1.0 / 1024.0,
    }
}

/// Whether `a` and `b` agree within `rel` of `|b|` element by element (NaN with NaN).
fn close(a: &Tensor, b: &Tensor, rel: f64) -> Result<(), String> {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    if a.len() != b.len() {
        return Err(format!("{} elements against {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let same = (x.is_nan() && y.is_nan()) || (x - y).abs() <= rel * y.abs();
        if !same {
            return Err(format!("element {i}: {x} against PyTorch's {y} (rel {rel:e})"));
        }
    }
    Ok(())
}

/// An argument: a JSON number, or a string such as "inf" (JSON has no infinities).
fn number(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| v.as_str().unwrap().parse().unwrap())
}

#[test]
fn clipping_follows_pytorch_for_every_order_and_dtype() {
    let (t, cases) = golden();
    let cases = cases.as_object().unwrap();
    assert_eq!(cases.len(), 17, "the fixture's cases");
    for (name, case) in cases {
        let dtypes: Vec<DType> =
            case["dtypes"].as_array().unwrap().iter().map(|d| dtype(d.as_str().unwrap())).collect();
        let shapes = case["shapes"].as_array().unwrap();
        let vars: Vec<Var> = shapes
            .iter()
            .zip(&dtypes)
            .map(|(s, &d)| {
                let dims: Vec<usize> =
                    s.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
                Var::zeros(dims, d, &Device::Cpu).unwrap()
            })
            .collect();
        let mut grads = empty_grads();
        for (i, v) in vars.iter().enumerate() {
            if let Some(g) = t.get(&format!("{name}.g{i}")) {
                grads.insert(v.as_tensor(), g.clone());
            }
        }
        assert!(grads.get(vars[3].as_tensor()).is_none(), "{name}: the fourth has no gradient");
        let widest = if dtypes.contains(&DType::F64) {
            DType::F64
        } else if dtypes.iter().all(|&d| d == dtypes[0]) {
            dtypes[0]
        } else {
            DType::F32
        };
        if case["kind"] == "norm" {
            let clip =
                ClipGradNorm::new(number(&case["max_norm"])).norm_type(number(&case["norm_type"]));
            let total = clip.clip(&vars, &mut grads).unwrap();
            let want = t[&format!("{name}.total")].to_dtype(DType::F64).unwrap();
            let want = want.to_scalar::<f64>().unwrap();
            let ok = (total.is_nan() && want.is_nan())
                || (total - want).abs() <= tolerance(widest) * want.abs();
            assert!(ok, "{name}: total {total} against PyTorch's {want}");
        } else {
            clip_grad_value(&vars, &mut grads, number(&case["clip_value"])).unwrap();
        }
        for (i, v) in vars.iter().enumerate().take(3) {
            let got = grads.get(v.as_tensor()).unwrap();
            assert_eq!(got.dtype(), dtypes[i], "{name}: gradient {i}'s dtype");
            // Clamping only selects: PyTorch's bits exactly.
            let rel = if case["kind"] == "value" { 0.0 } else { tolerance(dtypes[i]) };
            let want = &t[&format!("{name}.out{i}")];
            close(got, want, rel).unwrap_or_else(|e| panic!("{name}: gradient {i}: {e}"));
        }
    }
}

#[test]
fn clipping_by_a_nan_or_infinite_norm() {
    let (t, _) = golden();
    let vars: Vec<Var> = [(5usize, 1usize), (17, 3), (37, 11)]
        .iter()
        .map(|&(a, b)| {
            let dims = if b == 1 { vec![a] } else { vec![a, b] };
            Var::zeros(dims, DType::F32, &Device::Cpu).unwrap()
        })
        .collect();
    let fill = || {
        let mut grads = empty_grads();
        for (i, v) in vars.iter().enumerate() {
            grads.insert(v.as_tensor(), t[&format!("norm2_f32_nan.g{i}")].clone());
        }
        grads
    };
    // error_if_nonfinite: refused, and nothing changed.
    let mut grads = fill();
    let err = ClipGradNorm::new(1.0).error_if_nonfinite(true).clip(&vars, &mut grads).unwrap_err();
    let err = err.to_string();
    assert!(err.contains("clip_grad_norm_") && err.contains("non-finite"), "{err}");
    for (i, v) in vars.iter().enumerate() {
        let g = grads.get(v.as_tensor()).unwrap();
        close(g, &t[&format!("norm2_f32_nan.g{i}")], 0.0).unwrap();
    }
    // Without it, PyTorch's NaN everywhere (checked against the fixture above); the total is
    // NaN.
    let mut grads = fill();
    assert!(clip_grad_norm(&vars, &mut grads, 1.0).unwrap().is_nan());
}

#[test]
fn clipping_refuses_bad_arguments_and_changes_nothing() {
    let dev = Device::Cpu;
    let w = Var::zeros(3, DType::F32, &dev).unwrap();
    let u = Var::zeros((2, 2), DType::F32, &dev).unwrap();
    let mut grads = empty_grads();
    grads.insert(w.as_tensor(), Tensor::new(&[3f32, 4.0, 0.0], &dev).unwrap());
    let vars = [w.clone(), u.clone()];

    let msg = |e: multihead::Error| e.to_string();
    let e = msg(clip_grad_norm(&vars, &mut grads, -1.0).unwrap_err());
    assert!(e.contains("clip_grad_norm_: max_norm:") && e.contains("-1"), "{e}");
    let e = msg(clip_grad_norm(&vars, &mut grads, f64::NAN).unwrap_err());
    assert!(e.contains("max_norm"), "{e}");
    let e = msg(ClipGradNorm::new(1.0).norm_type(f64::NAN).clip(&vars, &mut grads).unwrap_err());
    assert!(e.contains("norm_type") && e.contains("NaN"), "{e}");
    let e = msg(clip_grad_norm(&[w.clone(), w.clone()], &mut grads, 1.0).unwrap_err());
    assert!(e.contains("appears twice") && e.contains("(3,)"), "{e}");
    let e = msg(clip_grad_value(&vars, &mut grads, -0.5).unwrap_err());
    assert!(e.contains("clip_grad_value_: clip_value:"), "{e}");

    // A wrong gradient for the second variable: refused before the first is scaled.
    grads.insert(u.as_tensor(), Tensor::zeros(4, DType::F32, &dev).unwrap());
    let e = msg(clip_grad_norm(&vars, &mut grads, 1.0).unwrap_err());
    assert!(e.contains("grads") && e.contains("(4,)") && e.contains("(2, 2)"), "{e}");
    let g = grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(g, [3.0, 4.0, 0.0], "nothing scaled");

    // The infinity norm of an empty gradient is undefined, as in PyTorch.
    let empty = Var::zeros(0, DType::F32, &dev).unwrap();
    let mut grads = empty_grads();
    grads.insert(empty.as_tensor(), Tensor::zeros(0, DType::F32, &dev).unwrap());
    let inf = ClipGradNorm::new(1.0).norm_type(f64::INFINITY);
    let e = msg(inf.clip(std::slice::from_ref(&empty), &mut grads).unwrap_err());
    assert!(e.contains("empty"), "{e}");
    // Its 2-norm is 0, and no gradients at all make a total of 0.
    assert_eq!(clip_grad_norm(&[empty], &mut grads, 1.0).unwrap(), 0.0);
    assert_eq!(clip_grad_norm(&[u], &mut empty_grads(), 1.0).unwrap(), 0.0);
}

/// `a = (1, 2)`, `b = (0, 0)` and the gradients of `sum((a + b)·(3, 4))`: candle stores the
/// add's gradient `(3, 4)` once, as both variables' gradient.
fn add_graph() -> (Var, Var, GradStore) {
    let dev = Device::Cpu;
    let a = Var::new(&[1f32, 2.0], &dev).unwrap();
    let b = Var::new(&[0f32, 0.0], &dev).unwrap();
    let y = Tensor::new(&[3f32, 4.0], &dev).unwrap();
    let sum = (a.as_tensor() + b.as_tensor()).unwrap().mul(&y).unwrap().sum_all().unwrap();
    let grads = sum.backward().unwrap();
    (a, b, grads)
}

/// Two variables holding one gradient tensor (candle stores the gradient of both inputs of an
/// add as one tensor): each is scaled once.
#[test]
fn a_gradient_shared_by_two_variables_is_scaled_once() {
    let (a, b, mut grads) = add_graph();
    // Total norm √(25 + 25); to 1: each gradient times 1/√50.
    let total = clip_grad_norm(&[a.clone(), b.clone()], &mut grads, 1.0).unwrap();
    assert!((total - 50f64.sqrt()).abs() < 1e-5, "{total}");
    for v in [&a, &b] {
        let g = grads.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        let want = [3.0 / 50f32.sqrt(), 4.0 / 50f32.sqrt()];
        assert!((g[0] - want[0]).abs() < 1e-6 && (g[1] - want[1]).abs() < 1e-6, "{g:?}");
    }
}

/// A contiguous or transposed gradient is clipped in place (a clone taken before sees it, as a
/// reference to `.grad` does in PyTorch; a transpose is written in its storage order); a
/// broadcast view is replaced by a clipped copy with its values.
#[test]
fn gradients_are_clipped_in_place_or_as_copies_with_the_same_values() {
    let dev = Device::Cpu;
    let a = Var::zeros(4, DType::F32, &dev).unwrap();
    let b = Var::zeros((3, 2), DType::F32, &dev).unwrap();
    let c = Var::zeros((2, 3), DType::F32, &dev).unwrap();
    let ga = Tensor::new(&[3f32, 0.0, -4.0, 0.0], &dev).unwrap();
    let base = Tensor::new(&[[1f32, 2.0, 3.0], [4.0, 5.0, 6.0]], &dev).unwrap();
    let gb = base.t().unwrap();
    let row = Tensor::new(&[[0.5f32, -9.0, 1.0]], &dev).unwrap();
    let gc = row.broadcast_as((2, 3)).unwrap();
    assert!(!gb.is_contiguous() && !gc.is_contiguous());
    let mut grads = empty_grads();
    grads.insert(a.as_tensor(), ga.clone());
    grads.insert(b.as_tensor(), gb.clone());
    grads.insert(c.as_tensor(), gc.clone());
    let vars = [a.clone(), b.clone(), c.clone()];
    clip_grad_value(&vars, &mut grads, 3.5).unwrap();
    assert_eq!(ga.to_vec1::<f32>().unwrap(), [3.0, 0.0, -3.5, 0.0], "in place");
    let got = grads.get(b.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(got, [[1.0, 3.5], [2.0, 3.5], [3.0, 3.5]], "the transpose's values, clamped");
    assert_eq!(base.to_vec2::<f32>().unwrap()[1], [3.5, 3.5, 3.5], "written in place");
    let got = grads.get(c.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(got, [[0.5, -3.5, 1.0], [0.5, -3.5, 1.0]], "the broadcast's values, clamped");
    assert_eq!(row.to_vec2::<f32>().unwrap(), [[0.5, -9.0, 1.0]], "a broadcast is copied");
    // 2-norm of (3, 0, -3.5, 0), the clamped transpose and the clamped broadcast:
    // √(21.25 + 50.75 + 2·13.5) = √99.
    let total = clip_grad_norm(&vars, &mut grads, 99f64.sqrt() / 2.0).unwrap();
    assert!((total - 99f64.sqrt()).abs() < 1e-5, "{total}");
    let ga_now = ga.to_vec1::<f32>().unwrap();
    assert!((ga_now[0] - 1.5).abs() < 1e-5 && (ga_now[2] + 1.75).abs() < 1e-5, "{ga_now:?}");
    let gb_now = grads.get(b.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    assert!((gb_now[2][0] - 1.5).abs() < 1e-5 && (gb_now[0][1] - 1.75).abs() < 1e-5, "{gb_now:?}");
}

/// A transposed gradient whose storage another store entry also holds is clipped into a new
/// transposed buffer with its values, the other entry kept. (candle's backward stores
/// contiguous gradients; a view comes from a caller's own `insert`.)
#[test]
fn a_shared_transposed_gradient_is_copied_with_its_layout() {
    let dev = Device::Cpu;
    let v = Var::zeros((3, 2), DType::F32, &dev).unwrap();
    let other = Var::zeros((2, 3), DType::F32, &dev).unwrap();
    let base = Tensor::new(&[[3f32, 0.0, 4.0], [0.0, -12.0, 0.0]], &dev).unwrap();
    let mut grads = empty_grads();
    grads.insert(v.as_tensor(), base.t().unwrap());
    grads.insert(other.as_tensor(), base.clone());
    let total = clip_grad_norm(std::slice::from_ref(&v), &mut grads, 1.0).unwrap();
    assert!((total - 13.0).abs() < 1e-5, "{total}");
    let got = grads.get(v.as_tensor()).unwrap();
    assert_eq!(got.dims(), [3, 2]);
    let want = [[3.0 / 13.0, 0.0], [0.0, -12.0 / 13.0], [4.0 / 13.0, 0.0]];
    for (g, w) in got.to_vec2::<f32>().unwrap().iter().flatten().zip(want.iter().flatten()) {
        assert!((*g as f64 - w).abs() < 1e-6, "{got}");
    }
    let kept = grads.get(other.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(kept, [[3.0, 0.0, 4.0], [0.0, -12.0, 0.0]]);
}

/// A gradient that is a view of a parameter (its own here) is clipped as a copy: the parameter
/// keeps its values.
#[test]
fn a_gradient_viewing_a_parameter_leaves_the_parameter_alone() {
    let dev = Device::Cpu;
    let w = Var::new(&[3f32, -4.0], &dev).unwrap();
    let mut grads = empty_grads();
    grads.insert(w.as_tensor(), w.as_tensor().clone());
    let total = clip_grad_norm(std::slice::from_ref(&w), &mut grads, 1.0).unwrap();
    assert!((total - 5.0).abs() < 1e-6, "{total}");
    assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), [3.0, -4.0]);
    let g = grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] + 0.8).abs() < 1e-6, "{g:?}");
}

/// Clipping some variables leaves the others' gradients alone, though candle stores both
/// inputs of an add with one gradient tensor (PyTorch: separate `.grad`s).
#[test]
fn clipping_a_subset_leaves_the_other_gradients_alone() {
    let (a, b, mut grads) = add_graph();
    let total = clip_grad_norm(std::slice::from_ref(&a), &mut grads, 1.0).unwrap();
    assert!((total - 5.0).abs() < 1e-6, "{total}");
    let ga = grads.get(a.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    assert!((ga[0] - 0.6).abs() < 1e-6 && (ga[1] - 0.8).abs() < 1e-6, "{ga:?}");
    assert_eq!(grads.get(b.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), [3.0, 4.0]);
    // b's own call then sees b's own gradient.
    let total = clip_grad_norm(std::slice::from_ref(&b), &mut grads, 1.0).unwrap();
    assert!((total - 5.0).abs() < 1e-6, "{total}");
    clip_grad_value(std::slice::from_ref(&a), &mut grads, 0.7).unwrap();
    let gb = grads.get(b.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    assert!((gb[0] - 0.6).abs() < 1e-6 && (gb[1] - 0.8).abs() < 1e-6, "{gb:?}");
}

/// PyTorch's refusals at the edges: a bound the gradient's dtype cannot hold, and a negative
/// order on an empty gradient; one element's norm is its magnitude even where its square
/// overflows.
#[test]
fn clipping_edges_follow_pytorch() {
    let dev = Device::Cpu;
    let h = Var::zeros(2, DType::F16, &dev).unwrap();
    let mut grads = empty_grads();
    let g16 = Tensor::new(&[1f32, -2.0], &dev).unwrap().to_dtype(DType::F16).unwrap();
    grads.insert(h.as_tensor(), g16);
    let e = clip_grad_value(std::slice::from_ref(&h), &mut grads, 70000.0).unwrap_err();
    assert!(e.to_string().contains("without overflow") && e.to_string().contains("F16"), "{e}");
    clip_grad_value(std::slice::from_ref(&h), &mut grads, f64::INFINITY).unwrap();

    let empty = Var::zeros(0, DType::F32, &dev).unwrap();
    let mut grads = empty_grads();
    grads.insert(empty.as_tensor(), Tensor::zeros(0, DType::F32, &dev).unwrap());
    let neg = ClipGradNorm::new(1.0).norm_type(-1.0);
    assert!(neg.clip(std::slice::from_ref(&empty), &mut grads).is_err());

    let w = Var::zeros(1, DType::F32, &dev).unwrap();
    let mut grads = empty_grads();
    grads.insert(w.as_tensor(), Tensor::new(&[1e20f32], &dev).unwrap());
    let total = clip_grad_norm(std::slice::from_ref(&w), &mut grads, 1.0).unwrap();
    assert_eq!(total, 1e20f32 as f64);
    assert_eq!(grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), [1.0]);
}

/// A gradient held by two store entries is written into a new buffer in every dtype, with the
/// values an unshared one gets in place.
#[test]
fn shared_gradients_get_the_in_place_values_in_every_dtype() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let vals = Tensor::new(&[3f32, -4.0, 0.5, 1e-3], &dev).unwrap().to_dtype(dtype).unwrap();
        let run = |shared: bool| {
            let w = Var::zeros(4, dtype, &dev).unwrap();
            let other = Var::zeros(4, dtype, &dev).unwrap();
            let mut grads = empty_grads();
            let g = vals.copy().unwrap();
            grads.insert(w.as_tensor(), g.clone());
            if shared {
                grads.insert(other.as_tensor(), g);
            }
            let w1 = std::slice::from_ref(&w);
            clip_grad_norm(w1, &mut grads, 1.0).unwrap();
            let normed = grads.get(w.as_tensor()).unwrap().clone();
            clip_grad_value(w1, &mut grads, 0.3).unwrap();
            let clamped = grads.get(w.as_tensor()).unwrap().clone();
            if shared {
                let kept = grads.get(other.as_tensor()).unwrap();
                close(kept, &vals, 0.0).unwrap();
            }
            (normed, clamped)
        };
        let (a, b) = (run(false), run(true));
        close(&b.0, &a.0, 0.0).unwrap_or_else(|e| panic!("{dtype:?} norm: {e}"));
        close(&b.1, &a.1, 0.0).unwrap_or_else(|e| panic!("{dtype:?} value: {e}"));
    }
}

/// An integer gradient (of an integer variable) is refused by name, before anything changes.
#[test]
fn an_integer_gradient_is_refused() {
    let dev = Device::Cpu;
    let i = Var::zeros(3, DType::I64, &dev).unwrap();
    let mut grads = empty_grads();
    grads.insert(i.as_tensor(), Tensor::new(&[1i64, -2, 3], &dev).unwrap());
    let vars = std::slice::from_ref(&i);
    let e = clip_grad_norm(vars, &mut grads, 1.0).unwrap_err().to_string();
    assert!(e.contains("clip_grad_norm_: grads:") && e.contains("I64"), "{e}");
    let e = clip_grad_value(vars, &mut grads, 1.0).unwrap_err().to_string();
    assert!(e.contains("clip_grad_value_: grads:") && e.contains("I64"), "{e}");
    assert_eq!(grads.get(i.as_tensor()).unwrap().to_vec1::<i64>().unwrap(), [1, -2, 3]);
}
