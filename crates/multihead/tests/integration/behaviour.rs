//! Behaviour tests: identities that must hold whatever the numbers are.

use candle_core::{DType, Tensor};
use multihead::functional::{
    multi_head_attention_forward, scaled_dot_product_attention, InProj, MhaParams, SdpaOptions,
};
use multihead::{Mask, MhaConfig, MhaOptions, NamedParameters};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, dev, mha, var};

const F64: DType = DType::F64;

fn param(m: &impl NamedParameters, key: &str) -> Tensor {
    m.named_parameters().into_iter().find(|(k, _)| k == key).map(|(_, t)| t).expect("param")
}

#[test]
fn packed_in_proj_equals_separate_q_k_v() {
    let (m, _vm) = mha(MhaConfig::new(8, 2), F64);
    let w = param(&m, "in_proj_weight");
    let b = param(&m, "in_proj_bias");
    let (wq, wk, wv) =
        (w.narrow(0, 0, 8).unwrap(), w.narrow(0, 8, 8).unwrap(), w.narrow(0, 16, 8).unwrap());
    let ow = param(&m, "out_proj.weight");
    let ob = param(&m, "out_proj.bias");
    let sep = MhaParams {
        embed_dim_to_check: 8,
        num_heads: 2,
        num_kv_heads: None,
        in_proj: InProj::Separate { q: &wq, k: &wk, v: &wv },
        in_proj_bias: Some(&b),
        bias_k: None,
        bias_v: None,
        add_zero_attn: false,
        dropout_p: 0.0,
        out_proj_weight: &ow,
        out_proj_bias: Some(&ob),
    };
    let x = det(&[4, 3, 8], F64, 1.0);
    for (k, v) in [(x.clone(), x.clone()), (det(&[5, 3, 8], F64, 2.0), det(&[5, 3, 8], F64, 3.0))] {
        let packed = m.forward(&x, &k, &v, &MhaOptions::default()).unwrap();
        let separate =
            multi_head_attention_forward(&x, &k, &v, &sep, &MhaOptions::default(), true).unwrap();
        assert_close(&separate.output, &packed.output, Tolerance::F64, "output");
        assert_close(
            separate.attn_weights.as_ref().unwrap(),
            packed.attn_weights.as_ref().unwrap(),
            Tolerance::F64,
            "weights",
        );
    }
}

#[test]
fn padding_with_a_key_mask_equals_no_padding() {
    let (m, _vm) = mha(MhaConfig::new(8, 2).with_batch_first(true), F64);
    let q = det(&[1, 3, 8], F64, 1.0);
    let kv = det(&[1, 4, 8], F64, 2.0);
    let garbage = det(&[1, 3, 8], F64, 9.0).affine(100.0, 5.0).unwrap();
    let padded = Tensor::cat(&[&kv, &garbage], 1).unwrap();
    let kpm = Mask::Bool(Tensor::new(&[[0u8, 0, 0, 0, 1, 1, 1]], &dev()).unwrap());
    for need_weights in [true, false] {
        let plain =
            m.forward(&q, &kv, &kv, &MhaOptions::default().need_weights(need_weights)).unwrap();
        let opts = MhaOptions::default().need_weights(need_weights).key_padding_mask(kpm.clone());
        let masked = m.forward(&q, &padded, &padded, &opts).unwrap();
        assert_close(&masked.output, &plain.output, Tolerance::F64, "output");
        if need_weights {
            let w = masked.attn_weights.unwrap();
            assert_close(
                &w.narrow(2, 0, 4).unwrap(),
                plain.attn_weights.as_ref().unwrap(),
                Tolerance::F64,
                "w",
            );
            let pad_w = w
                .narrow(2, 4, 3)
                .unwrap()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert_eq!(pad_w, 0.0);
        }
    }
}

