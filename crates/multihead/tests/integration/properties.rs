//! Property test: over random configurations, shapes and masks (valid and not), the module either
//! returns a typed error or a finite result of the right shape. It never panics.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::{Mask, MhaConfig, MhaOptions, MultiheadAttention};
use proptest::prelude::*;

use crate::common::{det, dev};

#[derive(Debug, Clone)]
struct Draw {
    e: usize,
    h: usize,
    kdim: Option<usize>,
    vdim: Option<usize>,
    bias: bool,
    bias_kv: bool,
    zero_attn: bool,
    batch_first: bool,
    unbatched: bool,
    n: usize,
    l: usize,
    s: usize,
    s_value: usize,
    q_feat_off: usize,
    input_f64: bool,
    module_f64: bool,
    attn_mask: u8, // 0 none, 1 2-D, 2 3-D, 3 wrong shape
    mask_float: bool,
    kpm: u8, // 0 none, 1 right, 2 wrong
    kpm_float: bool,
    mask_density: u8,
    need_weights: bool,
    average: bool,
    is_causal: bool,
    self_attn: bool,
    training: bool,
}

fn draw() -> impl Strategy<Value = Draw> {
    let a = (
        1usize..=12,
        1usize..=4,
        prop::option::of(1usize..=6),
        prop::option::of(1usize..=6),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    );
    let b = (
        any::<bool>(),
        0usize..=3,
        0usize..=5,
        0usize..=5,
        0usize..=5,
        prop_oneof![8 => Just(0usize), 1 => 1usize..=2],
        prop_oneof![9 => Just(false), 1 => Just(true)],
        any::<bool>(),
    );
    let c = (
        0u8..=3,
        any::<bool>(),
        0u8..=2,
        any::<bool>(),
        0u8..=3,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    );
    let d = (any::<bool>(), any::<bool>(), prop_oneof![9 => Just(false), 1 => Just(true)]);
    (a, b, c, d).prop_map(|(a, b, c, d)| Draw {
        e: a.0,
        h: a.1,
        kdim: a.2,
        vdim: a.3,
        bias: a.4,
        bias_kv: a.5,
        zero_attn: a.6,
        batch_first: a.7,
        unbatched: b.0,
        n: b.1,
        l: b.2,
        s: b.3,
        s_value: if b.7 { b.3 } else { b.4 },
        q_feat_off: b.5,
        input_f64: b.6,
        module_f64: d.2,
        attn_mask: c.0,
        mask_float: c.1,
        kpm: c.2,
        kpm_float: c.3,
        mask_density: c.4,
        need_weights: c.5,
        average: c.6,
        is_causal: c.7,
        self_attn: d.0,
        training: d.1,
    })
}

fn mask_tensor(shape: &[usize], density: u8, float: bool, dtype: DType, salt: f64) -> Mask {
    let n: usize = shape.iter().product();
    let bits: Vec<u8> = (0..n)
        .map(|i| (((i as f64 + salt) * 0.618).fract() < density as f64 * 0.3) as u8)
        .collect();
    let t = Tensor::from_vec(bits, shape, &dev()).expect("mask");
    if float {
        let neg = Tensor::full(f64::NEG_INFINITY, shape, &dev())
            .and_then(|x| x.to_dtype(dtype))
            .expect("neg");
        let vals = det(shape, dtype, salt);
        Mask::Float(t.where_cond(&neg, &vals).expect("where"))
    } else {
        Mask::Bool(t)
    }
}

