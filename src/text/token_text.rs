//! Each token's text as the tokenizer decodes it, for a person to read: ` capital`, not the
//! vocabulary's `Ġcapital` or `▁capital`; the pieces concatenate to the decoded text.

use crate::error::Result;

/// Piece `i` is what decoding the first `i + 1` ids adds to decoding the first `i` (special
/// tokens kept), cut where the decoding of all `n` ids agrees with it, so that the pieces
/// concatenate to exactly `decode(n)`. `decode(k)`: the text of the first `k` ids. A token
/// that adds no whole character on its own (one byte of a multi-byte character, split by
/// byte-level BPE or a byte-fallback piece) gets an empty piece, and the token completing
/// the character carries it; so do tokens whose text a later token rewrites (a decoder's
/// clean-up of spaces before punctuation).
pub(crate) fn token_texts(
    n: usize,
    decode: impl Fn(usize) -> Result<String>,
) -> Result<Vec<String>> {
    let full = decode(n)?;
    let mut pieces = Vec::with_capacity(n);
    let mut cut = 0;
    for i in 0..n {
        let prefix = if i + 1 == n {
            full.clone()
        } else {
            decode(i + 1)?
        };
        let agree = common_prefix(&prefix, &full).max(cut);
        pieces.push(full[cut..agree].to_string());
        cut = agree;
    }
    if let Some(last) = pieces.last_mut() {
        last.push_str(&full[cut..]);
    }
    Ok(pieces)
}

/// The length in bytes of the longest common prefix of `a` and `b` that ends on a character
/// boundary of both.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

/// A token's label for a person: its decoded text with line breaks and tabs written as
/// `\n`, `\r`, `\t` (a leading space kept), or the vocabulary's string where the text is
/// empty (a byte piece, shown as what it is).
pub fn display_label(text: &str, token: &str) -> String {
    if text.is_empty() {
        return token.to_string();
    }
    text.replace('\n', "\\n")
        .replace('\r', "\\r")
        .replace('\t', "\\t")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces from a decoder given as the text of each prefix: appended text becomes pieces,
    /// a character completed later goes to the token that completes it, a rewrite of earlier
    /// text moves to the rewriting token, and the pieces always concatenate to the whole.
    #[test]
    fn pieces_concatenate_to_the_decoded_text() -> Result<()> {
        let cases: [(&[&str], &[&str]); 4] = [
            (
                &["[CLS]", "[CLS] the", "[CLS] the cat"],
                &["[CLS]", " the", " cat"],
            ),
            // Two tokens of one character: the first decodes to U+FFFD alone, so it keeps
            // only the space before it, and the second carries the character.
            (
                &["The", "The \u{FFFD}", "The é", "The é!"],
                &["The", " ", "é", "!"],
            ),
            // A clean-up that removes a space once the next token arrives.
            (&["didn", "didn '", "didn't"], &["didn", "", "'t"]),
            (&["", "", "x"], &["", "", "x"]),
        ];
        for (prefixes, want) in cases {
            let got = token_texts(prefixes.len(), |k| Ok(prefixes[k - 1].to_string()))?;
            assert_eq!(got, want, "{prefixes:?}");
            assert_eq!(got.concat(), prefixes[prefixes.len() - 1]);
        }
        Ok(())
    }

    #[test]
    fn labels_show_text_or_the_piece() {
        assert_eq!(display_label(" capital", "Ġcapital"), " capital");
        assert_eq!(display_label("", "<0xE6>"), "<0xE6>");
        assert_eq!(display_label("\n\t", "ĊĉC"), "\\n\\t");
    }
}
