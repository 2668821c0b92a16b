"""`python -m sim kv`: bytes per token and the cache an engine allocates, per layer kind."""
from __future__ import annotations

import sys

from sim.models import ModelSpec

GiB = 2**30


def _number(value: float):
    return int(value) if float(value).is_integer() else round(value, 3)


def _label(group) -> str:
    """A layer group in a few characters: compressed/4 (CSA), sliding:1024, chunked:8192."""
    if group.kind == "compressed":
        return f"compressed/{group.ratio}"
    return f"{group.kind}:{group.window}" if group.window else group.kind


def kv_report(model: ModelSpec, tokens: int, batch: int, block_size: int, tensor_parallel_size: int,
              kv_dtype: str, requested_dtype: str = "auto") -> dict:
    """What `python -m sim kv` prints: kv_bytes_per_token is what is stored per token of context
    at `tokens` (before block padding; the per-token slope at tokens=0), kv_cache_bytes what the
    engine allocates for `batch` sequences (whole blocks, padding layers and pages included)."""
    usage = model.kv_usage(tokens, batch, block_size, kv_dtype, tensor_parallel_size)
    engine_block = model.engine_block_size(block_size, kv_dtype, tensor_parallel_size)
    stored = sum(u.stored_bytes + u.indexer_bytes + u.window_bytes + u.state_bytes for u in usage)
    allocated = sum(u.allocated_bytes for u in usage)
    per_token = stored / (tokens * batch) if tokens else model.kv_bytes_per_token(kv_dtype)
    copies = model.kv_replication(tensor_parallel_size)
    notes = []
    if requested_dtype != "auto" and any(g.entry_bytes for g in model.layer_groups):
        notes.append(f"kv_cache_dtype={requested_dtype} leaves the layers with given entry bytes "
                     f"(the engine's own layout) as they are")
    if engine_block != block_size:
        notes.append(f"block_size raised from {block_size} to {engine_block} tokens so that an attention page holds "
                     f"a state layer's state, as vLLM does for models with Mamba layers")
    kinds = [{"kind": u.kind, "label": _label(group), "layers": u.layers, "entries_per_sequence": u.entries,
              "entry_bytes": _number(u.entry_bytes), "stored_bytes": _number(u.stored_bytes),
              "indexer_bytes": _number(u.indexer_bytes), "window_bytes": _number(u.window_bytes),
              "state_bytes": _number(u.state_bytes), "padding_bytes": _number(u.padding_bytes),
              "allocated_bytes": _number(u.allocated_bytes),
              "freed_tokens_per_sequence": u.freed_tokens, "window": group.window,
              "ratio": group.ratio}
             for u, group in zip(usage, model.layer_groups)]
    return {
        "model": model.name, "attention": model.attention, "kv_dtype": kv_dtype,
        "tokens": tokens, "batch": batch, "block_size": engine_block,
        "kv_bytes_per_token": _number(per_token), "kv_stored_bytes": _number(stored),
        "kv_cache_bytes": _number(allocated), "kv_cache_gib": round(allocated / GiB, 2),
        "kv_padding_bytes": _number(allocated - stored),
        "tensor_parallel_size": tensor_parallel_size,
        "kv_cache_bytes_stored_across_tp": int(allocated * copies),
        "kinds": kinds, "notes": notes, "source": model.source,
    }


def print_kv_report(report: dict) -> None:
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    kinds = report["kinds"]
    layers = ", ".join(f"{k['layers']} {k['label']}" for k in kinds)
    print(f"model: {report['model']} ({report['attention']}; layers: {layers}; {report['kv_dtype']})")
    print(f"kv_bytes_per_token: {report['kv_bytes_per_token']:,} (stored per token at "
          f"{report['tokens']:,} tokens, before block padding)")
    print(f"kv_cache: {report['kv_cache_bytes'] / GiB:.2f} GiB ({report['tokens']:,} tokens x "
          f"{report['batch']} sequences, {report['block_size']}-token blocks; padding "
          f"{report['kv_padding_bytes'] / GiB:.3f} GiB)")
    if len(kinds) > 1 or kinds[0]["kind"] not in ("full", "mla"):
        states = any(k["kind"] == "state" for k in kinds)
        print(f"{'kind':<16}{'layers':>7}{'entries/seq':>13}{'B/entry':>9}{'stored GiB':>12}"
              f"{'indexer':>9}{'window':>9}{'state' if states else '':>9}{'padding':>9}{'freed tok/seq':>15}")
        for k in kinds:
            state = f"{k['state_bytes'] / GiB:>9.3f}" if states else f"{'':>9}"
            print(f"{k['label']:<16}{k['layers']:>7}{k['entries_per_sequence']:>13,}{k['entry_bytes']:>9}"
                  f"{k['stored_bytes'] / GiB:>12.3f}{k['indexer_bytes'] / GiB:>9.3f}"
                  f"{k['window_bytes'] / GiB:>9.3f}{state}{k['padding_bytes'] / GiB:>9.3f}"
                  f"{k['freed_tokens_per_sequence']:>15,}")
    if report["tensor_parallel_size"] > 1:
        print(f"stored across tensor_parallel_size={report['tensor_parallel_size']}: "
              f"{report['kv_cache_bytes_stored_across_tp'] / GiB:.2f} GiB")


def print_kv_compare(reports: list[dict]) -> None:
    for report in reports:
        for note in report["notes"]:
            print(f"note: {report['model']}: {note}", file=sys.stderr)
    first = reports[0]
    sizes = sorted({r["block_size"] for r in reports})
    blocks = (f"{sizes[0]}-token blocks" if len(sizes) == 1 else
              "blocks of " + ", ".join(f"{r['block_size']} ({r['model']})" for r in reports) + " tokens")
    print(f"{first['tokens']:,} tokens x {first['batch']} sequences, {blocks}")
    print(f"{'model':<22}{'layers':<52}{'kv_dtype':>9}{'B/token':>12}{'cache GiB':>11}{'vs first':>10}")
    for r in reports:
        kinds = " + ".join(f"{k['layers']} {k['label']}" for k in r["kinds"])
        ratio = r["kv_bytes_per_token"] / first["kv_bytes_per_token"] if first["kv_bytes_per_token"] else 0
        print(f"{r['model']:<22}{kinds:<52}{r['kv_dtype']:>9}{r['kv_bytes_per_token']:>12,.1f}"
              f"{r['kv_cache_bytes'] / GiB:>11.2f}{ratio:>10.1%}")
