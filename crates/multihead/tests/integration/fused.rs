//! The fused flash-attention path (f32, CPU) against the composed candle path: outputs, weights
//! and every gradient, over masks, causal hints, dropout and layouts.

use candle_core::{DType, Tensor};
use multihead::functional::explain_sdpa;
use multihead::random::DropoutKey;
use multihead::{no_grad, with_backend, Backend, Path};
use multihead::{Mask, MhaConfig, MhaOptions, NamedParameters};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, dev, mha, var};

/// `Auto` takes the fused kernels where they apply; `Composed` never does.
fn backend(fused: bool) -> Backend {
    if fused {
        Backend::Auto
    } else {
        Backend::Composed
    }
}

struct Run {
    output: Tensor,
    weights: Option<Tensor>,
    grads: Vec<(String, Tensor)>,
}

fn run(
    cfg: &MhaConfig,
    opts: &MhaOptions,
    l: usize,
    s: usize,
    n: usize,
    training: bool,
    fused: bool,
) -> Run {
    with_backend(backend(fused), || {
        let (mut m, _vm) = mha(cfg.clone(), DType::F32);
        m.train(training);
        let q = var(&det(&[l, n, cfg.embed_dim], DType::F32, 1.0));
        let k = var(&det(&[s, n, cfg.kdim()], DType::F32, 2.0));
        let v = var(&det(&[s, n, cfg.vdim()], DType::F32, 3.0));
        let out = m.forward(q.as_tensor(), k.as_tensor(), v.as_tensor(), opts).expect("forward");
        let g = det(out.output.dims(), DType::F32, 4.0);
        let grads = out.output.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        let mut named: Vec<(String, Tensor)> = m
            .named_parameters()
            .into_iter()
            .map(|(k, t)| (k, grads.get(&t).expect("param grad").clone()))
            .collect();
        for (name, t) in [("query", &q), ("key", &k), ("value", &v)] {
            named.push((name.into(), grads.get(t.as_tensor()).expect("input grad").clone()));
        }
        Run { output: out.output, weights: out.attn_weights, grads: named }
    })
}

fn compare(
    cfg: MhaConfig,
    opts: MhaOptions,
    l: usize,
    s: usize,
    n: usize,
    training: bool,
    what: &str,
) {
    let a = run(&cfg, &opts, l, s, n, training, true);
    let b = run(&cfg, &opts, l, s, n, training, false);
    assert_close(&a.output, &b.output, Tolerance::F32_FORWARD, &format!("{what}: output"));
    if let (Some(x), Some(y)) = (&a.weights, &b.weights) {
        assert_close(x, y, Tolerance::F32_FORWARD, &format!("{what}: weights"));
    }
    for ((name, x), (_, y)) in a.grads.iter().zip(&b.grads) {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: grad {name}"));
    }
}

fn bool_mask(shape: &[usize], salt: f64) -> Tensor {
    let n: usize = shape.iter().product();
    let bits: Vec<u8> = (0..n).map(|i| (((i as f64 + salt) * 0.618).fract() < 0.3) as u8).collect();
    Tensor::from_vec(bits, shape, &dev()).unwrap()
}

#[test]
fn fused_equals_composed_without_and_with_masks() {
    let cfg = MhaConfig::new(16, 4);
    compare(cfg.clone(), MhaOptions::default().need_weights(false), 70, 70, 2, true, "plain");
    compare(cfg.clone(), MhaOptions::default().need_weights(false), 9, 130, 3, true, "cross L<S");
    let attn = Mask::Bool(bool_mask(&[33, 65], 0.2));
    let kpm = Mask::Float(det(&[2, 65], DType::F32, 5.0));
    let opts = MhaOptions::default().need_weights(false).attn_mask(attn).key_padding_mask(kpm);
    compare(cfg.clone(), opts, 33, 65, 2, true, "both masks");
    let per_head = Mask::Float(det(&[2 * 4, 20, 20], DType::F32, 6.0));
    compare(
        cfg.clone(),
        MhaOptions::default().need_weights(false).attn_mask(per_head),
        20,
        20,
        2,
        true,
        "3-D mask",
    );
    let causal =
        Mask::Float(multihead::generate_square_subsequent_mask(40, DType::F32, &dev()).unwrap());
    compare(
        cfg.clone(),
        MhaOptions::default().need_weights(false).attn_mask(causal).is_causal(true),
        40,
        40,
        2,
        true,
        "causal",
    );
    // Fully padded batch element: zeros on both paths, finite gradients.
    let kpm = Mask::Bool(Tensor::new(&[[1u8; 7], [0, 0, 0, 1, 1, 0, 0]], &dev()).unwrap());
    compare(
        cfg.clone(),
        MhaOptions::default().need_weights(false).key_padding_mask(kpm),
        5,
        7,
        2,
        true,
        "fully masked",
    );
    compare(
        MhaConfig::new(12, 3).with_kdim(5).with_vdim(7),
        MhaOptions::default().need_weights(false),
        6,
        8,
        2,
        true,
        "separate",
    );
}

/// `bias_k`/`bias_v` and `add_zero_attn` run on the fused kernels (their key columns appended
/// to the projections), with the composed path's outputs, weights and gradients (`bias_k` and
/// `bias_v` included): masks, dropout, weights with gradients, batch first, static keys.
#[test]
fn extra_key_columns_run_fused() {
    let attn = Mask::Bool(bool_mask(&[10, 13], 0.7));
    let kpm = Mask::Float(det(&[2, 13], DType::F32, 5.0));
    let masks = MhaOptions::default().attn_mask(attn).key_padding_mask(kpm);
    let static_kv = MhaOptions::default()
        .static_kv(det(&[2 * 4, 9, 4], DType::F32, 7.0), det(&[2 * 4, 9, 4], DType::F32, 8.0));
    let both = |c: MhaConfig| c.with_add_bias_kv(true).with_add_zero_attn(true);
    let plain = MhaOptions::default();
    // (config, options, L, S, what); `compare` makes the query (L, 2, 16) and keys (S, 2, 16).
    let cases = [
        (MhaConfig::new(16, 4).with_add_bias_kv(true), plain.clone(), 10, 13, "bias_kv"),
        (MhaConfig::new(16, 4).with_add_zero_attn(true), plain.clone(), 10, 13, "zero_attn"),
        (both(MhaConfig::new(16, 4)), masks, 10, 13, "both, masks"),
        (both(MhaConfig::new(16, 4)).with_dropout(0.2), plain.clone(), 10, 13, "dropout"),
        (both(MhaConfig::new(16, 4)).with_batch_first(true), plain, 7, 7, "batch first"),
    ];
    for (cfg, opts, l, s, what) in cases {
        let opts = opts.dropout_key(DropoutKey { seed: 4, offset: 0 });
        let (m, _vm) = mha(cfg.clone(), DType::F32);
        let (q, k) = (det(&[l, 2, 16], DType::F32, 1.0), det(&[s, 2, 16], DType::F32, 2.0));
        let plan = m.explain(&q, &k, &k, &opts).unwrap();
        assert_eq!(plan.path, Path::Fused, "{what}: {plan:?}");
        compare(cfg.clone(), opts.clone(), l, s, 2, true, what);
        compare(cfg, opts.need_weights(false), l, s, 2, true, what);
    }
    // Static keys (the zero-attention key appended to them): the key and value inputs get no
    // gradient, so outputs, weights and the query's gradient.
    let cfg = MhaConfig::new(16, 4).with_add_zero_attn(true);
    let (m, _vm) = mha(cfg, DType::F32);
    let x = det(&[10, 2, 16], DType::F32, 1.0);
    let go = |fused: bool| {
        with_backend(backend(fused), || {
            let q = var(&x);
            let plan = m.explain(q.as_tensor(), &x, &x, &static_kv).unwrap();
            assert_eq!(plan.path == Path::Fused, fused, "static keys: {plan:?}");
            let out = m.forward(q.as_tensor(), &x, &x, &static_kv).unwrap();
            let w = out.attn_weights.clone().expect("weights");
            let loss = out.output.sum_all().unwrap().add(&w.sqr().unwrap().sum_all().unwrap());
            let g = loss.unwrap().backward().unwrap();
            (out.output, w, g.get(q.as_tensor()).unwrap().clone())
        })
    };
    let ((a, wa, ga), (b, wb, gb)) = (go(true), go(false));
    assert_close(&a, &b, Tolerance::F32_FORWARD, "static keys: output");
    assert_close(&wa, &wb, Tolerance::F32_FORWARD, "static keys: weights");
    assert_close(&ga, &gb, Tolerance::F32_GRAD, "static keys: query gradient");
}

