//! Regression tests for the hardening issue: each finding of bad input that used to panic,
//! abort, hang or give silently wrong numbers, on the fused and the composed path alike.

use candle_core::{DType, IndexOp, Tensor};
use multihead::functional::{
    multi_head_attention_forward, scaled_dot_product_attention, InProj, MhaParams, SdpaOptions,
};
use multihead::{
    grad_enabled, no_grad, with_backend, Backend, Error, Linear, Mask, MhaConfig, MhaOptions,
};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, dev, mha};

const BACKENDS: [Backend; 3] = [Backend::Auto, Backend::Composed, Backend::Fused];

fn t(shape: &[usize]) -> Tensor {
    det(shape, DType::F32, 0.3)
}

/// `y` of a Linear on each backend; all must agree (or all fail with the same message).
fn linear_all(w: &Tensor, b: Option<&Tensor>, x: &Tensor) -> multihead::Result<Tensor> {
    let lin = Linear::from_weights(w.clone(), b.cloned());
    let runs: Vec<multihead::Result<Tensor>> = [Backend::Composed, Backend::Fused]
        .into_iter()
        .map(|be| with_backend(be, || lin.forward(x)))
        .collect();
    match (&runs[0], &runs[1]) {
        (Ok(a), Ok(b)) => assert_close(b, a, Tolerance::F32_FORWARD, "fused vs composed linear"),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        (a, b) => panic!("the paths disagree: composed {a:?}, fused {b:?}"),
    }
    runs.into_iter().next().expect("two runs")
}

// Finding 1: the fused linear never checked its bias.
#[test]
fn linear_bias_shapes_are_checked_and_views_are_read_through_their_strides() {
    let w = t(&[6, 5]);
    let x = det(&[4, 5], DType::F32, 1.0);
    // Shorter, longer and 2-D biases: a typed error naming the bias, on both paths.
    for bad in [t(&[5]), t(&[7]), t(&[1, 6]), t(&[6, 1])] {
        let e = linear_all(&w, Some(&bad), &x).expect_err("bad bias");
        assert!(matches!(e, Error::Shape { arg: "bias", .. }), "{e:?}");
        assert!(e.to_string().contains("(6,)"), "{e}");
    }
    // A broadcast (stride-0) bias and a strided one (a column of a matrix) give the numbers of
    // the same bias made contiguous.
    let reference = linear_all(&w, Some(&Tensor::full(0.25f32, 6, &dev()).unwrap()), &x).unwrap();
    let broadcast = Tensor::new(&[0.25f32], &dev()).unwrap().broadcast_as(6).unwrap();
    assert_close(
        &linear_all(&w, Some(&broadcast), &x).unwrap(),
        &reference,
        Tolerance::F32_FORWARD,
        "stride 0",
    );
    let m = det(&[6, 3], DType::F32, 2.0);
    let column = m.i((.., 1)).unwrap();
    assert!(!column.is_contiguous());
    let want = linear_all(&w, Some(&column.contiguous().unwrap()), &x).unwrap();
    assert_close(
        &linear_all(&w, Some(&column), &x).unwrap(),
        &want,
        Tolerance::F32_FORWARD,
        "strided",
    );
    // A bias of another dtype, and a 1-D or 3-D weight.
    let e = linear_all(&w, Some(&det(&[6], DType::F64, 0.0)), &x).expect_err("dtype");
    assert!(matches!(e, Error::DType { arg: "bias", .. }), "{e:?}");
    let e = linear_all(&t(&[6]), None, &x).expect_err("1-D weight");
    assert!(matches!(e, Error::Shape { arg: "weight", .. }), "{e:?}");
}

/// `multi_head_attention_forward` with the given parameters on every backend: the same error
/// text everywhere.
fn mha_fn_err(params: &MhaParams, x: &Tensor) -> String {
    let errs: Vec<String> = BACKENDS
        .iter()
        .map(|&b| {
            let opts = MhaOptions::default().need_weights(false).backend(b);
            multi_head_attention_forward(x, x, x, params, &opts, false)
                .expect_err("rejected")
                .to_string()
        })
        .collect();
    assert!(errs.iter().all(|e| e == &errs[0]), "paths disagree: {errs:?}");
    errs[0].clone()
}

#[test]
fn functional_mha_checks_every_parameter_shape() {
    let e = 8;
    let (w_in, b_in, w_out, b_out) = (t(&[3 * e, e]), t(&[3 * e]), t(&[e, e]), t(&[e]));
    let base = MhaParams {
        embed_dim_to_check: e,
        num_heads: 2,
        num_kv_heads: None,
        in_proj: InProj::Packed(&w_in),
        in_proj_bias: Some(&b_in),
        bias_k: None,
        bias_v: None,
        add_zero_attn: false,
        dropout_p: 0.0,
        out_proj_weight: &w_out,
        out_proj_bias: Some(&b_out),
    };
    let x = det(&[3, 2, e], DType::F32, 1.0);
    let short = t(&[3 * e - 1]);
    let long = t(&[3 * e + 5]);
    let tall = t(&[e + 4, e]);
    let b2 = t(&[1, e]);
    let cases: Vec<(&str, MhaParams)> = vec![
        ("in_proj_bias", MhaParams { in_proj_bias: Some(&short), ..base }),
        ("in_proj_bias", MhaParams { in_proj_bias: Some(&long), ..base }),
        ("out_proj_weight", MhaParams { out_proj_weight: &tall, ..base }),
        ("out_proj_bias", MhaParams { out_proj_bias: Some(&b2), ..base }),
    ];
    for (arg, params) in cases {
        let msg = mha_fn_err(&params, &x);
        assert!(msg.contains(arg) && msg.contains("expected shape"), "{arg}: {msg}");
    }
}

