//! BERT's tokenizer as `multihead embed` uses it: loaded from `tokenizer.json` (or built from
//! `vocab.txt` and `tokenizer_config.json` as transformers converts a slow BERT tokenizer),
//! truncating at the model's limit, lowercasing first for `do_lower_case`, and long texts
//! tokenized from a prefix cut where BERT's normaliser and pre-tokenizer cannot move a word
//! boundary.

use std::path::Path;

use anyhow::{Context, Result};
use tokenizers::normalizers::{Lowercase, Sequence};
use tokenizers::{ModelWrapper, NormalizerWrapper, Tokenizer, TruncationParams};

/// Lowercases texts before the tokenizer's own normaliser, as sentence-transformers does for
/// `do_lower_case` (unless the normaliser already starts from a `Lowercase` step).
fn lowercase_first(tokenizer: &mut Tokenizer) -> Result<()> {
    let steps: Vec<NormalizerWrapper> = match tokenizer.get_normalizer().cloned() {
        None => Vec::new(),
        Some(NormalizerWrapper::Sequence(s)) => s.into_iter().collect(),
        Some(n) => vec![n],
    };
    if steps.iter().any(|n| matches!(n, NormalizerWrapper::Lowercase(_))) {
        return Ok(());
    }
    let mut all = vec![NormalizerWrapper::Lowercase(Lowercase)];
    all.extend(steps);
    tokenizer
        .with_normalizer(Some(NormalizerWrapper::Sequence(Sequence::new(all))))
        .map_err(|e| anyhow::anyhow!("do_lower_case: {e}"))?;
    Ok(())
}

/// The length from which a text is tokenized from a prefix first (see [`tokenize`]):
/// 256 tokens of ordinary text take a few kilobytes.
const PREFIX_BYTES: usize = 16 << 10;

/// Where a long text may be cut before tokenizing (see [`word_prefix`]).
#[derive(Debug, Default)]
pub(crate) struct Cuts {
    /// The tokenizer's added tokens (`[CLS]`, `[MASK]`, ...), matched in the raw text before
    /// anything else: a cut must not split one.
    specials: Vec<String>,
    /// The normaliser puts spaces around CJK ideographs (BERT's `handle_chinese_chars`), so
    /// the point between two of them is a word boundary too.
    cjk: bool,
    /// The tokenizer is not BERT's (its normaliser and pre-tokenizer): no cut is known to be
    /// safe, so texts are tokenized whole.
    whole: bool,
    /// WordPiece's `max_input_chars_per_word`: a longer word is one unknown token whatever
    /// its length, so such a word may be shortened before tokenizing (see
    /// [`shorten_long_words`]). `None` where that is not known to hold (another model, or an
    /// added token that a shortened word could make or unmake).
    long_word: Option<usize>,
}

impl Cuts {
    pub(crate) fn of(tokenizer: &Tokenizer) -> Self {
        let mut specials: Vec<String> =
            tokenizer.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        specials.retain(|s| !s.is_empty());
        // BERT's normaliser, alone or after the `Lowercase` step `do_lower_case` puts first
        // (lowercasing moves no boundary).
        let steps: &[NormalizerWrapper] = match tokenizer.get_normalizer() {
            Some(NormalizerWrapper::Sequence(s)) => s.as_ref(),
            Some(n) => std::slice::from_ref(n),
            None => &[],
        };
        let isolates = |n: &NormalizerWrapper| matches!(n, NormalizerWrapper::BertNormalizer(b) if b.handle_chinese_chars);
        let bert_steps = steps.iter().all(|n| {
            matches!(n, NormalizerWrapper::BertNormalizer(_) | NormalizerWrapper::Lowercase(_))
        });
        let cjk = bert_steps && steps.iter().any(isolates);
        let bert_split = matches!(
            tokenizer.get_pre_tokenizer(),
            Some(tokenizers::PreTokenizerWrapper::BertPreTokenizer(_))
        );
        let whole = !(bert_steps && bert_split);
        let long_word = match tokenizer.get_model() {
            ModelWrapper::WordPiece(wp) if !whole => Some(wp.max_input_chars_per_word),
            _ => None,
        };
        // Added tokens are matched in the raw text first. One that starts with a character
        // that ends a word anyway (`[` of `[MASK]`) and holds no word longer than WordPiece's
        // longest can neither start inside a shortened word nor span one.
        let long_word = long_word.filter(|&most| {
            specials.iter().all(|s| {
                s.chars().next().is_some_and(|c| ends_word(c, cjk)) && longest_word(s, cjk) <= most
            })
        });
        Self { specials, cjk, whole, long_word }
    }

