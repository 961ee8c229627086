//! ALiBi and attention sinks through SDPA: the fused kernels against the composed path
//! (outputs, q/k/v gradients and the sinks' gradient), the composed gradients against f64
//! central differences, and bad options as errors on both paths.

use candle_core::{DType, Tensor, Var};
use multihead::functional::{explain_sdpa, scaled_dot_product_attention, SdpaOptions};
use multihead::random::DropoutKey;
use multihead::{Backend, CausalAlign, Error, Mask, Path, Variants};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, var};

/// Output and the gradients of q, k, v (and the sinks, when `sinks`) of `sum(out ∘ g)`.
fn run(
    shapes: [&[usize]; 3],
    opts: &SdpaOptions,
    sinks: Option<&Var>,
    dtype: DType,
) -> (Tensor, Vec<Tensor>) {
    let [q, k, v] = [1.0, 2.0, 3.0].map(|salt| var(&det(shapes[salt as usize - 1], dtype, salt)));
    let mut opts = opts.clone();
    if let Some(s) = sinks {
        opts = opts.sinks(s.as_tensor().clone());
    }
    let out = scaled_dot_product_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)
        .expect("sdpa");
    let g = det(out.dims(), dtype, 4.0);
    let grads = out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let mut gs: Vec<Tensor> =
        [&q, &k, &v].iter().map(|t| grads.get(t.as_tensor()).expect("grad").clone()).collect();
    if let Some(s) = sinks {
        gs.push(grads.get(s.as_tensor()).expect("sinks grad").clone());
    }
    (out, gs)
}

fn sinks_var(h: usize, dtype: DType) -> Var {
    let vals: Vec<f64> = (0..h).map(|i| [0.3, -1.0, 2.5, -0.2, 1.1, 0.0][i % 6]).collect();
    var(&Tensor::from_vec(vals, h, &candle_core::Device::Cpu).unwrap().to_dtype(dtype).unwrap())
}

fn compare(shapes: [&[usize]; 3], opts: SdpaOptions, with_sinks: bool, what: &str) {
    let probe = shapes.map(|s| Tensor::zeros(s, DType::F32, &candle_core::Device::Cpu).unwrap());
    let plan = explain_sdpa(&probe[0], &probe[1], &probe[2], &opts).expect("plan");
    assert_eq!(plan.path, Path::Fused, "{what}: {plan:?}");
    let hq = shapes[0][shapes[0].len() - 3];
    let s = with_sinks.then(|| sinks_var(hq, DType::F32));
    let (a, ga) = run(shapes, &opts.clone().backend(Backend::Fused), s.as_ref(), DType::F32);
    let (b, gb) = run(shapes, &opts.backend(Backend::Composed), s.as_ref(), DType::F32);
    assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
    for (name, (x, y)) in ["dq", "dk", "dv", "dsinks"].iter().zip(ga.iter().zip(&gb)) {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: {name}"));
    }
}

#[test]
fn fused_alibi_and_sinks_match_the_composed_path() {
    let (q, kv): (&[usize], &[usize]) = (&[2, 4, 70, 16], &[2, 4, 90, 16]);
    let o = SdpaOptions::default;
    let slopes = Variants::alibi_slopes_for(4);
    compare([q, kv, kv], o().alibi(slopes.clone()), false, "alibi");
    let causal = o().is_causal(true).causal_align(CausalAlign::BottomRight);
    compare([q, kv, kv], causal.clone().alibi(slopes.clone()), false, "alibi causal");
    compare([q, kv, kv], o(), true, "sinks");
    compare([q, kv, kv], causal.clone().window(Some(9), None), true, "sinks, sliding window");
    let key = DropoutKey { seed: 7, offset: 0 };
    let all = Variants::default()
        .align(CausalAlign::BottomRight)
        .window(Some(30), None)
        .kv_lengths(vec![85, 0])
        .softcap(1.5)
        .alibi(slopes.clone());
    compare([q, kv, kv], o().is_causal(true).variants(all.clone()), true, "all");
    compare([q, kv, kv], o().variants(all).dropout_p(0.2).dropout_key(key), true, "dropout");
    // ALiBi inside the cap (ONNX's placement) with a float mask; grouped-query heads.
    let after = Variants::default().softcap(0.9).softcap_after_masks(true).alibi(slopes);
    let fmask = Mask::Float(det(&[2, 1, 70, 90], DType::F32, 6.0));
    compare([q, kv, kv], o().variants(after).attn_mask(fmask), true, "cap after mask");
    let (qg, kg): (&[usize], &[usize]) = (&[2, 6, 33, 8], &[2, 2, 40, 8]);
    let gqa = o().enable_gqa(true).alibi(Variants::alibi_slopes_for(6)).is_causal(true);
    compare([qg, kg, kg], gqa, true, "gqa");
}

