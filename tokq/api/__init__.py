"""tokq's Python API: quantize, compare, bench and gate as functions returning result objects (the CLI's commands
parse their options, call these and print). Import from `tokq` itself: `tokq.quantize(...)`."""