    /// Whether an added token occurs in `text` across byte `i` (in any ASCII case: a token
    /// matched after a lowercasing normaliser must not be split either).
    fn splits_special(&self, text: &[u8], i: usize) -> bool {
        self.specials.iter().any(|s| {
            let s = s.as_bytes();
            (i.saturating_sub(s.len() - 1)..i)
                .any(|at| text[at..].get(..s.len()).is_some_and(|w| w.eq_ignore_ascii_case(s)))
        })
    }
}

/// A character BERT's pre-tokenizer makes a token of its own: ASCII punctuation or any
/// Unicode punctuation (`。`, `、`, `«`, ...), as its `is_bert_punc` says.
fn is_bert_punctuation(c: char) -> bool {
    use unicode_categories::UnicodeCategories;
    c.is_ascii_punctuation() || c.is_punctuation()
}

/// Where BERT's normaliser and pre-tokenizer may end a word: whitespace (any, as its
/// normaliser maps it to a space), punctuation, and a CJK ideograph when `cjk` (isolated),
/// also as a part of a character's canonical decomposition.
fn ends_word(c: char, cjk: bool) -> bool {
    let plain =
        |c: char| c.is_whitespace() || is_bert_punctuation(c) || (cjk && is_cjk_ideograph(c));
    if plain(c) || c.is_ascii() {
        return plain(c);
    }
    // Where the normaliser strips accents it decomposes first (NFD), and the pre-tokenizer
    // sees the parts: `≠` is `=` and a combining mark, so it splits a word there. Counting
    // such a character as a boundary also where it is not decomposed only keeps more of a
    // text (a boundary that is not there makes no word shorter than it is).
    let mut parts = false;
    unicode_normalization_alignments::char::decompose_canonical(c, |d| parts |= plain(d));
    parts
}

/// A character that stays a character of its word through BERT's normaliser (a letter or a
/// number: control characters are removed, and so are combining marks when accents are
/// stripped; decomposing and lowercasing a letter never removes it).
fn stays(c: char) -> bool {
    use unicode_categories::UnicodeCategories;
    c.is_letter() || c.is_number()
}

/// The most letters and numbers between two characters that end a word, in `text`.
fn longest_word(text: &str, cjk: bool) -> usize {
    let (mut run, mut most) = (0usize, 0usize);
    for c in text.chars() {
        if ends_word(c, cjk) {
            run = 0;
        } else if stays(c) {
            run += 1;
            most = most.max(run);
        }
    }
    most
}

/// `text` with every word of more than WordPiece's `max_input_chars_per_word` letters
/// ([`Cuts::long_word`]) cut after one more letter than that, up to the character that ends
/// it: WordPiece makes such a word one unknown token whatever its length, so the tokens do not
/// change, and a megabyte-long word (a line of kana or Thai without spaces or punctuation)
/// costs what a short one does. Only letters and numbers are counted (the normaliser may
/// remove marks and control characters, never a letter); whitespace, punctuation and, when the
/// normaliser isolates them, CJK ideographs end a word and are all kept. The text itself
/// (borrowed) when it has no such word or the tokenizer gives no such guarantee.
fn shorten_long_words<'t>(text: &'t str, cuts: &Cuts) -> std::borrow::Cow<'t, str> {
    use std::borrow::Cow;
    let Some(most) = cuts.long_word else { return Cow::Borrowed(text) };
    // The shortened text, from the first character dropped on; letters kept of this word.
    let (mut out, mut run): (Option<String>, usize) = (None, 0);
    for (i, c) in text.char_indices() {
        let keep = if ends_word(c, cuts.cjk) {
            run = 0;
            true
        } else if run > most {
            false // the word already has its `most + 1` letters
        } else {
            run += usize::from(stays(c));
            true
        };
        match (keep, out.as_mut()) {
            (true, Some(o)) => o.push(c),
            (false, None) => out = Some(text[..i].to_string()),
            _ => {}
        }
    }
    out.map_or(Cow::Borrowed(text), Cow::Owned)
}

