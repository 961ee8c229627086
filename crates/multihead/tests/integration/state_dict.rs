//! state_dict keys, order, strict loading and safetensors round trips.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use multihead::state_dict::{load_safetensors, load_strict, load_strict_file, save_state_dict};
use multihead::{Error, MhaConfig, MhaOptions, MultiheadAttention, NamedParameters};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, dev, mha};

fn keys(m: &MultiheadAttention) -> Vec<String> {
    m.named_parameters().into_iter().map(|(k, _)| k).collect()
}

#[test]
fn keys_and_order_are_pytorchs() {
    let (m, _) = mha(MhaConfig::new(8, 2), DType::F32);
    assert_eq!(keys(&m), ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]);
    // Spec §1.2's example.
    let (m, _) = mha(
        MhaConfig::new(8, 2).with_bias(false).with_add_bias_kv(true).with_kdim(3).with_vdim(5),
        DType::F32,
    );
    assert_eq!(
        keys(&m),
        ["q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k", "bias_v", "out_proj.weight"]
    );
    let shapes: Vec<Vec<usize>> =
        m.named_parameters().iter().map(|(_, t)| t.dims().to_vec()).collect();
    assert_eq!(
        shapes,
        [vec![8, 8], vec![8, 3], vec![8, 5], vec![1, 1, 8], vec![1, 1, 8], vec![8, 8]]
    );
    // kdim == vdim == E passed explicitly stays packed.
    let (m, _) = mha(MhaConfig::new(8, 2).with_kdim(8).with_vdim(8), DType::F32);
    assert_eq!(keys(&m)[0], "in_proj_weight");
}

#[test]
fn fresh_parameters_follow_pytorch_init() {
    let vm = candle_nn::VarMap::new();
    let e = 64;
    let m = MultiheadAttention::new(
        MhaConfig::new(e, 4).with_add_bias_kv(true),
        candle_nn::VarBuilder::from_varmap(&vm, DType::F64, &dev()),
    )
    .unwrap();
    let p: HashMap<String, Tensor> = m.named_parameters().into_iter().collect();
    let max_abs = |k: &str| {
        p[k].abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    };
    let xavier = (6.0 / (4.0 * e as f64)).sqrt();
    assert!(max_abs("in_proj_weight") <= xavier && max_abs("in_proj_weight") > 0.8 * xavier);
    let out_bound = 1.0 / (e as f64).sqrt();
    assert!(
        max_abs("out_proj.weight") <= out_bound && max_abs("out_proj.weight") > 0.8 * out_bound
    );
    assert_eq!(max_abs("in_proj_bias"), 0.0);
    assert_eq!(max_abs("out_proj.bias"), 0.0);
    let bk = p["bias_k"].flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let std = (bk.iter().map(|x| x * x).sum::<f64>() / bk.len() as f64).sqrt();
    assert!((std - out_bound).abs() < 0.5 * out_bound, "bias_k std {std}");
}

#[test]
fn safetensors_round_trip_gives_the_same_module() {
    let cfg = MhaConfig::new(6, 3).with_kdim(4).with_vdim(5).with_add_bias_kv(true);
    let (m, _) = mha(cfg.clone(), DType::F64);
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let path = dir.join("mha.safetensors");
    save_state_dict(&m, &path).unwrap();
    let loaded = load_safetensors(&path, &dev()).unwrap();
    assert_eq!(loaded.len(), 8);
    let (m2, vm) =
        load_strict_file(&path, DType::F64, &dev(), |vb| MultiheadAttention::new(cfg, vb)).unwrap();
    assert_eq!(vm.all_vars().len(), 8);
    let q = det(&[3, 2, 6], DType::F64, 1.0);
    let k = det(&[4, 2, 4], DType::F64, 2.0);
    let v = det(&[4, 2, 5], DType::F64, 3.0);
    let a = m.forward(&q, &k, &v, &MhaOptions::default()).unwrap();
    let b = m2.forward(&q, &k, &v, &MhaOptions::default()).unwrap();
    assert_close(&b.output, &a.output, Tolerance { rel: 0.0, abs: 0.0 }, "round trip");
}