#[test]
fn is_causal_equals_an_explicit_causal_mask() {
    let (m, _vm) = mha(MhaConfig::new(8, 2), F64);
    let x = det(&[5, 2, 8], F64, 1.0);
    let causal = multihead::generate_square_subsequent_mask(5, F64, &dev()).unwrap();
    let explicit = m
        .forward(
            &x,
            &x,
            &x,
            &MhaOptions::default().need_weights(false).attn_mask(Mask::Float(causal.clone())),
        )
        .unwrap();
    // The hint discards the given mask (PyTorch's rule), even a non-causal one.
    let zeros = Tensor::zeros((5, 5), F64, &dev()).unwrap();
    let hinted = m
        .forward(
            &x,
            &x,
            &x,
            &MhaOptions::default()
                .need_weights(false)
                .attn_mask(Mask::Float(zeros))
                .is_causal(true),
        )
        .unwrap();
    assert_close(&hinted.output, &explicit.output, Tolerance::F64, "mha");
    // SDPA: is_causal equals the upper-left mask, also for L != S.
    let q = det(&[2, 3, 4, 6], F64, 1.0);
    let k = det(&[2, 3, 7, 6], F64, 2.0);
    let v = det(&[2, 3, 7, 5], F64, 3.0);
    let a =
        scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::default().is_causal(true)).unwrap();
    let keep: Vec<u8> = (0..4).flat_map(|i| (0..7).map(move |j| (j <= i) as u8)).collect();
    let keep = Tensor::from_vec(keep, (4, 7), &dev()).unwrap();
    let b = scaled_dot_product_attention(
        &q,
        &k,
        &v,
        &SdpaOptions::default().attn_mask(Mask::Bool(keep)),
    )
    .unwrap();
    assert_close(&a, &b, Tolerance::F64, "sdpa");
}

#[test]
fn unbatched_equals_a_batch_of_one_and_batch_first_equals_transpose() {
    let (m, _vm) = mha(MhaConfig::new(6, 3).with_add_bias_kv(true).with_add_zero_attn(true), F64);
    let q = det(&[4, 6], F64, 1.0);
    let k = det(&[5, 6], F64, 2.0);
    let mask = Mask::Bool(
        Tensor::new(&[[0u8, 1, 0, 0, 0], [0, 0, 0, 1, 0], [1, 0, 0, 0, 0], [0; 5]], &dev())
            .unwrap(),
    );
    let opts = MhaOptions::default().attn_mask(mask).average_attn_weights(false);
    let un = m.forward(&q, &k, &k, &opts).unwrap();
    let b1 = m
        .forward(
            &q.unsqueeze(1).unwrap(),
            &k.unsqueeze(1).unwrap(),
            &k.unsqueeze(1).unwrap(),
            &opts,
        )
        .unwrap();
    assert_close(&un.output, &b1.output.squeeze(1).unwrap(), Tolerance::F64, "output");
    assert_close(
        un.attn_weights.as_ref().unwrap(),
        &b1.attn_weights.unwrap().squeeze(0).unwrap(),
        Tolerance::F64,
        "weights",
    );
    assert_eq!(un.attn_weights.unwrap().dims(), &[3, 4, 7]);

    let (seq, vm) = mha(MhaConfig::new(8, 2), F64);
    let state: std::collections::HashMap<_, _> = seq.named_parameters().into_iter().collect();
    let (bf, _) = multihead::state_dict::load_strict(&state, F64, &dev(), |vb| {
        multihead::MultiheadAttention::new(MhaConfig::new(8, 2).with_batch_first(true), vb)
    })
    .unwrap();
    drop(vm);
    let x = det(&[5, 3, 8], F64, 4.0);
    let a = seq.forward(&x, &x, &x, &MhaOptions::default()).unwrap();
    let xt = x.transpose(0, 1).unwrap().contiguous().unwrap();
    let b = bf.forward(&xt, &xt, &xt, &MhaOptions::default()).unwrap();
    assert_close(&b.output.transpose(0, 1).unwrap(), &a.output, Tolerance::F64, "batch_first");
    assert_close(
        b.attn_weights.as_ref().unwrap(),
        a.attn_weights.as_ref().unwrap(),
        Tolerance::F64,
        "w",
    );
}

