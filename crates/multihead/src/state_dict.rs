//! PyTorch state_dicts: safetensors in and out, strict loading by PyTorch's keys.
//!
//! A module here is built from a candle [`VarBuilder`] and asks for each parameter by its
//! PyTorch key, so the builder *is* the map of the checkpoint. Strict loading puts the file's
//! tensors into a [`VarMap`] (so they train), builds the module from it, and then compares the
//! keys the module asked for with the keys the file has.
//!
//! [`VarBuilder`]: https://docs.rs/candle-nn/0.11/candle_nn/var_builder/type.VarBuilder.html
//! [`VarMap`]: https://docs.rs/candle-nn/0.11/candle_nn/var_map/struct.VarMap.html

pub use crate::key_map::KeyMap;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

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
    // The key in the message: which of a module's sizes is wrong.
    let named = |e: Error| match e {
        Error::Alloc { op, what, msg } => {
            Error::Alloc { op, what, msg: format!("{full}: {msg}; check the module's sizes") }
        }
        e => e,
    };
    crate::alloc::elements("get_param", "parameter", shape).map_err(named)?;
    if !vb.contains_tensor(name) {
        // The builder will create it: make sure it can be allocated first.
        crate::alloc::ensure(
            "get_param",
            "parameter",
            shape,
            vb.dtype(),
            1,
            "this parameter is too large for this machine",
        )
        .map_err(named)?;
    }
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
            let got = vb
                .get_unchecked(name)
                .map(|t| t.dims().to_vec())
                .ok()
                .or_else(|| mismatched_shape(&e));
            match got {
                Some(got) if e.to_string().contains("shape mismatch") => {
                    Err(Error::StateDictShape { key: full, expected: shape.to_vec(), got })
                }
                _ => Err(Error::Candle(e)),
            }
        }
    }
}

/// The shape a builder found under a key when it refused the asked one: candle's
/// `UnexpectedShape` (the safetensors and tensor-map backends), or the `[..] <> [..]` message of
/// a `VarMap` already holding the key (`get_unchecked` is not implemented there).
fn mismatched_shape(e: &candle_core::Error) -> Option<Vec<usize>> {
    match e {
        candle_core::Error::UnexpectedShape { got, .. } => Some(got.dims().to_vec()),
        candle_core::Error::WithBacktrace { inner, .. } => mismatched_shape(inner),
        other => {
            let msg = other.to_string();
            let (_, tail) = msg.rsplit_once(" <> ")?;
            let inner = tail.trim().strip_prefix('[')?.strip_suffix(']')?;
            inner
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(|d| d.parse::<usize>().ok())
                .collect()
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
/// are rejected with a clear error. ([`load_file`] and [`load_strict_file`] accept such
/// tensors under keys the module does not have, as PyTorch does, and report them as
/// unexpected.)
///
/// A pipe (a FIFO, `<(zcat model.safetensors.gz)`) is read whole, up to half the machine's
/// memory. A FIFO is opened without waiting for its writer; if nothing has been written to it
/// within five seconds, that is an error rather than a wait for ever.
pub fn load_safetensors(
    path: impl AsRef<Path>,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let path = path.as_ref();
    let (tensors, unsupported) = read_safetensors(path, device)?;
    match unsupported.into_iter().next() {
        Some((name, dtype)) => {
            Err(file_err(path, format!("tensor {name}: unsupported dtype {dtype}")))
        }
        None => Ok(tensors),
    }
}

/// The tensors of a safetensors file that candle can hold, and the names and dtypes of those
/// it cannot (other integer widths, 8-bit floats): each read straight into its own storage
/// (`crate::st_read`).
fn read_safetensors(
    path: &Path,
    device: &Device,
) -> Result<(HashMap<String, Tensor>, BTreeMap<String, String>)> {
    crate::st_read::read(path, device)
}

/// Writes named tensors to a safetensors file under their names (PyTorch's keys).
///
/// The file is written beside its target and renamed over it, so that a file being read (or
/// mapped) is never truncated under its reader. A symbolic link is followed (the file it
/// names is replaced, the link kept); a replaced file keeps its permissions, a new one gets
/// `rw-r--r--`; a path that names something other than a regular file (a directory, a device,
/// a pipe) is an error, and so is a name given twice.
pub fn save_safetensors<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    path: impl AsRef<Path>,
) -> Result<()> {
    let path = path.as_ref();
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for (k, t) in tensors {
        // A view (a transpose, a broadcast `expand`) is written at its full size: that copy,
        // checked before it is made (a 4 TiB broadcast view aborted the process before
        // 2026-12-07).
        if !t.is_contiguous() {
            let hint = "a view is written at its full size; save the tensor it views";
            crate::alloc::ensure("save_safetensors", "tensor", t.dims(), t.dtype(), 1, hint)?;
        }
        // The header's reserved key: a tensor of that name makes a file no reader can open.
        if k == "__metadata__" {
            let msg = "cannot write a tensor named \"__metadata__\": the name is reserved for \
                       the file's metadata; rename the tensor";
            return Err(file_err(path, msg.to_string()));
        }
        // A file holds one tensor per name: a second one would silently replace the first.
        if map.insert(k.to_string(), t.contiguous()?).is_some() {
            return Err(file_err(path, format!("cannot write: the name {k:?} is given twice")));
        }
    }
    let (target, mode) = save_target(path)?;
    candle_core::safetensors::save(&map, &target)
        .map_err(|e| file_err(path, format!("cannot write: {e}")))?;
    set_mode(&target, mode).map_err(|e| file_err(path, format!("cannot set permissions: {e}")))
}

/// The regular file a save replaces (symbolic links followed) and the permissions it should
/// end with: the replaced file's, or `0o644` for a new one.
fn save_target(path: &Path) -> Result<(std::path::PathBuf, Option<std::fs::Permissions>)> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => {
            let real = std::fs::canonicalize(path)
                .map_err(|e| file_err(path, format!("cannot resolve: {e}")))?;
            Ok((real, Some(m.permissions())))
        }
        Ok(_) => Err(file_err(
            path,
            "cannot write: not a regular file (a directory, device or pipe); give a file path",
        )),
        // A link to nothing yet: the file it names is created.
        Err(_) => match std::fs::read_link(path) {
            Ok(dest) => {
                let dest = match path.parent() {
                    Some(dir) if dest.is_relative() => dir.join(dest),
                    _ => dest,
                };
                Ok((dest, None))
            }
            Err(_) => Ok((path.to_path_buf(), None)),
        },
    }
}