#[test]
fn strict_loading_names_missing_and_unexpected_keys_and_bad_shapes() {
    let (m, _) = mha(MhaConfig::new(8, 2), DType::F32);
    let mut state: HashMap<String, Tensor> = m.named_parameters().into_iter().collect();
    state.remove("in_proj_bias");
    state.insert("bias_k".into(), Tensor::zeros((1, 1, 8), DType::F32, &dev()).unwrap());
    let err = load_strict(&state, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(8, 2), vb)
    })
    .map(|(m, _)| m)
    .expect_err("strict");
    match &err {
        Error::StateDictKeys { missing, unexpected, .. } => {
            assert_eq!(missing, &["in_proj_bias"]);
            assert_eq!(unexpected, &["bias_k"]);
        }
        other => panic!("wrong error {other:?}"),
    }
    assert!(err.to_string().contains("missing keys [\"in_proj_bias\"]"));

    let mut state: HashMap<String, Tensor> = m.named_parameters().into_iter().collect();
    state.insert("in_proj_weight".into(), Tensor::zeros((24, 6), DType::F32, &dev()).unwrap());
    let err = load_strict(&state, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(8, 2), vb)
    })
    .map(|(m, _)| m)
    .expect_err("shape");
    let msg = err.to_string();
    assert!(matches!(err, Error::StateDictShape { .. }), "{msg}");
    assert!(
        msg.contains("in_proj_weight") && msg.contains("[24, 8]") && msg.contains("[24, 6]"),
        "{msg}"
    );
}

fn build(vb: candle_nn::VarBuilder) -> multihead::Result<MultiheadAttention> {
    MultiheadAttention::new(MhaConfig::new(8, 2), vb)
}

#[test]
fn every_problem_of_a_state_dict_is_reported_at_once() {
    let (m, _) = mha(MhaConfig::new(8, 2), DType::F32);
    // Two wrong shapes, a missing key and an unexpected one: all four named, as PyTorch does.
    let mut state: HashMap<String, Tensor> = m.named_parameters().into_iter().collect();
    state.insert("in_proj_weight".into(), Tensor::zeros((24, 6), DType::F32, &dev()).unwrap());
    state.insert("out_proj.weight".into(), Tensor::zeros((8, 7), DType::F32, &dev()).unwrap());
    state.remove("in_proj_bias");
    state.insert("extra".into(), Tensor::zeros(2, DType::F32, &dev()).unwrap());
    let err = load_strict(&state, DType::F32, &dev(), build).map(|(m, _)| m).expect_err("bad");
    let msg = err.to_string();
    match &err {
        Error::StateDictMismatch { missing, unexpected, mismatched, .. } => {
            assert_eq!(missing, &["in_proj_bias"]);
            assert_eq!(unexpected, &["extra"]);
            let keys: Vec<&str> = mismatched.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(keys, ["in_proj_weight", "out_proj.weight"]);
        }
        other => panic!("wrong error {other:?}"),
    }
    assert!(msg.contains("[24, 6]") && msg.contains("[8, 7]") && msg.contains("extra"), "{msg}");
    // strict=False still refuses wrong shapes, and names both.
    let err = multihead::state_dict::load(&state, DType::F32, &dev(), build)
        .map(|(m, _, _)| m)
        .expect_err("shapes");
    assert!(
        matches!(&err, Error::StateDictMismatch { mismatched, missing, .. }
            if mismatched.len() == 2 && missing.is_empty()),
        "{err}"
    );
}