/// The calls that now run fused (3-D and broadcast SDPA, extra key columns, weights with
/// gradients) give the composed path's NaN, errors and numbers on strided views, NaN inputs,
/// wrong shapes and f64.
#[test]
fn new_fused_paths_agree_with_composed_on_nan_views_shapes_and_dtypes() {
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let nan_at = |t: &Tensor, i: usize| -> Tensor {
        let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[i] = f32::NAN;
        Tensor::from_vec(v, t.dims(), &dev()).unwrap()
    };
    // SDPA: a transposed 3-D query, NaN in one key; a batch-broadcast key with NaN.
    let q3 = det(&[4, 8, 9], DType::F32, 1.0).transpose(1, 2).unwrap(); // (4, 9, 8), strided
    let k3 = nan_at(&det(&[4, 11, 8], DType::F32, 2.0), 30);
    let v3 = det(&[4, 11, 8], DType::F32, 3.0);
    let q4 = det(&[2, 4, 9, 8], DType::F32, 1.0);
    let k4 = nan_at(&det(&[1, 4, 11, 8], DType::F32, 2.0), 100);
    let v4 = det(&[1, 4, 11, 8], DType::F32, 3.0).broadcast_as((2, 4, 11, 8)).unwrap();
    for (q, k, v) in [(&q3, &k3, &v3), (&q4, &k4, &v4)] {
        let mask = Mask::Bool(bool_mask(&[9, 11], 0.5));
        let go = |fused: bool| {
            let o = SdpaOptions::default().attn_mask(mask.clone()).backend(backend(fused));
            assert_eq!(explain_sdpa(q, k, v, &o).unwrap().path == Path::Fused, fused);
            scaled_dot_product_attention(q, k, v, &o).unwrap()
        };
        let (a, b) = (go(true), go(false));
        let nans = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(nans.iter().any(|x| x.is_nan()), "a NaN key reaches the output");
        assert_close(&a, &b, Tolerance::F32_FORWARD, "sdpa with NaN");
        // Wrong shapes: the same error on both paths; f64 takes the composed path on both.
        let bad = det(&[4, 11, 7], DType::F32, 4.0);
        let err = |fused: bool| {
            let o = SdpaOptions::default().backend(backend(fused));
            scaled_dot_product_attention(&q3, &bad, &v3, &o).unwrap_err().to_string()
        };
        assert_eq!(err(true), err(false));
        let (q64, k64, v64) = (
            q.to_dtype(DType::F64).unwrap(),
            k.to_dtype(DType::F64).unwrap(),
            v.to_dtype(DType::F64).unwrap(),
        );
        let plan = explain_sdpa(&q64, &k64, &v64, &SdpaOptions::default()).unwrap();
        assert_eq!(plan.path, Path::Composed, "f64: {plan:?}");
    }
    // MHA with extra key columns and the weights with gradients: a NaN query row.
    let cfg = MhaConfig::new(16, 4).with_add_bias_kv(true).with_add_zero_attn(true);
    let (m, _vm) = mha(cfg, DType::F32);
    let x = nan_at(&det(&[6, 2, 16], DType::F32, 1.0), 20);
    let go = |fused: bool| {
        with_backend(backend(fused), || {
            let q = var(&x);
            let out =
                m.forward(q.as_tensor(), q.as_tensor(), q.as_tensor(), &MhaOptions::default());
            let out = out.unwrap();
            let w = out.attn_weights.clone().expect("weights");
            let loss = out.output.sum_all().unwrap().add(&w.sum_all().unwrap()).unwrap();
            let g = loss.backward().unwrap();
            (out.output, w, g.get(q.as_tensor()).unwrap().clone())
        })
    };
    let ((a, wa, ga), (b, wb, gb)) = (go(true), go(false));
    assert_close(&a, &b, Tolerance::F32_FORWARD, "mha with NaN: output");
    assert_close(&wa, &wb, Tolerance::F32_FORWARD, "mha with NaN: weights");
    assert_close(&ga, &gb, Tolerance::F32_GRAD, "mha with NaN: gradient");
}

#[test]
fn fused_dropout_draws_the_composed_mask() {
    let cfg = MhaConfig::new(16, 2).with_dropout(0.3);
    let opts =
        MhaOptions::default().need_weights(false).dropout_key(DropoutKey { seed: 5, offset: 2 });
    compare(cfg, opts, 24, 24, 2, true, "dropout");
}

/// The weights asked for while gradients are recorded (PyTorch's default `need_weights=True`
/// in training): the output runs fused and the weights come through candle operations, so a
/// loss that uses them gets their gradient; output, weights and every gradient as on the
/// composed path, with dropout (the same mask for both), masks, grouped and static keys.
#[test]
fn weights_with_gradients_run_the_output_fused_and_carry_their_gradient() {
    let kpm = Mask::Bool(Tensor::new(&[[0u8; 17], [0; 17]], &dev()).unwrap());
    let cases = [
        (MhaConfig::new(16, 4), MhaOptions::default(), "plain"),
        (
            MhaConfig::new(16, 4).with_dropout(0.3),
            MhaOptions::default().dropout_key(DropoutKey { seed: 9, offset: 1 }),
            "dropout",
        ),
        (
            MhaConfig::new(16, 4),
            MhaOptions::default()
                .attn_mask(Mask::Bool(bool_mask(&[12, 17], 0.4)))
                .key_padding_mask(kpm)
                .average_attn_weights(false),
            "masks, per head",
        ),
        (MhaConfig::new(16, 4).with_num_kv_heads(2), MhaOptions::default(), "grouped"),
        // Self-attention (one packed projection), batch first: keys are the query.
        (MhaConfig::new(16, 4).with_batch_first(true), MhaOptions::default(), "self"),
    ];
    for (cfg, opts, what) in cases {
        let self_attn = what == "self";
        let (mut m, _vm) = mha(cfg.clone(), DType::F32);
        m.train(true);
        let q0 = det(&[12, 2, 16], DType::F32, 1.0);
        let k0 = det(&[17, 2, 16], DType::F32, 2.0);
        let go = |fused: bool| {
            with_backend(backend(fused), || {
                let q = var(&q0);
                let k = if self_attn { q.clone() } else { var(&k0) };
                let plan = m.explain(q.as_tensor(), k.as_tensor(), k.as_tensor(), &opts).unwrap();
                assert_eq!(plan.path == Path::Fused, fused, "{what}: {plan:?}");
                let out = m.forward(q.as_tensor(), k.as_tensor(), k.as_tensor(), &opts).unwrap();
                let w = out.attn_weights.clone().expect("weights");
                let loss = out.output.mul(&det(out.output.dims(), DType::F32, 3.0)).unwrap();
                let wl = w.mul(&det(w.dims(), DType::F32, 4.0)).unwrap().sum_all().unwrap();
                let grads = loss.sum_all().unwrap().add(&wl).unwrap().backward().unwrap();
                let mut gs: Vec<Tensor> =
                    [&q, &k].iter().map(|t| grads.get(t.as_tensor()).unwrap().clone()).collect();
                for (_, p) in m.named_parameters() {
                    gs.push(grads.get(&p).expect("parameter gradient").clone());
                }
                (out.output, w, gs)
            })
        };
        let ((a, wa, ga), (b, wb, gb)) = (go(true), go(false));
        assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
        assert_close(&wa, &wb, Tolerance::F32_FORWARD, &format!("{what}: weights"));
        for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
            assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: gradient {i}"));
        }
    }
}

#[test]
fn fused_weights_in_no_grad_equal_the_composed_weights() {
    let cfg = MhaConfig::new(16, 4);
    let (m, _vm) = mha(cfg, DType::F32);
    let q = det(&[12, 2, 16], DType::F32, 1.0);
    let k = det(&[17, 2, 16], DType::F32, 2.0);
    let mask = Mask::Bool(bool_mask(&[12, 17], 0.4));
    for average in [true, false] {
        let opts = MhaOptions::default().attn_mask(mask.clone()).average_attn_weights(average);
        let fused = no_grad(|| m.forward(&q, &k, &k, &opts)).unwrap();
        let composed = with_backend(Backend::Composed, || m.forward(&q, &k, &k, &opts)).unwrap();
        assert_close(&fused.output, &composed.output, Tolerance::F32_FORWARD, "output");
        assert_close(
            fused.attn_weights.as_ref().unwrap(),
            composed.attn_weights.as_ref().unwrap(),
            Tolerance::F32_FORWARD,
            "weights",
        );
    }
}

#[test]
fn sdpa_fused_equals_composed_with_gqa_masks_and_gradients() {
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let q0 = det(&[2, 4, 33, 8], DType::F32, 1.0);
    let k0 = det(&[2, 2, 47, 8], DType::F32, 2.0);
    let v0 = det(&[2, 2, 47, 6], DType::F32, 3.0);
    let masks = [
        None,
        Some(Mask::Bool(bool_mask(&[33, 47], 0.1))),
        Some(Mask::Float(det(&[2, 1, 33, 47], DType::F32, 4.0))),
        Some(Mask::Float(det(&[1, 47], DType::F32, 5.0))),
        // 1-D masks broadcast as any other (PyTorch 2.15 raises IndexError for them on 4-D
        // inputs: docs/pytorch-behaviour.md §8.18).
        Some(Mask::Bool(bool_mask(&[47], 0.2))),
        Some(Mask::Float(det(&[47], DType::F32, 7.0))),
    ];
    for (i, mask) in masks.into_iter().enumerate() {
        for causal in [false, true] {
            if causal && mask.is_some() {
                continue;
            }
            let mut opts = SdpaOptions::default().enable_gqa(true).is_causal(causal).scale(0.3);
            opts.attn_mask = mask.clone();
            let go = |fused: bool| {
                with_backend(backend(fused), || {
                    let (q, k, v) = (var(&q0), var(&k0), var(&v0));
                    let plan = explain_sdpa(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts);
                    assert_eq!(plan.unwrap().path == Path::Fused, fused, "path taken");
                    let out = scaled_dot_product_attention(
                        q.as_tensor(),
                        k.as_tensor(),
                        v.as_tensor(),
                        &opts,
                    )
                    .unwrap();
                    let g = out
                        .mul(&det(out.dims(), DType::F32, 6.0))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let grads: Vec<Tensor> = [&q, &k, &v]
                        .iter()
                        .map(|t| g.get(t.as_tensor()).unwrap().clone())
                        .collect();
                    (out, grads)
                })
            };
            let (a, ga) = go(true);
            let (b, gb) = go(false);
            assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("mask {i} causal {causal}"));
            for (x, y) in ga.iter().zip(&gb) {
                assert_close(x, y, Tolerance::F32_GRAD, &format!("grad, mask {i} causal {causal}"));
            }
        }
    }
}

