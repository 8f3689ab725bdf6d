"""Prefill context parallelism: the split of a step's prefills over the PCP ranks
(:mod:`.partition`, pure) and the step's two collectives (:mod:`.exchange`)."""
