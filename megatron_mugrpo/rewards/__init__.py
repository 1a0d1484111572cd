"""Rewards that need more than a string comparison; today the sandbox that runs model-written programs."""
