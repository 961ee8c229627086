//! One hop onto rayon's pool per call (`multihead::on_pool`, and the modules' own hop for
//! calls large enough to go parallel): the call runs on a worker with the caller's modes, the
//! worker's own modes come back afterwards, and the numbers are the same bits.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::transformer::{LayerConfig, TransformerEncoder};
use multihead::{
    autocast, autocast_dtype, default_backend, grad_enabled, no_grad, on_pool, with_backend,
    Backend, Mask, MhaConfig, MhaOptions,
};
use multihead_kernels::bf16gemm::{active_bf16_kernel, with_bf16_kernel, Bf16Kernel};

use crate::common::{det, dev, mha};

#[test]
fn on_pool_runs_on_a_worker_with_the_callers_modes() {
    assert!(rayon::current_thread_index().is_none(), "the test thread is not a worker");
    assert!(on_pool(|| rayon::current_thread_index().is_some()));
    assert!(!no_grad(|| on_pool(grad_enabled)));
    assert_eq!(with_backend(Backend::Composed, || on_pool(default_backend)), Backend::Composed);
    assert_eq!(autocast(DType::BF16, || on_pool(autocast_dtype)), Some(DType::BF16));
    let k = with_bf16_kernel(Bf16Kernel::Portable, || on_pool(active_bf16_kernel));
    assert_eq!(k, Bf16Kernel::Portable);
    // Nested: already on a worker, the call runs there.
    assert!(!no_grad(|| on_pool(|| on_pool(grad_enabled))));
    // The workers keep their own modes once the calls are done (every worker is asked).
    for _ in 0..8 {
        let modes = on_pool(|| (grad_enabled(), default_backend(), autocast_dtype()));
        assert_eq!(modes, (true, Backend::Auto, None));
    }
}

/// A module call large enough to hop carries the backend: forced fused kernels on a call
/// they cannot run is still the error, not a silent composed run on the worker.
#[test]
fn a_hopping_module_call_keeps_the_backend() {
    // f64: the fused kernels take f32 only.
    let (m, _vm) = mha(MhaConfig::new(64, 4), DType::F64);
    let x = det(&[64, 2, 64], DType::F64, 1.0); // 128 rows × 64 × 192: hops
    let o = MhaOptions::default().need_weights(false);
    assert!(m.forward(&x, &x, &x, &o).is_ok());
    let forced = with_backend(Backend::Fused, || m.forward(&x, &x, &x, &o));
    assert!(forced.is_err(), "the forced backend was lost on the hop");
}

/// `no_grad` crosses the hop: an evaluating encoder large enough to hop takes PyTorch's
/// inference path (padded rows exactly zero) only under `no_grad`, and the output equals the
/// call made on a worker directly, bit for bit.
#[test]
fn a_hopping_encoder_keeps_no_grad_and_its_bits() {
    let vm = VarMap::new();
    let cfg = LayerConfig::new(64, 4).with_dim_feedforward(128).with_batch_first(true);
    let mut enc =
        TransformerEncoder::new(cfg, 2, None, VarBuilder::from_varmap(&vm, DType::F32, &dev()))
            .unwrap();
    enc.eval();
    let x = det(&[8, 64, 64], DType::F32, 2.0); // 512 rows × 64 × 192: hops
    let pad: Vec<u8> = (0..8 * 64).map(|i| u8::from(i % 64 >= 40)).collect();
    let kpm = Mask::Bool(Tensor::from_vec(pad, (8, 64), &dev()).unwrap());
    let y = no_grad(|| enc.forward(&x, None, Some(&kpm), None)).unwrap();
    let padded = y.narrow(1, 40, 24).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(padded.to_scalar::<f32>().unwrap(), 0.0, "no_grad was lost on the hop");
    let on_worker = on_pool(|| no_grad(|| enc.forward(&x, None, Some(&kpm), None))).unwrap();
    let d = (&y - &on_worker).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    // With gradients recorded, the padded rows are computed (PyTorch's training path).
    let y = enc.forward(&x, None, Some(&kpm), None).unwrap();
    let padded = y.narrow(1, 40, 24).unwrap().abs().unwrap().max_all().unwrap();
    assert!(padded.to_scalar::<f32>().unwrap() > 0.0);
}
