//! Renaming state_dict keys between a PyTorch model's names and a port's, both ways.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::error::{Error, Result};

/// Renames of dotted key segments between a PyTorch file's names and a module's, applied one
/// way on loading ([`KeyMap::to_module`]) and the other on saving ([`KeyMap::to_file`]), so a
/// port may use this crate's modules for PyTorch modules that name their parts differently
/// (torchvision's ViT `EncoderBlock` holds `ln_1`, `self_attention` and `mlp.0` where
/// `TransformerEncoderLayer` holds `norm1`, `self_attn` and `linear1`) and hand the weights
/// back under PyTorch's names.
///
/// A rename matches whole segments: `rename("mlp.0", "linear1")` turns
/// `encoder.layers.encoder_layer_0.mlp.0.weight` into `encoder.layers.encoder_layer_0.linear1.weight`
/// but leaves `mlp.00.weight` and `my_mlp.0` alone. At each segment the first rename that
/// matches applies, then matching goes on after it. Two keys that would get the same name
/// are an error naming both, and so is a map that would not turn a renamed key back into its
/// original (the map is checked both ways on the keys it is given).
///
/// # Example
/// ```
/// use multihead::state_dict::KeyMap;
///
/// let map = KeyMap::new().rename("ln_1", "norm1").rename("mlp.0", "linear1");
/// let module_key = map.to_module_key("encoder.layers.encoder_layer_0.mlp.0.weight");
/// assert_eq!(module_key, "encoder.layers.encoder_layer_0.linear1.weight");
/// assert_eq!(map.to_file_key(&module_key), "encoder.layers.encoder_layer_0.mlp.0.weight");
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyMap {
    /// `(file's segments, module's segments)`.
    renames: Vec<(Vec<String>, Vec<String>)>,
}

/// Which way a map is applied.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    ToModule,
    ToFile,
}

impl KeyMap {
    /// A map that renames nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a rename: the segments `file` in a file's keys are `module` in the module's.
    /// Both are dotted runs of whole segments (`"ln_1"`, `"mlp.0"`), neither empty: a rename
    /// with an empty side or an empty segment (`""`, `"mlp..0"`, `".ln_1"`) matches no key,
    /// and [`KeyMap::to_module`] and [`KeyMap::to_file`] refuse the map with an error naming it.
    pub fn rename(mut self, file: &str, module: &str) -> Self {
        let split = |s: &str| s.split('.').map(str::to_string).collect::<Vec<_>>();
        self.renames.push((split(file), split(module)));
        self
    }

    /// The renames, as `(file, module)` pairs.
    pub fn renames(&self) -> Vec<(String, String)> {
        self.renames.iter().map(|(f, m)| (f.join("."), m.join("."))).collect()
    }

    fn apply(&self, key: &str, way: Way) -> String {
        let segs: Vec<&str> = key.split('.').collect();
        let mut out: Vec<&str> = Vec::with_capacity(segs.len());
        let mut i = 0;
        'outer: while i < segs.len() {
            for (file, module) in &self.renames {
                let (from, to) = if way == Way::ToModule { (file, module) } else { (module, file) };
                let n = from.len();
                if n > 0
                    && !from.iter().any(String::is_empty)
                    && i + n <= segs.len()
                    && segs[i..i + n].iter().zip(from).all(|(a, b)| *a == b.as_str())
                {
                    out.extend(to.iter().map(String::as_str));
                    i += n;
                    continue 'outer;
                }
            }
            out.push(segs[i]);
            i += 1;
        }
        out.join(".")
    }

    /// A file's key as the module names it.
    pub fn to_module_key(&self, file_key: &str) -> String {
        self.apply(file_key, Way::ToModule)
    }

    /// A module's key as the file names it.
    pub fn to_file_key(&self, module_key: &str) -> String {
        self.apply(module_key, Way::ToFile)
    }

    /// A state_dict read from a PyTorch file, renamed for the module (then load it with
    /// [`load_strict`](crate::state_dict::load_strict) or [`load`](crate::state_dict::load)).
    ///
    /// Errors: two keys renamed to one, or a key the map does not turn back into itself.
    pub fn to_module(&self, state: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        self.check_renames("KeyMap::to_module")?;
        let mut keys: Vec<&String> = state.keys().collect();
        keys.sort();
        let mut seen: HashMap<String, &String> = HashMap::with_capacity(state.len());
        let mut out = HashMap::with_capacity(state.len());
        for k in keys {
            let renamed = self.checked(k, Way::ToModule)?;
            if let Some(first) = seen.insert(renamed.clone(), k) {
                return Err(collision("KeyMap::to_module", first, k, &renamed));
            }
            out.insert(renamed, state[k].clone());
        }
        Ok(out)
    }

    /// A module's named parameters renamed for the file (for
    /// [`save_safetensors`](crate::state_dict::save_safetensors)), in their order.
    ///
    /// Errors as [`KeyMap::to_module`]'s.
    pub fn to_file(&self, named: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        self.check_renames("KeyMap::to_file")?;
        let mut seen = HashMap::with_capacity(named.len());
        let mut out = Vec::with_capacity(named.len());
        for (k, t) in named {
            let renamed = self.checked(&k, Way::ToFile)?;
            if let Some(first) = seen.insert(renamed.clone(), k.clone()) {
                return Err(collision("KeyMap::to_file", &first, &k, &renamed));
            }
            out.push((renamed, t));
        }
        Ok(out)
    }

    /// Every rename has two sides of whole, non-empty segments.
    fn check_renames(&self, op: &'static str) -> Result<()> {
        let bad = |segs: &[String]| segs.iter().any(String::is_empty);
        match self.renames.iter().find(|(f, m)| bad(f) || bad(m)) {
            None => Ok(()),
            Some((f, m)) => Err(Error::Config {
                op,
                arg: "renames",
                msg: format!(
                    "rename({:?}, {:?}) has an empty segment, so it would match no key: name whole dotted segments on both sides, as rename(\"mlp.0\", \"linear1\")",
                    f.join("."),
                    m.join(".")
                ),
            }),
        }
    }

    /// `key` renamed `way`, checked to come back unchanged the other way.
    fn checked(&self, key: &str, way: Way) -> Result<String> {
        let renamed = self.apply(key, way);
        let back =
            self.apply(&renamed, if way == Way::ToModule { Way::ToFile } else { Way::ToModule });
        if back != key {
            return Err(Error::Config {
                op: "KeyMap",
                arg: "renames",
                msg: format!(
                    "{key:?} becomes {renamed:?}, which the other way becomes {back:?}, not {key:?}: make the renames one-to-one (a module name that is also a file name, or renames that overlap)"
                ),
            });
        }
        Ok(renamed)
    }
}

fn collision(op: &'static str, a: &str, b: &str, renamed: &str) -> Error {
    Error::Config {
        op,
        arg: "renames",
        msg: format!(
            "{a:?} and {b:?} would both be named {renamed:?}: make the renames one-to-one"
        ),
    }
}
