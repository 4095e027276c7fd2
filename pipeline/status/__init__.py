"""Status: collect what the topics and the processes' metrics say, and render it."""