/// The composed path's gradients of `sum(out ∘ g)` in f64 (q, k, v and the sinks) against
/// central differences.
#[test]
fn composed_alibi_and_sinks_have_the_finite_difference_gradients() {
    let shapes: [&[usize]; 3] = [&[2, 2, 4, 3], &[2, 2, 6, 3], &[2, 2, 6, 2]];
    let opts = SdpaOptions::default()
        .alibi(vec![0.7, -0.2])
        .softcap(0.8)
        .is_causal(true)
        .causal_align(CausalAlign::BottomRight)
        .backend(Backend::Composed);
    let sinks = sinks_var(2, DType::F64);
    let (_, grads) = run(shapes, &opts, Some(&sinks), DType::F64);
    let mut inputs: Vec<Tensor> =
        [1.0, 2.0, 3.0].iter().map(|&s| det(shapes[s as usize - 1], DType::F64, s)).collect();
    inputs.push(sinks.as_tensor().clone());
    let f = |xs: &[Tensor]| -> f64 {
        let o = opts.clone().sinks(xs[3].clone());
        let out = scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], &o).unwrap();
        let g = det(out.dims(), DType::F64, 4.0);
        out.mul(&g).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
    };
    let h = 1e-6;
    for (which, grad) in grads.iter().enumerate() {
        let analytic = grad.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let x0 = inputs[which].flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for (i, &a) in analytic.iter().enumerate() {
            let shifted = |d: f64| {
                let mut x = x0.clone();
                x[i] += d;
                let mut xs = inputs.clone();
                let shape = inputs[which].shape().clone();
                xs[which] = Tensor::from_vec(x, shape, &candle_core::Device::Cpu).unwrap();
                f(&xs)
            };
            let numeric = (shifted(h) - shifted(-h)) / (2.0 * h);
            assert!(
                (a - numeric).abs() <= 1e-6 + 1e-6 * numeric.abs(),
                "input {which}[{i}]: {a} vs {numeric}"
            );
        }
    }
}

/// The sinks change the output (a sink of −inf is none), and ALiBi's default slopes are the
/// paper's.
#[test]
fn sinks_and_slopes_do_what_they_say() {
    let shapes: [&[usize]; 3] = [&[1, 2, 5, 4], &[1, 2, 7, 4], &[1, 2, 7, 4]];
    let inf =
        var(&Tensor::new(&[f32::NEG_INFINITY, f32::NEG_INFINITY], &candle_core::Device::Cpu)
            .unwrap());
    for backend in [Backend::Fused, Backend::Composed] {
        let o = SdpaOptions::default().backend(backend);
        let (plain, _) = run(shapes, &o, None, DType::F32);
        let (none, g) = run(shapes, &o, Some(&inf), DType::F32);
        assert_close(&none, &plain, Tolerance::F32_FORWARD, "a -inf sink");
        assert!(g[3].to_vec1::<f32>().unwrap().iter().all(|&x| x == 0.0));
        let (sunk, _) = run(shapes, &o, Some(&sinks_var(2, DType::F32)), DType::F32);
        let diff = (sunk - &plain).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() > 1e-2);
    }
    let m = Variants::alibi_slopes_for(12);
    let want: Vec<f64> = (1..=8)
        .map(|i| 2f64.powf(-(i as f64)))
        .chain([1, 3, 5, 7].map(|i| 2f64.powf(-0.5 * i as f64)))
        .collect();
    assert_eq!(m, want);
}

