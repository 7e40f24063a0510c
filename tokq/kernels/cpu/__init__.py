"""CPU paths: linear.py (quantized GEMMs over native torch ops), native_linear.py (tokq's own compiled GEMVs for
decode, native/gemv.cpp, built at first use) and attention.py (paged attention); the registry decides when each
runs."""
