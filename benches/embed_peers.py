#!/usr/bin/env python3
"""The peers of examples/embed.rs for issue 23: all-MiniLM-L6-v2 sentence embeddings of a
corpus, one peer per process, one JSON line on stdout.

    .venv/bin/python benches/embed_peers.py --impl st  [--file benches/data/corpus.txt] [--threads 2]
    .venv/bin/python benches/embed_peers.py --impl ort [--file ...] [--threads 2] [--ort-graph optimized]
    .venv/bin/python benches/embed_peers.py --impl ort --prepare      # export only, no timing
    .venv/bin/python benches/embed_peers.py --impl st --check st.npy  # also save the embeddings
    .venv/bin/python benches/embed_peers.py --compare st.npy ort.npy  # cosine of each pair

Both peers embed the same weights (weights/: float16 safetensors, computed in float32), mean
pooling over the real tokens, L2 normalisation, batches of --batch-size (32) sentences sorted
by length and padded per batch, truncation at sentence-transformers' max_seq_length (256; the
committed corpus stays below 200 tokens, so nothing is cut).

* st: sentence-transformers SentenceTransformer(weights/) on torch (the directory already is
  a sentence-transformers model: modules.json, 1_Pooling/, Normalize), then
  encode(sentences, batch_size=32, normalize_embeddings=True). dtype float32.
* ort: ONNX Runtime (CPUExecutionProvider) on the BertModel exported with torch.onnx, inputs
  tokenized with `tokenizers` (weights/tokenizer.json), pooling and normalisation in numpy,
  results put back in input order. The export is cached under
  ~/.cache/candle-attention/onnx/ (re-made when missing or when weights/model.safetensors
  changes); --ort-graph optimized (default) also runs onnxruntime.transformers' BERT fusion
  (attention, skip-layer-norm, GELU) offline, plain leaves ORT's own online optimiser
  (ORT_ENABLE_ALL) alone. The ORT run imports no torch.

Threads: --threads N sets OMP/MKL/OpenBLAS/Rayon thread counts (before any import),
torch.set_num_threads(N) for st, intra_op_num_threads=N and inter_op_num_threads=1 for ort.

JSON: impl, sentences, tokens (WordPiece tokens incl. [CLS]/[SEP], no padding), seconds (wall
time of the whole encode, tokenization included), sentences_per_s (sentences / seconds),
load_s (model load after imports), import_s (the Python imports), peak_rss_mb (ru_maxrss of
the process, MiB), threads, batch_size, versions. The whole-process wall time, interpreter
start-up included, is measured outside by benches/embed_throughput.sh.
"""
import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "candle-attention" / "onnx"
MAX_SEQ = 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["st", "ort"])
    p.add_argument("--file", default=str(ROOT / "benches/data/corpus.txt"))
    p.add_argument("--model", default=str(ROOT / "weights"), help="sentence-transformers model directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ort-graph", choices=["optimized", "plain"], default="optimized")
    p.add_argument("--check", metavar="OUT.npy", help="save the embeddings (float32, input order)")
    p.add_argument("--prepare", action="store_true", help="ort: export (if needed) and exit")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="cosine of each pair of rows of two .npy (or examples/embed --format json) files")
    a = p.parse_args()
    if not a.compare and not a.impl:
        p.error("--impl st|ort (or --compare A B)")
    return a


def set_thread_env(n):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS",
                "RAYON_RS_NUM_CPUS"):
        os.environ[var] = str(n)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def read_sentences(path):
    # Like examples/embed.rs --file: one sentence per line, blank lines skipped.
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def versions(*names):
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": sys.version.split()[0]}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


# ---------------------------------------------------------------- sentence-transformers
def run_st(a, sentences):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(a.threads)
    t_import = time.perf_counter()
    model = SentenceTransformer(a.model, device="cpu", local_files_only=True,
                                model_kwargs={"dtype": torch.float32})
    model.eval()
    assert model.max_seq_length == MAX_SEQ, model.max_seq_length
    t_load = time.perf_counter()
    with torch.inference_mode():
        emb = model.encode(sentences, batch_size=a.batch_size, normalize_embeddings=True,
                           convert_to_numpy=True, show_progress_bar=False)
    t_end = time.perf_counter()
    return emb, t_import, t_load, t_end, versions("sentence-transformers", "torch", "transformers",
                                                  "tokenizers", "numpy")


# ---------------------------------------------------------------- ONNX Runtime
def onnx_paths(model_dir):
    st = (Path(model_dir) / "model.safetensors").stat()
    key = f"{st.st_size}-{st.st_mtime_ns}"
    stem = "all-MiniLM-L6-v2-f32"
    return CACHE / f"{stem}.onnx", CACHE / f"{stem}.opt.onnx", CACHE / f"{stem}.key", key


