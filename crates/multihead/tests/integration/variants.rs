//! SDPA's variants (soft cap, windows, causal alignment, key lengths): the fused kernels
//! against the composed path (outputs and gradients), the composed path's gradients against
//! f64 finite differences, and the errors of bad options on both paths.

use candle_core::{DType, Tensor};
use multihead::functional::{explain_sdpa, scaled_dot_product_attention, SdpaOptions};
use multihead::random::DropoutKey;
use multihead::{Backend, CausalAlign, Error, Mask, Path, Variants};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, var};

/// Output and the gradients of q, k, v of `sum(out ∘ g)`.
fn run(shapes: [&[usize]; 3], opts: &SdpaOptions, dtype: DType) -> (Tensor, Vec<Tensor>) {
    let q = var(&det(shapes[0], dtype, 1.0));
    let k = var(&det(shapes[1], dtype, 2.0));
    let v = var(&det(shapes[2], dtype, 3.0));
    let out = scaled_dot_product_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), opts)
        .expect("sdpa");
    let g = det(out.dims(), dtype, 4.0);
    let grads = out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let gs = [&q, &k, &v].map(|t| grads.get(t.as_tensor()).expect("grad").clone());
    (out, gs.to_vec())
}

fn compare(shapes: [&[usize]; 3], opts: SdpaOptions, what: &str) {
    let (q, k, v) = (shapes[0], shapes[1], shapes[2]);
    let probe = [q, k, v].map(|s| Tensor::zeros(s, DType::F32, &candle_core::Device::Cpu).unwrap());
    let plan = explain_sdpa(&probe[0], &probe[1], &probe[2], &opts).expect("plan");
    assert_eq!(plan.path, Path::Fused, "{what}: {plan:?}");
    let (a, ga) = run(shapes, &opts.clone().backend(Backend::Fused), DType::F32);
    let (b, gb) = run(shapes, &opts.backend(Backend::Composed), DType::F32);
    assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
    for (name, (x, y)) in ["dq", "dk", "dv"].iter().zip(ga.iter().zip(&gb)) {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: {name}"));
    }
}

#[test]
fn fused_variants_match_the_composed_path() {
    let (q, kv): (&[usize], &[usize]) = (&[2, 4, 70, 16], &[2, 4, 90, 16]);
    let o = SdpaOptions::default;
    compare([q, kv, kv], o().softcap(0.5).scale(2.0), "softcap");
    compare([q, kv, kv], o().is_causal(true).causal_align(CausalAlign::BottomRight), "lower right");
    compare([q, kv, kv], o().is_causal(true).window(Some(7), None), "sliding window");
    compare([q, kv, kv], o().window(Some(3), Some(5)), "two-sided window");
    compare([q, kv, kv], o().kv_lengths(vec![90, 31]), "key lengths");
    let all = Variants::default()
        .align(CausalAlign::BottomRight)
        .window(Some(12), None)
        .kv_lengths(vec![85, 90])
        .softcap(1.5);
    let key = DropoutKey { seed: 3, offset: 0 };
    compare([q, kv, kv], o().is_causal(true).variants(all.clone()), "all");
    compare([q, kv, kv], o().variants(all.clone()).dropout_p(0.2).dropout_key(key), "dropout");
    // With an explicit float mask, and grouped-query heads.
    let mask = Mask::Float(det(&[70, 90], DType::F32, 5.0));
    compare([q, kv, kv], o().variants(all).attn_mask(mask), "mask");
    // ONNX's placement, with a float mask and with a bool mask (its hidden keys stay hidden).
    let after = Variants::default().softcap(0.9).softcap_after_masks(true).window(Some(20), None);
    let fmask = Mask::Float(det(&[2, 1, 70, 90], DType::F32, 6.0));
    compare([q, kv, kv], o().variants(after.clone()).attn_mask(fmask), "cap after float mask");
    let bits: Vec<u8> = (0..70 * 90).map(|i| (i % 7 != 3) as u8).collect();
    let bmask = Mask::Bool(Tensor::from_vec(bits, (70, 90), &candle_core::Device::Cpu).unwrap());
    compare([q, kv, kv], o().variants(after).attn_mask(bmask), "cap after bool mask");
    let (qg, kg): (&[usize], &[usize]) = (&[2, 6, 33, 8], &[2, 2, 40, 8]);
    let v = Variants::default().window(Some(4), Some(0)).softcap(0.7).kv_lengths(vec![40, 9]);
    compare([qg, kg, kg], o().enable_gqa(true).variants(v), "gqa");
}

