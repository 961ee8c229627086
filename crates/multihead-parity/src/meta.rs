//! `case.json` as typed structs (`docs/case-format.md` §2).
//!
//! The keys that change the computation are read strictly: a missing required key or an
//! unknown key inside `constructor` (its `layer` and `norm`) or `call` is an error that names
//! it. The other top-level keys (seed, torch version, description, ...) are informative and
//! ignored.

use std::collections::HashMap;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

/// A problem with `case.json`, in words that name the key.
pub type Result<T> = std::result::Result<T, String>;

/// The most elements one parameter of a case may have (2³¹), checked before anything is
/// built.
pub const MAX_PARAM_ELEMENTS: usize = 1 << 31;
/// The most layers a case's stack may have.
pub const MAX_LAYERS: usize = 1024;

/// The `module` values a case may name.
pub const SUPPORTED_MODULES: [&str; 8] = [
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.MultiheadAttention",
    "torch.nn.modules.activation.MultiheadAttention",
    "torch.nn.TransformerEncoderLayer",
    "torch.nn.TransformerDecoderLayer",
    "torch.nn.TransformerEncoder",
    "torch.nn.TransformerDecoder",
    "torch.nn.Transformer",
];

/// The top level of `case.json`.
#[derive(Clone, Debug, Deserialize)]
pub struct CaseMeta {
    /// `1` (written `1.0` by some JSON writers: an integral number is taken).
    #[serde(deserialize_with = "integral")]
    pub format_version: u32,
    /// PyTorch's class path.
    pub module: String,
    /// The constructor's keyword arguments (read per module by [`Module::parse`]).
    pub constructor: Value,
    /// Training mode.
    pub training: bool,
    /// Gradients were recorded.
    pub grad_mode: bool,
    /// The forward's non-tensor arguments (read per module).
    pub call: Value,
    /// Which inputs were the same tensor.
    #[serde(default)]
    pub aliasing: Aliasing,
    /// Per tensor: shape, stored dtype, logical dtype.
    #[serde(default)]
    pub tensors: HashMap<String, TensorMeta>,
    /// rtol/atol per dtype.
    #[serde(default)]
    pub suggested_tolerance: Option<Value>,
    /// This project's optional key (docs/case-format.md): the forward ran inside
    /// `torch.autocast("cpu", dtype=...)`, `"bfloat16"` or `"float16"`; absent for none.
    #[serde(default)]
    pub autocast: Option<String>,
}

/// `aliasing`: which MHA inputs were the same tensor object.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Aliasing {
    /// `key is query`.
    #[serde(default)]
    pub key_is_query: bool,
    /// `value is key`.
    #[serde(default)]
    pub value_is_key: bool,
}

/// One entry of `tensors`.
#[derive(Clone, Debug, Deserialize)]
pub struct TensorMeta {
    /// The shape.
    #[serde(default)]
    pub shape: Option<Vec<usize>>,
    /// The stored dtype.
    #[serde(default)]
    pub dtype: Option<String>,
    /// `"bool"` for masks stored as uint8.
    #[serde(default)]
    pub logical_dtype: Option<String>,
}

/// A mask's kind in `call`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MaskKind {
    /// A bool mask (stored as uint8); `"torch.bool"`, as `str(torch.bool)` writes it, too.
    #[serde(alias = "torch.bool")]
    Bool,
    /// An additive float mask; a float dtype's name (`"float32"`, `"torch.float64"`, ...) too.
    #[serde(alias = "float32", alias = "float64", alias = "bfloat16", alias = "float16")]
    #[serde(alias = "torch.float32", alias = "torch.float64", alias = "torch.bfloat16")]
    #[serde(alias = "torch.float16", alias = "torch.float")]
    Float,
}

/// A non-negative integer written as an integer or as an integral float (`1` or `1.0`).
fn integral<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u32, D::Error> {
    let v = f64::deserialize(d)?;
    if v.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&v) {
        Ok(v as u32)
    } else {
        Err(serde::de::Error::custom(format!("expected a non-negative integer, got {v}")))
    }
}