/// Rows whose keys are all masked, with an infinite or NaN value among those keys: the fused
/// and composed paths give the same outputs (0·inf is NaN there, as in PyTorch) and the same
/// gradients. PyTorch's softmax backward, `(g - Σ g·y)·y`, meets `0·inf` in its sum on such a
/// row and gives NaN for every key of it, as the fused kernels' `D = Σ dO·O` does; the
/// composed softmax gave 0 for the finite keys (its zero-row guard cut the sum's gradient).
#[test]
fn fully_masked_rows_with_a_non_finite_value_give_the_same_gradients_on_both_paths() {
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    for dtype in [DType::F32, DType::BF16] {
        for bad in [f64::NEG_INFINITY, f64::NAN] {
            let q0 = det(&[2, 1, 3, 8], dtype, 1.0);
            let k0 = det(&[2, 1, 2, 8], dtype, 2.0);
            // The second batch's key 1 holds the bad value in its last channel.
            let flat = det(&[2, 1, 2, 8], DType::F64, 3.0).flatten_all().unwrap();
            let mut vals = flat.to_vec1::<f64>().unwrap();
            vals[31] = bad;
            let v0 = Tensor::from_vec(vals, (2, 1, 2, 8), &dev()).unwrap();
            let v0 = v0.to_dtype(dtype).unwrap();
            // The first batch's row 1 sees no key; the second batch's rows see none (a row that
            // sees any key meets the bad value as 0·inf in its output, NaN on both paths).
            let take = Tensor::new(&[1u8, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0], &dev()).unwrap();
            let take = take.reshape((2, 1, 3, 2)).unwrap();
            let opts = SdpaOptions { attn_mask: Some(Mask::Bool(take)), ..Default::default() };
            let go = |fused: bool| {
                with_backend(backend(fused), || {
                    let (q, k, v) = (var(&q0), var(&k0), var(&v0));
                    let (q, k, v) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                    let plan = explain_sdpa(q, k, v, &opts).unwrap();
                    assert_eq!(plan.path == Path::Fused, fused, "path taken");
                    let out = scaled_dot_product_attention(q, k, v, &opts).unwrap();
                    let up = det(out.dims(), dtype, 6.0);
                    let g = out.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
                    let grads: Vec<Tensor> =
                        [q, k, v].iter().map(|t| g.get(t).unwrap().clone()).collect();
                    (out, grads)
                })
            };
            let ((a, ga), (b, gb)) = (go(true), go(false));
            let what = format!("{dtype:?} value {bad}");
            let tol = match dtype {
                DType::BF16 => Tolerance::BF16_GRAD,
                _ => Tolerance::F32_GRAD,
            };
            assert_close(&a, &b, tol, &what);
            for (name, (x, y)) in ["q", "k", "v"].iter().zip(ga.iter().zip(&gb)) {
                assert_close(x, y, tol, &format!("{what}: grad {name}"));
            }
            // The second batch's key gradient is NaN for both keys: PyTorch's sum meets 0·inf
            // on each of its rows.
            let dk = ga[1].to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let dk = dk.to_vec1::<f32>().unwrap();
            assert!(dk[16..].iter().all(|x| x.is_nan()), "{what}: {dk:?}");
        }
    }
}

/// SDPA's output and the gradients of q, k and v for the loss `Σ out ∘ up` (a fixed `up`).
fn sdpa_and_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &multihead::functional::SdpaOptions,
) -> (Tensor, Vec<Tensor>) {
    let out = multihead::functional::scaled_dot_product_attention(q, k, v, opts).unwrap();
    let up = det(out.dims(), DType::F32, 6.0);
    let g = out.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
    (out, [q, k, v].iter().map(|t| g.get(t).unwrap().clone()).collect())
}

/// 3-D and 5-D inputs take the fused kernels as the 4-D call with their leading dimensions
/// merged (bit for bit that call), and agree with the composed path, gradients and dropout
/// included; a mask whose leading dimensions cannot be merged keeps the composed path.
#[test]
fn sdpa_on_3d_and_5d_inputs_runs_fused_as_the_4d_call() {
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    };
    // (lead, mask shape and whether it is boolean, fused expected)
    type MaskSpec = Option<(Vec<usize>, bool)>;
    // The last field says whether the call runs fused; every case here does now (a mask whose
    // leading dimensions broadcast is expanded), and the path is asserted for each.
    let cases: Vec<(Vec<usize>, MaskSpec, bool)> = vec![
        (vec![2, 3], None, true),
        (vec![2, 3], Some((vec![9, 11], true)), true),
        (vec![2, 3], Some((vec![2, 3, 4, 9, 11], false)), true),
        (vec![2, 3], Some((vec![1, 1, 1, 9, 11], false)), true),
        (vec![2, 3], Some((vec![3, 4, 1, 11], false)), true), // expanded over the first dim
        (vec![1, 3], Some((vec![3, 1, 9, 11], true)), true),
        (vec![], None, true),
        (vec![], Some((vec![4, 9, 11], false)), true),
        // Keys and values broadcast over the first leading dimension (expanded, then merged).
        (vec![2, 3, 0], Some((vec![3, 1, 9, 11], false)), true),
    ];
    for (ci, (lead, mask, fused_expected)) in cases.into_iter().enumerate() {
        // A trailing 0 in `lead` marks keys and values with a first leading dimension of 1.
        let kv_one = lead.last() == Some(&0);
        let lead: Vec<usize> = lead.into_iter().filter(|&x| x != 0).collect();
        let shape = |h: usize, l: usize, e: usize, kv: bool| {
            let mut v = lead.clone();
            if kv && kv_one {
                v[0] = 1;
            }
            v.extend([h, l, e]);
            v
        };
        let (q0, k0, v0) = (
            det(&shape(4, 9, 8, false), DType::F32, 1.0),
            det(&shape(2, 11, 8, true), DType::F32, 2.0),
            det(&shape(2, 11, 6, true), DType::F32, 3.0),
        );
        let mask = mask.map(|(dims, is_bool)| match is_bool {
            true => Mask::Bool(bool_mask(&dims, 0.3)),
            false => Mask::Float(det(&dims, DType::F32, 4.0)),
        });
        for p in [0.0, 0.3] {
            let mut opts = SdpaOptions::default().enable_gqa(true).scale(0.4).dropout_p(p);
            opts = opts.dropout_key(DropoutKey { seed: 7, offset: 0 });
            opts.attn_mask = mask.clone();
            let what = format!("case {ci}, p {p}");
            let go = |fused: bool| {
                with_backend(backend(fused), || {
                    let (q, k, v) = (var(&q0), var(&k0), var(&v0));
                    let plan = explain_sdpa(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts);
                    assert_eq!(
                        plan.unwrap().path == Path::Fused,
                        fused && fused_expected,
                        "{what}"
                    );
                    let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                    sdpa_and_grads(qt, kt, vt, &opts)
                })
            };
            let (a, ga) = go(true);
            let (b, gb) = go(false);
            assert_eq!(
                a.dims(),
                q0.dims()[..q0.rank() - 1]
                    .iter()
                    .chain(&[6])
                    .copied()
                    .collect::<Vec<_>>()
                    .as_slice()
            );
            assert_close(&a, &b, Tolerance::F32_FORWARD, &what);
            for (x, y) in ga.iter().zip(&gb) {
                assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: grad"));
            }
            if fused_expected {
                // The 4-D call on the merged inputs, bit for bit.
                let n: usize = lead.iter().product();
                let four = |t: &Tensor| {
                    let d = t.dims();
                    let r = d.len();
                    let full: Vec<usize> = lead.iter().chain(&d[r - 3..]).copied().collect();
                    let t = t.broadcast_as(full).unwrap();
                    t.reshape((n, d[r - 3], d[r - 2], d[r - 1])).unwrap()
                };
                let mut o4 = opts.clone();
                o4.attn_mask = mask.as_ref().map(|m| {
                    let t = m.tensor();
                    let d = t.dims().to_vec();
                    let t = match d.len() {
                        0..=3 => t.clone(),
                        r if d[..r - 3].iter().all(|&x| x == 1) => t.reshape(&d[r - 3..]).unwrap(),
                        r => {
                            let full: Vec<usize> =
                                lead.iter().chain(&d[r - 3..]).copied().collect();
                            let t = t.broadcast_as(full).unwrap();
                            t.reshape((n, d[r - 3], d[r - 2], d[r - 1])).unwrap()
                        }
                    };
                    if m.is_bool() {
                        Mask::Bool(t)
                    } else {
                        Mask::Float(t)
                    }
                });
                let y4 = scaled_dot_product_attention(&four(&q0), &four(&k0), &four(&v0), &o4);
                assert_eq!(bits(&y4.unwrap()), bits(&a), "{what}: the 4-D call");
            }
        }
    }
}

#[test]
fn the_module_takes_the_fused_path_on_f32_and_not_on_f64() {
    let x32 = det(&[5, 2, 8], DType::F32, 1.0);
    let (m32, _a) = mha(MhaConfig::new(8, 2), DType::F32);
    let opts = MhaOptions::default().need_weights(false);
    assert_eq!(m32.explain(&x32, &x32, &x32, &opts).unwrap().path, Path::Fused);
    let (m64, _b) = mha(MhaConfig::new(8, 2), DType::F64);
    let x64 = det(&[5, 2, 8], DType::F64, 1.0);
    let plan = m64.explain(&x64, &x64, &x64, &opts).unwrap();
    assert_eq!(plan.path, Path::Composed, "f64 stays on the composed path");
    assert!(plan.to_string().contains("F64"), "{plan}");
    // Forcing the fused kernels on f64 is an error that says why, not a silent fall-back.
    let forced = opts.clone().backend(Backend::Fused);
    let err = m64.forward(&x64, &x64, &x64, &forced).unwrap_err().to_string();
    assert!(err.contains("Backend::Fused") && err.contains("F64"), "{err}");
}

