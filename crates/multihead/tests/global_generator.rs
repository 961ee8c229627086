//! The global dropout generator (`multihead::manual_seed`, PyTorch's `torch.manual_seed`): its
//! own test binary, so that no other test draws keys from the process-wide generator between a
//! seed and the calls it should reproduce. In the shared integration binary tests running on
//! other threads can (seeded layer tests there failed about one run in four, until the layers
//! keyed their own dropouts from a call's key).

#![allow(clippy::unwrap_used)]

#[path = "integration/common.rs"]
mod common;

use candle_core::DType::F64;
use multihead::random::DropoutKey;
use multihead::{MhaConfig, MhaOptions};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, mha};

#[test]
fn dropout_is_seeded_counted_and_off_in_eval() {
    let (mut m, _vm) = mha(MhaConfig::new(8, 2).with_dropout(0.5), F64);
    let x = det(&[16, 2, 8], F64, 1.0);
    let opts = MhaOptions::default().average_attn_weights(false);
    multihead::manual_seed(3);
    let a = m.forward(&x, &x, &x, &opts).unwrap();
    let b = m.forward(&x, &x, &x, &opts).unwrap();
    multihead::manual_seed(3);
    let a2 = m.forward(&x, &x, &x, &opts).unwrap();
    assert_close(&a2.output, &a.output, Tolerance { rel: 0.0, abs: 0.0 }, "same seed");
    let diff = a
        .output
        .sub(&b.output)
        .unwrap()
        .abs()
        .unwrap()
        .max_keepdim(0)
        .unwrap()
        .max_keepdim(1)
        .unwrap();
    assert!(
        diff.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap() > 1e-3,
        "next call draws a new mask"
    );
    // About half the weights are zeroed; survivors are scaled by 2, so rows sum to ~1 on average.
    let w = a.attn_weights.unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let zeros = w.iter().filter(|x| **x == 0.0).count() as f64 / w.len() as f64;
    assert!((zeros - 0.5).abs() < 0.06, "dropped fraction {zeros}");
    // need_weights=False with the same key gives the same output.
    let key = DropoutKey { seed: 9, offset: 1 };
    let with_w = m.forward(&x, &x, &x, &opts.clone().dropout_key(key)).unwrap();
    let without =
        m.forward(&x, &x, &x, &opts.clone().dropout_key(key).need_weights(false)).unwrap();
    assert_close(&without.output, &with_w.output, Tolerance::F64, "same key, both branches");
    // Eval mode: no dropout, weights rows sum to one.
    m.eval();
    let e1 = m.forward(&x, &x, &x, &opts).unwrap();
    let e2 = m.forward(&x, &x, &x, &opts).unwrap();
    assert_close(&e1.output, &e2.output, Tolerance { rel: 0.0, abs: 0.0 }, "eval");
    let sums = e1.attn_weights.unwrap().sum(3).unwrap();
    assert_close(&sums, &sums.ones_like().unwrap(), Tolerance::F64, "rows sum to 1");
}