def export_onnx(model_dir):
    """Exports BertModel (float32) to ONNX once; returns (plain, optimized) paths."""
    plain, opt, keyfile, key = onnx_paths(model_dir)
    if plain.exists() and opt.exists() and keyfile.exists() and keyfile.read_text() == key:
        return plain, opt
    import torch
    from transformers import AutoModel

    CACHE.mkdir(parents=True, exist_ok=True)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True,
                                      attn_implementation="eager").eval()  # fusable by ORT

    class Hidden(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones(2, 16, dtype=torch.int64)
    args = (ids, torch.ones_like(ids), torch.zeros_like(ids))
    names = ["input_ids", "attention_mask", "token_type_ids"]
    tmp = plain.with_suffix(".tmp.onnx")
    print(f"exporting {model_dir} to {plain} (torch {torch.__version__})", file=sys.stderr)
    torch.onnx.export(Hidden(model), args, str(tmp), input_names=names,
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in names}
                      | {"last_hidden_state": {0: "batch", 1: "seq"}})
    tmp.replace(plain)

    from onnxruntime.transformers.optimizer import optimize_model
    cfg = model.config
    fused = optimize_model(str(plain), model_type="bert", num_heads=cfg.num_attention_heads,
                           hidden_size=cfg.hidden_size, opt_level=1)
    print(f"fused operators: {fused.get_fused_operator_statistics()}", file=sys.stderr)
    fused.save_model_to_file(str(opt))
    keyfile.write_text(key)
    return plain, opt


def run_ort(a, sentences):
    import numpy as np
    import onnxruntime as ort
    from tokenizers import Tokenizer

    t_import = time.perf_counter()
    plain, opt = export_onnx(a.model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    path = opt if a.ort_graph == "optimized" else plain
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in sess.get_inputs()}
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_SEQ)
    t_load = time.perf_counter()

    encs = tok.encode_batch(sentences)
    order = sorted(range(len(encs)), key=lambda i: -len(encs[i].ids))  # longest first, like ST
    out = np.empty((len(encs), 0), dtype=np.float32)
    for s in range(0, len(order), a.batch_size):
        idx = order[s:s + a.batch_size]
        width = max(len(encs[i].ids) for i in idx)
        ids = np.zeros((len(idx), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for r, i in enumerate(idx):
            e = encs[i].ids
            ids[r, :len(e)] = e
            mask[r, :len(e)] = 1
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        (hidden,) = sess.run(None, {k: v for k, v in feed.items() if k in inputs})
        m = mask[:, :, None].astype(np.float32)
        pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
        pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        if out.shape[1] == 0:
            out = np.empty((len(encs), pooled.shape[1]), dtype=np.float32)
        out[idx] = pooled
    t_end = time.perf_counter()
    v = versions("onnxruntime", "onnx", "tokenizers", "numpy")
    v["onnx_graph"] = f"{a.ort_graph} ({path.name})"
    return out, t_import, t_load, t_end, v


# ---------------------------------------------------------------- checks
def load_embeddings(path):
    import numpy as np
    if path.endswith(".npy"):
        return np.load(path)
    with open(path, encoding="utf-8") as f:  # examples/embed --format json: one object a line
        return np.array([json.loads(line)["embedding"] for line in f if line.strip()], dtype=np.float32)


def compare(a_path, b_path):
    import numpy as np
    a, b = load_embeddings(a_path), load_embeddings(b_path)
    if a.shape != b.shape:
        sys.exit(f"shapes differ: {a_path} {a.shape}, {b_path} {b.shape}")
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    worst = int(cos.argmin())
    print(json.dumps({"a": a_path, "b": b_path, "rows": len(cos), "min_cosine": float(cos.min()),
                      "mean_cosine": float(cos.mean()), "worst_row": worst,
                      "max_abs_diff": float(np.abs(a - b).max()),
                      "ok_0.99999": bool(cos.min() >= 0.99999)}))
    return cos.min() >= 0.99999


def main():
    a = parse_args()
    set_thread_env(a.threads if a.impl else 1)
    if a.compare:
        sys.exit(0 if compare(*a.compare) else 1)
    if a.prepare:
        if a.impl == "ort":
            print("\n".join(map(str, export_onnx(a.model))))
        return
    sentences = read_sentences(a.file)
    emb, t_import, t_load, t_end, vers = (run_st if a.impl == "st" else run_ort)(a, sentences)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the extras below
    from tokenizers import Tokenizer  # token count for the record, outside the timings
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_SEQ)
    tokens = sum(len(e.ids) for e in tok.encode_batch(sentences))
    if a.check:
        import numpy as np
        np.save(a.check, np.asarray(emb, dtype=np.float32))
    seconds = t_end - t_load
    print(json.dumps({
        "impl": a.impl, "sentences": len(sentences), "tokens": tokens, "dim": int(emb.shape[1]),
        "seconds": round(seconds, 4), "sentences_per_s": round(len(sentences) / seconds, 2),
        "load_s": round(t_load - t_import, 4), "import_s": round(t_import - T0, 4),
        "peak_rss_mb": round(rss_mb, 1),
        "threads": a.threads, "batch_size": a.batch_size, "versions": vers}))


if __name__ == "__main__":
    main()
