//! `autocast` at the edges PyTorch's `torch.autocast("cpu", dtype)` defines: functional
//! `scaled_dot_product_attention` and `multi_head_attention_forward` run in the autocast dtype,
//! and bf16 or f16 inputs (and float masks) reach f32 modules converted, as PyTorch's autocast
//! casts every f32, bf16 or f16 argument of its ops (f64 it leaves alone). The dtypes of the
//! results are PyTorch 2.15's, printed by:
//!
//! ```python
//! with torch.autocast("cpu", dtype=torch.bfloat16):
//!     lin(x).dtype, mha(x, x, x)[0].dtype, F.scaled_dot_product_attention(x, x, x).dtype
//!     # bf16 for f32 and bf16 x; enc(x).dtype: f32 for f32 x, bf16 for bf16 x, f32 for f16 x
//! ```
//!
//! except that an f32 input keeps an f32 result holding the autocast dtype's values (this
//! crate's documented choice, so that f32 code around composes).

use candle_core::{DType, Tensor};
use multihead::functional::{
    multi_head_attention_forward, scaled_dot_product_attention, InProj, MhaParams, SdpaOptions,
};
use multihead::transformer::{LayerConfig, TransformerDecoderLayer, TransformerEncoderLayer};
use multihead::{autocast, Linear, Mask, MhaConfig, MhaOptions, MultiheadAttention};

use crate::common::{bits, det, dev, var};

/// The functional parameters of a `MultiheadAttention(16, 4)` from its named parameters.
fn params_of(named: &std::collections::HashMap<String, Tensor>) -> MhaParams<'_> {
    MhaParams {
        embed_dim_to_check: 16,
        num_heads: 4,
        num_kv_heads: None,
        in_proj: InProj::Packed(&named["in_proj_weight"]),
        in_proj_bias: Some(&named["in_proj_bias"]),
        bias_k: None,
        bias_v: None,
        add_zero_attn: false,
        dropout_p: 0.0,
        out_proj_weight: &named["out_proj.weight"],
        out_proj_bias: Some(&named["out_proj.bias"]),
    }
}

fn to(t: &Tensor, dtype: DType) -> Tensor {
    t.to_dtype(dtype).unwrap()
}

/// SDPA under autocast is the call on inputs converted to the autocast dtype: the same bits
/// (output and the f32 inputs' gradients, which are the reduced gradients widened), an f32
/// result for f32 inputs and the autocast dtype for any other mix; f64 stays f64 (uncast).
#[test]
fn sdpa_under_autocast_attends_in_the_autocast_dtype() {
    let (q, k, v) = (
        var(&det(&[2, 2, 5, 8], DType::F32, 1.0)),
        var(&det(&[2, 2, 7, 8], DType::F32, 2.0)),
        var(&det(&[2, 2, 7, 8], DType::F32, 3.0)),
    );
    let mask = (det(&[5, 7], DType::F32, 4.0) * 0.37).unwrap();
    for dt in [DType::BF16, DType::F16] {
        let opts = SdpaOptions::default().attn_mask(Mask::Float(mask.clone()));
        let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
        let y = autocast(dt, || scaled_dot_product_attention(qt, kt, vt, &opts)).unwrap();
        assert_eq!(y.dtype(), DType::F32, "{dt:?}: f32 inputs keep an f32 result");
        // The same call in `dt`, by hand.
        let (qr, kr, vr) = (var(&to(qt, dt)), var(&to(kt, dt)), var(&to(vt, dt)));
        let ropts = SdpaOptions::default().attn_mask(Mask::Float(to(&mask, dt)));
        let yr =
            scaled_dot_product_attention(qr.as_tensor(), kr.as_tensor(), vr.as_tensor(), &ropts)
                .unwrap();
        assert_eq!(bits(&y), bits(&yr), "{dt:?}: output");
        let plain = scaled_dot_product_attention(qt, kt, vt, &opts).unwrap();
        assert_ne!(bits(&y), bits(&plain), "{dt:?}: autocast changed nothing");
        let g = det(y.dims(), dt, 5.0);
        let grads = y.mul(&to(&g, DType::F32)).unwrap().sum_all().unwrap().backward().unwrap();
        let rgrads = yr.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, a, b) in [("query", &q, &qr), ("key", &k, &kr), ("value", &v, &vr)] {
            let ga = grads.get(a.as_tensor()).unwrap();
            assert_eq!(ga.dtype(), DType::F32, "{dt:?}: {name} gradient");
            assert_eq!(bits(ga), bits(grads_of(&rgrads, b)), "{dt:?}: {name} gradient");
        }
        // A reduced query among f32 key and value: PyTorch casts all three, and returns `dt`.
        let mixed =
            autocast(dt, || scaled_dot_product_attention(qr.as_tensor(), kt, vt, &opts)).unwrap();
        assert_eq!(mixed.dtype(), dt);
        assert_eq!(bits(&mixed), bits(&yr), "{dt:?}: mixed inputs");
    }
    // f64 is not cast: the plain f64 call, bits and all.
    let q64 = det(&[1, 2, 3, 4], DType::F64, 6.0);
    let plain = scaled_dot_product_attention(&q64, &q64, &q64, &SdpaOptions::default()).unwrap();
    let ac = autocast(DType::BF16, || {
        scaled_dot_product_attention(&q64, &q64, &q64, &SdpaOptions::default())
    })
    .unwrap();
    assert_eq!(ac.dtype(), DType::F64);
    let (a, b) = (ac.flatten_all().unwrap(), plain.flatten_all().unwrap());
    assert_eq!(a.to_vec1::<f64>().unwrap(), b.to_vec1::<f64>().unwrap());
}

