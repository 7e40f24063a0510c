"""CPU paths over native torch ops (no compiled code of tokq's own): linear.py (quantized GEMMs) and
attention.py (paged attention); the registry decides when each runs."""