#[cfg(unix)]
fn set_mode(path: &Path, mode: Option<std::fs::Permissions>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = mode.unwrap_or_else(|| std::fs::Permissions::from_mode(0o644));
    std::fs::set_permissions(path, mode)
}

#[cfg(not(unix))]
fn set_mode(_path: &Path, _mode: Option<std::fs::Permissions>) -> std::io::Result<()> {
    Ok(())
}

/// Saves what a load built: the parameters in `vars` (the `VarMap` that
/// [`load_strict`], [`load`] and the file loaders return, trained or not) under their keys, in
/// the order of `module`'s [`NamedParameters`], like
/// `safetensors.torch.save_file(model.state_dict(), path)`.
///
/// The module's `named_parameters` must list exactly the keys it loaded: one it asked for and
/// does not list (a `class_token` read with `vb.get` and left out of a hand-written list) or
/// one it lists and never loaded is an error naming the keys, not a file PyTorch's strict load
/// refuses later.
///
/// # Example
/// ```
/// use std::collections::HashMap;
/// use candle_core::{DType, Device, Tensor};
/// use multihead::{state_dict, Linear, NamedParameters};
///
/// struct Head {
///     token: Tensor,
///     proj: Linear,
/// }
/// impl NamedParameters for Head {
///     fn named_parameters(&self) -> Vec<(String, Tensor)> {
///         state_dict::prefixed("proj", &self.proj) // forgot "token"
///     }
/// }
/// let dev = Device::Cpu;
/// let mut state = HashMap::new();
/// state.insert("token".to_string(), Tensor::zeros(4, DType::F32, &dev)?);
/// state.insert("proj.weight".to_string(), Tensor::zeros((2, 4), DType::F32, &dev)?);
/// let (head, vars) = state_dict::load_strict(&state, DType::F32, &dev, |vb| {
///     Ok(Head { token: vb.get(4, "token")?, proj: Linear::new(4, 2, false, vb.pp("proj"))? })
/// })?;
/// let path = std::env::temp_dir().join("multihead_save_loaded_doc.safetensors");
/// let err = state_dict::save_loaded(&head, &vars, &path).unwrap_err();
/// assert!(err.to_string().contains("[\"token\"]"));
/// # Ok::<(), multihead::Error>(())
/// ```
pub fn save_loaded<M: NamedParameters>(
    module: &M,
    vars: &VarMap,
    path: impl AsRef<Path>,
) -> Result<()> {
    save_loaded_with(module, vars, &KeyMap::new(), path)
}

/// The prefix `p` such that the VarMap's keys are exactly the module's keys under `p.`: a
/// module built under `vb.pp(p)`.
fn common_prefix(unlisted: &[String], unloaded: &[String]) -> Option<String> {
    let first = unloaded.first()?;
    let p = unlisted.iter().find_map(|k| k.strip_suffix(first.as_str())?.strip_suffix('.'))?;
    let under: BTreeSet<String> = unloaded.iter().map(|k| format!("{p}.{k}")).collect();
    let held: BTreeSet<String> = unlisted.iter().cloned().collect();
    (!p.is_empty() && under == held).then(|| p.to_string())
}

