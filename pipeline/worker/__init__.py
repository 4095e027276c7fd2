"""The worker: the join and the stream stages (outcomes, labels, drift) in one faust app."""