fn grads_of<'a>(g: &'a candle_core::backprop::GradStore, v: &candle_core::Var) -> &'a Tensor {
    g.get(v.as_tensor()).unwrap()
}

/// bf16 inputs to f32 modules under bf16 autocast (and an f16 one, cast to bf16): the result
/// of the f32 input holding the same values, in PyTorch's dtype; bf16 float masks likewise.
/// The functional `multi_head_attention_forward` under autocast is the module's call.
#[test]
fn reduced_inputs_reach_f32_modules_under_autocast_as_pytorch_casts_them() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let bf = DType::BF16;
    let x = to(&to(&det(&[2, 5, 16], DType::F32, 1.0), bf), DType::F32);
    let xb = to(&x, bf);
    let ac = |f: &dyn Fn() -> Tensor| autocast(bf, f);
    // Linear: bf16 in, bf16 out; the values of the f32 input's (rounded) result.
    let lin = Linear::new(16, 12, true, vb.pp("lin")).unwrap();
    let (y32, yb) = (ac(&|| lin.forward(&x).unwrap()), ac(&|| lin.forward(&xb).unwrap()));
    assert_eq!((y32.dtype(), yb.dtype()), (DType::F32, bf));
    assert_eq!(bits(&yb), bits(&y32), "linear");
    // f16 input under bf16 autocast: cast to bf16 (its values here are bf16 ones).
    let yh = ac(&|| lin.forward(&to(&x, DType::F16)).unwrap());
    assert_eq!(yh.dtype(), bf);
    let xh_as_bf16 = to(&to(&to(&x, DType::F16), bf), DType::F32);
    assert_eq!(bits(&yh), bits(&ac(&|| lin.forward(&xh_as_bf16).unwrap())), "linear f16");
    // MultiheadAttention with a bf16 float mask: bf16 output and weights.
    let cfg = MhaConfig::new(16, 4).with_batch_first(true).with_dropout(0.0);
    let mha = MultiheadAttention::new(cfg, vb.pp("mha")).unwrap();
    let mask = to(&(det(&[5, 5], DType::F32, 2.0) * 0.37).unwrap(), bf);
    let opts = |m: Tensor| MhaOptions::default().attn_mask(Mask::Float(m));
    let ob = ac(&|| {
        let o = mha.forward(&xb, &xb, &xb, &opts(mask.clone())).unwrap();
        Tensor::cat(
            &[o.output.flatten_all().unwrap(), o.attn_weights.unwrap().flatten_all().unwrap()],
            0,
        )
        .unwrap()
    });
    let o32 = ac(&|| {
        let o = mha.forward(&x, &x, &x, &opts(to(&mask, DType::F32))).unwrap();
        Tensor::cat(
            &[o.output.flatten_all().unwrap(), o.attn_weights.unwrap().flatten_all().unwrap()],
            0,
        )
        .unwrap()
    });
    assert_eq!((ob.dtype(), o32.dtype()), (bf, DType::F32));
    assert_eq!(bits(&ob), bits(&o32), "mha");
    // Explaining accepts what the call accepts (the plan of the call it runs).
    let plan = autocast(bf, || mha.explain(&xb, &xb, &xb, &opts(mask.clone())));
    assert_eq!(plan.unwrap().path, multihead::Path::Fused);
    assert!(mha.explain(&xb, &xb, &xb, &opts(mask.clone())).is_err(), "outside autocast");
    // The functional call with the module's parameters: the module's bits.
    let named: std::collections::HashMap<String, Tensor> =
        multihead::state_dict::NamedParameters::named_parameters(&mha).into_iter().collect();
    let xs = x.transpose(0, 1).unwrap().contiguous().unwrap(); // (L, N, E)
    let params = params_of(&named);
    let f = ac(&|| {
        let mo = MhaOptions::default().attn_mask(Mask::Float(to(&mask, DType::F32)));
        multi_head_attention_forward(&xs, &xs, &xs, &params, &mo, false).unwrap().output
    });
    let m = ac(&|| {
        mha.forward(&x, &x, &x, &opts(to(&mask, DType::F32)))
            .unwrap()
            .output
            .transpose(0, 1)
            .unwrap()
    });
    assert_eq!(bits(&f), bits(&m), "functional mha under autocast");
    let xsb = to(&xs, bf);
    let mo = MhaOptions::default().attn_mask(Mask::Float(mask.clone()));
    let plan =
        autocast(bf, || multihead::functional::explain_mha(&xsb, &xsb, &xsb, &params, &mo, false));
    assert!(plan.is_ok(), "{plan:?}");
    let plain = multi_head_attention_forward(
        &xs,
        &xs,
        &xs,
        &params,
        &MhaOptions::default().attn_mask(Mask::Float(to(&mask, DType::F32))),
        false,
    )
    .unwrap()
    .output;
    assert_ne!(bits(&f), bits(&plain), "the functional call ignored autocast");
    // The layers: bf16 in, bf16 out; f16 in (under bf16 autocast), f32 out, as PyTorch's
    // first residual sum promotes.
    let lcfg =
        LayerConfig::new(16, 2).with_dim_feedforward(24).with_dropout(0.0).with_batch_first(true);
    let enc = TransformerEncoderLayer::new(lcfg.clone(), vb.pp("enc")).unwrap();
    let dec = TransformerDecoderLayer::new(lcfg, vb.pp("dec")).unwrap();
    let e32 = ac(&|| enc.forward(&x, None, None, false).unwrap());
    let eb = ac(&|| enc.forward(&xb, None, None, false).unwrap());
    assert_eq!(eb.dtype(), bf);
    assert_eq!(bits(&eb), bits(&to(&e32, bf)), "encoder layer");
    let eh = ac(&|| enc.forward(&to(&x, DType::F16), None, None, false).unwrap());
    assert_eq!(eh.dtype(), DType::F32);
    let none = MhaOptions::default();
    let d32 = ac(&|| dec.forward_with(&x, &x, &none, &none).unwrap());
    let db = ac(&|| dec.forward_with(&xb, &xb, &none, &none).unwrap());
    assert_eq!(db.dtype(), bf);
    assert_eq!(bits(&db), bits(&to(&d32, bf)), "decoder layer");
    // Outside autocast a bf16 input to an f32 module stays an error, as in PyTorch.
    assert!(lin.forward(&xb).is_err());
}

