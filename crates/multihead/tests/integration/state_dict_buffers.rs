//! Loading what is not a float parameter: integer buffers keep their own dtype (PyTorch copies
//! a state_dict entry into each buffer's dtype: an int64 `position_ids` stays exact), integer
//! builders are refused where PyTorch refuses integer parameters, and the errors of a builder
//! that holds a key already, or of a load under a prefix, say what to do.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use candle_nn::Init;
use multihead::state_dict::{load_strict, save_loaded, NamedParameters};
use multihead::{Embedding, LayerNorm, Linear};

use crate::common::{det, dev};

/// A port with an int64 buffer and a u8 mask next to a float layer (a BERT-style module).
struct WithBuffers {
    position_ids: Tensor,
    mask: Tensor,
    head: Linear,
}

impl NamedParameters for WithBuffers {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![
            ("position_ids".to_string(), self.position_ids.clone()),
            ("mask".to_string(), self.mask.clone()),
        ];
        v.extend(multihead::state_dict::prefixed("head", &self.head));
        v
    }
}

fn build(vb: candle_nn::VarBuilder) -> multihead::Result<WithBuffers> {
    let ids = vb.get_with_hints_dtype((1, 4), "position_ids", Init::Const(0.0), DType::I64)?;
    let mask = vb.get_with_hints_dtype(4, "mask", Init::Const(0.0), DType::U8)?;
    Ok(WithBuffers { position_ids: ids, mask, head: Linear::new(4, 3, true, vb.pp("head"))? })
}

#[test]
fn integer_buffers_load_exactly_in_their_own_dtype_and_save_so() {
    // 2^24 + 1 is not an f32 (nor anything above 256 a bf16): a cast through the load's float
    // dtype would change it.
    let ids = Tensor::new(&[[0i64, 1, 16_777_217, 9_007_199_254_740_993]], &dev()).unwrap();
    let mask = Tensor::new(&[0u8, 1, 1, 0], &dev()).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let mut state: HashMap<String, Tensor> = HashMap::new();
        state.insert("position_ids".into(), ids.clone());
        state.insert("mask".into(), mask.clone());
        state.insert("head.weight".into(), det(&[3, 4], DType::F32, 1.0));
        state.insert("head.bias".into(), det(&[3], DType::F32, 2.0));
        let (m, vars) = load_strict(&state, dtype, &dev(), build).unwrap();
        assert_eq!(m.position_ids.dtype(), DType::I64, "{dtype:?}");
        assert_eq!(m.position_ids.to_vec2::<i64>().unwrap(), ids.to_vec2::<i64>().unwrap());
        assert_eq!(m.mask.dtype(), DType::U8);
        assert_eq!(m.mask.to_vec1::<u8>().unwrap(), [0, 1, 1, 0]);
        // The float parameters take the load's dtype, as before.
        assert_eq!(m.head.weight().dtype(), dtype);
        // The VarMap holds the buffers in their dtype too, and so does a saved file.
        let held = vars.data().lock().unwrap()["position_ids"].as_tensor().dtype();
        assert_eq!(held, DType::I64);
        let path = std::env::temp_dir()
            .join(format!("multihead_buffers_{}_{dtype:?}.safetensors", std::process::id()));
        save_loaded(&m, &vars, &path).unwrap();
        let back = multihead::state_dict::load_safetensors(&path, &dev()).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(back["position_ids"].dtype(), DType::I64);
        assert_eq!(back["position_ids"].to_vec2::<i64>().unwrap(), ids.to_vec2::<i64>().unwrap());
        assert_eq!(back["mask"].to_vec1::<u8>().unwrap(), [0, 1, 1, 0]);
    }
    // A float parameter from an integer file is converted into the parameter's dtype, as
    // PyTorch's copy_ converts it, and the VarMap holds that converted parameter.
    let mut state: HashMap<String, Tensor> = HashMap::new();
    state.insert("position_ids".into(), ids.clone());
    state.insert("mask".into(), mask.clone());
    state.insert("head.weight".into(), Tensor::new(&[[1i64, -2, 3, 4]; 3], &dev()).unwrap());
    state.insert("head.bias".into(), Tensor::new(&[5i64, 6, 7], &dev()).unwrap());
    let (m, vars) = load_strict(&state, DType::F32, &dev(), build).unwrap();
    assert_eq!(m.head.weight().to_vec2::<f32>().unwrap(), vec![vec![1.0, -2.0, 3.0, 4.0]; 3]);
    let held = vars.data().lock().unwrap()["head.bias"].as_tensor().clone();
    assert_eq!(held.dtype(), DType::F32);
    assert_eq!(held.to_vec1::<f32>().unwrap(), [5.0, 6.0, 7.0]);
}

#[test]
fn float_modules_refuse_an_integer_builder_as_pytorch_refuses_integer_parameters() {
    for dtype in [DType::U8, DType::U32, DType::I64] {
        let vm = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, dtype, &dev());
        let errs = [
            Linear::new(4, 3, true, vb.pp("l")).err().map(|e| e.to_string()),
            LayerNorm::new(4, 1e-5, true, vb.pp("n")).err().map(|e| e.to_string()),
            Embedding::new(5, 4, vb.pp("e")).err().map(|e| e.to_string()),
        ];
        for (what, e) in ["Linear", "LayerNorm", "Embedding"].iter().zip(errs) {
            let e = e.unwrap_or_else(|| panic!("{what} built with {dtype:?}"));
            assert!(e.starts_with(&format!("{what}: dtype: expected a float")), "{e}");
        }
    }
}

