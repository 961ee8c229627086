//! SDPA's variants against committed golden cases (`tools/variant_cases.py`): PyTorch's
//! numbers (`causal_lower_right`, windows and key lengths as explicit masks, a hand-written
//! soft cap, BLOOM's and FlashAttention's ALiBi, gpt-oss's sinks, a learned bias; outputs and
//! gradients) and ONNX `Attention`'s node test cases (outputs of its
//! reference), on the fused and the composed path.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use multihead::functional::{explain_sdpa, scaled_dot_product_attention, SdpaOptions};
use multihead::{Backend, CausalAlign, Mask, Path, Variants};
use multihead_parity::Tolerance;
use serde_json::Value;

use crate::common::{assert_close, var};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/variants")
}

/// The options a case's JSON describes, with its mask tensor.
fn options(c: &Value, tensors: &std::collections::HashMap<String, Tensor>) -> SdpaOptions {
    let name = c["name"].as_str().expect("name");
    let usize_of = |k: &str| c.get(k).and_then(Value::as_u64).map(|x| x as usize);
    let mut v = Variants::default().window(usize_of("window_left"), usize_of("window_right"));
    v.align = match &c["align"] {
        Value::String(s) if s == "bottom_right" => CausalAlign::BottomRight,
        Value::Object(o) => CausalAlign::Offset(o["offset"].as_i64().expect("offset") as isize),
        Value::Null => CausalAlign::TopLeft,
        other => panic!("{name}: align {other}"),
    };
    if let Some(lens) = c.get("kv_lengths").and_then(Value::as_array) {
        v.kv_lengths = Some(lens.iter().map(|x| x.as_u64().expect("length") as usize).collect());
    }
    v.softcap = c.get("softcap").and_then(Value::as_f64);
    v.softcap_after_masks = c["softcap_after_masks"].as_bool().unwrap_or(false);
    if let Some(m) = c.get("alibi_slopes").and_then(Value::as_array) {
        v.alibi_slopes = Some(m.iter().map(|x| x.as_f64().expect("slope")).collect());
    }
    let mut o = SdpaOptions::default()
        .variants(v)
        .is_causal(c["is_causal"].as_bool().unwrap_or(false))
        .enable_gqa(c["enable_gqa"].as_bool().unwrap_or(false));
    if let Some(s) = c.get("scale").and_then(Value::as_f64) {
        o = o.scale(s);
    }
    let mask = tensors.get(&format!("{name}.mask"));
    match (c["mask"].as_str(), mask) {
        (Some("float"), Some(m)) => o.attn_mask(Mask::Float(m.clone())),
        (Some("bool"), Some(m)) => o.attn_mask(Mask::Bool(m.to_dtype(DType::U8).expect("u8"))),
        (None, None) => o,
        other => panic!("{name}: mask {other:?}"),
    }
}

#[test]
fn every_variant_golden_case_matches_pytorch_and_onnx() {
    let root = fixtures();
    let text = std::fs::read_to_string(root.join("cases.json")).expect("cases.json");
    let cases: Vec<Value> = serde_json::from_str(&text).expect("cases.json parses");
    let tensors = candle_core::safetensors::load(root.join("tensors.safetensors"), &Device::Cpu)
        .expect("tensors.safetensors");
    let (mut pytorch, mut onnx, mut bias) = (0, 0, 0);
    for c in &cases {
        let name = c["name"].as_str().expect("name");
        let t = |k: &str| tensors.get(&format!("{name}.{k}")).expect(k).clone();
        let opts = options(c, &tensors);
        let (q, k, v) = (t("q"), t("k"), t("v"));
        let plan = explain_sdpa(&q, &k, &v, &opts).expect("plan");
        assert_eq!(plan.path, Path::Fused, "{name}: {plan:?}");
        for backend in [Backend::Auto, Backend::Composed] {
            let what = format!("{name} ({backend:?})");
            let (qv, kv, vv) = (var(&q), var(&k), var(&v));
            let sinks = (c["sinks"].as_bool() == Some(true)).then(|| var(&t("sinks")));
            let learned = (c["mask_grad"].as_bool() == Some(true)).then(|| var(&t("mask")));
            let mut o = opts.clone().backend(backend);
            if let Some(m) = &learned {
                o = o.attn_mask(Mask::Float(m.as_tensor().clone()));
            }
            if let Some(s) = &sinks {
                o = o.sinks(s.as_tensor().clone());
            }
            let out =
                scaled_dot_product_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &o)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&out, &t("out"), Tolerance::F32_FORWARD, &format!("{what}: out"));
            if c["grads"].as_bool() == Some(true) {
                let grads = out.mul(&t("g")).unwrap().sum_all().unwrap().backward().unwrap();
                for (x, g) in [(&qv, "dq"), (&kv, "dk"), (&vv, "dv")] {
                    let got = grads.get(x.as_tensor()).expect("grad");
                    assert_close(got, &t(g), Tolerance::F32_GRAD, &format!("{what}: {g}"));
                }
                if let Some(m) = &learned {
                    let got = grads.get(m.as_tensor()).expect("mask grad");
                    assert_close(got, &t("dmask"), Tolerance::F32_GRAD, &format!("{what}: dmask"));
                    bias += 1;
                }
                if let Some(s) = &sinks {
                    let got = grads.get(s.as_tensor()).expect("sinks grad");
                    assert_close(
                        got,
                        &t("dsinks"),
                        Tolerance::F32_GRAD,
                        &format!("{what}: dsinks"),
                    );
                    bias += 1;
                }
            }
        }
        match c["source"].as_str() {
            Some("pytorch") => {
                pytorch += 1;
                bias += usize::from(c.get("alibi_slopes").is_some());
            }
            Some("onnx") => onnx += 1,
            other => panic!("{name}: source {other:?}"),
        }
    }
    // Every committed case ran (a fixture that lost its cases would pass vacuously).
    assert!(pytorch >= 16 && onnx >= 60, "{pytorch} PyTorch and {onnx} ONNX cases");
    // 3 ALiBi cases; 2 sink and 2 learned-bias cases on two backends.
    assert!(bias >= 11, "{bias} ALiBi cases, sink and bias gradients");
    let softcaps = cases.iter().filter(|c| c["source"] == "onnx" && c.get("softcap").is_some());
    assert!(softcaps.count() >= 6, "the ONNX soft-cap cases");
}