/// A bf16 module under bf16 autocast runs its own path on its own-dtype input (PyTorch runs a
/// bf16 model under autocast unchanged): the bits of the call outside autocast.
#[test]
fn a_bf16_module_under_autocast_runs_as_outside_it() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::BF16, &dev());
    let bf = DType::BF16;
    let x = det(&[2, 5, 16], bf, 1.0);
    let lin = Linear::new(16, 12, true, vb.pp("lin")).unwrap();
    let cfg = MhaConfig::new(16, 4).with_batch_first(true).with_dropout(0.0);
    let mha = MultiheadAttention::new(cfg, vb.pp("mha")).unwrap();
    let lcfg =
        LayerConfig::new(16, 2).with_dim_feedforward(24).with_dropout(0.0).with_batch_first(true);
    let enc = TransformerEncoderLayer::new(lcfg, vb.pp("enc")).unwrap();
    type Run<'a> = Box<dyn Fn() -> Tensor + 'a>;
    let runs: Vec<(&str, Run)> = vec![
        ("linear", Box::new(|| lin.forward(&x).unwrap())),
        ("mha", Box::new(|| mha.forward(&x, &x, &x, &MhaOptions::default()).unwrap().output)),
        ("encoder layer", Box::new(|| enc.forward(&x, None, None, false).unwrap())),
    ];
    for (what, run) in &runs {
        let inside = autocast(bf, run);
        assert_eq!(inside.dtype(), bf, "{what}");
        assert_eq!(bits(&inside), bits(&run()), "{what}");
    }
}

