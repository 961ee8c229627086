//! Helpers shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead::{MhaConfig, MultiheadAttention, NamedParameters};
use multihead_parity::Tolerance;

pub fn dev() -> Device {
    Device::Cpu
}

/// A deterministic pseudo-random tensor (sin-based, so the tests need no RNG state).
pub fn det(shape: &[usize], dtype: DType, salt: f64) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n).map(|i| ((i as f64 + 1.0) * 0.7311 + salt * 13.17).sin()).collect();
    Tensor::from_vec(data, shape, &dev()).and_then(|t| t.to_dtype(dtype)).expect("tensor")
}

/// Builds an MHA whose parameters are deterministic, non-trivial values (biases included).
pub fn mha(cfg: MhaConfig, dtype: DType) -> (MultiheadAttention, VarMap) {
    let vm = VarMap::new();
    let m =
        MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, dtype, &dev())).expect("builds");
    for (i, (_, t)) in m.named_parameters().iter().enumerate() {
        let data = vm.data().lock().expect("lock");
        for var in data.values() {
            if var.as_tensor().id() == t.id() {
                let v = det(t.dims(), dtype, i as f64 + 0.5).affine(0.4, 0.0).expect("affine");
                var.set(&v).expect("set");
            }
        }
    }
    (m, vm)
}

/// An f32 `nn.LayerNorm(d)` (eps 1e-5, with a bias) at its initial values, and its variables.
pub fn layer_norm_f32(d: usize) -> (multihead::LayerNorm, VarMap) {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    (multihead::LayerNorm::new(d, 1e-5, true, vb).expect("builds"), vm)
}

pub fn var(t: &Tensor) -> Var {
    Var::from_tensor(t).expect("var")
}

pub fn assert_close(actual: &Tensor, expected: &Tensor, tol: Tolerance, what: &str) {
    let c = tol.compare(actual, expected).expect("compare");
    assert!(
        c.passed(),
        "{what}: max|diff| {:.3e} ({:.2}x tolerance), shapes {:?} vs {:?}",
        c.max_abs,
        c.worst_ratio,
        actual.dims(),
        expected.dims()
    );
}

/// Gives every variable of `vm` deterministic non-trivial values in `dtype` (norm weights
/// around 1).
pub fn perturb(vm: &VarMap, dtype: DType) {
    let data = vm.data().lock().expect("lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.iter().enumerate() {
        let v = &data[*name];
        let base = if name.contains("norm") && name.ends_with("weight") { 1.0 } else { 0.0 };
        let t = det(v.dims(), DType::F64, i as f64).affine(0.3, base).expect("affine");
        v.set(&t.to_dtype(dtype).expect("dtype")).expect("set");
    }
}

/// The f32 bits of every element of `t` (widened exactly from bf16 or f16): for bit-for-bit
/// comparisons.
pub fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.to_dtype(DType::F32).expect("widen").flatten_all().expect("flatten");
    t.to_vec1::<f32>().expect("values").iter().map(|v| v.to_bits()).collect()
}
