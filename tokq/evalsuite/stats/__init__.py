"""Paired statistics for A/B comparisons: per-document, per-position-bucket and overall estimates with CIs.

- `estimate`: `Estimate`, one statistic with its confidence interval, and the few-documents warning;
- `bootstrap`: token-weighted means with a studentized interval from a paired document (cluster) bootstrap;
- `quantiles`: quantiles of the per-token values (the KL tail) with percentile intervals from the same resampling;
- `exact`: exact binomial tests over probes (Clopper-Pearson intervals, McNemar's test);
- `aggregation`: the position buckets and the overall / per-bucket / per-document table of `tokq compare`;
- `thresholds`: gate thresholds checked against the unfavourable end of an interval.
"""