/// Under autocast the static keys and values (and sinks) are rounded as the masks are, as
/// PyTorch's autocast casts what its products read; bf16 ones are taken with a bf16 query.
#[test]
fn static_keys_and_values_under_autocast_are_rounded_as_pytorch_casts_them() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let bf = DType::BF16;
    let cfg = MhaConfig::new(8, 2).with_dropout(0.0);
    let mha = MultiheadAttention::new(cfg, vb.pp("m")).unwrap();
    let x = to(&to(&det(&[3, 2, 8], DType::F32, 1.0), bf), DType::F32); // (L, N, E)
                                                                        // (N·H, S, D) with values bf16 cannot hold.
    let k = (det(&[4, 5, 4], DType::F32, 2.0) * 0.37).unwrap();
    let v = (det(&[4, 5, 4], DType::F32, 3.0) * 0.29).unwrap();
    let rounded = |t: &Tensor| to(&to(t, bf), DType::F32);
    let run = |k: &Tensor, v: &Tensor, q: &Tensor| {
        let o = MhaOptions::default().static_kv(k.clone(), v.clone());
        autocast(bf, || mha.forward(q, q, q, &o)).unwrap().output
    };
    let given = run(&k, &v, &x);
    assert_eq!(bits(&given), bits(&run(&rounded(&k), &rounded(&v), &x)));
    let plain = mha.forward(&x, &x, &x, &MhaOptions::default().static_kv(k.clone(), v.clone()));
    assert_ne!(bits(&given), bits(&plain.unwrap().output), "autocast changed nothing");
    // bf16 static keys and values with a bf16 query: taken, a bf16 result, the same values.
    let reduced = run(&to(&k, bf), &to(&v, bf), &to(&x, bf));
    assert_eq!(reduced.dtype(), bf);
    assert_eq!(bits(&reduced), bits(&given));
}

