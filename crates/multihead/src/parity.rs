//! PyTorch parity cases: load, replay and check (the contract in
//! `spec/parity-case-format.md`).
//!
//! A case directory holds `case.json` (what was built and called) and `case.safetensors`
//! (weights, inputs, upstream gradients and PyTorch's results). [`replay`] rebuilds the module,
//! loads its state_dict strictly, runs the call and back-propagates
//! `sum(output * g) [+ sum(attn_weights * g_w)]`; [`check`] compares the result with the case's
//! `expect.*` tensors.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::functional::MhaOptions;
use crate::mask::Mask;
use crate::multihead_attention::{MhaConfig, MultiheadAttention};
use crate::state_dict::{load_safetensors, load_strict, NamedParameters};
use crate::tolerance::Tolerance;
use crate::transformer::{
    DecoderMasks, LayerConfig, NormConfig, Transformer, TransformerConfig, TransformerDecoder,
    TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer, TransformerMasks,
};
use crate::Activation;

/// A loaded parity case.
#[derive(Debug)]
pub struct Case {
    /// The case directory.
    pub dir: PathBuf,
    /// `case.json`.
    pub meta: Value,
    /// Every tensor of `case.safetensors`.
    pub tensors: HashMap<String, Tensor>,
}

fn case_err(dir: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: dir.to_path_buf(), msg: msg.into() }
}

impl Case {
    /// Reads `case.json` and `case.safetensors` from `dir`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let json_path = dir.join("case.json");
        let text = std::fs::read_to_string(&json_path)
            .map_err(|e| case_err(dir, format!("cannot read case.json: {e}")))?;
        let meta: Value = serde_json::from_str(&text)
            .map_err(|e| case_err(dir, format!("case.json is not valid JSON: {e}")))?;
        match meta.get("format_version").and_then(Value::as_u64) {
            Some(1) => {}
            other => {
                return Err(case_err(
                    dir,
                    format!("unsupported format_version {other:?}, expected 1"),
                ))
            }
        }
        let tensors = load_safetensors(dir.join("case.safetensors"), &Device::Cpu)?;
        Ok(Self { dir: dir.to_path_buf(), meta, tensors })
    }

    /// The module's PyTorch class path.
    pub fn module(&self) -> &str {
        self.meta.get("module").and_then(Value::as_str).unwrap_or("")
    }

    /// The case's dtype (`constructor.dtype`).
    pub fn dtype(&self) -> Result<DType> {
        let ctor = self.meta.get("constructor");
        let name = ctor.and_then(|c| c.get("dtype")).and_then(Value::as_str).unwrap_or("float32");
        match name.trim_start_matches("torch.") {
            "float32" | "float" => Ok(DType::F32),
            "float64" | "double" => Ok(DType::F64),
            other => Err(case_err(&self.dir, format!("unsupported dtype {other:?}"))),
        }
    }

    fn flag(&self, section: &str, key: &str, default: bool) -> bool {
        self.meta.get(section).and_then(|s| s.get(key)).and_then(Value::as_bool).unwrap_or(default)
    }

    fn top_flag(&self, key: &str, default: bool) -> bool {
        self.meta.get(key).and_then(Value::as_bool).unwrap_or(default)
    }

    /// The tolerance for an `expect.*` tensor: `suggested_tolerance` when the case gives one
    /// for this dtype, otherwise [`Tolerance::for_dtype`].
    pub fn tolerance(&self, dtype: DType, grad: bool) -> Tolerance {
        let fallback = Tolerance::for_dtype(dtype, grad);
        let Some(st) = self.meta.get("suggested_tolerance") else {
            return fallback;
        };
        let dname = if dtype == DType::F64 { "float64" } else { "float32" };
        let per_dtype = st.get(dname).unwrap_or(st);
        let kind = if grad {
            per_dtype
                .get("grad")
                .or_else(|| per_dtype.get("gradients"))
                .or_else(|| per_dtype.get("backward"))
        } else {
            per_dtype.get("forward")
        };
        let Some(kind) = kind.or(Some(per_dtype)) else {
            return fallback;
        };
        match (kind.get("rtol").and_then(Value::as_f64), kind.get("atol").and_then(Value::as_f64)) {
            (Some(rel), Some(abs)) => Tolerance { rel, abs },
            _ => fallback,
        }
    }

    fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    fn mask(&self, name: &str) -> Result<Option<Mask>> {
        let Some(t) = self.tensor(&format!("input.{name}")) else {
            return Ok(None);
        };
        let call_kind = self.meta.get("call").and_then(|c| c.get(name)).and_then(Value::as_str);
        let logical = self
            .meta
            .get("tensors")
            .and_then(|ts| ts.get(format!("input.{name}")))
            .and_then(|m| m.get("logical_dtype"))
            .and_then(Value::as_str);
        let is_bool = match (call_kind, logical) {
            (Some("bool"), _) => true,
            (Some("float"), _) => false,
            (_, Some("bool")) => true,
            _ => t.dtype() == DType::U8,
        };
        Ok(Some(if is_bool { Mask::Bool(t.to_dtype(DType::U8)?) } else { Mask::Float(t.clone()) }))
    }
}

