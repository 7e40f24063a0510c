"""One file per architecture family, each written once on the engine's two seams."""