/// Bad input to what autocast and the f32 masks added gets the errors of the plain call on
/// both paths: a wrong shape, a view too large to convert (an allocation error, not an
/// abort), an f64 mask; a NaN propagates as it does outside autocast, fused and composed alike.
#[test]
fn bad_input_under_autocast_is_an_error_on_both_paths() {
    use multihead::{with_backend, Backend};
    let bf = DType::BF16;
    let q = det(&[1, 2, 4, 8], DType::F32, 1.0);
    let k_bad = det(&[1, 2, 5, 7], DType::F32, 2.0);
    let huge =
        det(&[1, 1, 1, 8], DType::F32, 3.0).broadcast_as((1usize << 16, 1 << 12, 1 << 10, 8));
    let huge = huge.unwrap();
    let mask64 = Mask::Float(det(&[4, 4], DType::F64, 4.0));
    let mut with_nan =
        det(&[1, 2, 4, 8], DType::F32, 5.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    with_nan[3] = f32::NAN;
    let qn = Tensor::from_vec(with_nan, (1, 2, 4, 8), &dev()).unwrap();
    let plain = SdpaOptions::default();
    for backend in [Backend::Auto, Backend::Composed] {
        let run = |a: &Tensor, b: &Tensor, o: &SdpaOptions| {
            with_backend(backend, || autocast(bf, || scaled_dot_product_attention(a, b, b, o)))
        };
        let e = run(&q, &k_bad, &plain).map(|_| ()).expect_err("shape").to_string();
        assert!(e.starts_with("scaled_dot_product_attention: "), "{backend:?}: {e}");
        let e = run(&huge, &q, &plain).map(|_| ()).expect_err("huge");
        assert!(matches!(e, multihead::Error::Alloc { .. }), "{backend:?}: {e}");
        let o = SdpaOptions::default().attn_mask(mask64.clone());
        let e = run(&q, &q, &o).map(|_| ()).expect_err("f64 mask").to_string();
        assert!(e.contains("attn_mask") && e.contains("F64"), "{backend:?}: {e}");
        // NaN: the same rows NaN as the bf16 call on converted inputs.
        let y = run(&qn, &q, &plain).unwrap();
        let y16 = with_backend(backend, || {
            let (a, b) = (to(&qn, bf), to(&q, bf));
            scaled_dot_product_attention(&a, &b, &b, &plain)
        })
        .unwrap();
        assert_eq!(bits(&y), bits(&y16), "{backend:?}: NaN");
        let flat = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(flat.iter().any(|v| v.is_nan()) && flat.iter().any(|v| v.is_finite()));
    }
}

/// A bf16 or f16 module under an autocast to its own dtype (`model.to(torch.bfloat16)` run
/// under `torch.autocast("cpu", torch.bfloat16)`) takes f32 inputs and float masks as PyTorch's
/// autocast casts them: the call is the module's on the arguments converted to its dtype
/// outside autocast, bit for bit, in its dtype, and an f32 input's gradient is the converted
/// input's gradient widened. PyTorch 2.15 gives the same identities (`torch.equal` of output
/// and weights, batch-first and sequence-first, self- and cross-attention with a float mask,
/// `need_weights` on and off; `nn.Linear`). An f64 input is left as it is and refused.
#[test]
fn a_reduced_module_under_its_own_autocast_casts_f32_inputs_as_pytorch_does() {
    for dt in [DType::BF16, DType::F16] {
        let vm = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, dt, &dev());
        let x = det(&[2, 5, 16], DType::F32, 1.0);
        let kv = det(&[2, 7, 16], DType::F32, 3.0);
        let mask = (det(&[5, 7], DType::F32, 2.0) * 0.37).unwrap();
        let lin = Linear::new(16, 12, true, vb.pp("lin")).unwrap();
        let y = autocast(dt, || lin.forward(&x)).unwrap();
        assert_eq!(y.dtype(), dt);
        assert_eq!(bits(&y), bits(&lin.forward(&to(&x, dt)).unwrap()), "linear {dt:?}");
        let act = multihead::Activation::Gelu;
        let y = autocast(dt, || lin.forward_act(&x, act)).unwrap();
        assert_eq!(bits(&y), bits(&lin.forward_act(&to(&x, dt), act).unwrap()), "gelu {dt:?}");
        for batch_first in [true, false] {
            let cfg = MhaConfig::new(16, 4).with_batch_first(batch_first).with_dropout(0.0);
            let mha = MultiheadAttention::new(cfg, vb.pp(format!("mha{batch_first}"))).unwrap();
            let lay = |t: &Tensor| if batch_first { t.clone() } else { t.transpose(0, 1).unwrap() };
            let (xv, kvv) = (var(&lay(&x)), var(&lay(&kv)));
            for need_weights in [true, false] {
                let opts = |m: Tensor| {
                    MhaOptions::default().attn_mask(Mask::Float(m)).need_weights(need_weights)
                };
                let what = format!("{dt:?} batch_first={batch_first} weights={need_weights}");
                let inside = autocast(dt, || {
                    mha.forward(
                        xv.as_tensor(),
                        kvv.as_tensor(),
                        kvv.as_tensor(),
                        &opts(mask.clone()),
                    )
                })
                .unwrap();
                let (xr, kvr) = (var(&to(xv.as_tensor(), dt)), var(&to(kvv.as_tensor(), dt)));
                let outside = mha
                    .forward(xr.as_tensor(), kvr.as_tensor(), kvr.as_tensor(), &opts(to(&mask, dt)))
                    .unwrap();
                assert_eq!(inside.output.dtype(), dt, "{what}");
                assert_eq!(bits(&inside.output), bits(&outside.output), "{what}");
                match (&inside.attn_weights, &outside.attn_weights) {
                    (Some(a), Some(b)) => assert_eq!(bits(a), bits(b), "{what} weights"),
                    (None, None) => {}
                    _ => panic!("{what}: weights returned on one side only"),
                }
                // The gradients: the f32 inputs' are the converted inputs' widened.
                let loss = |t: &Tensor| multihead::sum_f32(t).unwrap();
                let g_in = loss(&inside.output).backward().unwrap();
                let g_out = loss(&outside.output).backward().unwrap();
                for ((v32, vr), name) in [((&xv, &xr), "query"), ((&kvv, &kvr), "key/value")] {
                    let (a, b) = (grads_of(&g_in, v32), grads_of(&g_out, vr));
                    assert_eq!(a.dtype(), DType::F32, "{what} {name} grad");
                    assert_eq!(bits(a), bits(&to(b, DType::F32)), "{what} {name} grad");
                }
            }
            // Explaining accepts what the call accepts.
            let o = MhaOptions::default().attn_mask(Mask::Float(mask.clone()));
            let (xl, kvl) = (lay(&x), lay(&kv));
            let plan = autocast(dt, || mha.explain(&xl, &kvl, &kvl, &o)).unwrap();
            let own = mha.explain(&to(&xl, dt), &to(&kvl, dt), &to(&kvl, dt), &o).unwrap();
            assert_eq!(plan.path, own.path, "{dt:?} plan");
            // f64 is not cast: the mixed call is refused, as PyTorch refuses it.
            let x64 = to(&xl, DType::F64);
            let e = autocast(dt, || mha.forward(&x64, &x64, &x64, &MhaOptions::default()));
            assert!(e.unwrap_err().to_string().contains("dtype"), "{dt:?} f64");
        }
        // The functional form, with the module's parameters: the same call.
        let cfg = MhaConfig::new(16, 4).with_dropout(0.0);
        let mha = MultiheadAttention::new(cfg, vb.pp("functional")).unwrap();
        let named: std::collections::HashMap<String, Tensor> =
            multihead::NamedParameters::named_parameters(&mha).into_iter().collect();
        let params = params_of(&named);
        let xs = x.transpose(0, 1).unwrap();
        let o = MhaOptions::default().attn_mask(Mask::Float(det(&[5, 5], DType::F32, 4.0)));
        let f = autocast(dt, || multi_head_attention_forward(&xs, &xs, &xs, &params, &o, false));
        let f = f.unwrap();
        let m = autocast(dt, || mha.forward(&xs, &xs, &xs, &o)).unwrap();
        assert_eq!(f.output.dtype(), dt);
        assert_eq!(bits(&f.output), bits(&m.output), "{dt:?} functional");
    }
}