/// [`save_loaded`] with the keys renamed for the file by `map` (the map a port loaded
/// through, so that PyTorch gets its own keys back).
pub fn save_loaded_with<M: NamedParameters>(
    module: &M,
    vars: &VarMap,
    map: &KeyMap,
    path: impl AsRef<Path>,
) -> Result<()> {
    let named = module.named_parameters();
    let entries: Vec<(String, Tensor)> = {
        let data = vars.data().lock().unwrap_or_else(|e| e.into_inner());
        let listed: BTreeSet<&str> = named.iter().map(|(k, _)| k.as_str()).collect();
        let unlisted: Vec<String> =
            data.keys().filter(|k| !listed.contains(k.as_str())).cloned().collect();
        let unloaded: Vec<String> =
            listed.iter().filter(|k| !data.contains_key(**k)).map(|k| k.to_string()).collect();
        if !unlisted.is_empty() || !unloaded.is_empty() {
            let mut msg = Vec::new();
            if !unlisted.is_empty() {
                msg.push(format!(
                    "the module loaded {} that its named_parameters does not list",
                    crate::key_groups::key_list(&unlisted)
                ));
            }
            if !unloaded.is_empty() {
                msg.push(format!(
                    "it lists {} that it did not load",
                    crate::key_groups::key_list(&unloaded)
                ));
            }
            let advice = match common_prefix(&unlisted, &unloaded) {
                Some(p) => format!(
                    "the module was built under vb.pp(\"{p}\"), so the VarMap holds its \
                     parameters under that prefix: save its own names with \
                     save_state_dict(&module, path), or the file's with \
                     save_safetensors over prefixed(\"{p}\", &module)"
                ),
                None => "make named_parameters list every parameter the module asks its \
                         VarBuilder for (prefixed(..) for sub-modules)"
                    .to_string(),
            };
            return Err(Error::Config {
                op: "save_loaded",
                arg: "named_parameters",
                msg: format!("{}: {advice}", msg.join("; ")),
            });
        }
        named.iter().map(|(k, _)| (k.clone(), data[k].as_tensor().clone())).collect()
    };
    let entries = map.to_file(entries)?;
    save_safetensors(entries.iter().map(|(k, t)| (k.as_str(), t)), path)
}

/// Saves a module's parameters under PyTorch's keys, like
/// `safetensors.torch.save_file(module.state_dict(), path)`. For a module built by a load,
/// [`save_loaded`] also checks its `named_parameters` against what it loaded.
pub fn save_state_dict<M: NamedParameters>(module: &M, path: impl AsRef<Path>) -> Result<()> {
    let params = module.named_parameters();
    save_safetensors(params.iter().map(|(k, t)| (k.as_str(), t)), path)
}

/// What a non-strict load found: PyTorch's `load_state_dict(strict=False)` return value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Keys the module has that the state_dict lacks (they keep their fresh initialisation).
    pub missing_keys: Vec<String>,
    /// Keys in the state_dict that the module does not have (ignored).
    pub unexpected_keys: Vec<String>,
}

impl LoadReport {
    /// Whether the keys matched exactly.
    pub fn is_exact(&self) -> bool {
        self.missing_keys.is_empty() && self.unexpected_keys.is_empty()
    }
}

/// Compares the keys a module has with the keys a state_dict has, as PyTorch's strict
/// `load_state_dict` does. The error names every missing and unexpected key and, when the
/// two sides differ by a prefix (a checkpoint saved from `model.encoder` loaded into the
/// encoder), says which.
pub fn check_keys<'a>(
    module_keys: impl IntoIterator<Item = &'a str>,
    state_keys: impl IntoIterator<Item = &'a str>,
) -> Result<()> {
    let (report, matched) = compare_keys(module_keys, state_keys);
    if report.is_exact() {
        Ok(())
    } else {
        let none = BTreeMap::new();
        let shapes = Shapes { module: &none, file: &none };
        let hint = prefix_hint(&report.missing_keys, &report.unexpected_keys, matched, shapes);
        Err(Error::StateDictKeys {
            missing: report.missing_keys,
            unexpected: report.unexpected_keys,
            hint,
        })
    }
}

/// The missing and unexpected keys, and how many keys the two sides share.
fn compare_keys<'a>(
    module_keys: impl IntoIterator<Item = &'a str>,
    state_keys: impl IntoIterator<Item = &'a str>,
) -> (LoadReport, usize) {
    let m: BTreeSet<&str> = module_keys.into_iter().collect();
    let s: BTreeSet<&str> = state_keys.into_iter().collect();
    let report = LoadReport {
        missing_keys: m.difference(&s).map(|k| k.to_string()).collect(),
        unexpected_keys: s.difference(&m).map(|k| k.to_string()).collect(),
    };
    (report, m.intersection(&s).count())
}

