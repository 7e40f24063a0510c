"""tokq: quantize LLMs, run them on tokq's own engine, gate releases on speed and long-document quality."""

__version__ = "0.1.0"