/// A bf16 or f16 Transformer layer under an autocast to its own dtype, on its own-dtype input
/// with f32 float masks and (the decoder) an f32 memory: PyTorch's autocast casts the masks and
/// the memory its attention reads to the layer's dtype, so the call is the layer's on converted
/// masks and memory outside autocast (PyTorch 2.15: `torch.equal`, post- and pre-norm; outside
/// autocast the f32 mask is read unrounded there and here). An f32 input is refused, as
/// PyTorch's LayerNorm refuses it (in training; its fused eval path takes it).
#[test]
fn a_reduced_layer_under_its_own_autocast_casts_f32_masks_as_pytorch_does() {
    use multihead::transformer::{DecoderMasks, TransformerDecoder, TransformerEncoder};
    for dt in [DType::BF16, DType::F16] {
        for norm_first in [false, true] {
            let vm = candle_nn::VarMap::new();
            let vb = candle_nn::VarBuilder::from_varmap(&vm, dt, &dev());
            let cfg = LayerConfig::new(16, 4)
                .with_dim_feedforward(32)
                .with_dropout(0.0)
                .with_batch_first(true)
                .with_norm_first(norm_first);
            let what = format!("{dt:?} norm_first={norm_first}");
            let x = to(&det(&[2, 5, 16], DType::F32, 1.0), dt);
            let mem = det(&[2, 7, 16], DType::F32, 3.0);
            let m = (det(&[5, 5], DType::F32, 2.0) * 0.37).unwrap();
            let mm = (det(&[5, 7], DType::F32, 5.0) * 0.41).unwrap();
            let (m16, mm16) = (Some(Mask::Float(to(&m, dt))), Some(Mask::Float(to(&mm, dt))));
            let enc = TransformerEncoderLayer::new(cfg.clone(), vb.pp("enc")).unwrap();
            let f = Some(Mask::Float(m.clone()));
            let inside = autocast(dt, || enc.forward(&x, f.as_ref(), None, false)).unwrap();
            let outside = enc.forward(&x, m16.as_ref(), None, false).unwrap();
            assert_eq!(inside.dtype(), dt, "{what}");
            assert_eq!(bits(&inside), bits(&outside), "{what} encoder layer");
            let mut stack = TransformerEncoder::new(cfg.clone(), 2, None, vb.pp("stack")).unwrap();
            let inside = autocast(dt, || stack.forward(&x, f.as_ref(), None, None)).unwrap();
            let outside = stack.forward(&x, m16.as_ref(), None, None).unwrap();
            assert_eq!(bits(&inside), bits(&outside), "{what} encoder");
            // In eval under no_grad (this crate's inference path; PyTorch's fused one reads a
            // float mask as bool, §7.5), with a key padding mask too.
            stack.eval();
            let kpm =
                Mask::Bool(Tensor::new(&[[0u8, 0, 0, 0, 0], [0, 0, 0, 1, 1]], &dev()).unwrap());
            let run = |m: &Option<Mask>| {
                multihead::no_grad(|| stack.forward(&x, m.as_ref(), Some(&kpm), None)).unwrap()
            };
            let inside = autocast(dt, || run(&f));
            assert_eq!(bits(&inside), bits(&run(&m16)), "{what} encoder in eval");
            let dec = TransformerDecoderLayer::new(cfg.clone(), vb.pp("dec")).unwrap();
            let masks = |tgt: Option<Mask>, mem: Option<Mask>| DecoderMasks {
                tgt_mask: tgt,
                memory_mask: mem,
                ..Default::default()
            };
            let m32 = masks(f.clone(), Some(Mask::Float(mm.clone())));
            let inside = autocast(dt, || dec.forward(&x, &mem, &m32)).unwrap();
            let outside = dec.forward(&x, &to(&mem, dt), &masks(m16.clone(), mm16.clone()));
            assert_eq!(bits(&inside), bits(&outside.unwrap()), "{what} decoder layer");
            let dstack = TransformerDecoder::new(cfg.clone(), 2, None, vb.pp("dstack")).unwrap();
            let inside = autocast(dt, || dstack.forward(&x, &mem, &m32)).unwrap();
            let outside = dstack.forward(&x, &to(&mem, dt), &masks(m16.clone(), mm16.clone()));
            assert_eq!(bits(&inside), bits(&outside.unwrap()), "{what} decoder");
            // An f32 input to the layer: refused, as PyTorch's LayerNorm refuses it.
            let x32 = to(&x, DType::F32);
            let e = autocast(dt, || enc.forward(&x32, None, None, false)).unwrap_err();
            let e = e.to_string();
            assert!(e.starts_with("TransformerEncoderLayer.forward: src:"), "{what}: {e}");
            assert!(e.contains("but the input is F32") && e.contains("convert it"), "{e}");
            let e = autocast(dt, || dec.forward(&x32, &mem, &masks(None, None))).unwrap_err();
            assert!(e.to_string().starts_with("TransformerDecoderLayer.forward: tgt:"), "{e}");
        }
    }
}

