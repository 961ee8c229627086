//! Reads a safetensors file tensor by tensor, each straight into its own storage.
//!
//! Reading the whole file into one buffer and copying each tensor out of it touches every
//! byte twice in fresh memory: a 90 MB model (all-MiniLM-L6-v2) took 0.3-0.6 s to load on a
//! 2-core VM, 80% of it the kernel clearing the pages of the two copies. Here the header is
//! parsed first (checked as the `safetensors` crate checks a whole file: offsets contiguous,
//! sizes matching shapes and dtypes, the data ending where the file ends), then each tensor's
//! bytes are read into a vector of its element type that the tensor then owns.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use candle_core::{DType, Device, Tensor, WithDType};
use half::{bf16, f16};
use safetensors::tensor::Metadata;
use safetensors::Dtype as S;

use crate::error::{Error, Result};

/// The largest header the `safetensors` crate accepts (100 MB).
const MAX_HEADER: u64 = 100_000_000;

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: path.to_path_buf(), msg: msg.into() }
}

/// The tensors of the file that candle can hold, and the names and dtypes of those it cannot
/// (other integer widths, 8-bit floats), whose bytes are skipped.
pub(crate) fn read(
    path: &Path,
    device: &Device,
) -> Result<(HashMap<String, Tensor>, BTreeMap<String, String>)> {
    let bad = |msg: String| file_err(path, format!("not a safetensors file: {msg}"));
    let (mut file, fifo) =
        crate::fifo::open(path).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    let stat = file.metadata().map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    if stat.is_dir() {
        return Err(file_err(path, "cannot read: it is a directory"));
    }
    if !stat.is_file() {
        // A pipe or a device has no length to check the header against: read it whole.
        return read_stream(file, fifo, path, device);
    }
    let len = stat.len();
    let mut word = [0u8; 8];
    file.read_exact(&mut word).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            bad(format!("{len} bytes, shorter than the 8-byte header length"))
        }
        _ => file_err(path, format!("cannot read: {e}")),
    })?;
    let n = u64::from_le_bytes(word);
    if n > MAX_HEADER {
        return Err(bad(format!("header length {n} is over the format's limit of {MAX_HEADER}")));
    }
    if n > len.saturating_sub(8) {
        return Err(bad(format!("header length {n} does not fit the file's {len} bytes")));
    }
    let mut header = Vec::new();
    header.try_reserve_exact(n as usize).map_err(|_| Error::Alloc {
        op: "load_safetensors",
        what: "header",
        msg: format!("{n} bytes cannot be allocated; free memory"),
    })?;
    header.resize(n as usize, 0);
    file.read_exact(&mut header).map_err(|e| bad(format!("reading the header: {e}")))?;
    let meta: Metadata = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("header is not valid metadata: {e}")))?;
    let total = (8 + n).checked_add(meta.data_len() as u64);
    if total != Some(len) {
        let took = total.map_or("more than 2^64".to_string(), |t| t.to_string());
        return Err(bad(format!("header and data take {took} bytes but the file has {len}")));
    }
    ensure_room(path, &meta)?;
    let (mut out, mut unsupported) = (HashMap::new(), BTreeMap::new());
    // In offset order: each tensor's bytes follow the previous one's.
    for name in meta.offset_keys() {
        let Some(info) = meta.info(&name) else { continue };
        let bytes = info.data_offsets.1 - info.data_offsets.0;
        let shape = info.shape.as_slice();
        let t = match candle_dtype(info.dtype) {
            Some(DType::U8) => read_as::<u8>(&mut file, path, &name, shape, device)?,
            Some(DType::F32) => read_as::<f32>(&mut file, path, &name, shape, device)?,
            Some(DType::F64) => read_as::<f64>(&mut file, path, &name, shape, device)?,
            Some(DType::F16) => read_as::<f16>(&mut file, path, &name, shape, device)?,
            Some(DType::BF16) => read_as::<bf16>(&mut file, path, &name, shape, device)?,
            Some(DType::U32) => read_as::<u32>(&mut file, path, &name, shape, device)?,
            Some(DType::I64) => read_as::<i64>(&mut file, path, &name, shape, device)?,
            _ => {
                skip(&mut file, path, &name, bytes as u64)?;
                unsupported.insert(name, format!("{:?}", info.dtype));
                continue;
            }
        };
        out.insert(name, t);
    }
    Ok((out, unsupported))
}

/// The tensors this file would load, together, must fit the memory available now: each is
/// allocated on its own (and an overcommitting kernel grants each), so a file whose tensors
/// fit one at a time but not all together would be killed for memory halfway instead.
fn ensure_room(path: &Path, meta: &Metadata) -> Result<()> {
    let total: u128 = meta
        .offset_keys()
        .iter()
        .filter_map(|name| meta.info(name))
        .filter(|info| candle_dtype(info.dtype).is_some())
        .map(|info| (info.data_offsets.1 - info.data_offsets.0) as u128)
        .sum();
    let room = crate::alloc::memory_available();
    if total > room as u128 {
        let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
        return Err(Error::Alloc {
            op: "load_safetensors",
            what: "tensors",
            msg: format!(
                "{}: its tensors need {:.1} GiB together, more than the {:.1} GiB of memory \
                 available now; free memory or load a smaller file",
                path.display(),
                gib(total),
                gib(room as u128)
            ),
        });
    }
    Ok(())
}