/// When every unexpected key is a missing key with one extra leading prefix (or the other way
/// round), names that prefix and what to do; `matched` keys were found as they are (so a claim
/// about every key of the file or of the module is made only when it is true).
fn prefix_hint(
    missing: &[String],
    unexpected: &[String],
    matched: usize,
    shapes: Shapes,
) -> String {
    let common_prefix = |longer: &[String], shorter: &[String]| -> Option<String> {
        let first = longer.first()?;
        let shorter_set: BTreeSet<&str> = shorter.iter().map(String::as_str).collect();
        // Try every dot-separated prefix of the first longer key.
        let mut cut = 0;
        while let Some(dot) = first[cut..].find('.') {
            cut += dot + 1;
            let prefix = &first[..cut];
            let all = longer
                .iter()
                .all(|k| k.strip_prefix(prefix).is_some_and(|rest| shorter_set.contains(rest)));
            if all && longer.len() == shorter.len() {
                return Some(prefix.to_string());
            }
        }
        None
    };
    if missing.is_empty() || unexpected.is_empty() {
        return String::new();
    }
    let pp = |p: &str| p.trim_end_matches('.').to_string();
    if let Some(p) = common_prefix(unexpected, missing) {
        if matched == 0 {
            return format!(
                "every key in the file starts with {p:?}: build the module under vb.pp({:?}) or strip the prefix from the file's keys",
                pp(&p)
            );
        }
        return format!(
            "the file has every missing key under {p:?} (\"{}\" is \"{}\"): ask for {} under vb.pp({:?}), or rename the keys on load",
            missing[0],
            unexpected[0],
            if missing.len() == 1 { "it" } else { "them" },
            pp(&p)
        );
    }
    if let Some(p) = common_prefix(missing, unexpected) {
        if matched == 0 {
            return format!(
                "the module's keys start with {p:?} but the file's do not: build the sub-module from the root VarBuilder, or save the file from the parent module"
            );
        }
        return format!(
            "the file has every missing key without the prefix {p:?} (\"{}\" is \"{}\"): ask for {} outside vb.pp({:?}), or rename the keys on load",
            missing[0],
            unexpected[0],
            if missing.len() == 1 { "it" } else { "them" },
            pp(&p)
        );
    }
    if let Some(h) = rename_hint(missing, unexpected, shapes) {
        return h;
    }
    let prefixes = sub_module_prefixes(missing, unexpected);
    if let Some(p) = prefixes.first() {
        let under = prefixes.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(" and ");
        return format!(
            "every missing key is in the file under {under}, beside other keys (a parent model's state_dict): build the module under vb.pp({:?}) and load it with state_dict::load (strict=False), or save only that sub-module",
            p.trim_end_matches('.')
        );
    }
    String::new()
}

/// The shapes of the keys on each side, where known (a key absent has any shape).
#[derive(Clone, Copy)]
struct Shapes<'a> {
    module: &'a BTreeMap<String, Vec<usize>>,
    file: &'a BTreeMap<String, Vec<usize>>,
}

impl Shapes<'_> {
    /// Whether the module's key `m` may be the file's `u`.
    fn fit(&self, m: &str, u: &str) -> bool {
        match (self.module.get(m), self.file.get(u)) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
    }
}

/// When the missing keys are exactly the unexpected ones with some runs of segments renamed
/// (torchvision's `ln_1` for `norm1` in every layer), the [`KeyMap`] that says so.
///
/// Each missing key is compared with the unexpected keys of its shape that share the most
/// leading and trailing segments with it; a renamed run of the module (`norm1`) may be any run
/// of the file found so for every one of its keys (`ln_1` or `ln_2`: the weights rule out
/// `mlp.3`). A run left with one choice takes it and leaves it to no other; runs left with the
/// same choices are paired in sorted order. The hint is given only if the renames so found turn
/// the unexpected keys into the missing ones exactly.
fn rename_hint(missing: &[String], unexpected: &[String], shapes: Shapes) -> Option<String> {
    const MAX_KEYS: usize = 1024;
    const MAX_RENAMES: usize = 16;
    if missing.is_empty() || missing.len() != unexpected.len() || missing.len() > MAX_KEYS {
        return None;
    }
    let split = |k: &str| k.split('.').map(str::to_string).collect::<Vec<_>>();
    let files: Vec<(&String, Vec<String>)> = unexpected.iter().map(|u| (u, split(u))).collect();
    // Module run -> the file runs it may be.
    let mut choices: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in missing {
        let ms = split(m);
        let scored: Vec<(usize, String, String)> = files
            .iter()
            .filter(|(u, _)| shapes.fit(m, u))
            .filter_map(|(_, us)| {
                let (p, q) = affixes(&ms, us);
                let (mm, um) = (ms[p..ms.len() - q].join("."), us[p..us.len() - q].join("."));
                (p + q > 0 && !mm.is_empty() && !um.is_empty()).then_some((p + q, mm, um))
            })
            .collect();
        let best = scored.iter().map(|s| s.0).max()?;
        let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (_, mm, um) in scored.into_iter().filter(|s| s.0 == best) {
            found.entry(mm).or_default().insert(um);
        }
        for (mm, ums) in found {
            let c = choices.entry(mm).or_insert_with(|| ums.clone());
            c.retain(|u| ums.contains(u));
        }
    }
    let renames = settle(choices, MAX_RENAMES)?;
    let map = renames.iter().fold(KeyMap::new(), |map, (f, m)| map.rename(f, m));
    let renamed: BTreeSet<String> = unexpected.iter().map(|u| map.to_module_key(u)).collect();
    let wanted: BTreeSet<String> = missing.iter().cloned().collect();
    if renamed != wanted {
        return None;
    }
    let calls: String = renames.iter().map(|(f, m)| format!(".rename({f:?}, {m:?})")).collect();
    Some(format!(
        "the missing keys are the unexpected ones renamed: let map = state_dict::KeyMap::new(){calls}; load map.to_module(&state), and save through map.to_file(..) (or state_dict::save_loaded_with) so that PyTorch gets its own keys back"
    ))
}