/// Bad input to a bf16 module under its own autocast, on the fused and the composed path
/// alike: a wrong shape and an f64 mask are errors that name the call, a broadcast view too
/// large to convert is an allocation error, a strided view gives the contiguous input's bits,
/// and a NaN gives the bits of the call on converted inputs (NaN rows and finite ones).
#[test]
fn bad_input_to_a_reduced_module_under_its_own_autocast_is_an_error_on_both_paths() {
    use multihead::{with_backend, Backend};
    let bf = DType::BF16;
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, bf, &dev());
    let cfg = MhaConfig::new(8, 2).with_batch_first(true).with_dropout(0.0);
    let mha = MultiheadAttention::new(cfg, vb.pp("mha")).unwrap();
    let x = det(&[2, 4, 8], DType::F32, 1.0);
    let bad = det(&[2, 4, 7], DType::F32, 2.0);
    let huge = det(&[1, 1, 8], DType::F32, 3.0).broadcast_as((1usize << 20, 1 << 14, 8));
    let huge = huge.unwrap();
    let strided = det(&[4, 2, 8], DType::F32, 4.0).transpose(0, 1).unwrap();
    let mut with_nan = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    with_nan[3] = f32::NAN;
    let xn = Tensor::from_vec(with_nan, (2, 4, 8), &dev()).unwrap();
    let o = MhaOptions::default();
    for backend in [Backend::Auto, Backend::Composed] {
        let run = |q: &Tensor, k: &Tensor, o: &MhaOptions| {
            with_backend(backend, || autocast(bf, || mha.forward(q, k, k, o)))
        };
        let e = run(&x, &bad, &o).map(|_| ()).expect_err("shape").to_string();
        assert!(e.starts_with("multi_head_attention_forward: "), "{backend:?}: {e}");
        let e = run(&huge, &huge, &o).map(|_| ()).expect_err("huge");
        assert!(matches!(e, multihead::Error::Alloc { .. }), "{backend:?}: {e}");
        let o64 = MhaOptions::default().attn_mask(Mask::Float(det(&[4, 4], DType::F64, 5.0)));
        let e = run(&x, &x, &o64).map(|_| ()).expect_err("f64 mask").to_string();
        assert!(e.contains("attn_mask") && e.contains("F64"), "{backend:?}: {e}");
        let contiguous = strided.contiguous().unwrap();
        let (a, b) = (run(&strided, &strided, &o).unwrap(), run(&contiguous, &contiguous, &o));
        assert_eq!(bits(&a.output), bits(&b.unwrap().output), "{backend:?}: strided");
        let y = run(&xn, &xn, &o).unwrap().output;
        let xb = to(&xn, bf);
        let y16 = with_backend(backend, || mha.forward(&xb, &xb, &xb, &o)).unwrap().output;
        assert_eq!(bits(&y), bits(&y16), "{backend:?}: NaN");
        let flat = to(&y, DType::F32).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(flat.iter().any(|v| v.is_nan()) && flat.iter().any(|v| v.is_finite()));
    }
}