/// A file without a known length (a pipe, a device), read whole and then parsed.
fn read_stream(
    mut file: File,
    fifo: bool,
    path: &Path,
    device: &Device,
) -> Result<(HashMap<String, Tensor>, BTreeMap<String, String>)> {
    // At most half of what this machine could hold (its tensors are then copied out of the
    // buffer, a second copy): an endless stream (a device such as /dev/zero) is an error,
    // not a process killed for memory.
    let limit = crate::alloc::memory_limit() / 2;
    let (mut bytes, mut chunk) = (Vec::new(), vec![0u8; 1 << 16]);
    let opened = std::time::Instant::now();
    loop {
        let n = file.read(&mut chunk).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
        if n == 0 && fifo && bytes.is_empty() {
            // No writer yet: wait a little for one, then say so rather than hang.
            if crate::fifo::wait_for_data(opened) {
                continue;
            }
            let secs = crate::fifo::FIFO_WAIT.as_secs();
            let msg = format!(
                "cannot read: it is a FIFO and nothing was written to it in {secs} s; start the process that writes it first"
            );
            return Err(file_err(path, msg));
        }
        if n == 0 {
            break;
        }
        if bytes.len().saturating_add(n) > limit || bytes.try_reserve(n).is_err() {
            let msg = format!(
                "cannot read: the stream is longer than the memory free here ({} bytes read)",
                bytes.len()
            );
            return Err(file_err(path, msg));
        }
        bytes.extend_from_slice(&chunk[..n]);
    }
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| file_err(path, format!("not a safetensors file: {e}")))?;
    let (mut out, mut unsupported) = (HashMap::new(), BTreeMap::new());
    for (name, view) in st.tensors() {
        let Some(dtype) = candle_dtype(view.dtype()) else {
            unsupported.insert(name, format!("{:?}", view.dtype()));
            continue;
        };
        let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), device)?;
        out.insert(name, t);
    }
    Ok((out, unsupported))
}

/// The dtype candle holds a tensor of this file dtype in (bool as `u8`: `1` for true, the
/// form `Mask::Bool` takes), if it has one.
fn candle_dtype(d: S) -> Option<DType> {
    match d {
        S::BOOL | S::U8 => Some(DType::U8),
        S::F32 => Some(DType::F32),
        S::F64 => Some(DType::F64),
        S::F16 => Some(DType::F16),
        S::BF16 => Some(DType::BF16),
        S::U32 => Some(DType::U32),
        S::I64 => Some(DType::I64),
        _ => None,
    }
}

/// Element types whose every bit pattern is a valid value, so that bytes read from a file
/// may fill them.
///
/// # Safety
/// An implementor must be plain data: no padding, no invalid bit patterns, no pointers.
unsafe trait Plain: WithDType {}
// SAFETY: an integer of fixed width: every bit pattern is a value, no padding.
unsafe impl Plain for u8 {}
// SAFETY: an integer of fixed width: every bit pattern is a value, no padding.
unsafe impl Plain for u32 {}
// SAFETY: an integer of fixed width: every bit pattern is a value, no padding.
unsafe impl Plain for i64 {}
// SAFETY: an IEEE float of fixed width: every bit pattern is a value, no padding.
unsafe impl Plain for f32 {}
// SAFETY: an IEEE float of fixed width: every bit pattern is a value, no padding.
unsafe impl Plain for f64 {}
// SAFETY: an IEEE half (`half::f16` is a `u16`) of fixed width: every bit pattern is a value, no padding.
unsafe impl Plain for f16 {}
// SAFETY: a bfloat16 (`half::bf16` is a `u16`) of fixed width: every bit pattern is a value, no padding.
unsafe impl Plain for bf16 {}

/// The next tensor of the file, of `shape` and element type `T` (little-endian in the file,
/// as on every CPU candle runs on).
fn read_as<T: Plain>(
    file: &mut File,
    path: &Path,
    name: &str,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    // The metadata was validated: the element count fits `usize` and the bytes fit the file.
    let count: usize = shape.iter().product();
    let mut data: Vec<T> = Vec::new();
    data.try_reserve_exact(count).map_err(|_| Error::Alloc {
        op: "load_safetensors",
        what: "tensor",
        msg: format!(
            "{name} of shape {shape:?} ({:?}) cannot be allocated; free memory or load a smaller file",
            T::DTYPE
        ),
    })?;
    data.resize(count, T::zero());
    let size = count * std::mem::size_of::<T>();
    // SAFETY: `data` holds `count` initialised values of `T`, which is `size` bytes of plain
    // data; every byte pattern is a valid `T` (`Plain`), so writing bytes through this view
    // keeps every element valid, and the view ends before `data` is used again. (The bytes
    // are little-endian, as safetensors stores them; like candle's own loader, this gives the
    // right values on the little-endian CPUs candle runs on.)
    let view = unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), size) };
    file.read_exact(view)
        .map_err(|e| file_err(path, format!("cannot read tensor {name} ({size} bytes): {e}")))?;
    Ok(Tensor::from_vec(data, shape, device)?)
}

/// Skips the next `bytes` bytes of the file (a tensor candle cannot hold).
fn skip(file: &mut File, path: &Path, name: &str, bytes: u64) -> Result<()> {
    let copied = std::io::copy(&mut file.by_ref().take(bytes), &mut std::io::sink())
        .map_err(|e| file_err(path, format!("cannot read tensor {name}: {e}")))?;
    match copied == bytes {
        true => Ok(()),
        false => Err(file_err(path, format!("tensor {name}: the file ends inside it"))),
    }
}
