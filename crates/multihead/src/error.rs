//! The library's one error type.

use std::path::PathBuf;

use crate::key_groups::key_list;

/// Everything that can go wrong in `multihead`.
///
/// Messages are lowercase, name the operation and the argument, and give both shapes when two
/// shapes disagree, for example
/// `multi_head_attention_forward: attn_mask: expected a 2-D mask of shape (L, S) = (3, 5), got (5, 3)`.
///
/// `Debug` prints the same message, so that `main() -> Result<(),
/// Box<dyn Error>>` and `unwrap` show what `Display` shows.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor argument has the wrong rank or shape.
    #[error("{op}: {arg}: {msg}")]
    Shape {
        /// The operation that rejected the argument (PyTorch's function name).
        op: &'static str,
        /// The argument's PyTorch name.
        arg: &'static str,
        /// What was expected and what was given.
        msg: String,
    },
    /// A tensor argument has the wrong dtype.
    #[error("{op}: {arg}: {msg}")]
    DType {
        /// The operation that rejected the argument.
        op: &'static str,
        /// The argument's PyTorch name.
        arg: &'static str,
        /// What was expected and what was given.
        msg: String,
    },
    /// A constructor or call argument that is not a tensor is out of range or inconsistent.
    #[error("{op}: {arg}: {msg}")]
    Config {
        /// The operation or constructor.
        op: &'static str,
        /// The argument's PyTorch name.
        arg: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// Strict state_dict loading found keys missing from the file or keys the module does not
    /// have.
    #[error("load_state_dict: {}{}", state_dict_problems(missing, unexpected, &[]), then(hint))]
    StateDictKeys {
        /// Keys the module needs that the state_dict lacks.
        missing: Vec<String>,
        /// Keys in the state_dict that the module does not have.
        unexpected: Vec<String>,
        /// When the two sides differ by a prefix, which one and what to do (else empty); the
        /// message appends it after `; `.
        hint: String,
    },
    /// A state_dict does not fit the module in more than one way; every problem is listed at
    /// once, as PyTorch's `load_state_dict` lists every missing and unexpected key and every
    /// size mismatch. (A lone wrong shape is [`Error::StateDictShape`]; keys alone,
    /// [`Error::StateDictKeys`].)
    #[error(
        "load_state_dict: {}{}",
        state_dict_problems(missing, unexpected, mismatched),
        then(hint)
    )]
    StateDictMismatch {
        /// Keys the module needs that the state_dict lacks (strict loading only).
        missing: Vec<String>,
        /// Keys in the state_dict that the module does not have (strict loading only).
        unexpected: Vec<String>,
        /// `(key, what is wrong)` for each entry the module cannot take: a wrong shape, or a
        /// dtype that cannot be a parameter.
        mismatched: Vec<(String, String)>,
        /// When the keys differ by a prefix, which one and what to do (else empty); the message
        /// appends it after `; `.
        hint: String,
    },
    /// A state_dict entry has the wrong shape for the module.
    #[error(
        "load_state_dict: {key}: expected shape {expected:?}, got {got:?}; build the module \
         with the sizes the weights were saved with"
    )]
    StateDictShape {
        /// The PyTorch key.
        key: String,
        /// The shape the module needs.
        expected: Vec<usize>,
        /// The shape in the state_dict.
        got: Vec<usize>,
    },
    /// A parity case or safetensors file could not be read or is malformed.
    #[error("{path}: {msg}")]
    File {
        /// The file or case directory.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A tensor the call needs is larger than this machine can allocate, or its size overflows
    /// `usize`. Nothing was allocated.
    #[error("{op}: {what}: {msg}")]
    Alloc {
        /// The operation that needed the memory.
        op: &'static str,
        /// What the memory was for (PyTorch's name where there is one).
        what: &'static str,
        /// The size asked for and what to do instead.
        msg: String,
    },
    /// Appending to a [`KvCache`](crate::KvCache) would go past its capacity. Nothing was
    /// written: the cache is as it was.
    #[error("{op}: cache: {msg}")]
    CacheFull {
        /// The operation that appended.
        op: &'static str,
        /// Which row, how many tokens it holds and asked for, and what to do instead.
        msg: String,
    },
    /// An error raised inside candle.
    #[error("candle: {0}")]
    Candle(#[source] candle_core::Error),
}

/// Keeps candle's message and drops the backtrace candle attaches when `RUST_BACKTRACE` is set
/// (dozens of lines of frames in what should be a one-line message).
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        let mut e = e;
        while let candle_core::Error::WithBacktrace { inner, .. } = e {
            e = *inner;
        }
        Error::Candle(e)
    }
}

/// Lets `?` turn a multihead error into a candle error, so these layers work inside
/// `candle_nn::Module` code. A wrapped candle error comes back unchanged.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Formats a shape as PyTorch prints a tuple: `(2, 3, 5)`.
pub(crate) fn fmt_shape(dims: &[usize]) -> String {
    match dims {
        [d] => format!("({d},)"),
        _ => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// A hint appended to a message: `; hint`, or nothing.
fn then(hint: &str) -> String {
    if hint.is_empty() {
        String::new()
    } else {
        format!("; {hint}")
    }
}

/// The message of [`Error::StateDictMismatch`]: each non-empty list, `; `-separated.
fn state_dict_problems(
    missing: &[String],
    unexpected: &[String],
    mismatched: &[(String, String)],
) -> String {
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("missing keys {}", key_list(missing)));
    }
    if !unexpected.is_empty() {
        parts.push(format!("unexpected keys {}", key_list(unexpected)));
    }
    for (key, what) in mismatched {
        parts.push(format!("{key}: {what}"));
    }
    parts.join("; ")
}

impl Error {
    /// This error with its argument renamed where `renames` maps it (`(from, to)` pairs): a
    /// Transformer layer names the masks it hands to its attention by its own arguments (a
    /// decoder's `tgt_mask` and `memory_mask` both reach `MultiheadAttention` as `attn_mask`).
    pub(crate) fn renamed(self, renames: &[(&str, &'static str)]) -> Self {
        // The argument, and its name where the message says it ("types of attn_mask" of a
        // layer's `src_mask`).
        let swap = |arg: &'static str, msg: String| match renames.iter().find(|(f, _)| *f == arg) {
            Some((from, to)) => (*to, msg.replace(from, to)),
            None => (arg, msg),
        };
        match self {
            Error::Shape { op, arg, msg } => {
                let (arg, msg) = swap(arg, msg);
                Error::Shape { op, arg, msg }
            }
            Error::DType { op, arg, msg } => {
                let (arg, msg) = swap(arg, msg);
                Error::DType { op, arg, msg }
            }
            Error::Config { op, arg, msg } => {
                let (arg, msg) = swap(arg, msg);
                Error::Config { op, arg, msg }
            }
            e => e,
        }
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The one variant with a source (`Candle`) already shows it in its message.
        write!(f, "{self}")
    }
}