#[test]
fn fused_linear_equals_candle_matmul_forward_and_backward() {
    use candle_nn::{VarBuilder, VarMap};
    for bias in [true, false] {
        for shape in [vec![7usize, 5], vec![3, 4, 5], vec![2, 1, 3, 5]] {
            for transposed in [false, true] {
                let go = |fused: bool| {
                    with_backend(backend(fused), || {
                        let vm = VarMap::new();
                        let lin = multihead::Linear::new(
                            5,
                            6,
                            bias,
                            VarBuilder::from_varmap(&vm, DType::F32, &dev()),
                        )
                        .unwrap();
                        for (i, (_, t)) in lin.named_parameters().iter().enumerate() {
                            let v = vm
                                .all_vars()
                                .into_iter()
                                .find(|v| v.as_tensor().id() == t.id())
                                .unwrap();
                            v.set(&det(v.dims(), DType::F32, i as f64 + 0.2)).unwrap();
                        }
                        let x = var(&det(&shape, DType::F32, 1.0));
                        let input = if transposed && shape.len() == 3 {
                            x.as_tensor().transpose(0, 1).unwrap()
                        } else {
                            x.as_tensor().clone()
                        };
                        let y = lin.forward(&input).unwrap();
                        let g = y
                            .mul(&det(y.dims(), DType::F32, 2.0))
                            .unwrap()
                            .sum_all()
                            .unwrap()
                            .backward()
                            .unwrap();
                        let mut grads = vec![g.get(x.as_tensor()).unwrap().clone()];
                        for (_, t) in lin.named_parameters() {
                            grads.push(g.get(&t).unwrap().clone());
                        }
                        (y, grads)
                    })
                };
                let (a, ga) = go(true);
                let (b, gb) = go(false);
                let what = format!("bias {bias} shape {shape:?} transposed {transposed}");
                assert_close(&a, &b, Tolerance::F32_FORWARD, &what);
                for (x, y) in ga.iter().zip(&gb) {
                    assert_close(x, y, Tolerance::F32_GRAD, &what);
                }
            }
        }
    }
}

#[test]
fn fused_long_key_path_equals_composed() {
    // Long key sequences (the kernels copy the projections' strided heads as they read them);
    // check them like the rest.
    for batch_first in [false, true] {
        let cfg = MhaConfig::new(8, 2).with_batch_first(batch_first);
        let n = 2;
        let kpm = Mask::Bool(bool_mask(&[n, 2048], 0.3));
        let self_opts = MhaOptions::default().need_weights(false).key_padding_mask(kpm);
        let go = |fused: bool, opts: &MhaOptions, l: usize, s: usize, cross: bool| {
            with_backend(backend(fused), || {
                let (m, _vm) = mha(cfg.clone(), DType::F32);
                let shape =
                    |len: usize| if batch_first { vec![n, len, 8] } else { vec![len, n, 8] };
                let q = var(&det(&shape(l), DType::F32, 1.0));
                let kv = if cross { var(&det(&shape(s), DType::F32, 2.0)) } else { q.clone() };
                let plan = m.explain(q.as_tensor(), kv.as_tensor(), kv.as_tensor(), opts).unwrap();
                assert_eq!(plan.path == Path::Fused, fused);
                let out =
                    m.forward(q.as_tensor(), kv.as_tensor(), kv.as_tensor(), opts).unwrap().output;
                let g = out
                    .mul(&det(out.dims(), DType::F32, 3.0))
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let mut grads = vec![g.get(q.as_tensor()).unwrap().clone()];
                if cross {
                    grads.push(g.get(kv.as_tensor()).unwrap().clone());
                }
                for (_, t) in m.named_parameters() {
                    grads.push(g.get(&t).unwrap().clone());
                }
                (out, grads)
            })
        };
        for (opts, l, s, cross) in [
            (self_opts.clone(), 2048, 2048, false),
            (
                MhaOptions::default().need_weights(false).attn_mask(Mask::Float(det(
                    &[5, 2100],
                    DType::F32,
                    4.0,
                ))),
                5,
                2100,
                true,
            ),
        ] {
            let (a, ga) = go(true, &opts, l, s, cross);
            let (b, gb) = go(false, &opts, l, s, cross);
            let what = format!("batch_first {batch_first} L {l} S {s}");
            assert_close(&a, &b, Tolerance::F32_FORWARD, &what);
            for (x, y) in ga.iter().zip(&gb) {
                // Parameter gradients sum over N·L = 4096 rows in different orders on the two
                // paths: scale the absolute tolerance with the gradient's size (f32 eps · rows).
                let max = y
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64;
                let tol =
                    Tolerance { rel: 1e-4, abs: 1e-4 + 4096.0 * f32::EPSILON as f64 * max * 1e-2 };
                assert_close(x, y, tol, &what);
            }
        }
    }
}

/// A LayerNorm over `d` with seeded parameters, and its parameters in name order.
fn seeded_layer_norm(d: usize, bias: bool) -> (multihead::LayerNorm, Vec<candle_core::Var>) {
    use candle_nn::{VarBuilder, VarMap};
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let ln = multihead::LayerNorm::new(d, 1e-5, bias, vb).unwrap();
    let mut named: Vec<(String, candle_core::Var)> =
        vm.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0)); // the VarMap's order is a HashMap's
    for (i, (_, v)) in named.iter().enumerate() {
        v.set(&det(v.dims(), DType::F32, 7.0 + i as f64)).unwrap();
    }
    (ln, named.into_iter().map(|(_, v)| v).collect())
}

#[test]
fn fused_residual_layer_norm_equals_the_composed_sum_and_norm_forward_and_backward() {
    use candle_nn::{VarBuilder, VarMap};
    for bias in [true, false] {
        for shape in [vec![3usize, 1], vec![2, 5, 17], vec![70, 384], vec![4, 3, 1000]] {
            let d = *shape.last().unwrap();
            let go = |fused: bool| {
                with_backend(backend(fused), || {
                    let (ln, named) = seeded_layer_norm(d, bias);
                    let x = var(&det(&shape, DType::F32, 1.0).affine(3.0, 0.5).unwrap());
                    let r = var(&det(&shape, DType::F32, 3.0).affine(2.0, -0.25).unwrap());
                    let y = ln.forward_residual(x.as_tensor(), r.as_tensor()).unwrap();
                    let g = y
                        .mul(&det(y.dims(), DType::F32, 2.0))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let mut grads = vec![
                        g.get(x.as_tensor()).unwrap().clone(),
                        g.get(r.as_tensor()).unwrap().clone(),
                    ];
                    for v in &named {
                        grads.push(g.get(v.as_tensor()).unwrap().clone());
                    }
                    (y, grads)
                })
            };
            let ((a, ga), (b, gb)) = (go(true), go(false));
            let what = format!("{shape:?} bias {bias}");
            assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: y"));
            assert_eq!(ga.len(), 3 + usize::from(bias));
            for (x, y) in ga.iter().zip(&gb) {
                assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: grad"));
            }
            // The residual's gradient is the input's (the sum's), on both paths.
            assert_close(&ga[0], &ga[1], Tolerance::F32_GRAD, &format!("{what}: dx = dr"));
        }
    }
    // Strided and broadcast views: a transposed input and a stride-0 residual give the norm of
    // their sum on both paths.
    for fused in [true, false] {
        with_backend(backend(fused), || {
            let (ln, _) = seeded_layer_norm(6, true);
            let x = det(&[6, 5], DType::F32, 1.0).t().unwrap(); // (5, 6), strided
            let r = det(&[1, 6], DType::F32, 2.0).broadcast_as((5, 6)).unwrap();
            let got = ln.forward_residual(&x, &r).unwrap();
            let want = ln.forward(&(&x.contiguous().unwrap() + &r).unwrap()).unwrap();
            assert_close(&got, &want, Tolerance::F32_FORWARD, &format!("views, fused {fused}"));
            // A NaN in the residual makes its row NaN and leaves the others alone.
            let mut rv = vec![0.5f32; 30];
            rv[7] = f32::NAN;
            let rn = Tensor::from_vec(rv, (5, 6), &dev()).unwrap();
            let y = ln.forward_residual(&x, &rn).unwrap().to_vec2::<f32>().unwrap();
            for (i, row) in y.iter().enumerate() {
                assert_eq!(row.iter().all(|v| v.is_nan()), i == 1, "NaN row {i}, fused {fused}");
                assert!(i == 1 || row.iter().all(|v| v.is_finite()), "row {i}, fused {fused}");
            }
        });
    }
    // A broadcast view too large to materialise is an allocation error, not an abort.
    for fused in [true, false] {
        with_backend(backend(fused), || {
            let (ln, _) = seeded_layer_norm(4, true);
            let huge = (1usize << 40, 4);
            let x = det(&[1, 4], DType::F32, 1.0).broadcast_as(huge).unwrap();
            let e = ln.forward_residual(&x, &x).unwrap_err();
            assert!(matches!(e, multihead::Error::Alloc { .. }), "fused {fused}: {e}");
        });
    }
    // A residual of another shape or dtype is an error on both paths, naming the residual.
    for fused in [true, false] {
        with_backend(backend(fused), || {
            let vm = VarMap::new();
            let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
            let ln = multihead::LayerNorm::new(4, 1e-5, true, vb).unwrap();
            let x = det(&[2, 4], DType::F32, 1.0);
            for r in [det(&[1, 4], DType::F32, 2.0), det(&[2, 4], DType::F64, 2.0)] {
                let e = ln.forward_residual(&x, &r).unwrap_err().to_string();
                assert!(e.contains("layer_norm") && e.contains("residual"), "{e}");
            }
        });
    }
}