#[test]
fn a_builder_holding_a_key_of_another_shape_names_both_shapes() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    Linear::new(4, 3, true, vb.clone()).unwrap();
    // The same prefix, other sizes: candle's VarMap refuses; the error names what it holds.
    let e = Linear::new(4, 7, true, vb).map(|_| ()).expect_err("shape mismatch").to_string();
    assert!(e.contains("weight: expected shape [7, 4], got [3, 4]"), "{e}");
    assert!(e.contains("build the module with the sizes"), "{e}");
}

#[test]
fn saving_a_module_loaded_under_a_prefix_says_how() {
    let mut state: HashMap<String, Tensor> = HashMap::new();
    state.insert("model.lin.weight".into(), det(&[3, 4], DType::F32, 1.0));
    state.insert("model.lin.bias".into(), det(&[3], DType::F32, 2.0));
    let build = |vb: candle_nn::VarBuilder| Linear::new(4, 3, true, vb.pp("model.lin"));
    let (lin, vars) = load_strict(&state, DType::F32, &dev(), build).unwrap();
    let path = std::env::temp_dir()
        .join(format!("multihead_prefix_save_{}.safetensors", std::process::id()));
    let e = save_loaded(&lin, &vars, &path).expect_err("prefixed keys").to_string();
    assert!(e.contains("built under vb.pp(\"model.lin\")"), "{e}");
    assert!(e.contains("save_state_dict") && e.contains("prefixed(\"model.lin\""), "{e}");
    assert!(!path.exists());
    // Missing keys without a prefix to explain them say what to do too.
    let mut state: HashMap<String, Tensor> = HashMap::new();
    state.insert("weight".into(), det(&[3, 4], DType::F32, 1.0));
    let e = load_strict(&state, DType::F32, &dev(), |vb| Linear::new(4, 3, true, vb))
        .err()
        .expect("missing bias")
        .to_string();
    assert!(e.contains("missing keys [\"bias\"]") && e.contains("load non-strictly"), "{e}");
}

#[test]
fn a_parameter_too_large_to_hold_is_named_by_its_key() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let e = Linear::new(usize::MAX / 2, 3, true, vb.pp("proj")).map(|_| ()).expect_err("too large");
    let msg = e.to_string();
    assert!(matches!(e, multihead::Error::Alloc { .. }), "{msg}");
    assert!(msg.contains("proj.weight: ") && msg.contains("check the module's sizes"), "{msg}");
}

/// Each entry is converted once, from the file's values, into the dtype its module asks for:
/// an f32 entry asked for as f32 in a bf16 load keeps its bits, an int64 buffer stored as
/// float values gets them exactly (PyTorch's `copy_`), and a key asked for in two dtypes is an
/// error rather than two parameters of which the VarMap would hold one.
#[test]
fn each_entry_is_converted_from_the_files_values_into_the_asked_dtype() {
    let mut state: HashMap<String, Tensor> = HashMap::new();
    state.insert("w32".into(), Tensor::new(&[1.000_976_6f32, 1.234_567], &dev()).unwrap());
    state.insert("ids".into(), Tensor::new(&[301f32, 513.0], &dev()).unwrap());
    struct Two {
        w32: Tensor,
        ids: Tensor,
    }
    impl NamedParameters for Two {
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            vec![("w32".into(), self.w32.clone()), ("ids".into(), self.ids.clone())]
        }
    }
    let build = |vb: candle_nn::VarBuilder| -> multihead::Result<Two> {
        Ok(Two {
            w32: vb.get_with_hints_dtype(2, "w32", Init::Const(0.0), DType::F32)?,
            ids: vb.get_with_hints_dtype(2, "ids", Init::Const(0.0), DType::I64)?,
        })
    };
    let (m, vars) = load_strict(&state, DType::BF16, &dev(), build).unwrap();
    assert_eq!(m.w32.to_vec1::<f32>().unwrap(), [1.000_976_6, 1.234_567]);
    assert_eq!(m.ids.to_vec1::<i64>().unwrap(), [301, 513]);
    // The module's tensors are the VarMap's variables (an optimiser trains what it reads).
    let held = vars.data().lock().unwrap()["w32"].as_tensor().clone();
    assert_eq!(held.id(), m.w32.id());
    let twice = |vb: candle_nn::VarBuilder| -> multihead::Result<Two> {
        let a = vb.get_with_hints_dtype(2, "w32", Init::Const(0.0), DType::F32)?;
        let b = vb.get_with_hints_dtype(2, "w32", Init::Const(0.0), DType::BF16)?;
        Ok(Two { w32: a, ids: b })
    };
    let mut one: HashMap<String, Tensor> = HashMap::new();
    one.insert("w32".into(), state["w32"].clone());
    let e = load_strict(&one, DType::F32, &dev(), twice).map(|_| ()).expect_err("two dtypes");
    let e = e.to_string();
    assert!(e.contains("w32 is asked for as F32 and as BF16"), "{e}");
}