fn t() -> bool {
    true
}
fn default_ff() -> usize {
    2048
}
fn default_dropout() -> f64 {
    0.1
}
fn default_act() -> String {
    "relu".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn six() -> usize {
    6
}

/// `nn.MultiheadAttention`'s keyword arguments.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct MhaCtor {
    pub embed_dim: usize,
    pub num_heads: usize,
    #[serde(default)]
    pub dropout: f64,
    #[serde(default = "t")]
    pub bias: bool,
    #[serde(default)]
    pub add_bias_kv: bool,
    #[serde(default)]
    pub add_zero_attn: bool,
    #[serde(default)]
    pub kdim: Option<usize>,
    #[serde(default)]
    pub vdim: Option<usize>,
    #[serde(default)]
    pub batch_first: bool,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
}

/// `nn.TransformerEncoderLayer`'s and `nn.TransformerDecoderLayer`'s keyword arguments.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct LayerCtor {
    pub d_model: usize,
    pub nhead: usize,
    #[serde(default = "default_ff")]
    pub dim_feedforward: usize,
    #[serde(default = "default_dropout")]
    pub dropout: f64,
    #[serde(default = "default_act")]
    pub activation: String,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub batch_first: bool,
    #[serde(default)]
    pub norm_first: bool,
    #[serde(default = "t")]
    pub bias: bool,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
}

/// The final norm of a stack: `nn.LayerNorm`'s keyword arguments that matter.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct NormCtor {
    #[serde(default = "default_eps")]
    pub eps: f64,
    #[serde(default)]
    pub bias: Option<bool>,
    #[serde(default = "t")]
    pub elementwise_affine: bool,
}

/// `nn.TransformerEncoder`'s and `nn.TransformerDecoder`'s arguments.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct StackCtor {
    pub layer: LayerCtor,
    pub num_layers: usize,
    #[serde(default)]
    pub norm: Option<NormCtor>,
    #[serde(default = "t")]
    pub enable_nested_tensor: bool,
    #[serde(default = "t")]
    pub mask_check: bool,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
}

/// `nn.Transformer`'s keyword arguments.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct TransformerCtor {
    #[serde(default = "default_d_model")]
    pub d_model: usize,
    #[serde(default = "default_nhead")]
    pub nhead: usize,
    #[serde(default = "six")]
    pub num_encoder_layers: usize,
    #[serde(default = "six")]
    pub num_decoder_layers: usize,
    #[serde(default = "default_ff")]
    pub dim_feedforward: usize,
    #[serde(default = "default_dropout")]
    pub dropout: f64,
    #[serde(default = "default_act")]
    pub activation: String,
    #[serde(default)]
    pub custom_encoder: Option<Value>,
    #[serde(default)]
    pub custom_decoder: Option<Value>,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub batch_first: bool,
    #[serde(default)]
    pub norm_first: bool,
    #[serde(default = "t")]
    pub bias: bool,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
}

fn default_d_model() -> usize {
    512
}
fn default_nhead() -> usize {
    8
}

impl TransformerCtor {
    /// The layer arguments inside.
    pub fn layer(&self) -> LayerCtor {
        LayerCtor {
            d_model: self.d_model,
            nhead: self.nhead,
            dim_feedforward: self.dim_feedforward,
            dropout: self.dropout,
            activation: self.activation.clone(),
            layer_norm_eps: self.layer_norm_eps,
            batch_first: self.batch_first,
            norm_first: self.norm_first,
            bias: self.bias,
            device: self.device.clone(),
            dtype: self.dtype.clone(),
        }
    }
}

/// `MultiheadAttention.forward`'s non-tensor arguments.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct MhaCallArgs {
    #[serde(default = "t")]
    pub need_weights: bool,
    #[serde(default = "t")]
    pub average_attn_weights: bool,
    #[serde(default)]
    pub is_causal: Option<bool>,
    #[serde(default)]
    pub attn_mask: Option<MaskKind>,
    #[serde(default)]
    pub key_padding_mask: Option<MaskKind>,
}

