#!/usr/bin/env python3
"""The numbers of docs/benchmarks.md, "Byte-level BPE against bytes on the README demo", from
the runs of bench/bpe_demo.sh (run it after them; it runs `tessel eval` once per run).
  TESSEL_BIN=build/wt/tessel bench/bpe_demo_report.py runs/bpe-v256 runs/bpe-v1024 ...
The first run is the byte-level baseline. Checks that every run's val.tok decodes to the same
documents, byte for byte, as the baseline's; then per run: the loss of the run's validation
(train.eval_sequences windows from val.tok's start) and of `tessel eval --sequences 0` (every
window), each in nats/token and bits per byte. A shard of N tokens has W = (N - 1) // T windows;
n of them predict tokens 1 .. n*T except each document's first token (data.attention_mask =
causal_document masks the target across a document boundary; checked against eval's
loss_tokens), so bits per byte = loss * targets / bytes / ln 2 with bytes = the decoded length
of those targets (an <|endoftext|> would count 0 bytes; bible has none)."""
import array, json, math, os, re, statistics, struct, subprocess, sys

def read_shard(path):  # layout: src/tessel/data/shard.hpp (little-endian host assumed)
    raw = open(path, "rb").read()
    _, _, code, _, _, n, d, index_offset = struct.unpack_from("<8sIIIIQQQ", raw, 0)
    tokens = array.array({1: "B", 2: "H", 3: "i"}[code])
    tokens.frombytes(raw[64:64 + n * tokens.itemsize])
    return list(tokens), list(struct.unpack_from(f"<{d}Q", raw, index_offset))

def gpt2_byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
         list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return {chr(c): b for b, c in zip(bs, cs)}

def token_bytes(data_dir):  # id -> bytes; byte-level data sets have no vocab.json
    if not os.path.exists(f"{data_dir}/vocab.json"):
        return {i: bytes([i]) for i in range(256)}
    dec = gpt2_byte_decoder()
    vocab = json.load(open(f"{data_dir}/vocab.json", encoding="utf-8"))
    return {i: b"" if s == "<|endoftext|>" else bytes(dec[c] for c in s) for s, i in vocab.items()}

def config_value(run, key):
    m = re.search(rf"^{key} = '?([^'\n]*)'?$", open(f"{run}/config.toml").read(), re.M)
    return m.group(1)

runs = sys.argv[1:]
usage = ("usage: bench/bpe_demo_report.py RUN_DIR [RUN_DIR ...] (runs of bench/bpe_demo.sh, "
         "the byte-level baseline first; each holds a config.toml)")
if any(a in ("-h", "--help") for a in runs):
    print(usage)
    sys.exit(0)
if not runs or not all(os.path.isfile(f"{r}/config.toml") for r in runs):
    sys.exit(usage)
binary = os.environ.get("TESSEL_BIN", "build/release/tessel")
rows, base_docs = [], None
for run in runs:
    data = config_value(run, "path")
    T, n_eval = int(config_value(run, "seq_len")), int(config_value(run, "eval_sequences"))
    tok, index = read_shard(f"{data}/val.tok")
    tb = token_bytes(data)
    docs = [b"".join(tb[t] for t in tok[a:b]) for a, b in zip(index, index[1:] + [len(tok)])]
    if base_docs is None:
        base_docs = docs
    lens = [len(tb[t]) for t in tok]
    W = (len(tok) - 1) // T
    n = min(n_eval, W)
    ds = json.load(open(f"{data}/dataset.json"))
    # the byte-level baseline's train tokens are the train set's bytes
    train_bytes = json.load(open(f"{config_value(runs[0], 'path')}/dataset.json"))["train"]["tokens"]
    metrics = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    steps = [m for m in metrics if "tokens_per_s" in m]
    vals = [m for m in metrics if "val_loss" in m]
    def evaluate(*extra):
        return json.loads(subprocess.run([binary, "eval", "--run", run, "--json", *extra],
                                         check=True, capture_output=True, text=True).stdout)
    ev_run, ev = evaluate(), evaluate("--sequences", "0")
    starts = set(index[1:])
    def targets(windows):  # (count, bytes) of the loss targets of the first `windows` windows
        ts = [i for i in range(1, windows * T + 1) if i not in starts]
        return len(ts), sum(lens[i] for i in ts)
    (run_targets, run_bytes), (all_targets, all_bytes) = targets(n), targets(W)
    assert run_targets == ev_run["loss_tokens"] and all_targets == ev["loss_tokens"], (run_targets, ev_run, all_targets, ev)
    assert abs(ev_run["loss"] - vals[-1]["val_loss"]) < 1e-4, (ev_run, vals[-1])
    bpt_train = train_bytes / ds["train"]["tokens"]
    tps = statistics.median(m["tokens_per_s"] for m in steps)
    cum, t = {}, 0.0
    for m in steps:
        t += m["step_seconds"]; cum[m["step"]] = t
    print(f"== {run}: data {data}, vocab {config_value(run, 'vocab')}")
    print(f"  val.tok: {len(tok)} tokens, {len(docs)} documents (dataset.json: "
          f"{ds['val']['documents']} / {ds['val']['tokens']}), decoded {sum(lens)} bytes, "
          f"same documents as {runs[0]}: {docs == base_docs}")
    print(f"  run's validation: {n} of {W} windows, {run_targets} targets = {run_bytes} bytes; "
          f"final val_loss {vals[-1]['val_loss']:.4f} nats/token (eval: {ev_run['loss']:.4f}) = "
          f"{vals[-1]['val_loss'] * run_targets / run_bytes / math.log(2):.4f} bits/byte")
    print(f"  eval --sequences 0: {json.dumps(ev)}")
    loss_all = ev["loss"]
    print(f"  whole val set: {W} windows, {all_targets} targets = {all_bytes} bytes; "
          f"{loss_all:.4f} nats/token = {loss_all * all_targets / all_bytes / math.log(2):.4f} bits/byte")
    print(f"  train set: {ds['train']['tokens']} tokens, {bpt_train:.4f} bytes/token; "
          f"median {tps:.0f} tokens/s = {tps * bpt_train:.0f} bytes/s over {len(steps)} steps; "
          f"sum of step_seconds {t:.1f} s")
    for v in vals:
        print(f"    step {v['step']:4d}  training time {cum[v['step']]:6.1f} s  val_loss "
              f"{v['val_loss']:.4f}  = {v['val_loss'] * run_targets / run_bytes / math.log(2):.4f} bits/byte "
              f"(run's windows)")