fn opt_usize(v: Option<&Value>) -> Option<usize> {
    v.and_then(Value::as_u64).map(|x| x as usize)
}

/// Reads an MHA constructor from `case.json`'s `constructor`.
pub fn mha_config(ctor: &Value) -> Result<MhaConfig> {
    let get_usize = |k: &str| opt_usize(ctor.get(k));
    let bad = |k: &str| Error::File {
        path: PathBuf::from("case.json"),
        msg: format!("constructor.{k} is missing or not a whole number"),
    };
    let mut cfg = MhaConfig::new(
        get_usize("embed_dim").ok_or_else(|| bad("embed_dim"))?,
        get_usize("num_heads").ok_or_else(|| bad("num_heads"))?,
    );
    let b = |k: &str, d: bool| ctor.get(k).and_then(Value::as_bool).unwrap_or(d);
    cfg.dropout = ctor.get("dropout").and_then(Value::as_f64).unwrap_or(0.0);
    cfg.bias = b("bias", true);
    cfg.add_bias_kv = b("add_bias_kv", false);
    cfg.add_zero_attn = b("add_zero_attn", false);
    cfg.kdim = get_usize("kdim");
    cfg.vdim = get_usize("vdim");
    cfg.batch_first = b("batch_first", false);
    Ok(cfg)
}

/// What a replay produced, by the contract's result names (`output`, `attn_weights`,
/// `grad.<arg>`, `grad.param.<key>`).
pub type ReplayResult = BTreeMap<String, Tensor>;

/// Replays a case: builds the module, loads `param.*` strictly, runs the call and, when
/// `grad_mode`, back-propagates the case's loss.
pub fn replay(case: &Case) -> Result<ReplayResult> {
    match case.module() {
        "torch.nn.MultiheadAttention" | "torch.nn.modules.activation.MultiheadAttention" => {
            replay_mha(case)
        }
        "torch.nn.TransformerEncoderLayer"
        | "torch.nn.TransformerDecoderLayer"
        | "torch.nn.TransformerEncoder"
        | "torch.nn.TransformerDecoder"
        | "torch.nn.Transformer" => replay_transformer(case),
        other => Err(case_err(&case.dir, format!("unsupported module {other:?}"))),
    }
}

fn input_var(case: &Case, name: &str, dtype: DType) -> Result<Var> {
    let t = case
        .tensor(&format!("input.{name}"))
        .ok_or_else(|| case_err(&case.dir, format!("missing tensor input.{name}")))?;
    if t.dtype() != dtype {
        return Err(case_err(
            &case.dir,
            format!("input.{name} has dtype {:?}, the case dtype is {dtype:?}", t.dtype()),
        ));
    }
    Ok(Var::from_tensor(t)?)
}

fn params_of(case: &Case) -> HashMap<String, Tensor> {
    case.tensors
        .iter()
        .filter_map(|(k, t)| k.strip_prefix("param.").map(|p| (p.to_string(), t.clone())))
        .collect()
}