/// `F.scaled_dot_product_attention` has no constructor: only the case's `dtype` and
/// `device` may be given.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct SdpaCtor {
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
}

/// `F.scaled_dot_product_attention`'s non-tensor arguments.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct SdpaCallArgs {
    #[serde(default)]
    pub dropout_p: f64,
    #[serde(default)]
    pub is_causal: bool,
    #[serde(default)]
    pub scale: Option<f64>,
    #[serde(default)]
    pub enable_gqa: bool,
    #[serde(default)]
    pub attn_mask: Option<MaskKind>,
}

/// The Transformer modules' non-tensor arguments: every mask kind and causal hint any of them
/// takes; [`Module::call_keys`] says which one module accepts.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct LayerCallArgs {
    #[serde(default)]
    pub is_causal: Option<bool>,
    #[serde(default)]
    pub src_is_causal: Option<bool>,
    #[serde(default)]
    pub tgt_is_causal: Option<bool>,
    #[serde(default)]
    pub memory_is_causal: Option<bool>,
    #[serde(default)]
    pub mask: Option<MaskKind>,
    #[serde(default)]
    pub src_mask: Option<MaskKind>,
    #[serde(default)]
    pub tgt_mask: Option<MaskKind>,
    #[serde(default)]
    pub memory_mask: Option<MaskKind>,
    #[serde(default)]
    pub src_key_padding_mask: Option<MaskKind>,
    #[serde(default)]
    pub tgt_key_padding_mask: Option<MaskKind>,
    #[serde(default)]
    pub memory_key_padding_mask: Option<MaskKind>,
}

/// The module of a case, with its constructor and call arguments read.
#[derive(Clone, Debug)]
#[allow(missing_docs)]
pub enum Module {
    Sdpa(SdpaCtor, SdpaCallArgs),
    Mha(MhaCtor, MhaCallArgs),
    EncoderLayer(LayerCtor, LayerCallArgs),
    DecoderLayer(LayerCtor, LayerCallArgs),
    Encoder(StackCtor, LayerCallArgs),
    Decoder(StackCtor, LayerCallArgs),
    Transformer(TransformerCtor, LayerCallArgs),
}

/// Deserialises `v` into `T`; an error names the key path under `section`.
fn typed<T: DeserializeOwned>(v: &Value, section: &str) -> Result<T> {
    serde_path_to_error::deserialize(v.clone()).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." { section.to_string() } else { format!("{section}.{path}") };
        format!("{at}: {}", e.into_inner())
    })
}

/// A size that must not exceed `max`.
fn bounded(what: &str, n: usize, max: usize) -> Result<()> {
    if n > max {
        return Err(format!("{what} = {n} exceeds this tool's limit of {max}"));
    }
    Ok(())
}

/// Parameter element counts must stay below [`MAX_PARAM_ELEMENTS`].
fn bounded_product(what: &str, dims: &[usize]) -> Result<()> {
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    match n {
        Some(n) if n <= MAX_PARAM_ELEMENTS => Ok(()),
        _ => {
            let product: Vec<String> = dims.iter().map(usize::to_string).collect();
            Err(format!(
                "{what} would have {} elements, more than {MAX_PARAM_ELEMENTS}, this tool's limit",
                product.join(" × ")
            ))
        }
    }
}

impl LayerCtor {
    fn check_sizes(&self, section: &str) -> Result<()> {
        let d = self.d_model;
        bounded_product(&format!("{section}: the attention's in_proj_weight"), &[3, d, d])?;
        bounded_product(&format!("{section}: linear1.weight"), &[self.dim_feedforward, d])
    }
}

