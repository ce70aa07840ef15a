"""Trained drafting heads: EAGLE, EAGLE-3 and Medusa networks over a target's features, and their exports."""