fn replay_mha(case: &Case) -> Result<ReplayResult> {
    let dtype = case.dtype()?;
    let ctor = case
        .meta
        .get("constructor")
        .ok_or_else(|| case_err(&case.dir, "case.json has no constructor"))?;
    let cfg = mha_config(ctor)?;
    let dev = Device::Cpu;
    let state = params_of(case);
    for (k, t) in &state {
        if t.dtype() != dtype {
            return Err(case_err(
                &case.dir,
                format!("param.{k} has dtype {:?}, the case dtype is {dtype:?}", t.dtype()),
            ));
        }
    }
    let (mut mha, vm) = load_strict(&state, dtype, &dev, |vb| MultiheadAttention::new(cfg, vb))?;
    mha.train(case.top_flag("training", true));
    let grad_mode = case.top_flag("grad_mode", false);

    let key_is_query = case.flag("aliasing", "key_is_query", false);
    let value_is_key = case.flag("aliasing", "value_is_key", false);
    let q = input_var(case, "query", dtype)?;
    let k = if key_is_query { q.clone() } else { input_var(case, "key", dtype)? };
    let v = if value_is_key { k.clone() } else { input_var(case, "value", dtype)? };

    let call = case.meta.get("call");
    let cflag =
        |k: &str, d: bool| call.and_then(|c| c.get(k)).and_then(Value::as_bool).unwrap_or(d);
    let mut opts = MhaOptions::default()
        .need_weights(cflag("need_weights", true))
        .average_attn_weights(cflag("average_attn_weights", true))
        .is_causal(cflag("is_causal", false));
    opts.attn_mask = case.mask("attn_mask")?;
    opts.key_padding_mask = case.mask("key_padding_mask")?;

    let out = mha.forward(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)?;
    let mut result = ReplayResult::new();
    result.insert("output".into(), out.output.contiguous()?);
    if let Some(w) = &out.attn_weights {
        result.insert("attn_weights".into(), w.contiguous()?);
    }
    if !grad_mode {
        return Ok(result);
    }
    let g = case
        .tensor("grad.output")
        .ok_or_else(|| case_err(&case.dir, "grad_mode is true but grad.output is missing"))?;
    let mut loss = out.output.mul(g)?.sum_all()?;
    if let Some(gw) = case.tensor("grad.attn_weights") {
        let w = out.attn_weights.as_ref().ok_or_else(|| {
            case_err(&case.dir, "grad.attn_weights is given but the call returns no weights")
        })?;
        loss = loss.add(&w.mul(gw)?.sum_all()?)?;
    }
    let grads = loss.backward()?;
    let grad_of = |t: &Tensor| -> Result<Tensor> {
        match grads.get(t) {
            Some(g) => Ok(g.contiguous()?),
            None => Ok(t.zeros_like()?),
        }
    };
    result.insert("grad.query".into(), grad_of(q.as_tensor())?);
    if !key_is_query {
        result.insert("grad.key".into(), grad_of(k.as_tensor())?);
    }
    if !value_is_key {
        result.insert("grad.value".into(), grad_of(v.as_tensor())?);
    }
    for (name, t) in mha.named_parameters() {
        result.insert(format!("grad.param.{name}"), grad_of(&t)?);
    }
    drop(vm);
    Ok(result)
}

/// One compared tensor of a checked case.
#[derive(Clone, Debug)]
pub struct TensorCheck {
    /// The `expect.*` name.
    pub name: String,
    /// Whether it is within tolerance.
    pub passed: bool,
    /// The largest absolute difference.
    pub max_abs: f64,
    /// The worst error over the tolerance (at most 1 passes).
    pub worst_ratio: f64,
    /// Why it failed, when it failed for a reason other than values.
    pub note: Option<String>,
}

/// Replays a case and compares every `expect.*` tensor with the tolerance of its kind.
pub fn check(case: &Case) -> Result<Vec<TensorCheck>> {
    let result = replay(case)?;
    let dtype = case.dtype()?;
    let mut checks = Vec::new();
    let mut names: Vec<&String> =
        case.tensors.keys().filter(|k| k.starts_with("expect.")).collect();
    names.sort();
    for name in names {
        let expected = &case.tensors[name];
        let key = &name["expect.".len()..];
        let grad = key.starts_with("grad.");
        let tol = case.tolerance(dtype, grad);
        match result.get(key) {
            Some(actual) => {
                let c = tol.compare(actual, expected)?;
                checks.push(TensorCheck {
                    name: name.clone(),
                    passed: c.passed(),
                    max_abs: c.max_abs,
                    worst_ratio: c.worst_ratio,
                    note: c.shape_mismatch.then(|| {
                        format!("shape {:?} vs expected {:?}", actual.dims(), expected.dims())
                    }),
                });
            }
            None => checks.push(TensorCheck {
                name: name.clone(),
                passed: false,
                max_abs: f64::INFINITY,
                worst_ratio: f64::INFINITY,
                note: Some("the replay produced no such tensor".into()),
            }),
        }
    }
    Ok(checks)
}

