//! A parity case on disk: `case.json` read strictly, `case.safetensors`, and the checks that
//! tie them together (`docs/case-format.md`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use multihead::state_dict::load_safetensors;
use multihead::{Error, Mask, Result};
use serde_json::Value;

use crate::meta::{CaseMeta, MaskKind, Module};
use crate::tolerance::Tolerance;

/// `case.json` files larger than this are refused before they are read.
const MAX_JSON_BYTES: u64 = 16 << 20;

/// A loaded parity case.
#[derive(Debug)]
pub struct Case {
    /// The case directory.
    pub dir: PathBuf,
    /// `case.json`, typed.
    pub meta: CaseMeta,
    /// The module with its constructor and call arguments.
    pub module: Module,
    /// The case's dtype.
    pub dtype: DType,
    /// Every tensor of `case.safetensors`.
    pub tensors: HashMap<String, Tensor>,
}

pub(crate) fn case_err(dir: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: dir.to_path_buf(), msg: msg.into() }
}

/// The inputs a module's case may store (case-format.md §3), by PyTorch class path.
fn known_inputs(module: &str) -> &'static [&'static str] {
    const DECODER: &[&str] = &[
        "tgt",
        "memory",
        "tgt_mask",
        "memory_mask",
        "tgt_key_padding_mask",
        "memory_key_padding_mask",
    ];
    match module.rsplit('.').next().unwrap_or(module) {
        "MultiheadAttention" => &["query", "key", "value", "attn_mask", "key_padding_mask"],
        "scaled_dot_product_attention" => &["query", "key", "value", "attn_mask"],
        "TransformerEncoderLayer" => &["src", "src_mask", "src_key_padding_mask"],
        "TransformerEncoder" => &["src", "mask", "src_key_padding_mask"],
        "TransformerDecoderLayer" | "TransformerDecoder" => DECODER,
        "Transformer" => &[
            "src",
            "tgt",
            "src_mask",
            "tgt_mask",
            "memory_mask",
            "src_key_padding_mask",
            "tgt_key_padding_mask",
            "memory_key_padding_mask",
        ],
        _ => &[],
    }
}

/// `suggested_tolerance` is a tree of objects (per dtype, per forward or gradient) whose
/// `rtol` and `atol` are non-negative numbers: anything else is an error naming where it is,
/// not a silent fall-back to the default tolerances.
fn check_tolerance(v: &Value, at: &str) -> std::result::Result<(), String> {
    let Some(map) = v.as_object() else {
        return Err(format!("{at} must be an object of rtol/atol entries, got {v}"));
    };
    for (k, x) in map {
        let here = format!("{at}.{k}");
        match k.as_str() {
            "rtol" | "atol" => match x.as_f64() {
                Some(t) if t.is_finite() && t >= 0.0 => {}
                _ => return Err(format!("{here} must be a non-negative number, got {x}")),
            },
            _ => check_tolerance(x, &here)?,
        }
    }
    Ok(())
}

/// The prefix of a bfloat16 case's float64 reference results.
pub const REF64: &str = "ref64.";

/// A dtype name of the case format.
fn dtype_of(name: &str) -> Option<DType> {
    match name.trim_start_matches("torch.") {
        "float32" | "float" => Some(DType::F32),
        "float64" | "double" => Some(DType::F64),
        "bfloat16" => Some(DType::BF16),
        _ => None,
    }
}

/// Whether `input.<name>` is a mask (its dtype is the mask's own).
fn is_mask_name(name: &str) -> bool {
    name.ends_with("mask")
}