/// `(file run, module run)` pairs from each module run's choices: a run with one choice takes
/// it (and no other run may), then runs with the same choices pair up in sorted order. `None`
/// when that leaves a run without a choice or more than `max` renames.
fn settle(
    mut choices: BTreeMap<String, BTreeSet<String>>,
    max: usize,
) -> Option<BTreeSet<(String, String)>> {
    let mut renames = BTreeSet::new();
    loop {
        let single =
            choices.iter().find(|(_, c)| c.len() == 1).map(|(m, c)| (m.clone(), c.clone()));
        let Some((m, c)) = single else { break };
        let u = c.into_iter().next()?;
        choices.remove(&m);
        for c in choices.values_mut() {
            c.remove(&u);
        }
        renames.insert((u, m));
    }
    let mut groups: BTreeMap<BTreeSet<String>, Vec<String>> = BTreeMap::new();
    for (m, c) in choices {
        groups.entry(c).or_default().push(m);
    }
    for (files, modules) in groups {
        if files.len() != modules.len() {
            return None;
        }
        renames.extend(files.into_iter().zip(modules));
    }
    (renames.len() <= max).then_some(renames)
}

/// How many leading and trailing segments `a` and `b` share (the two never overlap).
fn affixes(a: &[String], b: &[String]) -> (usize, usize) {
    let p = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let room = a.len().min(b.len()) - p;
    let q = a.iter().rev().zip(b.iter().rev()).take(room).take_while(|(x, y)| x == y).count();
    (p, q)
}

/// The prefixes `p` (ending in `.`, in order) under which the file holds every missing key,
/// when the file also holds keys outside them (a sub-module loaded from its parent's
/// state_dict).
fn sub_module_prefixes(missing: &[String], unexpected: &[String]) -> Vec<String> {
    let Some(first) = missing.first() else {
        return Vec::new();
    };
    let in_file: BTreeSet<&str> = unexpected.iter().map(String::as_str).collect();
    let found: BTreeSet<String> = unexpected
        .iter()
        .filter_map(|u| {
            let p = u.strip_suffix(first.as_str())?;
            let fits = p.ends_with('.')
                && missing.iter().all(|m| in_file.contains(format!("{p}{m}").as_str()));
            fits.then(|| p.to_string())
        })
        .collect();
    found.into_iter().collect()
}

/// A load stops building after this many missing keys, or this many entries of the wrong
/// shape or dtype (a module far larger than its state_dict, such as a stack of 10⁹ layers, is
/// reported, not built).
const MAX_MISSING: usize = 4096;

/// A `VarBuilder` backend for loading: present keys come from the state_dict's variables;
/// a missing key is recorded and, when strict, answered with a placeholder that allocates
/// nothing (a stride-0 view of one zero), so a module with huge missing parameters is
/// reported, not allocated.
struct Loader {
    /// The parameters made so far: each entry of the file the module asked for, in the dtype
    /// it asked for (and fresh ones for missing keys, when not strict).
    vars: VarMap,
    /// The file's tensors, as given.
    state: HashMap<String, Tensor>,
    /// The file's shape of each key it holds in a candle dtype.
    present: BTreeMap<String, Vec<usize>>,
    /// Keys the file holds in a dtype candle has not (with that dtype's name).
    unsupported: BTreeMap<String, String>,
    strict: bool,
    missing: Arc<Mutex<Vec<String>>>,
    /// Each entry the module asked for and cannot take.
    mismatched: Arc<Mutex<Vec<(String, Wrong)>>>,
    /// Every key the module asked for, by its full path.
    requested: Arc<Mutex<BTreeMap<String, Vec<usize>>>>,
}