#[test]
fn entries_in_dtypes_candle_lacks_are_unexpected_keys_unless_the_module_asks_for_them() {
    // A file with an int32 step counter beside the module's weights (candle has no i32).
    let (m, _) = mha(MhaConfig::new(8, 2), DType::F32);
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let path = dir.join("with_i32.safetensors");
    let mut views: Vec<(String, Vec<u8>, Vec<usize>, safetensors::Dtype)> = m
        .named_parameters()
        .into_iter()
        .map(|(k, t)| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (k, bytes, t.dims().to_vec(), safetensors::Dtype::F32)
        })
        .collect();
    views.push(("step".into(), 7i32.to_le_bytes().to_vec(), vec![1], safetensors::Dtype::I32));
    let tensors: Vec<(String, safetensors::tensor::TensorView)> = views
        .iter()
        .map(|(k, b, s, d)| {
            (k.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(tensors, None, &path).unwrap();

    // Reading every tensor still refuses it, naming it.
    let err = load_safetensors(&path, &dev()).expect_err("i32");
    assert!(err.to_string().contains("step") && err.to_string().contains("I32"), "{err}");
    // strict=False: loaded, the entry reported as unexpected (PyTorch's behaviour).
    let (loaded, _, report) =
        multihead::state_dict::load_file(&path, DType::F32, &dev(), build).expect("non-strict");
    assert_eq!(report.unexpected_keys, ["step"]);
    assert!(report.missing_keys.is_empty());
    let out = |m: &MultiheadAttention| {
        let x = det(&[3, 2, 8], DType::F32, 1.0);
        m.forward(&x, &x, &x, &MhaOptions::default()).unwrap().output
    };
    assert_close(&out(&loaded), &out(&m), Tolerance { rel: 0.0, abs: 0.0 }, "loaded");
    // Strict: an unexpected key.
    let err = load_strict_file(&path, DType::F32, &dev(), build).map(|(m, _)| m).expect_err("s");
    assert!(
        matches!(&err, Error::StateDictKeys { unexpected, missing, .. }
            if unexpected == &["step"] && missing.is_empty()),
        "{err}"
    );
    // The message lists only what is wrong, as PyTorch's does (not "missing keys []").
    assert!(
        err.to_string().starts_with("load_state_dict: unexpected keys [\"step\"]")
            && !err.to_string().contains("missing"),
        "{err}"
    );
    // A module that asks for that key gets an error naming the key and its dtype.
    let err = load_strict_file(&path, DType::F32, &dev(), |vb| {
        vb.get(1, "step")?;
        build(vb)
    })
    .map(|(m, _)| m)
    .expect_err("asked");
    assert!(err.to_string().contains("step: dtype I32 cannot be read"), "{err}");
}

#[test]
fn a_prefix_mismatch_is_named_and_non_strict_loading_reports_the_keys() {
    use multihead::state_dict::{load, prefixed};
    let (m, _) = mha(MhaConfig::new(8, 2), DType::F32);
    // A checkpoint saved from a parent module: every key starts with "model.".
    let state: HashMap<String, Tensor> = prefixed("model.attn", &m).into_iter().collect();
    let err = load_strict(&state, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(8, 2), vb)
    })
    .map(|(m, _)| m)
    .expect_err("prefix");
    let msg = err.to_string();
    assert!(msg.contains("\"model.attn.\"") && msg.contains("vb.pp(\"model.attn\")"), "{msg}");
    // Built under the prefix, the same state loads.
    let (sub, _) = load_strict(&state, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(8, 2), vb.pp("model").pp("attn"))
    })
    .expect("loads under the prefix");
    assert_eq!(sub.named_parameters().len(), 4);

    // A parent's state_dict (the module under "encoder." beside other keys): the hint names
    // the prefix and the non-strict load under it.
    let mut parent: HashMap<String, Tensor> = prefixed("encoder", &m).into_iter().collect();
    parent.extend(prefixed("decoder", &m));
    let err = load_strict(&parent, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(8, 2), vb)
    })
    .map(|(m, _)| m)
    .expect_err("parent");
    let msg = err.to_string();
    assert!(msg.contains("under \"decoder.\" and \"encoder.\""), "{msg}");
    assert!(msg.contains("vb.pp(\"decoder\")") && msg.contains("state_dict::load"), "{msg}");
    let (_, _, report) = load(&parent, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(8, 2), vb.pp("encoder"))
    })
    .expect("non-strict under the prefix");
    assert!(report.missing_keys.is_empty() && report.unexpected_keys.len() == 4);

    // strict=False: missing keys keep their initialisation, unexpected ones are reported.
    let mut state: HashMap<String, Tensor> = m.named_parameters().into_iter().collect();
    let kept = state.remove("out_proj.bias").expect("key");
    state.insert("extra.weight".into(), kept.clone());
    let (loaded, _vars, report) =
        load(&state, DType::F32, &dev(), |vb| MultiheadAttention::new(MhaConfig::new(8, 2), vb))
            .expect("non-strict");
    assert_eq!(report.missing_keys, ["out_proj.bias"]);
    assert_eq!(report.unexpected_keys, ["extra.weight"]);
    let w = loaded.named_parameters().into_iter().find(|(k, _)| k == "in_proj_weight").unwrap().1;
    let want = m.named_parameters().into_iter().find(|(k, _)| k == "in_proj_weight").unwrap().1;
    assert_close(&w, &want, Tolerance { rel: 0.0, abs: 0.0 }, "loaded weight");
}

#[test]
fn embedding_loads_by_its_pytorch_key_and_rejects_bad_indices() {
    use multihead::Embedding;
    let mut state = HashMap::new();
    let table = det(&[5, 3], DType::F32, 1.0);
    state.insert("weight".to_string(), table.clone());
    let (emb, _) = load_strict(&state, DType::F32, &dev(), |vb| Embedding::new(5, 3, vb)).unwrap();
    let ids = Tensor::new(&[[4u32, 0], [2, 2]], &dev()).unwrap();
    let out = emb.forward(&ids).unwrap();
    assert_eq!(out.dims(), &[2, 2, 3]);
    assert_close(
        &out.get(0).unwrap().get(0).unwrap(),
        &table.get(4).unwrap(),
        Tolerance { rel: 0.0, abs: 0.0 },
        "row 4",
    );
    for bad in [Tensor::new(&[5u32], &dev()).unwrap(), Tensor::new(&[-1i64], &dev()).unwrap()] {
        let e = emb.forward(&bad).expect_err("out of range");
        assert!(e.to_string().contains("out of range for an embedding of 5 rows"), "{e}");
    }
    let e = emb.forward(&Tensor::new(&[1f32], &dev()).unwrap()).expect_err("float ids");
    assert!(matches!(e, Error::DType { .. }), "{e:?}");
}

