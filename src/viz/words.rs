//! Grouping word pieces back into words.

use std::ops::Range;

use crate::text::EncodedText;

/// Consecutive tokens that form one word (or one special token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WordGroup {
    /// Token positions of the word.
    pub tokens: Range<usize>,
    /// The word as written in the text (special tokens keep their token string).
    pub label: String,
}

/// Groups an encoding's tokens into words: consecutive tokens with the same word id and
/// segment form one word; special tokens stand alone.
pub fn word_groups(item: &EncodedText) -> Vec<WordGroup> {
    let mut groups: Vec<WordGroup> = Vec::new();
    let mut prev: Option<(u32, u32)> = None;
    for i in 0..item.len() {
        let key = item.word_ids[i].map(|w| (item.type_ids.get(i).copied().unwrap_or(0), w));
        let special = item.special.get(i).copied().unwrap_or(false);
        match (key, prev) {
            (Some(k), Some(p)) if !special && k == p => {
                if let Some(last) = groups.last_mut() {
                    last.tokens.end = i + 1;
                }
            }
            _ => groups.push(WordGroup {
                tokens: i..i + 1,
                label: String::new(),
            }),
        }
        prev = if special { None } else { key };
    }
    for g in &mut groups {
        let start = item.offsets[g.tokens.start].0;
        let end = item.offsets[g.tokens.end - 1].1;
        let is_special = item.special.get(g.tokens.start).copied().unwrap_or(false);
        g.label = match item.text.get(start..end) {
            // Offsets of a pair's second segment refer to the second text; fall back to
            // the joined pieces there and for special tokens.
            Some(s) if !is_special && end > start && item.type_ids[g.tokens.start] == 0 => {
                s.to_string()
            }
            _ => item.tokens[g.tokens.clone()]
                .iter()
                .map(|t| t.trim_start_matches("##"))
                .collect::<String>(),
        };
    }
    groups
}

/// `m` `(seq, seq)` over words: a word's value as a key is the sum over its pieces, as a
/// query the mean over its pieces, `W[I][J] = mean_{i in I} sum_{j in J} A[i][j]`.
pub(crate) fn aggregate(m: &[Vec<f32>], groups: &[WordGroup]) -> Vec<Vec<f32>> {
    groups
        .iter()
        .map(|gi| {
            groups
                .iter()
                .map(|gj| {
                    let sum: f32 = gi
                        .tokens
                        .clone()
                        .map(|i| gj.tokens.clone().map(|j| m[i][j]).sum::<f32>())
                        .sum();
                    sum / gi.tokens.len() as f32
                })
                .collect()
        })
        .collect()
}