/// Why a file's entry cannot become the parameter the module asks for.
enum Wrong {
    /// `(expected, got)`.
    Shape(Vec<usize>, Vec<usize>),
    /// A dtype candle has not (its safetensors name).
    Dtype(String),
}

impl std::fmt::Display for Wrong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Wrong::Shape(expected, got) => write!(f, "expected shape {expected:?}, got {got:?}"),
            Wrong::Dtype(dt) => write!(f, "dtype {dt} cannot be read into a parameter"),
        }
    }
}

/// A tensor of shape `s` that allocates nothing (a stride-0 view of one zero), handed to the
/// module in place of an entry that cannot be loaded, so that building goes on and every
/// problem is reported together.
fn placeholder(s: candle_core::Shape, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
    Tensor::zeros((), dtype, dev)?.broadcast_as(s)
}

impl Loader {
    /// The file's tensor `name` as the parameter the module asks for: converted to the `dtype`
    /// it asks for (PyTorch's `copy_` into a parameter or buffer of that dtype: an int64
    /// buffer stays exact, an f32 entry asked for as f32 in a bf16 load keeps its bits, a float
    /// parameter from an integer file is converted) and made a variable the `VarMap` holds (for
    /// an optimiser, and for `save_loaded`). A key asked for again gets the same variable; in
    /// another dtype it is an error, as a parameter has one dtype.
    fn get_as(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let mut data = self.vars.data().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = data.get(name) {
            if v.dtype() == dtype {
                return Ok(v.as_tensor().clone());
            }
            candle_core::bail!(
                "load_state_dict: {name} is asked for as {:?} and as {dtype:?}; a parameter has \
                 one dtype: ask for it once, or convert the tensor it gives",
                v.dtype()
            );
        }
        let Some(t) = self.state.get(name) else {
            candle_core::bail!("cannot find tensor {name}");
        };
        let t = crate::precision::cast(t, dtype).map_err(candle_core::Error::wrap)?;
        let var = Var::from_tensor(&t.to_device(dev)?)?;
        data.insert(name.to_string(), var.clone());
        Ok(var.as_tensor().clone())
    }
}

impl candle_nn::var_builder::SimpleBackend for Loader {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut requested = self.requested.lock().unwrap_or_else(|e| e.into_inner());
        requested.insert(name.to_string(), s.dims().to_vec());
        drop(requested);
        let wrong = match (self.present.get(name), self.unsupported.get(name)) {
            (Some(got), _) if got.as_slice() == s.dims() => {
                return self.get_as(name, dtype, dev);
            }
            (Some(got), _) => Some(Wrong::Shape(s.dims().to_vec(), got.clone())),
            (None, Some(dt)) => Some(Wrong::Dtype(dt.clone())),
            (None, None) => None,
        };
        if let Some(wrong) = wrong {
            let mut mismatched = self.mismatched.lock().unwrap_or_else(|e| e.into_inner());
            if mismatched.len() >= MAX_MISSING {
                candle_core::bail!("more than {MAX_MISSING} parameters do not fit the state_dict");
            }
            mismatched.push((name.to_string(), wrong));
            return placeholder(s, dtype, dev);
        }
        let mut missing = self.missing.lock().unwrap_or_else(|e| e.into_inner());
        if self.strict && missing.len() >= MAX_MISSING {
            candle_core::bail!("more than {MAX_MISSING} parameters are missing");
        }
        missing.push(name.to_string());
        drop(missing);
        if self.strict {
            placeholder(s, dtype, dev)
        } else {
            self.vars.get(s, name, h, dtype, dev)
        }
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let data = self.vars.data().lock().unwrap_or_else(|e| e.into_inner());
        match (data.get(name), self.state.get(name)) {
            (Some(v), _) => Ok(v.as_tensor().clone()),
            (None, Some(t)) => Ok(t.clone()),
            (None, None) => candle_core::bail!("cannot find tensor {name}"),
        }
    }

    /// Whether `get` can answer without allocating: a present key, or any key when strict
    /// (missing ones get a placeholder). `get_param` probes the allocation otherwise.
    fn contains_tensor(&self, name: &str) -> bool {
        self.strict || self.present.contains_key(name) || self.unsupported.contains_key(name)
    }
}

