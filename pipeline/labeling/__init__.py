"""Labeling: the queue of active-learning samples (queue), answers, agreement and the terminal labeler."""
