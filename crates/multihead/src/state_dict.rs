//! PyTorch state_dicts: safetensors in and out, strict loading by PyTorch's keys.
//!
//! A module here is built from a candle [`VarBuilder`] and asks for each parameter by its
//! PyTorch key, so the builder *is* the map of the checkpoint. Strict loading puts the file's
//! tensors into a [`VarMap`] (so they train), builds the module from it, and then compares the
//! keys the module asked for with the keys the file has.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Init, VarBuilder, VarMap};

use crate::error::{Error, Result};

/// A module whose parameters have PyTorch state_dict keys.
pub trait NamedParameters {
    /// Every parameter with its PyTorch key, in PyTorch's `state_dict()` order.
    fn named_parameters(&self) -> Vec<(String, Tensor)>;
}

/// Fetches a parameter from `vb` by key, creating it with `init` when the builder creates
/// variables, and turns a shape mismatch into [`Error::StateDictShape`].
pub(crate) fn get_param(
    vb: &VarBuilder,
    shape: &[usize],
    name: &str,
    init: Init,
) -> Result<Tensor> {
    let full =
        if vb.prefix().is_empty() { name.to_string() } else { format!("{}.{name}", vb.prefix()) };
    match vb.get_with_hints(shape, name, init) {
        Ok(t) => {
            if t.dims() != shape {
                return Err(Error::StateDictShape {
                    key: full,
                    expected: shape.to_vec(),
                    got: t.dims().to_vec(),
                });
            }
            Ok(t)
        }
        Err(e) => {
            let msg = e.to_string();
            if msg.contains("shape mismatch") {
                let got = vb.get_unchecked(name).map(|t| t.dims().to_vec()).unwrap_or_default();
                Err(Error::StateDictShape { key: full, expected: shape.to_vec(), got })
            } else {
                Err(Error::Candle(e))
            }
        }
    }
}

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: path.to_path_buf(), msg: msg.into() }
}

/// Reads every tensor of a safetensors file.
///
/// Bool tensors (which candle has no dtype for) are read as `u8` with `1` for `True`, the form
/// [`Mask::Bool`](crate::Mask::Bool) takes. Integer tensors other than `u8`, `u32` and `i64`
/// are rejected with a clear error.
pub fn load_safetensors(
    path: impl AsRef<Path>,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| file_err(path, format!("not a safetensors file: {e}")))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = view.data();
        use safetensors::Dtype as S;
        let t = match view.dtype() {
            S::BOOL | S::U8 => Tensor::from_raw_buffer(data, DType::U8, &shape, device)?,
            S::F32 => Tensor::from_raw_buffer(data, DType::F32, &shape, device)?,
            S::F64 => Tensor::from_raw_buffer(data, DType::F64, &shape, device)?,
            S::F16 => Tensor::from_raw_buffer(data, DType::F16, &shape, device)?,
            S::BF16 => Tensor::from_raw_buffer(data, DType::BF16, &shape, device)?,
            S::U32 => Tensor::from_raw_buffer(data, DType::U32, &shape, device)?,
            S::I64 => Tensor::from_raw_buffer(data, DType::I64, &shape, device)?,
            other => {
                return Err(file_err(path, format!("tensor {name}: unsupported dtype {other:?}")))
            }
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// Writes named tensors to a safetensors file under their names (PyTorch's keys).
pub fn save_safetensors<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    path: impl AsRef<Path>,
) -> Result<()> {
    let path = path.as_ref();
    let map: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, t)| Ok((k.to_string(), t.contiguous()?)))
        .collect::<Result<_>>()?;
    candle_core::safetensors::save(&map, path)
        .map_err(|e| file_err(path, format!("cannot write: {e}")))
}

/// Saves a module's parameters under PyTorch's keys, like
/// `safetensors.torch.save_file(module.state_dict(), path)`.
pub fn save_state_dict<M: NamedParameters>(module: &M, path: impl AsRef<Path>) -> Result<()> {
    let params = module.named_parameters();
    save_safetensors(params.iter().map(|(k, t)| (k.as_str(), t)), path)
}

/// Compares the keys a module has with the keys a state_dict has, as PyTorch's strict
/// `load_state_dict` does.
pub fn check_keys<'a>(
    module_keys: impl IntoIterator<Item = &'a str>,
    state_keys: impl IntoIterator<Item = &'a str>,
) -> Result<()> {
    let m: BTreeSet<&str> = module_keys.into_iter().collect();
    let s: BTreeSet<&str> = state_keys.into_iter().collect();
    let missing: Vec<String> = m.difference(&s).map(|k| k.to_string()).collect();
    let unexpected: Vec<String> = s.difference(&m).map(|k| k.to_string()).collect();
    if missing.is_empty() && unexpected.is_empty() {
        Ok(())
    } else {
        Err(Error::StateDictKeys { missing, unexpected })
    }
}

/// Loads a state_dict strictly: puts every tensor into a fresh [`VarMap`] as a trainable
/// variable of `dtype`, builds the module from it with `build`, and fails with
/// [`Error::StateDictKeys`] if the module and the state_dict do not have the same keys.
///
/// Returns the module and the `VarMap` that holds its parameters (hand its `all_vars()` to an
/// optimiser to train).
///
/// # Example
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::{state_dict, MhaConfig, MultiheadAttention, NamedParameters};
///
/// let dev = Device::Cpu;
/// let vm = VarMap::new();
/// let mha = MultiheadAttention::new(MhaConfig::new(8, 2), VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
/// let state: std::collections::HashMap<_, _> = mha.named_parameters().into_iter().collect();
/// let (copy, _vars) = state_dict::load_strict(&state, DType::F32, &dev, |vb| {
///     MultiheadAttention::new(MhaConfig::new(8, 2), vb)
/// })?;
/// assert_eq!(copy.named_parameters().len(), 4);
/// # Ok::<(), multihead::Error>(())
/// ```
pub fn load_strict<M: NamedParameters>(
    state: &HashMap<String, Tensor>,
    dtype: DType,
    device: &Device,
    build: impl FnOnce(VarBuilder) -> Result<M>,
) -> Result<(M, VarMap)> {
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap_or_else(|e| e.into_inner());
        for (k, t) in state {
            let t = t.to_dtype(dtype)?.to_device(device)?;
            data.insert(k.clone(), Var::from_tensor(&t)?);
        }
    }
    let module = build(VarBuilder::from_varmap(&vm, dtype, device)).map_err(|e| match e {
        Error::StateDictShape { key, expected, got } if got.is_empty() => {
            let got = state.get(&key).map(|t| t.dims().to_vec()).unwrap_or_default();
            Error::StateDictShape { key, expected, got }
        }
        other => other,
    })?;
    let names = module.named_parameters();
    check_keys(names.iter().map(|(k, _)| k.as_str()), state.keys().map(|k| k.as_str()))?;
    Ok((module, vm))
}

/// [`load_strict`] from a safetensors file.
pub fn load_strict_file<M: NamedParameters>(
    path: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
    build: impl FnOnce(VarBuilder) -> Result<M>,
) -> Result<(M, VarMap)> {
    let state = load_safetensors(path, device)?;
    load_strict(&state, dtype, device, build)
}