fn run(d: &Draw) -> Result<(), TestCaseError> {
    let mdtype = if d.module_f64 { DType::F64 } else { DType::F32 };
    let idtype = if d.input_f64 != d.module_f64 { DType::F64 } else { mdtype };
    let mut cfg = MhaConfig::new(d.e, d.h)
        .with_bias(d.bias)
        .with_add_bias_kv(d.bias_kv)
        .with_add_zero_attn(d.zero_attn)
        .with_batch_first(d.batch_first);
    cfg.kdim = d.kdim;
    cfg.vdim = d.vdim;
    let vm = VarMap::new();
    let m = match MultiheadAttention::new(cfg.clone(), VarBuilder::from_varmap(&vm, mdtype, &dev()))
    {
        Ok(m) => m,
        Err(e) => {
            prop_assert!(!d.e.is_multiple_of(d.h), "valid config rejected: {e}");
            return Ok(());
        }
    };
    let mut m = m;
    m.train(d.training);
    let (e, n, l, s) = (d.e, d.n, d.l, d.s);
    let qf = e + d.q_feat_off;
    let shape = |len: usize, feat: usize| -> Vec<usize> {
        if d.unbatched {
            vec![len, feat]
        } else if d.batch_first {
            vec![n, len, feat]
        } else {
            vec![len, n, feat]
        }
    };
    let q = det(&shape(l, qf), idtype, 1.0);
    let (k, v) = if d.self_attn {
        (q.clone(), q.clone())
    } else {
        (det(&shape(s, cfg.kdim()), idtype, 2.0), det(&shape(d.s_value, cfg.vdim()), idtype, 3.0))
    };
    let s_eff = if d.self_attn { l } else { s };
    let nb = if d.unbatched { 1 } else { n };
    let mut opts = MhaOptions::default()
        .need_weights(d.need_weights)
        .average_attn_weights(d.average)
        .is_causal(d.is_causal);
    let lead = if d.unbatched { d.h } else { nb * d.h };
    opts.attn_mask = match d.attn_mask {
        1 => Some(mask_tensor(&[l, s_eff], d.mask_density, d.mask_float, mdtype, 0.5)),
        2 => Some(mask_tensor(&[lead, l, s_eff], d.mask_density, d.mask_float, mdtype, 0.7)),
        3 => Some(mask_tensor(&[1, l + 1, s_eff], d.mask_density, d.mask_float, mdtype, 0.9)),
        _ => None,
    };
    opts.key_padding_mask = match (d.kpm, d.unbatched) {
        (1, false) => Some(mask_tensor(&[nb, s_eff], d.mask_density, d.kpm_float, mdtype, 0.3)),
        (1, true) => Some(mask_tensor(&[s_eff], d.mask_density, d.kpm_float, mdtype, 0.3)),
        (2, _) => Some(mask_tensor(&[nb + 1, s_eff], d.mask_density, d.kpm_float, mdtype, 0.3)),
        _ => None,
    };
    match m.forward(&q, &k, &v, &opts) {
        Err(err) => {
            // A typed error with a message that names the operation.
            let msg = err.to_string();
            prop_assert!(
                !msg.is_empty() && msg.chars().next().is_some_and(|c| c.is_lowercase()),
                "{msg}"
            );
        }
        Ok(out) => {
            let expect_out = shape(l, e);
            prop_assert_eq!(out.output.dims(), expect_out.as_slice());
            let vals = out
                .output
                .to_dtype(DType::F64)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f64>())
                .expect("values");
            prop_assert!(vals.iter().all(|x| x.is_finite()), "non-finite output for {:?}", d);
            let s2 = s_eff + d.bias_kv as usize + d.zero_attn as usize;
            match (&out.attn_weights, d.need_weights) {
                (Some(w), true) => {
                    let expect: Vec<usize> = match (d.unbatched, d.average) {
                        (true, true) => vec![l, s2],
                        (true, false) => vec![d.h, l, s2],
                        (false, true) => vec![nb, l, s2],
                        (false, false) => vec![nb, d.h, l, s2],
                    };
                    prop_assert_eq!(w.dims(), expect.as_slice());
                    let wv = w
                        .to_dtype(DType::F64)
                        .and_then(|t| t.flatten_all())
                        .and_then(|t| t.to_vec1::<f64>())
                        .expect("w");
                    prop_assert!(wv.iter().all(|x| x.is_finite() && *x >= 0.0));
                }
                (None, false) => {}
                _ => prop_assert!(
                    false,
                    "weights returned {} but need_weights {}",
                    out.attn_weights.is_some(),
                    d.need_weights
                ),
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, failure_persistence: None, .. ProptestConfig::default() })]
    #[test]
    fn typed_error_or_finite_result_of_the_right_shape(d in draw()) {
        run(&d)?;
    }
}