impl Case {
    /// Reads `case.json` and `case.safetensors` from `dir`, strictly: unknown or missing keys,
    /// sizes over the limits and tensors whose dtype is not the case's are errors.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let json_path = dir.join("case.json");
        let meta = std::fs::metadata(&json_path)
            .map_err(|e| case_err(dir, format!("cannot read case.json: {e}")))?;
        if !meta.is_file() {
            // A FIFO that nobody writes would be waited on for ever.
            return Err(case_err(
                dir,
                "case.json is not a regular file (a FIFO, a socket, a device or a directory)"
                    .to_string(),
            ));
        }
        let size = meta.len();
        if size > MAX_JSON_BYTES {
            return Err(case_err(
                dir,
                format!("case.json has {size} bytes, over the limit of {MAX_JSON_BYTES}"),
            ));
        }
        let text = std::fs::read_to_string(&json_path)
            .map_err(|e| case_err(dir, format!("cannot read case.json: {e}")))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| case_err(dir, format!("case.json is not valid JSON: {e}")))?;
        // Read and check case.json before the tensors: a bad case costs no tensor memory.
        Self::parse_meta(dir, value.clone())?;
        let tensors = load_safetensors(dir.join("case.safetensors"), &Device::Cpu)?;
        Self::from_parts(dir, value, tensors)
    }

    fn parse_meta(dir: &Path, value: Value) -> Result<(CaseMeta, Module, DType, &'static str)> {
        if !value.is_object() {
            let kind = match value {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                _ => "null",
            };
            return Err(case_err(
                dir,
                format!(
                    "case.json must be a JSON object (format_version, module, ...), got {kind}"
                ),
            ));
        }
        // The module first: a case for another module fails on that, not on its other keys.
        if let Some(m) = value.get("module").and_then(Value::as_str) {
            if !crate::meta::SUPPORTED_MODULES.contains(&m) {
                return Err(case_err(
                    dir,
                    format!(
                        "case.json: unsupported module {m:?}; supported: {:?}",
                        crate::meta::SUPPORTED_MODULES
                    ),
                ));
            }
        }
        let meta: CaseMeta = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let at = if path == "." { String::new() } else { format!("{path}: ") };
            case_err(dir, format!("case.json: {at}{}", e.inner()))
        })?;
        if meta.format_version != 1 {
            return Err(case_err(
                dir,
                format!("unsupported format_version {}, expected 1", meta.format_version),
            ));
        }
        if let Some(st) = &meta.suggested_tolerance {
            check_tolerance(st, "suggested_tolerance")
                .map_err(|m| case_err(dir, format!("case.json: {m}")))?;
        }
        let module = Module::parse(&meta).map_err(|m| case_err(dir, format!("case.json: {m}")))?;
        let (name, source) =
            module.dtype_name().map_err(|m| case_err(dir, format!("case.json: {m}")))?;
        let dtype = dtype_of(&name).ok_or_else(|| {
            case_err(
                dir,
                format!("{source}: unsupported dtype {name:?}; use float32, float64 or bfloat16"),
            )
        })?;
        Ok((meta, module, dtype, source))
    }

    /// A case from its `case.json` value and its tensors (what [`Case::load`] reads from
    /// disk), with the same checks.
    pub fn from_parts(
        dir: impl AsRef<Path>,
        case_json: Value,
        tensors: HashMap<String, Tensor>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let (meta, module, dtype, source) = Self::parse_meta(dir, case_json)?;
        let case = Self { dir: dir.to_path_buf(), meta, module, dtype, tensors };
        case.check_tensor_dtypes(source)?;
        case.check_declared_tensors()?;
        case.check_input_names()?;
        Ok(case)
    }

    /// The `tensors` table of case.json must agree with the file: each tensor it describes
    /// that the file holds has the declared shape and (for a dtype name this tool knows) the
    /// declared dtype. A table that disagrees with the tensors means a case assembled by hand
    /// or damaged, whose numbers cannot be trusted. (A declared tensor the file lacks is left
    /// to the checks that need it, which name every missing parameter or input.)
    fn check_declared_tensors(&self) -> Result<()> {
        let mut names: Vec<&String> = self.meta.tensors.keys().collect();
        names.sort();
        for name in names {
            let declared = &self.meta.tensors[name];
            let Some(t) = self.tensors.get(name) else { continue };
            if let Some(shape) = declared.shape.as_ref().filter(|s| s.as_slice() != t.dims()) {
                let msg = format!(
                    "case.json declares {name} with shape {shape:?} but case.safetensors holds \
                     {:?}; make them agree",
                    t.dims()
                );
                return Err(case_err(&self.dir, msg));
            }
            let known = declared.dtype.as_deref().and_then(dtype_of_name);
            if let Some(dt) = known.filter(|&dt| dt != t.dtype()) {
                let msg = format!(
                    "case.json declares {name} as {dt:?} but case.safetensors holds {:?}; make \
                     them agree",
                    t.dtype()
                );
                return Err(case_err(&self.dir, msg));
            }
        }
        Ok(())
    }

    /// Every `input.<name>` must be one of the module's inputs (case-format.md §3): a
    /// misspelled mask would otherwise be left out of the call without a word.
    fn check_input_names(&self) -> Result<()> {
        let known = known_inputs(&self.meta.module);
        let mut unknown: Vec<&str> = self
            .tensors
            .keys()
            .filter_map(|k| k.strip_prefix("input."))
            .filter(|n| !known.contains(n))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        unknown.sort();
        Err(case_err(
            &self.dir,
            format!(
                "unexpected input.{} for {}; its inputs are {known:?}",
                unknown.join(", input."),
                self.meta.module
            ),
        ))
    }

    /// Every float tensor of the case (parameters, inputs, gradients, expected results) must
    /// have the case's dtype; a mask is u8 or the case's float dtype; the float64 references
    /// of a bfloat16 or autocast case (`ref64.*`) are float64.
    fn check_tensor_dtypes(&self, source: &str) -> Result<()> {
        let reduced = self.dtype == DType::BF16 || self.autocast()?.is_some();
        for (name, t) in &self.tensors {
            let mask = name.strip_prefix("input.").is_some_and(is_mask_name);
            let ok = if name.starts_with(REF64) {
                reduced && t.dtype() == DType::F64
            } else if mask {
                t.dtype() == DType::U8 || t.dtype() == self.dtype
            } else {
                t.dtype() == self.dtype
            };
            if !ok && name.starts_with(REF64) {
                let msg = match reduced {
                    true => format!(
                        "{name} is stored as {:?}; float64 references must be F64",
                        t.dtype()
                    ),
                    false => format!(
                        "{name}: float64 references belong to bfloat16 or autocast cases, and this \
                         case is {:?} without autocast; remove the ref64.* tensors",
                        self.dtype
                    ),
                };
                return Err(case_err(&self.dir, msg));
            }
            if !ok {
                return Err(case_err(
                    &self.dir,
                    format!(
                        "{name} is stored as {:?} but the case dtype ({source}) is {:?}",
                        t.dtype(),
                        self.dtype
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The dtype of the `torch.autocast` the case's forward ran in (the optional `autocast`
    /// key, docs/case-format.md), `None` without one; an unknown name is an error.
    pub fn autocast(&self) -> Result<Option<DType>> {
        match self.meta.autocast.as_deref() {
            None => Ok(None),
            Some("bfloat16") => Ok(Some(DType::BF16)),
            Some("float16") => Ok(Some(DType::F16)),
            Some(other) => Err(case_err(
                &self.dir,
                format!(
                    "case.json: autocast is \"{other}\"; use \"bfloat16\", \"float16\" or leave it out"
                ),
            )),
        }
    }

    /// The module's PyTorch class path.
    pub fn module_name(&self) -> &str {
        &self.meta.module
    }

    /// The case's dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The tolerance for an `expect.*` tensor: `suggested_tolerance` when the case gives one
    /// for this dtype, otherwise [`Tolerance::for_dtype`].
    pub fn tolerance(&self, grad: bool) -> Tolerance {
        // An autocast case's results have bf16 products: its tolerances are bfloat16's.
        let dtype = if self.meta.autocast.is_some() { DType::BF16 } else { self.dtype };
        let fallback = Tolerance::for_dtype(dtype, grad);
        let Some(st) = &self.meta.suggested_tolerance else {
            return fallback;
        };
        let dname = match dtype {
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            _ => "float32",
        };
        let per_dtype = st.get(dname).unwrap_or(st);
        let kind = if grad {
            per_dtype
                .get("grad")
                .or_else(|| per_dtype.get("gradients"))
                .or_else(|| per_dtype.get("backward"))
        } else {
            per_dtype.get("forward")
        };
        let kind = kind.unwrap_or(per_dtype);
        match (kind.get("rtol").and_then(Value::as_f64), kind.get("atol").and_then(Value::as_f64)) {
            (Some(rel), Some(abs)) if rel >= 0.0 && abs >= 0.0 => Tolerance { rel, abs },
            _ => fallback,
        }
    }

    /// A tensor of the case by name.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// The `param.*` tensors by PyTorch key.
    pub fn params(&self) -> HashMap<String, Tensor> {
        self.tensors
            .iter()
            .filter_map(|(k, t)| k.strip_prefix("param.").map(|p| (p.to_string(), t.clone())))
            .collect()
    }

    /// `input.<name>` as a trainable variable.
    pub(crate) fn input_var(&self, name: &str) -> Result<Var> {
        let t = self
            .tensor(&format!("input.{name}"))
            .ok_or_else(|| case_err(&self.dir, format!("missing tensor input.{name}")))?;
        Ok(Var::from_tensor(t)?)
    }

    /// `input.<name>` as a mask: the kind from `call`, else the tensor's logical dtype. A kind
    /// in `call` without the tensor, or the tensor with `call` saying null, is an error.
    pub(crate) fn mask(&self, name: &str, kind: Option<MaskKind>) -> Result<Option<Mask>> {
        let t = self.tensor(&format!("input.{name}"));
        let said = self.meta.call.get(name);
        let t = match (t, kind, said) {
            (None, Some(k), _) => {
                return Err(case_err(
                    &self.dir,
                    format!("call.{name} is {k:?} but input.{name} is missing"),
                ))
            }
            (None, None, _) => return Ok(None),
            (Some(_), None, Some(Value::Null)) => {
                return Err(case_err(
                    &self.dir,
                    format!("input.{name} is stored but call.{name} is null"),
                ))
            }
            (Some(t), _, _) => t,
        };
        let logical = self
            .meta
            .tensors
            .get(&format!("input.{name}"))
            .and_then(|m| m.logical_dtype.as_deref())
            .map(|l| l.trim_start_matches("torch."));
        let is_bool = match (kind, logical) {
            (Some(k), Some(l)) if (k == MaskKind::Bool) != (l == "bool") => {
                return Err(case_err(
                    &self.dir,
                    format!(
                    "call.{name} is {:?} but input.{name} has logical_dtype {l:?}; make them agree",
                    if k == MaskKind::Bool { "bool" } else { "float" }
                ),
                ))
            }
            (Some(MaskKind::Bool), _) => true,
            (Some(MaskKind::Float), _) => false,
            (None, Some("bool")) => true,
            _ => t.dtype() == DType::U8,
        };
        if !is_bool {
            if t.dtype() == DType::U8 {
                return Err(case_err(
                    &self.dir,
                    format!(
                        "input.{name} is stored as uint8 (a bool mask) but is read as a float mask; say \"bool\" in call.{name}"
                    ),
                ));
            }
            return Ok(Some(Mask::Float(t.clone())));
        }
        if t.dtype() != DType::U8 {
            // A float tensor read as bool: only 0 and 1 say which positions are masked; any
            // other value (-inf, -1e9) means a float mask was mislabelled.
            let values = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            if let Some(v) = values.iter().find(|&&v| v != 0.0 && v != 1.0) {
                return Err(case_err(
                    &self.dir,
                    format!(
                        "input.{name} is read as a bool mask but is stored as {:?} and holds {v}, not only 0 and 1; store a bool mask as uint8, or say \"float\" in call.{name}",
                        t.dtype()
                    ),
                ));
            }
        }
        Ok(Some(Mask::Bool(t.to_dtype(DType::U8)?)))
    }
}

/// The dtype a case.json `dtype` entry names (PyTorch's names, or safetensors' own), `None`
/// for one this tool does not know (informative only).
fn dtype_of_name(name: &str) -> Option<DType> {
    match name {
        "float32" | "F32" => Some(DType::F32),
        "float64" | "F64" => Some(DType::F64),
        "bfloat16" | "BF16" => Some(DType::BF16),
        "float16" | "F16" => Some(DType::F16),
        "uint8" | "U8" => Some(DType::U8),
        _ => None,
    }
}
