//! The self-contained HTML view (head view and model view, no network).

use serde::Serialize;

use crate::error::{Error, Result};
use crate::viz::dump::AttentionDump;

const TEMPLATE: &str = include_str!("attention_view.html");
const DATA_SLOT: &str = "/*__ATTENTION_DATA__*/null";
const META_SLOT: &str = "/*__ATTENTION_META__*/null";

#[derive(Serialize)]
struct PageSentence<'a> {
    model: &'a str,
    text: &'a str,
    tokens: &'a [String],
    shape: [usize; 4],
    attentions: &'a [Vec<Vec<Vec<f32>>>],
    layer_ids: &'a [usize],
    head_ids: &'a [usize],
}

#[derive(Serialize)]
struct PageMeta<'a> {
    title: &'a str,
    words: bool,
    /// Query heads per key/value head (grouped-K/V decoders); 1 otherwise.
    kv_group: usize,
}

/// One HTML page showing every dump (a sentence selector when there are several).
pub fn render_html(dumps: &[AttentionDump], title: &str, words: bool) -> Result<String> {
    render_html_grouped(dumps, title, words, 1)
}

/// [`render_html`] for a model whose query heads share key/value heads `kv_group` at a
/// time: each group's heads side by side, behind a label that selects the group.
pub fn render_html_grouped(
    dumps: &[AttentionDump],
    title: &str,
    words: bool,
    kv_group: usize,
) -> Result<String> {
    let data: Vec<PageSentence> = dumps
        .iter()
        .map(|d| PageSentence {
            model: &d.model,
            text: &d.text,
            tokens: &d.tokens,
            shape: d.shape,
            attentions: &d.attentions,
            layer_ids: &d.layer_ids,
            head_ids: &d.head_ids,
        })
        .collect();
    let data = script_json(&data)?;
    let meta = script_json(&PageMeta {
        title,
        words,
        kv_group: kv_group.max(1),
    })?;
    Ok(TEMPLATE
        .replacen(DATA_SLOT, &data, 1)
        .replacen(META_SLOT, &meta, 1))
}

/// JSON safe to embed in a `<script>`: `<`, `>` and `&` become `\u003c`, `\u003e`,
/// `\u0026` (they can only occur inside JSON strings, where the escapes mean the same).
fn script_json<T: Serialize>(value: &T) -> Result<String> {
    let s = serde_json::to_string(value)
        .map_err(|e| Error::config(format!("cannot serialize the attention data: {e}")))?;
    Ok(s.replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_both_slots_and_escapes_script_tags() -> Result<()> {
        let dump = AttentionDump {
            model: "m".into(),
            text: "</script><b>".into(),
            tokens: vec!["</script>".into()],
            shape: [1, 1, 1, 1],
            attentions: vec![vec![vec![vec![1.0]]]],
            layer_ids: vec![0],
            head_ids: vec![0],
            explain: None,
        };
        let page = render_html(std::slice::from_ref(&dump), "t", false)?;
        assert!(!page.contains(DATA_SLOT) && !page.contains(META_SLOT));
        assert!(page.contains("\"kv_group\":1"));
        let grouped = render_html_grouped(&[dump], "t", false, 3)?;
        assert!(grouped.contains("\"kv_group\":3"));
        assert!(!page.contains("</script><b>"));
        assert!(page.contains("\\u003c/script\\u003e"));
        Ok(())
    }
}