/// BERT's CJK ideographs (the ranges of its normaliser's `handle_chinese_chars`).
fn is_cjk_ideograph(c: char) -> bool {
    matches!(
        c as u32,
        0x4E00..=0x9FFF
            | 0x3400..=0x4DBF
            | 0x20000..=0x2A6DF
            | 0x2A700..=0x2B73F
            | 0x2B740..=0x2B81F
            | 0x2B920..=0x2CEAF
            | 0xF900..=0xFAFF
            | 0x2F800..=0x2FA1F
    )
}

/// The longest prefix of `text` of at least `limit` bytes that ends at a word boundary BERT's
/// tokenizer cannot move: before an ASCII space or tab, after punctuation (ASCII or Unicode,
/// a token of its own), or between two CJK ideographs when the normaliser isolates them; never inside
/// an added token such as `[MASK]` (matched in the raw text first). The normaliser and
/// pre-tokenizer work character by character and split there, and WordPiece works within
/// words, so the prefix's tokens are the first tokens of the whole text. The whole text when
/// it is shorter or has no such boundary past `limit`.
fn word_prefix<'t>(text: &'t str, limit: usize, cuts: &Cuts) -> &'t str {
    if text.len() <= limit || cuts.whole {
        return text;
    }
    let mut start = limit.max(1);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let bytes = text.as_bytes();
    let mut prev = text[..start].chars().next_back();
    for (at, c) in text[start..].char_indices() {
        let i = start + at;
        let boundary = matches!(c, ' ' | '\t')
            || prev.is_some_and(is_bert_punctuation)
            || (cuts.cjk && is_cjk_ideograph(c) && prev.is_some_and(is_cjk_ideograph));
        if boundary && !cuts.splits_special(bytes, i) {
            return &text[..i];
        }
        prev = Some(c);
    }
    text
}

/// The folder's tokenizer (`tokenizer.json`, else built from `vocab.txt`), truncating at
/// `max_tokens` and padding nothing (batches are padded or packed here), lowercasing first for
/// `do_lower_case`.
pub(crate) fn load_tokenizer(
    dir: &Path,
    max_tokens: usize,
    do_lower_case: bool,
) -> Result<Tokenizer> {
    let json = dir.join("tokenizer.json");
    for file in ["tokenizer.json", "tokenizer_config.json", "vocab.txt"] {
        crate::sentence::plain_file(&dir.join(file))?;
    }
    let mut tokenizer = match !json.exists() && dir.join("vocab.txt").is_file() {
        true => from_vocab(dir)?,
        false => {
            let mut t = Tokenizer::from_file(json)
                .map_err(|e| anyhow::anyhow!("loading tokenizer.json: {e}"))?;
            follow_tokenizer_config(&mut t, &read_tokenizer_config(dir)?)?;
            t
        }
    };
    tokenizer
        .with_truncation(Some(TruncationParams { max_length: max_tokens, ..Default::default() }))
        .map_err(|e| anyhow::anyhow!("truncation: {e}"))?;
    tokenizer.with_padding(None);
    if do_lower_case {
        lowercase_first(&mut tokenizer)?;
    }
    Ok(tokenizer)
}