/// Saving follows a symbolic link (the file it names is replaced, the link kept), keeps a
/// replaced file's permissions, gives a new file `rw-r--r--`, and refuses what is not a
/// regular file or a name given twice. It used to rename its temporary file over the path itself: a link became a
/// copy and a device node (`/dev/full`) was replaced by a file.
#[cfg(unix)]
#[test]
fn save_follows_links_keeps_modes_and_refuses_non_files() {
    use multihead::state_dict::save_safetensors;
    use std::os::unix::fs::{symlink, PermissionsExt};
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let t = Tensor::arange(0f32, 6.0, &dev()).unwrap();
    let save = |p: &std::path::Path| save_safetensors([("t", &t)], p);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;

    let new = dir.join("new.safetensors");
    save(&new).unwrap();
    assert_eq!(mode(&new), 0o644);

    let (real, link) = (dir.join("real.safetensors"), dir.join("link.safetensors"));
    std::fs::write(&real, b"old").unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
    symlink(&real, &link).unwrap();
    save(&link).unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(mode(&real), 0o600);
    let back = load_safetensors(&real, &dev()).unwrap();
    assert_eq!(back["t"].to_vec1::<f32>().unwrap(), t.to_vec1::<f32>().unwrap());

    // A dangling link: the file it names is created.
    let (target, dangling) = (dir.join("later.safetensors"), dir.join("dangling.safetensors"));
    symlink(&target, &dangling).unwrap();
    save(&dangling).unwrap();
    assert!(
        target.is_file() && std::fs::symlink_metadata(&dangling).unwrap().file_type().is_symlink()
    );

    let twice = save_safetensors([("t", &t), ("t", &t)], &new).unwrap_err();
    assert!(twice.to_string().contains("\"t\" is given twice"), "{twice}");

    let err = save(dir).unwrap_err();
    assert!(
        matches!(err, Error::File { .. }) && err.to_string().contains("not a regular file"),
        "{err}"
    );
}

#[test]
fn a_prefix_hint_is_only_given_when_true_and_debug_reads_as_display() {
    // The module asks for "pos_embedding" at the root beside keys the file has as they are; the
    // file has it as "encoder.pos_embedding" (torchvision's ViT). The hint names the prefix
    // of the missing key, and never claims that every key of the file starts with it.
    let (m, _) = mha(MhaConfig::new(8, 2), DType::F32);
    let mut state: HashMap<String, Tensor> = m.named_parameters().into_iter().collect();
    state
        .insert("encoder.pos_embedding".into(), Tensor::zeros((1, 4), DType::F32, &dev()).unwrap());
    let build = |vb: candle_nn::VarBuilder| {
        vb.get((1, 4), "pos_embedding")?;
        MultiheadAttention::new(MhaConfig::new(8, 2), vb)
    };
    let err = load_strict(&state, DType::F32, &dev(), build).map(|(m, _)| m).expect_err("missing");
    let msg = err.to_string();
    assert!(!msg.contains("every key in the file"), "{msg}");
    assert!(
        msg.contains("every missing key under \"encoder.\"")
            && msg.contains("\"pos_embedding\" is \"encoder.pos_embedding\"")
            && msg.contains("vb.pp(\"encoder\")"),
        "{msg}"
    );
    // What `main() -> Result<(), Box<dyn Error>>` prints is the message itself.
    let boxed: Box<dyn std::error::Error> = Box::new(err);
    assert_eq!(format!("{boxed:?}"), msg);
    assert!(!msg.contains("; ;") && !msg.contains("hint"), "{msg}");
    // Nothing shared: then every key of the file does start with the prefix.
    let only: HashMap<String, Tensor> =
        multihead::state_dict::prefixed("model", &m).into_iter().collect();
    let err = load_strict(&only, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(8, 2), vb)
    })
    .map(|(m, _)| m)
    .expect_err("prefix");
    assert!(err.to_string().contains("every key in the file starts with \"model.\""), "{err}");
}

