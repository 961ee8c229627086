//! bf16 products (`Bf16Products::Direct`): bf16 computation multiplies bf16 operands (on
//! AVX512-BF16 where the CPU has it, on the portable kernel otherwise), agrees with the
//! widened path within bf16 rounding, and never changes float16.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use multihead::state_dict::{load_strict, NamedParameters};
use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
use multihead::{
    autocast, no_grad, with_bf16_products, Activation, Bf16Products, Mask, MhaConfig, MhaOptions,
    MultiheadAttention,
};

use crate::common::{bits, det, dev, var};

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// How many elements of `a` and `b` differ in their bits.
fn differing(a: &Tensor, b: &Tensor) -> usize {
    bits(a).iter().zip(bits(b)).filter(|(x, y)| **x != *y).count()
}

fn direct<R>(f: impl FnOnce() -> R) -> R {
    with_bf16_products(Bf16Products::Direct, f)
}

fn widened<R>(f: impl FnOnce() -> R) -> R {
    with_bf16_products(Bf16Products::Widened, f)
}

/// Largest `|a - b|`.
fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// `m`'s parameters as a state_dict-style map, and the module rebuilt from it in `dtype`.
fn twin<M: NamedParameters>(
    m: &M,
    dtype: DType,
    build: impl FnOnce(candle_nn::VarBuilder) -> multihead::Result<M>,
) -> M {
    let state: HashMap<String, Tensor> = m.named_parameters().into_iter().collect();
    load_strict(&state, dtype, &dev(), build).unwrap().0
}

/// `m` rebuilt in `dtype` with deterministic parameters (the random initialisation cannot be
/// seeded): `0.2·det` (LayerNorm weights `1 + 0.1·det`), in `named_parameters` order, so that
/// PyTorch code can rebuild the same layer and measure its own error on it.
fn deterministic<M: NamedParameters>(
    m: &M,
    dtype: DType,
    build: impl FnOnce(candle_nn::VarBuilder) -> multihead::Result<M>,
) -> M {
    let value = |i: usize, k: &str, t: &Tensor| {
        let v = det(t.dims(), DType::F32, i as f64 + 0.25).affine(0.2, 0.0).unwrap();
        let norm_weight = k.starts_with("norm") && k.ends_with("weight");
        if norm_weight {
            v.affine(0.5, 1.0).unwrap()
        } else {
            v
        }
    };
    let state: HashMap<String, Tensor> = m
        .named_parameters()
        .into_iter()
        .enumerate()
        .map(|(i, (k, t))| (k.clone(), value(i, &k, &t)))
        .collect();
    load_strict(&state, dtype, &dev(), build).unwrap().0
}

#[test]
fn a_bf16_linear_without_a_gradient_multiplies_the_bf16_operands() {
    // 21 rows (past the few-rows kernel), 70 outputs (a partial 64-column panel), 200 inputs
    // (two k blocks, the second odd-sized).
    let w = det(&[70, 200], DType::BF16, 1.0);
    let b = det(&[70], DType::BF16, 2.0);
    let lin = multihead::Linear::from_weights(w.clone(), Some(b.clone()));
    let x = det(&[3, 7, 200], DType::BF16, 3.0);
    let y_direct = direct(|| no_grad(|| lin.forward(&x))).unwrap();
    let y_widened = widened(|| no_grad(|| lin.forward(&x))).unwrap();
    assert_eq!(y_direct.dtype(), DType::BF16);
    assert_eq!(y_direct.dims(), &[3, 7, 70]);
    // The reference: the same bf16 values in f64, rounded to bf16 once.
    let f64_of = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let y64 = f64_of(&x).broadcast_matmul(&f64_of(&w).t().unwrap()).unwrap();
    let y64 = y64.broadcast_add(&f64_of(&b)).unwrap();
    let want = values(&y64.to_dtype(DType::BF16).unwrap());
    let exact = values(&y64);
    for (name, y) in [("direct", &y_direct), ("widened", &y_widened)] {
        // f32 sums of exact products round to the reference's bf16 value, or to a neighbour
        // when the f64 value lies within f32 rounding of a bf16 rounding boundary.
        for ((g, w), e) in values(y).iter().zip(&want).zip(&exact) {
            assert!((g - w).abs() <= e.abs() * 2f64.powi(-7) + 1e-6, "{name}: {g} vs {w} ({e})");
        }
    }
    // A strided input (seq-first viewed batch-first) gives the same numbers as a contiguous one.
    let xt = det(&[7, 3, 200], DType::BF16, 3.0).transpose(0, 1).unwrap();
    let a = direct(|| no_grad(|| lin.forward(&xt))).unwrap();
    let c = direct(|| no_grad(|| lin.forward(&xt.contiguous().unwrap()))).unwrap();
    assert_eq!(bits(&a), bits(&c));
}