/// Tokenizes texts, truncated at `max_tokens` (as sentence-transformers does).
///
/// A long text is tokenized from a prefix ending at a word boundary: a prefix of
/// [`PREFIX_BYTES`], then four times as long, until its tokens fill the limit (then they are
/// the full text's first tokens) or the prefix is the whole text. The tokenizer's memory grows
/// with what it is given (about a hundred bytes per input byte), so a megabyte-long line costs
/// what its first few kilobytes do. Words longer than WordPiece's longest are shortened first
/// ([`shorten_long_words`]: one unknown token either way), so a line without spaces or
/// punctuation (kana, Thai) costs no more.
pub(crate) fn tokenize(
    tokenizer: &Tokenizer,
    cuts: &Cuts,
    texts: &[String],
    max_tokens: usize,
) -> Result<Vec<Vec<u32>>> {
    let texts: Vec<std::borrow::Cow<str>> = texts
        .iter()
        .map(|t| match t.len() > PREFIX_BYTES {
            true => shorten_long_words(t, cuts),
            false => std::borrow::Cow::Borrowed(t.as_str()),
        })
        .collect();
    let mut limits = vec![PREFIX_BYTES; texts.len()];
    let mut ids: Vec<Option<Vec<u32>>> = vec![None; texts.len()];
    loop {
        let todo: Vec<usize> = (0..texts.len()).filter(|&i| ids[i].is_none()).collect();
        if todo.is_empty() {
            return Ok(ids.into_iter().flatten().collect());
        }
        let inputs: Vec<&str> =
            todo.iter().map(|&i| word_prefix(&texts[i], limits[i], cuts)).collect();
        let encodings = tokenizer
            .encode_batch(inputs.clone(), true)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        for ((&i, input), e) in todo.iter().zip(&inputs).zip(&encodings) {
            if input.len() == texts[i].len() || e.get_ids().len() >= max_tokens {
                ids[i] = Some(e.get_ids().to_vec());
            } else {
                limits[i] = limits[i].saturating_mul(4);
            }
        }
    }
}

/// `tokenizer_config.json` as JSON (`Null` where the folder has none).
fn read_tokenizer_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("tokenizer_config.json");
    match path.exists() {
        true => crate::sentence::read_json(&path),
        false => Ok(serde_json::Value::Null),
    }
}

/// transformers' `BertTokenizer` (the class `tokenizer_config.json` names, or none: `embed`
/// serves BERT models) takes only the vocabulary (and the added tokens) from `tokenizer.json`
/// and builds the rest from its own arguments, as sentence-transformers (through
/// `AutoTokenizer`, transformers 5.25) tokenizes: BERT's normaliser from `do_lower_case`
/// (default true), `strip_accents` (default none: strip when lowercasing) and
/// `tokenize_chinese_chars` (default true), control characters cleaned; BERT's pre-tokenizer;
/// WordPiece with `##` continuations, words of at most 100 characters and the config's unknown
/// token; `[CLS] text [SEP]` with the config's tokens (where the vocabulary has them). Whatever `tokenizer.json` says of these is
/// replaced: a folder whose two files disagree (a `tokenizer.json` that does not lowercase beside
/// a config that does or says nothing, no normaliser, another pre-tokenizer or continuation
/// prefix, no post-processor) otherwise gave other tokens, embeddings 0.1-0.8 apart (adversarial
/// runs). Another tokenizer class keeps `tokenizer.json` as it is, as transformers does.
fn follow_tokenizer_config(tokenizer: &mut Tokenizer, cfg: &serde_json::Value) -> Result<()> {
    let class = cfg.get("tokenizer_class").and_then(|v| v.as_str());
    if !matches!(class, None | Some("BertTokenizer") | Some("BertTokenizerFast")) {
        return Ok(());
    }
    bert_pipeline(tokenizer, cfg, "tokenizer.json")
}