/// An infinite score at a key hidden by index (causal, here) under a soft cap after the masks:
/// the cap makes it `c` and the band then hides it, on both paths (the composed path once added
/// the band before the cap: `inf − inf`, NaN rows).
#[test]
fn an_infinite_score_at_a_hidden_key_under_a_cap_after_the_masks_stays_hidden() {
    let dev = candle_core::Device::Cpu;
    let q = Tensor::from_vec(vec![1f32, 0.5, 1.0, 0.25], (1, 1, 2, 2), &dev).unwrap();
    let k = Tensor::from_vec(vec![0.5f32, 1.0, f32::INFINITY, 1.0], (1, 1, 2, 2), &dev).unwrap();
    let v = det(&[1, 1, 2, 2], DType::F32, 3.0);
    let after = Variants::default().softcap(2.0).softcap_after_masks(true);
    let zeros = Mask::Float(Tensor::zeros((2, 2), DType::F32, &dev).unwrap());
    // Causal, and (with a float mask, which is_causal refuses) a window ending at the diagonal.
    for mask in [None, Some(zeros)] {
        let mut outs = Vec::new();
        for backend in [Backend::Fused, Backend::Composed] {
            let mut o = match &mask {
                None => SdpaOptions::default().is_causal(true).variants(after.clone()),
                Some(_) => SdpaOptions::default().variants(after.clone().window(Some(4), Some(0))),
            }
            .backend(backend);
            o.attn_mask = mask.clone();
            let out = scaled_dot_product_attention(&q, &k, &v, &o).unwrap();
            let vals = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(
                vals.iter().all(|x| x.is_finite()),
                "{backend:?} {:?}: {vals:?}",
                mask.is_some()
            );
            outs.push(out);
        }
        assert_close(&outs[0], &outs[1], Tolerance::F32_FORWARD, "fused against composed");
    }
}

/// A `-inf` score (a `-inf` key) under a cap after the masks with an ALiBi bias and no mask: the
/// cap makes it `-c` on both paths (a `-inf` sum is kept only where masks are, as the kernels
/// keep it; the composed path once counted the ALiBi bias as a mask).
#[test]
fn an_alibi_bias_alone_is_not_a_mask_for_the_cap_after_the_masks() {
    let dev = candle_core::Device::Cpu;
    let q = Tensor::from_vec(vec![1f32, 0.5, 0.5, 0.25], (1, 1, 2, 2), &dev).unwrap();
    let k =
        Tensor::from_vec(vec![0.5f32, 1.0, f32::NEG_INFINITY, 1.0], (1, 1, 2, 2), &dev).unwrap();
    let v = det(&[1, 1, 2, 2], DType::F32, 3.0);
    let after = Variants::default().softcap(2.0).softcap_after_masks(true).alibi(vec![0.5]);
    let run = |backend| {
        let o = SdpaOptions::default().variants(after.clone()).backend(backend);
        scaled_dot_product_attention(&q, &k, &v, &o).unwrap()
    };
    let (fused, composed) = (run(Backend::Fused), run(Backend::Composed));
    assert_close(&fused, &composed, Tolerance::F32_FORWARD, "alibi, cap after the masks");
}

/// `scale = 0`: every score is 0 and the query's gradient is `0 · (dS k)`, zeros (NaN where a
/// key is NaN), on both paths; candle drops an `affine` by 0 from the graph, which once left the
/// composed path (every f64 call) with no query gradient at all.
#[test]
fn a_zero_scale_still_gives_the_query_a_gradient() {
    for (dtype, backend) in
        [(DType::F32, Backend::Fused), (DType::F32, Backend::Composed), (DType::F64, Backend::Auto)]
    {
        let q = var(&det(&[1, 2, 3, 4], dtype, 1.0));
        let k0 = det(&[1, 2, 5, 4], dtype, 2.0);
        for nan_key in [false, true] {
            let k = match nan_key {
                true => {
                    let mut x = k0
                        .flatten_all()
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap();
                    x[3] = f64::NAN;
                    Tensor::from_vec(x, k0.dims(), k0.device()).unwrap().to_dtype(dtype).unwrap()
                }
                false => k0.clone(),
            };
            let v = det(&[1, 2, 5, 4], dtype, 3.0);
            let o = SdpaOptions::default().scale(0.0).backend(backend);
            let out = scaled_dot_product_attention(q.as_tensor(), &k, &v, &o).unwrap();
            let grads = out.sum_all().unwrap().backward().unwrap();
            let gq =
                grads.get(q.as_tensor()).unwrap_or_else(|| panic!("{backend:?} {dtype:?}: no dq"));
            let gq =
                gq.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            let what = format!("{backend:?} {dtype:?} nan key {nan_key}");
            // Head 0 reads the NaN key: its rows are NaN; head 1 gets zeros.
            for (i, x) in gq.iter().enumerate() {
                let head0 = i < 12;
                match nan_key && head0 {
                    true => assert!(x.is_nan(), "{what}: dq[{i}] = {x}"),
                    false => assert_eq!(*x, 0.0, "{what}: dq[{i}]"),
                }
            }
        }
    }
}

