"""Recipes: one readable script per way of fine-tuning, and their configs."""