/// Everything of BERT's tokenizer but its vocabulary, from `tokenizer_config.json` (`cfg`) as
/// transformers' `BertTokenizer` builds it: the normaliser (`do_lower_case`, `strip_accents`,
/// `tokenize_chinese_chars`, control characters cleaned), the pre-tokenizer, WordPiece's `##`
/// continuations, 100-character words and unknown token, and `[CLS] text [SEP]` (where the
/// vocabulary has the two; `from` names the file it came from in errors).
fn bert_pipeline(tokenizer: &mut Tokenizer, cfg: &serde_json::Value, from: &str) -> Result<()> {
    use tokenizers::normalizers::BertNormalizer;
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    use tokenizers::processors::bert::BertProcessing;
    use tokenizers::ModelWrapper;
    let flag = |k: &str, default: bool| cfg.get(k).and_then(|v| v.as_bool()).unwrap_or(default);
    let normalizer = BertNormalizer::new(
        true,
        flag("tokenize_chinese_chars", true),
        cfg.get("strip_accents").and_then(|v| v.as_bool()),
        flag("do_lower_case", true),
    );
    tokenizer
        .with_normalizer(Some(normalizer))
        .map_err(|e| anyhow::anyhow!("{from}: the normaliser: {e}"))?;
    tokenizer.with_pre_tokenizer(Some(BertPreTokenizer));
    let ModelWrapper::WordPiece(wordpiece) = tokenizer.get_model() else {
        anyhow::bail!("{from}: a BertTokenizer's model must be WordPiece");
    };
    let mut model = wordpiece.clone();
    model.unk_token = special(cfg, "unk_token", "[UNK]");
    model.continuing_subword_prefix = "##".into();
    model.max_input_chars_per_word = 100;
    tokenizer.with_model(model);
    // (A vocabulary without the two tokens keeps the file's post-processor: no BERT model's.)
    let [sep, cls] =
        [("sep_token", "[SEP]"), ("cls_token", "[CLS]")].map(|(k, d)| special(cfg, k, d));
    if let (Some(s), Some(c)) = (tokenizer.token_to_id(&sep), tokenizer.token_to_id(&cls)) {
        tokenizer.with_post_processor(Some(BertProcessing::new((sep, s), (cls, c))));
    }
    Ok(())
}

/// A special token of `tokenizer_config.json`: a string, or an object with its `content`
/// (transformers writes both forms); `default` when absent.
fn special(cfg: &serde_json::Value, key: &str, default: &str) -> String {
    match cfg.get(key) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v) => v.get("content").and_then(|c| c.as_str()).unwrap_or(default).to_string(),
        None => default.to_string(),
    }
}