#[test]
fn bad_alibi_and_sinks_are_errors_on_both_paths() {
    let q = det(&[2, 2, 3, 4], DType::F32, 1.0);
    let k = det(&[2, 2, 5, 4], DType::F32, 2.0);
    for backend in [Backend::Fused, Backend::Composed] {
        let o = || SdpaOptions::default().backend(backend);
        for slopes in [vec![0.5], vec![0.5, f64::NAN], vec![0.5, 1e300]] {
            let e = scaled_dot_product_attention(&q, &k, &k, &o().alibi(slopes)).unwrap_err();
            assert!(matches!(e, Error::Config { arg: "alibi_slopes", .. }), "{e}");
        }
        let q2 = det(&[3, 4], DType::F32, 1.0);
        let e = scaled_dot_product_attention(&q2, &q2, &q2, &o().alibi(vec![1.0])).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "alibi_slopes", .. }), "{e}");
        let bad =
            [det(&[3], DType::F32, 1.0), det(&[1, 2], DType::F32, 1.0), det(&[2], DType::F64, 1.0)];
        for s in bad {
            let e = scaled_dot_product_attention(&q, &k, &k, &o().sinks(s)).unwrap_err();
            assert!(e.to_string().contains("sinks"), "{e}");
            assert!(e.to_string().contains("scaled_dot_product_attention"), "{e}");
        }
    }
}

/// A learned-bias case: name, q/k/v shapes, the bias's shape, options.
type BiasCase<'a> = (&'a str, [&'a [usize]; 3], &'a [usize], SdpaOptions);

/// A learned additive bias (T5/Swin relative positions) on the fused path: outputs and the
/// gradients of q, k, v and the bias against the composed path, for biases broadcast over the
/// batch, the heads or both, through soft caps in both placements, windows, dropout and GQA.
#[test]
fn a_learned_bias_gets_its_gradient_on_the_fused_path() {
    let (q, kv): (&[usize], &[usize]) = (&[2, 4, 70, 16], &[2, 4, 90, 16]);
    let (qg, kg): (&[usize], &[usize]) = (&[2, 6, 33, 8], &[2, 2, 40, 8]);
    let key = DropoutKey { seed: 9, offset: 0 };
    let o = SdpaOptions::default;
    let cases: Vec<BiasCase> = vec![
        ("per head", [q, kv, kv], &[1, 4, 70, 90], o()),
        ("full", [q, kv, kv], &[2, 4, 70, 90], o().softcap(0.8)),
        ("shared", [q, kv, kv], &[70, 90], o().window(Some(20), Some(5)).softcap(1.2)),
        ("per batch", [q, kv, kv], &[2, 1, 70, 90], o().dropout_p(0.2).dropout_key(key)),
        (
            "cap after",
            [q, kv, kv],
            &[4, 70, 90],
            o().variants(Variants::default().softcap(0.9).softcap_after_masks(true)),
        ),
        ("gqa", [qg, kg, kg], &[6, 33, 40], o().enable_gqa(true).kv_lengths(vec![40, 11])),
    ];
    for (what, shapes, bias_shape, opts) in cases {
        let bias = var(&det(bias_shape, DType::F32, 8.0));
        let opts = opts.attn_mask(Mask::Float(bias.as_tensor().clone()));
        let plan = explain_sdpa(
            &det(shapes[0], DType::F32, 1.0),
            &det(shapes[1], DType::F32, 2.0),
            &det(shapes[2], DType::F32, 3.0),
            &opts,
        )
        .expect("plan");
        assert_eq!(plan.path, Path::Fused, "{what}: {plan:?}");
        let grads_of = |backend| {
            let (out, mut gs) = run(shapes, &opts.clone().backend(backend), None, DType::F32);
            // `run` took the gradients of q, k, v; the bias's comes from the same graph.
            let g = det(out.dims(), DType::F32, 4.0);
            let store = out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            gs.push(store.get(bias.as_tensor()).expect("bias grad").clone());
            (out, gs)
        };
        let (a, ga) = grads_of(Backend::Fused);
        let (b, gb) = grads_of(Backend::Composed);
        assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
        for (name, (x, y)) in ["dq", "dk", "dv", "dbias"].iter().zip(ga.iter().zip(&gb)) {
            assert_eq!(x.dims(), y.dims(), "{what}: {name}");
            assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: {name}"));
        }
    }
}
