"""What a memory is to an intent in the simulator's ground truth (shared by the simulator and its text bank)."""

HELPFUL, HARMFUL, IRRELEVANT = 1, -1, 0
