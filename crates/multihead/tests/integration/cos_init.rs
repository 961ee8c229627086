//! PyTorch's own cos-initialised golden tests for the Transformer layers (test_nn.py,
//! test_transformers.py and the C++ frontend's transformer.cpp), ported as plain tests.
//! `tools/cos_init_golden.py` wrote the entries and checked them against the numbers in
//! PyTorch's tests.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use multihead_parity::{self as parity, Case, Tolerance};
use serde_json::{json, Value};

/// A nested JSON list as (shape, flat values).
fn flatten(v: &Value, shape: &mut Vec<usize>, depth: usize, out: &mut Vec<f64>) {
    match v {
        Value::Array(items) => {
            if shape.len() <= depth {
                shape.push(items.len());
            }
            for it in items {
                flatten(it, shape, depth + 1, out);
            }
        }
        other => out.push(other.as_f64().expect("a number")),
    }
}

fn tensor(v: &Value, dtype: DType) -> Tensor {
    let (mut shape, mut data) = (Vec::new(), Vec::new());
    flatten(v, &mut shape, 0, &mut data);
    Tensor::from_vec(data, shape, &Device::Cpu).and_then(|t| t.to_dtype(dtype)).expect("tensor")
}

#[test]
fn pytorch_cos_initialised_golden_values() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cos_init/golden.json");
    let entries: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).expect("golden.json")).expect("json");
    assert!(entries.len() >= 20);
    let mut checked = 0;
    for e in &entries {
        let name = e["name"].as_str().expect("name");
        let dtype = if e["dtype"] == "float64" { DType::F64 } else { DType::F32 };
        let mut tensors = HashMap::new();
        for (k, v) in e["params"].as_object().expect("params") {
            tensors.insert(format!("param.{k}"), tensor(v, dtype));
        }
        let mut call = serde_json::Map::new();
        for (k, v) in e["inputs"].as_object().expect("inputs") {
            if k.ends_with("_kind") {
                continue;
            }
            let kind = e["inputs"].get(format!("{k}_kind")).and_then(Value::as_str);
            let t = match kind {
                Some("bool") => tensor(v, DType::U8),
                _ => tensor(v, dtype),
            };
            if let Some(kind) = kind {
                call.insert(k.clone(), json!(kind));
            }
            tensors.insert(format!("input.{k}"), t);
        }
        let meta = json!({
            "format_version": 1,
            "module": e["module"],
            "constructor": e["constructor"],
            "training": e["training"],
            "grad_mode": false,
            "call": call,
        });
        let case = Case::from_parts(name, meta, tensors).expect("case");
        let out =
            parity::replay(&case).unwrap_or_else(|err| panic!("{name}: {err}"))["output"].clone();
        let expected = tensor(&e["output"], dtype);
        // Our tolerance, and the one PyTorch's test uses against its printed reference.
        let ours = Tolerance::for_dtype(dtype, false).compare(&out, &expected).expect("compare");
        assert!(ours.passed(), "{name}: max|diff| {:.3e}", ours.max_abs);
        let tt = &e["test_tolerance"];
        let theirs = Tolerance {
            rel: tt["rtol"].as_f64().unwrap_or(1e-7),
            abs: tt["atol"].as_f64().unwrap_or(1e-5),
        };
        let reference = tensor(&e["test_reference"], dtype);
        assert!(
            theirs.compare(&out, &reference).expect("compare").passed(),
            "{name} vs PyTorch's test reference"
        );
        checked += 1;
    }
    assert_eq!(checked, entries.len());
}

#[test]
fn cpp_frontend_encoder_layer_numbers() {
    // transformer.cpp: the encoder layer on [[20, 30, 40, 50]] gives these four numbers.
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cos_init/golden.json");
    let entries: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).expect("golden.json")).expect("json");
    let e = entries.iter().find(|e| e["name"] == "enc_layer_single_token_f32").expect("entry");
    let mut tensors = HashMap::new();
    for (k, v) in e["params"].as_object().expect("params") {
        tensors.insert(format!("param.{k}"), tensor(v, DType::F32));
    }
    tensors.insert(
        "input.src".into(),
        Tensor::new(&[[[20f32, 30., 40., 50.]]], &Device::Cpu).expect("src"),
    );
    let meta = json!({"format_version": 1, "module": e["module"], "constructor": e["constructor"], "training": false, "grad_mode": false, "call": {}});
    let out = parity::replay(&Case::from_parts("cpp", meta, tensors).expect("case"))
        .expect("replay")["output"]
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("values");
    for (got, want) in out.iter().zip([2.258703f32, 0.127985, -0.697881, 0.170862]) {
        assert!((got - want).abs() <= 1e-5, "{got} vs {want}");
    }
}