// Finding 2: bias_v without bias_k.
#[test]
fn bias_v_without_bias_k_is_rejected_on_every_path_and_dtype() {
    for dtype in [DType::F32, DType::F64] {
        let e = 8;
        let (w_in, w_out, bv) =
            (det(&[3 * e, e], dtype, 0.1), det(&[e, e], dtype, 0.2), det(&[1, 1, e], dtype, 0.3));
        let params = MhaParams {
            embed_dim_to_check: e,
            num_heads: 2,
            num_kv_heads: None,
            in_proj: InProj::Packed(&w_in),
            in_proj_bias: None,
            bias_k: None,
            bias_v: Some(&bv),
            add_zero_attn: false,
            dropout_p: 0.0,
            out_proj_weight: &w_out,
            out_proj_bias: None,
        };
        let msg = mha_fn_err(&params, &det(&[3, 2, e], dtype, 1.0));
        assert!(msg.contains("bias_k and bias_v must both be given"), "{msg}");
        assert!(msg.contains("bias_v without bias_k"), "{msg}");
    }
}

// Finding 3: the modes leaked when the closure panicked.
#[test]
fn no_grad_and_with_backend_are_restored_after_a_caught_panic() {
    let r = std::panic::catch_unwind(|| no_grad(|| panic!("inside no_grad")));
    assert!(r.is_err());
    assert!(grad_enabled(), "grad mode leaked out of a panicking no_grad");
    let r = std::panic::catch_unwind(|| with_backend(Backend::Composed, || panic!("inside")));
    assert!(r.is_err());
    assert_eq!(multihead::default_backend(), Backend::Auto);
}

// Finding 4: weights larger than memory aborted the process.
#[test]
fn attention_weights_larger_than_memory_are_a_typed_error() {
    // Fused weights under no_grad: (1024, 4096, 4096) f32 = 64 GiB.
    let (m, _vm) = mha(MhaConfig::new(8, 2).with_batch_first(true), DType::F32);
    let x = Tensor::zeros((1024, 4096, 8), DType::F32, &dev()).unwrap();
    let e = no_grad(|| m.forward(&x, &x, &x, &MhaOptions::default())).expect_err("too large");
    assert!(matches!(e, Error::Alloc { what: "attn_weights", .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("64.0 GiB") && msg.contains("need_weights=false"), "{msg}");
    // With gradients: the weights (64, 65536, 65536) = 1 TiB on the fused path, and the
    // (64·2, 65536, 65536) scores = 2 TiB on the composed one.
    let (m, _vm) = mha(MhaConfig::new(8, 2), DType::F32);
    let x = Tensor::zeros((65536, 64, 8), DType::F32, &dev()).unwrap();
    let x = candle_core::Var::from_tensor(&x).unwrap();
    let go = || m.forward(x.as_tensor(), x.as_tensor(), x.as_tensor(), &MhaOptions::default());
    let e = go().expect_err("too large");
    assert!(matches!(e, Error::Alloc { what: "attn_weights", .. }), "{e:?}");
    let e = with_backend(Backend::Composed, go).expect_err("too large");
    assert!(matches!(e, Error::Alloc { what: "attention scores", .. }), "{e:?}");
    // SDPA on the composed path (f64).
    let q = Tensor::zeros((64, 2, 65536, 4), DType::F64, &dev()).unwrap();
    let e =
        scaled_dot_product_attention(&q, &q, &q, &SdpaOptions::default()).expect_err("too large");
    assert!(matches!(e, Error::Alloc { .. }), "{e:?}");
}

// Finding 6: sizes that overflow built modules with empty parameters.
#[test]
fn constructor_sizes_that_overflow_are_rejected() {
    use candle_nn::{VarBuilder, VarMap};
    for cfg in [MhaConfig::new(1 << 32, 1), MhaConfig::new(8, 2).with_kdim(usize::MAX / 4)] {
        let vm = VarMap::new();
        let e = multihead::MultiheadAttention::new(
            cfg,
            VarBuilder::from_varmap(&vm, DType::F32, &dev()),
        )
        .expect_err("overflow");
        assert!(matches!(e, Error::Config { .. }), "{e:?}");
        assert!(vm.all_vars().is_empty(), "nothing may be created");
    }
    // Large but addressable: an allocation error, not an abort.
    let vm = VarMap::new();
    let e = Linear::new(1 << 20, 1 << 20, true, VarBuilder::from_varmap(&vm, DType::F32, &dev()))
        .expect_err("4 TiB weight");
    assert!(matches!(e, Error::Alloc { .. }), "{e:?}");
}

/// Output and attention weights of an MHA call with the composed and the auto (fused) backend.
fn both_paths(
    m: &multihead::MultiheadAttention,
    q: &Tensor,
    kv: &Tensor,
    opts: &MhaOptions,
) -> [(Tensor, Option<Tensor>); 2] {
    [Backend::Composed, Backend::Auto].map(|b| {
        let out = no_grad(|| m.forward(q, kv, kv, &opts.clone().backend(b))).expect("runs");
        (out.output, out.attn_weights)
    })
}

/// Same NaN positions, and the finite values close.
fn assert_same_nan_pattern(a: &Tensor, b: &Tensor, what: &str) {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.is_nan(), y.is_nan(), "{what}: element {i}: {x} vs {y}");
        if x.is_finite() {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{what}: element {i}: {x} vs {y}");
        }
    }
}