/// torchvision's `EncoderBlock` keys for layer `i` of `VisionTransformer(hidden_dim=8,
/// mlp_dim=16)`, built from an encoder layer's parameters renamed as torchvision names them.
fn torchvision_block(
    i: usize,
    layer: &multihead::transformer::TransformerEncoderLayer,
) -> Vec<(String, Tensor)> {
    let map = torchvision_map();
    let named =
        multihead::state_dict::prefixed(&format!("encoder.layers.encoder_layer_{i}"), layer);
    map.to_file(named).unwrap()
}

fn torchvision_map() -> multihead::state_dict::KeyMap {
    multihead::state_dict::KeyMap::new()
        .rename("ln_1", "norm1")
        .rename("ln_2", "norm2")
        .rename("self_attention", "self_attn")
        .rename("mlp.0", "linear1")
        .rename("mlp.3", "linear2")
}

#[test]
fn a_key_map_loads_and_saves_under_the_files_names_and_checks_itself() {
    use multihead::state_dict::{load_safetensors, save_loaded_with, KeyMap};
    use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    let cfg = LayerConfig::new(8, 2).with_dim_feedforward(16).with_batch_first(true);
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let layers: Vec<TransformerEncoderLayer> = (0..2)
        .map(|i| TransformerEncoderLayer::new(cfg.clone(), vb.pp(format!("l{i}"))).unwrap())
        .collect();
    let file: HashMap<String, Tensor> =
        (0..2).flat_map(|i| torchvision_block(i, &layers[i])).collect();
    assert!(file.contains_key("encoder.layers.encoder_layer_1.mlp.3.weight"));
    assert!(file.contains_key("encoder.layers.encoder_layer_0.self_attention.in_proj_weight"));
    #[derive(Debug)]
    struct Blocks(Vec<TransformerEncoderLayer>);
    impl NamedParameters for Blocks {
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            let pre = |i| format!("encoder.layers.encoder_layer_{i}");
            let named = self.0.iter().enumerate();
            named.flat_map(|(i, l)| multihead::state_dict::prefixed(&pre(i), l)).collect()
        }
    }
    let build = |vb: candle_nn::VarBuilder| {
        (0..2)
            .map(|i| {
                TransformerEncoderLayer::new(
                    cfg.clone(),
                    vb.pp(format!("encoder.layers.encoder_layer_{i}")),
                )
            })
            .collect::<multihead::Result<Vec<_>>>()
            .map(Blocks)
    };
    // Without the map: the error groups the 48 keys by pattern and names the renames.
    let err = load_strict(&file, DType::F32, &dev(), build).map(|(m, _)| m).expect_err("names");
    let msg = err.to_string();
    assert!(msg.len() < 1500, "{} characters: {msg}", msg.len());
    assert!(msg.contains("\"encoder.layers.encoder_layer_*.norm*.{bias,weight}\" (×8)"), "{msg}");
    assert!(
        msg.contains(".rename(\"ln_1\", \"norm1\")")
            && msg.contains(".rename(\"self_attention\", \"self_attn\")"),
        "{msg}"
    );
    // Through the map: loads strictly, and saving gives back the file's keys and values.
    let map = torchvision_map();
    let (loaded, vars) =
        load_strict(&map.to_module(&file).unwrap(), DType::F32, &dev(), build).unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let path = dir.join("saved.safetensors");
    save_loaded_with(&loaded, &vars, &map, &path).unwrap();
    let back = load_safetensors(&path, &dev()).unwrap();
    let mut want: Vec<&String> = file.keys().collect();
    let mut got: Vec<&String> = back.keys().collect();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    for (k, t) in &file {
        assert_close(&back[k], t, Tolerance { rel: 0.0, abs: 0.0 }, k);
    }
    // A map that is not one-to-one is an error naming the keys.
    let twice = KeyMap::new().rename("ln_1", "norm1").rename("ln_2", "norm1");
    let err = twice.to_module(&file).expect_err("collision").to_string();
    assert!(err.contains("one-to-one") && err.contains("norm1"), "{err}");
    let overlapping = KeyMap::new().rename("ln_1", "ln_2");
    let err = overlapping.to_module(&file).expect_err("not invertible").to_string();
    assert!(err.contains("one-to-one"), "{err}");
    // A rename with an empty side or segment would match nothing: refused both ways, by name.
    for (f, m) in [("", "norm1"), ("ln_1", ""), ("mlp..0", "linear1"), (".ln_1", "norm1")] {
        let map = torchvision_map().rename(f, m);
        let err = map.to_module(&file).expect_err("empty segment").to_string();
        assert!(err.contains("empty segment") && err.contains(&format!("{f:?}")), "{err}");
        let err = map.to_file(Vec::new()).expect_err("empty segment").to_string();
        assert!(err.starts_with("KeyMap::to_file"), "{err}");
    }
}

