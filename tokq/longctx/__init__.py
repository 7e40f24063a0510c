"""Document loading, tokenized long windows, position buckets and retrieval probes."""