// Finding 5: whether a NaN in a padded key reached the output depended on the tile size.
#[test]
fn nan_in_masked_keys_and_values_propagates_identically_on_every_path() {
    let (e, h, n) = (8, 2, 2);
    let s = 530; // key tiles of 256: keys 255/256 straddle a boundary, 512.. is a short tile
    let (m, _vm) = mha(MhaConfig::new(e, h).with_batch_first(true), DType::F32);
    let q = det(&[n, 5, e], DType::F32, 1.0);
    for pos in [3usize, 255, 256, 300, 520] {
        for in_value in [false, true] {
            // Batch 0 pads keys 200.. (so `pos` >= 200 lies in fully padded tiles); batch 1 open.
            let mut pad = vec![0u8; n * s];
            pad[200..s].iter_mut().for_each(|p| *p = 1);
            let kpm = Mask::Bool(Tensor::from_vec(pad, (n, s), &dev()).unwrap());
            let mut data =
                det(&[n, s, e], DType::F32, 2.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            data[pos * e + if in_value { 3 } else { 0 }] = f32::NAN;
            let kv = Tensor::from_vec(data, (n, s, e), &dev()).unwrap();
            for need_weights in [false, true] {
                let opts =
                    MhaOptions::default().key_padding_mask(kpm.clone()).need_weights(need_weights);
                let [(oc, wc), (of, wf)] = both_paths(&m, &q, &kv, &opts);
                let what = format!("pos {pos} value {in_value} weights {need_weights}");
                assert_same_nan_pattern(&of, &oc, &what);
                // PyTorch's arithmetic: NaN + (-inf) and 0·NaN are NaN, so batch 0 is NaN.
                let b0 = of.get(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(b0.iter().all(|x| x.is_nan()), "{what}: batch 0 must be NaN");
                let b1 = of.get(1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(b1.iter().all(|x| x.is_finite()), "{what}: batch 1 must stay finite");
                if let (Some(wc), Some(wf)) = (wc, wf) {
                    assert_same_nan_pattern(&wf, &wc, &format!("{what}: weights"));
                }
            }
        }
    }
}

#[test]
fn nan_in_future_keys_under_is_causal_and_sdpa_masks_agree_across_paths() {
    let (b, h, l, s, d) = (1, 2, 300, 300, 8);
    let q = det(&[b, h, l, d], DType::F32, 1.0);
    let v = det(&[b, h, s, d], DType::F32, 3.0);
    for pos in [0usize, 255, 256, 299] {
        let mut data =
            det(&[b, h, s, d], DType::F32, 2.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        data[pos * d + 1] = f32::NAN; // head 0
        let k = Tensor::from_vec(data, (b, h, s, d), &dev()).unwrap();
        // A fully masked key range (SDPA polarity: False = masked) over the NaN, and causal.
        let mut keep = vec![1u8; l * s];
        for i in 0..l {
            for j in 250..s {
                keep[i * s + j] = 0;
            }
        }
        let mask = Mask::Bool(Tensor::from_vec(keep, (l, s), &dev()).unwrap());
        for opts in
            [SdpaOptions::default().is_causal(true), SdpaOptions::default().attn_mask(mask.clone())]
        {
            let run =
                |be| scaled_dot_product_attention(&q, &k, &v, &opts.clone().backend(be)).unwrap();
            let (c, f) = (run(Backend::Composed), run(Backend::Fused));
            assert_same_nan_pattern(&f, &c, &format!("pos {pos}"));
            let head1 = f.i((0, 1)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(head1.iter().all(|x| x.is_finite()), "head 1 has no NaN key");
        }
    }
}

// The ecosystem: our errors convert into candle's, so the layers work in candle_nn code.
#[test]
fn multihead_errors_convert_into_candle_errors() {
    fn candle_code(m: &multihead::MultiheadAttention, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(m.self_attention(x)?)
    }
    let (m, _vm) = mha(MhaConfig::new(8, 2), DType::F32);
    let err = candle_code(&m, &t(&[3, 2, 7])).expect_err("wrong width");
    assert!(err.to_string().contains("embedding dimension of 8"), "{err}");
    assert!(candle_code(&m, &t(&[3, 2, 8])).is_ok());
}

// Review findings (an adversarial pass after the first fixes).

#[test]
fn a_learned_float_mask_gets_its_gradient_on_every_path() {
    let q = det(&[1, 2, 4, 8], DType::F32, 1.0);
    let k = det(&[1, 2, 6, 8], DType::F32, 2.0);
    let bias = candle_core::Var::from_tensor(&det(&[1, 2, 4, 6], DType::F32, 3.0)).unwrap();
    let grads: Vec<Tensor> = [Backend::Composed, Backend::Fused]
        .into_iter()
        .map(|b| {
            let opts =
                SdpaOptions::default().attn_mask(Mask::Float(bias.as_tensor().clone())).backend(b);
            let out = scaled_dot_product_attention(&q, &k, &k, &opts).unwrap();
            let g = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            g.get(bias.as_tensor()).expect("the mask's gradient").clone()
        })
        .collect();
    assert_close(&grads[1], &grads[0], Tolerance::F32_GRAD, "mask gradient");
    let opts = SdpaOptions::default().attn_mask(Mask::Float(bias.as_tensor().clone()));
    // SDPA's fused path gives a learned mask its gradient (flash_backward_dscores), with
    // grad on and off.
    let plan = multihead::functional::explain_sdpa(&q, &k, &k, &opts).unwrap();
    assert_eq!(plan.path, multihead::Path::Fused, "{plan}");
    let plan = no_grad(|| multihead::functional::explain_sdpa(&q, &k, &k, &opts)).unwrap();
    assert_eq!(plan.path, multihead::Path::Fused);
}

#[test]
fn sdpa_reads_transposed_and_broadcast_views_on_the_fused_path() {
    let q = det(&[1, 2, 8, 5], DType::F32, 1.0).transpose(2, 3).unwrap(); // last stride 5
    let k = det(&[1, 2, 6, 8], DType::F32, 2.0);
    let v = det(&[1, 1, 1, 1], DType::F32, 3.0).broadcast_as((1, 2, 6, 8)).unwrap();
    let run =
        |b| scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::default().backend(b)).unwrap();
    assert_close(&run(Backend::Fused), &run(Backend::Composed), Tolerance::F32_FORWARD, "views");
}

#[test]
fn broadcast_views_that_would_expand_beyond_memory_are_alloc_errors() {
    let l = 1usize << 17;
    let (m, _vm) = mha(MhaConfig::new(8, 1), DType::F32);
    let x = Tensor::zeros((1, 1, 8), DType::F32, &dev()).unwrap().broadcast_as((l, 1, 8)).unwrap();
    for mask in [
        Mask::Float(
            Tensor::zeros((1, 1), DType::F32, &dev()).unwrap().broadcast_as((l, l)).unwrap(),
        ),
        Mask::Bool(Tensor::zeros((1, 1), DType::U8, &dev()).unwrap().broadcast_as((l, l)).unwrap()),
    ] {
        for b in BACKENDS {
            // A mask is copied (a bool one converted) for the fused kernels without its
            // broadcast dimensions (one value here): they would run the 2^34 scores
            // (`fused.rs` checks the bits of such masks at a small size); the composed path's
            // scores cannot be allocated.
            if b != Backend::Composed {
                continue;
            }
            let opts = MhaOptions::default().attn_mask(mask.clone()).need_weights(false).backend(b);
            let e = no_grad(|| m.forward(&x, &x, &x, &opts)).expect_err("64 GiB mask");
            assert!(matches!(e, Error::Alloc { .. }), "{b:?}: {e:?}");
            let plan = no_grad(|| m.explain(&x, &x, &x, &opts)).expect_err("the same");
            assert_eq!(plan.to_string(), e.to_string(), "{b:?}");
        }
    }
    let e = multihead::generate_square_subsequent_mask(1 << 32, DType::F32, &dev())
        .expect_err("overflow");
    assert!(matches!(e, Error::Alloc { .. }), "{e:?}");
    let e = multihead::generate_square_subsequent_mask(3, DType::U8, &dev()).expect_err("int");
    assert!(matches!(e, Error::DType { .. }), "{e:?}");
    let ids = Tensor::zeros(1, DType::U32, &dev()).unwrap().broadcast_as(1usize << 38).unwrap();
    let emb = multihead::Embedding::from_weight(t(&[10, 4])).unwrap();
    assert!(matches!(emb.forward(&ids), Err(Error::Alloc { .. })));
    let q = Tensor::zeros((1, 1, 1, 8), DType::F32, &dev())
        .unwrap()
        .broadcast_as((1, 1, 1 << 37, 8))
        .unwrap();
    let kv = Tensor::zeros((1, 1, 0, 8), DType::F32, &dev()).unwrap();
    let e = scaled_dot_product_attention(&q, &kv, &kv, &SdpaOptions::default()).expect_err("4 TiB");
    assert!(matches!(e, Error::Alloc { .. }), "{e:?}");
    let x = Tensor::zeros(1, DType::F32, &dev()).unwrap().broadcast_as(1usize << 38).unwrap();
    assert!(matches!(multihead::activation::dropout(&x, 0.5, true), Err(Error::Alloc { .. })));
    for b in BACKENDS {
        let r = with_backend(b, || multihead::Activation::Gelu.forward(&x));
        assert!(matches!(r, Err(Error::Alloc { .. })), "{b:?}: {r:?}");
    }
    let vm = candle_nn::VarMap::new();
    let ln = multihead::LayerNorm::new(
        1,
        1e-5,
        true,
        candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev()),
    )
    .unwrap();
    let x2 =
        Tensor::zeros((1, 1), DType::F32, &dev()).unwrap().broadcast_as((1usize << 38, 1)).unwrap();
    assert!(matches!(ln.forward(&x2), Err(Error::Alloc { .. })));
    let cfg = multihead::transformer::LayerConfig::new(8, 2).with_dim_feedforward(8);
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let e = multihead::transformer::TransformerEncoder::new(cfg, 1 << 40, None, vb)
        .expect_err("2^40 layers");
    assert!(matches!(e, Error::Alloc { .. }), "{e:?}");
}

#[test]
fn integer_inputs_to_float_layers_are_typed_errors() {
    use candle_nn::VarBuilder;
    let (ln, vm) = crate::common::layer_norm_f32(4);
    for x in [
        Tensor::ones((2, 4), DType::U32, &dev()).unwrap(),
        Tensor::zeros((2, 4), DType::F64, &dev()).unwrap(),
    ] {
        assert!(matches!(ln.forward(&x), Err(Error::DType { .. })), "{:?}", x.dtype());
    }
    let u = Tensor::ones(3, DType::U32, &dev()).unwrap();
    assert!(matches!(multihead::Activation::Gelu.forward(&u), Err(Error::DType { .. })));
    let e = multihead::MultiheadAttention::new(
        MhaConfig::new(8, 2),
        VarBuilder::from_varmap(&vm, DType::U32, &dev()),
    );
    assert!(matches!(e, Err(Error::DType { .. })));
}

#[test]
fn a_per_call_composed_backend_governs_the_projections_too() {
    let e = 8;
    let (w_in, w_out) = (det(&[3 * e, e], DType::F64, 0.1), det(&[e, e], DType::F64, 0.2));
    let params = MhaParams {
        embed_dim_to_check: e,
        num_heads: 2,
        num_kv_heads: None,
        in_proj: InProj::Packed(&w_in),
        in_proj_bias: None,
        bias_k: None,
        bias_v: None,
        add_zero_attn: false,
        dropout_p: 0.0,
        out_proj_weight: &w_out,
        out_proj_bias: None,
    };
    let x = det(&[3, 2, e], DType::F64, 1.0);
    let opts = MhaOptions::default().backend(Backend::Composed);
    let r = with_backend(Backend::Fused, || {
        multi_head_attention_forward(&x, &x, &x, &params, &opts, false)
    });
    assert!(r.is_ok(), "{:?}", r.err());
}

/// A call with nothing to compute (an empty batch, query or key set) gives zero gradients to
/// its inputs and every parameter, as PyTorch does, on both paths: its zeros used to be fresh
/// tensors outside the graph, so `backward` gave them no gradient at all.
#[test]
fn empty_calls_give_zero_gradients_to_inputs_and_parameters() {
    use candle_core::Var;
    use multihead::{with_backend, Backend, MhaConfig, MhaOptions, NamedParameters};
    let zeros_for = |grads: &candle_core::backprop::GradStore, what: &str, t: &Tensor| {
        let g = grads.get(t).unwrap_or_else(|| panic!("{what}: no gradient"));
        assert_eq!(g.dims(), t.dims(), "{what}");
        let all = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(all.iter().all(|&x| x == 0.0), "{what}: not zero");
    };
    for backend in [Backend::Auto, Backend::Composed] {
        for (l, s) in [(0usize, 7usize), (5, 0)] {
            let q = Var::from_tensor(&t(&[2, 3, l, 8])).unwrap();
            let k = Var::from_tensor(&t(&[2, 3, s, 8])).unwrap();
            let v = Var::from_tensor(&t(&[2, 3, s, 8])).unwrap();
            // A learned bias and sinks are parameters too (the output does not depend on them).
            let bias = Var::from_tensor(&t(&[l, s])).unwrap();
            let sinks = Var::from_tensor(&t(&[3])).unwrap();
            let opts = multihead::SdpaOptions::default()
                .attn_mask(multihead::Mask::Float(bias.as_tensor().clone()))
                .sinks(sinks.as_tensor().clone());
            let y = with_backend(backend, || {
                scaled_dot_product_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)
            })
            .unwrap();
            let grads = (y.sqr().unwrap().sum_all().unwrap() + y.sum_all().unwrap())
                .unwrap()
                .backward()
                .unwrap();
            for (n, x) in [("q", &q), ("k", &k), ("v", &v), ("mask", &bias), ("sinks", &sinks)] {
                zeros_for(&grads, &format!("{backend:?} sdpa l={l} s={s} {n}"), x.as_tensor());
            }
        }
        // A soft cap sends the masks through the variants' merge on the composed path.
        let cases = [(0usize, 4usize, 4usize), (2, 0, 4), (2, 4, 0)];
        let variants =
            [multihead::Variants::default(), multihead::Variants::default().softcap(30.0)];
        for ((n, l, s), variants) in
            cases.iter().flat_map(|&c| variants.iter().map(move |v| (c, v)))
        {
            let (m, _vm) = mha(MhaConfig::new(8, 2).with_batch_first(true), DType::F32);
            let q = Var::from_tensor(&t(&[n, l, 8])).unwrap();
            let kv = Var::from_tensor(&t(&[n, s, 8])).unwrap();
            let (bias, kpm) =
                (Var::from_tensor(&t(&[l, s])).unwrap(), Var::from_tensor(&t(&[n, s])).unwrap());
            let opts = MhaOptions {
                need_weights: false,
                attn_mask: Some(multihead::Mask::Float(bias.as_tensor().clone())),
                key_padding_mask: Some(multihead::Mask::Float(kpm.as_tensor().clone())),
                variants: variants.clone(),
                ..Default::default()
            };
            let y = with_backend(backend, || {
                m.forward(q.as_tensor(), kv.as_tensor(), kv.as_tensor(), &opts)
            })
            .unwrap()
            .output;
            let grads = (y.sum_all().unwrap() + y.sqr().unwrap().sum_all().unwrap())
                .unwrap()
                .backward()
                .unwrap();
            let what = format!("{backend:?} mha n={n} l={l} s={s} {variants:?}");
            zeros_for(&grads, &format!("{what} query"), q.as_tensor());
            zeros_for(&grads, &format!("{what} key"), kv.as_tensor());
            zeros_for(&grads, &format!("{what} attn_mask"), bias.as_tensor());
            zeros_for(&grads, &format!("{what} key_padding_mask"), kpm.as_tensor());
            for (name, p) in m.named_parameters() {
                if s == 0 && name == "out_proj.bias" {
                    // No keys: every output row is out_proj.bias, which gets dL/dy summed.
                    assert!(grads.get(&p).is_some(), "{what} {name}: no gradient");
                    continue;
                }
                zeros_for(&grads, &format!("{what} {name}"), &p);
            }
        }
    }
}

/// The same for the Transformer stacks: an empty batch or sequence gives every parameter a
/// (zero) gradient, pre-norm and post-norm (candle's ops on empty tensors drop gradients, so
/// the norms and residual sums keep empty results in the graph themselves).
#[test]
fn empty_batches_give_every_stack_parameter_a_gradient() {
    use candle_core::Var;
    use candle_nn::{VarBuilder, VarMap};
    use multihead::transformer::{
        DecoderMasks, LayerConfig, NormConfig, TransformerDecoder, TransformerEncoder,
    };
    use multihead::NamedParameters;
    for norm_first in [false, true] {
        let cfg = LayerConfig::new(8, 2)
            .with_dim_feedforward(16)
            .with_batch_first(true)
            .with_dropout(0.0)
            .with_norm_first(norm_first);
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
        let enc = TransformerEncoder::new(cfg.clone(), 2, Some(NormConfig::default()), vb.pp("e"))
            .unwrap();
        let dec = TransformerDecoder::new(cfg, 2, Some(NormConfig::default()), vb.pp("d")).unwrap();
        for (n, s) in [(0usize, 5usize), (2, 0)] {
            let x = Var::from_tensor(&t(&[n, s, 8])).unwrap();
            let mem = enc.forward(x.as_tensor(), None, None, None).unwrap();
            let y = dec.forward(x.as_tensor(), &mem, &DecoderMasks::default()).unwrap();
            let grads = y.sum_all().unwrap().backward().unwrap();
            let what = format!("norm_first={norm_first} n={n} s={s}");
            assert!(grads.get(x.as_tensor()).is_some(), "{what}: input");
            let params = enc.named_parameters().into_iter().chain(dec.named_parameters());
            for (name, p) in params {
                let g = grads.get(&p).unwrap_or_else(|| panic!("{what} {name}: no gradient"));
                let all = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(all.iter().all(|&v| v == 0.0), "{what} {name}: not zero");
            }
        }
    }
}

#[test]
fn copies_of_huge_views_are_alloc_errors_on_every_path_not_aborts() {
    // Broadcast views whose copies (the products read rows) would be terabytes: each of these
    // aborted the process ("memory allocation of N bytes failed") before 2026-12-07; an
    // adversarial run found them. Now each is `Error::Alloc`, with and without gradients, on
    // every backend and dtype, and a sane size runs.
    let b20 = 1usize << 20;
    let one = |dt: DType, rank: usize| Tensor::ones(vec![1; rank], dt, &dev()).unwrap();
    let alloc = |r: multihead::Result<Tensor>, what: &str| match r {
        Err(e @ Error::Alloc { .. }) => assert!(e.to_string().contains("cannot be allocated")),
        other => panic!("{what}: expected an Alloc error, got {other:?}"),
    };
    for dt in [DType::F32, DType::F64, DType::BF16] {
        for recorded in [false, true] {
            let run = |f: &dyn Fn() -> multihead::Result<Tensor>| {
                if recorded {
                    f()
                } else {
                    no_grad(f)
                }
            };
            let what = format!("{dt:?} recorded {recorded}");
            // Linear: the input broadcast along its 2^20 features (a (2^20, 1) output), and
            // the weight broadcast (one row in).
            let w = det(&[1, b20], dt, 0.5);
            let x = one(dt, 2).broadcast_as((b20, b20)).unwrap();
            for be in BACKENDS {
                let lin = Linear::from_weights(w.clone(), None);
                alloc(run(&|| with_backend(be, || lin.forward(&x))), &format!("{what} x {be:?}"));
            }
            if dt != DType::F64 {
                // (f64 reads such a weight through its strides and would compute 2^40 terms.)
                let lin = Linear::from_weights(one(dt, 2).broadcast_as((b20, b20)).unwrap(), None);
                alloc(run(&|| lin.forward(&det(&[1, b20], dt, 0.5))), &format!("{what} weight"));
            }
            // MultiheadAttention with kdim = vdim = 2^20 features, keys broadcast over them.
            let cfg = MhaConfig::new(8, 2).with_kdim(b20).with_vdim(b20);
            let (m, _vm) = mha(cfg, dt);
            let (q, kv) =
                (det(&[4, 1, 8], dt, 1.0), one(dt, 3).broadcast_as((b20, 1, b20)).unwrap());
            let opts = MhaOptions::default().need_weights(false);
            let mha_run = || m.forward(&q, &kv, &kv, &opts).map(|o| o.output);
            alloc(run(&mha_run), &format!("{what} mha kdim"));
        }
    }
    // A sane size of the same views runs (the product of ones).
    let lin = Linear::from_weights(Tensor::ones((2, 16), DType::F32, &dev()).unwrap(), None);
    let y = lin.forward(&one(DType::F32, 2).broadcast_as((3, 16)).unwrap()).unwrap();
    assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![16.0; 6]);
    // The encoder's nested-tensor path (inference, a padding mask): a 2^38-element broadcast
    // mask and input.
    let cfg = multihead::transformer::LayerConfig::new(8, 2)
        .with_dim_feedforward(8)
        .with_batch_first(true);
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let mut enc = multihead::transformer::TransformerEncoder::new(cfg, 1, None, vb).unwrap();
    enc.eval();
    let n = 1usize << 19;
    let src = one(DType::F32, 3).broadcast_as((n, n, 8)).unwrap();
    let kpm = Tensor::zeros((1, 1), DType::U8, &dev()).unwrap().broadcast_as((n, n)).unwrap();
    let r = no_grad(|| enc.forward(&src, None, Some(&Mask::Bool(kpm.clone())), None));
    alloc(r, "nested path");
}

#[test]
fn a_kv_cache_copies_only_the_tokens_it_appends() {
    // Keys broadcast to 2^38 tokens whose last dimension is strided: the cache appends the one
    // token asked for (copying 2^38 tokens aborted the process before 2026-12-07).
    let mut cache = multihead::KvCache::new(1, 1, 8, 16, DType::F32, &dev()).unwrap();
    let row = det(&[1, 1, 1, 1], DType::F32, 2.0);
    let k = row.broadcast_as((1, 1, 1usize << 38, 8)).unwrap();
    cache.append_kv(&k, &k, Some(&[1])).unwrap();
    let want = row.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
    for c in [cache.keys(), cache.values()] {
        let got = c.i((0, 0, 0)).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, vec![want; 8]);
    }
    assert_eq!(cache.lens(), &[1]);
}

