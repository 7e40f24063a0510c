"""CPU paths: linear.py (quantized GEMMs over native torch ops), native_linear.py (tokq's own compiled GEMVs for
decode, native/gemv.cpp, built at first use), attention.py (paged attention over torch ops) and native_attention.py
(tokq's own decode attention, native/attention.cpp); the registry decides when each runs."""