/// Loads `state` into a module built by `build`: strict (missing keys are an error, before
/// anything is allocated for them) or not (missing keys keep their fresh initialisation).
/// `unsupported` names the file's entries in dtypes candle has not: unexpected keys when the
/// module lacks them, errors when it asks for them. Wrong shapes are errors either way; all
/// problems are reported together.
fn load_with<M: NamedParameters>(
    state: &HashMap<String, Tensor>,
    unsupported: &BTreeMap<String, String>,
    dtype: DType,
    device: &Device,
    strict: bool,
    build: impl FnOnce(VarBuilder) -> Result<M>,
) -> Result<(M, VarMap, LoadReport)> {
    let vm = VarMap::new();
    for t in state.values() {
        // Each parameter will be a copy (a view's at its full size), in the load's dtype for a
        // float entry: checked for every entry before any is made.
        let hint = "each tensor of a state_dict becomes a parameter of its full size; pass the \
                    tensors a view stands for";
        let dt = if t.dtype().is_float() { dtype } else { t.dtype() };
        crate::alloc::ensure("load_state_dict", "tensor", t.dims(), dt, 1, hint)?;
    }
    let (missing, mismatched) =
        (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let requested = Arc::new(Mutex::new(BTreeMap::new()));
    let loader = Loader {
        vars: vm.clone(),
        state: state.clone(),
        present: state.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect(),
        unsupported: unsupported.clone(),
        strict,
        missing: missing.clone(),
        mismatched: mismatched.clone(),
        requested: requested.clone(),
    };
    let built = build(VarBuilder::from_backend(Box::new(loader), dtype, device.clone()));
    let recorded = std::mem::take(&mut *missing.lock().unwrap_or_else(|e| e.into_inner()));
    let wrong = std::mem::take(&mut *mismatched.lock().unwrap_or_else(|e| e.into_inner()));
    let module = match built {
        Ok(m) => m,
        // A strict load with missing keys or wrong entries: report them, not what the
        // placeholders caused.
        Err(_) if (strict && !recorded.is_empty()) || !wrong.is_empty() => {
            // A build stopped at the cap: the lists hold the first keys only, not the count.
            let capped = (strict && recorded.len() >= MAX_MISSING) || wrong.len() >= MAX_MISSING;
            let hint = match capped {
                true => format!(
                    "the load stopped after {MAX_MISSING} keys: the module asks for more, so \
                     its configuration is larger than the state_dict's"
                ),
                false => String::new(),
            };
            let missing: BTreeSet<String> =
                if strict { recorded.into_iter().collect() } else { BTreeSet::new() };
            return Err(problems(missing.into_iter().collect(), Vec::new(), wrong, hint));
        }
        Err(e) => return Err(e),
    };
    // The keys the module asked for, by full path (a module built under `vb.pp("model")`
    // asks for `model.…`), against the file's.
    let asked = std::mem::take(&mut *requested.lock().unwrap_or_else(|e| e.into_inner()));
    let file_keys = state.keys().chain(unsupported.keys()).map(String::as_str);
    let (report, matched) = compare_keys(asked.keys().map(String::as_str), file_keys);
    let keys_wrong = strict && !report.is_exact();
    if keys_wrong || !wrong.is_empty() {
        let hint = if keys_wrong {
            let file_shapes: BTreeMap<String, Vec<usize>> =
                state.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect();
            let shapes = Shapes { module: &asked, file: &file_shapes };
            prefix_hint(&report.missing_keys, &report.unexpected_keys, matched, shapes)
        } else {
            String::new()
        };
        let (m, u) = if keys_wrong {
            (report.missing_keys, report.unexpected_keys)
        } else {
            (Vec::new(), Vec::new())
        };
        return Err(problems(m, u, wrong, hint));
    }
    // The VarMap keeps what the module asked for (its parameters, for an optimiser and for
    // `save_loaded`), not the file's other entries.
    vm.data().lock().unwrap_or_else(|e| e.into_inner()).retain(|k, _| asked.contains_key(k));
    Ok((module, vm, report))
}

/// What to do about missing or unexpected keys that no prefix explains.
const KEYS_HINT: &str = "build the module with the options the weights were saved with (bias, \
    add_bias_kv, kdim/vdim, the layer counts), rename keys with a state_dict::KeyMap, or load \
    non-strictly (state_dict::load, load_file), which keeps absent parameters as initialised \
    and reports both lists";

/// The error for what a load found: keys only ([`Error::StateDictKeys`]), one wrong shape
/// alone ([`Error::StateDictShape`]), or several kinds together ([`Error::StateDictMismatch`]).
fn problems(
    missing: Vec<String>,
    unexpected: Vec<String>,
    mut mismatched: Vec<(String, Wrong)>,
    hint: String,
) -> Error {
    // Without a prefix to name, what to do about keys that differ.
    let hint = match (hint.is_empty(), missing.is_empty() && unexpected.is_empty()) {
        (true, false) => KEYS_HINT.to_string(),
        _ => hint,
    };
    if mismatched.is_empty() {
        return Error::StateDictKeys { missing, unexpected, hint };
    }
    let lone_shape = matches!(mismatched.as_slice(), [(_, Wrong::Shape(..))]);
    if missing.is_empty() && unexpected.is_empty() && lone_shape {
        if let Some((key, Wrong::Shape(expected, got))) = mismatched.pop() {
            return Error::StateDictShape { key, expected, got };
        }
    }
    let mismatched = mismatched.into_iter().map(|(k, w)| (k, w.to_string())).collect();
    Error::StateDictMismatch { missing, unexpected, mismatched, hint }
}

/// Loads a state_dict strictly: builds the module with `build` from a `VarBuilder` of `dtype`,
/// and puts each tensor the module asks for into a fresh `VarMap` as a trainable variable of
/// the dtype it asks for (`dtype` for parameters, a buffer's own, such as int64 position ids),
/// converted from the stored dtype, as PyTorch's `load_state_dict` copies into each
/// parameter's or buffer's dtype. It fails with
/// [`Error::StateDictKeys`] if the module and the state_dict do not have the same keys,
/// [`Error::StateDictShape`] for a lone wrong shape, and [`Error::StateDictMismatch`] listing
/// everything when there is more than one problem (as PyTorch lists every missing key,
/// unexpected key and size mismatch). Missing keys are found before anything is allocated for
/// them.
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
    let (m, vm, _) = load_with(state, &BTreeMap::new(), dtype, device, true, build)?;
    Ok((m, vm))
}