#[test]
fn training_under_direct_takes_bf16_products_forward_and_backward() {
    // A bf16 Linear with a recorded gradient: the same products of the same bf16 operands as
    // the widened path, in another order, so within a bf16 step of it.
    let w = var(&det(&[70, 40], DType::BF16, 1.0));
    let lin = multihead::Linear::from_weights(w.as_tensor().clone(), None);
    let x = var(&det(&[30, 40], DType::BF16, 2.0));
    let step = |choice| {
        with_bf16_products(choice, || {
            let y = lin.forward(x.as_tensor()).unwrap();
            let g = y.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap().backward();
            let g = g.unwrap();
            (
                values(&y),
                values(g.get(w.as_tensor()).unwrap()),
                values(g.get(x.as_tensor()).unwrap()),
            )
        })
    };
    let (d, wd) = (step(Bf16Products::Direct), step(Bf16Products::Widened));
    for (name, a, b) in [("y", &d.0, &wd.0), ("dW", &d.1, &wd.1), ("dx", &d.2, &wd.2)] {
        let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(
            max_diff(a, b) <= scale * 2f64.powi(-7),
            "{name}: {:e} of {scale:e}",
            max_diff(a, b)
        );
    }
    // An encoder layer: inside it the products' operands (activations, output gradients) are
    // rounded to bf16, so training differs from the widened path by bf16 steps, not more.
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg =
        LayerConfig::new(32, 4).with_dim_feedforward(64).with_dropout(0.0).with_batch_first(true);
    let layer = TransformerEncoderLayer::new(cfg.clone(), vb).unwrap();
    let l16 =
        deterministic(&layer, DType::BF16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
    let l64 = twin(&l16, DType::F64, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
    let x = var(&det(&[2, 9, 32], DType::BF16, 3.0));
    // A fixed upstream gradient (the sum of squares of a LayerNorm output is nearly constant).
    let up = det(&[2, 9, 32], DType::F64, 4.0);
    let train = |m: &TransformerEncoderLayer, x: &candle_core::Var| {
        let y = m.forward(x.as_tensor(), None, None, false).unwrap();
        let g = y.to_dtype(DType::F64).unwrap().mul(&up).unwrap().sum_all().unwrap().backward();
        (values(&y), values(g.unwrap().get(x.as_tensor()).unwrap()))
    };
    let d = with_bf16_products(Bf16Products::Direct, || train(&l16, &x));
    let wd = with_bf16_products(Bf16Products::Widened, || train(&l16, &x));
    let r = train(&l64, &var(&x.as_tensor().to_dtype(DType::F64).unwrap()));
    assert_ne!(d.1, wd.1, "direct products ran in the backward");
    // Against the float64 layer, the bf16 rule of the golden cases: at most twice PyTorch
    // bf16's own error on this very layer (the same parameters, input and upstream gradient;
    // `python3 tools/bf16_layer_error.py` with PyTorch 2.15: output 0.68%, input gradient 1.96%
    // of its scale); the widened path no worse than the direct one.
    let rel = |a: &[f64], b: &[f64]| max_diff(a, b) / b.iter().fold(0f64, |m, v| m.max(v.abs()));
    let (out_d, out_w) = (rel(&d.0, &r.0), rel(&wd.0, &r.0));
    let (grad_d, grad_w) = (rel(&d.1, &r.1), rel(&wd.1, &r.1));
    let (pt_out, pt_grad) = (0.0068, 0.0196);
    assert!(out_d <= 2.0 * pt_out && out_w <= 2.0 * pt_out, "outputs: {out_d:e}, {out_w:e}");
    assert!(grad_d <= 2.0 * pt_grad, "direct input gradient: {grad_d:e} of its scale");
    assert!(grad_w <= grad_d, "widened input gradient: {grad_w:e} of its scale");
}

#[test]
fn bf16_layers_under_direct_round_their_products_and_stay_accurate() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg = LayerConfig::new(32, 4)
        .with_dim_feedforward(64)
        .with_dropout(0.0)
        .with_activation(Activation::Gelu)
        .with_batch_first(true);
    let layer = TransformerEncoderLayer::new(cfg.clone(), vb.pp("layer")).unwrap();
    let l16 =
        deterministic(&layer, DType::BF16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
    let l64 = twin(&l16, DType::F64, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
    let x = det(&[3, 9, 32], DType::BF16, 1.0);
    let kpm =
        Mask::Bool(Tensor::new(&[[0u8; 9], [0; 9], [0, 0, 0, 0, 0, 0, 1, 1, 1]], &dev()).unwrap());
    let run =
        |m: &TransformerEncoderLayer, x: &Tensor| m.forward(x, None, Some(&kpm), false).unwrap();
    let y_direct = direct(|| no_grad(|| run(&l16, &x)));
    let y_widened = widened(|| no_grad(|| run(&l16, &x)));
    let y64 = values(&run(&l64, &x.to_dtype(DType::F64).unwrap()));
    // Rounding the products' inputs changes some outputs by a bf16 step ...
    assert_ne!(bits(&y_direct), bits(&y_widened), "direct products ran");
    // ... however few the rows: a sequence alone (5 rows, the linear layers' few-rows case)
    // gets what it gets inside a batch of 15 rows, bit for bit.
    let seqs = x.narrow(1, 0, 5).unwrap();
    let run5 = |t: &Tensor| direct(|| no_grad(|| l16.forward(t, None, None, false).unwrap()));
    let alone = run5(&seqs.narrow(0, 0, 1).unwrap());
    let batched = run5(&seqs).narrow(0, 0, 1).unwrap();
    assert_eq!(bits(&alone), bits(&batched), "a few rows take the same products");
    // ... and the error stays of the widened path's order (LayerNorm outputs are O(1)).
    let (e_direct, e_widened) =
        (max_diff(&values(&y_direct), &y64), max_diff(&values(&y_widened), &y64));
    assert!(
        e_direct <= 3.0 * e_widened + 2f64.powi(-7),
        "direct {e_direct:e}, widened {e_widened:e}"
    );
    assert!(e_direct < 0.05, "direct error {e_direct:e}");

    // Attention likewise, and autocast on the f32 module computes what the bf16 module does.
    let mcfg = MhaConfig::new(32, 4).with_batch_first(true).with_dropout(0.0);
    let mha = MultiheadAttention::new(mcfg.clone(), vb.pp("mha")).unwrap();
    let m16 = twin(&mha, DType::BF16, |vb| MultiheadAttention::new(mcfg.clone(), vb));
    let opts = MhaOptions::default().need_weights(false);
    let attend = |m: &MultiheadAttention, x: &Tensor| m.forward(x, x, x, &opts).unwrap().output;
    let a_direct = direct(|| no_grad(|| attend(&m16, &x)));
    let a_widened = widened(|| no_grad(|| attend(&m16, &x)));
    assert_ne!(bits(&a_direct), bits(&a_widened), "direct products ran in attention");
    let d = max_diff(&values(&a_direct), &values(&a_widened));
    assert!(d < 0.05, "direct and widened attention differ by {d:e}");
    let x32 = x.to_dtype(DType::F32).unwrap();
    let a_auto = direct(|| no_grad(|| autocast(DType::BF16, || attend(&mha, &x32))));
    assert_eq!(bits(&a_auto), bits(&a_direct), "autocast equals the bf16 module");
}

#[test]
fn float16_layers_never_take_bf16_products() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg = LayerConfig::new(16, 2).with_dim_feedforward(32).with_dropout(0.0);
    let layer = TransformerEncoderLayer::new(cfg.clone(), vb).unwrap();
    let l16 = twin(&layer, DType::F16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
    let x = det(&[2, 9, 16], DType::F16, 1.0);
    let run = || no_grad(|| l16.forward(&x, None, None, false).unwrap());
    assert_eq!(bits(&direct(run)), bits(&widened(run)));
}

#[test]
fn bf16_attention_under_direct_takes_bf16_products_and_stays_accurate() {
    use multihead::functional::scaled_dot_product_attention as sdpa;
    let (q, k, v) = (
        det(&[2, 2, 20, 16], DType::BF16, 1.0),
        det(&[2, 2, 70, 16], DType::BF16, 2.0),
        det(&[2, 2, 70, 16], DType::BF16, 3.0),
    );
    let opts = multihead::SdpaOptions::default();
    let y_direct = direct(|| no_grad(|| sdpa(&q, &k, &v, &opts))).unwrap();
    let y_widened = widened(|| no_grad(|| sdpa(&q, &k, &v, &opts))).unwrap();
    assert_eq!(y_direct.dtype(), DType::BF16);
    // The probabilities rounded to bf16 move some outputs by a bf16 step, no more.
    assert_ne!(bits(&y_direct), bits(&y_widened), "direct products ran");
    let f64_of = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let y64 = values(&sdpa(&f64_of(&q), &f64_of(&k), &f64_of(&v), &opts).unwrap());
    let (e_direct, e_widened) =
        (max_diff(&values(&y_direct), &y64), max_diff(&values(&y_widened), &y64));
    assert!(
        e_direct <= 2.0 * e_widened + 2f64.powi(-8),
        "direct {e_direct:e}, widened {e_widened:e}"
    );
    // With a gradient recorded, the backward's products are bf16 too: its gradients stay of
    // the widened path's accuracy against float64.
    let (qv, kv, vv) = (var(&q), var(&k), var(&v));
    let up = det(&[2, 2, 20, 16], DType::F64, 5.0);
    let grads = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let y = sdpa(q, k, v, &opts).unwrap().to_dtype(DType::F64).unwrap();
        let g = y.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
        [q, k, v].map(|t| values(g.get(t).unwrap()))
    };
    let (qt, kt, vt) = (qv.as_tensor(), kv.as_tensor(), vv.as_tensor());
    let g_direct = direct(|| grads(qt, kt, vt));
    let g_widened = widened(|| grads(qt, kt, vt));
    let (q64, k64, v64) = (var(&f64_of(&q)), var(&f64_of(&k)), var(&f64_of(&v)));
    let g64 = grads(q64.as_tensor(), k64.as_tensor(), v64.as_tensor());
    assert_ne!(g_direct[1], g_widened[1], "direct products ran in the backward");
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        let (e_d, e_w) = (max_diff(&g_direct[i], &g64[i]), max_diff(&g_widened[i], &g64[i]));
        let scale = g64[i].iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(
            e_d <= 3.0 * e_w + scale * 2f64.powi(-7),
            "{name}: direct {e_d:e}, widened {e_w:e}"
        );
    }
}

#[test]
fn bad_input_gets_the_same_answer_under_direct_as_widened() {
    let lin = multihead::Linear::from_weights(det(&[12, 20], DType::BF16, 1.0), None);
    let modes = [Bf16Products::Direct, Bf16Products::Widened];
    // Wrong features, wrong dtype: the same typed error either way.
    for x in [det(&[16, 19], DType::BF16, 3.0), det(&[16, 20], DType::F32, 3.0)] {
        let errs = modes.map(|m| with_bf16_products(m, || no_grad(|| lin.forward(&x))));
        let msgs = errs.map(|e| e.err().map(|e| e.to_string()));
        assert!(msgs[0].is_some(), "{:?}", x.dims());
        assert_eq!(msgs[0], msgs[1]);
    }
    // Strided and broadcast views give what their contiguous copies give.
    let strided = det(&[20, 16], DType::BF16, 4.0).t().unwrap();
    let broadcast = det(&[1, 20], DType::BF16, 5.0).broadcast_as((16, 20)).unwrap();
    for m in modes {
        for x in [&strided, &broadcast] {
            let run = |t: &Tensor| with_bf16_products(m, || no_grad(|| lin.forward(t))).unwrap();
            assert_eq!(bits(&run(x)), bits(&run(&x.contiguous().unwrap())), "{m:?}");
        }
    }
    // A size that cannot be allocated is an error, not an abort.
    let huge = det(&[1, 20], DType::BF16, 6.0).broadcast_as((1usize << 40, 20)).unwrap();
    for m in modes {
        let r = with_bf16_products(m, || no_grad(|| lin.forward(&huge)));
        assert!(matches!(r, Err(multihead::Error::Alloc { .. })), "{m:?}: {r:?}");
    }
    // NaN in one row reaches that row's outputs only, on the fused and the composed path.
    let mut v = vec![0.5f32; 16 * 20];
    v[3 * 20 + 7] = f32::NAN;
    let x = Tensor::from_vec(v, (16, 20), &dev()).unwrap().to_dtype(DType::BF16).unwrap();
    for backend in [multihead::Backend::Auto, multihead::Backend::Composed] {
        for m in modes {
            let y = multihead::with_backend(backend, || {
                with_bf16_products(m, || no_grad(|| lin.forward(&x)))
            });
            let y = y.unwrap().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            for (r, row) in y.iter().enumerate() {
                assert!(row.iter().all(|v| v.is_nan() == (r == 3)), "{backend:?} {m:?} row {r}");
            }
        }
    }
    // Attention: a NaN key poisons the same rows on every path (docs/pytorch-behaviour.md §5:
    // a non-finite key reaches every row of its head, masked or not), and no row of the
    // other head.
    let (q, k) = (det(&[1, 2, 12, 16], DType::BF16, 1.0), det(&[1, 2, 12, 16], DType::BF16, 2.0));
    let mut kv = k.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    kv[5 * 16] = f32::NAN; // head 0, key 5
    let k = Tensor::from_vec(kv, (1, 2, 12, 16), &dev()).unwrap().to_dtype(DType::BF16).unwrap();
    let opts = multihead::SdpaOptions { is_causal: true, ..Default::default() };
    let nan_rows = |backend, m| {
        let y = multihead::with_backend(backend, || {
            with_bf16_products(m, || {
                no_grad(|| multihead::functional::scaled_dot_product_attention(&q, &k, &k, &opts))
            })
        });
        let y = y.unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        y.to_vec1::<f32>().unwrap().chunks(16).map(|r| r[0].is_nan()).collect::<Vec<_>>()
    };
    let composed = nan_rows(multihead::Backend::Composed, Bf16Products::Widened);
    for m in modes {
        assert_eq!(nan_rows(multihead::Backend::Auto, m), composed, "{m:?}");
    }
    assert!(composed[..12].iter().all(|&n| n) && composed[12..].iter().all(|&n| !n));
}

#[test]
fn a_bf16_linear_in_training_is_one_op_with_the_widened_paths_bits() {
    // The bf16 tensors multiplied as they are (no f32 copies of x and W, no conversion nodes):
    // output, dx, dW and db equal, bit for bit, the products of the same bf16 operands on the
    // bf16 GEMM with the bias and activation in f32 and one rounding each, which is what the
    // widened path computes. 21 rows, a partial panel (70 outputs), two k blocks.
    use multihead_kernels::bf16gemm::{matmul_bf16_new, BfMat};
    use multihead_kernels::epilogue::{bias_act_in_place, bias_grad, Act};
    let (m, k, n) = (21usize, 200usize, 70usize);
    let f32v = |t: &Tensor| {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    // f32 values rounded to bf16 (and back, exactly).
    let round = |v: &[f32]| {
        let t = Tensor::from_slice(v, v.len(), &dev()).unwrap().to_dtype(DType::BF16).unwrap();
        f32v(&t)
    };
    let product = |a: BfMat, b: BfMat| matmul_bf16_new(a, b).unwrap();
    for (act, kernel_act) in [
        (None, Act::Identity),
        (Some(Activation::Relu), Act::Relu),
        (Some(Activation::Gelu), Act::Gelu),
    ] {
        let w = var(&det(&[n, k], DType::BF16, 1.0).affine(0.2, 0.0).unwrap());
        let b = var(&det(&[n], DType::BF16, 2.0));
        let lin =
            multihead::Linear::from_weights(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        let x = var(&det(&[3, 7, k], DType::BF16, 3.0));
        // bf16-exact upstream values, so that the output's gradient is exactly `up`.
        let up = det(&[3, 7, n], DType::BF16, 4.0);
        let (y, g) = direct(|| {
            let y = match act {
                Some(a) => lin.forward_act(x.as_tensor(), a),
                None => lin.forward(x.as_tensor()),
            };
            let y = y.unwrap();
            let loss = y.to_dtype(DType::F32).unwrap().mul(&up.to_dtype(DType::F32).unwrap());
            let g = loss.unwrap().sum_all().unwrap().backward().unwrap();
            (y, g)
        });
        let (xv, wv, bv, upv) =
            (f32v(x.as_tensor()), f32v(w.as_tensor()), f32v(b.as_tensor()), f32v(&up));
        let mut pre = product(BfMat::f32(&xv, m, k), BfMat::f32(&wv, n, k).t());
        bias_act_in_place(&mut pre, n, Some(&bv), Act::Identity).unwrap();
        let mut out = pre.clone();
        bias_act_in_place(&mut out, n, None, kernel_act).unwrap();
        let out = round(&out);
        assert_eq!(y.dtype(), DType::BF16);
        assert_eq!(f32v(&y), out, "{act:?} output");
        // The gradient through the activation: from the rounded output (ReLU, as PyTorch's
        // threshold_backward on a bf16 output) or the f32 pre-activation (GELU).
        let mut dpre = upv.clone();
        match kernel_act {
            Act::Relu => multihead_kernels::activation::relu_backward(&out, &upv, &mut dpre),
            Act::Gelu => multihead_kernels::activation::gelu_backward(&pre, &upv, &mut dpre),
            Act::Identity => Ok(()),
        }
        .unwrap();
        let dx = product(BfMat::f32(&dpre, m, n), BfMat::f32(&wv, n, k));
        let dw = product(BfMat::f32(&dpre, m, n).t(), BfMat::f32(&xv, m, k));
        let db = bias_grad(&dpre, n).unwrap();
        for (name, t, want) in
            [("dx", x.as_tensor(), dx), ("dW", w.as_tensor(), dw), ("db", b.as_tensor(), db)]
        {
            let got = g.get(t).unwrap();
            assert_eq!(got.dtype(), DType::BF16, "{name}");
            assert_eq!(f32v(got), round(&want), "{act:?} {name}");
        }
    }
}

/// A mask that requires grad sends PyTorch's bf16 attention to its math path (f32 products,
/// `ToCopyBackward0`), so bf16 products must not round there: SDPA and MultiheadAttention (with
/// identity projections, exact in bf16 either way) give the widened path's bits under
/// `Bf16Products::Direct`.
#[test]
fn a_learned_mask_keeps_f32_attention_products_as_pytorch_does() {
    use candle_nn::{VarBuilder, VarMap};
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let bf = DType::BF16;
    let (q, k, v) =
        (det(&[1, 2, 8, 16], bf, 1.0), det(&[1, 2, 8, 16], bf, 2.0), det(&[1, 2, 8, 16], bf, 3.0));
    let bias = var(&det(&[8, 8], bf, 4.0));
    let opts = SdpaOptions::default().attn_mask(Mask::Float(bias.as_tensor().clone()));
    let run = || scaled_dot_product_attention(&q, &k, &v, &opts).unwrap();
    assert_eq!(bits(&direct(run)), bits(&widened(run)), "sdpa");
    // MultiheadAttention whose projections are identities.
    let (e, l) = (16, 8);
    let vm = VarMap::new();
    let m = MultiheadAttention::new(MhaConfig::new(e, 2), VarBuilder::from_varmap(&vm, bf, &dev()))
        .unwrap();
    let eye = Tensor::eye(e, bf, &dev()).unwrap();
    for (name, var) in vm.data().lock().unwrap().iter() {
        let t = match name.as_str() {
            "in_proj_weight" => Tensor::cat(&[&eye, &eye, &eye], 0).unwrap(),
            "out_proj.weight" => eye.clone(),
            _ => var.zeros_like().unwrap(),
        };
        var.set(&t).unwrap();
    }
    let x = det(&[l, 2, e], bf, 5.0);
    let bias = var(&det(&[l, l], bf, 6.0));
    let o =
        MhaOptions::default().need_weights(false).attn_mask(Mask::Float(bias.as_tensor().clone()));
    let run = || m.forward(&x, &x, &x, &o).unwrap().output;
    assert_eq!(bits(&direct(run)), bits(&widened(run)), "multihead attention");
}

#[test]
fn bf16_inference_writes_bf16_activations_with_the_bits_of_the_f32_twin() {
    // Without a gradient, a bf16 layer's f32 twin writes the feed-forward hidden units and
    // self-attention's q/k/v projection as bf16 (the bits the next products round them to;
    // the attention kernel reads the projection as it is), and a bf16 MHA's output projection
    // rounds its tiles as they leave the kernel. With a gradient recorded (an input that is a
    // Var) all stay f32 and are rounded later: the outputs must be the same bits. 70 tokens
    // per sequence (query blocks over prepacked keys), 72 hidden units (a partial panel), 140
    // rows; ReLU and GELU, post- and pre-norm.
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let x = det(&[2, 70, 32], DType::BF16, 4.0);
    let xv = var(&x);
    let graded = xv.as_tensor();
    for (act, norm_first) in [(Activation::Gelu, false), (Activation::Relu, true)] {
        let cfg = LayerConfig::new(32, 4)
            .with_dim_feedforward(72)
            .with_dropout(0.0)
            .with_activation(act)
            .with_norm_first(norm_first)
            .with_batch_first(true);
        let layer = TransformerEncoderLayer::new(cfg.clone(), vb.pp("layer")).unwrap();
        let l16 =
            deterministic(&layer, DType::BF16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
        let run = |x: &Tensor| l16.forward(x, None, None, false).unwrap();
        let inference = direct(|| no_grad(|| run(&x)));
        let recorded = direct(|| run(graded));
        assert_eq!(inference.dtype(), DType::BF16);
        let differ = differing(&inference, &recorded);
        assert_eq!(differ, 0, "{act:?} norm_first {norm_first}: outputs differ");
        // The same values as the f64 layer within bf16 products' accuracy (the output is a
        // LayerNorm's: O(1)).
        let l64 = twin(&l16, DType::F64, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
        let y64 =
            values(&l64.forward(&x.to_dtype(DType::F64).unwrap(), None, None, false).unwrap());
        let e = max_diff(&values(&inference), &y64);
        assert!(e < 0.05, "{act:?} norm_first {norm_first}: error {e:e}");
    }
    let mcfg = MhaConfig::new(32, 4).with_batch_first(true).with_dropout(0.0);
    let mha = MultiheadAttention::new(mcfg.clone(), vb.pp("mha")).unwrap();
    let m16 = deterministic(&mha, DType::BF16, |vb| MultiheadAttention::new(mcfg.clone(), vb));
    for causal in [false, true] {
        let opts = MhaOptions::default().need_weights(false).is_causal(causal);
        let opts = match causal {
            true => {
                let m = multihead::generate_square_subsequent_mask(70, DType::BF16, &dev());
                opts.attn_mask(Mask::Float(m.unwrap()))
            }
            false => opts,
        };
        let attend = |x: &Tensor| m16.forward(x, x, x, &opts).unwrap().output;
        let inference = direct(|| no_grad(|| attend(&x)));
        let recorded = direct(|| attend(graded));
        assert_eq!(inference.dtype(), DType::BF16);
        assert_eq!(differing(&inference, &recorded), 0, "causal {causal}: outputs differ");
    }
}

#[test]
fn bf16_sdpa_without_a_gradient_reads_and_writes_bf16_with_the_bits_of_the_f32_twin() {
    // Without a gradient, a bf16 SDPA call reads q, k and v as bf16 and writes its output as
    // bf16; with one (a query that is a Var) the inputs are widened to f32 and the output
    // rounded: the same bits. Keys as a transposed view (rows strided), a causal call, a bool
    // and a float mask broadcast over heads; 70 queries over 90 keys (partial tiles).
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let q = det(&[2, 3, 70, 16], DType::BF16, 1.0);
    let k = det(&[2, 90, 3, 16], DType::BF16, 2.0).transpose(1, 2).unwrap();
    let v = det(&[2, 3, 90, 16], DType::BF16, 3.0).affine(2.0, 0.5).unwrap();
    let qv = var(&q);
    let keep = det(&[70, 90], DType::F32, 5.0).ge(-0.8).unwrap();
    let bias = det(&[2, 1, 70, 90], DType::BF16, 6.0).affine(3.0, 0.0).unwrap();
    let cases = [
        ("plain", SdpaOptions::default()),
        ("causal", SdpaOptions::default().is_causal(true)),
        ("bool mask", SdpaOptions::default().attn_mask(Mask::Bool(keep))),
        ("float mask", SdpaOptions::default().attn_mask(Mask::Float(bias)).scale(0.3)),
    ];
    for (what, opts) in cases {
        let attend = |q: &Tensor| scaled_dot_product_attention(q, &k, &v, &opts).unwrap();
        let inference = direct(|| no_grad(|| attend(&q)));
        let recorded = direct(|| attend(qv.as_tensor()));
        assert_eq!(inference.dtype(), DType::BF16, "{what}");
        assert_eq!(inference.dims(), &[2, 3, 70, 16], "{what}");
        assert_eq!(differing(&inference, &recorded), 0, "{what}: outputs differ");
        // And the f64 attention within bf16 products' accuracy (values O(1)).
        let w = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let o64 = match &opts.attn_mask {
            Some(Mask::Float(m)) => opts.clone().attn_mask(Mask::Float(w(m))),
            _ => opts.clone(),
        };
        let y64 = scaled_dot_product_attention(&w(&q), &w(&k), &w(&v), &o64).unwrap();
        let e = max_diff(&values(&inference), &values(&y64));
        assert!(e < 0.05, "{what}: error {e:e}");
    }
    // A NaN query and an infinite key (their heads read every key): NaN where PyTorch's rules
    // put it, on both routes alike.
    let mut qn = values(&q);
    qn[5] = f64::NAN;
    let mut kn = values(&det(&[2, 90, 3, 16], DType::BF16, 2.0));
    kn[16 * 3 * 7 + 2] = f64::INFINITY;
    let qn = Tensor::from_vec(qn, q.dims(), &dev()).unwrap().to_dtype(DType::BF16).unwrap();
    let kn = Tensor::from_vec(kn, (2, 90, 3, 16), &dev()).unwrap();
    let kn = kn.to_dtype(DType::BF16).unwrap().transpose(1, 2).unwrap();
    let qnv = var(&qn);
    let opts = SdpaOptions::default().is_causal(true);
    let attend = |q: &Tensor| scaled_dot_product_attention(q, &kn, &v, &opts).unwrap();
    let inference = values(&direct(|| no_grad(|| attend(&qn))));
    let recorded = values(&direct(|| attend(qnv.as_tensor())));
    let nans = inference.iter().filter(|x| x.is_nan()).count();
    assert!(nans > 0 && nans < inference.len(), "{nans} NaN outputs");
    for (i, (a, b)) in inference.iter().zip(&recorded).enumerate() {
        assert!(a == b || (a.is_nan() && b.is_nan()), "element {i}: {a} vs {b}");
    }
    // Bad input gets the same error on both routes: a key of the wrong width, a mask of the
    // wrong shape, a value in another dtype.
    let narrow_k = det(&[2, 3, 90, 8], DType::BF16, 2.0);
    let bad_mask = SdpaOptions::default().attn_mask(Mask::Float(det(&[70, 91], DType::BF16, 1.0)));
    let v16 = v.to_dtype(DType::F16).unwrap();
    let bad: [(&str, &Tensor, &Tensor, SdpaOptions); 3] = [
        ("key width", &narrow_k, &v, SdpaOptions::default()),
        ("mask shape", &k, &v, bad_mask),
        ("value dtype", &k, &v16, SdpaOptions::default()),
    ];
    for (what, k, v, opts) in bad {
        let run = |q: &Tensor| scaled_dot_product_attention(q, k, v, &opts).map(|_| ());
        let a = direct(|| no_grad(|| run(&q))).expect_err(what).to_string();
        let b = direct(|| run(qv.as_tensor())).expect_err(what).to_string();
        assert_eq!(a, b, "{what}");
        assert!(a.contains("scaled_dot_product_attention"), "{what}: {a}");
    }
}

#[test]
fn a_bf16_sdpa_scale_folded_into_its_softmax_keeps_the_bits_of_the_scaled_scores() {
    // A power-of-two scale with nothing else on the scores is folded into the softmax pass
    // (the max of the raw scores, then `x·scale - max` in one FMA); a float mask of zeros keeps
    // the scores scaled and stored first (and a causal call's mask of 0 and -inf, its rule).
    // Both give the same bits: head widths 64 (scale 1/8) and 16 (1/4), an explicit 0.5,
    // causal calls (folded off the diagonal only), a scale that is no power of two (folded
    // neither way), 130 keys (partial blocks).
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    for (d, scale, causal) in
        [(64, None, false), (16, None, true), (64, Some(0.5), true), (32, None, false)]
    {
        let q = det(&[2, 2, 70, d], DType::BF16, 1.0).affine(4.0, 0.0).unwrap();
        let k = det(&[2, 2, 130, d], DType::BF16, 2.0).affine(4.0, 0.0).unwrap();
        let v = det(&[2, 2, 130, d], DType::BF16, 3.0);
        // Zeros, or PyTorch's causal rule (top left) as a float mask of 0 and -inf.
        let rule: Vec<f32> = (0..70 * 130)
            .map(|i| if causal && i % 130 > i / 130 { f32::NEG_INFINITY } else { 0.0 })
            .collect();
        let rule = Tensor::from_vec(rule, (70, 130), &dev()).unwrap();
        let mut opts = SdpaOptions::default().is_causal(causal);
        let mut masked =
            SdpaOptions::default().attn_mask(Mask::Float(rule.to_dtype(DType::BF16).unwrap()));
        if let Some(s) = scale {
            (opts, masked) = (opts.scale(s), masked.scale(s));
        }
        let run = |o: &SdpaOptions| {
            direct(|| no_grad(|| scaled_dot_product_attention(&q, &k, &v, o))).unwrap()
        };
        let (folded, scaled) = (run(&opts), run(&masked));
        let what = format!("d {d}, scale {scale:?}, causal {causal}");
        assert_eq!(differing(&folded, &scaled), 0, "{what}: outputs differ");
        // Not a trivial output: the f64 attention within bf16 products' accuracy.
        let w = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let y64 = scaled_dot_product_attention(&w(&q), &w(&k), &w(&v), &opts).unwrap();
        let e = max_diff(&values(&folded), &values(&y64));
        assert!(e < 0.05, "{what}: error {e:e}");
        let spread = values(&folded).iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(spread > 0.05, "{what}: outputs near zero ({spread:e})");
    }
}

/// A `(2, 70)` key padding mask hiding the second sequence's keys from `from` on.
fn second_sequence_padded_from(from: usize) -> Tensor {
    let mut pad = vec![0u8; 2 * 70];
    pad[70 + from..].iter_mut().for_each(|p| *p = 1);
    Tensor::from_vec(pad, (2, 70), &dev()).unwrap()
}

/// Two sequences of 70 tokens of width 32 in bf16, `(N, L, E)` with `batch_first`, else
/// `(L, N, E)`, with one NaN in the first sequence (whose rows then all read NaN).
fn two_sequences_with_a_nan(batch_first: bool) -> (Tensor, [usize; 3]) {
    let shape = if batch_first { [2, 70, 32] } else { [70, 2, 32] };
    let mut xs = values(&det(&shape, DType::F32, 7.0));
    xs[if batch_first { 40 } else { 8 }] = f64::NAN;
    (Tensor::from_vec(xs, &shape[..], &dev()).unwrap().to_dtype(DType::BF16).unwrap(), shape)
}

/// `run` without a gradient (the bf16 route) and on `xv` (a Var: the twin) for the input `x`
/// of `two_sequences_with_a_nan`: a bf16 output of `shape` with the twin's bits, NaN in some
/// outputs but not all.
fn route_matches_twin_on(
    run: &dyn Fn(&Tensor) -> Tensor,
    (x, xv): (&Tensor, &candle_core::Var),
    shape: &[usize],
    what: &str,
) {
    let inference = direct(|| no_grad(|| run(x)));
    let recorded = direct(|| run(xv.as_tensor()));
    assert_eq!(inference.dtype(), DType::BF16, "{what}");
    assert_eq!(inference.dims(), shape, "{what}");
    assert_eq!(differing(&inference, &recorded), 0, "{what}: outputs differ");
    let nans = values(&inference).iter().filter(|v| v.is_nan()).count();
    assert!(nans > 0 && nans < 2 * 70 * 32, "{what}: {nans} NaN outputs");
}

/// `run` on an unbatched call (70 rows) and one of few rows (2 × 3), which keeps the twin:
/// the same bits with or without a gradient.
fn route_matches_twin_unbatched_and_on_few_rows(run: &dyn Fn(&Tensor) -> Tensor) {
    for dims in [vec![70, 32], vec![3, 2, 32]] {
        let x = det(&dims, DType::BF16, 9.0);
        let xv = var(&x);
        let inference = direct(|| no_grad(|| run(&x)));
        let recorded = direct(|| run(xv.as_tensor()));
        assert_eq!(differing(&inference, &recorded), 0, "{dims:?}: outputs differ");
    }
}

#[test]
fn a_bf16_mha_without_a_gradient_skips_its_f32_twin_with_the_twins_bits() {
    // Without a gradient, a bf16 self-attention call that its f32 twin would compute from bf16
    // values anyway runs as it is: the input and the weights are multiplied unwidened, the
    // masks widened only. With a gradient recorded (an input that is a Var) the call runs as
    // the twin: the same bits. Sequence-first and batch-first, a bool key padding mask, a
    // float attention mask, a NaN in the input, an unbatched call, and a call of few rows
    // (which keeps the twin, as the few-rows kernel sums in another order).
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let pad = second_sequence_padded_from(60);
    let bias = det(&[70, 70], DType::BF16, 8.0).affine(2.0, 0.0).unwrap();
    let cases = [
        ("plain", MhaOptions::default()),
        ("key padding", MhaOptions::default().key_padding_mask(Mask::Bool(pad))),
        ("float mask", MhaOptions::default().attn_mask(Mask::Float(bias))),
    ];
    for batch_first in [false, true] {
        let cfg = MhaConfig::new(32, 4).with_batch_first(batch_first).with_dropout(0.0);
        let mha = MultiheadAttention::new(cfg.clone(), vb.pp(format!("m{batch_first}"))).unwrap();
        let m16 = deterministic(&mha, DType::BF16, |vb| MultiheadAttention::new(cfg.clone(), vb));
        let (x, shape) = two_sequences_with_a_nan(batch_first);
        let xv = var(&x);
        for (what, opts) in &cases {
            let opts = opts.clone().need_weights(false);
            let attend = |x: &Tensor| m16.forward(x, x, x, &opts).unwrap().output;
            let what = format!("{what}, batch_first {batch_first}");
            route_matches_twin_on(&attend, (&x, &xv), &shape, &what);
        }
        let opts = MhaOptions::default().need_weights(false);
        route_matches_twin_unbatched_and_on_few_rows(&|x| {
            m16.forward(x, x, x, &opts).unwrap().output
        });
    }
}

#[test]
fn a_bf16_encoder_layer_without_a_gradient_keeps_its_weights_bf16_with_the_twins_bits() {
    // Without a gradient, a bf16 encoder layer whose self-attention runs as it is multiplies
    // its bf16 weights unwidened (the attention's output projection written in f32 for the
    // residual sum, the feed-forward products reading the bf16 weights, a pre-norm layer's
    // attention reading its first norm rounded to bf16); with a gradient recorded (an input
    // that is a Var) it runs as its widened f32 twin: the same bits. Post-norm and pre-norm,
    // sequence-first and batch-first, ReLU and GELU, with and without biases, a bool key
    // padding mask, a float mask, a NaN in the input, an unbatched call and few rows (which
    // keep the twin).
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let pad = second_sequence_padded_from(50);
    let bias = det(&[70, 70], DType::BF16, 8.0).affine(2.0, 0.0).unwrap();
    let cases = [
        ("plain", None, None),
        ("key padding", None, Some(Mask::Bool(pad))),
        ("float mask", Some(Mask::Float(bias)), None),
    ];
    let layers = [
        (Activation::Gelu, true, false, false),
        (Activation::Relu, false, true, false),
        (Activation::Gelu, true, true, true),
        (Activation::Relu, false, false, true),
    ];
    for (i, (act, with_bias, batch_first, norm_first)) in layers.into_iter().enumerate() {
        let cfg = LayerConfig::new(32, 4)
            .with_dim_feedforward(72)
            .with_dropout(0.0)
            .with_activation(act)
            .with_bias(with_bias)
            .with_batch_first(batch_first)
            .with_norm_first(norm_first);
        let layer = TransformerEncoderLayer::new(cfg.clone(), vb.pp(format!("l{i}"))).unwrap();
        let mut l16 =
            deterministic(&layer, DType::BF16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
        l16.eval();
        let (x, shape) = two_sequences_with_a_nan(batch_first);
        let xv = var(&x);
        for (what, mask, kpm) in &cases {
            let run = |x: &Tensor| l16.forward(x, mask.as_ref(), kpm.as_ref(), false).unwrap();
            let what = format!("{what}, {act:?}, bias {with_bias}, batch_first {batch_first}");
            let what = format!("{what}, norm_first {norm_first}");
            route_matches_twin_on(&run, (&x, &xv), &shape, &what);
        }
        route_matches_twin_unbatched_and_on_few_rows(&|x| {
            l16.forward(x, None, None, false).unwrap()
        });
    }
}

#[test]
fn bad_input_to_a_bf16_encoder_layer_gets_the_same_error_with_or_without_a_gradient() {
    // The layer's bf16 route without a gradient and its f32 twin (a gradient recorded) check
    // the same arguments and name them the same way: wrong features, masks of the wrong shape,
    // a float mask of another dtype, and a size that cannot be allocated; post-norm and
    // pre-norm, under the default and a composed backend.
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    for norm_first in [false, true] {
        let l16 = bf16_eval_layer(&vb, (32, 4, 72), norm_first, &format!("l{norm_first}"));
        same_errors(&l16, norm_first);
        // The composed path alike (the one-pass norms step aside there).
        multihead::with_backend(multihead::Backend::Composed, || same_errors(&l16, norm_first));
    }
}

/// A bf16 encoder layer in eval mode, `(E, H, F)` wide, without dropout, with the
/// deterministic weights of `deterministic`.
fn bf16_eval_layer(
    vb: &candle_nn::VarBuilder,
    (e, h, f): (usize, usize, usize),
    norm_first: bool,
    tag: &str,
) -> TransformerEncoderLayer {
    let cfg = LayerConfig::new(e, h)
        .with_dim_feedforward(f)
        .with_dropout(0.0)
        .with_norm_first(norm_first);
    let layer = TransformerEncoderLayer::new(cfg.clone(), vb.pp(tag)).unwrap();
    let mut l16 =
        deterministic(&layer, DType::BF16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
    l16.eval();
    l16
}

/// The errors of [`bad_input_to_a_bf16_encoder_layer_gets_the_same_error_with_or_without_a_gradient`]
/// for one layer.
fn same_errors(l16: &TransformerEncoderLayer, norm_first: bool) {
    let x = det(&[70, 2, 32], DType::BF16, 1.0);
    let mask = |dims: &[usize], dt| Some(Mask::Float(det(dims, dt, 2.0)));
    let pad = |dims: &[usize]| Some(Mask::Bool(Tensor::zeros(dims, DType::U8, &dev()).unwrap()));
    let huge = det(&[1, 1, 32], DType::BF16, 3.0).broadcast_as((1usize << 20, 1 << 16, 32));
    let cases: [(&str, Tensor, Option<Mask>, Option<Mask>); 6] = [
        ("features", det(&[70, 2, 31], DType::BF16, 1.0), None, None),
        ("mask shape", x.clone(), mask(&[70, 69], DType::BF16), None),
        ("mask heads", x.clone(), mask(&[3, 70, 70], DType::BF16), None),
        // An f32 mask goes with a bf16 query (PyTorch's SDPA takes it); an f64 one does not.
        ("mask dtype", x.clone(), mask(&[70, 70], DType::F64), None),
        ("padding shape", x.clone(), None, pad(&[2, 69])),
        ("huge", huge.unwrap(), None, None),
    ];
    for (what, x, m, kpm) in cases {
        let run = |x: &Tensor| l16.forward(x, m.as_ref(), kpm.as_ref(), false);
        let plain = direct(|| no_grad(|| run(&x))).err().map(|e| e.to_string());
        // A Var of the huge view cannot be made (it would copy 4 TiB).
        let graded = (what != "huge").then(|| {
            let xv = var(&x);
            direct(|| run(xv.as_tensor())).err().map(|e| e.to_string())
        });
        let plain = plain.unwrap_or_else(|| panic!("{what}, norm_first {norm_first}: no error"));
        if let Some(graded) = graded {
            assert_eq!(Some(plain.clone()), graded, "{what}, norm_first {norm_first}");
        }
    }
}

#[test]
fn a_bf16_encoder_layer_route_under_a_composed_backend_keeps_the_twins_bits() {
    // Under a composed default backend the twin's norms run as candle's operations, whose bits
    // differ from the fused norm's in the last place; the route's one-pass norms must then
    // step aside (the attention may still run fused, as its options ask). 1024 tokens: at a
    // few dozen the bf16 rounding hides a last-place difference in the norms.
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let x = det(&[1024, 4, 64], DType::BF16, 1.0);
    let xv = var(&x);
    let opts = MhaOptions::default().backend(multihead::Backend::Fused);
    for norm_first in [false, true] {
        let l16 = bf16_eval_layer(&vb, (64, 4, 128), norm_first, &format!("c{norm_first}"));
        let run = |t: &Tensor| direct(|| l16.forward_with(t, &opts).unwrap());
        multihead::with_backend(multihead::Backend::Composed, || {
            let inference = no_grad(|| run(&x));
            let recorded = run(xv.as_tensor());
            let what = format!("norm_first {norm_first}");
            assert_eq!(differing(&inference, &recorded), 0, "{what}: outputs differ");
        });
    }
}

/// A xorshift generator for the configuration sweep below (fixed seed: the same cases each run).
struct Sweep(u64);

impl Sweep {
    fn pick(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

#[test]
fn a_bf16_encoder_layer_route_matches_its_twin_over_a_sweep_of_configurations() {
    // 200 seeded configurations of a bf16 layer in inference (a third pre-norm), each run without a
    // gradient (the bf16 route, or the twin where the route does not apply: few rows, grouped
    // or unsupported options) and with one (the twin): the same bits, or the same error.
    // Widths with 1-8 heads, 8-130 hidden units, 1-90 tokens, 1-3 sequences, both layouts,
    // unbatched calls, with and without biases, float, bool, causal and per-head masks, key
    // padding (whole sequences padded too), a soft cap, windows, ALiBi, and NaN, infinite or
    // huge input values.
    let mut rng = Sweep(0x9e37_79b9_7f4a_7c15);
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    for case in 0..200 {
        let (e, h) = [(8, 1), (16, 2), (24, 3), (32, 4), (48, 6), (64, 8)][rng.pick(6)];
        let (f, l, n) = ([8, 40, 72, 130][rng.pick(4)], 1 + rng.pick(90), 1 + rng.pick(3));
        let (batch_first, unbatched) = (rng.pick(2) == 1, rng.pick(6) == 0);
        let act = [Activation::Gelu, Activation::Relu][rng.pick(2)];
        let norm_first = rng.pick(3) == 0;
        let cfg = LayerConfig::new(e, h)
            .with_dim_feedforward(f)
            .with_dropout(0.0)
            .with_activation(act)
            .with_bias(rng.pick(3) != 0)
            .with_batch_first(batch_first)
            .with_norm_first(norm_first);
        let layer = TransformerEncoderLayer::new(cfg.clone(), vb.pp(format!("c{case}"))).unwrap();
        let mut l16 =
            deterministic(&layer, DType::BF16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
        l16.eval();
        let dims = match (unbatched, batch_first) {
            (true, _) => vec![l, e],
            (false, true) => vec![n, l, e],
            (false, false) => vec![l, n, e],
        };
        let nb = if unbatched { 1 } else { n };
        let mut xs = values(&det(&dims, DType::F32, case as f64));
        if rng.pick(5) == 0 {
            let i = rng.pick(xs.len());
            xs[i] = [f64::NAN, f64::INFINITY, 1e30][rng.pick(3)];
        }
        let x = Tensor::from_vec(xs, &dims[..], &dev()).unwrap().to_dtype(DType::BF16).unwrap();
        let mut opts = MhaOptions::default();
        match rng.pick(5) {
            1 => opts = opts.attn_mask(Mask::Float(det(&[l, l], DType::BF16, 3.0))),
            2 => {
                let v = (0..l * l).map(|i| u8::from(i % 5 == 0 && i % (l + 1) != 0));
                let v = Tensor::from_vec(v.collect::<Vec<_>>(), (l, l), &dev()).unwrap();
                opts = opts.attn_mask(Mask::Bool(v));
            }
            3 => {
                let m = multihead::generate_square_subsequent_mask(l, DType::BF16, &dev());
                opts = opts.attn_mask(Mask::Float(m.unwrap())).is_causal(true);
            }
            4 if !unbatched => {
                opts = opts.attn_mask(Mask::Float(det(&[nb * h, l, l], DType::BF16, 4.0)))
            }
            _ => {}
        }
        if !unbatched && rng.pick(3) == 0 {
            let whole = rng.pick(4) == 0; // the first sequence padded whole
            let v = (0..nb * l).map(|i| u8::from(whole && i < l || i % l >= l - l / 3));
            let v = Tensor::from_vec(v.collect::<Vec<_>>(), (nb, l), &dev()).unwrap();
            opts = opts.key_padding_mask(Mask::Bool(v));
        }
        opts = opts.variants(match rng.pick(5) {
            1 => multihead::Variants::default().softcap(5.0),
            2 => multihead::Variants::default().window(Some(1 + rng.pick(5)), Some(rng.pick(3))),
            3 => multihead::Variants::default().alibi(multihead::Variants::alibi_slopes_for(h)),
            _ => multihead::Variants::default(),
        });
        let run = |t: &Tensor| direct(|| l16.forward_with(t, &opts));
        let xv = var(&x);
        let what = format!("case {case}: e {e} h {h} f {f} dims {dims:?} {act:?} {opts:?}");
        let what = format!("{what}, norm_first {norm_first}");
        match (no_grad(|| run(&x)), run(xv.as_tensor())) {
            (Ok(a), Ok(b)) => assert_eq!(differing(&a, &b), 0, "{what}"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{what}"),
            (a, b) => panic!("{what}: {:?} against {:?}", a.err(), b.err()),
        }
    }
}

#[test]
fn a_packed_bf16_encoder_layer_without_a_gradient_keeps_its_weights_bf16_with_the_twins_bits() {
    // `forward_packed` of a bf16 layer without a gradient multiplies its bf16 weights as they
    // are (the attention's f32 products and the feed-forward block's) instead of widening them
    // into an f32 twin; with a gradient recorded (an input that is a Var) it runs the twin:
    // the same bits. Post-norm and pre-norm, ReLU and GELU, with and without biases, causal,
    // sinks, a window, the composed path, NaN in one sequence, and sequences of 1 to 37
    // tokens; with bf16 products widened (no route) too.
    use multihead::functional::CuSeqlens;
    use multihead::multihead_attention::PackedOptions;
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let lens = [5usize, 37, 1, 20];
    let cu = CuSeqlens::from_lengths(&lens);
    let t: usize = lens.iter().sum();
    let mut xs = values(&det(&[t, 32], DType::F32, 5.0));
    xs[6 * 32 + 3] = f64::NAN; // the second sequence's second token
    let x = Tensor::from_vec(xs, (t, 32), &dev()).unwrap().to_dtype(DType::BF16).unwrap();
    let xv = var(&x);
    let sinks = det(&[4], DType::BF16, 6.0);
    let opts = [
        ("plain", PackedOptions::default()),
        ("causal", PackedOptions::default().is_causal(true)),
        ("sinks", PackedOptions::default().sinks(sinks)),
        (
            "window",
            PackedOptions::default()
                .variants(multihead::Variants::default().window(Some(3), Some(1))),
        ),
        // The composed path: the products' bf16 weights widened as the twin's.
        ("composed", PackedOptions::default().backend(multihead::Backend::Composed)),
    ];
    let layers = [(Activation::Gelu, false, true), (Activation::Relu, true, false)];
    for (i, (act, norm_first, bias)) in layers.into_iter().enumerate() {
        let cfg = LayerConfig::new(32, 4)
            .with_dim_feedforward(72)
            .with_dropout(0.0)
            .with_activation(act)
            .with_norm_first(norm_first)
            .with_bias(bias);
        let layer = TransformerEncoderLayer::new(cfg.clone(), vb.pp(format!("p{i}"))).unwrap();
        let mut l16 =
            deterministic(&layer, DType::BF16, |vb| TransformerEncoderLayer::new(cfg.clone(), vb));
        l16.eval();
        for (what, o) in &opts {
            let run = |x: &Tensor| l16.forward_packed(x, &cu, o).unwrap();
            let what = format!("{what}, {act:?}, norm_first {norm_first}, bias {bias}");
            for products in [Bf16Products::Direct, Bf16Products::Widened] {
                let inference = with_bf16_products(products, || no_grad(|| run(&x)));
                let recorded = with_bf16_products(products, || run(xv.as_tensor()));
                assert_eq!(inference.dtype(), DType::BF16, "{what}");
                let differ = differing(&inference, &recorded);
                assert_eq!(differ, 0, "{what}, {products:?}: outputs differ");
            }
            let y = values(&direct(|| no_grad(|| run(&x))));
            let nan_rows: Vec<bool> = y.chunks(32).map(|r| r.iter().any(|v| v.is_nan())).collect();
            // NaN stays in its own sequence (tokens 5..42).
            assert!(nan_rows.iter().enumerate().all(|(r, n)| !n || (5..42).contains(&r)), "{what}");
            assert!(nan_rows[6], "{what}: the NaN token's row");
        }
        // A strided view (the rows of a transposed tensor) gives its contiguous copy's bits;
        // a wrong dtype and a size that cannot be allocated are errors, on this route as on
        // the twin's.
        let strided = x.t().unwrap().contiguous().unwrap().t().unwrap();
        assert!(!strided.is_contiguous());
        let o = PackedOptions::default();
        let run = |x: &Tensor| direct(|| no_grad(|| l16.forward_packed(x, &cu, &o)));
        assert_eq!(differing(&run(&strided).unwrap(), &run(&x).unwrap()), 0, "strided {i}");
        let e = run(&x.to_dtype(DType::F32).unwrap()).unwrap_err().to_string();
        assert!(e.contains("F32") && e.contains("BF16"), "{e}");
        let rows = 1usize << 36;
        let huge = det(&[1, 32], DType::BF16, 1.0).broadcast_as((rows, 32)).unwrap();
        let whole = CuSeqlens::from_lengths(&[rows]);
        let r = direct(|| no_grad(|| l16.forward_packed(&huge, &whole, &o)));
        assert!(matches!(r, Err(multihead::Error::Alloc { .. })), "huge: {r:?}");
    }
}

/// `Auto` widens a small call's products (under 2^20 multiply-adds in its largest product)
/// outside `no_grad`, and multiplies bf16 operands directly in a large call and inside
/// `no_grad`, where it decides so (`with_auto_bf16_decision(true)`: the rule runs the same on
/// every CPU). A small bf16 MHA training step, SDPA call and linear give `Widened`'s bits
/// (output and gradients); a large MHA, and the small ones inside `no_grad`, `Direct`'s. A
/// call's parts follow the call: an MHA whose attention is large and whose projections are
/// small, with untracked weights outside `no_grad`, is `Direct`'s bits throughout.
#[test]
fn auto_widens_small_calls_and_decides_large_ones_as_a_whole() {
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    use multihead::with_auto_bf16_decision;
    if std::env::var_os("MULTIHEAD_BF16_PRODUCTS").is_some() {
        // A choice for every call: the rule below does not apply (the CI runs without it).
        assert!(!multihead::explain_bf16_products().reason.contains("under 2^20"));
        return;
    }
    let auto = |f: &dyn Fn() -> Vec<Tensor>| {
        with_bf16_products(Bf16Products::Auto, || with_auto_bf16_decision(true, f))
    };
    let step = |m: &MultiheadAttention, x: &Tensor| -> Vec<Tensor> {
        let xv = candle_core::Var::from_tensor(x).unwrap();
        let y = m.forward(xv.as_tensor(), xv.as_tensor(), xv.as_tensor(), &MhaOptions::default());
        let y = y.unwrap().output;
        let loss = y.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        let mut out = vec![y, g.get(xv.as_tensor()).unwrap().clone()];
        out.extend(m.named_parameters().iter().filter_map(|(_, p)| g.get(p).cloned()));
        out
    };
    let same = |a: &[Tensor], b: &[Tensor]| {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| differing(x, y) == 0)
    };
    let inference = |f: &dyn Fn() -> Vec<Tensor>| multihead::no_grad(f);
    // N·L·E² = 2·8·16² = 4096: small.
    let cfg = MhaConfig::new(16, 4).with_batch_first(true).with_dropout(0.0);
    let (small, _vm) = crate::common::mha(cfg, DType::BF16);
    let x = det(&[2, 8, 16], DType::BF16, 1.0);
    assert!(same(&auto(&|| step(&small, &x)), &widened(|| step(&small, &x))), "small MHA step");
    assert!(!same(&widened(|| step(&small, &x)), &direct(|| step(&small, &x))), "the two differ");
    let q = det(&[1, 2, 8, 8], DType::BF16, 2.0);
    let sdpa = || vec![scaled_dot_product_attention(&q, &q, &q, &SdpaOptions::default()).unwrap()];
    assert!(same(&auto(&sdpa), &widened(sdpa)), "a small SDPA widens");
    let lin = multihead::Linear::from_weights(det(&[8, 16], DType::BF16, 3.0), None);
    let lin_y = || vec![lin.forward(&x).unwrap()];
    assert!(same(&auto(&lin_y), &widened(lin_y)), "a small linear widens");
    // Inference: small calls go direct.
    let small_y = || vec![small.forward(&x, &x, &x, &MhaOptions::default()).unwrap().output];
    assert!(same(&inference(&|| auto(&small_y)), &inference(&|| direct(small_y))), "no_grad");
    assert!(same(&inference(&|| auto(&sdpa)), &inference(&|| direct(sdpa))), "no_grad sdpa");
    // N·L·E² = 2·64·128² = 2^21: large.
    let cfg = MhaConfig::new(128, 4).with_batch_first(true).with_dropout(0.0);
    let (large, _vm) = crate::common::mha(cfg, DType::BF16);
    let x = det(&[2, 64, 128], DType::BF16, 4.0);
    assert!(same(&auto(&|| step(&large, &x)), &direct(|| step(&large, &x))), "large MHA step");
    // Attention 1024·1024·16 = 2^24, the in-projection 1024·16·48 < 2^20, weights untracked
    // (as loaded for inference) and no `no_grad`: the call is large, its projections follow.
    let cfg = MhaConfig::new(16, 4).with_batch_first(true).with_dropout(0.0);
    let (tracked, _vm) = crate::common::mha(cfg.clone(), DType::BF16);
    let state: HashMap<String, Tensor> = tracked.named_parameters().into_iter().collect();
    let vb = candle_nn::VarBuilder::from_tensors(state, DType::BF16, &dev());
    let mut plain = MultiheadAttention::new(cfg, vb).unwrap();
    multihead::Train::eval(&mut plain);
    let x = det(&[1, 1024, 16], DType::BF16, 5.0);
    let y = || vec![plain.forward(&x, &x, &x, &MhaOptions::default()).unwrap().output];
    assert!(same(&auto(&y), &direct(y)), "a large call's small projections");
    // Where Auto decides widened, every call widens.
    let widen_all = |f: &dyn Fn() -> Vec<Tensor>| with_auto_bf16_decision(false, f);
    assert!(same(&widen_all(&|| step(&large, &x_large())), &widened(|| step(&large, &x_large()))));
}

/// A packed bf16 batch is weighed by its sequences (each attends to itself only): a small
/// packed layer in training widens, and the same rows packed as longer sequences, whose
/// attention is large, go direct (where `Auto` decides direct).
#[test]
fn auto_weighs_a_packed_batch_by_its_sequences() {
    use multihead::functional::CuSeqlens;
    use multihead::multihead_attention::PackedOptions;
    use multihead::with_auto_bf16_decision;
    if std::env::var_os("MULTIHEAD_BF16_PRODUCTS").is_some() {
        return; // a choice for every call (the CI runs without it)
    }
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::BF16, &dev());
    let cfg = LayerConfig::new(16, 4).with_dim_feedforward(32).with_dropout(0.0);
    let layer = TransformerEncoderLayer::new(cfg, vb).unwrap();
    crate::common::perturb(&vm, DType::BF16);
    let run = |x: &Tensor, cu: &CuSeqlens| -> Vec<Tensor> {
        let xv = candle_core::Var::from_tensor(x).unwrap();
        let y = layer.forward_packed(xv.as_tensor(), cu, &PackedOptions::default()).unwrap();
        let loss = y.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        vec![y, g.get(xv.as_tensor()).unwrap().clone()]
    };
    let auto = |f: &dyn Fn() -> Vec<Tensor>| {
        with_bf16_products(Bf16Products::Auto, || with_auto_bf16_decision(true, f))
    };
    let same = |a: &[Tensor], b: &[Tensor]| a.iter().zip(b).all(|(x, y)| differing(x, y) == 0);
    // 1024 rows of 16 in sequences of 8: products 1024·16·48 < 2^20, attention 1024·8·16.
    let x = det(&[1024, 16], DType::BF16, 1.0);
    let short = CuSeqlens::from_lengths(&[8; 128]);
    assert!(same(&auto(&|| run(&x, &short)), &widened(|| run(&x, &short))), "short sequences");
    assert!(!same(&direct(|| run(&x, &short)), &widened(|| run(&x, &short))), "the two differ");
    // The same rows as two sequences of 512: attention 2·512²·16 = 2^23, large.
    let long = CuSeqlens::from_lengths(&[512, 512]);
    assert!(same(&auto(&|| run(&x, &long)), &direct(|| run(&x, &long))), "long sequences");
}

fn x_large() -> Tensor {
    det(&[2, 64, 128], DType::BF16, 4.0)
}