#[test]
fn fused_layer_norm_equals_the_composed_one_forward_and_backward() {
    for bias in [true, false] {
        for shape in [vec![3usize, 1], vec![2, 5, 17], vec![70, 384], vec![4, 3, 1000]] {
            let d = *shape.last().unwrap();
            let go = |fused: bool| {
                with_backend(backend(fused), || {
                    let (ln, named) = seeded_layer_norm(d, bias);
                    let x = var(&det(&shape, DType::F32, 1.0).affine(3.0, 0.5).unwrap());
                    let y = ln.forward(x.as_tensor()).unwrap();
                    let g = y
                        .mul(&det(y.dims(), DType::F32, 2.0))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let mut grads = vec![g.get(x.as_tensor()).unwrap().clone()];
                    for v in &named {
                        grads.push(g.get(v.as_tensor()).unwrap().clone());
                    }
                    (y, grads)
                })
            };
            let ((a, ga), (b, gb)) = (go(true), go(false));
            assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{shape:?} bias {bias}: y"));
            for (x, y) in ga.iter().zip(&gb) {
                assert_close(x, y, Tolerance::F32_GRAD, &format!("{shape:?} bias {bias}: grad"));
            }
        }
    }
}

#[test]
fn fused_gelu_equals_the_composed_one_forward_and_backward() {
    for shape in [vec![1usize], vec![17], vec![3, 1000], vec![2, 64, 257]] {
        let go = |fused: bool| {
            with_backend(backend(fused), || {
                let x = var(&det(&shape, DType::F32, 1.0).affine(6.0, 0.0).unwrap());
                let y = multihead::Activation::Gelu.forward(x.as_tensor()).unwrap();
                let g = y.mul(&det(y.dims(), DType::F32, 2.0)).unwrap().sum_all().unwrap();
                let grads = g.backward().unwrap();
                (y, grads.get(x.as_tensor()).unwrap().clone())
            })
        };
        let ((a, ga), (b, gb)) = (go(true), go(false));
        assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{shape:?}: gelu"));
        assert_close(&ga, &gb, Tolerance::F32_GRAD, &format!("{shape:?}: gelu grad"));
    }
}

/// ReLU, alone and inside a layer's feed-forward block, gives the same bits on both paths,
/// with PyTorch's special values: NaN kept, `-inf` to 0, and the gradient selected by the
/// output (an infinite upstream gradient at a zeroed element gives 0, not NaN).
#[test]
fn fused_relu_equals_the_composed_one_and_fuses_into_the_feed_forward_product() {
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -3.0, 2.5];
    let mut xs = det(&[3, 40], DType::F32, 1.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    xs[..specials.len()].copy_from_slice(&specials);
    let mut gs = det(&[3, 40], DType::F32, 2.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    gs[2] = f32::INFINITY; // at x = -inf (zeroed)
    gs[5] = f32::NAN; // at x = -3 (zeroed)
    gs[6] = f32::INFINITY; // at x = 2.5 (kept)
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    };
    let go = |fused: bool| {
        with_backend(backend(fused), || {
            let x = var(&Tensor::from_vec(xs.clone(), (3, 40), &dev()).unwrap());
            let y = multihead::Activation::Relu.forward(x.as_tensor()).unwrap();
            let up = Tensor::from_vec(gs.clone(), (3, 40), &dev()).unwrap();
            let grads = y.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
            (bits(&y), bits(grads.get(x.as_tensor()).unwrap()))
        })
    };
    let ((y, g), (yc, gc)) = (go(true), go(false));
    assert_eq!(y, yc, "relu forward");
    assert_eq!(g, gc, "relu gradient");
    let y: Vec<f32> = y.iter().map(|b| f32::from_bits(*b)).collect();
    let g: Vec<f32> = g.iter().map(|b| f32::from_bits(*b)).collect();
    assert!(y[0].is_nan() && y[1] == f32::INFINITY && y[2] == 0.0 && y[6] == 2.5, "{y:?}");
    assert!(g[2] == 0.0 && g[5] == 0.0 && g[6] == f32::INFINITY, "{g:?}");
    // Inside an encoder layer (the activation fused into the first feed-forward product):
    // the output and every gradient of the composed layer, ReLU and GELU.
    for activation in [multihead::Activation::Relu, multihead::Activation::Gelu] {
        let cfg = multihead::transformer::LayerConfig::new(16, 2)
            .with_dim_feedforward(24)
            .with_dropout(0.0)
            .with_activation(activation)
            .with_batch_first(true);
        let vm = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
        let layer = multihead::transformer::TransformerEncoderLayer::new(cfg, vb).unwrap();
        let run = |fused: bool| {
            with_backend(backend(fused), || {
                let x = var(&det(&[2, 5, 16], DType::F32, 3.0));
                let y = layer.forward(x.as_tensor(), None, None, false).unwrap();
                let grads = y.mul(&det(y.dims(), DType::F32, 4.0)).unwrap().sum_all().unwrap();
                let grads = grads.backward().unwrap();
                let mut out = vec![y, grads.get(x.as_tensor()).unwrap().clone()];
                for (_, p) in layer.named_parameters() {
                    out.push(grads.get(&p).unwrap().clone());
                }
                out
            })
        };
        for (i, (a, b)) in run(true).iter().zip(&run(false)).enumerate() {
            assert_close(a, b, Tolerance::F32_GRAD, &format!("encoder layer, {activation:?}: {i}"));
        }
    }
}

/// A few rows without a gradient take the few-rows kernel: strided and broadcast views, NaN,
/// and wrong shapes or dtypes behave as on the composed path.
#[test]
fn few_row_linear_agrees_with_composed_on_views_nan_and_errors() {
    let wide = det(&[3, 20], DType::F32, 1.0);
    let x = wide.narrow(1, 2, 12).unwrap(); // strided rows
    let w = det(&[7, 12], DType::F32, 2.0);
    let b = det(&[1, 7], DType::F32, 3.0).broadcast_as((1, 7)).unwrap().squeeze(0).unwrap();
    let lin = multihead::Linear::from_weights(w.clone(), Some(b.clone()));
    let fused = no_grad(|| lin.forward(&x)).unwrap();
    let composed = with_backend(Backend::Composed, || lin.forward(&x)).unwrap();
    assert_close(&fused, &composed, Tolerance::F32_FORWARD, "few rows, strided x");
    // A broadcast (stride-0) input row.
    let xb = det(&[1, 12], DType::F32, 4.0).broadcast_as((5, 12)).unwrap();
    let fused = no_grad(|| lin.forward(&xb)).unwrap();
    let composed = with_backend(Backend::Composed, || lin.forward(&xb)).unwrap();
    assert_close(&fused, &composed, Tolerance::F32_FORWARD, "few rows, broadcast x");
    // NaN in one input row stays in that output row.
    let mut v = det(&[2, 12], DType::F32, 5.0).to_vec2::<f32>().unwrap();
    v[1][3] = f32::NAN;
    let xn = Tensor::new(v, &dev()).unwrap();
    let y = no_grad(|| lin.forward(&xn)).unwrap().to_vec2::<f32>().unwrap();
    assert!(y[0].iter().all(|x| x.is_finite()) && y[1].iter().all(|x| x.is_nan()));
    // Wrong feature size and dtype are the same typed errors as before.
    let err = no_grad(|| lin.forward(&det(&[2, 11], DType::F32, 1.0))).unwrap_err();
    assert!(matches!(err, multihead::Error::Shape { .. }), "{err}");
    let err = no_grad(|| lin.forward(&det(&[2, 12], DType::F64, 1.0))).unwrap_err();
    assert!(matches!(err, multihead::Error::DType { .. }), "{err}");
}

/// Cross-attention over one memory (key is value): the fused path reads k and v from the
/// packed key/value projection and writes one packed gradient; a key padding mask pads each
/// sequence's end. Output and every gradient (the memory's included) equal the composed
/// path's, and a NaN in the memory reaches the same outputs on both paths.
#[test]
fn cross_attention_over_one_memory_equals_composed_with_padding_and_nan() {
    let cfg = MhaConfig::new(32, 4).with_batch_first(true);
    let (n, l, s) = (3, 21, 150);
    // Row b pads its last 40·b keys.
    let pad: Vec<u8> = (0..n * s).map(|i| (i % s >= s - 40 * (i / s)) as u8).collect();
    let kpm = Mask::Bool(Tensor::from_vec(pad, (n, s), &dev()).unwrap());
    let opts = MhaOptions::default().need_weights(false).key_padding_mask(kpm);
    let go = |fused: bool, memory: &Tensor| {
        with_backend(backend(fused), || {
            let (m, _vm) = mha(cfg.clone(), DType::F32);
            let q = var(&det(&[n, l, 32], DType::F32, 1.0));
            let mem = var(memory);
            let (x, k) = (q.as_tensor(), mem.as_tensor());
            let out = m.forward(x, k, k, &opts).expect("forward").output;
            let g = det(out.dims(), DType::F32, 4.0);
            let grads = out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let mut all = vec![("output".to_string(), out.clone())];
            for (name, t) in m.named_parameters() {
                all.push((name, grads.get(&t).expect("param grad").clone()));
            }
            all.push(("query".into(), grads.get(x).expect("query grad").clone()));
            all.push(("memory".into(), grads.get(k).expect("memory grad").clone()));
            all
        })
    };
    let memory = det(&[n, s, 32], DType::F32, 2.0);
    for ((name, a), (_, b)) in go(true, &memory).iter().zip(&go(false, &memory)) {
        let tol = if name == "output" { Tolerance::F32_FORWARD } else { Tolerance::F32_GRAD };
        assert_close(a, b, tol, &format!("cross-attention: {name}"));
    }
    // NaN in a padded key of row 1: PyTorch adds the mask, so NaN still reaches that row.
    let mut m = memory.to_vec3::<f32>().unwrap();
    m[1][s - 1][3] = f32::NAN;
    let memory = Tensor::new(m, &dev()).unwrap();
    let nan_rows = |t: &Tensor| -> Vec<bool> {
        t.to_vec3::<f32>().unwrap().iter().map(|r| r.iter().flatten().any(|x| x.is_nan())).collect()
    };
    let (a, b) = (&go(true, &memory)[0].1, &go(false, &memory)[0].1);
    assert_eq!(nan_rows(a), nan_rows(b));
    assert_eq!(nan_rows(a), vec![false, true, false]);
}