/// Loads a state_dict non-strictly, like PyTorch's `load_state_dict(strict=False)`: keys the
/// module lacks are ignored, parameters the state_dict lacks keep their fresh initialisation,
/// and the [`LoadReport`] lists both. Shapes must still match (every wrong one is named).
///
/// # Example
/// ```
/// use std::collections::HashMap;
/// use candle_core::{DType, Device, Tensor};
/// use multihead::{state_dict, Linear};
///
/// let dev = Device::Cpu;
/// let mut state = HashMap::new();
/// state.insert("weight".to_string(), Tensor::zeros((3, 4), DType::F32, &dev)?);
/// state.insert("extra".to_string(), Tensor::zeros(2, DType::F32, &dev)?);
/// let (_lin, _vars, report) =
///     state_dict::load(&state, DType::F32, &dev, |vb| Linear::new(4, 3, true, vb))?;
/// assert_eq!(report.missing_keys, ["bias"]);
/// assert_eq!(report.unexpected_keys, ["extra"]);
/// # Ok::<(), multihead::Error>(())
/// ```
pub fn load<M: NamedParameters>(
    state: &HashMap<String, Tensor>,
    dtype: DType,
    device: &Device,
    build: impl FnOnce(VarBuilder) -> Result<M>,
) -> Result<(M, VarMap, LoadReport)> {
    load_with(state, &BTreeMap::new(), dtype, device, false, build)
}

/// [`load`] from a safetensors file. Entries in dtypes candle has not (`i32`, `i16`, 8-bit
/// floats, ...) are fine under keys the module does not have: they are reported as unexpected,
/// as PyTorch would; a module that asks for one gets an error naming it.
pub fn load_file<M: NamedParameters>(
    path: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
    build: impl FnOnce(VarBuilder) -> Result<M>,
) -> Result<(M, VarMap, LoadReport)> {
    let (state, unsupported) = read_safetensors(path.as_ref(), device)?;
    load_with(&state, &unsupported, dtype, device, false, build)
}

/// A sub-module's parameters under a prefix, as PyTorch names them inside a parent module:
/// `prefixed("encoder", &enc)` gives `encoder.layers.0.linear1.weight`, ... Use it to write a
/// parent's [`NamedParameters`] from its children.
///
/// # Example
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::{state_dict::prefixed, Linear};
///
/// let vm = VarMap::new();
/// let head = Linear::new(4, 2, true, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
/// let keys: Vec<String> = prefixed("classifier", &head).into_iter().map(|(k, _)| k).collect();
/// assert_eq!(keys, ["classifier.weight", "classifier.bias"]);
/// # Ok::<(), multihead::Error>(())
/// ```
pub fn prefixed<M: NamedParameters + ?Sized>(prefix: &str, module: &M) -> Vec<(String, Tensor)> {
    let prefix = prefix.trim_end_matches('.');
    module
        .named_parameters()
        .into_iter()
        .map(|(k, t)| if prefix.is_empty() { (k, t) } else { (format!("{prefix}.{k}"), t) })
        .collect()
}
/// [`load_strict`] from a safetensors file (entries in dtypes candle has not are unexpected
/// keys when the module does not ask for them, see [`load_file`]).
pub fn load_strict_file<M: NamedParameters>(
    path: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
    build: impl FnOnce(VarBuilder) -> Result<M>,
) -> Result<(M, VarMap)> {
    let (state, unsupported) = read_safetensors(path.as_ref(), device)?;
    let (m, vm, _) = load_with(&state, &unsupported, dtype, device, true, build)?;
    Ok((m, vm))
}