#[test]
fn mha_explain_gives_the_calls_error_for_sizes_that_cannot_be_allocated() {
    // `explain` said Ok for calls that then failed to allocate (found by an adversarial run):
    // weights too large, projections of huge views, score matrices, a cached step's projection.
    // Each now gives the call's own error; every case runs the call and the plan.
    let one = |dims: &[usize]| {
        Tensor::ones(vec![1; dims.len()], DType::F32, &dev()).unwrap().broadcast_as(dims).unwrap()
    };
    let agree =
        |what: &str, call: multihead::Result<Tensor>, plan: multihead::Result<multihead::Plan>| {
            let call = call.expect_err(what);
            assert!(matches!(call, Error::Alloc { .. }), "{what}: {call}");
            assert_eq!(plan.expect_err(what).to_string(), call.to_string(), "{what}");
        };
    let (m, _vm) = mha(MhaConfig::new(8, 2), DType::F32);
    // Weights (N, L, S) of 2^34 values.
    let x = one(&[1 << 17, 1, 8]);
    for b in BACKENDS {
        let o = MhaOptions::default().need_weights(true).backend(b);
        let call = no_grad(|| m.forward(&x, &x, &x, &o).map(|y| y.output));
        agree(&format!("weights {b:?}"), call, no_grad(|| m.explain(&x, &x, &x, &o)));
    }
    // Keys of 2^20 features broadcast along them: the projection's copy.
    let cfg = MhaConfig::new(8, 2).with_kdim(1 << 20).with_vdim(1 << 20);
    let (mk, _vk) = mha(cfg, DType::F32);
    let (q, kv) = (det(&[4, 1, 8], DType::F32, 1.0), one(&[1 << 20, 1, 1 << 20]));
    for b in BACKENDS {
        let o = MhaOptions::default().need_weights(false).backend(b);
        let call = no_grad(|| mk.forward(&q, &kv, &kv, &o).map(|y| y.output));
        agree(&format!("kdim {b:?}"), call, no_grad(|| mk.explain(&q, &kv, &kv, &o)));
    }
    // A cached step whose projection cannot be allocated.
    let mut cache = m.new_cache(1, 4).unwrap();
    let x = one(&[1 << 38, 1, 8]);
    let plan = m.explain_cached(&x, &cache, Some(&[1]));
    agree("cached", m.forward_cached(&x, &mut cache, Some(&[1])), plan);
}