#[test]
fn saving_what_was_loaded_checks_the_modules_list_and_keeps_only_its_parameters() {
    use multihead::state_dict::{load, save_loaded};
    use multihead::Linear;
    struct Port {
        class_token: Tensor,
        head: Linear,
    }
    impl NamedParameters for Port {
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            multihead::state_dict::prefixed("head", &self.head) // class_token forgotten
        }
    }
    let mut state: HashMap<String, Tensor> = HashMap::new();
    state.insert("class_token".into(), det(&[1, 1, 4], DType::F32, 1.0));
    state.insert("head.weight".into(), det(&[3, 4], DType::F32, 2.0));
    state.insert("head.bias".into(), det(&[3], DType::F32, 3.0));
    state.insert("unused.step".into(), det(&[1], DType::F32, 4.0));
    let build = |vb: candle_nn::VarBuilder| {
        Ok(Port {
            class_token: vb.get((1, 1, 4), "class_token")?,
            head: Linear::new(4, 3, true, vb.pp("head"))?,
        })
    };
    let (port, vars, report) = load(&state, DType::F32, &dev(), build).unwrap();
    assert_eq!(report.unexpected_keys, ["unused.step"]);
    // The VarMap holds what the module asked for (what an optimiser should train), no more.
    let mut held: Vec<String> = vars.data().lock().unwrap().keys().cloned().collect();
    held.sort();
    assert_eq!(held, ["class_token", "head.bias", "head.weight"]);
    assert_eq!(port.class_token.dims(), &[1, 1, 4]);
    let path = std::env::temp_dir()
        .join(format!("multihead_save_loaded_{}.safetensors", std::process::id()));
    let err = save_loaded(&port, &vars, &path).expect_err("unlisted").to_string();
    assert!(err.contains("loaded [\"class_token\"]") && err.contains("named_parameters"), "{err}");
    assert!(!path.exists(), "nothing is written");
}

/// A tensor's elements as little-endian bytes.
fn le<T: candle_core::WithDType, const W: usize>(t: &Tensor, f: fn(T) -> [u8; W]) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1::<T>().unwrap().into_iter().flat_map(f).collect()
}