impl Module {
    /// Reads the module of `meta`: its constructor and call, strictly, and bounds its sizes.
    pub fn parse(meta: &CaseMeta) -> Result<Module> {
        let (c, k) = (&meta.constructor, &meta.call);
        let m = match meta.module.as_str() {
            "torch.nn.functional.scaled_dot_product_attention" => {
                let call: SdpaCallArgs = typed(k, "call")?;
                if call.dropout_p != 0.0 {
                    return Err(format!(
                        "call.dropout_p = {}: PyTorch's dropout draws cannot be replayed; SDPA cases use 0",
                        call.dropout_p
                    ));
                }
                if meta.aliasing.key_is_query || meta.aliasing.value_is_key {
                    return Err("aliasing: SDPA cases store query, key and value separately".into());
                }
                Module::Sdpa(typed(c, "constructor")?, call)
            }
            "torch.nn.MultiheadAttention" | "torch.nn.modules.activation.MultiheadAttention" => {
                let ctor: MhaCtor = typed(c, "constructor")?;
                let e = ctor.embed_dim;
                bounded_product("constructor: in_proj_weight", &[3, e, e])?;
                bounded_product("constructor: k_proj_weight", &[e, ctor.kdim.unwrap_or(e)])?;
                bounded_product("constructor: v_proj_weight", &[e, ctor.vdim.unwrap_or(e)])?;
                Module::Mha(ctor, typed(k, "call")?)
            }
            "torch.nn.TransformerEncoderLayer" | "torch.nn.TransformerDecoderLayer" => {
                let ctor: LayerCtor = typed(c, "constructor")?;
                ctor.check_sizes("constructor")?;
                if meta.module.ends_with("EncoderLayer") {
                    Module::EncoderLayer(ctor, typed(k, "call")?)
                } else {
                    Module::DecoderLayer(ctor, typed(k, "call")?)
                }
            }
            "torch.nn.TransformerEncoder" | "torch.nn.TransformerDecoder" => {
                let ctor: StackCtor = typed(c, "constructor")?;
                ctor.layer.check_sizes("constructor.layer")?;
                bounded("constructor.num_layers", ctor.num_layers, MAX_LAYERS)?;
                if ctor.norm.as_ref().is_some_and(|n| !n.elementwise_affine) {
                    return Err(
                        "constructor.norm.elementwise_affine = false is not supported".into()
                    );
                }
                if meta.module.ends_with("Encoder") {
                    Module::Encoder(ctor, typed(k, "call")?)
                } else {
                    Module::Decoder(ctor, typed(k, "call")?)
                }
            }
            "torch.nn.Transformer" => {
                let ctor: TransformerCtor = typed(c, "constructor")?;
                for (key, v) in [
                    ("custom_encoder", &ctor.custom_encoder),
                    ("custom_decoder", &ctor.custom_decoder),
                ] {
                    if v.as_ref().is_some_and(|v| !v.is_null()) {
                        return Err(format!("constructor.{key} must be null"));
                    }
                }
                ctor.layer().check_sizes("constructor")?;
                bounded("constructor.num_encoder_layers", ctor.num_encoder_layers, MAX_LAYERS)?;
                bounded("constructor.num_decoder_layers", ctor.num_decoder_layers, MAX_LAYERS)?;
                Module::Transformer(ctor, typed(k, "call")?)
            }
            other => return Err(format!("unsupported module {other:?}")),
        };
        m.check_call_keys(k)?;
        m.check_device()?;
        match m.dropout() {
            Some(p) if meta.training && p != 0.0 => Err(format!(
                "constructor dropout = {p} with training = true: PyTorch's dropout draws cannot \
                 be replayed; cases in training mode use dropout 0"
            )),
            _ => Ok(m),
        }
    }

    /// The module's dropout probability (its layers'), where it has one.
    fn dropout(&self) -> Option<f64> {
        match self {
            Module::Sdpa(..) => None,
            Module::Mha(c, _) => Some(c.dropout),
            Module::EncoderLayer(c, _) | Module::DecoderLayer(c, _) => Some(c.dropout),
            Module::Encoder(c, _) | Module::Decoder(c, _) => Some(c.layer.dropout),
            Module::Transformer(c, _) => Some(c.dropout),
        }
    }

