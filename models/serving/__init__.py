"""How a policy is served: the serving rule (:mod:`models.serving.rule`, pinned by contract vectors)
and its parameters (:mod:`models.serving.params`)."""
