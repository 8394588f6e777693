//! Parameter and FLOP accounting of an attention layer (what the benchmarks divide by).

/// Parameters and forward floating-point operations of one attention call (a multiply-add
/// counts as 2 FLOPs; softmax, bias and mask work is not counted).
///
/// For the standard layer (`heads == kv_heads`, `head_dim = hidden / heads`, with `W_O`)
/// over `T = seq` tokens of width `d = hidden`, per batch row:
/// projections `6 T d^2`, scores and weighted values `4 T^2 d`, `W_O` `2 T d^2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionCost {
    /// Weights and biases of the Q, K, V and output projections.
    pub parameters: u64,
    /// `x W_Q^T`, `x W_K^T`, `x W_V^T`: `2 * batch * seq * hidden * (q + k + v outputs)`.
    pub projection_flops: u64,
    /// `Q K^T` and `P V` over the (query, key) pairs a query can see:
    /// `2 * batch * heads * pairs * (d_k + d_v)`; `pairs = seq_q * seq_k` without a causal
    /// mask, `seq (seq + 1) / 2` with one (the blocks above the diagonal are never computed).
    pub attention_flops: u64,
    /// `context W_O^T`: `2 * batch * seq * (heads * d_v) * out`.
    pub output_flops: u64,
}

impl AttentionCost {
    /// All forward FLOPs.
    pub fn flops(&self) -> u64 {
        self.projection_flops + self.attention_flops + self.output_flops
    }
}

/// The sizes of a layer's heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeadDims {
    /// Width of the query input.
    pub hidden: usize,
    /// Width of the key/value input (cross-attention with PyTorch's `kdim`/`vdim`).
    pub kv_hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub v_head_dim: usize,
}

/// The sizes of a layer, enough to count its cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerDims {
    pub head: HeadDims,
    /// Output width of `W_O`, `None` without an output projection.
    pub out: Option<usize>,
    /// Biased projections (parameters only).
    pub bias: bool,
}

/// (query, key) pairs a causal mask with `offset` cached keys leaves visible.
pub(crate) fn causal_pairs(seq_q: usize, seq_k: usize, offset: usize) -> u64 {
    (0..seq_q).map(|i| (offset + i + 1).min(seq_k) as u64).sum()
}

pub(crate) fn layer_cost(
    dims: &LayerDims,
    batch: usize,
    seq_q: usize,
    seq_k: usize,
    causal: bool,
) -> AttentionCost {
    let u = |x: usize| x as u64;
    let (out, bias) = (dims.out, dims.bias);
    let dims = &dims.head;
    let q_out = u(dims.heads * dims.head_dim);
    let k_out = u(dims.kv_heads * dims.head_dim);
    let v_out = u(dims.kv_heads * dims.v_head_dim);
    let ctx = u(dims.heads * dims.v_head_dim);
    let out = out.map(u).unwrap_or(0);
    let bias = |n: u64| if bias { n } else { 0 };
    let parameters = q_out * u(dims.hidden)
        + (k_out + v_out) * u(dims.kv_hidden)
        + bias(q_out + k_out + v_out)
        + out * ctx
        + bias(out);
    let pairs = if causal {
        causal_pairs(seq_q, seq_k, seq_k.saturating_sub(seq_q))
    } else {
        u(seq_q) * u(seq_k)
    };
    let b = u(batch);
    AttentionCost {
        parameters,
        projection_flops: 2
            * b
            * (u(seq_q) * u(dims.hidden) * q_out + u(seq_k) * u(dims.kv_hidden) * (k_out + v_out)),
        attention_flops: 2 * b * u(dims.heads) * pairs * u(dims.head_dim + dims.v_head_dim),
        output_flops: 2 * b * u(seq_q) * ctx * out,
    }
}

/// Cost of the standard multi-head self-attention layer (`nn.MultiheadAttention`, BERT):
/// Q/K/V/O projections with biases, `head_dim = hidden / heads`, `kv_heads` key/value heads
/// (`kv_heads == heads` without grouping), over `seq` tokens.
///
/// `self_attention_cost(1, t, d, h, h, false).flops() == 6 t d^2 + 4 t^2 d + 2 t d^2`.
pub fn self_attention_cost(
    batch: usize,
    seq: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    causal: bool,
) -> AttentionCost {
    let head_dim = hidden / heads.max(1);
    let dims = LayerDims {
        head: HeadDims {
            hidden,
            kv_hidden: hidden,
            heads,
            kv_heads,
            head_dim,
            v_head_dim: head_dim,
        },
        out: Some(hidden),
        bias: true,
    };
    layer_cost(&dims, batch, seq, seq, causal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_layer_matches_the_textbook_formula() {
        let (t, d) = (128u64, 768u64);
        let c = self_attention_cost(1, 128, 768, 12, 12, false);
        assert_eq!(c.projection_flops, 6 * t * d * d);
        assert_eq!(c.attention_flops, 4 * t * t * d);
        assert_eq!(c.output_flops, 2 * t * d * d);
        assert_eq!(c.parameters, 4 * d * d + 4 * d);
        let b2 = self_attention_cost(2, 128, 768, 12, 12, false);
        assert_eq!(b2.flops(), 2 * c.flops());
    }

    #[test]
    fn causal_counts_the_lower_triangle() {
        assert_eq!(causal_pairs(4, 4, 0), 1 + 2 + 3 + 4);
        assert_eq!(causal_pairs(2, 5, 3), 4 + 5);
        let c = self_attention_cost(1, 4, 8, 2, 2, true);
        assert_eq!(c.attention_flops, 2 * 2 * 10 * 8);
    }

    #[test]
    fn grouped_heads_have_smaller_k_and_v() {
        let c = self_attention_cost(1, 10, 64, 8, 2, false);
        // q 64 outputs, k and v 16 each, W_O 64 x 64.
        assert_eq!(
            c.parameters,
            64 * 64 + 2 * 16 * 64 + (64 + 32) + 64 * 64 + 64
        );
        assert_eq!(c.projection_flops, 2 * 10 * 64 * 96);
    }
}