    /// The call keys this module's forward takes (PyTorch's argument names).
    pub fn call_keys(&self) -> &'static [&'static str] {
        match self {
            Module::Sdpa(..) => &["dropout_p", "is_causal", "scale", "enable_gqa", "attn_mask"],
            Module::Mha(..) => &[
                "need_weights",
                "average_attn_weights",
                "is_causal",
                "attn_mask",
                "key_padding_mask",
            ],
            Module::EncoderLayer(..) => &["src_mask", "src_key_padding_mask", "is_causal"],
            Module::Encoder(..) => &["mask", "src_key_padding_mask", "is_causal"],
            Module::DecoderLayer(..) | Module::Decoder(..) => &[
                "tgt_mask",
                "memory_mask",
                "tgt_key_padding_mask",
                "memory_key_padding_mask",
                "tgt_is_causal",
                "memory_is_causal",
            ],
            Module::Transformer(..) => &[
                "src_mask",
                "tgt_mask",
                "memory_mask",
                "src_key_padding_mask",
                "tgt_key_padding_mask",
                "memory_key_padding_mask",
                "src_is_causal",
                "tgt_is_causal",
                "memory_is_causal",
            ],
        }
    }

    /// A call key that belongs to another module is as unknown as a misspelt one.
    fn check_call_keys(&self, call: &Value) -> Result<()> {
        let Some(obj) = call.as_object() else {
            return Err("call: expected an object".into());
        };
        let keys = self.call_keys();
        for k in obj.keys() {
            if !keys.contains(&k.as_str()) {
                return Err(format!(
                    "call.{k}: unknown argument of this module's forward; expected one of {keys:?}"
                ));
            }
        }
        Ok(())
    }

    /// `device` may only be absent, null or "cpu".
    fn check_device(&self) -> Result<()> {
        let devices: Vec<(&str, &Option<String>)> = match self {
            Module::Sdpa(c, _) => vec![("constructor.device", &c.device)],
            Module::Mha(c, _) => vec![("constructor.device", &c.device)],
            Module::EncoderLayer(c, _) | Module::DecoderLayer(c, _) => {
                vec![("constructor.device", &c.device)]
            }
            Module::Encoder(c, _) | Module::Decoder(c, _) => {
                vec![
                    ("constructor.device", &c.device),
                    ("constructor.layer.device", &c.layer.device),
                ]
            }
            Module::Transformer(c, _) => vec![("constructor.device", &c.device)],
        };
        for (key, d) in devices {
            if let Some(d) = d {
                if d != "cpu" {
                    return Err(format!("{key}: only \"cpu\" is supported, got {d:?}"));
                }
            }
        }
        Ok(())
    }

    /// The dtype name and where it stands: `constructor.dtype`, or for the stacks
    /// `constructor.layer.dtype` when the top level has none. Both present and different is an
    /// error; none means float32.
    pub fn dtype_name(&self) -> Result<(String, &'static str)> {
        let (top, layer) = match self {
            Module::Sdpa(c, _) => (&c.dtype, &None),
            Module::Mha(c, _) => (&c.dtype, &None),
            Module::EncoderLayer(c, _) | Module::DecoderLayer(c, _) => (&c.dtype, &None),
            Module::Encoder(c, _) | Module::Decoder(c, _) => (&c.dtype, &c.layer.dtype),
            Module::Transformer(c, _) => (&c.dtype, &None),
        };
        match (top, layer) {
            (Some(a), Some(b))
                if a.trim_start_matches("torch.") != b.trim_start_matches("torch.") =>
            {
                Err(format!("constructor.dtype {a:?} and constructor.layer.dtype {b:?} disagree"))
            }
            (Some(a), _) => Ok((a.clone(), "constructor.dtype")),
            (None, Some(b)) => Ok((b.clone(), "constructor.layer.dtype")),
            (None, None) => Ok(("float32".into(), "the default (no dtype given)")),
        }
    }
}