/// Reads the Transformer layer arguments (`d_model`, `nhead`, `dim_feedforward`, ...).
pub fn layer_config(v: &Value) -> Result<LayerConfig> {
    let bad = |k: &str| Error::File {
        path: PathBuf::from("case.json"),
        msg: format!("constructor.{k} is missing or invalid"),
    };
    let d_model = opt_usize(v.get("d_model")).ok_or_else(|| bad("d_model"))?;
    let nhead = opt_usize(v.get("nhead")).ok_or_else(|| bad("nhead"))?;
    let mut cfg = LayerConfig::new(d_model, nhead);
    if let Some(x) = opt_usize(v.get("dim_feedforward")) {
        cfg.dim_feedforward = x;
    }
    if let Some(x) = v.get("dropout").and_then(Value::as_f64) {
        cfg.dropout = x;
    }
    if let Some(x) = v.get("activation").and_then(Value::as_str) {
        cfg.activation = Activation::from_name(x)?;
    }
    if let Some(x) = v.get("layer_norm_eps").and_then(Value::as_f64) {
        cfg.layer_norm_eps = x;
    }
    let b = |k: &str, d: bool| v.get(k).and_then(Value::as_bool).unwrap_or(d);
    cfg.batch_first = b("batch_first", false);
    cfg.norm_first = b("norm_first", false);
    cfg.bias = b("bias", true);
    Ok(cfg)
}

fn stack_config(case: &Case, ctor: &Value) -> Result<(LayerConfig, usize, Option<NormConfig>)> {
    let layer =
        ctor.get("layer").ok_or_else(|| case_err(&case.dir, "constructor.layer is missing"))?;
    let cfg = layer_config(layer)?;
    let n = opt_usize(ctor.get("num_layers"))
        .ok_or_else(|| case_err(&case.dir, "constructor.num_layers is missing"))?;
    let norm = match ctor.get("norm") {
        Some(Value::Object(o)) => Some(NormConfig {
            eps: o.get("eps").and_then(Value::as_f64).unwrap_or(1e-5),
            bias: o
                .get("bias")
                .and_then(Value::as_bool)
                .unwrap_or_else(|| case.tensors.contains_key("param.norm.bias")),
        }),
        _ => None,
    };
    Ok((cfg, n, norm))
}

/// A built Transformer-family module.
enum Built {
    EncoderLayer(TransformerEncoderLayer),
    DecoderLayer(TransformerDecoderLayer),
    Encoder(TransformerEncoder),
    Decoder(TransformerDecoder),
    Transformer(Transformer),
}

impl NamedParameters for Built {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        match self {
            Built::EncoderLayer(m) => m.named_parameters(),
            Built::DecoderLayer(m) => m.named_parameters(),
            Built::Encoder(m) => m.named_parameters(),
            Built::Decoder(m) => m.named_parameters(),
            Built::Transformer(m) => m.named_parameters(),
        }
    }
}

