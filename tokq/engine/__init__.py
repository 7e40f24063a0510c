"""tokq's model runtime: architectures, checkpoint loading, attention and linear seams."""