/// Keys and values of at most one key block (S ≤ 256) are read in place, and longer ones
/// copied contiguous first: a strided view (heads taken out of `[N, S, H, D]` rows) and a
/// broadcast view (one batch entry's keys for every entry) give the composed numbers,
/// gradients included, either way.
/// Batch and head dimensions that broadcast between query, key and value run on the fused
/// kernels, read in place, with the composed path's outputs and gradients.
#[test]
fn sdpa_broadcast_batch_and_heads_run_fused() {
    use multihead::functional::SdpaOptions;
    let shapes: [([usize; 4], [usize; 4], [usize; 4]); 4] = [
        ([2, 3, 19, 8], [1, 3, 23, 8], [1, 3, 23, 5]),
        ([2, 3, 19, 8], [2, 1, 23, 8], [1, 3, 23, 5]),
        ([1, 1, 19, 8], [2, 3, 23, 8], [2, 3, 23, 5]),
        ([2, 4, 70, 8], [1, 1, 130, 8], [1, 1, 130, 5]),
    ];
    for (i, (qs, ks, vs)) in shapes.into_iter().enumerate() {
        for (causal, p) in [(false, 0.0), (true, 0.0), (false, 0.2)] {
            let mut opts = SdpaOptions::default()
                .is_causal(causal)
                .dropout_p(p)
                .dropout_key(DropoutKey { seed: 3, offset: 0 });
            if !causal {
                opts = opts.attn_mask(Mask::Float(det(&[qs[2], ks[2]], DType::F32, 5.0)));
            }
            let what = format!("shapes {i}, causal {causal}, p {p}");
            let go = |fused: bool| {
                with_backend(backend(fused), || {
                    let (q, k, v) = (
                        var(&det(&qs, DType::F32, 1.0)),
                        var(&det(&ks, DType::F32, 2.0)),
                        var(&det(&vs, DType::F32, 3.0)),
                    );
                    let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                    let plan = explain_sdpa(qt, kt, vt, &opts).unwrap();
                    assert_eq!(plan.path == Path::Fused, fused, "{what}: {plan:?}");
                    sdpa_and_grads(qt, kt, vt, &opts)
                })
            };
            let ((a, ga), (b, gb)) = (go(true), go(false));
            assert_eq!(a.dims(), b.dims(), "{what}");
            assert_close(&a, &b, Tolerance::F32_FORWARD, &what);
            for (x, y) in ga.iter().zip(&gb) {
                assert_eq!(x.dims(), y.dims(), "{what}: gradient shape");
                assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: grad"));
            }
        }
    }
}

#[test]
fn sdpa_reads_strided_and_broadcast_keys_in_place() {
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    for l in [17usize, 64, 130, 300] {
        let q = var(&det(&[2, 3, l, 8], DType::F32, 1.0));
        let k_rows = var(&det(&[2, l, 3, 8], DType::F32, 2.0));
        let v_one = var(&det(&[1, 3, l, 8], DType::F32, 3.0));
        let run = |b: Backend| {
            let k = k_rows.as_tensor().transpose(1, 2).unwrap();
            let v = v_one.as_tensor().broadcast_as((2, 3, l, 8)).unwrap();
            let o = SdpaOptions::default().is_causal(l == 64).backend(b);
            let y = scaled_dot_product_attention(q.as_tensor(), &k, &v, &o).unwrap();
            let g = y.mul(&det(y.dims(), DType::F32, 4.0)).unwrap().sum_all().unwrap();
            let grads = g.backward().unwrap();
            let gs: Vec<Tensor> = [q.as_tensor(), k_rows.as_tensor(), v_one.as_tensor()]
                .iter()
                .map(|t| grads.get(t).expect("grad").clone())
                .collect();
            (y, gs)
        };
        let (a, ga) = run(Backend::Fused);
        let (b, gb) = run(Backend::Composed);
        assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("l={l}: output"));
        for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
            assert_close(x, y, Tolerance::F32_GRAD, &format!("l={l}: gradient {i}"));
        }
    }
}

/// Key lengths on 5-D inputs run fused: one length per entry of the first dimension, repeated
/// over the dimensions merged into the batch; the same numbers as the composed path (and as
/// the 4-D call with the lengths repeated, bit for bit), gradients and dropout included.
#[test]
fn sdpa_key_lengths_on_5d_inputs_run_fused() {
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let (q0, k0, v0) = (
        det(&[2, 3, 4, 9, 8], DType::F32, 1.0),
        det(&[2, 3, 2, 11, 8], DType::F32, 2.0),
        det(&[2, 3, 2, 11, 6], DType::F32, 3.0),
    );
    for p in [0.0, 0.3] {
        let opts = SdpaOptions::default()
            .enable_gqa(true)
            .kv_lengths(vec![7, 11])
            .dropout_p(p)
            .dropout_key(DropoutKey { seed: 5, offset: 0 });
        let go = |fused: bool| {
            with_backend(backend(fused), || {
                let (q, k, v) = (var(&q0), var(&k0), var(&v0));
                let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                let plan = explain_sdpa(qt, kt, vt, &opts).unwrap();
                assert_eq!(plan.path == Path::Fused, fused, "{plan}");
                sdpa_and_grads(qt, kt, vt, &opts)
            })
        };
        let (a, ga) = go(true);
        let (b, gb) = go(false);
        assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("p {p}: output"));
        for (x, y) in ga.iter().zip(&gb) {
            assert_close(x, y, Tolerance::F32_GRAD, &format!("p {p}: gradient"));
        }
        // Key 7 onward of the first entry is hidden: its value rows get no gradient.
        let dv = ga[2].get(0).unwrap().narrow(2, 7, 4).unwrap();
        assert_eq!(dv.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        // The 4-D call with the lengths repeated over the merged dimension.
        let four = |t: &Tensor| {
            let d = t.dims();
            t.reshape((6, d[2], d[3], d[4])).unwrap()
        };
        let o4 = opts.clone().kv_lengths(vec![7, 7, 7, 11, 11, 11]);
        let m = no_grad(|| scaled_dot_product_attention(&four(&q0), &four(&k0), &four(&v0), &o4));
        let bits = |t: &Tensor| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&m.unwrap()), bits(&a), "p {p}: the merged 4-D call");
    }
}

/// 2-D `(L, E)` inputs (single-head attention as the tutorials write it) run fused as one head
/// of a batch of one: the composed path's numbers and gradients, with masks, the causal flag,
/// dropout, a soft cap and a window.
#[test]
fn sdpa_on_2d_inputs_runs_fused() {
    use multihead::functional::SdpaOptions;
    let (q0, k0, v0) = (
        det(&[9, 8], DType::F32, 1.0),
        det(&[11, 8], DType::F32, 2.0),
        det(&[11, 6], DType::F32, 3.0),
    );
    let key = DropoutKey { seed: 3, offset: 0 };
    let o = || SdpaOptions::default();
    let cases = [
        ("plain", o()),
        ("bool mask", o().attn_mask(Mask::Bool(bool_mask(&[9, 11], 0.3)))),
        ("float key mask", o().attn_mask(Mask::Float(det(&[11], DType::F32, 4.0)))),
        ("causal, scale", o().is_causal(true).scale(0.3)),
        ("dropout", o().dropout_p(0.3).dropout_key(key)),
        ("soft cap, window", o().softcap(0.8).window(Some(3), Some(1))),
    ];
    for (what, opts) in cases {
        let go = |fused: bool| {
            with_backend(backend(fused), || {
                let (q, k, v) = (var(&q0), var(&k0), var(&v0));
                let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                let plan = explain_sdpa(qt, kt, vt, &opts).unwrap();
                assert_eq!(plan.path == Path::Fused, fused, "{what}: {plan}");
                sdpa_and_grads(qt, kt, vt, &opts)
            })
        };
        let (a, ga) = go(true);
        let (b, gb) = go(false);
        assert_eq!(a.dims(), &[9, 6], "{what}");
        assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
        for (x, y) in ga.iter().zip(&gb) {
            assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: gradient"));
        }
    }
    // A learned (S,) bias on 2-D inputs: its gradient, reduced from (1, 1, L, S), on both paths.
    let bias = var(&det(&[11], DType::F32, 7.0));
    let mask_grad = |fused: bool| {
        with_backend(backend(fused), || {
            let opts = SdpaOptions::default().attn_mask(Mask::Float(bias.as_tensor().clone()));
            let out = multihead::functional::scaled_dot_product_attention(&q0, &k0, &v0, &opts);
            let up = det(&[9, 6], DType::F32, 6.0);
            let g = out.unwrap().mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
            g.get(bias.as_tensor()).expect("the bias's gradient").clone()
        })
    };
    let (a, b) = (mask_grad(true), mask_grad(false));
    assert_eq!(a.dims(), &[11]);
    assert_close(&a, &b, Tolerance::F32_GRAD, "2-D learned bias gradient");
}

