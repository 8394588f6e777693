//! Showing who attends to whom: per-sentence attention dumps, word-level aggregation,
//! a terminal heatmap, JSON Lines and a self-contained HTML view; explanations beside the
//! raw weights ([`explain`]: rollout, gradient relevance, value norms).

mod dump;
pub mod explain;
mod heatmap;
mod html;
mod svg;
mod words;

pub use crate::text::display_label;
pub use dump::{AttentionDump, DumpSelection};
pub use explain::{ranking, ExplainMethod, Explanation, GradTarget};
pub use heatmap::{render_heatmap, render_top_keys, HeatmapStyle, HEATMAP_MAX_TOKENS};
pub use html::{render_html, render_html_grouped};
pub use svg::render_svg;
pub use words::{word_groups, WordGroup};
