//! Long lists of state_dict keys, shown by pattern: the same key in every layer once.

use std::collections::BTreeMap;

/// Lists up to this many keys one by one; longer lists are grouped.
const PLAIN: usize = 8;

/// `keys` as a message shows them: `["a", "b"]` when there are few; grouped when there are
/// many, each run of digits read as `*` and keys that differ only in their last segment
/// joined, with how many keys each group stands for:
/// `12 keys: "layers.*.ln_*.{bias,weight}" (×8), "head.{bias,weight}" (×2), ...`.
pub(crate) fn key_list(keys: &[String]) -> String {
    if keys.len() <= PLAIN {
        return format!("{keys:?}");
    }
    // pattern (digits as `*`, last segment cut) -> (last segments, how many keys)
    let mut groups: BTreeMap<String, (Vec<String>, usize)> = BTreeMap::new();
    for k in keys {
        let (stem, last) = match k.rsplit_once('.') {
            Some((s, l)) => (digits_as_star(s), l.to_string()),
            None => (String::new(), digits_as_star(k)),
        };
        let g = groups.entry(stem).or_default();
        if !g.0.contains(&last) {
            g.0.push(last);
        }
        g.1 += 1;
    }
    let shown: Vec<String> = groups
        .into_iter()
        .map(|(stem, (mut lasts, n))| {
            lasts.sort();
            let tail = if lasts.len() == 1 {
                lasts[0].clone()
            } else {
                format!("{{{}}}", lasts.join(","))
            };
            let pattern = if stem.is_empty() { tail } else { format!("{stem}.{tail}") };
            if n == 1 {
                format!("{pattern:?}")
            } else {
                format!("{pattern:?} (×{n})")
            }
        })
        .collect();
    format!("{} keys: {}", keys.len(), shown.join(", "))
}

/// `s` with every run of ASCII digits replaced by `*`.
fn digits_as_star(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_digits = false;
    for c in s.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('*');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_keys_are_listed_and_many_grouped_by_layer() {
        let few: Vec<String> = ["a.weight", "b.bias"].iter().map(|s| s.to_string()).collect();
        assert_eq!(key_list(&few), r#"["a.weight", "b.bias"]"#);
        let mut many = Vec::new();
        for layer in 0..2 {
            for part in ["ln_1", "ln_2", "mlp.0", "mlp.3"] {
                for p in ["weight", "bias"] {
                    many.push(format!("encoder.layers.encoder_layer_{layer}.{part}.{p}"));
                }
            }
        }
        many.push("heads.head.weight".into());
        assert_eq!(
            key_list(&many),
            "17 keys: \"encoder.layers.encoder_layer_*.ln_*.{bias,weight}\" (×8), \
             \"encoder.layers.encoder_layer_*.mlp.*.{bias,weight}\" (×8), \"heads.head.weight\""
        );
    }
}
