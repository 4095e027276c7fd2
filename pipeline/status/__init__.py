"""Status: collect what the topics (collect) and the processes' metrics (live) say, and render it."""
