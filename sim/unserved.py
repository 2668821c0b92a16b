"""Requests not served as asked, announced: one stderr line per reason, with the count as a plain
integer, its share and the fix. The counts themselves are `unserved.<reason>` in metrics.json."""
from __future__ import annotations

REASONS = ("rejected_prompt_too_long", "truncated_prompt", "truncated_output",
           "skipped_malformed_records", "failed_in_trace", "unfinished")


def _what_and_fix(reason: str, max_model_len: int, model: str, allocator: str) -> tuple[str, str]:
    longer = "" if model.startswith("llama31") else ", use a long-context model (model=llama31_70b)"
    return {
        "rejected_prompt_too_long": (
            f"rejected: prompt longer than max_model_len={max_model_len}",
            f"raise max_model_len={longer} or set trace.on_overlength=truncate"),
        "truncated_prompt": (
            f"truncated: prompt longer than max_model_len={max_model_len}, kept its last "
            f"max_model_len - output tokens (trace.on_overlength=truncate)",
            f"raise max_model_len={longer} to keep whole prompts"),
        "truncated_output": (
            f"cut short: prompt + output reached max_model_len={max_model_len} before the output did",
            f"raise max_model_len={longer}"),
        "skipped_malformed_records": (
            "skipped: malformed trace records (trace.on_error=skip)",
            "repair the trace, or trace.on_error=raise to stop at the first bad record"),
        "failed_in_trace": (
            "left out: the trace marks them failed (zero response tokens)",
            "none needed, they failed when recorded"),
        "unfinished": (
            f"unfinished when the run with the {allocator} allocator ended",
            "report this: every admitted request should finish"),
    }[reason]


def unserved_lines(unserved: dict, num_requests: int, max_model_len: int, model: str,
                   allocator: str = "") -> list[str]:
    """One line per reason with a non-zero count."""
    lines = []
    for reason in REASONS:
        count = int(unserved.get(reason, 0))
        if not count:
            continue
        base = num_requests
        if reason in ("skipped_malformed_records", "failed_in_trace"):
            base += count  # these never became requests
        what, fix = _what_and_fix(reason, max_model_len, model, allocator)
        lines.append(f"warning: {count} of {base} requests ({count / base:.1%}) {what}; "
                     f"fix: {fix}")
    return lines


def unserved_warnings(results, cfg) -> list[str]:
    """Lines for every allocator's run; identical lines (the usual case) are said once."""
    seen, lines = set(), []
    for result in results:
        metrics = result.metrics
        base = metrics["num_requests"] + metrics["unserved"]["unfinished"]
        own = unserved_lines(metrics["unserved"], base, metrics["max_model_len"], cfg.model.name,
                             result.allocator)
        for line in own + client_lines(metrics):
            if line not in seen:
                seen.add(line)
                lines.append(line)
    return lines


def client_lines(metrics: dict) -> list[str]:
    """A benchmark client's cap on requests in flight: how many waited for it, and for how long."""
    client = metrics.get("client")
    if not client or not client["num_held_requests"]:
        return []
    held = client["num_held_requests"]
    return [f"note: {held} of {metrics['num_requests']} requests waited at the client for a free "
            f"slot (scenario.max_concurrency={client['max_concurrency']}), "
            f"{client['mean_held_s_per_held_request']:.3g} s each on average; their latencies count "
            f"from when they were sent, as vllm bench serve measures them"]
