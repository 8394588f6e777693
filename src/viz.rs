//! Showing who attends to whom: per-sentence attention dumps, word-level aggregation,
//! a terminal heatmap, JSON Lines and a self-contained HTML view.

mod dump;
mod heatmap;
mod html;
mod words;

pub use dump::{AttentionDump, DumpSelection};
pub use heatmap::{render_heatmap, HeatmapStyle};
pub use html::{render_html, render_html_grouped};
pub use words::{word_groups, WordGroup};