/// The reader that fills each tensor straight from the file gives the bytes the `safetensors`
/// crate sees, for every dtype candle holds (bool as u8), an empty tensor and a scalar; a
/// dtype candle lacks is reported by name; a file cut short, grown by a byte or with a header
/// length past its end is a file error, not a panic.
#[test]
fn safetensors_files_are_read_tensor_by_tensor_as_the_crate_reads_them() {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype as S;
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let bytes = |n: usize, salt: u8| -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(37).wrapping_add(salt)).collect()
    };
    let specs: Vec<(&str, S, Vec<usize>, usize)> = vec![
        ("f32", S::F32, vec![3, 5], 4),
        ("f64", S::F64, vec![2, 3], 8),
        ("f16", S::F16, vec![7], 2),
        ("bf16", S::BF16, vec![2, 2, 2], 2),
        ("u8", S::U8, vec![9], 1),
        ("bool", S::BOOL, vec![4], 1),
        ("u32", S::U32, vec![3], 4),
        ("i64", S::I64, vec![2], 8),
        ("empty", S::F32, vec![0, 4], 4),
        ("scalar", S::F32, vec![], 4),
    ];
    let mut data: Vec<(String, S, Vec<usize>, Vec<u8>)> = specs
        .iter()
        .enumerate()
        .map(|(i, (n, d, s, w))| {
            let mut b = bytes(s.iter().product::<usize>() * w, i as u8);
            if *d == S::BOOL {
                b.iter_mut().for_each(|x| *x &= 1);
            }
            // Floats: finite values only (the bytes are compared, not the numbers).
            if matches!(d, S::F32 | S::F64 | S::F16 | S::BF16) {
                b.chunks_mut(*w).for_each(|c| c[w - 1] = 0x3f);
            }
            (n.to_string(), *d, s.clone(), b)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let file = dir.join("all.safetensors");
    safetensors::serialize_to_file(views.clone(), None, &file).unwrap();
    let map = load_safetensors(&file, &dev()).unwrap();
    assert_eq!(map.len(), data.len());
    for (name, _, shape, raw) in &data {
        let t = &map[name];
        assert_eq!(t.dims(), shape.as_slice(), "{name}");
        let got: Vec<u8> = match t.dtype() {
            DType::F32 => le(t, f32::to_le_bytes),
            DType::F64 => le(t, f64::to_le_bytes),
            DType::F16 => le(t, half::f16::to_le_bytes),
            DType::BF16 => le(t, half::bf16::to_le_bytes),
            DType::U8 => le(t, u8::to_le_bytes),
            DType::U32 => le(t, u32::to_le_bytes),
            DType::I64 => le(t, i64::to_le_bytes),
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(&got, raw, "{name}: bytes");
    }
    // An i32 tensor between two others: named, and the ones after it still read.
    data.insert(1, ("int32".into(), S::I32, vec![3], bytes(12, 9)));
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();
    let err = load_safetensors(&file, &dev()).unwrap_err().to_string();
    assert!(err.contains("tensor int32: unsupported dtype I32"), "{err}");
    // A pipe has no length to check against: it is read whole, with the same result, and
    // so is a pipe that holds a good file.
    let good = dir.join("good.safetensors");
    let good_views: Vec<(String, TensorView)> = data
        .iter()
        .filter(|d| d.1 != S::I32)
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(good_views, None, &good).unwrap();
    let good_fifo = dir.join("good.pipe");
    let made = std::process::Command::new("mkfifo").arg(&good_fifo).status().unwrap();
    assert!(made.success(), "mkfifo");
    let writer = {
        let (fifo, bytes) = (good_fifo.clone(), std::fs::read(&good).unwrap());
        std::thread::spawn(move || std::fs::write(fifo, bytes).unwrap())
    };
    // (load_safetensors opens the pipe first thing, so the writer is never left waiting.)
    let from_pipe = load_safetensors(&good_fifo, &dev()).unwrap();
    writer.join().unwrap();
    let from_file = load_safetensors(&good, &dev()).unwrap();
    assert_eq!(from_pipe.len(), from_file.len());
    for (k, t) in &from_file {
        let p = &from_pipe[k];
        assert_eq!((t.dtype(), t.dims()), (p.dtype(), p.dims()), "{k} through a pipe");
        let bits = |x: &Tensor| -> Vec<u64> {
            let v = x.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
            v.to_vec1::<f64>().unwrap().iter().map(|f| f.to_bits()).collect()
        };
        assert_eq!(bits(t), bits(p), "{k} through a pipe");
    }
    let fifo = dir.join("pipe.safetensors");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success(), "mkfifo");
    let whole = std::fs::read(&file).unwrap();
    let writer = {
        let (fifo, whole) = (fifo.clone(), whole.clone());
        std::thread::spawn(move || std::fs::write(fifo, whole).unwrap())
    };
    let piped = load_safetensors(&fifo, &dev()).unwrap_err().to_string();
    writer.join().unwrap();
    assert_eq!(piped, err.replace("all.safetensors", "pipe.safetensors"));
    // A FIFO that nobody writes is an error after a bounded wait, not a hang.
    let idle = dir.join("idle.pipe");
    assert!(std::process::Command::new("mkfifo").arg(&idle).status().unwrap().success());
    let start = std::time::Instant::now();
    let e = load_safetensors(&idle, &dev()).unwrap_err().to_string();
    assert!(e.contains("it is a FIFO and nothing was written to it"), "{e}");
    assert!(start.elapsed() < std::time::Duration::from_secs(30), "{:?}", start.elapsed());
    // A directory is named as one.
    match load_safetensors(dir, &dev()) {
        Err(Error::File { msg, .. }) => assert_eq!(msg, "cannot read: it is a directory"),
        other => panic!("directory: {other:?}"),
    }
    // Malformed files.
    let mut long_header = whole.clone();
    long_header[..8].copy_from_slice(&(whole.len() as u64).to_le_bytes());
    let mut grown = whole.clone();
    grown.push(0);
    for (what, b) in [
        ("cut", whole[..whole.len() - 1].to_vec()),
        ("grown", grown),
        ("header", long_header),
        ("tiny", whole[..5].to_vec()),
    ] {
        std::fs::write(&file, &b).unwrap();
        match load_safetensors(&file, &dev()) {
            Err(Error::File { msg, .. }) => {
                assert!(msg.starts_with("not a safetensors file"), "{what}: {msg}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// A tensor candle cannot hold is skipped over, and the tensors after it in the file are read
/// from the right place (a module loaded non-strictly gets its parameters, the skipped one is
/// reported as unexpected).
#[test]
fn tensors_after_a_skipped_one_are_read_from_their_own_offsets() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let weight: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    let bias: Vec<f32> = vec![0.25, -4.0];
    let header = r#"{"weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"int32":{"dtype":"I32","shape":[3],"data_offsets":[24,36]},"bias":{"dtype":"F32","shape":[2],"data_offsets":[36,44]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(weight.iter().flat_map(|x| x.to_le_bytes()));
    bytes.extend([7u8; 12]);
    bytes.extend(bias.iter().flat_map(|x| x.to_le_bytes()));
    let file = dir.join("skip.safetensors");
    std::fs::write(&file, &bytes).unwrap();
    let (lin, _, report) = multihead::state_dict::load_file(&file, DType::F32, &dev(), |vb| {
        multihead::Linear::new(3, 2, true, vb)
    })
    .unwrap();
    let got = lin.named_parameters();
    let w = got.iter().find(|(k, _)| k == "weight").unwrap().1.flatten_all().unwrap();
    let b = got.iter().find(|(k, _)| k == "bias").unwrap().1.clone();
    assert_eq!(w.to_vec1::<f32>().unwrap(), weight);
    assert_eq!(b.to_vec1::<f32>().unwrap(), bias);
    assert!(format!("{report:?}").contains("int32"), "{report:?}");
}

/// A tensor named `__metadata__` (the header's reserved key) made a file that no reader, ours
/// or Python's, could open (an adversarial run): saving it is an error, and nothing is written.
#[test]
fn the_reserved_metadata_name_is_refused_at_save() {
    let scratch = tempfile::tempdir().unwrap();
    let path = scratch.path().join("meta.safetensors");
    let t = Tensor::zeros(3, DType::F32, &dev()).unwrap();
    let err = multihead::state_dict::save_safetensors([("__metadata__", &t)], &path).unwrap_err();
    assert!(matches!(err, Error::File { .. }), "{err}");
    assert!(err.to_string().contains("reserved"), "{err}");
    assert!(!path.exists());
    // Any other name round-trips.
    multihead::state_dict::save_safetensors([("metadata", &t)], &path).unwrap();
    assert_eq!(load_safetensors(&path, &dev()).unwrap()["metadata"].dims(), &[3]);
}

/// A file whose tensors each fit the memory but not all together was read tensor by tensor
/// until the kernel killed the process (an adversarial run, from the code): their total is
/// checked against the memory available first. The file here is sparse (nothing is written),
/// with 1 GiB tensors enough to exceed `MemAvailable` plus free swap.
#[cfg(target_os = "linux")]
#[test]
fn a_file_whose_tensors_do_not_fit_together_is_an_alloc_error_before_reading() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib = |key: &str| -> u64 {
        let line = meminfo.lines().find(|l| l.starts_with(key)).unwrap_or("x 0");
        line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let gib = 1u64 << 30;
    let count = (kib("MemAvailable:") + kib("SwapFree:")) * 1024 / gib + 2;
    let header: serde_json::Map<String, serde_json::Value> = (0..count)
        .map(|i| {
            let info = serde_json::json!({
                "dtype": "F32", "shape": [gib / 4], "data_offsets": [i * gib, (i + 1) * gib]
            });
            (format!("t{i}"), info)
        })
        .collect();
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let scratch = tempfile::tempdir().unwrap();
    let path = scratch.path().join("sparse.safetensors");
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    std::fs::write(&path, &bytes).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(bytes.len() as u64 + count * gib).unwrap();
    let start = std::time::Instant::now();
    let err = load_safetensors(&path, &dev()).unwrap_err();
    assert!(matches!(err, Error::Alloc { .. }), "{err}");
    assert!(err.to_string().contains("together"), "{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(5), "{:?}", start.elapsed());
}

/// A module far larger than its state_dict is reported, not built: the load stops after 4096
/// missing keys and says so (the message read "missing keys 4096 keys", as if that were the
/// count; an adversarial run).
#[test]
fn a_load_that_stops_counting_missing_keys_says_so() {
    use multihead::transformer::{LayerConfig, TransformerEncoder};
    let state: HashMap<String, Tensor> = HashMap::new();
    let cfg = LayerConfig::new(8, 2).with_dim_feedforward(16);
    let err = load_strict(&state, DType::F32, &dev(), |vb| {
        TransformerEncoder::new(cfg.clone(), 100_000, None, vb)
    })
    .map(|(m, _)| m)
    .expect_err("no parameters");
    let msg = err.to_string();
    assert!(msg.contains("missing keys 4096 keys"), "{}", &msg[..200.min(msg.len())]);
    assert!(msg.contains("the load stopped after 4096 keys"), "{}", &msg[msg.len() - 300..]);
}
