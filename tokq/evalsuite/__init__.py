"""A/B quality metrics, paired statistics and the gate rules."""
