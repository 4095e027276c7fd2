"""Off-policy evaluation: the logged decisions of a retrieval log and the estimators that judge a
policy on them (IPS, SNIPS, DR, slate and set-level), policies as served, the reward model, and the
canary's on-policy statistics."""