#[test]
fn explain_sdpa_gives_the_calls_error_for_sizes_that_cannot_be_allocated() {
    // Broadcast views: a 2 TiB output (f32, fused; bf16, widened for the plan), and f64 calls
    // (composed) whose output is small but whose score matrices are not. The plan gives the
    // call's own error, and the same call at a sane size plans and runs.
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let o = SdpaOptions::default();
    let view = |dt: DType, dims: (usize, usize, usize, usize)| {
        det(&[1, 1, 1, dims.3], dt, 1.0).broadcast_as(dims).unwrap()
    };
    let cases = [
        ("f32 output", DType::F32, (1 << 20, 1 << 10, 1 << 8, 8), (1 << 20, 1 << 10, 4, 8)),
        ("bf16 output", DType::BF16, (1 << 20, 1 << 10, 1 << 8, 8), (1 << 20, 1 << 10, 4, 8)),
        ("f64 scores", DType::F64, (1, 1, 1 << 20, 1), (1, 1, 1 << 20, 1)),
    ];
    for (what, dt, qd, kd) in cases {
        let (q, k) = (view(dt, qd), view(dt, kd));
        // Without and with gradients recorded (a bf16 call then takes the widened route).
        for recorded in [false, true] {
            let run = |f: &dyn Fn() -> multihead::Error| if recorded { f() } else { no_grad(f) };
            let call = run(&|| scaled_dot_product_attention(&q, &k, &k, &o).unwrap_err());
            let plan = run(&|| explain_sdpa(&q, &k, &k, &o).unwrap_err());
            assert!(matches!(call, multihead::Error::Alloc { .. }), "{what}: {call}");
            assert_eq!(plan.to_string(), call.to_string(), "{what}, recorded {recorded}");
            assert!(call.to_string().contains("cannot be allocated"), "{what}: {call}");
        }
        let (q, k) = (view(dt, (2, 2, 5, qd.3)), view(dt, (2, 2, 7, kd.3)));
        let plan = explain_sdpa(&q, &k, &k, &o).unwrap();
        let y = no_grad(|| scaled_dot_product_attention(&q, &k, &k, &o)).unwrap();
        assert_eq!(y.dims(), &[2, 2, 5, qd.3], "{what}: {plan:?}");
    }
}

#[test]
fn sdpa_reads_broadcast_masks_and_strided_views_as_the_dense_tensors_and_checks_their_copies() {
    // A float mask expanded (stride 0) from (1, H, L, S) or (L, S) to (N, H, L, S), as PyTorch
    // code writes it, is copied for the kernels without its repeated dimensions: the same bits
    // as the mask made dense, on the f32 fused route (with gradients too) and the bf16 route,
    // and the same plan.
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let (n, h, l, s, e) = (3, 2, 5, 7, 8);
    for dt in [DType::F32, DType::BF16] {
        let q = det(&[n, h, l, e], dt, 1.0);
        let k = det(&[n, h, s, e], dt, 2.0);
        let v = det(&[n, h, s, e], dt, 3.0);
        // (The last two broadcast along the keys, then along everything: read with stride 0.)
        for base in [vec![1, h, l, s], vec![l, s], vec![l, 1], vec![1, 1]] {
            // One NaN (its row's output is NaN either way) among finite values.
            let mut vals =
                det(&base, DType::F32, 4.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            vals[0] = f32::NAN;
            let small =
                Tensor::from_vec(vals, base.as_slice(), &dev()).unwrap().to_dtype(dt).unwrap();
            let wide = small.broadcast_as((n, h, l, s)).unwrap();
            let dense = wide.contiguous().unwrap();
            let opts = |m: &Tensor| SdpaOptions::default().attn_mask(Mask::Float(m.clone()));
            for recorded in [false, true] {
                let go = |m: &Tensor| {
                    let f = || scaled_dot_product_attention(&q, &k, &v, &opts(m)).unwrap();
                    let y = if recorded { f() } else { no_grad(f) };
                    y.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>()
                };
                let (a, b) = (go(&wide).unwrap(), go(&dense).unwrap());
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{dt:?} {base:?} recorded {recorded}");
            }
            let (pw, pd) =
                (explain_sdpa(&q, &k, &v, &opts(&wide)), explain_sdpa(&q, &k, &v, &opts(&dense)));
            assert_eq!(format!("{:?}", pw.unwrap()), format!("{:?}", pd.unwrap()), "{dt:?}");
        }
        // A query broadcast along its feature dimension is copied to full size: 4 TiB here, which
        // the call refused by aborting the process before. Now the plan and the call give the
        // same error, and a sane size runs.
        let one = Tensor::ones((1, 1, 1, 1), dt, &dev()).unwrap();
        let (big, kk) = (
            one.broadcast_as((1, 1, 1 << 20, 1 << 20)).unwrap(),
            one.broadcast_as((1, 1, 2, 1 << 20)).unwrap(),
        );
        let (o, vv) = (SdpaOptions::default(), one.broadcast_as((1, 1, 2, 1)).unwrap());
        let call = no_grad(|| scaled_dot_product_attention(&big, &kk, &vv, &o)).unwrap_err();
        let plan = no_grad(|| explain_sdpa(&big, &kk, &vv, &o)).unwrap_err();
        assert!(matches!(call, multihead::Error::Alloc { .. }), "{dt:?}: {call}");
        assert_eq!(plan.to_string(), call.to_string(), "{dt:?}");
        // (bf16 names the input its widening copies; f32 the fused path's copy of the query.)
        let named = if dt == DType::F32 { "query" } else { "input" };
        assert!(call.to_string().contains(named) && call.to_string().contains("TiB"), "{call}");
        let (q, k) =
            (one.broadcast_as((1, 1, 3, 16)).unwrap(), one.broadcast_as((1, 1, 2, 16)).unwrap());
        let y = no_grad(|| scaled_dot_product_attention(&q, &k, &vv, &o)).unwrap();
        let y = y.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(y, vec![1.0; 3], "{dt:?}");
    }
}

#[test]
fn a_dense_float_mask_read_in_place_gives_the_bits_of_its_copy() {
    // Without a backward (inside no_grad), a contiguous f32 mask (the caller's, at an offset
    // into a larger tensor, or the call's own conversion of a bf16 mask) is read where it
    // lies; a transposed view of the same values is copied, and so is every mask a backward
    // may read. The same bits either way: outputs, head weights through MultiheadAttention,
    // and the gradients of q, k, v and of a learned mask, on the fused path.
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let (n, h, l, s, e) = (3, 2, 5, 7, 8);
    let bits = |t: &Tensor| {
        let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    let mut vals = det(&[n, h, l, s], DType::F32, 4.0).flatten_all().unwrap().to_vec1::<f32>();
    if let Ok(v) = vals.as_mut() {
        v[3] = f32::NEG_INFINITY;
        v[40] = f32::NAN;
    }
    let dense = Tensor::from_vec(vals.unwrap(), (n, h, l, s), &dev()).unwrap();
    // The same values three ways: dense, at an offset into a larger tensor, transposed.
    let pad = det(&[1, h, l, s], DType::F32, 9.0);
    let offset = Tensor::cat(&[&pad, &dense], 0).unwrap().narrow(0, 1, n).unwrap();
    let strided = dense.transpose(2, 3).unwrap().contiguous().unwrap().transpose(2, 3).unwrap();
    assert!(offset.is_contiguous() && offset.layout().start_offset() > 0);
    assert!(!strided.is_contiguous());
    for dt in [DType::F32, DType::BF16] {
        let (q, k, v) =
            (det(&[n, h, l, e], dt, 1.0), det(&[n, h, s, e], dt, 2.0), det(&[n, h, s, e], dt, 3.0));
        let run = |mask: &Tensor, learned: bool| {
            let (qv, kv, vv) = (var(&q), var(&k), var(&v));
            let mv = var(&mask.to_dtype(dt).unwrap());
            // (A learned mask is a Var: dense; the others keep their layout.)
            let m = if learned { mv.as_tensor().clone() } else { mask.to_dtype(dt).unwrap() };
            let opts = SdpaOptions::default().attn_mask(Mask::Float(m));
            let plan = explain_sdpa(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &opts);
            assert_eq!(plan.unwrap().path, Path::Fused, "{dt:?}");
            let y =
                scaled_dot_product_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &opts)
                    .unwrap();
            let w = det(y.dims(), dt, 5.0);
            let g = y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            let mut out = vec![bits(&y)];
            for t in [qv.as_tensor(), kv.as_tensor(), vv.as_tensor()] {
                out.push(bits(g.get(t).expect("gradient")));
            }
            if learned {
                out.push(bits(g.get(mv.as_tensor()).expect("mask gradient")));
            }
            out
        };
        for learned in [false, true] {
            let want = run(&strided, learned);
            assert_eq!(run(&dense, learned), want, "{dt:?} dense, learned {learned}");
            assert_eq!(run(&offset, learned), want, "{dt:?} offset, learned {learned}");
            // Without a backward, read in place: the copied mask's bits (in f32 the recorded
            // forward's too; bf16 products take another route without a backward).
            let inference = |mask: &Tensor| {
                let mask = Mask::Float(mask.to_dtype(dt).unwrap());
                let opts = SdpaOptions::default().attn_mask(mask);
                bits(&no_grad(|| scaled_dot_product_attention(&q, &k, &v, &opts)).unwrap())
            };
            let copied = inference(&strided);
            if dt == DType::F32 {
                assert_eq!(copied, want[0], "{dt:?} without a backward");
            }
            for (what, mask) in [("dense", &dense), ("offset", &offset)] {
                assert_eq!(inference(mask), copied, "{dt:?} {what} without a backward");
            }
        }
    }
    // MultiheadAttention with an (N·H, L, S) mask and a float key padding mask, each dense, at
    // an offset, or transposed: the same output and head weights, with and without gradients.
    let (m, _vm) = mha(MhaConfig::new(e, h), DType::F32);
    let x = det(&[l, n, e], DType::F32, 1.0);
    let kv = det(&[s, n, e], DType::F32, 2.0);
    let am = dense.reshape((n * h, l, s)).unwrap();
    let kpm = det(&[n, s], DType::F32, 6.0);
    let am_off = offset.reshape((n * h, l, s)).unwrap();
    let kpm_off = Tensor::cat(
        &[&pad.flatten_all().unwrap().narrow(0, 0, s).unwrap().reshape((1, s)).unwrap(), &kpm],
        0,
    )
    .unwrap()
    .narrow(0, 1, n)
    .unwrap();
    let am_t = am.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
    let kpm_t = kpm.t().unwrap().contiguous().unwrap().t().unwrap();
    assert!(kpm_off.is_contiguous() && kpm_off.layout().start_offset() > 0);
    for recorded in [false, true] {
        let go = |a: &Tensor, p: &Tensor| {
            let opts = MhaOptions::default()
                .attn_mask(Mask::Float(a.clone()))
                .key_padding_mask(Mask::Float(p.clone()))
                .average_attn_weights(false);
            let plan = m.explain(&x, &kv, &kv, &opts).unwrap();
            assert_eq!(plan.path, Path::Fused, "{plan:?}");
            let f = || m.forward(&x, &kv, &kv, &opts).unwrap();
            let out = if recorded { f() } else { no_grad(f) };
            (bits(&out.output), bits(&out.attn_weights.expect("weights")))
        };
        let want = go(&am_t, &kpm_t);
        assert_eq!(go(&am, &kpm), want, "mha dense, recorded {recorded}");
        assert_eq!(go(&am_off, &kpm_off), want, "mha offset, recorded {recorded}");
    }
}

#[test]
fn a_mask_refilled_before_the_backward_does_not_change_the_gradients() {
    // Micro-batches whose losses are summed before one backward, each with the same mask
    // buffer refilled in place (`Var::set`): the fused backward recomputes the scores with the
    // forward's mask, as the composed path keeps the forward's probabilities. (Reading the
    // mask where it lies in the backward too gave gradients off by 40% here, NaN for larger
    // changes.) SDPA with an (N, H, L, S) mask, and MultiheadAttention with a float key padding
    // mask.
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let (n, h, l, s, e) = (2, 2, 3, 4, 8);
    let blocked = |dims: &[usize], col: usize, fill: f32| {
        let len: usize = dims.iter().product();
        let last = dims[dims.len() - 1];
        let v: Vec<f32> = (0..len).map(|i| if i % last == col { fill } else { 0.0 }).collect();
        Tensor::from_vec(v, dims, &dev()).unwrap()
    };
    let sdpa_grads = |backend: Backend, fill: f32| {
        with_backend(backend, || {
            let (q, k, v) = (
                var(&det(&[n, h, l, e], DType::F32, 1.0)),
                var(&det(&[n, h, s, e], DType::F32, 2.0)),
                var(&det(&[n, h, s, e], DType::F32, 3.0)),
            );
            let buf = var(&blocked(&[n, h, l, s], 3, -1e9));
            let opts = SdpaOptions::default().attn_mask(Mask::Float(buf.as_tensor().detach()));
            let run = || {
                scaled_dot_product_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)
                    .unwrap()
            };
            let y1 = run();
            buf.set(&blocked(&[n, h, l, s], 0, fill)).unwrap();
            let y2 = run();
            let w = det(y2.dims(), DType::F32, 5.0);
            let loss = y1.sum_all().unwrap().add(&y2.mul(&w).unwrap().sum_all().unwrap()).unwrap();
            let g = loss.backward().unwrap();
            [&q, &k, &v].map(|t| g.get(t.as_tensor()).expect("gradient").clone())
        })
    };
    for fill in [-1e9, 100.0] {
        let (a, b) = (sdpa_grads(Backend::Fused, fill), sdpa_grads(Backend::Composed, fill));
        for (what, (x, y)) in ["dq", "dk", "dv"].iter().zip(a.iter().zip(&b)) {
            assert_close(x, y, Tolerance::F32_GRAD, &format!("sdpa {what}, refilled with {fill}"));
        }
    }
    let (m, vm) = mha(MhaConfig::new(e, h), DType::F32);
    let (x, mem) = (det(&[l, n, e], DType::F32, 1.0), det(&[s, n, e], DType::F32, 2.0));
    let mha_grads = |backend: Backend| {
        with_backend(backend, || {
            let buf = var(&blocked(&[n, s], 1, f32::NEG_INFINITY));
            let opts =
                MhaOptions::default().key_padding_mask(Mask::Float(buf.as_tensor().detach()));
            let y1 = m.forward(&x, &mem, &mem, &opts).unwrap().output;
            buf.set(&blocked(&[n, s], 2, f32::NEG_INFINITY)).unwrap();
            let y2 = m.forward(&x, &mem, &mem, &opts).unwrap().output;
            let w = det(y2.dims(), DType::F32, 5.0);
            let loss = y1.sum_all().unwrap().add(&y2.mul(&w).unwrap().sum_all().unwrap()).unwrap();
            let g = loss.backward().unwrap();
            let data = vm.data().lock().unwrap();
            let mut names: Vec<_> = data.keys().cloned().collect();
            names.sort();
            names
                .into_iter()
                .map(|k| (k.clone(), g.get(data[&k].as_tensor()).unwrap().clone()))
                .collect::<Vec<_>>()
        })
    };
    for ((name, a), (_, b)) in mha_grads(Backend::Fused).iter().zip(&mha_grads(Backend::Composed)) {
        assert_close(a, b, Tolerance::F32_GRAD, &format!("mha {name}"));
    }
}