/// BERT's fast tokenizer built from `vocab.txt` and `tokenizer_config.json`, as transformers
/// converts a slow `BertTokenizer` (its `BertConverter`, with `BertTokenizer`'s defaults:
/// lowercasing, CJK characters isolated, accents stripped when lowercasing): a WordPiece model
/// (`##` continuations, the unknown token), BERT's normaliser and pre-tokenizer,
/// `[CLS] text [SEP]`, and the special tokens matched before normalisation.
fn from_vocab(dir: &Path) -> Result<Tokenizer> {
    use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
    use tokenizers::models::wordpiece::WordPiece;
    use tokenizers::AddedToken;

    let cfg = read_tokenizer_config(dir)?;
    let [unk, sep, cls, pad, mask] = [
        ("unk_token", "[UNK]"),
        ("sep_token", "[SEP]"),
        ("cls_token", "[CLS]"),
        ("pad_token", "[PAD]"),
        ("mask_token", "[MASK]"),
    ]
    .map(|(k, d)| special(&cfg, k, d));
    let vocab = dir.join("vocab.txt");
    let vocab = vocab.to_str().context("vocab.txt: the path is not UTF-8")?;
    let model = WordPiece::from_file(vocab)
        .unk_token(unk.clone())
        .build()
        .map_err(|e| anyhow::anyhow!("loading vocab.txt: {e}"))?;
    let mut tokenizer = Tokenizer::new(model);
    for t in [&sep, &cls] {
        if tokenizer.token_to_id(t).is_none() {
            anyhow::bail!("vocab.txt lacks the special token {t}");
        }
    }
    bert_pipeline(&mut tokenizer, &cfg, "vocab.txt")?;
    tokenizer.with_decoder(Some(WordPieceDecoder::default()));
    let specials: Vec<AddedToken> = [pad, unk, cls, sep, mask]
        .into_iter()
        .filter(|t| tokenizer.token_to_id(t).is_some())
        .map(|t| AddedToken::from(t, true))
        .collect();
    tokenizer.add_special_tokens(specials).map_err(|e| anyhow::anyhow!("vocab.txt: {e}"))?;
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{follow_tokenizer_config, shorten_long_words, word_prefix, Cuts};

    /// `tokenizer.json` against `tokenizer_config.json`, as transformers 5.25's `AutoTokenizer`
    /// tokenizes "Hello Café World" with a small cased vocabulary (the same files written by
    /// the Python `tokenizers` package and loaded there): a `BertTokenizer` follows the
    /// config's `do_lower_case` (default true) and `strip_accents` (default: strip when
    /// lowercasing), another class keeps `tokenizer.json`'s normaliser.
    #[test]
    fn a_bert_tokenizer_follows_its_config_over_tokenizer_json() {
        use serde_json::json;
        use std::str::FromStr;
        use tokenizers::Tokenizer;
        let words = ["[UNK]", "hello", "Hello", "world", "World", "cafe", "café", "Café"];
        let vocab: serde_json::Map<String, serde_json::Value> =
            words.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
        // tokenizer.json as the Python package writes it.
        let build = |lower: bool, strip: Option<bool>| {
            let file = json!({
                "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": {"type": "BertNormalizer", "clean_text": true,
                    "handle_chinese_chars": true, "strip_accents": strip, "lowercase": lower},
                "pre_tokenizer": {"type": "BertPreTokenizer"},
                "post_processor": null, "decoder": null,
                "model": {"type": "WordPiece", "unk_token": "[UNK]",
                    "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                    "vocab": vocab.clone()},
            });
            Tokenizer::from_str(&file.to_string()).unwrap()
        };
        let bert = |extra: serde_json::Value| {
            let mut cfg = json!({"tokenizer_class": "BertTokenizer"});
            cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            cfg
        };
        let (lower, cased) = (["hello", "cafe", "world"], ["Hello", "Café", "World"]);
        let cases = [
            (false, Some(false), bert(json!({"do_lower_case": true})), lower),
            (false, Some(false), bert(json!({})), lower),
            (true, None, bert(json!({"do_lower_case": false})), cased),
            (
                false,
                Some(false),
                bert(json!({"do_lower_case": false, "strip_accents": false})),
                cased,
            ),
            (true, Some(false), bert(json!({"do_lower_case": true})), lower),
            (false, Some(false), serde_json::Value::Null, lower),
            (
                false,
                Some(false),
                json!({"tokenizer_class": "PreTrainedTokenizerFast", "do_lower_case": true}),
                cased,
            ),
        ];
        for (i, (lower, strip, cfg, want)) in cases.into_iter().enumerate() {
            let mut t = build(lower, strip);
            follow_tokenizer_config(&mut t, &cfg).unwrap();
            let e = t.encode("Hello Café World", false).unwrap();
            assert_eq!(e.get_tokens(), want, "case {i}: tokenizer.json lowercase {lower}, {cfg}");
        }
    }

    #[test]
    fn word_prefix_ends_at_a_boundary_the_tokenizer_keeps() {
        let plain = Cuts::default();
        let wp = |t: &str, limit: usize| word_prefix(t, limit, &plain).to_string();
        // Short texts, and texts without a boundary past the limit, are whole.
        assert_eq!(wp("short text", 64), "short text");
        assert_eq!(wp(&"x".repeat(100), 10), "x".repeat(100));
        // Before a space or a tab, never inside a word.
        assert_eq!(wp("aaaa bbbbbbbb cc", 6), "aaaa bbbbbbbb");
        assert_eq!(wp("aaaa\tbbbbbbbb\tcc", 6), "aaaa\tbbbbbbbb");
        // After ASCII punctuation (a token of its own).
        assert_eq!(wp("aaaa.bbbbbbbb.cc", 6), "aaaa.bbbbbbbb.");
        // Multi-byte characters are never split.
        assert_eq!(wp("éééééé ü", 3), "éééééé");
        // The limit is a minimum: a boundary right at it counts.
        assert_eq!(wp("abc def", 3), "abc");
        // CJK ideographs are not boundaries unless the normaliser isolates them.
        assert_eq!(wp("中文中文中文", 4), "中文中文中文");
        let bert =
            Cuts { specials: vec!["[MASK]".into(), "[CLS]".into()], cjk: true, ..Cuts::default() };
        assert_eq!(word_prefix("中文中文中文", 4, &bert), "中文");
        assert_eq!(word_prefix("中文かな", 4, &bert), "中文かな");
        // After Unicode punctuation too (a kana line with its full stops).
        assert_eq!(wp("かなかな。かなかな。かな", 4), "かなかな。");
        assert_eq!(wp("aaaa«bb cc", 3), "aaaa«");
        // Never inside an added token: "[" is punctuation, "[MASK]" one token.
        assert_eq!(word_prefix("aaaa [MASK] bb", 6, &bert), "aaaa [MASK]");
        assert_eq!(word_prefix("aaaa [mask] bb", 6, &bert), "aaaa [mask]");
        assert_eq!(word_prefix("aaaa[MASK][CLS]x", 5, &bert), "aaaa[MASK]");
        assert_eq!(word_prefix("aaaa[MASK][CLS]x", 11, &bert), "aaaa[MASK][CLS]");
        assert_eq!(wp("aaaa [MASK] bb", 6), "aaaa [");
        // Another tokenizer's texts are never cut.
        let other = Cuts { whole: true, ..Cuts::default() };
        assert_eq!(word_prefix("aaaa bbbb cccc", 4, &other), "aaaa bbbb cccc");
    }

    /// Words longer than WordPiece's longest keep one letter more than that and lose the rest
    /// up to their end; marks and control characters do not count (the normaliser may remove
    /// them), whitespace, punctuation and CJK end a word, and added tokens are left whole.
    #[test]
    fn words_past_wordpieces_longest_are_shortened() {
        let cuts = Cuts { long_word: Some(4), cjk: true, ..Cuts::default() };
        let sh = |t: &str| shorten_long_words(t, &cuts).into_owned();
        assert_eq!(sh("ab abcde abcdefgh."), "ab abcde abcde.");
        assert_eq!(sh("かなかなかなかな。かな"), "かなかなか。かな");
        assert_eq!(sh("a\u{301}b\u{200b}cd\u{301}efg h"), "a\u{301}b\u{200b}cd\u{301}e h");
        assert_eq!(sh("abcdefg\u{a0}abcdefg"), "abcde\u{a0}abcde");
        assert_eq!(sh("abcdefg中abcdefg"), "abcde中abcde");
        assert_eq!(sh("abcdefg[MASK]x"), "abcde[MASK]x");
        assert_eq!(sh("😀😀😀😀😀😀😀"), "😀😀😀😀😀😀😀");
        // A character whose decomposition (BERT's NFD) holds punctuation ends a word too:
        // `≠` is `=` and a combining mark; the four such characters of Unicode.
        for c in ['\u{2260}', '\u{226e}', '\u{226f}', '\u{1fef}'] {
            assert_eq!(sh(&format!("abc{c}abcd")), format!("abc{c}abcd"), "{c:?}");
            assert_eq!(sh(&format!("abcdefg{c}abcdefg")), format!("abcde{c}abcde"), "{c:?}");
        }
        // A decomposable letter does not: `é` (e and a mark) counts as one letter of its word.
        assert_eq!(sh("\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}x"), "\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}");
        assert!(matches!(shorten_long_words("abc def", &cuts), std::borrow::Cow::Borrowed(_)));
        // Another model's words are never shortened.
        let plain = Cuts::default();
        assert_eq!(shorten_long_words("abcdefghij", &plain), "abcdefghij");
    }
}