/// The composed path's gradient of `sum(out ∘ g)` in f64 against central differences of the
/// same function, for every input element (small sizes).
#[test]
fn composed_variants_have_the_finite_difference_gradients() {
    let shapes: [&[usize]; 3] = [&[2, 1, 4, 3], &[2, 1, 6, 3], &[2, 1, 6, 2]];
    let before = SdpaOptions::default()
        .is_causal(true)
        .softcap(0.8)
        .scale(1.7)
        .causal_align(CausalAlign::BottomRight)
        .window(Some(2), None)
        .kv_lengths(vec![6, 5])
        .backend(Backend::Composed);
    // ONNX's placement: a float mask inside the cap.
    let mask = Mask::Float(det(&[4, 6], DType::F64, 7.0));
    let after = before.clone().variants(Variants::default().softcap(0.6).softcap_after_masks(true));
    for opts in [before, after.is_causal(false).attn_mask(mask)] {
        finite_differences(shapes, &opts);
    }
}

fn finite_differences(shapes: [&[usize]; 3], opts: &SdpaOptions) {
    let (_, grads) = run(shapes, opts, DType::F64);
    let inputs = [1.0, 2.0, 3.0].map(|salt| det(shapes[salt as usize - 1], DType::F64, salt));
    let f = |xs: &[Tensor; 3]| -> f64 {
        let out = scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], opts).unwrap();
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
                xs[which] = Tensor::from_vec(x, shapes[which], &candle_core::Device::Cpu).unwrap();
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

#[test]
fn bad_variant_options_are_errors_on_both_paths() {
    let q = det(&[2, 2, 3, 4], DType::F32, 1.0);
    let k = det(&[2, 2, 5, 4], DType::F32, 2.0);
    for backend in [Backend::Fused, Backend::Composed] {
        let o = || SdpaOptions::default().backend(backend);
        for c in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let e = scaled_dot_product_attention(&q, &k, &k, &o().softcap(c)).unwrap_err();
            assert!(matches!(e, Error::Config { arg: "softcap", .. }), "{e}");
        }
        for lens in [vec![5], vec![5, 6], vec![1, 2, 3]] {
            let e = scaled_dot_product_attention(&q, &k, &k, &o().kv_lengths(lens)).unwrap_err();
            assert!(matches!(e, Error::Config { arg: "kv_lengths", .. }), "{e}");
            assert!(e.to_string().contains("scaled_dot_product_attention"), "{e}");
        }
        // Key lengths need a batch dimension.
        let q3 = det(&[2, 3, 4], DType::F32, 1.0);
        let e = scaled_dot_product_attention(&q3, &q3, &q3, &o().kv_lengths(vec![3])).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "kv_lengths", .. }), "{e}");
    }
}

/// A window wider than the sequence, a zero-length batch entry and a window that hides every key
/// of some rows: zeros there (as for fully masked rows), the same on both paths.
#[test]
fn edge_windows_and_lengths_agree() {
    let (q, kv): (&[usize], &[usize]) = (&[2, 1, 9, 4], &[2, 1, 5, 4]);
    let o = SdpaOptions::default;
    compare([q, kv, kv], o().window(Some(1000), Some(1000)), "wide window");
    compare([q, kv, kv], o().kv_lengths(vec![0, 5]), "empty entry");
    // Rows 6.. see no key: right window 0 around the diagonal of a 9 x 5 problem.
    compare([q, kv, kv], o().window(Some(0), Some(0)), "diagonal only");
    let (out, _) = run([q, kv, kv], &o().window(Some(0), Some(0)), DType::F32);
    let rows = out.flatten_to(2).unwrap().to_vec2::<f32>().unwrap();
    assert!(rows[6..9].iter().all(|r| r.iter().all(|&x| x == 0.0)), "{rows:?}");
}