#[test]
fn fully_masked_rows_give_zero_attention_on_every_path() {
    let (m, _vm) = mha(MhaConfig::new(8, 2), F64);
    let q = det(&[3, 2, 8], F64, 1.0);
    let k = det(&[4, 2, 8], F64, 2.0);
    let kpm = Mask::Bool(Tensor::new(&[[0u8, 0, 1, 0], [1, 1, 1, 1]], &dev()).unwrap());
    let bias = param(&m, "out_proj.bias");
    for need_weights in [true, false] {
        let qv = var(&q);
        let opts = MhaOptions::default().key_padding_mask(kpm.clone()).need_weights(need_weights);
        let out = m.forward(qv.as_tensor(), &k, &k, &opts).unwrap();
        // Batch element 1 has every key padded: its rows equal out_proj.bias.
        let row = out.output.narrow(1, 1, 1).unwrap().reshape((3, 8)).unwrap();
        assert_close(
            &row,
            &bias.unsqueeze(0).unwrap().broadcast_as((3, 8)).unwrap(),
            Tolerance::F64,
            "row",
        );
        if let Some(w) = out.attn_weights {
            assert_eq!(
                w.narrow(0, 1, 1)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap(),
                0.0
            );
        }
        // Gradients are finite.
        let grads = out.output.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads.get(qv.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert!(g.iter().all(|x| x.is_finite()));
    }
}

/// Loss used for finite differences: a fixed weighted sum of output and weights.
fn loss(
    m: &multihead::MultiheadAttention,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &MhaOptions,
) -> Tensor {
    let out = m.forward(q, k, v, opts).unwrap();
    let g = det(out.output.dims(), F64, 7.0);
    let mut l = out.output.mul(&g).unwrap().sum_all().unwrap();
    if let Some(w) = out.attn_weights {
        let gw = det(w.dims(), F64, 8.0);
        l = l.add(&w.mul(&gw).unwrap().sum_all().unwrap()).unwrap();
    }
    l
}

#[test]
fn gradients_of_every_parameter_match_finite_differences() {
    let configs = [
        MhaConfig::new(6, 2),
        MhaConfig::new(6, 3).with_kdim(4).with_vdim(5).with_add_bias_kv(true),
        MhaConfig::new(4, 2).with_add_zero_attn(true).with_bias(false),
    ];
    for cfg in configs {
        let (m, vm) = mha(cfg.clone(), F64);
        let q = var(&det(&[3, 2, 6.min(cfg.embed_dim)], F64, 1.0));
        let k = var(&det(&[4, 2, cfg.kdim()], F64, 2.0));
        let v = var(&det(&[4, 2, cfg.vdim()], F64, 3.0));
        let mask = Mask::Float(det(&[3, 4], F64, 4.0));
        let opts = MhaOptions::default().attn_mask(mask);
        let l = loss(&m, q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts);
        let grads = l.backward().unwrap();
        let params = m.named_parameters();
        assert_eq!(params.len(), vm.all_vars().len());
        for (name, t) in params.iter().map(|(n, t)| (n.clone(), t.clone())).chain([
            ("query".to_string(), q.as_tensor().clone()),
            ("key".to_string(), k.as_tensor().clone()),
            ("value".to_string(), v.as_tensor().clone()),
        ]) {
            let g = grads.get(&t).unwrap_or_else(|| panic!("{cfg:?}: no gradient for {name}"));
            let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            // Central differences on a few entries of each tensor.
            let data = vm.data().lock().unwrap();
            let target: Option<candle_core::Var> =
                data.values().find(|v| v.as_tensor().id() == t.id()).cloned();
            drop(data);
            let target = target.unwrap_or_else(|| {
                [&q, &k, &v].into_iter().find(|v| v.as_tensor().id() == t.id()).unwrap().clone()
            });
            let base = target.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            for idx in [0, base.len() / 2, base.len() - 1] {
                let h = 1e-6;
                let mut plus = base.clone();
                plus[idx] += h;
                target.set(&Tensor::from_vec(plus, t.dims(), &dev()).unwrap()).unwrap();
                let lp = loss(&m, q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)
                    .to_scalar::<f64>()
                    .unwrap();
                let mut minus = base.clone();
                minus[idx] -= h;
                target.set(&Tensor::from_vec(minus, t.dims(), &dev()).unwrap()).unwrap();
                let lm = loss(&m, q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)
                    .to_scalar::<f64>()
                    .unwrap();
                target.set(&Tensor::from_vec(base.clone(), t.dims(), &dev()).unwrap()).unwrap();
                let fd = (lp - lm) / (2.0 * h);
                // Central differences are accurate to O(h^2) plus rounding of about 1e-10 / h.
                let tol = Tolerance { rel: 1e-6, abs: 1e-7 };
                assert!(
                    tol.close(g[idx], fd),
                    "{cfg:?} {name}[{idx}]: autograd {} vs finite difference {fd}",
                    g[idx]
                );
            }
        }
    }
}

#[test]
fn sdpa_gqa_equals_repeated_heads_and_bool_polarity_is_keep() {
    let q = det(&[2, 4, 3, 5], F64, 1.0);
    let k = det(&[2, 2, 6, 5], F64, 2.0);
    let v = det(&[2, 2, 6, 7], F64, 3.0);
    let gqa =
        scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::default().enable_gqa(true)).unwrap();
    // repeat_interleave by hand: heads [0, 0, 1, 1].
    let idx = Tensor::new(&[0u32, 0, 1, 1], &dev()).unwrap();
    let kr = k.index_select(&idx, 1).unwrap();
    let vr = v.index_select(&idx, 1).unwrap();
    let manual = scaled_dot_product_attention(&q, &kr, &vr, &SdpaOptions::default()).unwrap();
    assert_close(&gqa, &manual, Tolerance::F64, "gqa");
    assert_eq!(gqa.dims(), &[2, 4, 3, 7]);

    let keep = Tensor::new(&[[1u8, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], &dev())
        .unwrap();
    let neg: Vec<f64> = keep
        .flatten_all()
        .unwrap()
        .to_vec1::<u8>()
        .unwrap()
        .iter()
        .map(|&b| if b == 1 { 0.0 } else { f64::NEG_INFINITY })
        .collect();
    let float = Tensor::from_vec(neg, (3, 6), &dev()).unwrap();
    let a = scaled_dot_product_attention(
        &q,
        &kr,
        &vr,
        &SdpaOptions::default().attn_mask(Mask::Bool(keep)),
    )
    .unwrap();
    let b = scaled_dot_product_attention(
        &q,
        &kr,
        &vr,
        &SdpaOptions::default().attn_mask(Mask::Float(float)),
    )
    .unwrap();
    assert_close(&a, &b, Tolerance::F64, "bool keep == float 0/-inf");
    // Row 1 is fully masked: zeros, not NaN.
    let row =
        a.narrow(2, 1, 1).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    assert_eq!(row, 0.0);
}

#[test]
fn sdpa_matches_a_naive_reference_with_negative_scale_and_broadcast_batch() {
    // PyTorch's test_scaled_dot_product_attention_math_with_negative_scale, by hand.
    let q = det(&[3, 4, 6], F64, 1.0); // broadcast over a leading batch of 2 below
    let k = det(&[2, 3, 5, 6], F64, 2.0);
    let v = det(&[2, 3, 5, 4], F64, 3.0);
    let scale = -1e4 / 1e4 * 0.37;
    let out =
        scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::default().scale(scale)).unwrap();
    assert_eq!(out.dims(), &[2, 3, 4, 4]);
    let qv = q.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let kv = k.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let vv = v.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let ov = out.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    for b in 0..2 {
        for h in 0..3 {
            for i in 0..4 {
                let s: Vec<f64> = (0..5)
                    .map(|j| {
                        (0..6)
                            .map(|d| qv[(h * 4 + i) * 6 + d] * kv[((b * 3 + h) * 5 + j) * 6 + d])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for d in 0..4 {
                    let expect: f64 = (0..5)
                        .map(|j| (s[j] - m).exp() / z * vv[((b * 3 + h) * 5 + j) * 4 + d])
                        .sum();
                    let got = ov[((b * 3 + h) * 4 + i) * 4 + d];
                    assert!(
                        Tolerance::F64.close(got, expect),
                        "{b} {h} {i} {d}: {got} vs {expect}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_module_composes_with_candle_layers() {
    let (m, vm) = mha(MhaConfig::new(8, 2).with_batch_first(true), DType::F32);
    let lin = multihead::Linear::new(
        8,
        3,
        true,
        candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev()).pp("head"),
    )
    .unwrap();
    let x = det(&[2, 5, 8], DType::F32, 1.0);
    let y = lin.forward(&candle_core::Module::forward(&m, &x).unwrap().relu().unwrap()).unwrap();
    assert_eq!(y.dims(), &[2, 5, 3]);
    let grads = y.sum_all().unwrap().backward().unwrap();
    for v in vm.all_vars() {
        assert!(grads.get(v.as_tensor()).is_some(), "a variable got no gradient");
    }
    assert_eq!(vm.all_vars().len(), 6);
}

#[test]
fn train_and_eval_recurse_through_a_model() {
    // model.eval() / model.train() on a hand-written container of layers with dropout 0.5:
    // in eval mode two calls agree, in training mode they do not.
    use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    use multihead::Train;
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg =
        LayerConfig::new(8, 2).with_dim_feedforward(16).with_dropout(0.5).with_batch_first(true);
    let mut model: Vec<Box<TransformerEncoderLayer>> = (0..2)
        .map(|i| Box::new(TransformerEncoderLayer::new(cfg.clone(), vb.pp(i.to_string())).unwrap()))
        .collect();
    let x = det(&[2, 5, 8], DType::F32, 1.0);
    let run = |m: &Vec<Box<TransformerEncoderLayer>>| {
        let mut h = x.clone();
        for layer in m {
            h = layer.forward(&h, None, None, false).unwrap();
        }
        h.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    Train::eval(&mut model);
    assert_eq!(run(&model), run(&model), "eval: no dropout");
    Train::train(&mut model, true);
    assert_ne!(run(&model), run(&model), "train: dropout");
}

#[test]
fn functional_add_is_candles_add_with_its_gradient_and_checks_its_arguments() {
    // Large enough for the parallel path, and small; f32 on the op, f64 on candle's add.
    for (n, dtype) in [(300_000usize, DType::F32), (1000, DType::F32), (1000, DType::F64)] {
        let a = var(&det(&[n], dtype, 1.0).affine(1e3, 0.0).unwrap());
        let b = var(&det(&[n], dtype, 2.0));
        let sum = multihead::functional::add(a.as_tensor(), b.as_tensor()).unwrap();
        let want = (a.as_tensor() + b.as_tensor()).unwrap();
        let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(bits(&sum), bits(&want), "{n} {dtype:?}");
        let up = det(&[n], dtype, 3.0);
        let g = sum.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(bits(g.get(a.as_tensor()).unwrap()), bits(&up));
        assert_eq!(bits(g.get(b.as_tensor()).unwrap()), bits(&up));
    }
    let a = det(&[2, 3], DType::F32, 1.0);
    let e = multihead::functional::add(&a, &det(&[3, 2], DType::F32, 1.0)).unwrap_err();
    assert!(e.to_string().contains("add: b: a has shape (2, 3) and b (3, 2)"), "{e}");
    let e = multihead::functional::add(&a, &det(&[2, 3], DType::F64, 1.0)).unwrap_err();
    assert!(e.to_string().contains("a is F32 and b F64"), "{e}");
    // Broadcast views of one value standing for more elements than memory holds: an error.
    let one = Tensor::new(&[1f32], &dev()).unwrap();
    let huge = one.broadcast_as((1usize << 40, 1usize << 20)).unwrap();
    let e = multihead::functional::add(&huge, &huge).unwrap_err();
    assert!(e.to_string().contains("add"), "{e}");
    // A strided view takes candle's add: the same numbers as on contiguous copies.
    let t = det(&[3, 2], DType::F32, 5.0).t().unwrap();
    let sum = multihead::functional::add(&t, &a).unwrap();
    let want = (t.contiguous().unwrap() + &a).unwrap();
    assert_eq!(sum.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
}
