"""kvsim: a discrete-event simulator of LLM-serving clusters whose subject is the KV cache."""
