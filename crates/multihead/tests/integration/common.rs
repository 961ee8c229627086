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

/// CPU time in nanoseconds that this process's threads whose name starts with `prefix` have
/// used so far, from `/proc/self/task/*/schedstat` (or from `stat`'s clock ticks where that
/// file is absent), and how many such threads there are.
#[cfg(target_os = "linux")]
pub fn threads_cpu_ns(prefix: &str) -> (u64, usize) {
    let (mut ns, mut threads) = (0, 0);
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let dir = task.expect("a task").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        threads += 1;
        ns += match std::fs::read_to_string(dir.join("schedstat")) {
            Ok(s) => {
                s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).expect("schedstat")
            }
            Err(_) => {
                let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
                // After the name's closing parenthesis: state, then fields 4..; utime and stime
                // are fields 14 and 15.
                let rest = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
                let f: Vec<&str> = rest.split_whitespace().collect();
                let ticks: u64 =
                    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
                // SAFETY: sysconf reads a configuration value; it touches no memory of ours.
                let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
                ticks * 1_000_000_000 / hz
            }
        };
    }
    (ns, threads)
}
