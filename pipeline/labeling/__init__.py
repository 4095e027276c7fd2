"""Labeling: the queue of active-learning samples, answers, agreement and the terminal labeler."""