fn replay_transformer(case: &Case) -> Result<ReplayResult> {
    let dtype = case.dtype()?;
    let dev = Device::Cpu;
    let ctor = case
        .meta
        .get("constructor")
        .ok_or_else(|| case_err(&case.dir, "case.json has no constructor"))?
        .clone();
    let module = case.module().to_string();
    let state = params_of(case);
    let (mut built, vm) = load_strict(&state, dtype, &dev, |vb| {
        Ok(match module.as_str() {
            "torch.nn.TransformerEncoderLayer" => {
                Built::EncoderLayer(TransformerEncoderLayer::new(layer_config(&ctor)?, vb)?)
            }
            "torch.nn.TransformerDecoderLayer" => {
                Built::DecoderLayer(TransformerDecoderLayer::new(layer_config(&ctor)?, vb)?)
            }
            "torch.nn.TransformerEncoder" => {
                let (cfg, n, norm) = stack_config(case, &ctor)?;
                Built::Encoder(TransformerEncoder::new(cfg, n, norm, vb)?)
            }
            "torch.nn.TransformerDecoder" => {
                let (cfg, n, norm) = stack_config(case, &ctor)?;
                Built::Decoder(TransformerDecoder::new(cfg, n, norm, vb)?)
            }
            _ => {
                let cfg = TransformerConfig {
                    layer: layer_config(&ctor)?,
                    num_encoder_layers: opt_usize(ctor.get("num_encoder_layers")).unwrap_or(6),
                    num_decoder_layers: opt_usize(ctor.get("num_decoder_layers")).unwrap_or(6),
                };
                Built::Transformer(Transformer::new(cfg, vb)?)
            }
        })
    })?;
    let training = case.top_flag("training", true);
    let grad_mode = case.top_flag("grad_mode", false);
    match &mut built {
        Built::EncoderLayer(m) => m.train(training),
        Built::DecoderLayer(m) => m.train(training),
        Built::Encoder(m) => {
            m.train(training);
            m.set_inference_mode(!grad_mode);
        }
        Built::Decoder(m) => m.train(training),
        Built::Transformer(m) => {
            m.train(training);
            m.set_inference_mode(!grad_mode);
        }
    }
    let call = case.meta.get("call").cloned().unwrap_or(Value::Null);
    let hint = |k: &str| call.get(k).and_then(Value::as_bool);
    let float_inputs: &[&str] = match &built {
        Built::EncoderLayer(_) | Built::Encoder(_) => &["src"],
        Built::DecoderLayer(_) | Built::Decoder(_) => &["tgt", "memory"],
        Built::Transformer(_) => &["src", "tgt"],
    };
    let mut inputs: BTreeMap<&str, Var> = BTreeMap::new();
    for name in float_inputs {
        inputs.insert(name, input_var(case, name, dtype)?);
    }
    let inp = |name: &str| -> Result<Tensor> {
        inputs
            .get(name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| case_err(&case.dir, format!("missing input.{name}")))
    };
    let decoder_masks = |tgt_causal_default: Option<bool>| -> Result<DecoderMasks> {
        Ok(DecoderMasks {
            tgt_mask: case.mask("tgt_mask")?,
            memory_mask: case.mask("memory_mask")?,
            tgt_key_padding_mask: case.mask("tgt_key_padding_mask")?,
            memory_key_padding_mask: case.mask("memory_key_padding_mask")?,
            tgt_is_causal: hint("tgt_is_causal").or(tgt_causal_default),
            memory_is_causal: hint("memory_is_causal").unwrap_or(false),
        })
    };
    let output = match &built {
        Built::EncoderLayer(m) => m.forward(
            &inp("src")?,
            case.mask("src_mask")?.as_ref(),
            case.mask("src_key_padding_mask")?.as_ref(),
            hint("is_causal").unwrap_or(false),
        )?,
        Built::Encoder(m) => m.forward(
            &inp("src")?,
            case.mask("mask")?.as_ref(),
            case.mask("src_key_padding_mask")?.as_ref(),
            hint("is_causal"),
        )?,
        Built::DecoderLayer(m) => {
            m.forward(&inp("tgt")?, &inp("memory")?, &decoder_masks(Some(false))?)?
        }
        Built::Decoder(m) => m.forward(&inp("tgt")?, &inp("memory")?, &decoder_masks(None)?)?,
        Built::Transformer(m) => {
            let masks = TransformerMasks {
                src_mask: case.mask("src_mask")?,
                src_key_padding_mask: case.mask("src_key_padding_mask")?,
                src_is_causal: hint("src_is_causal"),
                decoder: decoder_masks(None)?,
            };
            m.forward(&inp("src")?, &inp("tgt")?, &masks)?
        }
    };
    let mut result = ReplayResult::new();
    result.insert("output".into(), output.contiguous()?);
    if !grad_mode {
        return Ok(result);
    }
    let g = case
        .tensor("grad.output")
        .ok_or_else(|| case_err(&case.dir, "grad_mode is true but grad.output is missing"))?;
    let grads = output.mul(g)?.sum_all()?.backward()?;
    let grad_of = |t: &Tensor| -> Result<Tensor> {
        match grads.get(t) {
            Some(g) => Ok(g.contiguous()?),
            None => Ok(t.zeros_like()?),
        }
    };
    for (name, v) in &inputs {
        result.insert(format!("grad.{name}"), grad_of(v.as_tensor())?);
    }
    for (name, t) in built.named_parameters() {
        result.insert(format!("grad.param.{name}"), grad_of(&t)?);
    }
    drop(vm);
    Ok(result)
}