#[test]
fn static_keys_and_state_dicts_of_huge_views_are_alloc_errors() {
    // Each aborted the process before 2026-12-07 (a second adversarial run): static keys and
    // values that are 2^36-key broadcast views on the fused path, and a state_dict holding a
    // broadcast view, loaded or saved. Now `Error::Alloc`, explain agreeing.
    use multihead::state_dict::{load_strict, save_safetensors};
    use multihead::StaticKv;
    let one = |dims: &[usize]| {
        Tensor::ones(vec![1; dims.len()], DType::F32, &dev()).unwrap().broadcast_as(dims).unwrap()
    };
    let (m, _vm) = mha(MhaConfig::new(8, 2), DType::F32);
    let big = one(&[2, 1 << 36, 4]);
    let skv = StaticKv { k: big.clone(), v: big, memory: det(&[3, 1, 8], DType::F32, 1.0) };
    let x = det(&[2, 1, 8], DType::F32, 2.0);
    let call = no_grad(|| m.forward_static(&x, &skv, None)).expect_err("2 TiB keys");
    assert!(matches!(call, Error::Alloc { .. }), "{call}");
    let o = MhaOptions::default().need_weights(false);
    let plan = no_grad(|| m.explain_static(&x, &skv, &o)).expect_err("the same");
    assert_eq!(plan.to_string(), call.to_string());
    // A sane size of such a view runs, with the dense tensors' bits.
    let small = one(&[2, 3, 4]);
    let dense = small.contiguous().unwrap();
    let run = |k: &Tensor| {
        let s = StaticKv { k: k.clone(), v: k.clone(), memory: det(&[3, 1, 8], DType::F32, 1.0) };
        let y = no_grad(|| m.forward_static(&x, &s, None)).unwrap();
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert_eq!(run(&small), run(&dense));
    // A state_dict holding a 4 TiB broadcast view: loading it and saving it.
    let mut state = std::collections::HashMap::new();
    state.insert("weight".to_string(), one(&[1 << 20, 1 << 20]));
    let r = load_strict(&state, DType::F32, &dev(), |vb| {
        multihead::Linear::new(1 << 20, 1 << 20, false, vb)
    });
    assert!(matches!(r, Err(Error::Alloc { .. })), "{:?}", r.err());
    let dir = std::env::temp_dir().join(format!("mh-huge-view-{}", std::process::id()));
    let r = save_safetensors([("w", &state["weight"])], &dir);
    assert!(matches!(r, Err(Error::Alloc { .. })), "{r:?}");
    assert!(!dir.exists());
}

#[test]
fn sdpa_merging_huge_broadcast_batches_is_an_alloc_error() {
    // A 5-D call merges its leading dimensions into one batch, a broadcast one by a copy: for
    // a 32 TiB copy that was unchecked. Now `Error::Alloc`, the plan agreeing, for the inputs
    // and for a mask.
    let one = |dims: &[usize]| {
        Tensor::ones(vec![1; dims.len()], DType::F32, &dev()).unwrap().broadcast_as(dims).unwrap()
    };
    let o = SdpaOptions::default();
    let q = one(&[1 << 16, 1 << 16, 1, 256, 8]);
    let call = no_grad(|| scaled_dot_product_attention(&q, &q, &q, &o)).unwrap_err();
    let plan = no_grad(|| multihead::functional::explain_sdpa(&q, &q, &q, &o)).unwrap_err();
    assert!(matches!(call, Error::Alloc { .. }), "{call}");
    assert_eq!(plan.to_string(), call.to_string());
    // A small call with a mask broadcast over both leading dimensions runs.
    let (q, m) = (det(&[2, 3, 1, 4, 8], DType::F32, 1.0), one(&[2, 3, 1, 4, 4]));
    let o = SdpaOptions::default().attn_mask(Mask::Float(m));
    let y = scaled_dot_product_attention(&q, &q, &q, &o).unwrap();
    assert_eq!(y.dims(), &[2, 3, 1, 4, 8]);
}