#[test]
fn mha_reads_a_broadcast_float_mask_as_the_dense_mask() {
    // An attention mask expanded (stride 0) to (N·H, L, S) from (L, S), from a per-query
    // column (L, 1), or from one value, is copied for the kernels without its repeated
    // dimensions: the bits of the same mask made dense, with and without gradients.
    let (l, s, n, e, h) = (5, 6, 3, 8, 2);
    let (m, _vm) = mha(MhaConfig::new(e, h), DType::F32);
    let q = det(&[l, n, e], DType::F32, 1.0);
    let kv = det(&[s, n, e], DType::F32, 2.0);
    for base in [vec![l, s], vec![l, 1], vec![1, 1]] {
        let small = det(&base, DType::F32, 3.0);
        let wide = small.broadcast_as((n * h, l, s)).unwrap();
        let dense = wide.contiguous().unwrap();
        for recorded in [false, true] {
            let go = |mask: &Tensor| {
                let opts = MhaOptions::default().attn_mask(Mask::Float(mask.clone()));
                let f = || m.forward(&q, &kv, &kv, &opts).unwrap().output;
                let y = if recorded { f() } else { no_grad(f) };
                let v = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(go(&wide), go(&dense), "{base:?} recorded {recorded}");
        }
    }
}

#[test]
fn a_broadcast_bool_mask_gives_the_dense_masks_bits() {
    // A bool mask expanded (stride 0) is converted to an additive mask at the size of the data
    // behind it and broadcast back: the bits of the same mask made dense, for SDPA (f32 fused,
    // f64 composed) and MultiheadAttention, with and without gradients.
    use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
    let (n, h, l, s, e) = (3, 2, 5, 7, 8);
    let bits = |t: Tensor| {
        let v = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    // Row i hides key j where (i + 2j) % 3 == 0 (as an (L, 1) base: rows 0 and 3 hidden whole,
    // a pattern broadcast along the keys).
    let pattern = |rows: usize, cols: usize| {
        let v: Vec<u8> = (0..rows * cols)
            .map(|i| u8::from((i / cols + 2 * (i % cols)).is_multiple_of(3)))
            .collect();
        Tensor::from_vec(v, (rows, cols), &dev()).unwrap()
    };
    for base in [pattern(l, s), pattern(l, 1)] {
        let wide = base.broadcast_as((n, h, l, s)).unwrap();
        let dense = wide.contiguous().unwrap();
        for dt in [DType::F32, DType::F64] {
            let (q, k) = (det(&[n, h, l, e], dt, 1.0), det(&[n, h, s, e], dt, 2.0));
            for recorded in [false, true] {
                let go = |m: &Tensor| {
                    let o = SdpaOptions::default().attn_mask(Mask::Bool(m.clone()));
                    let f = || scaled_dot_product_attention(&q, &k, &k, &o).unwrap();
                    bits(if recorded { f() } else { no_grad(f) })
                };
                assert_eq!(go(&wide), go(&dense), "sdpa {dt:?} recorded {recorded}");
            }
        }
        let (m, _vm) = mha(MhaConfig::new(e, h), DType::F32);
        let (q, kv) = (det(&[l, n, e], DType::F32, 1.0), det(&[s, n, e], DType::F32, 2.0));
        let wide = base.broadcast_as((n * h, l, s)).unwrap();
        let dense = wide.contiguous().unwrap();
        let go = |mask: &Tensor| {
            let o = MhaOptions::default().attn_mask(Mask::Bool(mask.clone()));
            bits(no_grad(|| m.forward(&q, &kv, &kv, &o).unwrap().output))
        };
        assert_eq!(go(&wide), go(&dense), "mha");
    }
}
