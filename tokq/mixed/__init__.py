"""Mixed precision: how much each decoder Linear's format costs in quality (sensitivity), and which format
each Linear gets under a size or quality budget (knapsack, search, splits)."""
